"""Packed subtree rows against a brute-force construction from the sequences: token j is visible to token i iff the
prefix ending at j is a prefix of the prefix ending at i (the rows' `key_end` intervals drawn as a mask)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_dta.engine.rows import pack_rows
from trl_dta.kernels import PartMask
from trl_dta.tree import PrefixTree

seq_lists = st.lists(st.lists(st.integers(0, 3), max_size=9), min_size=1, max_size=10)


def _brute_force(tree: PrefixTree, seqs: list[list[int]], root: int, width: int):
    """Ids, depths and visibility `(width, width)` of the row holding the subtree of `root`, from the sequences."""
    prefixes = []  # per token of the row, the token prefix ending at it
    for g in range(root, root + tree.subtree_segments()[root]):
        seg = tree.segments[g]
        prefixes += [tuple(seqs[seg.rep][: d + 1]) for d in range(seg.start, seg.end)]
    n = len(prefixes)
    ids = torch.zeros(width, dtype=torch.long)
    ids[:n] = torch.tensor([p[-1] for p in prefixes], dtype=torch.long)
    depths = torch.zeros(width, dtype=torch.long)
    depths[:n] = torch.tensor([len(p) - 1 for p in prefixes])
    mask = torch.eye(width, dtype=torch.bool)  # padding sees only itself
    for i, pi in enumerate(prefixes):
        for j, pj in enumerate(prefixes):
            mask[i, j] = len(pj) <= len(pi) and pi[: len(pj)] == pj
    return ids, depths, mask


@settings(max_examples=300, deadline=None)
@given(seq_lists, st.data())
def test_packed_rows_match_brute_force(seqs, data):
    tree = PrefixTree.from_sequences(seqs)
    if not tree.segments:
        return
    roots = data.draw(st.lists(st.integers(0, tree.n_segments - 1), min_size=1, max_size=4, unique=True),
                      label="row roots")
    span, size = tree.subtree_segments(), tree.subtree_tokens()
    tokens = [tree.tokens(s.index) for s in tree.segments]
    packed = pack_rows(tree, roots, span, size, tokens, "cpu")
    width = max(size[r] for r in roots)
    assert packed.ids.shape == (len(roots), width)
    assert packed.n_real == sum(size[r] for r in roots)
    multi = any(span[r] > 1 for r in roots)
    assert (packed.key_end is not None) == multi and (packed.positions is not None) == multi
    if multi:
        visible = PartMask(causal=True, key_end=packed.key_end).dense(width, width, "cpu")[:, 0]  # (batch, w, w)
    for b, r in enumerate(roots):
        ids, depths, mask = _brute_force(tree, seqs, r, width)
        assert torch.equal(packed.ids[b], ids)
        if multi:
            assert torch.equal(packed.positions[b, : size[r]], depths[: size[r]])
            assert torch.equal(visible[b], mask), f"row {b} (root {r})"
        else:  # one segment per row: plain causal
            assert torch.equal(mask[: size[r], : size[r]], torch.ones(size[r], size[r], dtype=torch.bool).tril())
