"""Two-part attention: new tokens over a path stored once plus their own rows, merged by log-sum-exp.

A batch of `B` rows (sibling leaves, or packed subtrees) continues one `P`-token path. Concatenating
`[path_k.expand(B) ; own_k]` per layer holds `B` copies of the path's keys/values in every layer (and SDPA saves them
for backward). Splitting the keys instead:

```
                      path keys (1 copy)          own keys (per row)
  row 0, queries:     [ k_0 ... k_{P-1} ]         [ row 0: causal or tree mask ]
  row 1, queries:     [ same P keys     ]         [ row 1: causal or tree mask ]
```

- **path part**: every new query sees every path key (up to a sliding window), so the rows' queries fold into one
  query sequence `(1, n_heads, B * L, head_dim)` and one kernel call gives `(O_p, lse_p)`;
- **own part**: each row's queries over the row's own keys with the causal mask (the bottom-right alignment of the
  full `[path ; own]` mask restricted to the own keys) or the packed tree mask (`key_end`), giving `(O_r, lse_r)`;
- **merge** in float32 (float64 for float64 inputs): `lse = logaddexp(lse_p, lse_r)`,
  `O = exp(lse_p - lse) O_p + exp(lse_r - lse) O_r`. Every own row sees at least its own key, so `lse` is finite and
  padding rows never give NaN.

Backward (one `autograd.Function`): with `P_a = exp(S_a - lse)` the part-`a` slice of the joint softmax, the joint
gradients are `dS_a = P_a * (dO V_a^T - rowsum(dO * O))`; a flash-style backward computes exactly this when given the
*merged* `(O, lse)` (the ring-attention trick), so each part's backward kernel runs once on its own keys, `dQ` is
the sum of the parts' `dQ`, and the path's `dK_p, dV_p` come out already summed over all rows. No gradient flows
through `lse`.

**Sinks** (GPT-OSS's per-head `s_aux`): a sink adds `exp(s_h)` to head `h`'s softmax denominator, a key of logit
`s_h` and value zero that every query sees. It enters the merge once, as a third "part" without output:
`lse = logaddexp(lse_p, lse_r, s_h)`, so `O = sigmoid(lse_parts - s_h) O_parts` in effect. The parts' backward run
with this `lse` and the sunk `O` (their `P_a` are then the joint softmax's), and the sink's own gradient is
`dS_sink = P_sink (0 - rowsum(dO * O))`, summed over the batch and the queries of each head.

Each part runs on the first kernel of the backend's chain that supports it (see [`BACKENDS`]); the kernels'
contract is in `torch_parts`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import torch

from .._checks import check_choice, check_float, check_int
from ..precision import acc_dtype
from .masks import PartMask, plan_masks
from .sdpa import concat_attention
from .spans import Span, check_spans, plan_spans, spans_backward, spans_forward
from .torch_parts import MATH, TORCH, PartKernel


def _triton_kernel() -> PartKernel:
    from . import triton_parts

    return triton_parts.TRITON


def _flash_kernel() -> PartKernel:
    from . import flash_parts

    return flash_parts.FLASH


def _triton_available(device) -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _flash_available(device) -> bool:
    return _flash_kernel().available(device)  # flash-attn's ops registered with a kernel for this device


# Part kernels by name: (available on a device, the kernel, loaded lazily so that optional packages stay optional).
_KERNELS = {
    "math": (lambda device: True, lambda: MATH),
    "torch": (TORCH.available, lambda: TORCH),
    "triton": (_triton_available, _triton_kernel),
    "flash": (_flash_available, _flash_kernel),
}


@dataclass(frozen=True)
class _Plan:
    """Everything but the tensors that one two-part call needs, forward and backward."""

    path_mask: PartMask | None  # None: no path part (P = 0)
    own_mask: PartMask
    scale: float
    softcap: float | None
    path_kernel: PartKernel | None
    own_kernel: PartKernel
    own_spans: tuple[Span, ...] | None = None  # shared rows: the own part span by span, in row-major order


def _fold(x: torch.Tensor) -> torch.Tensor:
    """`(batch, heads, length, ...)` -> `(1, heads, batch * length, ...)`: all rows' queries as one sequence (a view
    when `x` is a transposed `(batch, length, heads, ...)` tensor, as transformers passes queries; else a copy)."""
    return x.transpose(0, 1).reshape(1, x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


def _unfold(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of [`_fold`] (a view)."""
    heads, total = x.shape[1], x.shape[2]
    return x.reshape(heads, batch, total // batch, *x.shape[3:]).transpose(0, 1)


def _sink_lse(lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """`lse` `(batch, n_heads, length)` with each head's sink logit `sinks (n_heads,)` added to the denominator."""
    if sinks is None:
        return lse
    return torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])


def two_part_forward(query, path_key, path_value, key, value, sinks, plan: _Plan):
    """Merged output `(batch, n_heads, length, head_dim)`, log-sum-exp `(batch, n_heads, length)` (the sinks
    included) and the parts' aux."""
    if plan.own_spans is None:
        out_r, lse_r, aux_r = plan.own_kernel.forward(query, key, value, plan.own_mask, plan.scale, plan.softcap)
    else:
        out_r, lse_r, aux_r = spans_forward(query, key, value, plan.own_spans, plan.scale, plan.softcap)
    if plan.path_mask is None and sinks is None:
        return out_r, lse_r, (None, aux_r)
    batch = query.shape[0]
    acc = acc_dtype(query.dtype)
    lse_r = lse_r.to(acc)  # (B, H, L)
    parts = [(out_r, lse_r)]
    aux_p = None
    if plan.path_mask is not None:
        out_p, lse_p, aux_p = plan.path_kernel.forward(_fold(query), path_key, path_value, plan.path_mask, plan.scale,
                                                       plan.softcap)  # (1, H, B * L, D), (1, H, B * L)
        parts.append((_unfold(out_p, batch), _unfold(lse_p, batch).to(acc)))
    # (B, H, L, D) over (B, L, H, D) storage: the layout transformers wants next, and `_fold` of it is a view.
    out = torch.empty(batch, query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype,
                      device=query.device).transpose(1, 2)
    out, lse = merge_parts(parts, sinks=sinks, out=out)  # lse finite: a query sees its own key
    return out, lse, (aux_p, aux_r)


def two_part_backward(grad_out, query, path_key, path_value, key, value, sinks, out, lse, aux, plan: _Plan):
    """Gradients of query, path key/value (None without a path), own key/value and the sinks (None without), from
    the merged `(out, lse)`."""
    aux_p, aux_r = aux
    if plan.own_spans is None:
        grad_query, grad_key, grad_value = plan.own_kernel.backward(
            grad_out, query, key, value, out, lse, aux_r, plan.own_mask, plan.scale, plan.softcap)
    else:
        grad_query, grad_key, grad_value = spans_backward(grad_out, query, key, value, out, lse, aux_r,
                                                          plan.own_spans, plan.scale, plan.softcap)
    grad_sinks = None
    if sinks is not None:  # the sink is a key of value 0: dS_sink = P_sink * (0 - rowsum(dO * O))
        acc = lse.dtype
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1)  # (B, H, L)
        p_sink = torch.exp(sinks.to(acc)[None, :, None] - lse)  # (B, H, L)
        grad_sinks = -(p_sink * delta).sum((0, 2)).to(sinks.dtype)  # (H,)
    if plan.path_mask is None:
        return grad_query, None, None, grad_key, grad_value, grad_sinks
    grad_fold, grad_path_key, grad_path_value = plan.path_kernel.backward(
        _fold(grad_out), _fold(query), path_key, path_value, _fold(out), _fold(lse), aux_p, plan.path_mask,
        plan.scale, plan.softcap)  # (1, H, B * L, D), (1, H_kv, P, D) summed over rows
    grad_query = grad_query + _unfold(grad_fold, query.shape[0])
    return grad_query, grad_path_key, grad_path_value, grad_key, grad_value, grad_sinks


def merge_parts(parts: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of attention parts over disjoint key sets of the same queries:
    `lse = logaddexp_p(lse_p)` (plus the sinks), `out = sum_p exp(lse_p - lse) out_p`.

    Args:
        parts (`list[tuple[Tensor, Tensor]]`): each part's `(out_p (batch, n_heads, length, head_dim), lse_p (batch,
            n_heads, length))`, every `lse_p` in the accumulation dtype (`precision.acc_dtype` of the queries), which
            the merge computes in.
        sinks (`torch.Tensor` of shape `(n_heads,)`, *optional*): attention sinks, added to the denominator.
        out (`torch.Tensor`, *optional*): where to write the merged output (in its own dtype and layout); None: a new
            tensor in the accumulation dtype.

    Returns:
        `(out, lse)`: the merged output and log-sum-exp.
    """
    lse = parts[0][1]
    for _, part_lse in parts[1:]:
        lse = torch.logaddexp(lse, part_lse)
    lse = _sink_lse(lse, sinks)
    weighted = [torch.exp(part_lse - lse)[..., None] * part_out.to(lse.dtype) for part_out, part_lse in parts]
    merged = weighted[0]
    for term in weighted[1:-1]:
        merged = merged + term
    if out is None:
        return (merged if len(weighted) == 1 else merged + weighted[-1]), lse
    if len(weighted) == 1:
        out.copy_(merged)
    else:
        torch.add(weighted[-1], merged, out=out)
    return out, lse


def attend_part(query, key, value, mask: PartMask, scale: float, softcap: float | None = None, *,
                backend: str = "torch", folded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention part on the first exact kernel of `backend`'s chain (no autograd: generation, the probe).

    Args:
        query (`torch.Tensor` of shape `(batch, n_heads, length, head_dim)`): the queries.
        key, value (`torch.Tensor` of shape `(batch, n_kv_heads, n_keys, head_dim)`): the part's keys/values; with
            `folded`, `(1, n_kv_heads, n_keys, head_dim)`: keys every row sees (a shared prefix), the rows' queries
            folded into one sequence over them (`mask` then indexes the folded queries, `batch * length` of them).
        mask (`PartMask`): the part's mask.
        scale (`float`), softcap (`float`, *optional*): the score scale and soft-capping.
        backend (`str`, *optional*, defaults to `"torch"`): a two-part backend (`"torch"`, `"flash"`, `"triton"`).

    Returns:
        `(out (batch, n_heads, length, head_dim), lse (batch, n_heads, length))` in the kernel's dtypes.
    """
    chain = _CHAINS[backend]
    if folded:
        batch = query.shape[0]
        query = _fold(query)
    out, lse, _ = _pick(chain, query, key, mask, softcap).forward(query, key, value, mask, scale, softcap)
    return (_unfold(out, batch), _unfold(lse, batch)) if folded else (out, lse)


class _TwoPartAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, path_key, path_value, key, value, sinks, plan):
        out, lse, aux = two_part_forward(query, path_key, path_value, key, value, sinks, plan)
        ctx.save_for_backward(query, path_key, path_value, key, value, sinks, out, lse)
        ctx.plan, ctx.aux = plan, aux
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, path_key, path_value, key, value, sinks, out, lse = ctx.saved_tensors
        grads = two_part_backward(grad_out, query, path_key, path_value, key, value, sinks, out, lse, ctx.aux,
                                  ctx.plan)
        return (*grads, None)


def _pick(chain: tuple[str, ...], query, key, mask: PartMask, softcap) -> PartKernel:
    """The first kernel of `chain` available here that computes this part exactly."""
    for name in chain:
        available, load = _KERNELS[name]
        if available(query.device):
            kernel = load()
            if kernel.supports(query, key, mask, softcap):
                return kernel
    raise ValueError(f"no kernel of {list(chain)} computes this attention part on {query.device.type} "
                     f"(mask {mask}, softcap {softcap}); use backend='torch'.")


def _make_plan(query, path_key, key, *, scale, positions, key_end, window, softcap, chain, spans=None) -> _Plan:
    """Plan the parts and pick each part's kernel from `chain` (each span's, for shared rows)."""
    path_len = 0 if path_key is None else path_key.shape[2]
    batch, _, q_len, _ = query.shape
    path_mask, own_mask = plan_masks(path_len, batch, q_len, positions, key_end, window, query.device)
    path_kernel = None if path_mask is None else _pick(chain, query, path_key, path_mask, softcap)
    own_kernel = _pick(chain, query, key, own_mask, softcap)
    own_spans = None
    if spans is not None:
        own_spans = plan_spans(spans, own_mask, query, key, lambda q, k, mask: _pick(chain, q, k, mask, softcap))
    return _Plan(path_mask, own_mask, scale, softcap, path_kernel, own_kernel, own_spans)


def _two_part(query, path_key, path_value, key, value, *, sinks, chain, **options):
    """A two-part backend: plan, then run (through autograd only when a gradient is needed)."""
    plan = _make_plan(query, path_key, key, chain=chain, **options)
    tensors = (query, path_key, path_value, key, value, sinks)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _TwoPartAttention.apply(*tensors, plan)
    return two_part_forward(*tensors, plan)[0]


# Backends by name. A two-part backend runs each part on the first kernel of its chain that is available and exact
# for that part: soft-capping, CUDA float32 and packed rows on CUDA fall back to `math` (exact, path stored once,
# scores materialised per part), and so does half precision under the Triton interpreter (numpy has no bfloat16:
# TRL's default bf16 autocast on CPU). "sdpa" is the concatenating reference (the path expanded over the rows).
_CHAINS = {"torch": ("torch", "math"), "flash": ("flash", "torch", "math"), "triton": ("triton", "math")}
_BACKENDS = {"sdpa": concat_attention, **{name: partial(_two_part, chain=chain) for name, chain in _CHAINS.items()}}
# Whether a backend can run on a device (explicit requests only; the chains handle unsupported features).
_BACKEND_AVAILABLE = {
    "sdpa": lambda device: True,
    "torch": TORCH.available,
    "flash": _flash_available,
    "triton": _triton_available,
}
# "auto": the first available backend per device type, fastest first (measured by benchmarks/suites/bench_attention.py).
AUTO = {"cpu": ("torch", "sdpa"), "cuda": ("flash", "torch", "sdpa")}
BACKENDS = tuple(_BACKENDS) + ("auto",)


def available_backends(device) -> list[str]:
    """Backends that can run on `device` here (optional packages installed)."""
    device = torch.device(device)
    return [name for name, ok in _BACKEND_AVAILABLE.items() if ok(device)]


def resolve_backend(backend: str, device) -> str:
    """The concrete backend `backend` means on `device` ("auto" resolved), or a ValueError listing what runs there."""
    check_choice("backend", backend, BACKENDS)
    device = torch.device(device)
    names = AUTO.get(device.type, ("sdpa",)) if backend == "auto" else (backend,)
    for name in names:
        if _BACKEND_AVAILABLE[name](device):
            return name
    raise ValueError(f"attention backend {backend!r} cannot run on {device.type} here; available: "
                     f"{available_backends(device)} (flash needs CUDA and `pip install flash-attn`, triton needs "
                     "`pip install triton` and CUDA, or TRITON_INTERPRET=1 on CPU).")


def _check(query, path_key, path_value, key, value, positions, key_end, sinks):
    if query.ndim != 4 or key.ndim != 4 or value.shape != key.shape:
        raise ValueError(f"`query` must be (batch, n_heads, length, head_dim) and `key`/`value` (batch, n_kv_heads, "
                         f"length, head_dim) of one shape, got {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}.")
    batch, n_heads, length, dim = query.shape
    if key.shape[0] != batch or key.shape[2] != length or key.shape[3] != dim or n_heads % key.shape[1]:
        raise ValueError(f"`key` {tuple(key.shape)} does not fit `query` {tuple(query.shape)}: it must be (batch, "
                         "n_kv_heads, length, head_dim) with n_heads a multiple of n_kv_heads.")
    if (path_key is None) != (path_value is None):
        raise ValueError("`path_key` and `path_value` must both be tensors or both None.")
    if path_key is not None and (path_key.ndim != 4 or path_key.shape[0] != 1 or path_value.shape != path_key.shape
                                 or path_key.shape[1] != key.shape[1] or path_key.shape[3] != dim):
        raise ValueError(f"`path_key`/`path_value` must be (1, n_kv_heads, path_len, head_dim) = (1, {key.shape[1]}, "
                         f"P, {dim}), got {tuple(path_key.shape)}, {tuple(path_value.shape)}; keep the path once, "
                         "do not expand it over the batch.")
    others = (key, value) if path_key is None else (key, value, path_key, path_value)
    if any(t.dtype != query.dtype or t.device != query.device for t in others):
        raise TypeError(f"query, keys and values must share one dtype and device, got "
                        f"{[(t.dtype, t.device.type) for t in (query, *others)]}; cast the path with "
                        "`.to(query.dtype)`.")
    if (key_end is None) != (positions is None):
        raise ValueError("packed subtree rows need both `key_end` and `positions` (batch, length); causal rows need "
                         "neither (their positions continue the path).")
    for name, t in (("positions", positions), ("key_end", key_end)):
        if t is not None and (t.shape != (batch, length) or t.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"`{name}` must be an integer tensor of shape (batch, length) = {(batch, length)}, "
                             f"got {tuple(t.shape)} {t.dtype}.")
    if sinks is not None and (sinks.shape != (n_heads,) or not sinks.is_floating_point()
                              or sinks.device != query.device):
        raise ValueError(f"`sinks` must be a floating tensor of shape (n_heads,) = ({n_heads},) on the queries' "
                         f"device (one sink logit per query head), got {tuple(sinks.shape)} {sinks.dtype} on "
                         f"{sinks.device.type}.")


def _options(query, path_key, path_value, key, value, scaling, positions, key_end, sliding_window, softcap,
             sinks=None):
    """Validated keyword options shared by the backends."""
    _check(query, path_key, path_value, key, value, positions, key_end, sinks)
    window = check_int("sliding_window", sliding_window, minimum=1, allow_none=True)
    if softcap is not None:
        softcap = check_float("softcap", softcap, minimum=0.0, exclusive=True)
    scale = query.shape[-1] ** -0.5 if scaling is None else check_float("scaling", scaling)
    return dict(scale=scale, positions=positions, key_end=key_end, window=window, softcap=softcap, sinks=sinks)


def part_kernels(query, path_key, key, *, backend="auto", scaling=None, positions=None, key_end=None,
                 sliding_window=None, softcap=None) -> tuple[str | None, str]:
    """Names of the kernels `two_part_attention` would run for the path part (None without a path) and the own part
    (`"concat"` for both with the `"sdpa"` backend). Arguments as in [`two_part_attention`]."""
    options = _options(query, path_key, path_key, key, key, scaling, positions, key_end, sliding_window, softcap)
    name = resolve_backend(backend, query.device)
    if name not in _CHAINS:
        return "concat", "concat"
    options.pop("sinks")
    plan = _make_plan(query, path_key, key, chain=_CHAINS[name], **options)
    return (None if plan.path_kernel is None else plan.path_kernel.name), plan.own_kernel.name


def two_part_attention(
    query: torch.Tensor,
    path_key: torch.Tensor | None,
    path_value: torch.Tensor | None,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scaling: float | None = None,
    positions: torch.Tensor | None = None,
    key_end: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    spans: tuple[tuple[tuple[int, int, bool], ...], ...] | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of new tokens over `[path keys ; their row's own keys]`, the path stored once.

    Args:
        query (`torch.Tensor` of shape `(batch, n_heads, length, head_dim)`): the new tokens' queries (all rows).
        path_key, path_value (`torch.Tensor` of shape `(1, n_kv_heads, path_len, head_dim)`, *optional*): keys and
            values of the path every row continues (positions `0 .. path_len - 1`), or None for an empty path.
        key, value (`torch.Tensor` of shape `(batch, n_kv_heads, length, head_dim)`): the rows' own keys and values.
        scaling (`float`, *optional*, defaults to `head_dim ** -0.5`): score scale.
        positions (`torch.LongTensor` of shape `(batch, length)`, *optional*): packed subtree rows only (with
            `key_end`): the tokens' positions (depths; padding at any position). None: causal rows continuing the path
            (positions `path_len + arange(length)`).
        key_end (`torch.LongTensor` of shape `(batch, length)`, *optional*): packed subtree rows in pre-order: key `j`
            is visible to the row's columns `j .. key_end[j] - 1` (see `masks`; padding columns have
            `key_end = column + 1`). Convert a tree mask with `key_end_from_row_mask`. None: causal rows.
        sliding_window (`int`, *optional*): key at position `s` visible to a query at `t` only if `s > t - window`.
        softcap (`float`, *optional*): logit soft-capping, `softcap * tanh(score / softcap)`.
        sinks (`torch.Tensor` of shape `(n_heads,)`, *optional*): attention sinks (GPT-OSS's `s_aux`): head `h`'s
            softmax denominator gains `exp(sinks[h])` for every query, as if each query also saw a key of logit
            `sinks[h]` and value zero. Differentiable (the sinks' gradient is returned).
        spans (`tuple`, *optional*): packed rows only (with `key_end`): per row, `(lo, hi, tree)` column ranges that
            tile it in order and that no key is visible across (the subtrees of a shared row, and its padding); the
            own part then runs span by span (causal within a span, with the span's `key_end` when `tree`), so a row
            holding several subtrees side by side computes no pair between them. The result is the same; only the
            work differs. Ignored by `"sdpa"`.
        backend (`str`, *optional*, defaults to `"auto"`): one of [`BACKENDS`].

    Returns:
        `torch.Tensor` of shape `(batch, n_heads, length, head_dim)`.
    """
    options = _options(query, path_key, path_value, key, value, scaling, positions, key_end, sliding_window, softcap,
                       sinks)
    name = resolve_backend(backend, query.device)
    if path_key is not None and path_key.shape[2] == 0:
        path_key = path_value = None
    if spans is not None and name in _CHAINS:
        check_spans(spans, query.shape[0], query.shape[2], key_end)
        options["spans"] = spans
    return _BACKENDS[name](query, path_key, path_value, key, value, **options)
