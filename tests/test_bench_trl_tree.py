"""The two peers of issue 33 compute what they claim: `trl-tree` (TRL's own tree packing, `baselines/trl_tree.py`)
and `sparse-flex` (the packed tree under FlexAttention's block mask, `baselines/sparse.py`) give the per-sequence
oracle's log-probs, loss and parameter gradients (the oracle and models of `test_baselines.py`)."""

import pytest
import torch

from benchmarks.baselines.sparse import (
    CPU_FLEX_FALLBACK,
    SparseProvider,
    tree_attention_mask,
    tree_block_mask,
    tree_layout,
)
from benchmarks.baselines.trl_tree import TRLTreeProvider, plan_rows
from bounds import assert_as_precise_as_dense
from conftest import float64_twin
from test_baselines import (
    _assert_as_precise,
    _assert_close,
    _loss_fn,
    _model,
    _native_dtype_norms,
    _oracle,
    _run,
    _seqs,
)
from trl_dta.tree import PrefixTree


@pytest.fixture(scope="module")
def exact64():
    """The float64 model (norms in float64), its sequences, loss and oracle (log-probs, loss, gradients)."""
    model = _native_dtype_norms(_model(torch.float64))
    seqs = _seqs()
    loss_fn = _loss_fn(len(seqs))
    return model, seqs, loss_fn, _oracle(model, seqs, loss_fn)


@pytest.mark.parametrize("token_budget", [None, 24])
def test_trl_tree_matches_oracle_float64(exact64, token_budget):
    model, seqs, loss_fn, ref = exact64
    provider = TRLTreeProvider(model, token_budget=token_budget, lm_head="torch")
    out, grads = _run(provider, model, seqs, loss_fn)
    assert out.stats["attention"] == "torch"
    assert (out.stats["micro_batches"] > 1) == (token_budget is not None)
    _assert_close(out, grads, ref, rtol=1e-10)
    assert model.config._attn_implementation == "sdpa"  # restored after the tree forward


def test_trl_tree_plans_and_packs_with_trls_code():
    """TRL's planner and `TreeRow`: a row never exceeds the budget in unique or trained tokens, every sample is placed
    once, and the forwarded tokens are the trie's (TRL's trie forks one token before samples diverge: at least the
    prefix tree's tokens)."""
    from trl.experimental.async_grpo.packing import TreeRow

    seqs = _seqs()
    rows = plan_rows(seqs, 24)
    assert all(isinstance(r, TreeRow) for r in rows)
    assert sorted(s["index"] for r in rows for s in r.samples) == list(range(len(seqs)))
    assert all(len(r.tokens) <= 24 and r.trained <= 24 for r in rows)
    one = plan_rows(seqs, None)
    assert len(one) == 1
    assert PrefixTree.from_sequences(seqs).n_tree_tokens <= len(one[0].tokens) < sum(len(s) for s in seqs)
    with pytest.raises(ValueError, match="token_budget"):
        plan_rows(seqs, 8)


def test_trl_tree_trl_head_float32():
    """TRL's fused LM head over `shift_labels`, as `AsyncGRPOTrainer.compute_loss` runs it, float32: as precise as
    the float32 oracle against the float64 twin."""
    model = _model(torch.float32)
    seqs = _seqs()
    loss_fn = _loss_fn(len(seqs))
    ref = _oracle(model, seqs, loss_fn)
    exact = _oracle(_native_dtype_norms(float64_twin(model)), seqs, loss_fn)
    out, grads = _run(TRLTreeProvider(model), model, seqs, loss_fn)
    _assert_as_precise(out, grads, exact, seqs, ref)


def test_flex_block_mask_is_the_tree_mask():
    tree = PrefixTree.from_sequences(_seqs())
    layout = tree_layout(tree)
    block_mask = tree_block_mask(layout, "cpu", block_size=16)
    T = tree.n_tree_tokens
    q, kv = torch.arange(T)[:, None].expand(T, T), torch.arange(T)[None].expand(T, T)
    assert torch.equal(block_mask.mask_mod(0, 0, q, kv), tree_attention_mask(tree, layout))
    # the blocks FlexAttention visits hold every attended pair
    visited = block_mask.to_dense()[0, 0].bool().repeat_interleave(16, 0).repeat_interleave(16, 1)[:T, :T]
    assert not (tree_attention_mask(tree, layout) & ~visited).any()


def test_sparse_flex_forward_matches_oracle(exact64):
    """FlexAttention itself runs forward-only on CPU (torch has no CPU backward): its log-probs in float64 equal the
    oracle's, in float32 within the float32 oracle's bound."""
    model, seqs, loss_fn, ref = exact64
    provider = SparseProvider(model, attention="flex", max_tokens=None, lm_head="torch", flex_block_size=16)
    with torch.no_grad():
        tree = PrefixTree.from_sequences(seqs)
        tree_lp = provider._tree_logprobs(tree_layout(tree))
    assert provider.ran == "flex"
    for i, want in enumerate(ref[0]):
        torch.testing.assert_close(tree_lp[tree.token_index(i)[1:]], want, rtol=1e-10, atol=1e-10)
    model32 = _model(torch.float32)
    ref32 = _oracle(model32, seqs, loss_fn)[0]
    exact = _oracle(_native_dtype_norms(float64_twin(model32)), seqs, loss_fn)[0]
    with torch.no_grad():
        lp32 = SparseProvider(model32, attention="flex", max_tokens=None, flex_block_size=16)._tree_logprobs(
            tree_layout(tree))
    assert_as_precise_as_dense([lp32[tree.token_index(i)[1:]] for i in range(len(seqs))], ref32, exact, "log-probs")


def test_sparse_flex_trains_on_cpu_through_the_named_fallback(exact64):
    model, seqs, loss_fn, ref = exact64
    provider = SparseProvider(model, attention="flex", max_tokens=None, lm_head="torch", block_size=4)
    out, grads = _run(provider, model, seqs, loss_fn)
    assert out.stats["attention"] == CPU_FLEX_FALLBACK and out.stats["micro_batches"] == 1
    _assert_close(out, grads, ref, rtol=1e-10)


def test_engine_rows_carry_the_method_and_its_oracle_check(tmp_path):
    """`grid.run_grid` (what `python -m benchmarks.suites.bench_engine --methods dense-ckpt,sparse-flex,trl-tree,dta`
    runs), in-process on a small GRPO batch: every row names its method, passed the oracle check before timing, and
    says how many micro-batches and forwarded tokens it ran; the CSV has both columns. A wrong result fails the
    check."""
    from benchmarks import workloads
    from benchmarks.harness.oracle import ORACLE_TOL, oracle_error
    from benchmarks.reporting.results import read_csv, write_csv
    from benchmarks.suites.grid import run_grid
    from benchmarks.suites.providers import MethodConfig

    w = workloads.grpo(24, 3, 8, vocab_size=4096)
    rows = run_grid([w], ["dense-ckpt", "sparse-flex", "trl-tree", "dta"], "bench-cpu-quick", "cpu", "fp32",
                    MethodConfig(), rounds=1, isolate=False, threads=1)
    assert [r["method"] for r in rows] == ["dense-ckpt", "sparse-flex", "trl-tree", "dta"]
    assert all(r["oracle_ok"] == 1 and r["oracle_err"] <= ORACLE_TOL["fp32"] and not r.get("error") for r in rows)
    tree = w.tree()
    assert [r["forward_tokens"] for r in rows[1:3]] == [tree.n_tree_tokens, tree.n_tree_tokens + 2]  # TRL forks early
    assert rows[0]["micro_batches"] == 1 and rows[2]["micro_batches"] == 1
    back = read_csv(write_csv(rows, tmp_path / "engine.csv"))
    assert {"method", "oracle_ok", "oracle_err", "micro_batches", "forward_tokens"} <= set(back[0])
    lp = [torch.randn(5), torch.randn(3)]
    assert oracle_error(lp, lp) == 0 and oracle_error([x.flip(0) for x in lp], lp) > ORACLE_TOL["fp32"]
