"""Part kernels on plain PyTorch: `math` (any mask, soft-capping, any dtype) and `torch` (PyTorch's own fused kernels).

Every part kernel has the same contract, which lets the two-part op merge parts and run the ring-attention backward:

- `forward(query, key, value, mask, scale, softcap) -> (out, lse, aux)`: `query (batch, n_heads, q_len, head_dim)`,
  `key`/`value (batch, n_kv_heads, k_len, head_dim)` (GQA when `n_heads` is a multiple of `n_kv_heads`, keys never
  repeated), `out` like `query`, `lse (batch, n_heads, q_len)` in the accumulation dtype (float64 for float64
  inputs, else float32); a query that sees no key gets `out = 0`, `lse = -inf`; `aux` is whatever the kernel's
  backward needs from its forward (or None).
- `backward(grad_out, query, key, value, out, lse, aux, mask, scale, softcap) -> (grad_query, grad_key,
  grad_value)`, where `out`/`lse` may be the *merged* output and log-sum-exp of several parts: the result is then
  this part's share of the gradients of the joint softmax.

`math` materialises the scores of one part, `(batch, n_heads, q_len, k_len)` (transiently, never saved), in the
accumulation dtype; it is the exact fallback for what the fused kernels lack (soft-capping, CUDA float32). `torch`
calls `aten._scaled_dot_product_flash_attention_for_cpu` (and its backward) on CPU, which take `out`/`logsumexp`
explicitly, support GQA and any float dtype including float64, and an additive float mask; on CUDA it calls
`aten._scaled_dot_product_flash_attention` (half precision, no mask beyond causal).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..precision import acc_dtype, is_half
from .masks import PartMask

NEG_INF = float("-inf")


class PartKernel(NamedTuple):
    """A forward/backward pair for one attention part, and what it supports.

    Args:
        name (`str`): the kernel's name (shown in errors and tables).
        available (`Callable[[torch.device], bool]`): whether it can run on the device here (library installed).
        supports (`Callable[[Tensor, Tensor, PartMask, float | None], bool]`): whether it computes this part
            exactly (query, key, mask, softcap).
        forward, backward: see the module docstring.
    """

    name: str
    available: Callable
    supports: Callable
    forward: Callable
    backward: Callable


def _grouped(x: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """`(batch, n_heads, length, d)` -> `(batch, n_kv_heads, groups, length, d)` (a view for contiguous heads)."""
    batch, n_heads, length, dim = x.shape
    return x.reshape(batch, n_kv_heads, n_heads // n_kv_heads, length, dim)


def _math_scores(query, key, mask: PartMask, scale, softcap):
    """Masked (soft-capped) scores `(batch, n_kv_heads, groups, q_len, k_len)` and the tanh of the soft-cap."""
    acc = acc_dtype(query.dtype)
    q = _grouped(query, key.shape[1]).to(acc)  # (B, Hkv, G, Lq, D)
    k = key.to(acc)[:, :, None]  # (B, Hkv, 1, Lk, D)
    scores = q @ k.transpose(-1, -2) * scale  # (B, Hkv, G, Lq, Lk)
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(scores / softcap)
        scores = tanh * softcap
    visible = mask.dense(query.shape[2], key.shape[2], query.device)[:, :, None]  # (B|1, 1, 1, Lq, Lk)
    return scores.masked_fill(~visible, NEG_INF), tanh


def _probs(scores, lse):
    """`exp(scores - lse)`, zero for queries that see no key (`lse = -inf`)."""
    return torch.exp(scores - lse.masked_fill(lse == NEG_INF, 0.0)[..., None])


def math_forward(query, key, value, mask: PartMask, scale: float, softcap: float | None):
    batch, n_heads, q_len, dim = query.shape
    scores, _ = _math_scores(query, key, mask, scale, softcap)  # (B, Hkv, G, Lq, Lk)
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, G, Lq), -inf for a query without keys
    out = _probs(scores, lse) @ value.to(scores.dtype)[:, :, None]  # (B, Hkv, G, Lq, D)
    return out.reshape(batch, n_heads, q_len, dim).to(query.dtype), lse.reshape(batch, n_heads, q_len), None


def math_backward(grad_out, query, key, value, out, lse, aux, mask: PartMask, scale: float, softcap: float | None):
    n_kv = key.shape[1]
    scores, tanh = _math_scores(query, key, mask, scale, softcap)
    acc = scores.dtype
    probs = _probs(scores, _grouped(lse[..., None], n_kv)[..., 0])  # (B, Hkv, G, Lq, Lk)
    d_out = _grouped(grad_out, n_kv).to(acc)  # (B, Hkv, G, Lq, D)
    delta = (d_out * _grouped(out, n_kv).to(acc)).sum(-1, keepdim=True)  # (B, Hkv, G, Lq, 1)
    grad_value = (probs.transpose(-1, -2) @ d_out).sum(2)  # (B, Hkv, Lk, D)
    d_scores = probs * (d_out @ value.to(acc)[:, :, None].transpose(-1, -2) - delta)
    if tanh is not None:
        d_scores = d_scores * (1 - tanh * tanh)
    d_scores = d_scores * scale
    grad_query = (d_scores @ key.to(acc)[:, :, None]).reshape(query.shape)
    grad_key = (d_scores.transpose(-1, -2) @ _grouped(query, n_kv).to(acc)).sum(2)  # (B, Hkv, Lk, D)
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


MATH = PartKernel("math", available=lambda device: True, supports=lambda query, key, mask, softcap: True,
                  forward=math_forward, backward=math_backward)


def _additive_mask(query, key, mask: PartMask):
    """`(is_causal, additive float mask (batch or 1, 1, q_len, k_len) or None, rows without keys or None)`."""
    if mask.plain:
        return mask.causal, None, None
    visible = mask.dense(query.shape[2], key.shape[2], query.device)
    additive = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(~visible, NEG_INF)
    return False, additive, ~visible.any(-1)  # (B|1, 1, Lq)


def cpu_forward(query, key, value, mask: PartMask, scale: float, softcap: float | None):
    is_causal, additive, empty = _additive_mask(query, key, mask)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=additive, scale=scale
    )  # (B, H, Lq, D), (B, H, Lq)
    if empty is not None:  # the kernel reports lse = 0 (out = 0) for a query that sees no key
        lse = lse.masked_fill(empty, NEG_INF)
    return out, lse, None


def cpu_backward(grad_out, query, key, value, out, lse, aux, mask: PartMask, scale: float, softcap: float | None):
    is_causal, additive, _ = _additive_mask(query, key, mask)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, lse, 0.0, is_causal, attn_mask=additive, scale=scale
    )


def cuda_forward(query, key, value, mask: PartMask, scale: float, softcap: float | None):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        query, key, value, 0.0, mask.causal, False, scale=scale
    )  # (B, H, Lq, D), (B, H, Lq) float32
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def cuda_backward(grad_out, query, key, value, out, lse, aux, mask: PartMask, scale: float, softcap: float | None):
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out.contiguous(), query, key, value, out.contiguous(), lse.contiguous(), cum_q, cum_k, max_q, max_k,
        0.0, mask.causal, seed, offset, scale=scale
    )


def _torch_forward(query, key, value, mask, scale, softcap):
    return (cuda_forward if query.is_cuda else cpu_forward)(query, key, value, mask, scale, softcap)


def _torch_backward(grad_out, query, key, value, out, lse, aux, mask, scale, softcap):
    fn = cuda_backward if query.is_cuda else cpu_backward
    return fn(grad_out, query, key, value, out, lse, aux, mask, scale, softcap)


def _torch_supports(query, key, mask: PartMask, softcap) -> bool:
    if softcap is not None:
        return False
    if query.device.type == "cpu":
        return True
    # CUDA flash: half precision, head_dim a multiple of 8 up to 256, causal only for square parts, no other mask.
    return (query.is_cuda and is_half(query.dtype) and query.shape[-1] % 8 == 0
            and query.shape[-1] <= 256 and mask.plain and (not mask.causal or query.shape[2] == key.shape[2]))


TORCH = PartKernel("torch", available=lambda device: device.type in ("cpu", "cuda"), supports=_torch_supports,
                   forward=_torch_forward, backward=_torch_backward)
