"""Triton part kernels: flash attention whose visibility is a few integers per token (pre-order intervals, positions).

One forward kernel and two backward kernels (dK/dV per key block, dQ per query block) serve both parts of the
two-part attention. Key `j` is visible to query `i` when every enabled condition holds (see `masks.PartMask`):

```
  CAUSAL:      j <= i                      (own part: query and key columns of one row)
  HAS_END:     i < key_end[j]              (packed subtree rows in pre-order: one int per key, no N x N mask)
  HAS_WINDOW:  k_pos[j] > q_pos[i] - window
```

GQA: query head `h` reads key/value head `h // groups`; the dK/dV kernel loops over the `groups` query heads of its
key head, so keys are never repeated and no atomics are needed. Soft-capping: `s = c * tanh(raw / c)`, and the
backward multiplies `dS` by `1 - tanh^2`. The forward returns the log-sum-exp (`-inf`, output 0, for a query that
sees no key); the backward takes `(out, lse)` from outside, so it accepts the merged statistics of several parts.

Accumulation in float32 (float64 for float64 inputs; matrix products in IEEE precision, never TF32). On CUDA the
kernels take half precision only (float16, bfloat16: tensor cores, wgmma on sm_90); float32 and float64 parts go to
the next kernel of the backend's chain, `math` (cuBLAS in the input dtype, TF32 off as in PyTorch's default: the
error of plain float32 arithmetic, ~1e-6 relative, as the dense path), because an IEEE float32 `tl.dot` runs without
tensor cores, compiles for 10-15 s per variant, spills 15-60 KB per thread and needs 230,400 B of shared memory for
dK/dV at head_dim 128 (sm_90 has 232,448 B). Under `TRITON_INTERPRET=1` (CPU, tests) float32 and float64 run here,
on 16 x 16 tiles, so that small test shapes still cross several tiles and their edges.

Launch configuration on CUDA ([`launch_config`]): per kernel the tile and the warps that compile spill-free for sm_90 at
head_dim 64 and 128 with every mask flag on (`tests/attention_kernels/test_triton_compile.py` compiles every variant
offline, `benchmarks/gpu/triton_variants.py` records registers, spills and shared memory). One program per
(tile, batch x head), on grid axis 0 (up to 2^31 - 1 programs; axis 1 would cap batch x heads at 65,535).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..precision import acc_dtype
from .masks import PartMask
from .torch_parts import PartKernel


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _program(length, BLOCK: tl.constexpr):
    """`(tile, batch x head)` of this program: tiles of one (batch, head) are consecutive on grid axis 0."""
    pid = tl.program_id(0)
    tiles = tl.cdiv(length, BLOCK)
    return pid % tiles, pid // tiles


@triton.jit
def _scores(q, k, offs_m, offs_n, q_len, k_len, q_pos, k_pos, k_end, scale, softcap, window,
            CAUSAL: tl.constexpr, HAS_END: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """Masked scores `(BLOCK_M, BLOCK_N)` (-inf where hidden), the visibility, and tanh of the soft-cap (or 0)."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    t = s * 0.0
    if SOFTCAP:
        t = _tanh(s / softcap)
        s = t * softcap
    visible = (offs_m[:, None] < q_len) & (offs_n[None, :] < k_len)
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None])
    if HAS_END:
        visible = visible & (offs_m[:, None] < k_end[None, :])
    if HAS_WINDOW:
        visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
    return tl.where(visible, s, float("-inf")), visible, t


@triton.jit
def _forward_kernel(Q, K, V, O, LSE, QPOS, KPOS, KEND,
                    s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_ob, s_oh, s_om, s_lb, s_lh,
                    s_qpb, s_kpb, s_keb,
                    n_heads, groups, q_len, k_len, head_dim, scale, softcap, window,
                    CAUSAL: tl.constexpr, HAS_END: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    pid_m, bh = _program(q_len, BLOCK_M)
    b, h = bh // n_heads, bh % n_heads
    hk = h // groups
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim
    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :],
                mask=(offs_m[:, None] < q_len) & d_ok, other=0.0)
    q_pos = tl.load(QPOS + b * s_qpb + offs_m, mask=offs_m < q_len, other=0)
    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(k_len, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n[:, None] < k_len
        k = tl.load(K + b * s_kb + hk * s_kh + offs_n[:, None] * s_kn + offs_d[None, :], mask=n_ok & d_ok, other=0.0)
        v = tl.load(V + b * s_kb + hk * s_kh + offs_n[:, None] * s_kn + offs_d[None, :], mask=n_ok & d_ok, other=0.0)
        k_pos = tl.load(KPOS + b * s_kpb + offs_n, mask=offs_n < k_len, other=0)
        k_end = tl.load(KEND + b * s_keb + offs_n, mask=offs_n < k_len, other=0)
        s, _, _ = _scores(q, k, offs_m, offs_n, q_len, k_len, q_pos, k_pos, k_end, scale, softcap, window,
                          CAUSAL, HAS_END, HAS_WINDOW, SOFTCAP)
        s = s.to(ACC)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: keep exp() finite
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee").to(ACC)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(O + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=(offs_m[:, None] < q_len) & d_ok)
    tl.store(LSE + b * s_lb + h * s_lh + offs_m, lse, mask=offs_m < q_len)


@triton.jit
def _grad_scores(q, k, v, do, lse, delta, offs_m, offs_n, q_len, k_len, q_pos, k_pos, k_end, scale, softcap, window,
                 CAUSAL: tl.constexpr, HAS_END: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                 ACC: tl.constexpr):
    """Probabilities `P = exp(S - lse)` and `dS` (w.r.t. the raw, scaled scores), both `(BLOCK_M, BLOCK_N)`."""
    s, visible, t = _scores(q, k, offs_m, offs_n, q_len, k_len, q_pos, k_pos, k_end, scale, softcap, window,
                            CAUSAL, HAS_END, HAS_WINDOW, SOFTCAP)
    p = tl.where(visible, tl.exp(s.to(ACC) - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision="ieee").to(ACC)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return p, ds * scale


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, QPOS, KPOS, KEND,
                 s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_lb, s_lh, s_qpb, s_kpb, s_keb,
                 n_kv_heads, groups, q_len, k_len, head_dim, scale, softcap, window,
                 CAUSAL: tl.constexpr, HAS_END: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    pid_n, bh = _program(k_len, BLOCK_N)
    b, hk = bh // n_kv_heads, bh % n_kv_heads
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim
    kv_mask = (offs_n[:, None] < k_len) & d_ok
    k = tl.load(K + b * s_kb + hk * s_kh + offs_n[:, None] * s_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * s_kb + hk * s_kh + offs_n[:, None] * s_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    k_pos = tl.load(KPOS + b * s_kpb + offs_n, mask=offs_n < k_len, other=0)
    k_end = tl.load(KEND + b * s_keb + offs_n, mask=offs_n < k_len, other=0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M
    for g in range(groups):
        h = hk * groups + g
        for start_m in range(lo, q_len, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_ok = offs_m < q_len
            q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :],
                        mask=m_ok[:, None] & d_ok, other=0.0)
            do = tl.load(DO + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :],
                         mask=m_ok[:, None] & d_ok, other=0.0)
            lse = tl.load(LSE + b * s_lb + h * s_lh + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + b * s_lb + h * s_lh + offs_m, mask=m_ok, other=0.0)
            q_pos = tl.load(QPOS + b * s_qpb + offs_m, mask=m_ok, other=0)
            p, ds = _grad_scores(q, k, v, do, lse, delta, offs_m, offs_n, q_len, k_len, q_pos, k_pos, k_end, scale,
                                 softcap, window, CAUSAL, HAS_END, HAS_WINDOW, SOFTCAP, ACC)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision="ieee").to(ACC)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision="ieee").to(ACC)
    tl.store(DK + b * s_kb + hk * s_kh + offs_n[:, None] * s_kn + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + b * s_kb + hk * s_kh + offs_n[:, None] * s_kn + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, QPOS, KPOS, KEND,
               s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_lb, s_lh, s_qpb, s_kpb, s_keb,
               n_heads, groups, q_len, k_len, head_dim, scale, softcap, window,
               CAUSAL: tl.constexpr, HAS_END: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    pid_m, bh = _program(q_len, BLOCK_M)
    b, h = bh // n_heads, bh % n_heads
    hk = h // groups
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim
    m_ok = offs_m < q_len
    q_ptrs = b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :]
    q = tl.load(Q + q_ptrs, mask=m_ok[:, None] & d_ok, other=0.0)
    do = tl.load(DO + q_ptrs, mask=m_ok[:, None] & d_ok, other=0.0)
    lse = tl.load(LSE + b * s_lb + h * s_lh + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + b * s_lb + h * s_lh + offs_m, mask=m_ok, other=0.0)
    q_pos = tl.load(QPOS + b * s_qpb + offs_m, mask=m_ok, other=0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(k_len, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < k_len) & d_ok
        k = tl.load(K + b * s_kb + hk * s_kh + offs_n[:, None] * s_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + b * s_kb + hk * s_kh + offs_n[:, None] * s_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        k_pos = tl.load(KPOS + b * s_kpb + offs_n, mask=offs_n < k_len, other=0)
        k_end = tl.load(KEND + b * s_keb + offs_n, mask=offs_n < k_len, other=0)
        _, ds = _grad_scores(q, k, v, do, lse, delta, offs_m, offs_n, q_len, k_len, q_pos, k_pos, k_end, scale,
                             softcap, window, CAUSAL, HAS_END, HAS_WINDOW, SOFTCAP, ACC)
        dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee").to(ACC)
    tl.store(DQ + q_ptrs, dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok)


_TL_ACC = {torch.float64: tl.float64, torch.float32: tl.float32}
KERNELS = ("forward", "dkdv", "dq")


def jit_kernel(name: str):
    """The `triton.jit` function of the kernel `name` (one of [`KERNELS`]), the one [`launch_config`]`(name, ...)`
    configures: for compiling a variant offline (`benchmarks/gpu/triton_variants.py`)."""
    if name not in KERNELS:
        raise ValueError(f"unknown Triton kernel {name!r}; choose one of {KERNELS}")
    return {"forward": _forward_kernel, "dkdv": _dkdv_kernel, "dq": _dq_kernel}[name]


@dataclass(frozen=True)
class LaunchConfig:
    """Tiles and warps of one kernel: `block_m` query rows and `block_n` key rows per tile (dK/dV: `block_n` keys per
    program, its query loop in steps of `block_m`), `num_warps` per program, `num_stages` of software pipelining."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# CUDA, half precision, per kernel and padded head_dim (`BLOCK_D`). Registers bound the tiles: a program holds its
# float32 accumulators (forward: the (block_m, D) output; dK/dV: two (block_n, D) tiles; dQ: one (block_m, D)) spread
# over `32 * num_warps` threads, plus the operand and score tiles. At D = 128 with 4 warps, 64 x 64 tiles give dK/dV
# 2 * 64 * 128 / 128 = 128 accumulator registers per thread before any operand, and it spilled 1.2-1.6 KB per thread
# (255 registers, sm_90, every mask flag on); with 8 warps and a 32-query step it needs at most 250, no spill. dQ with
# 64 x 64 spilled 88-224 B at either warp count; 64 x 16 key tiles need at most 244 (8 warps at D = 128). The forward
# spilled with 64 x 64 (4 B at D = 128 under Triton 3.9, 12 B at D = 64 under 3.6, the GPU machine's); 64 x 32 needs
# at most 226. Two pipeline stages: a third added registers (the forward spilled 24 B) for at most 67 KB of shared
# memory either way, far below sm_90's 232,448 B. Figures: Triton 3.9 and 3.6, offline for sm_90, every mask-flag
# set (`benchmarks/gpu/triton_variants.py`; the table in benchmarks/RESULTS.md).
CUDA_LAUNCH = {
    ("forward", 64): LaunchConfig(64, 32, 4, 2),
    ("forward", 128): LaunchConfig(64, 32, 4, 2),
    ("dkdv", 64): LaunchConfig(32, 64, 8, 2),
    ("dkdv", 128): LaunchConfig(32, 64, 8, 2),
    ("dq", 64): LaunchConfig(64, 16, 4, 2),
    ("dq", 128): LaunchConfig(64, 16, 8, 2),
}
# The interpreter (CPU tests): 16 x 16 tiles, so that small shapes cross several tiles and their edges.
INTERPRET_LAUNCH = LaunchConfig(16, 16, 1, 1)
MAX_HEAD_DIM = 128


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def block_d(head_dim: int) -> int:
    """The padded head dimension a kernel is compiled for: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


def launch_config(kernel: str, head_dim: int) -> LaunchConfig:
    """The [`LaunchConfig`] of `kernel` (one of [`KERNELS`]) for `head_dim` (up to `MAX_HEAD_DIM`) here."""
    if _interpreted():
        return INTERPRET_LAUNCH
    return CUDA_LAUNCH[kernel, max(64, block_d(head_dim))]


def mask_flags(mask: PartMask, softcap: float | None) -> dict[str, bool]:
    """The constexpr mask flags a part compiles with (one kernel variant per combination)."""
    return dict(CAUSAL=mask.causal, HAS_END=mask.key_end is not None, HAS_WINDOW=mask.window is not None,
                SOFTCAP=softcap is not None)


def _launch(kernel, name: str, tiles_of: int, rows: int, head_dim: int, *args, **flags):
    """Launch `kernel` on one grid axis: `cdiv(tiles_of, tile) * rows` programs (rows = batch x heads)."""
    config = launch_config(name, head_dim)
    tile = config.block_n if name == "dkdv" else config.block_m
    programs = triton.cdiv(tiles_of, tile) * rows
    if programs >= 2**31:
        raise ValueError(f"{programs} Triton programs exceed CUDA's grid limit (2^31 - 1); split the batch.")
    kernel[(programs,)](*args, **flags, BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps,
                        num_stages=config.num_stages)


def _launch_args(query, key, mask: PartMask, scale, softcap):
    """Grid-independent launch arguments: index tensors (dummies when unused), constexpr flags, sizes."""
    batch, n_heads, q_len, dim = query.shape
    dummy = torch.zeros(1, 1, dtype=torch.int64, device=query.device)
    q_pos = dummy if mask.q_pos is None else mask.q_pos.expand(batch, q_len).to(torch.int64).contiguous()
    k_pos = dummy if mask.k_pos is None else mask.k_pos.expand(batch, key.shape[2]).to(torch.int64).contiguous()
    k_end = dummy if mask.key_end is None else mask.key_end.to(torch.int64).contiguous()
    flags = dict(**mask_flags(mask, softcap), BLOCK_D=block_d(dim), ACC=_TL_ACC[acc_dtype(query.dtype)])
    sizes = (q_len, key.shape[2], dim, scale, 1.0 if softcap is None else softcap, mask.window or 0)
    positions = (q_pos, k_pos, k_end, q_pos.stride(0) if q_pos is not dummy else 0,
                 k_pos.stride(0) if k_pos is not dummy else 0, k_end.stride(0) if k_end is not dummy else 0)
    return positions, sizes, flags


def triton_forward(query, key, value, mask: PartMask, scale: float, softcap: float | None):
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    batch, n_heads, q_len, dim = query.shape
    (q_pos, k_pos, k_end, s_qp, s_kp, s_ke), sizes, flags = _launch_args(query, key, mask, scale, softcap)
    out = torch.empty_like(query)  # (B, H, Lq, D)
    lse = torch.empty(batch, n_heads, q_len, dtype=acc_dtype(query.dtype), device=query.device)
    _launch(_forward_kernel, "forward", q_len, batch * n_heads, dim,
            query, key, value, out, lse, q_pos, k_pos, k_end,
            query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            s_qp, s_kp, s_ke, n_heads, n_heads // key.shape[1], *sizes, **flags)
    return out, lse, None


def triton_backward(grad_out, query, key, value, out, lse, aux, mask: PartMask, scale: float, softcap: float | None):
    query, key, value, grad_out = query.contiguous(), key.contiguous(), value.contiguous(), grad_out.contiguous()
    batch, n_heads, q_len, dim = query.shape
    n_kv = key.shape[1]
    acc = acc_dtype(query.dtype)
    lse = lse.to(acc).contiguous()  # (B, H, Lq)
    delta = (grad_out.to(acc) * out.to(acc)).sum(-1).contiguous()  # rowsum(dO * O), (B, H, Lq)
    (q_pos, k_pos, k_end, s_qp, s_kp, s_ke), sizes, flags = _launch_args(query, key, mask, scale, softcap)
    grad_query, grad_key, grad_value = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    strides = (query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
               lse.stride(0), lse.stride(1), s_qp, s_kp, s_ke)
    _launch(_dkdv_kernel, "dkdv", key.shape[2], batch * n_kv, dim,
            query, key, value, grad_out, lse, delta, grad_key, grad_value, q_pos, k_pos, k_end,
            *strides, n_kv, n_heads // n_kv, *sizes, **flags)
    _launch(_dq_kernel, "dq", q_len, batch * n_heads, dim,
            query, key, value, grad_out, lse, delta, grad_query, q_pos, k_pos, k_end,
            *strides, n_heads, n_heads // n_kv, *sizes, **flags)
    return grad_query, grad_key, grad_value


def _supports(query, key, mask: PartMask, softcap) -> bool:
    # The interpreter (`TRITON_INTERPRET=1`, CPU) computes with numpy, which has no bfloat16: half precision there gives
    # garbage. Compiled (CUDA), only half precision runs here (see the module docstring). Other parts (and key padding,
    # `key_length`) go to the next kernel of the backend's chain.
    dtypes = (torch.float64, torch.float32) if _interpreted() else (torch.float16, torch.bfloat16)
    return query.dtype in dtypes and query.shape[-1] <= MAX_HEAD_DIM and mask.key_length is None


TRITON = PartKernel("triton", available=lambda device: True, supports=_supports, forward=triton_forward,
                    backward=triton_backward)
