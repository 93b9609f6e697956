"""The `flash` backend against flash-attn 2.8.3's op contract, on CPU.

A stand-in (`flash_standin.py`) registers `_flash_attn_forward` / `_flash_attn_backward` under flash-attn's namespace
with 2.8.3's schemas and semantics: the backend must find the ops by their real names (`flash_attn::`, and
`flashattn::` of 2.7.0-2.7.2), select them exactly where flash-attn is exact, pass arguments in flash-attn's order and
`(batch, length, heads, head_dim)` layout, and merge flash's `(batch, heads, q_len)` float32 log-sum-exp.
"""

from __future__ import annotations

import pytest
import torch

from bounds import assert_as_precise_as_dense
from tests.attention_kernels import flash_standin
from tests.attention_kernels.reference import causal_case, packed_case, reference_attention
from trl_dta.kernels import PartMask, available_backends, part_kernels, resolve_backend, two_part_attention
from trl_dta.kernels.flash_parts import flash_forward

# flash-attn 2.8.3's schemas, as `torch.library.custom_op` infers them from its `flash_attn_interface.py`.
FORWARD_SCHEMA = ("_flash_attn_forward(Tensor q, Tensor k, Tensor v, float dropout_p, float softmax_scale, "
                  "bool causal, SymInt window_size_left, SymInt window_size_right, float softcap, "
                  "Tensor? alibi_slopes, bool return_softmax) -> (Tensor, Tensor, Tensor, Tensor)")
BACKWARD_SCHEMA = ("_flash_attn_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
                   "Tensor(a6!)? dq, Tensor(a7!)? dk, Tensor(a8!)? dv, float dropout_p, float softmax_scale, "
                   "bool causal, SymInt window_size_left, SymInt window_size_right, float softcap, "
                   "Tensor? alibi_slopes, bool deterministic, Tensor? rng_state=None) -> Tensor")


@pytest.fixture(params=["flash_attn", "flashattn"], ids=["2.8.3", "2.7.0-2.7.2"])
def standin(request):
    lib = flash_standin.register(request.param)
    yield request.param
    lib._destroy()


def test_stand_in_has_flash_attn_schemas(standin):
    ns = getattr(torch.ops, standin)
    assert str(ns._flash_attn_forward.default._schema) == f"{standin}::{FORWARD_SCHEMA}"
    assert str(ns._flash_attn_backward.default._schema) == f"{standin}::{BACKWARD_SCHEMA}"


def test_found_only_while_registered():
    assert "flash" not in available_backends("cpu")
    lib = flash_standin.register()
    try:
        assert "flash" in available_backends("cpu") and resolve_backend("flash", "cpu") == "flash"
        assert "flash" not in available_backends("meta")  # a kernel for CPU only
    finally:
        lib._destroy()
    assert "flash" not in available_backends("cpu")


@pytest.mark.parametrize(("options", "packed", "dtype", "expected"), [
    ({}, False, torch.bfloat16, ("flash", "flash")),
    (dict(softcap=2.0), False, torch.float16, ("flash", "flash")),
    (dict(sliding_window=4), False, torch.bfloat16, ("torch", "flash")),  # the window cuts into the path
    (dict(sliding_window=64), False, torch.bfloat16, ("flash", "flash")),  # it does not
    ({}, True, torch.bfloat16, ("flash", "torch")),  # packed rows: a tree mask flash cannot express
    ({}, False, torch.float32, ("torch", "torch")),  # flash-attn is half precision only
])
def test_flash_selected_where_exact(standin, options, packed, dtype, expected):
    shape = dict(batch=3, n_heads=4, n_kv=2, path_len=9, dim=16, dtype=dtype)
    case = packed_case(0, **shape) if packed else causal_case(0, length=5, **shape)
    kwargs = {**case.kwargs(), **options}
    assert part_kernels(case.query, case.path_key, case.key, backend="flash", **kwargs) == expected


CASES = {
    "siblings-gqa": lambda dtype: causal_case(1, batch=4, n_heads=4, n_kv=2, length=12, path_len=20, dim=32,
                                              dtype=dtype),
    "no-path": lambda dtype: causal_case(2, batch=3, n_heads=2, n_kv=1, length=16, path_len=0, dim=16, dtype=dtype),
    "window-in-rows": lambda dtype: causal_case(3, batch=3, n_heads=4, n_kv=2, length=14, path_len=2, dim=16,
                                                dtype=dtype, window=6),
    "softcap": lambda dtype: causal_case(4, batch=2, n_heads=4, n_kv=1, length=10, path_len=12, dim=16, dtype=dtype,
                                         softcap=1.5),
    "packed": lambda dtype: packed_case(5, batch=3, n_heads=4, n_kv=2, path_len=7, dim=16, dtype=dtype),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_flash_no_worse_than_sdpa(standin, name, dtype):
    """Output and every input gradient against the float64 reference, in relative L2, within the derived multiple of
    the concatenating SDPA path's error in the same precision (`bounds.py`; the path's keys and values shared by the
    rows: `gradient_slack`). Both round the inputs and the output to `dtype`; the stand-in computes in float32. A
    swapped argument, a wrong window or a mis-laid log-sum-exp costs far more."""
    ref_case = CASES[name](torch.float64)
    ref_inputs = ref_case.inputs()
    ref = reference_attention(ref_case)
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out)
    used = part_kernels(ref_case.query.to(dtype), ref_case.path_key if ref_case.path_key is None else
                        ref_case.path_key.to(dtype), ref_case.key.to(dtype), backend="flash", **ref_case.kwargs())
    assert "flash" in used, used
    errors = {}
    for backend in ("sdpa", "flash"):
        inputs = [t.detach().to(dtype).requires_grad_() for t in ref_inputs]
        out = two_part_attention(*_slots(ref_case, inputs), backend=backend, **ref_case.kwargs())
        grads = torch.autograd.grad(out, inputs, grad_out.to(dtype))
        errors[backend] = [t.detach().double() for t in (out, *grads)]
    names = ("out", "query", "path_key", "path_value", "key", "value") if ref_case.path_key is not None else \
        ("out", "query", "key", "value")
    rows = ref_case.query.shape[0]
    for what, ours, theirs, exact in zip(names, errors["flash"], errors["sdpa"], [ref, *ref_grads]):
        assert_as_precise_as_dense(ours, theirs, exact.detach(), f"flash ({used}) {what}",
                                   sharing=rows if what.startswith("path") else None)


def _slots(case, inputs):
    """`inputs` (the case's non-None tensors) back in `two_part_attention`'s five argument slots."""
    if case.path_key is None:
        q, k, v = inputs
        return q, None, None, k, v
    return tuple(inputs)


def test_log_sum_exp_layout(standin):
    """`flash_forward` returns `(batch, heads, q_len)` float32 log-sum-exp (flash's layout) of the scaled scores.

    Bound: the stand-in sums `head_dim` float32 products per score; each score's error is at most `head_dim * u *
    scale * sum_d |q_d k_d|` (u = 2^-24, the float32 unit round-off), which moves the log-sum-exp by at most the
    largest score error, plus a few u of the logsumexp itself relative to its size."""
    case = causal_case(6, batch=2, n_heads=4, n_kv=2, length=9, path_len=0, dim=16, dtype=torch.bfloat16)
    scale = case.scale
    out, lse, _ = flash_forward(case.query, case.key, case.value, PartMask(causal=True), scale, None)
    assert lse.shape == (2, 4, 9) and lse.dtype == torch.float32 and out.shape == case.query.shape
    q = case.query.double()
    k = case.key.double().repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    want = torch.logsumexp(scores, dim=-1)
    u = 2.0 ** -24
    magnitude = (q.abs() @ k.abs().transpose(-1, -2) * scale).amax(-1)  # (B, H, Lq): largest sum_d |q_d k_d|
    bound = 16 * u * magnitude + 8 * u * want.abs()
    assert ((lse.double() - want).abs() <= bound).all(), ((lse.double() - want).abs() / bound).max()
