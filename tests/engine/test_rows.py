"""Subtree rows against a brute-force construction from the sequences: token j is visible to token i iff both belong
to the same subtree of the row and the prefix ending at j is a prefix of the prefix ending at i (the rows' `key_end`
intervals drawn as a mask). Rows hold one subtree or several side by side (shared rows)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_dta.engine.rows import pack_rows
from trl_dta.engine.schedule import TreeShape, causal_batch
from trl_dta.kernels import PartMask
from trl_dta.tree import PrefixTree

seq_lists = st.lists(st.lists(st.integers(0, 3), max_size=9), min_size=1, max_size=10)


def _brute_force(tree: PrefixTree, seqs: list[list[int]], roots: tuple[int, ...], width: int):
    """Ids, depths and visibility `(width, width)` of the row holding the subtrees of `roots`, from the sequences."""
    prefixes, owner = [], []  # per token of the row, the token prefix ending at it and the subtree it belongs to
    for k, root in enumerate(roots):
        for g in range(root, root + tree.subtree_segments()[root]):
            seg = tree.segments[g]
            prefixes += [tuple(seqs[seg.rep][: d + 1]) for d in range(seg.start, seg.end)]
            owner += [k] * seg.length
    n = len(prefixes)
    ids = torch.zeros(width, dtype=torch.long)
    ids[:n] = torch.tensor([p[-1] for p in prefixes], dtype=torch.long)
    depths = torch.zeros(width, dtype=torch.long)
    depths[:n] = torch.tensor([len(p) - 1 for p in prefixes])
    mask = torch.eye(width, dtype=torch.bool)  # padding sees only itself
    for i, pi in enumerate(prefixes):
        for j, pj in enumerate(prefixes):
            mask[i, j] = owner[i] == owner[j] and len(pj) <= len(pi) and pi[: len(pj)] == pj
    return ids, depths, mask


@settings(max_examples=300, deadline=None)
@given(seq_lists, st.data())
def test_rows_match_brute_force(seqs, data):
    tree = PrefixTree.from_sequences(seqs)
    if not tree.segments:
        return
    span, size = tree.subtree_segments(), tree.subtree_tokens()
    # disjoint subtrees (none inside another), split into rows of one or more
    picked = data.draw(st.lists(st.integers(0, tree.n_segments - 1), min_size=1, max_size=5, unique=True),
                       label="roots")
    roots = [r for r in picked if not any(o != r and o <= r < o + span[o] for o in picked)]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(roots) - 1, 1)), max_size=len(roots) - 1), label="cuts"))
    bounds = [0, *[c for c in cuts if c < len(roots)], len(roots)]
    rows = tuple(tuple(roots[a:b]) for a, b in zip(bounds, bounds[1:]) if a < b)
    shape = TreeShape.of(tree)
    causal = causal_batch(rows, shape)
    tokens = [tree.tokens(s.index) for s in tree.segments]
    packed = pack_rows(tree, rows, shape, tokens, "cpu")
    width = max(sum(size[r] for r in row) for row in rows)
    assert packed.ids.shape == (len(rows), width)
    assert packed.n_real == sum(size[r] for r in roots)
    assert (packed.key_end is None) == causal and (packed.positions is None) == causal
    assert (packed.spans is not None) == any(len(row) > 1 for row in rows)
    if not causal:
        visible = PartMask(causal=True, key_end=packed.key_end).dense(width, width, "cpu")[:, 0]  # (batch, w, w)
    for b, row in enumerate(rows):
        ids, depths, mask = _brute_force(tree, seqs, row, width)
        n = sum(size[r] for r in row)
        assert torch.equal(packed.ids[b], ids)
        if causal:  # one chain per row: plain causal
            assert len(row) == 1 and torch.equal(mask[:n, :n], torch.ones(n, n, dtype=torch.bool).tril())
        else:
            assert torch.equal(packed.positions[b, :n], depths[:n])
            assert torch.equal(visible[b], mask), f"row {b} (roots {row})"
        if packed.spans is not None:  # no key visible across spans; a chain's span is plain causal
            for lo, hi, tree_span in packed.spans[b]:
                assert not mask[lo:hi, :lo].any() and not mask[hi:, lo:hi].any()
                if not tree_span:
                    assert torch.equal(mask[lo:hi, lo:hi], torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()) \
                        or hi > n  # padding: causal among itself in the spans, only itself in the mask
