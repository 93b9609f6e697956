"""Plain reference for the attention kernels, and random cases (causal sibling rows, packed subtree rows).

The reference concatenates the path in front of every row, builds the visibility matrix from the rows' *trees*
(ancestor segments, not `key_end`), and runs a float64 softmax. Nothing here uses trl_dta.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Case:
    """One attention call: tensors as `two_part_attention` takes them, and the reference's visibility.

    `visible (batch, length, path_len + length)`: True where query i sees key j (path keys first)."""

    query: torch.Tensor
    path_key: torch.Tensor | None
    path_value: torch.Tensor | None
    key: torch.Tensor
    value: torch.Tensor
    positions: torch.Tensor | None
    key_end: torch.Tensor | None
    visible: torch.Tensor
    window: int | None
    softcap: float | None
    scale: float
    spans: tuple | None = None  # packed rows: per row, its trees' and its padding's `(lo, hi, tree)`

    def inputs(self):
        return [t for t in (self.query, self.path_key, self.path_value, self.key, self.value) if t is not None]

    def kwargs(self):
        return dict(scaling=self.scale, positions=self.positions, key_end=self.key_end, sliding_window=self.window,
                    softcap=self.softcap)


def reference_attention(case: Case, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`(batch, n_heads, length, head_dim)` in float64: concatenation, explicit mask, softmax. With `sinks`
    `(n_heads,)`, each head's softmax has one more column of logit `sinks[h]`, dropped afterwards (GPT-OSS's eager
    attention)."""
    query, key, value = case.query.double(), case.key.double(), case.value.double()
    batch, n_heads = query.shape[:2]
    if case.path_key is not None:
        key = torch.cat([case.path_key.double().expand(batch, -1, -1, -1), key], dim=2)
        value = torch.cat([case.path_value.double().expand(batch, -1, -1, -1), value], dim=2)
    groups = n_heads // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) * case.scale
    if case.softcap is not None:
        scores = torch.tanh(scores / case.softcap) * case.softcap
    scores = scores.masked_fill(~case.visible[:, None], float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ value
    column = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1] @ value


def _tensors(gen, batch, n_heads, n_kv, length, path_len, dim, dtype):
    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    path_k = path_v = None
    if path_len:
        path_k, path_v = rand(1, n_kv, path_len, dim), rand(1, n_kv, path_len, dim)
    return rand(batch, n_heads, length, dim), path_k, path_v, rand(batch, n_kv, length, dim), rand(batch, n_kv,
                                                                                                    length, dim)


def _window_ok(q_pos, k_pos, window):
    """`(batch, Lq, Lk)`: key position > query position - window (all True without a window)."""
    if window is None:
        return torch.ones(q_pos.shape[0], q_pos.shape[1], k_pos.shape[-1], dtype=torch.bool)
    return k_pos[:, None, :] > q_pos[:, :, None] - window


def causal_case(seed, *, batch, n_heads, n_kv, length, path_len, dim, dtype, window=None, softcap=None):
    """Sibling rows continuing a path causally (right-padded rows are plain causal rows)."""
    gen = torch.Generator().manual_seed(seed)
    q, pk, pv, k, v = _tensors(gen, batch, n_heads, n_kv, length, path_len, dim, dtype)
    q_pos = (path_len + torch.arange(length)).expand(batch, length)
    k_pos = torch.arange(path_len + length).expand(batch, -1)
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & _window_ok(q_pos, k_pos, window)
    return Case(q, pk, pv, k, v, None, None, visible, window, softcap, dim ** -0.5 * 1.3)


def random_tree_row(gen, max_segments=4, max_len=3):
    """A random tree of segments: `(parents, lengths)`, parents before children (parent -1 for the root)."""
    n = int(torch.randint(1, max_segments + 1, (1,), generator=gen))
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    lengths = [int(torch.randint(1, max_len + 1, (1,), generator=gen)) for _ in range(n)]
    return parents, lengths


def _preorder(parents):
    children = {i: [] for i in range(len(parents))}
    for i, p in enumerate(parents[1:], start=1):
        children[p].append(i)
    order, todo = [], [0]
    while todo:
        s = todo.pop()
        order.append(s)
        todo.extend(reversed(children[s]))
    return order


def packed_case(seed, *, batch, n_heads, n_kv, path_len, dim, dtype, window=None, softcap=None, pad=2, items=1):
    """Packed subtree rows: each row `items` random trees side by side (a shared row when `items > 1`), each laid out
    in pre-order, right-padded by up to `pad` columns. The case's `spans`: per row, each tree's `(lo, hi, tree)` and
    its padding's."""
    gen = torch.Generator().manual_seed(seed)
    rows = [[random_tree_row(gen) for _ in range(items)] for _ in range(batch)]
    length = max(sum(sum(lengths) for _, lengths in row) for row in rows) + pad
    positions = torch.zeros(batch, length, dtype=torch.long)
    key_end = torch.arange(1, length + 1).repeat(batch, 1)  # padding sees itself
    own = torch.eye(length, dtype=torch.bool).repeat(batch, 1, 1)
    spans = []
    for b, row in enumerate(rows):
        base, row_spans = 0, []
        for parents, lengths in row:
            _lay_out_tree(parents, lengths, base, path_len, positions[b], key_end[b], own[b])
            row_spans.append((base, base + sum(lengths), len(parents) > 1))
            base += sum(lengths)
        if base < length:
            row_spans.append((base, length, True))  # padding sees only itself (`key_end`), as in `visible`
        spans.append(tuple(row_spans))
    q, pk, pv, k, v = _tensors(gen, batch, n_heads, n_kv, length, path_len, dim, dtype)
    k_pos = torch.cat([torch.arange(path_len).expand(batch, -1), positions], dim=1)
    visible = torch.cat([torch.ones(batch, length, path_len, dtype=torch.bool), own], dim=2)
    visible &= _window_ok(positions, k_pos, window)
    return Case(q, pk, pv, k, v, positions, key_end, visible, window, softcap, dim ** -0.5, tuple(spans))


def _lay_out_tree(parents, lengths, base, path_len, positions, key_end, own):
    """Write one tree's depths, `key_end` and visibility into a row from column `base` on (in pre-order)."""
    order = _preorder(parents)
    start, depth, col = {}, {}, base
    for s in order:
        depth[s] = 0 if parents[s] < 0 else depth[parents[s]] + lengths[parents[s]]
        start[s] = col
        col += lengths[s]
    seg_of = [s for s in order for _ in range(lengths[s])]
    offset = [t for s in order for t in range(lengths[s])]

    def ancestors(s):
        out = {s}
        while parents[s] >= 0:
            s = parents[s]
            out.add(s)
        return out

    def subtree_tokens(s):
        return sum(lengths[t] for t in range(len(parents)) if s in ancestors(t))

    for i, (si, oi) in enumerate(zip(seg_of, offset)):
        positions[base + i] = path_len + depth[si] + oi
        key_end[base + i] = start[si] + subtree_tokens(si)
        for j, (sj, oj) in enumerate(zip(seg_of, offset)):
            own[base + i, base + j] = sj in ancestors(si) and (sj != si or oj <= oi)
