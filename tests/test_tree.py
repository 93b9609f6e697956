"""PrefixTree invariants against brute force over the set of prefixes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_dta import PrefixTree

seq_lists = st.lists(st.lists(st.integers(0, 4), max_size=8), max_size=12)


def _check_invariants(seqs: list[list[int]]):
    tree = PrefixTree.from_sequences(seqs)
    prefixes = {tuple(s[: k + 1]) for s in seqs for k in range(len(s))}
    assert tree.n_sequences == len(seqs)
    assert tree.n_tokens == sum(map(len, seqs))
    assert tree.n_tree_tokens == len(prefixes)
    assert tree.max_path_len == max(map(len, seqs), default=0)
    assert sorted(tree.empty) == [i for i, s in enumerate(seqs) if not s]
    # Each sequence is the concatenation of its path's segments and ends at its end segment.
    for i, s in enumerate(seqs):
        path = tree.path(i)
        got = torch.cat([tree.tokens(p) for p in path]).tolist() if path else []
        assert got == s
        if s:
            assert i in tree.segments[tree.end_segment[i]].ends
    # Tree-token ids: shared exactly when the prefixes up to them are equal.
    index = [tree.token_index(i).tolist() for i in range(len(seqs))]
    seen: dict[int, tuple] = {}
    ids = tree.tree_token_ids().tolist()
    for s, idx in zip(seqs, index):
        for k, t in enumerate(idx):
            assert ids[t] == s[k]
            assert seen.setdefault(t, tuple(s[: k + 1])) == tuple(s[: k + 1])
    assert len(seen) == tree.n_tree_tokens
    # Segments: pre-order, children start where the parent ends and differ in their first token, no empty segment,
    # no segment with a single child unless a sequence ends there (maximal segments).
    for seg in tree.segments:
        assert seg.length >= 1
        for c in seg.children:
            assert tree.segments[c].parent == seg.index and tree.segments[c].start == seg.end and c > seg.index
        firsts = [int(tree.tokens(c)[0]) for c in seg.children]
        assert firsts == sorted(set(firsts))
        if len(seg.children) == 1:
            assert seg.ends
    # Lexicographic order with the right neighbour LCPs.
    assert [seqs[i] for i in tree.order] == sorted(seqs)
    for k in range(1, len(seqs)):
        a, b = seqs[tree.order[k - 1]], seqs[tree.order[k]]
        lcp = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
        assert tree.order_lcp[k] == lcp
    assert sum(tree.subtree_tokens()[r] for r in tree.roots) == tree.n_tree_tokens
    return tree


@settings(max_examples=300, deadline=None)
@given(seq_lists)
def test_invariants_hypothesis(seqs):
    _check_invariants(seqs)


def test_shapes():
    prompt = list(range(10, 30))
    seqs = [prompt + [1, 2], prompt + [1, 3], prompt, prompt, [], [7], list(range(100, 150))]
    tree = _check_invariants(seqs)
    assert tree.n_tree_tokens == 20 + 1 + 2 + 1 + 50
    assert tree.compression_ratio == pytest.approx(tree.n_tokens / tree.n_tree_tokens)
    assert tree.depth == 3 and tree.n_leaves == 4
    stats = tree.stats()
    assert stats["tree_tokens"] == tree.n_tree_tokens and stats["sequences"] == 7


def test_no_sharing_and_one_huge_prefix():
    distinct = [[i, i + 1, i + 2] for i in range(0, 30, 3)]
    tree = _check_invariants(distinct)
    assert tree.compression_ratio == 1.0 and len(tree.roots) == 10
    huge = list(range(5000))
    tree = _check_invariants([huge + [i] for i in range(4)] + [huge])
    assert tree.n_tree_tokens == 5004 and tree.n_segments == 5


def test_from_padded_left_right_and_mixed():
    seqs = [[5, 6, 7], [5, 6], [9]]
    width = 5
    left = torch.zeros(3, width, dtype=torch.long)
    right = torch.zeros(3, width, dtype=torch.long)
    lmask, rmask = torch.zeros_like(left), torch.zeros_like(right)
    for r, s in enumerate(seqs):
        left[r, width - len(s):], lmask[r, width - len(s):] = torch.tensor(s), 1
        right[r, : len(s)], rmask[r, : len(s)] = torch.tensor(s), 1
    for ids, mask in ((left, lmask), (right, rmask)):
        tree = PrefixTree.from_padded(ids, mask)
        assert [t.tolist() for t in tree.seqs] == seqs
    # TRL's layout: left-padded prompt then right-padded completion.
    ids = torch.tensor([[0, 5, 6, 7, 0], [5, 6, 8, 9, 4]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    tree = PrefixTree.from_padded(ids, mask)
    assert [t.tolist() for t in tree.seqs] == [[5, 6, 7], [5, 6, 8, 9, 4]]
    assert tree.n_tree_tokens == 2 + 1 + 3


def test_large_batch_builds():
    """1M tokens (500 sequences, half of each shared): built with sort-and-LCP, no per-token Python objects."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.cat([torch.tensor([20_000 + p]), torch.randint(0, 1000, (999,), generator=g)]) for p in range(50)]
    seqs = [torch.cat([prompts[i % 50], torch.tensor([10_000 + i]), torch.randint(0, 1000, (999,), generator=g)])
            for i in range(500)]
    tree = PrefixTree.from_sequences(seqs)
    assert tree.n_tokens == 1_000_000
    assert tree.n_tree_tokens == 50 * 1000 + 500 * 1000


def test_errors():
    with pytest.raises(ValueError, match="1-D"):
        PrefixTree.from_sequences([torch.zeros(2, 2, dtype=torch.long)])
    with pytest.raises(TypeError, match="from_padded"):
        PrefixTree.from_sequences(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        PrefixTree.from_padded(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4))
    with pytest.raises(ValueError, match="input_ids"):
        PrefixTree.from_padded(torch.zeros(3, dtype=torch.long))
    empty = PrefixTree.from_sequences([])
    assert empty.n_sequences == 0 and empty.compression_ratio == 1.0


# ---------------------------------------------------------------------------------------------- input validation

_IDS = torch.tensor([[0, 5, 6], [7, 8, 9]])
_MASK = torch.tensor([[0, 1, 1], [1, 1, 1]])

# (builder, arguments, expected error, text the message must contain)
BAD_INPUTS = [
    ("from_sequences", ("abc",), TypeError, "seqs"),
    ("from_sequences", (None,), TypeError, "seqs"),
    ("from_sequences", (3,), TypeError, "seqs"),
    ("from_sequences", ({0: [1]},), TypeError, "seqs"),
    ("from_sequences", ({(1, 2)},), TypeError, "seqs"),
    ("from_sequences", (np.zeros((2, 3), dtype=np.int64),), TypeError, "from_padded"),
    ("from_sequences", ([[1, 2.0]],), TypeError, r"seqs\[0\]\[1\]"),
    ("from_sequences", ([[1, 2], [False]],), TypeError, r"seqs\[1\]\[0\]"),
    ("from_sequences", ([[1, [2]]],), TypeError, r"seqs\[0\]\[1\]"),
    ("from_sequences", ([1, 2],), TypeError, r"seqs\[0\]"),
    ("from_sequences", (["hello"],), TypeError, r"seqs\[0\]"),
    ("from_sequences", ([torch.tensor([1.0, 2.0])],), TypeError, "dtype"),
    ("from_sequences", ([torch.tensor([True])],), TypeError, "dtype"),
    ("from_sequences", ([np.array([1.5])],), TypeError, "dtype"),
    ("from_sequences", ([np.zeros((1, 2), dtype=np.int64)],), ValueError, "1-D"),
    ("from_sequences", ([torch.zeros(2, dtype=torch.long, device="meta")],), ValueError, "meta"),
    ("from_sequences", ([[3, -100]],), ValueError, "negative"),
    ("from_padded", (_IDS.tolist(),), TypeError, "input_ids"),
    ("from_padded", (_IDS.numpy(),), TypeError, "input_ids"),
    ("from_padded", (_IDS.float(),), TypeError, "input_ids"),
    ("from_padded", (_IDS.bool(),), TypeError, "input_ids"),
    ("from_padded", (_IDS[0],), ValueError, "input_ids"),
    ("from_padded", (_IDS[None],), ValueError, "input_ids"),
    ("from_padded", (_IDS.to("meta"),), ValueError, "meta"),
    ("from_padded", (_IDS, _MASK.tolist()), TypeError, "attention_mask"),
    ("from_padded", (_IDS, _MASK.float()), TypeError, "attention_mask"),
    ("from_padded", (_IDS, _MASK[:, 1:]), ValueError, "attention_mask"),
    ("from_padded", (_IDS, _MASK * 2), ValueError, "attention_mask"),
    ("from_padded", (_IDS - 8, _MASK), ValueError, "negative"),
]


@pytest.mark.parametrize("builder, args, error, text", BAD_INPUTS)
def test_bad_inputs_refused(builder, args, error, text):
    with pytest.raises(error, match=text):
        getattr(PrefixTree, builder)(*args)


@pytest.mark.parametrize(
    "seqs",
    [
        ([5, 6], [5, 7], []),
        (s for s in ([5, 6], [5, 7], [])),
        [np.array([5, 6], dtype=np.uint8), np.array([5, 7], dtype=np.int32), np.array([], dtype=np.int64)],
        [torch.tensor([5, 6], dtype=torch.int16), torch.tensor([5, 7]), torch.tensor([], dtype=torch.long)],
        [[np.int64(5), torch.tensor(6)], (5, 7), range(0)],
    ],
    ids=["tuple", "generator", "numpy", "tensors", "scalars"],
)
def test_accepted_forms_build_the_same_tree(seqs):
    tree = PrefixTree.from_sequences(seqs)
    assert [s.tolist() for s in tree.seqs] == [[5, 6], [5, 7], []]
    assert all(s.dtype == torch.long for s in tree.seqs)
    assert tree.n_tree_tokens == 3


def test_from_padded_bool_mask_equals_integer_mask():
    a = PrefixTree.from_padded(_IDS, _MASK)
    b = PrefixTree.from_padded(_IDS, _MASK.bool())
    assert [s.tolist() for s in a.seqs] == [s.tolist() for s in b.seqs] == [[5, 6], [7, 8, 9]]


def test_subtree_reduce():
    tree = PrefixTree.from_sequences([[1, 2, 3], [1, 2, 4, 5], [1], [6]])
    # segments in pre-order: [1] (seq 2 ends), [2], [3], [4 5], [6]
    assert tree.subtree_tokens() == [5, 4, 1, 2, 1]
    assert tree.subtree_segments() == [4, 3, 1, 1, 1]
    depth_min = tree.subtree_reduce([s.start for s in tree.segments], min)
    assert all(depth_min[s.index] == s.start for s in tree.segments)  # children are deeper than their parents


@settings(max_examples=150, deadline=None)
@given(seq_lists, st.integers(2, 3))
def test_unshared_keeps_every_sequence_and_no_short_internal_segment(seqs, min_length):
    """`PrefixTree.unshared` (the hybrid models' tree): each sequence is still its path's concatenation and ends at its
    end segment, pre-order numbering and offsets hold, no non-root segment with children is shorter than
    `min_length`, and every copy is counted."""
    tree = PrefixTree.from_sequences(seqs)
    out = tree.unshared(min_length)
    for i, s in enumerate(seqs):
        path = out.path(i)
        assert (torch.cat([out.tokens(p) for p in path]).tolist() if path else []) == s
        if s:
            assert i in out.segments[out.end_segment[i]].ends
    assert sorted(out.empty) == sorted(tree.empty) and out.lengths == tree.lengths
    offset = 0
    for k, seg in enumerate(out.segments):
        assert seg.index == k and seg.offset == offset and seg.length >= 1
        offset += seg.length
        assert all(c > k and out.segments[c].parent == k and out.segments[c].start == seg.end for c in seg.children)
        assert seg.parent < 0 or not seg.children or seg.length >= min_length
    assert out.n_tree_tokens == offset >= tree.n_tree_tokens
    assert sorted(out.roots) == [s.index for s in out.segments if s.parent < 0]
    size = out.subtree_segments()
    for seg in out.segments:  # every subtree a contiguous pre-order range
        assert all(seg.index < c and c + size[c] <= seg.index + size[seg.index] for c in seg.children)
    if all(s.parent < 0 or not s.children or s.length >= min_length for s in tree.segments):
        assert out is tree


def test_unshared_docstring_example():
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 3], [1, 2, 8]]
    out = PrefixTree.from_sequences(seqs).unshared()
    assert [out.tokens(s.index).tolist() for s in out.segments] == [[1, 2], [3], [3, 4, 5], [3, 6, 7], [8]]
    assert out.segments[1].ends == [2] and not out.segments[1].children
    assert out.n_tree_tokens == PrefixTree.from_sequences(seqs).n_tree_tokens + 2
