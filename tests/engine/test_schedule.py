"""The walk's schedule (`engine/schedule.py`, `engine/ops.py`): how many model calls and padded tokens it takes, and
what it keeps in memory, on the workloads that motivated it and on random trees.

- Model calls: a tau2 airline tree (1 task x 4 episodes, 36 per-turn rows) in at most 5 forwards; per-turn forests of
  8 episodes x 30 turns in at most 12, 16 x 40 in at most 40, their padded tokens equal to their tree tokens.
- No regression: on every workload of the benchmarks' quick suite (and the tau2 and per-turn trees), under every
  budget, no more padded tokens and no dearer schedule (by the cost model) than the schedule before chains, fused
  runs and shared rows ([`_previous_schedule`], a re-implementation of it); no more forwards where a call is
  expensive (a GPU's cost model).
- Memory: on random trees and budgets, a forward with grad never holds more graph than the budget allows (rows and
  kept runs within `max_graph_tokens`, recomputed blocks at most `block_size` beyond it).
- The cost model: a CPU prices a tree row of the tau2 trees above their walk, a GPU (a call worth thousands of
  tokens) below it.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import workloads
from trl_dta.engine.ops import Pop, Push, Rows, walk_ops
from trl_dta.engine.schedule import DEFAULT_COST, Budgets, RowCost, TreeShape, batch_cost, pack_decisions
from trl_dta.flops import MODEL_SHAPES, ModelShape
from trl_dta.tree import PrefixTree

QWEN = MODEL_SHAPES["qwen3-0.6b"]
COSTS = {"cpu": RowCost.from_shape(QWEN, "cpu"), "cuda": RowCost.from_shape(QWEN, "cuda"), "default": DEFAULT_COST}


def budgets(cost=DEFAULT_COST, **kw) -> Budgets:
    """The engine's default budgets (`DTAEngine`), with `kw` over them."""
    return Budgets(**(dict(block_size=1024, max_batch_tokens=8192, max_graph_tokens=None, max_pack_tokens=None,
                           lm_head_chunk_size=4096, cost=cost) | kw))


def counts(tree: PrefixTree, b: Budgets, hybrid: bool = False) -> tuple[int, int, float]:
    """`(forwards, padded tokens, cost)` of a training walk, its cost priced by `b.cost` (a batch of rows as the
    schedule prices it, a run or block as a causal forward under its path)."""
    shape = TreeShape.of(tree)
    forwards, padded, cost = 0, 0, 0.0
    for op in walk_ops(tree, b, train=True, hybrid=hybrid):
        for f in op.forwards:
            forwards += 1
            padded += f.row_tokens
            if isinstance(op, Rows):
                cost += batch_cost(op.rows, shape, b.cost, f.path_tokens)
            else:
                cost += b.cost.forward(f.rows, f.length, f.path_tokens, causal=True)
    return forwards, padded, cost


def _previous_schedule(tree: PrefixTree, b: Budgets) -> tuple[int, int, float]:
    """`(forwards, padded tokens, cost)` of a training walk under the schedule before issue 39 (commit 6310067's
    `schedule.py` / `ops.py`), priced like [`counts`]: leaves and subtrees of at most `max_pack_tokens` (1024 when
    None, its old default) as rows of one subtree each, sorted and padded (a row of several segments under a tree
    mask); every other segment walked on its own, kept when it fits the graph budget, else in recompute blocks
    (forwarded twice); a lone leaf beyond the graph budget in blocks."""
    size, segs = tree.subtree_tokens(), tree.segments
    max_pack = 1024 if b.max_pack_tokens is None else b.max_pack_tokens
    span = tree.subtree_segments()
    fits = lambda live, n: b.max_graph_tokens is None or live + n <= b.max_graph_tokens  # noqa: E731
    total = [0, 0, 0.0]

    def forward(rows, width, path, causal):
        total[0] += 1
        total[1] += rows * width
        total[2] += b.cost.forward(rows, width, path, causal)

    def blocks(n, path):
        for lo in range(0, n, b.block_size):
            for _ in range(2):  # no grad at push, with grad at pop
                forward(1, min(b.block_size, n - lo), path + lo, True)

    def children(kids, live, path):
        pack = min(max_pack, b.max_batch_tokens)
        rows = sorted((c for c in kids if not segs[c].children or size[c] <= pack), key=size.__getitem__)
        walk = [c for c in kids if segs[c].children and size[c] > pack]
        batches, cur = [], []
        for c in rows:
            padded = (len(cur) + 1) * size[c]
            if cur and (padded > b.max_batch_tokens or not fits(live, padded)):
                batches.append(cur)
                cur = []
            cur.append(c)
        if cur:
            batches.append(cur)
        for batch in batches:
            if len(batch) == 1 and not fits(live, size[batch[0]]):
                if segs[batch[0]].children:
                    walk.append(batch[0])
                else:
                    blocks(segs[batch[0]].length, path)
            else:
                forward(len(batch), size[batch[-1]], path, all(span[r] == 1 for r in batch))
        for c in sorted(walk, key=size.__getitem__):
            n = segs[c].length
            if fits(live, n):
                forward(1, n, path, True)
                children(segs[c].children, live + n, path + n)
            else:
                blocks(n, path)
                children(segs[c].children, live, path + n)

    children(tree.roots, 0, 0)
    return total[0], total[1], total[2]


TAU2 = workloads.tau2_airline(group=4)
FORESTS = {f"{w.name}-{len(w.seqs)}": w for w in [
    *workloads.suite("quick"), TAU2, workloads.tau2_airline(tasks=1, group=2, max_turns=3, prefix_tokens=1024,
                                                            vocab_size=4096),
    workloads.per_turn(8, 30), workloads.per_turn(16, 40)]}


@pytest.mark.parametrize("cost", list(COSTS))
def test_forwards_of_the_tau2_and_per_turn_trees(cost):
    b = budgets(COSTS[cost])
    tree = TAU2.tree()
    forwards, padded, _ = counts(tree, b)
    assert forwards <= 5 and padded == tree.n_tree_tokens
    assert _previous_schedule(tree, b)[0] == 8  # before: a push per segment above the leaves
    for name, limit in (("per-turn-8x30-240", 12), ("per-turn-16x40-640", 40)):
        tree = FORESTS[name].tree()
        forwards, padded, _ = counts(tree, b)
        assert forwards <= limit and padded == tree.n_tree_tokens, (name, forwards, padded)
        assert _previous_schedule(tree, b)[0] > 4 * limit  # before: one forward per turn


@pytest.mark.parametrize("budget", [dict(), dict(max_graph_tokens=1024), dict(max_graph_tokens=0, block_size=256),
                                    dict(max_pack_tokens=0), dict(max_pack_tokens=1024), dict(max_batch_tokens=2048)],
                         ids=["defaults", "graph-1024", "graph-0", "no-tree-rows", "pack-1024", "batch-2048"])
def test_no_workload_takes_more_forwards_or_padded_tokens(budget):
    """Never a dearer schedule than before; where a model call is expensive (a GPU's cost model) never more calls
    either; where rows may share (tree rows allowed) never more padded tokens. Where a call costs a few tokens' work
    (a CPU's cost model, the schedule's default one) the cost model may walk what the old rule packed: cheaper
    attention for a few more calls; without tree rows (`max_pack_tokens=0`, a hybrid's schedule) chains of unequal
    lengths may be padded into one forward where the calls saved are worth it."""
    for cost in ("cuda", "default", "cpu"):
        b = budgets(COSTS[cost], **budget)
        for name, w in FORESTS.items():
            tree = w.tree()
            before, now = _previous_schedule(tree, b), counts(tree, b)
            assert now[2] <= before[2] * (1 + 1e-9), (cost, name, now, before)
            if b.tree_rows:
                assert now[1] <= before[1], (cost, name, now, before)
            if cost == "cuda":
                assert now[0] <= before[0], (cost, name, now, before)


def test_cost_model_walks_on_a_cpu_and_packs_on_a_gpu():
    """The tau2 trees at SmolLM2's width: a tree row of the whole subtree below the system prompt costs its full
    square of attention; on a CPU that is more than a walk's extra calls, on a GPU less."""
    smollm2 = ModelShape(576, 1536, 30, 9, 3, 64, 49152, name="smollm2")
    tree = workloads.tau2_airline(tasks=1, group=2, max_turns=2, prefix_tokens=512, vocab_size=4096).tree()
    shape = TreeShape.of(tree)
    root = tree.roots[0]
    assert not shape.chain[root]
    cpu, gpu = RowCost.from_shape(smollm2, "cpu"), RowCost.from_shape(smollm2, "cuda")
    assert cpu.call < 100 * cpu.token and gpu.call > 1000 * gpu.token  # a call: ~42 tokens of work, ~12,600
    assert not pack_decisions(shape, budgets(cpu))[root]
    assert pack_decisions(shape, budgets(gpu))[root]
    assert counts(tree, budgets(gpu))[:2] == (1, tree.n_tree_tokens)  # one tree row
    assert counts(tree, budgets(cpu))[:2] == (2, tree.n_tree_tokens)  # the prompt, both episodes in one shared row
    ops = list(walk_ops(tree, budgets(cpu), train=True))
    assert [type(op) for op in ops] == [Push, Rows, Pop] and len(ops[1].rows) == 1 and len(ops[1].rows[0]) == 2


@st.composite
def trees(draw):
    tok = st.integers(3, 9)
    stems = draw(st.lists(st.lists(tok, min_size=1, max_size=12), min_size=1, max_size=3))
    seqs = []
    for _ in range(draw(st.integers(1, 8))):
        stem = draw(st.sampled_from(stems))
        seqs.append(stem[: draw(st.integers(0, len(stem)))] + draw(st.lists(tok, max_size=8)))
    return PrefixTree.from_sequences(seqs)


@settings(max_examples=200, deadline=None)
@given(tree=trees(), graph=st.sampled_from([None, 0, 3, 8, 20]), block=st.integers(1, 6),
       batch=st.sampled_from([1, 5, 16, 64]), pack=st.sampled_from([None, 0, 6]),
       cost=st.sampled_from(list(COSTS)), hybrid=st.booleans())
def test_graph_stays_within_its_budget(tree, graph, block, batch, pack, cost, hybrid):
    """Every forward with grad: rows and kept runs within the graph budget, a recomputed block at most `block_size`
    tokens (a hybrid's up to one more: no one-token block) above a path within it; every push popped with its
    blocks; every tree token forwarded (kept or recomputed) and scored once per pass."""
    if hybrid:
        tree, pack = tree.unshared(min_length=2), 0
    b = budgets(COSTS[cost], max_graph_tokens=graph, block_size=block, max_batch_tokens=batch, max_pack_tokens=pack)
    ops = list(walk_ops(tree, b, train=True, hybrid=hybrid))
    pushed, seen = [], []
    for op in ops:
        for f in op.forwards:
            if not f.grad:
                continue
            if graph is not None:
                assert f.graph_tokens <= graph
                if isinstance(op, Pop):  # a recomputed block
                    assert f.length <= (max(block, 2) + 1 if hybrid else block)  # a hybrid merges a short last block
                else:  # (a hybrid's one-token forward after a path is padded to two)
                    assert f.graph_tokens + f.row_tokens <= graph + (f.rows if hybrid else 0)
        if isinstance(op, Push):
            pushed.append((op.segments, op.blocks))
            seen += op.segments
            assert all(b_ == a + 1 and tree.segments[a].children == [b_] for a, b_ in zip(op.segments, op.segments[1:]))
        elif isinstance(op, Pop):
            assert pushed.pop() == (op.segments, op.blocks)
        elif isinstance(op, Rows):
            span = tree.subtree_segments()
            seen += [g for row in op.rows for r in row for g in range(r, r + span[r])]
    assert not pushed and sorted(seen) == list(range(tree.n_segments))
