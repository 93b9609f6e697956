"""Which keys each query sees, for one attention *part*, described by a few integers per token instead of a matrix.

A part is one query block attending one key block. The two-part attention has two of them:

- the **path part**: every new query (all rows folded into one sequence) over the path's `P` keys. Every key is
  visible, except under a sliding window `w` that cuts into the path (key `p` is visible to a query at position `t`
  when `p > t - w`, the transformers convention);
- the **own part**: each row's queries over the row's own keys, causally (`j <= i`), and for packed subtree rows
  only within the key's subtree. Rows are laid out in pre-order, so the queries that see key `j` are exactly the
  columns `j <= i < key_end[j]`, where `key_end[j]` ends the subtree of `j`'s segment. One int per key replaces the
  `(length, length)` tree mask. For a row holding a root segment `a` (3 tokens) with children `b` and `c`:

```
                 keys:  a0 a1 a2 b0 b1 c0 c1     key_end = [7, 7, 7, 5, 5, 7, 7]
  query a0:              1  0  0  0  0  0  0
  query a2:              1  1  1  0  0  0  0
  query b1:              1  1  1  1  1  0  0     (b1 is column 4 < key_end of a*, b*; c* starts at column 5)
  query c0:              1  1  1  0  0  1  0     (column 5 >= key_end 5 of b0, b1)
```

Padding columns (after every real token of a row) get `key_end = column + 1`: they see only themselves, so no
softmax row is ever empty in the own part.

[`plan_masks`] gives the two masks of one call (causal rows or packed rows, a window or none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PartMask:
    """Visibility of one attention part: key `j` is visible to query `i` when every condition that is set holds.

    Args:
        causal (`bool`, *optional*, defaults to `False`): `j <= i` (query and key columns of the same row).
        key_end (`torch.LongTensor` of shape `(batch, key_len)`, *optional*): `i < key_end[j]` (packed subtree rows,
            with `causal`).
        q_pos (`torch.LongTensor` of shape `(batch or 1, query_len)`, *optional*): query positions, with `window`.
        k_pos (`torch.LongTensor` of shape `(batch or 1, key_len)`, *optional*): key positions, with `window`.
        window (`int`, *optional*): sliding window, `k_pos[j] > q_pos[i] - window`.
        key_length (`torch.LongTensor` of shape `(batch,)`, *optional*): key padding, `j < key_length[b]` (rows whose
            keys are right-padded to a common width, as the generation cache's rows are).
    """

    causal: bool = False
    key_end: torch.Tensor | None = None
    q_pos: torch.Tensor | None = None
    k_pos: torch.Tensor | None = None
    window: int | None = None
    key_length: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """True when the mask is all-visible or plain causal (no per-token data)."""
        return self.key_end is None and self.window is None and self.key_length is None

    def dense(self, q_len: int, k_len: int, device) -> torch.Tensor:
        """The boolean mask (True = visible), `(batch or 1, 1, q_len or 1, k_len)`: the query dimension is 1 when no
        condition depends on the query (key padding alone), and broadcasts."""
        q_idx = torch.arange(q_len, device=device)[:, None]  # (Lq, 1)
        k_idx = torch.arange(k_len, device=device)[None, :]  # (1, Lk)
        per_query = self.causal or self.key_end is not None or self.window is not None
        visible = torch.ones(1, 1, q_len if per_query else 1, k_len, dtype=torch.bool, device=device)
        if self.key_length is not None:
            visible = visible & (k_idx < self.key_length[:, None, None, None])  # (B, 1, Lq|1, Lk)
        if self.causal:
            visible = visible & (k_idx <= q_idx)
        if self.key_end is not None:
            visible = visible & (q_idx < self.key_end[:, None, None, :])  # (B, 1, Lq, Lk)
        if self.window is not None:
            visible = visible & (self.k_pos[:, None, None, :] > self.q_pos[:, None, :, None] - self.window)
        return visible


def key_end_from_row_mask(row_mask: torch.Tensor) -> torch.Tensor:
    """`key_end` `(batch, length)` of a pre-order tree mask `(batch, length, length)` (True = query i sees key j).

    In pre-order the queries that see key `j` are the contiguous columns `j .. key_end[j] - 1`; a mask of any other
    shape is refused (ValueError), so the conversion is exact or an error.
    """
    if row_mask.ndim != 3 or row_mask.shape[1] != row_mask.shape[2] or row_mask.dtype != torch.bool:
        raise ValueError(f"`row_mask` must be a boolean (batch, length, length) tensor, got {tuple(row_mask.shape)} "
                         f"{row_mask.dtype}.")
    length = row_mask.shape[-1]
    idx = torch.arange(length, device=row_mask.device)
    last = torch.where(row_mask, idx[None, :, None], -1).amax(dim=1)  # (B, Lk): last query that sees key j
    key_end = torch.maximum(last + 1, idx + 1)
    rebuilt = PartMask(causal=True, key_end=key_end).dense(length, length, row_mask.device)[:, 0]
    if not torch.equal(rebuilt, row_mask):
        raise ValueError("`row_mask` is not a pre-order tree mask (the queries that see a key must be the key's own "
                         "column and the columns right after it, padding seeing itself); lay the rows out in "
                         "pre-order.")
    return key_end


def plan_masks(path_len: int, batch: int, q_len: int, positions, key_end, window, device):
    """The masks of the two parts of one call: what each part's kernel must hide (its mask flags pick the kernel
    variant; `benchmarks/gpu/triton_variants.py` enumerates them from here).

    Args:
        path_len (`int`): keys of the shared path (0: no path part).
        batch (`int`), q_len (`int`): rows and queries per row.
        positions (`torch.LongTensor` of shape `(batch, q_len)`, *optional*): the queries' positions in packed rows;
            None for causal rows, which continue the path at `path_len`.
        key_end (`torch.LongTensor` of shape `(batch, q_len)`, *optional*): packed rows' subtree ends (per key).
        window (`int`, *optional*): the sliding window.
        device (`torch.device` or `str`): where the position tensors are built.

    Returns:
        `tuple[PartMask | None, PartMask]`: the path part's mask (None without a path) and the own part's mask.
    """
    causal_rows = positions is None
    if causal_rows:  # rows continue the path: positions P .. P + L - 1
        positions = path_len + torch.arange(q_len, device=device)[None]  # (1, L)
    path_mask = None
    if path_len:
        path_mask = PartMask()
        # Causal rows: the window hides path keys only if the last position reaches past it.
        if window is not None and (not causal_rows or path_len + q_len - 1 >= window):
            path_mask = PartMask(q_pos=positions.expand(batch, q_len).reshape(1, batch * q_len),  # folded queries
                                 k_pos=torch.arange(path_len, device=device)[None], window=window)
    if window is None or (causal_rows and q_len <= window):
        return path_mask, PartMask(causal=True, key_end=key_end)
    return path_mask, PartMask(causal=True, key_end=key_end, q_pos=positions, k_pos=positions, window=window)
