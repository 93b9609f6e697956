"""flash-attn (>= 2.7) part kernels: the path part (all folded queries over the path, no mask) and the own part of
causal rows (causal, sliding window, soft-capping), both with native GQA.

flash-attn's public functions hide the log-sum-exp from the backward, so this module calls its registered torch ops,
which take `(out, softmax_lse)` explicitly: the backward can then run with the *merged* statistics of the two parts.
Written against flash-attn 2.8.3, which registers (`torch.library.custom_op`, CUDA kernels)

```
flash_attn::_flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                                softcap, alibi_slopes, return_softmax) -> (out, softmax_lse, S_dmask, rng_state)
flash_attn::_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq!, dk!, dv!, dropout_p, softmax_scale, causal,
                                 window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                                 rng_state) -> softmax_d
```

(2.7.0 to 2.7.2 named the namespace `flashattn`, with the same arguments; both are looked up). Layout: `(batch,
length, heads, head_dim)`; the log-sum-exp is `(batch, heads, q_len)` float32; the backward writes into the `dq`,
`dk`, `dv` it is given. The own part's queries and keys have equal lengths, so flash's bottom-right causal alignment
coincides with the plain causal mask; the sliding window `k_pos > q_pos - w` is flash's `window_size_left = w - 1`.
Packed subtree rows and windows that cut into the path are not expressible here and fall back to the next kernel of
the chain.

The backend is available on a device when the ops are registered with a kernel for it: flash-attn's on CUDA (its
import registers them); a package or test that registers ops of the same names and schemas for another device
(`tests/attention_kernels/flash_standin.py` does, on CPU) is used the same way. flash-attn is never built here (PyPI has
only its source distribution, a 30-minute CUDA build): install a prebuilt wheel.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from ..precision import is_half
from .masks import PartMask
from .torch_parts import PartKernel

NAMESPACES = ("flash_attn", "flashattn")  # flash-attn >= 2.7.3; 2.7.0 - 2.7.2
_DISPATCH_KEYS = {"cuda": "CUDA", "cpu": "CPU"}


def _registered():
    """`(forward, backward)` op packets of the first namespace that has both, or None."""
    for name in NAMESPACES:
        namespace = getattr(torch.ops, name)
        try:
            return namespace._flash_attn_forward, namespace._flash_attn_backward
        except AttributeError:  # not registered under this namespace
            continue
    return None


@functools.cache
def _import_flash_attn() -> bool:
    """Import flash-attn once (it registers its ops); False when it is missing or does not load here."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        import flash_attn  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # e.g. a CUDA build on a machine without its libraries
        return False
    return True


def ops():
    """The registered `(forward, backward)` ops (importing flash-attn when none are registered yet), or None."""
    found = _registered()
    if found is None and _import_flash_attn():
        found = _registered()
    return found


def _has_kernel(op, device) -> bool:
    key = _DISPATCH_KEYS.get(device.type)
    name = op._qualified_op_name
    return key is not None and any(torch._C._dispatch_has_kernel_for_dispatch_key(name, k)
                                   for k in (key, "CompositeExplicitAutograd", "CompositeImplicitAutograd"))


def _window(mask: PartMask) -> tuple[int, int]:
    return (-1, -1) if mask.window is None else (mask.window - 1, 0)


def flash_forward(query, key, value, mask: PartMask, scale: float, softcap: float | None):
    forward, _ = ops()
    left, right = _window(mask)
    q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))  # (B, L, H, D)
    out, lse, _, rng_state = forward(q, k, v, 0.0, scale, mask.causal, left, right, softcap or 0.0, None, False)
    return out.transpose(1, 2), lse, rng_state  # (B, H, Lq, D), (B, H, Lq)


def flash_backward(grad_out, query, key, value, out, lse, aux, mask: PartMask, scale: float, softcap: float | None):
    _, backward = ops()
    left, right = _window(mask)
    q, k, v, do, o = (t.transpose(1, 2).contiguous() for t in (query, key, value, grad_out, out))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backward(do, q, k, v, o, lse.float().contiguous(), dq, dk, dv, 0.0, scale, mask.causal, left, right,
             softcap or 0.0, None, False, aux)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _available(device) -> bool:
    found = ops()
    return found is not None and all(_has_kernel(op, torch.device(device)) for op in found)


def _supports(query, key, mask: PartMask, softcap) -> bool:
    dim = query.shape[-1]
    causal_ok = not mask.causal or query.shape[2] == key.shape[2]
    # Without key_end the own part is causal rows, whose positions are consecutive: flash's column window is exact.
    # A windowed path part (positions of folded queries) has no flash form.
    return (is_half(query.dtype) and dim % 8 == 0 and dim <= 256
            and mask.key_end is None and mask.key_length is None and causal_ok
            and (mask.window is None or mask.causal))


FLASH = PartKernel("flash", available=_available, supports=_supports, forward=flash_forward, backward=flash_backward)
