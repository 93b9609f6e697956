"""The schedule's shapes against the per-sequence oracle: chains as causal rows (sequences ending inside them), shared
rows (subtrees side by side, attended span by span), fused runs of single-child segments (kept, split at
`max_batch_tokens`, recomputed in blocks that cross segment ends), on attention models and on a hybrid (recurrent
states carried across a fused run and along a chain row).

Each case first asserts that the engine's op stream really has the shape it is named for (so that a change of the
cost model cannot quietly turn the test into another one), then compares in float64 to 1e-10 (`test_engine.check`),
and in float32 and under TRL's bf16 autocast against the dense path's own error (`bounds.py`).
"""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, float64_twin, make_model
from hybrid_models import PRIMARY, float64_internals, make_hybrid
from reference import compare_grads, compare_lists, dense_forward_backward, grads_of
from test_engine import TOL, check, nonlinear_loss
from test_precision import BF16, OFF, _assert_as_precise
from test_precision import loss_fn as precision_loss
from trl_dta import DTAEngine, PrefixTree
from trl_dta.engine.ops import Push, Rows, walk_ops
from trl_dta.engine.schedule import Budgets, TreeShape


def per_turn_batch(seed: int = 0, vocab: int = VOCAB) -> list[torch.Tensor]:
    """Per-turn rows of three episodes of unequal lengths under a shared prompt (a row ends after every turn: chains
    whose inner segments each end a sequence), plus a short branching subtree (two leaves under a stem) and a lone
    leaf: what shared rows pack side by side.

    ```
    prompt (6) ─┬─ 3 ─ 4 ─ 2 ─ 5        episode 0 (a row after each turn)
                ├─ 9 ─ 7                episode 1
                ├─ 2 ─ 1 ─ 12           episode 2
                ├─ 2 ─┬─ 3              a branching subtree
                │     └─ 2
                └─ 1                    a one-token leaf
    ```
    """
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (6,), generator=g)
    seqs = []
    for first, turns in ((3, [3, 4, 2, 5]), (4, [9, 7]), (5, [2, 1, 12])):
        history = [prompt]
        for k, n in enumerate(turns):
            turn = torch.randint(3, vocab, (n,), generator=g)
            if k == 0:
                turn[0] = first  # distinct first tokens: the episodes branch at the prompt
            history.append(turn)
            seqs.append(torch.cat(history))
    stem = torch.cat([prompt, torch.tensor([6, 9])])
    seqs += [torch.cat([stem, torch.tensor([10, 11, 12])]), torch.cat([stem, torch.tensor([13, 14])])]
    seqs.append(torch.cat([prompt, torch.tensor([7])]))
    return seqs


SEQS = per_turn_batch()


def shape_of(engine: DTAEngine, seqs, hybrid: bool = False) -> dict:
    """What the engine's training walk of `seqs` does: shared rows, chain rows of several segments, fused pushes
    (kept and in blocks)."""
    tree = PrefixTree.from_sequences(seqs)
    if hybrid:
        tree = tree.unshared(min_length=2)
    shape = TreeShape.of(tree)
    b = Budgets(engine.block_size, engine.max_batch_tokens, engine.max_graph_tokens,
                0 if hybrid else engine.max_pack_tokens, engine.lm_head_chunk_size, engine.row_cost())
    seen = dict(forwards=0, shared=0, tree_in_shared=0, chain_rows=0, fused_kept=0, fused_blocks=0, cross_block=0)
    for op in walk_ops(tree, b, train=True, hybrid=hybrid):
        seen["forwards"] += len(op.forwards)
        if isinstance(op, Rows):
            seen["shared"] += sum(len(row) > 1 for row in op.rows)
            seen["tree_in_shared"] += sum(not shape.chain[r] for row in op.rows if len(row) > 1 for r in row)
            seen["chain_rows"] += sum(shape.chain[r] and shape.subtree_segments[r] > 1 for row in op.rows for r in row)
        elif isinstance(op, Push) and len(op.segments) > 1:
            seen["fused_blocks" if op.blocks else "fused_kept"] += 1
            if op.blocks:  # a block that starts in one segment and ends in another
                ends = set()
                edge = 0
                for s in op.segments:
                    edge += shape.lengths[s]
                    ends.add(edge)
                seen["cross_block"] += sum(any(lo < e < hi for e in ends) for lo, hi in op.blocks)
    return seen


# name -> (engine kwargs, what the walk must contain). The tiny test model's cost model packs the whole tree into
# one tree row (a call costs thousands of its tokens' work): the other cases cap tree rows or the budgets.
CASES = {
    "one-tree-row": (dict(), dict()),
    # the prompt pushed, the episodes' chains and the small branching subtree side by side in shared rows
    "shared-rows": (dict(max_pack_tokens=8), dict(shared=1, tree_in_shared=1, chain_rows=1)),
    "fused-kept": (dict(max_batch_tokens=9), dict(fused_kept=1)),  # chains too wide for a row: walked as fused runs
    "fused-blocks": (dict(max_graph_tokens=4, block_size=3), dict(fused_blocks=1, cross_block=1)),
}


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
def test_float64_equals_oracle(case, backend):
    engine_kw, expect = CASES[case]
    model = make_model("qwen2", torch.float64)
    engine = DTAEngine(model, attn_backend=backend, **engine_kw)
    seen = shape_of(engine, SEQS)
    assert all(seen[k] >= v for k, v in expect.items()), seen
    if case == "one-tree-row":
        assert seen["forwards"] == 1
    out = check(model, SEQS, TOL[torch.float64], engine=engine)
    n_scored = [max(len(s) - 6, 0) for s in SEQS]  # only the completions (TRL's layout): fewer targets per block
    check(model, SEQS, TOL[torch.float64], engine=engine, n_scored=n_scored)
    if case in ("shared-rows", "one-tree-row"):  # subtrees side by side: no padding
        assert out.stats["padded_tokens"] == out.stats["forward_tokens"] == out.stats["tree_tokens"]


@pytest.mark.parametrize("case", ["shared-rows", "fused-blocks"])
@pytest.mark.parametrize("autocast", [OFF, BF16], ids=["float32", "bf16-autocast"])
def test_low_precision_within_the_dense_error(case, autocast):
    """float32 weights, with and without TRL's bf16 autocast: DTA's errors against the float64 twin within the
    derived multiple of the dense path's own (`test_precision._assert_as_precise`)."""
    model = make_model("qwen2", torch.float32, exact_norms=False)
    exact = float64_twin(model)
    _, lp64, ent64 = dense_forward_backward(exact, SEQS, precision_loss)
    _assert_as_precise(model, SEQS, (lp64, ent64, grads_of(exact)), autocast, "auto", case, **CASES[case][0])


HYBRID_MODES = {"chain_rows": dict(), "fused_kept": dict(max_batch_tokens=9),
                "fused_blocks": dict(max_graph_tokens=4, block_size=3)}


@pytest.mark.parametrize("shape", list(HYBRID_MODES))
def test_hybrid_float64_equals_oracle(shape):
    """Gated DeltaNet beside attention: chain rows continue the path's recurrent states, a fused run carries them
    across its segments (kept, or rebuilt block by block when recomputed)."""
    model = make_hybrid(PRIMARY[0])
    engine = DTAEngine(model, **HYBRID_MODES[shape])
    seen = shape_of(engine, SEQS, hybrid=True)
    assert seen["shared"] == 0 and seen[shape] >= 1, seen
    with float64_internals(model):
        want_loss, want_lp, want_ent = dense_forward_backward(model, SEQS, nonlinear_loss)
        want = grads_of(model)
        model.zero_grad(set_to_none=True)
        out = engine.forward_backward(SEQS, nonlinear_loss, entropy=True)
    for what, (err, where) in {"log-probs": compare_lists(out.logps, want_lp),
                               "entropies": compare_lists(out.entropies, want_ent),
                               "gradients": compare_grads(grads_of(model), want)}.items():
        assert err <= TOL[torch.float64], f"{what} differ by {err:.3g} (at {where})"
    assert abs(out.loss.item() - float(want_loss)) <= TOL[torch.float64] * abs(float(want_loss))
