"""`attention.py`: `dta_attention` on every backend that runs here against a plain softmax over `[path keys ; new
keys]` (GQA, sliding windows, soft-capping, padded rows, packed subtree rows), outputs and gradients, float64; and the
reference backend's masks against brute-force constructions from explicit positions."""

from __future__ import annotations

import itertools

import pytest
import torch

from reference import max_rel_err
from trl_dta.kernels import available_backends, key_end_from_row_mask
from trl_dta.kernels.sdpa import _mask
from trl_dta.kv_stack import Frame, KVStack
from trl_dta.modeling.attention import AttentionContext, dta_attention
from trl_dta.refusal import DTAUnsupportedError

BACKENDS = [pytest.param(name, marks=pytest.mark.skipif(name not in available_backends("cpu"),
                                                        reason=f"{name} does not run here"))
            for name in ("sdpa", "torch", "triton")]

HEAD_DIM = 8


def brute_causal(q_len: int, prefix_len: int, window: int | None) -> torch.Tensor:
    """Query `i` sits at position `prefix_len + i`; key `j` at position `j`. Visible: not later, and (windowed)
    fewer than `window` positions back."""
    mask = torch.zeros(q_len, prefix_len + q_len, dtype=torch.bool)
    for i, j in itertools.product(range(q_len), range(prefix_len + q_len)):
        q_pos = prefix_len + i
        mask[i, j] = j <= q_pos and (window is None or q_pos - j < window)
    return mask


@pytest.mark.parametrize("window", [None, 1, 3, 100])
@pytest.mark.parametrize("prefix_len", [0, 2, 7])
@pytest.mark.parametrize("q_len", [1, 3, 5])
def test_bottom_right_causal_mask(q_len, prefix_len, window):
    """The reference backend's mask for causal rows continuing the path."""
    got = _mask(q_len, prefix_len, None, None, window, "cpu")
    assert torch.equal(got[0, 0], brute_causal(q_len, prefix_len, window))


def test_mask_drawing_in_the_module_docstring():
    assert _mask(3, 2, None, None, None, "cpu")[0, 0].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0],
                                                                        [1, 1, 1, 1, 1]]


def packed_row(parents: list[int], prefix_len: int, width: int):
    """A packed subtree row from explicit token parents (`-1`: continues the path), right-padded to `width`.

    Returns positions `(width,)` (depths; padding repeats the last depth), the row mask `(width, width)` (a real token
    sees its ancestors-or-self, a padding token only itself) and the brute-force full mask `(width, prefix_len +
    width)` before windows: every path key for real tokens, and the row mask."""
    n = len(parents)
    depth, ancestors = [], []
    for t, p in enumerate(parents):
        depth.append(prefix_len if p < 0 else depth[p] + 1)
        ancestors.append({t} | (ancestors[p] if p >= 0 else set()))
    positions = torch.tensor(depth + [depth[-1]] * (width - n))
    row = torch.eye(width, dtype=torch.bool)
    for t in range(n):
        for a in ancestors[t]:
            row[t, a] = True
    full = torch.cat([torch.ones(width, prefix_len, dtype=torch.bool), row], dim=1)
    return positions, row, full


# Two packed rows: a root segment of 3 tokens with two children of 2 and 1 tokens (pre-order), and a chain of 4.
ROWS = ([-1, 0, 1, 2, 3, 2], [-1, 0, 1, 2])


@pytest.mark.parametrize("window", [None, 1, 2, 4])
@pytest.mark.parametrize("prefix_len", [0, 3])
def test_packed_mask(prefix_len, window):
    """The reference backend's mask for packed rows, from the rows' `key_end` (exactly their tree mask)."""
    width = max(len(r) for r in ROWS) + 1  # one padding column at least
    layouts = [packed_row(r, prefix_len, width) for r in ROWS]
    positions = torch.stack([p for p, _, _ in layouts])
    key_end = key_end_from_row_mask(torch.stack([m for _, m, _ in layouts]))
    got = _mask(width, prefix_len, positions, key_end, window, "cpu")
    assert got.shape == (len(ROWS), 1, width, prefix_len + width)
    for b, (pos, _, full) in enumerate(layouts):
        k_pos = torch.cat([torch.arange(prefix_len), pos])
        want = full.clone()
        if window is not None:
            for i, j in itertools.product(range(width), range(prefix_len + width)):
                want[i, j] &= pos[i] - k_pos[j] < window
        assert torch.equal(got[b, 0], want), f"row {b}"
        assert got[b, 0].any(-1).all()  # never an empty softmax row


# ---------------------------------------------------------------------------------------------- dta_attention


class Layer(torch.nn.Module):
    """What `dta_attention` reads from the calling module."""

    def __init__(self, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx


def reference_attention(q, k, v, mask, scaling, softcap=None):
    """Plain softmax attention: q `(heads, L, D)`, k/v `(kv_heads, S, D)`, mask `(L, S)`; returns `(L, heads, D)`."""
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    scores = q @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def tensors(batch, heads, kv_heads, length, prefix_len, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)

    q, k, v = rnd(batch, heads, length, HEAD_DIM), rnd(batch, kv_heads, length, HEAD_DIM), rnd(batch, kv_heads,
                                                                                              length, HEAD_DIM)
    frames = [(rnd(1, kv_heads, n, HEAD_DIM), rnd(1, kv_heads, n, HEAD_DIM)) for n in
              ([prefix_len - prefix_len // 2, prefix_len // 2] if prefix_len else [])]
    return q, k, v, frames


def stack_of(frames) -> KVStack:
    stack = KVStack(1)
    for k, v in frames:
        stack.push(Frame([k], [v], k.shape[2]))
    return stack


def grads(outputs, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    upstream = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outputs]
    return torch.autograd.grad(outputs, inputs, upstream)


CASES = {
    "mha": dict(heads=4, kv_heads=4),
    "gqa": dict(heads=4, kv_heads=2),
    "gqa-window": dict(heads=4, kv_heads=1, window=3),
    "softcap": dict(heads=4, kv_heads=2, softcap=2.0),
    "softcap-window": dict(heads=2, kv_heads=2, softcap=2.0, window=4),
}


@pytest.mark.parametrize("prefix_len", [0, 5])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_dta_attention_matches_softmax_over_path_and_new_keys(backend, case, prefix_len):
    """Batch of 2 rows on one path: row 1 has 6 real tokens, row 0 has 4 and is right-padded; each real query's output
    (and every gradient reaching real tokens and the path) equals plain attention over the row alone."""
    kw = CASES[case]
    heads, kv_heads, window, softcap = kw["heads"], kw["kv_heads"], kw.get("window"), kw.get("softcap")
    length, real = 6, [4, 6]
    q, k, v, frames = tensors(2, heads, kv_heads, length, prefix_len)
    ctx = AttentionContext(stack_of(frames), backend=backend)
    out, weights = dta_attention(Layer(), q, k, v, None, scaling=0.3, sliding_window=window, softcap=softcap,
                                 dta_ctx=ctx)
    assert weights is None and out.shape == (2, length, heads, HEAD_DIM)
    assert ctx.calls == 1 and ctx.record[0][0] is k and ctx.record[0][1] is v
    path_k = torch.cat([f[0] for f in frames], 2) if frames else k.new_zeros(1, kv_heads, 0, HEAD_DIM)
    path_v = torch.cat([f[1] for f in frames], 2) if frames else v.new_zeros(1, kv_heads, 0, HEAD_DIM)
    leaves = [q, k, v] + [t for f in frames for t in f]
    got_out = [out[b, : real[b]] for b in range(2)]
    want_out = []
    for b in range(2):
        n = real[b]
        keys, values = torch.cat([path_k[0], k[b, :, :n]], 1), torch.cat([path_v[0], v[b, :, :n]], 1)
        want_out.append(reference_attention(q[b, :, :n], keys, values, brute_causal(n, prefix_len, window), 0.3,
                                            softcap))
    for b in range(2):
        assert max_rel_err(got_out[b], want_out[b]) <= 1e-12, f"row {b}"
    got_g = grads(got_out, leaves)
    want_g = grads(want_out, leaves)
    for name, a, w in zip(["q", "k", "v"] + [f"frame{i}" for i in range(len(leaves) - 3)], got_g, want_g):
        assert max_rel_err(a, w) <= 1e-12, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows_match_softmax_over_ancestors(backend):
    """Packed subtree rows (`key_end`, and a window): each token attends to the path and its ancestors-or-self."""
    prefix_len, window, width = 3, 4, 7
    layouts = [packed_row(r, prefix_len, width) for r in ROWS]
    positions = torch.stack([p for p, _, _ in layouts])
    key_end = key_end_from_row_mask(torch.stack([m for _, m, _ in layouts]))
    q, k, v, frames = tensors(2, 4, 2, width, prefix_len, seed=3)
    ctx = AttentionContext(stack_of(frames), positions=positions, key_end=key_end, backend=backend)
    out, _ = dta_attention(Layer(), q, k, v, None, scaling=0.4, sliding_window=window, dta_ctx=ctx)
    path_k, path_v = torch.cat([f[0] for f in frames], 2)[0], torch.cat([f[1] for f in frames], 2)[0]
    for b, (pos, _, full) in enumerate(layouts):
        n = len(ROWS[b])
        k_pos = torch.cat([torch.arange(prefix_len), pos])
        mask = full & (pos[:, None] - k_pos[None, :] < window)
        want = reference_attention(q[b], torch.cat([path_k, k[b]], 1), torch.cat([path_v, v[b]], 1), mask, 0.4)
        assert max_rel_err(out[b, :n], want[:n]) <= 1e-12, f"row {b}"


def test_refusals():
    q, k, v, _ = tensors(1, 2, 2, 3, 0)
    ctx = AttentionContext(KVStack(1))
    with pytest.raises(RuntimeError, match="without a DTAEngine context"):
        dta_attention(Layer(), q, k, v, None)
    with pytest.raises(ValueError, match="dropout"):
        dta_attention(Layer(), q, k, v, None, dropout=0.1, dta_ctx=ctx)
    with pytest.raises(DTAUnsupportedError, match="attn_bias"):  # a keyword DTA does not implement
        dta_attention(Layer(), q, k, v, None, dta_ctx=ctx, attn_bias=torch.zeros(2))
