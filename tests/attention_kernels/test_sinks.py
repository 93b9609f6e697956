"""Attention sinks (GPT-OSS's per-head `s_aux`) in `two_part_attention`, every backend against the float64
concatenating reference with one more softmax column per head: the output and the gradients of the query, the path's
keys/values, the rows' own keys/values and the sink logits, on causal sibling rows (windows inside the rows and cutting
into the path, soft-capping, several Triton tiles) and packed subtree rows.

Bounds (`tests/bounds.py`). float64: 1e-10 relative to `max(|reference|, 1)` (exactness). float32: two computations of
the same attention within `bounds.chain_bound(k)` of each other, `k` the longest chain of rounded operations: a
score (`head_dim` products and sums), the softmax sum and the value sum over every key and the sink (`K + 1` each),
the merge of the parts and the sink (5 roundings), and in the backward the same again plus the sums of a path key's
and the sinks' gradients over every query that sees them (`batch * length * groups` folded queries): `k = 2 (head_dim
+ 2 (K + 1) + 5 + batch * length * groups)`. bf16: relative L2 within the derived multiple of the concatenating
path's own bf16 error (`bounds.assert_as_precise_as_dense`; the path and the sinks shared by the `batch` rows).
"""

from __future__ import annotations

import pytest
import torch

from bounds import assert_as_precise_as_dense, chain_bound
from tests.attention_kernels.reference import causal_case, packed_case, reference_attention
from tests.attention_kernels.test_two_part import CAUSAL, DEVICE_BACKENDS, PACKED, _on, _with, _worst
from trl_dta.kernels import two_part_attention

# Causal and packed cases of the two-part test, sinks added; "no-path" and "packed-no-path-gqa" merge the own part with
# the sink only.
CAUSAL_CASES = ("one-row", "no-path", "siblings-gqa", "window-cuts-path", "window-past-path", "softcap",
                "several-tiles")
PACKED_CASES = ("packed", "packed-no-path-gqa", "packed-window", "packed-softcap")
# bf16 against the concatenating path: the fused kernels where they run (CUDA), the torch parts on CPU.
LOW_PRECISION = [p for p in DEVICE_BACKENDS
                 if p.values[1] != "sdpa" and (p.values[0] == "cuda" or p.values[1] == "torch")]


def make_sinks(n_heads: int, dtype: torch.dtype, seed: int = 11) -> torch.Tensor:
    """Sink logits of order 1 with one large head (its queries put most of their mass on the sink)."""
    gen = torch.Generator().manual_seed(seed)
    sinks = torch.randn(n_heads, generator=gen, dtype=torch.float64) * 1.5 + 0.5
    sinks[0] = 3.0
    return sinks.to(dtype).requires_grad_()


def float32_bound(case) -> float:
    """The derived float32 bound (module docstring) for `case`."""
    batch, n_heads, length, dim = case.query.shape
    groups = n_heads // case.key.shape[1]
    keys = length + (0 if case.path_key is None else case.path_key.shape[2])
    return chain_bound(2 * (dim + 2 * (keys + 1) + 5 + batch * length * groups))


def check(case, sinks, backend, dtype, device="cpu") -> dict[str, float]:
    """Errors of the output and of every gradient against the float64 reference (computed on the CPU); fails past the
    dtype's bound."""
    tol = 1e-10 if dtype == torch.float64 else float32_bound(case)
    run = _on(case, device)
    inputs = run.inputs()
    run_sinks = sinks.detach().to(device).requires_grad_()
    out = two_part_attention(run.query, run.path_key, run.path_value, run.key, run.value, sinks=run_sinks,
                             backend=backend, **run.kwargs())
    assert out.dtype == dtype and out.shape == case.query.shape and out.device.type == device
    assert torch.isfinite(out).all()
    ref_inputs = [t.detach().double().requires_grad_() for t in case.inputs()]
    ref_sinks = sinks.detach().double().requires_grad_()
    ref = reference_attention(_with(case, ref_inputs), ref_sinks)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads = torch.autograd.grad(out, [*inputs, run_sinks], grad_out.to(device, dtype))
    ref_grads = torch.autograd.grad(ref, [*ref_inputs, ref_sinks], grad_out)
    names = ["query", "path_key", "path_value", "key", "value"] if case.path_key is not None else \
        ["query", "key", "value"]
    errors = {"out": _worst("out", out.cpu(), ref, tol)}
    for name, g, r in zip([*names, "sinks"], grads, ref_grads):
        errors[name] = _worst(f"grad {name}", g.cpu(), r, tol)
    # Not vacuous: the sinks move the output and receive a gradient far beyond the tolerance.
    assert (ref - reference_attention(_with(case, ref_inputs))).abs().max() > 1e3 * tol
    assert ref_grads[-1].abs().max() > 1e3 * tol
    return errors


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", CAUSAL_CASES)
@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_sinks_causal_rows(device, backend, name, dtype):
    case = causal_case(list(CAUSAL).index(name), dim=8, dtype=dtype, **CAUSAL[name])
    check(case, make_sinks(case.query.shape[1], dtype), backend, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", PACKED_CASES)
@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_sinks_packed_rows(device, backend, name, dtype):
    case = packed_case(1, dim=8, dtype=dtype, **PACKED[name])
    check(case, make_sinks(case.query.shape[1], dtype), backend, dtype, device)


def test_sinks_without_grad_and_as_a_float32_parameter():
    """No-grad calls give the same output; float32 sinks beside float64 attention inputs (a float32 parameter under a
    wider computation) are used in the accumulation dtype and get a float32 gradient."""
    case = causal_case(3, batch=2, n_heads=4, n_kv=2, length=5, path_len=6, dim=8, dtype=torch.float64)
    sinks = make_sinks(4, torch.float32)
    args = (case.query, case.path_key, case.path_value, case.key, case.value)
    out = two_part_attention(*args, sinks=sinks, backend="torch", **case.kwargs())
    with torch.no_grad():
        quiet = two_part_attention(*args, sinks=sinks, backend="torch", **case.kwargs())
    assert quiet.grad_fn is None and torch.equal(quiet, out.detach())
    (grad,) = torch.autograd.grad(out.sum(), [sinks])
    assert grad.dtype == torch.float32


def test_bad_sinks_are_refused():
    case = causal_case(0, batch=2, n_heads=2, n_kv=1, length=4, path_len=3, dim=8, dtype=torch.float64)
    args = (case.query, case.path_key, case.path_value, case.key, case.value)
    for bad in (torch.zeros(3, dtype=torch.float64), torch.zeros(2, 1, dtype=torch.float64), torch.zeros(2,
                                                                                                        dtype=torch.long)):
        with pytest.raises(ValueError, match=r"`sinks` must be a floating tensor of shape \(n_heads,\) = \(2,\)"):
            two_part_attention(*args, sinks=bad)


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize(("device", "backend"), LOW_PRECISION)
def test_sinks_bf16_as_precise_as_sdpa(device, backend, packed):
    """bf16 inputs with float32 sinks (GPT-OSS under bf16 autocast: the sink parameter stays float32): error against
    the float64 reference, in relative L2, within the derived multiple of the concatenating path's own bf16 error,
    for the output and every gradient."""
    shape = dict(batch=4, n_heads=8, n_kv=2, path_len=300 if device == "cuda" else 40, dim=64, dtype=torch.float64)
    case = packed_case(3, **shape, pad=3) if packed else causal_case(3, length=24, **shape)
    ref_inputs = [*case.inputs(), make_sinks(8, torch.float64)]
    ref = reference_attention(_with(case, ref_inputs[:-1]), ref_inputs[-1])
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out)
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.kwargs().items()}
    results = {}
    for name in ("sdpa", backend):
        inputs = [t.detach().to(device, torch.bfloat16).requires_grad_() for t in ref_inputs[:-1]]
        sinks = ref_inputs[-1].detach().to(device, torch.float32).requires_grad_()
        out = two_part_attention(*inputs, sinks=sinks, backend=name, **kwargs)
        grads = torch.autograd.grad(out, [*inputs, sinks], grad_out.to(device, torch.bfloat16))
        results[name] = [t.detach().double().cpu() for t in (out, *grads)]
    names = ("out", "query", "path_key", "path_value", "key", "value", "sinks")
    for what, ours, theirs, exact in zip(names, results[backend], results["sdpa"], [ref, *ref_grads]):
        shared = what.startswith("path") or what == "sinks"
        assert_as_precise_as_dense(ours, theirs, exact.detach(), f"{backend} {what}",
                                   sharing=shape["batch"] if shared else None)
