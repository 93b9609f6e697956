"""A CPU stand-in for flash-attn 2.8.3's registered ops: the same op names and schemas (the signatures below are
flash-attn 2.8.3's, `flash_attn/flash_attn_interface.py`, from which `torch.library.custom_op` infers the schema), and
flash-attn's semantics, computed with plain float32 math on CPU:

- `q, k, v` `(batch, seqlen, heads, head_dim)` with the last dimension contiguous, float16 or bfloat16, head_dim a
  multiple of 8, query heads a multiple of key heads (GQA);
- `causal` aligns bottom-right (query `i` of `Lq` sees keys up to `Lk - Lq + i`); the window `(left, right)` keeps
  keys `j` with `i + Lk - Lq - left <= j <= i + Lk - Lq + right` (`-1`: unbounded); `softcap > 0` caps the scaled
  scores at `softcap * tanh(s / softcap)`;
- the forward returns `(out, softmax_lse (batch, heads, Lq) float32, S_dmask (0,), rng_state (2,) int64)`;
- the backward writes `dq, dk, dv` in place from the *given* `out` and `softmax_lse` (`P = exp(S - lse)`,
  `dS = P * (dO V^T - rowsum(dO * O))`) and returns `softmax_d (batch, heads, round_up(Lq, 128))` float32.

Anything else (other dtypes, non-contiguous inputs, dropout, ALiBi) raises, as flash-attn would, so that a caller
that passes its arguments in another order or layout fails here. Imports nothing from trl_dta.
"""

from __future__ import annotations

import torch

# flash-attn 2.8.3's op names, in the namespace it registers them under.
NAMESPACE = "flash_attn"


def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    return_softmax: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(q, k, v, dropout_p, alibi_slopes)
    scores, tanh = _scores(q, k, softmax_scale, causal, window_size_left, window_size_right, softcap)
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, Lq)
    out = torch.exp(scores - lse[..., None]) @ _heads(v, q.shape[2]).float()  # (B, H, Lq, D)
    S_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
    return out.transpose(1, 2).to(q.dtype).contiguous(), lse, S_dmask, torch.zeros(2, dtype=torch.int64)


def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
) -> torch.Tensor:
    _check(q, k, v, dropout_p, alibi_slopes)
    batch, q_len, n_heads, dim = q.shape
    if softmax_lse.shape != (batch, n_heads, q_len) or softmax_lse.dtype != torch.float32:
        raise RuntimeError(f"softmax_lse must be (batch, heads, seqlen_q) float32, got {tuple(softmax_lse.shape)} "
                           f"{softmax_lse.dtype}")
    if any(t is None or t.shape != s.shape for t, s in ((dq, q), (dk, k), (dv, v))):
        raise RuntimeError("dq, dk, dv must be preallocated like q, k, v")
    scores, tanh = _scores(q, k, softmax_scale, causal, window_size_left, window_size_right, softcap)
    probs = torch.exp(scores - softmax_lse[..., None])  # (B, H, Lq, Lk), the given statistics
    d_out, o = dout.transpose(1, 2).float(), out.transpose(1, 2).float()  # (B, H, Lq, D)
    delta = (d_out * o).sum(-1, keepdim=True)
    keys, values = _heads(k, n_heads).float(), _heads(v, n_heads).float()
    d_scores = probs * (d_out @ values.transpose(-1, -2) - delta)
    if tanh is not None:
        d_scores = d_scores * (1 - tanh * tanh)
    d_scores = d_scores * softmax_scale
    groups = n_heads // k.shape[2]
    grad_q = d_scores @ keys  # (B, H, Lq, D)
    grad_k = (d_scores.transpose(-1, -2) @ q.transpose(1, 2).float())  # (B, H, Lk, D), summed over groups below
    grad_v = probs.transpose(-1, -2) @ d_out
    dq.copy_(grad_q.transpose(1, 2))
    dk.copy_(grad_k.unflatten(1, (k.shape[2], groups)).sum(2).transpose(1, 2))
    dv.copy_(grad_v.unflatten(1, (k.shape[2], groups)).sum(2).transpose(1, 2))
    return torch.zeros(batch, n_heads, (q_len + 127) // 128 * 128, dtype=torch.float32)


def _check(q, k, v, dropout_p, alibi_slopes):
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("FlashAttention only supports fp16 and bf16 data type")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise RuntimeError("Input tensor must have contiguous last dimension")
    if q.ndim != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise RuntimeError(f"q (batch, seqlen_q, heads, d) and k, v (batch, seqlen_k, heads_k, d) expected, got "
                           f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2] or q.shape[3] % 8:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query; head_dim % 8 == 0")
    if dropout_p != 0.0 or alibi_slopes is not None:
        raise RuntimeError("the stand-in has no dropout and no ALiBi")


def _heads(x, n_heads):
    """`(B, L, H_kv, D)` -> `(B, n_heads, L, D)`, each key head serving its group of query heads."""
    return x.transpose(1, 2).repeat_interleave(n_heads // x.shape[2], dim=1)


def _scores(q, k, scale, causal, left, right, softcap):
    """Masked (soft-capped) float32 scores `(B, H, Lq, Lk)` and the tanh of the soft-cap (or None)."""
    q_len, k_len = q.shape[1], k.shape[1]
    scores = q.transpose(1, 2).float() @ _heads(k, q.shape[2]).float().transpose(-1, -2) * scale
    tanh = None
    if softcap > 0:
        tanh = torch.tanh(scores / softcap)
        scores = tanh * softcap
    i = torch.arange(q_len)[:, None] + (k_len - q_len)  # each query's aligned column
    j = torch.arange(k_len)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool)
    if causal:  # flash-attn sets the right window to 0 under causal
        right = 0
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    return scores.masked_fill(~visible, float("-inf")), tanh


def register(namespace: str = NAMESPACE) -> torch.library.Library:
    """Register both ops under `namespace` with CPU kernels; `lib._destroy()` removes them again."""
    lib = torch.library.Library(namespace, "FRAGMENT")
    lib.define("_flash_attn_forward" + torch.library.infer_schema(_flash_attn_forward, mutates_args=()))
    lib.define("_flash_attn_backward" + torch.library.infer_schema(_flash_attn_backward,
                                                                   mutates_args=("dq", "dk", "dv")))
    lib.impl("_flash_attn_forward", _flash_attn_forward, "CPU")
    lib.impl("_flash_attn_backward", _flash_attn_backward, "CPU")
    return lib
