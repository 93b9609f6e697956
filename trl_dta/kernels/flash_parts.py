"""flash-attn (>= 2.7) part kernels, CUDA only: the path part (all folded queries over the path, no mask) and the own
part of causal rows (causal, sliding window, soft-capping), both with native GQA.

flash-attn's public functions hide the log-sum-exp from the backward, so this module calls its registered torch ops
`torch.ops.flashattn._flash_attn_forward/_backward` (flash-attn >= 2.7: separate left/right window sizes), which take
`(out, softmax_lse)` explicitly: the backward can then run with the *merged* statistics of the two parts. Layout:
`(batch, length, heads, head_dim)`; the log-sum-exp is `(batch, heads, q_len)` float32. The own part's queries and
keys have equal lengths, so flash's bottom-right causal alignment coincides with the plain causal mask; the sliding
window `k_pos > q_pos - w` is flash's `window_size_left = w - 1`. Packed subtree rows and windows that cut into the
path are not expressible here and fall back to the next kernel of the chain.
"""

from __future__ import annotations

import torch

from .masks import PartMask
from .torch_parts import PartKernel


def _ops():
    import flash_attn  # noqa: F401  (registers torch.ops.flashattn)

    return torch.ops.flashattn


def _window(mask: PartMask) -> tuple[int, int]:
    return (-1, -1) if mask.window is None else (mask.window - 1, 0)


def flash_forward(query, key, value, mask: PartMask, scale: float, softcap: float | None):
    left, right = _window(mask)
    q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))  # (B, L, H, D)
    out, lse, _, rng_state = _ops()._flash_attn_forward(
        q, k, v, 0.0, scale, mask.causal, left, right, softcap or 0.0, None, False)
    return out.transpose(1, 2), lse, rng_state  # (B, H, Lq, D), (B, H, Lq)


def flash_backward(grad_out, query, key, value, out, lse, aux, mask: PartMask, scale: float, softcap: float | None):
    left, right = _window(mask)
    q, k, v, do, o = (t.transpose(1, 2).contiguous() for t in (query, key, value, grad_out, out))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _ops()._flash_attn_backward(do, q, k, v, o, lse.float().contiguous(), dq, dk, dv, 0.0, scale, mask.causal, left,
                                right, softcap or 0.0, None, False, aux)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _available(device) -> bool:
    if device.type != "cuda":
        return False
    try:
        _ops()._flash_attn_forward  # noqa: B018  (flash-attn >= 2.7)
    except (ImportError, AttributeError, RuntimeError):
        return False
    return True


def _supports(query, key, mask: PartMask, softcap) -> bool:
    dim = query.shape[-1]
    causal_ok = not mask.causal or query.shape[2] == key.shape[2]
    # Without key_end the own part is causal rows, whose positions are consecutive: flash's column window is exact.
    # A windowed path part (positions of folded queries) has no flash form.
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dim % 8 == 0 and dim <= 256
            and mask.key_end is None and mask.key_length is None and causal_ok
            and (mask.window is None or mask.causal))


FLASH = PartKernel("flash", available=_available, supports=_supports, forward=flash_forward, backward=flash_backward)
