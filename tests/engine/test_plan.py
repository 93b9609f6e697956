"""ScorePlan against brute force: every sequence's slices reassemble exactly its scored targets, and every scored
target is needed by some sequence."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_dta.engine.plan import ScorePlan
from trl_dta.engine.schedule import block_bounds
from trl_dta.tree import PrefixTree


@st.composite
def scored_batches(draw):
    """Sequences grown from a few stems (shared prefixes, duplicates, prefixes of one another, lengths 0 and 1) and a
    random `n_scored` per sequence (clipped as the engine clips it)."""
    tok = st.integers(0, 3)
    stems = draw(st.lists(st.lists(tok, max_size=10), min_size=1, max_size=3))
    seqs = []
    for _ in range(draw(st.integers(1, 8))):
        stem = draw(st.sampled_from(stems))
        seqs.append(stem[: draw(st.integers(0, len(stem)))] + draw(st.lists(tok, max_size=4)))
    if draw(st.booleans()):
        seqs.append(list(draw(st.sampled_from(seqs))))
    n_scored = [min(draw(st.integers(0, len(s) + 1)), max(len(s) - 1, 0)) for s in seqs]
    return seqs, n_scored


def _target(tree: PrefixTree, seg: int, offset: int) -> tuple[int, int]:
    """(token id, depth) of the tree token at `offset` in segment `seg`."""
    return int(tree.tokens(seg)[offset]), tree.segments[seg].start + offset


@settings(max_examples=400, deadline=None)
@given(scored_batches())
def test_slices_reassemble_scored_positions(batch):
    seqs, n_scored = batch
    tree = PrefixTree.from_sequences(seqs)
    plan = ScorePlan(tree, n_scored)
    targets = {s.index: [_target(tree, *t) for t in plan.output_targets(s.index)] for s in tree.segments}
    used = {s: set() for s in targets}
    for i, seq in enumerate(seqs):
        got = []
        for s, a, b in plan.slices(i):
            assert 0 <= a < b <= plan.n_outputs(s)
            got += targets[s][a:b]
            used[s].update(range(a, b))
        first = len(seq) - n_scored[i]
        assert got == [(seq[d], d) for d in range(first, len(seq))], f"sequence {i}"
    for s, outputs in targets.items():
        assert len(outputs) == plan.n_outputs(s)
        assert used[s] == set(range(len(outputs))), f"segment {s} scores targets no sequence needs"


@settings(max_examples=200, deadline=None)
@given(scored_batches(), st.integers(1, 5))
def test_blocks_partition_the_outputs(batch, block_size):
    """Recompute blocks of any size produce, in order, exactly the segment's outputs."""
    seqs, n_scored = batch
    tree = PrefixTree.from_sequences(seqs)
    plan = ScorePlan(tree, n_scored)
    for seg in tree.segments:
        whole = plan.block(seg.index, 0, seg.length)
        assert whole.outputs == (0, plan.n_outputs(seg.index))
        internal, forks, stop = [], [], 0
        for lo in range(0, seg.length, block_size):
            block = plan.block(seg.index, lo, min(lo + block_size, seg.length))
            assert block.outputs[0] == stop
            assert all(lo <= p < lo + block_size for p in block.internal)
            stop = block.outputs[1]
            internal += list(block.internal)
            forks += block.forks
        assert stop == plan.n_outputs(seg.index)
        assert internal == list(whole.internal) and forks == whole.forks


def test_docstring_example():
    seqs = [list("abcd"), list("abef")]
    tree = PrefixTree.from_sequences([[ord(c) for c in s] for s in seqs])
    plan = ScorePlan(tree, [2, 3])
    assert plan.first == [2, 1]
    assert [plan.n_outputs(s) for s in range(3)] == [3, 1, 1]
    assert plan.slices(0) == [(0, 1, 2), (1, 0, 1)]
    assert plan.slices(1) == [(0, 0, 1), (0, 2, 3), (2, 0, 1)]


@pytest.mark.parametrize("length,size,min_block,want", [
    (5, 2, 1, [(0, 2), (2, 4), (4, 5)]),
    (5, 2, 2, [(0, 2), (2, 5)]),
    (1, 4, 2, [(0, 1)]),
    (7, 1, 2, [(0, 2), (2, 4), (4, 7)]),
    (8, 4, 2, [(0, 4), (4, 8)]),
])
def test_block_bounds(length, size, min_block, want):
    """Recompute blocks: `block_size` tokens, and for hybrids (`min_block=2`) no block of one token unless the
    segment is one."""
    assert block_bounds(length, size, min_block) == want
