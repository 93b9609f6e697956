r"""The own part of shared rows, subtree by subtree.

A shared row holds several subtrees side by side (`engine/rows.py`); no key of one is visible to a query of another,
so the own part's `(width, width)` mask is block-diagonal and a kernel over the whole row computes every pair
between the blocks for nothing. `spans` names the blocks: per row, the `(lo, hi, tree)` column ranges that tile it
(`tree`: a branching subtree, which needs its `key_end`; a chain's span is plain causal, which every fused kernel has).
The own part then runs one kernel call per span, on the first kernel of the backend's chain that computes it, and the
results are concatenated back:

```
row:   [ chain A (5) | subtree B (3) | padding (2) ]     spans ((0, 5, False), (5, 8, True), (8, 10, False))
pairs: A x A causal, B x B under B's key_end, padding x padding causal; never A x B
```

The backward runs each span's kernel with the merged output and log-sum-exp slices (the ring-attention identity of
`two_part`), so the merge with the path part is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..precision import acc_dtype
from .masks import PartMask
from .torch_parts import PartKernel


@dataclass(frozen=True)
class Span:
    """One block of a shared row: its columns, its own mask, the kernel that computes it."""

    row: int
    lo: int
    hi: int
    mask: PartMask
    kernel: PartKernel


def check_spans(spans, batch: int, length: int, key_end) -> None:
    """Refuse spans that do not tile each row in order (`two_part_attention`'s `spans`)."""
    if key_end is None:
        raise ValueError("`spans` describe packed rows: pass them with `key_end` and `positions`.")
    if len(spans) != batch:
        raise ValueError(f"`spans` must hold one tuple of (lo, hi, tree) ranges per row ({batch}), got {len(spans)}.")
    for b, row in enumerate(spans):
        edge = 0
        for lo, hi, _ in row:
            if lo != edge or hi <= lo:
                raise ValueError(f"`spans[{b}]` must tile the row's columns 0 .. {length} in order, got {row}.")
            edge = hi
        if edge != length:
            raise ValueError(f"`spans[{b}]` must tile the row's columns 0 .. {length} in order, got {row}.")


def plan_spans(spans, own: PartMask, query, key, pick: Callable) -> tuple[Span, ...]:
    """The [`Span`]s of `spans` under the batch's own mask `own`; `pick(query, key, mask)` chooses each kernel."""
    out = []
    for b, row in enumerate(spans):
        for lo, hi, tree in row:
            mask = _span_mask(own, b, lo, hi, tree)
            part = (slice(b, b + 1), slice(None), slice(lo, hi))
            out.append(Span(b, lo, hi, mask, pick(query[part], key[part], mask)))
    return tuple(out)


def _span_mask(own: PartMask, b: int, lo: int, hi: int, tree: bool) -> PartMask:
    """The own mask of columns `lo .. hi - 1` of row `b` on their own: causal, with the subtree's `key_end` (made
    relative) for a branching subtree, and the window's positions."""
    key_end = own.key_end[b : b + 1, lo:hi] - lo if tree and own.key_end is not None else None
    if own.window is None:
        return PartMask(causal=True, key_end=key_end)
    return PartMask(causal=True, key_end=key_end, q_pos=own.q_pos[b : b + 1, lo:hi],
                    k_pos=own.k_pos[b : b + 1, lo:hi], window=own.window)


def spans_forward(query, key, value, spans: tuple[Span, ...], scale: float, softcap: float | None):
    """The own part span by span: `(out (batch, n_heads, length, head_dim), lse (batch, n_heads, length), aux)`."""
    outs, lses, aux = [], [], []
    for sp in spans:
        part = (slice(sp.row, sp.row + 1), slice(None), slice(sp.lo, sp.hi))
        out, lse, a = sp.kernel.forward(query[part], key[part], value[part], sp.mask, scale, softcap)
        outs.append(out)
        lses.append(lse.to(acc_dtype(query.dtype)))
        aux.append(a)
    return _join(outs, spans), _join(lses, spans), aux


def spans_backward(grad_out, query, key, value, out, lse, aux, spans: tuple[Span, ...], scale: float,
                   softcap: float | None):
    """Gradients of the own part's query, key and value, span by span, from the merged `out` and `lse`."""
    grads = [], [], []
    for sp, a in zip(spans, aux):
        part = (slice(sp.row, sp.row + 1), slice(None), slice(sp.lo, sp.hi))
        for acc, g in zip(grads, sp.kernel.backward(grad_out[part], query[part], key[part], value[part], out[part],
                                                    lse[part], a, sp.mask, scale, softcap)):
            acc.append(g)
    return tuple(_join(g, spans) for g in grads)


def _join(parts: list[torch.Tensor], spans: tuple[Span, ...]) -> torch.Tensor:
    """Per-span tensors `(1, heads, hi - lo, ...)` back into `(batch, heads, length, ...)` (spans tile every row in
    order)."""
    rows, row, last = [], [], spans[0].row
    for sp, t in zip(spans, parts):
        if sp.row != last:
            rows.append(torch.cat(row, dim=2) if len(row) > 1 else row[0])
            row, last = [], sp.row
        row.append(t)
    rows.append(torch.cat(row, dim=2) if len(row) > 1 else row[0])
    return torch.cat(rows) if len(rows) > 1 else rows[0]
