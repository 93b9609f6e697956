r"""Subtree rows: small subtrees forwarded as the rows of one batch.

Each row holds the segments of one or more subtrees (side by side, each in pre-order), right-padded to the longest
row. A token sits at its depth (its position id) and sees the path's keys plus the tokens of its row whose segment is
an ancestor-or-self of its own segment and that are not deeper. Pre-order makes every subtree a contiguous range of
columns, so the tokens that see a key are an interval: a token of segment `g` (first column `c`) is seen by the
columns from its own up to `key_end = c + subtree_tokens[g]` (exclusive), one int per key instead of a
`(width, width)` mask (the attention kernels take it as is, see `kernels.masks`). For a row `[a b | c | d]` with `c`
and `d` both children of `[a b]` (depths 0 1 | 2 | 2; `key_end = [4, 4, 3, 4]`):

```
            keys:  a  b  c  d
  query a:         1  0  0  0
  query b:         1  1  0  0
  query c:         1  1  1  0
  query d:         1  1  0  1
```

A row of one chain (a subtree that never branches) is plain causal; when every row is one chain the rows continue the
path causally and need neither depths nor `key_end`. Two subtrees side by side in one row (a *shared* row) are two
disjoint intervals: neither sees the other. A padding column gets `key_end = column + 1`: it sees only itself (never
an empty softmax row) and no real token sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree import PrefixTree
from .schedule import TreeShape, batch_width, causal_batch, shared_batch


@dataclass
class PackedRows:
    """A batch of subtree rows.

    Args:
        ids (`torch.LongTensor` of shape `(batch, width)`): token ids, right-padded with 0.
        columns (`dict[int, tuple[int, int]]`): segment -> (row, column of its first token), in pre-order per row.
        rows (`list[list[int]]`): the segments of each row, in pre-order.
        n_real (`int`): real (unpadded) tokens.
        positions (`torch.LongTensor` of shape `(batch, width)`, *optional*): depths; None when every row is one
            chain (the rows then continue the path causally).
        key_end (`torch.LongTensor` of shape `(batch, width)`, *optional*): with `positions`: token `j` of row `b` is
            seen by the columns `j .. key_end[b, j] - 1` of its row (see the module docstring).
        spans (`tuple`, *optional*): when some row holds several subtrees: per row, its subtrees' and its padding's
            `(lo, hi, tree)` column ranges (`tree`: a branching subtree, which needs its `key_end`), for the attention
            to run each on its own (`kernels.two_part_attention`).
    """

    ids: torch.Tensor
    columns: dict[int, tuple[int, int]]
    rows: list[list[int]]
    n_real: int
    positions: torch.Tensor | None = None
    key_end: torch.Tensor | None = None
    spans: tuple[tuple[tuple[int, int, bool], ...], ...] | None = None


def pack_rows(tree: PrefixTree, rows: tuple[tuple[int, ...], ...], shape: TreeShape, tokens: list[torch.Tensor],
              device) -> PackedRows:
    """Lay out subtrees as the rows of one batch: each row the subtrees of its roots side by side.

    Args:
        tree (`PrefixTree`): the batch.
        rows (`tuple[tuple[int, ...], ...]`): per row, the roots of the subtrees it holds.
        shape (`TreeShape`): the tree's per-segment facts.
        tokens (`list[torch.LongTensor]`): per segment, its ids `(length,)` on `device`.
    """
    segs = tree.segments
    span, size = shape.subtree_segments, shape.subtree_tokens
    layout = [[g for r in roots for g in range(r, r + span[r])] for roots in rows]
    width = batch_width(rows, shape)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)  # (batch, width)
    columns = {}
    for b, row in enumerate(layout):
        col = 0
        for g in row:
            columns[g] = (b, col)
            ids[b, col : col + segs[g].length] = tokens[g]
            col += segs[g].length
    packed = PackedRows(ids, columns, layout, sum(size[r] for roots in rows for r in roots))
    if not causal_batch(rows, shape):
        packed.positions, packed.key_end = tree_intervals(tree, layout, width, size, device)
    if shared_batch(rows):
        packed.spans = tuple(row_spans(roots, shape, width) for roots in rows)
    return packed


def row_spans(roots: tuple[int, ...], shape: TreeShape, width: int) -> tuple[tuple[int, int, bool], ...]:
    """`(lo, hi, tree)` of each subtree of a row and of its padding, in column order."""
    out, col = [], 0
    for r in roots:
        out.append((col, col + shape.subtree_tokens[r], not shape.chain[r]))
        col += shape.subtree_tokens[r]
    if col < width:
        out.append((col, width, False))  # padding: causal among itself, seen by no real token
    return tuple(out)

def tree_intervals(tree: PrefixTree, rows: list[list[int]], width: int, subtree_tokens: list[int],
                   device) -> tuple[torch.Tensor, torch.Tensor]:
    """Depths and `key_end`, each `(batch, width)`, of packed rows (see the module docstring)."""
    segs = tree.segments
    batch = len(rows)
    positions = torch.zeros(batch, width, dtype=torch.long)  # (batch, width)
    key_end = torch.arange(1, width + 1).repeat(batch, 1)  # (batch, width): padding sees only itself
    for b, row in enumerate(rows):
        col = 0
        for g in row:
            n = segs[g].length
            positions[b, col : col + n] = torch.arange(segs[g].start, segs[g].end)
            key_end[b, col : col + n] = col + subtree_tokens[g]
            col += n
    return positions.to(device), key_end.to(device)
