"""The walk's op stream (`engine/ops.py`) is what the walk really runs and what the memory estimate consumes.

Every model forward of a real engine call on a tiny model is recorded by a pre-hook on its decoder (the ids' shape as
forwarded, the stack's tokens and frames under it, whether grad is on) and compared, in order, with the forwards of
`walk_ops` on the same tree and budgets; the engine's own peak of graph tokens equals the stream's; and the forwards
with grad are exactly those `memory.peak_memory` replays (`memory._grad_forwards`). Trees: nested prefixes (a
sequence ending where others go on), one-token segments, siblings, an empty sequence; budgets: the defaults,
everything walked, graph budgets forcing block recompute, packed subtrees, lockstep with idle batches; a hybrid
(Gated DeltaNet beside attention) walks its own schedule (one-token forwards after a path padded to two)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model
from hybrid_models import make_hybrid
from trl_dta import DTAEngine
from trl_dta.engine.ops import Idle, Pop, Push, Rows, lockstep_batches, walk_ops
from trl_dta.engine.schedule import Budgets
from trl_dta.memory import _grad_forwards, activation_bytes_per_token, peak_memory
from trl_dta.tree import PrefixTree

P = [5, 6, 7, 8]
TREES = {
    # a sequence ending inside another, three levels deep, and a sibling of the middle one
    "nested": [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9], [30, 31]],
    # one-token segments ([9], [10], [13]) under a shared prompt, siblings of several sizes, an empty sequence
    "one_token": [P + [9], P + [10], P + [11, 12], P + [9, 13], P + [9, 14, 15, 16], [], [20]],
}
BUDGETS = {
    "defaults": dict(),
    "walked": dict(max_pack_tokens=0),
    "recompute": dict(max_pack_tokens=0, max_graph_tokens=5, block_size=2),
    "packed": dict(max_pack_tokens=4, max_batch_tokens=6),
    "lockstep": dict(max_batch_tokens=8, lockstep=2),  # two idle batches beyond this process's own
}


class Forwards:
    """The decoder's forwards: `(rows, length, path_tokens, frames, grad)` each, in order."""

    def __init__(self, model):
        self.seen: list[tuple] = []
        self.handle = model.get_decoder().register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        rows, length = kwargs["input_ids"].shape
        stack = kwargs["dta_ctx"].stack
        self.seen.append((rows, length, stack.length, len(stack.frames), torch.is_grad_enabled()))


def _check(model, seqs, hybrid: bool, budget: dict, train: bool):
    budget = dict(budget)
    extra = budget.pop("lockstep", None)
    engine = DTAEngine(model, **budget)
    asked = []
    if extra is not None:
        engine.lockstep = lambda n: asked.append(n) or n + extra
    forwards = Forwards(model)
    try:
        if train:
            engine.forward_backward(seqs, lambda i, lp, ent: (lp * lp).sum())
        else:
            engine.logprobs(seqs)
    finally:
        forwards.handle.remove()
    stats = engine.last_stats
    tree = PrefixTree.from_sequences(seqs)
    if hybrid:
        tree = tree.unshared(min_length=2)  # as the engine walks a hybrid
    budgets = Budgets(engine.block_size, engine.max_batch_tokens, engine.max_graph_tokens,
                      0 if hybrid else engine.max_pack_tokens, engine.lm_head_chunk_size, engine.row_cost())
    lockstep = None
    if extra is not None:
        assert asked == [len(lockstep_batches(tree, budgets, train=train))]
        lockstep = asked[0] + extra
    ops = list(walk_ops(tree, budgets, train=train, hybrid=hybrid, lockstep=lockstep))
    stream = [f for op in ops for f in op.forwards]
    assert [(f.rows, f.length, f.path_tokens, f.frames, f.grad) for f in stream] == forwards.seen
    assert stats["forwards"] == len(stream)
    assert stats["idle_batches"] == sum(isinstance(op, Idle) for op in ops) == (extra or 0)
    grad = [f for f in stream if f.grad]
    assert max((f.graph_tokens + f.row_tokens for f in grad), default=0) == stats["peak_graph_tokens"]
    # every push is popped, innermost first, with the blocks it was pushed with
    open_ = []
    for op in ops:
        if isinstance(op, Push):
            open_.append((op.segments, op.blocks))
        elif isinstance(op, Pop):
            assert open_.pop() == (op.segments, op.blocks)
    assert not open_
    if train:  # what the memory estimate replays
        replay = list(_grad_forwards(tree, budgets, hybrid=hybrid, lockstep=lockstep))
        assert replay == [(f.path_tokens, f.graph_tokens, f.rows, f.row_tokens, f.frames) for f in grad]
    return ops


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("tree", list(TREES))
def test_walk_runs_the_op_stream(tree, budget):
    model = make_model("qwen2", torch.float32)
    ops = _check(model, TREES[tree], False, BUDGETS[budget], train=True)
    _check(model, TREES[tree], False, BUDGETS[budget], train=False)
    kinds = {type(op) for op in ops}
    if budget == "walked":
        assert Push in kinds and Rows in kinds
    if budget == "recompute":
        assert any(isinstance(op, Pop) and op.blocks and op.forwards for op in ops)
    if budget == "lockstep":
        assert kinds == {Rows, Idle}


@pytest.mark.parametrize(("tree", "budget"), [("one_token", "recompute"), ("one_token_leaves", "defaults")])
def test_hybrid_walk_runs_the_op_stream(tree, budget):
    model = make_hybrid("qwen3_5_text", torch.float32)
    seqs = TREES[tree] if tree in TREES else [P + [9], P + [10], [20, 21]]
    ops = _check(model, seqs, True, BUDGETS[budget], train=True)
    if tree == "one_token_leaves":  # a batch of one-token leaves after the prompt, padded to two tokens
        assert any(f.rows == 2 and f.length == 2 and isinstance(op, Rows) for op in ops for f in op.forwards)
    else:
        assert any(isinstance(op, Pop) and op.forwards for op in ops)
    _check(model, seqs, True, BUDGETS[budget], train=False)


def test_lockstep_memory_counts_packed_roots_and_idle_batches():
    """In lockstep the whole tree runs as packed root subtrees under an empty path (max_pack_tokens does not apply),
    and an idle batch is a one-token forward: the estimate follows (fp32 sizes of a tiny shape, exact integers)."""
    from test_memory import ACT, KV, SHAPE

    seqs = [[0] * 10 + [1 + leaf] * 4 for leaf in range(3)]  # one root: a 10-token prompt, 3 leaves of 4
    walked = peak_memory(seqs, SHAPE, "sdpa", "fp32", max_pack_tokens=0)
    assert walked.total == 2 * 10 * KV + 10 * ACT + 12 * ACT + 3 * 10 * KV  # prompt kept, 3 leaf rows under it
    locked = peak_memory(seqs, SHAPE, "sdpa", "fp32", max_pack_tokens=0, lockstep=3)
    assert (locked.path_tokens, locked.graph_tokens, locked.rows, locked.row_tokens) == (0, 0, 1, 22)
    assert locked.total == 22 * ACT == 22 * activation_bytes_per_token(SHAPE, "fp32")
    # a process with only an empty sequence runs idle batches only: one token each
    idle = peak_memory([[]], SHAPE, "sdpa", "fp32", lockstep=2)
    assert (idle.rows, idle.row_tokens, idle.total) == (1, 1, ACT)
    assert peak_memory([[]], SHAPE, "sdpa", "fp32").total == 0
    with pytest.raises(ValueError, match="`lockstep` is the number of row batches.*own 1"):
        peak_memory(seqs, SHAPE, "sdpa", "fp32", lockstep=0)
    with pytest.raises(ValueError, match="`lockstep` with a hybrid"):
        peak_memory(seqs, "qwen3.5-9b", lockstep=1)
