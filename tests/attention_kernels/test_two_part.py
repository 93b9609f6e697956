"""`two_part_attention`, every backend against the float64 concatenating reference: outputs and the gradients of
the query, the path's keys/values and the rows' own keys/values, on every device here (CUDA cases skip without a GPU;
on a GPU machine the Triton cases on CPU tensors skip, since Triton runs on CPU tensors only in its interpreter)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

import pytest
import torch

from bounds import assert_as_precise_as_dense, chain_bound
from tests.attention_kernels.reference import causal_case, packed_case, reference_attention
from trl_dta.kernels import (
    AUTO,
    BACKENDS,
    available_backends,
    key_end_from_row_mask,
    part_kernels,
    resolve_backend,
    two_part_attention,
)

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA; the Triton kernels then run on CPU tensors.
TRITON_ON_CPU = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
NO_CUDA = "needs a CUDA GPU"
NO_TRITON_CPU = ("Triton runs on CPU tensors only in its interpreter (TRITON_INTERPRET=1, which tests/conftest.py "
                 "sets on machines without CUDA)" if HAS_TRITON else "triton is not installed")

TOL = {torch.float64: 1e-10}


def _tol(case, dtype) -> float:
    """float64: exactness. float32: two computations of the same attention within `bounds.chain_bound` of each other,
    the longest chain being a score (`dim` products and sums, the soft-cap), the softmax sum and the value sum over
    every key (path and own), the two-part merge (5 roundings), and in the backward the same again for `dO . V` and
    the sums of the query's and keys' gradients over keys and queries (2x)."""
    if dtype == torch.float64:
        return TOL[dtype]
    keys = case.key.shape[-2] + (0 if case.path_key is None else case.path_key.shape[-2])
    return chain_bound(2 * (case.query.shape[-1] + 2 * keys + 5 + case.query.shape[-2]))


def _device_backends(cuda_only=()):
    """`(device, backend)` pairs, each skipped with its reason where it cannot run here."""
    params = []
    for device in ("cpu", "cuda"):
        for backend in ("sdpa", "torch", "triton", "flash"):
            skip = None
            if device == "cuda" and not HAS_CUDA:
                skip = NO_CUDA
            elif backend == "triton" and not (HAS_TRITON if device == "cuda" else TRITON_ON_CPU):
                skip = "triton is not installed" if device == "cuda" else NO_TRITON_CPU
            elif backend == "flash" and (device == "cpu" or backend not in available_backends(device)):
                if device == "cpu":
                    continue  # flash-attn has no CPU kernels (test_flash_standin.py registers some)
                skip = "flash-attn is not installed"
            if device == "cpu" and backend in cuda_only:
                continue
            marks = [pytest.mark.skip(reason=skip)] if skip else []
            params.append(pytest.param(device, backend, id=f"{device}-{backend}", marks=marks))
    return params


DEVICE_BACKENDS = _device_backends()

# (name, case builder kwargs). Causal rows: 1 and many rows, P = 0 and P > 0, GQA, windows inside the rows and
# cutting into the path, soft-capping. Packed rows: random trees, right-padded.
CAUSAL = {
    "one-row": dict(batch=1, n_heads=2, n_kv=2, length=5, path_len=7),
    "no-path": dict(batch=3, n_heads=2, n_kv=1, length=6, path_len=0),
    "siblings-gqa": dict(batch=4, n_heads=4, n_kv=2, length=5, path_len=9),
    "window-in-rows": dict(batch=3, n_heads=2, n_kv=2, length=6, path_len=2, window=4),
    "window-clear": dict(batch=3, n_heads=2, n_kv=1, length=4, path_len=3, window=8),
    "window-cuts-path": dict(batch=3, n_heads=4, n_kv=2, length=5, path_len=9, window=4),
    "window-past-path": dict(batch=2, n_heads=2, n_kv=2, length=7, path_len=3, window=2),
    "softcap": dict(batch=3, n_heads=4, n_kv=2, length=5, path_len=6, softcap=1.5),
    "softcap-window": dict(batch=2, n_heads=2, n_kv=1, length=6, path_len=7, window=5, softcap=2.0),
    "several-tiles": dict(batch=2, n_heads=2, n_kv=1, length=18, path_len=21, window=12),  # Triton tiles are 16
}
PACKED = {
    "packed": dict(batch=4, n_heads=2, n_kv=2, path_len=5),
    "packed-no-path-gqa": dict(batch=3, n_heads=4, n_kv=2, path_len=0),
    "packed-window": dict(batch=4, n_heads=4, n_kv=2, path_len=6, window=4),
    "packed-softcap": dict(batch=3, n_heads=2, n_kv=1, path_len=4, softcap=2.5, window=6),
}


def _worst(name, actual, expected, tol):
    err = (actual.double() - expected).abs()
    scale = expected.abs().max().clamp(min=1.0)
    if err.max() > tol * scale:
        flat = err.flatten().topk(min(5, err.numel()))
        where = [tuple(int(i) for i in torch.unravel_index(k, err.shape)) for k in flat.indices]
        rows = [f"  {w}: got {actual[w].item():.6e}, want {expected[w].item():.6e}" for w in where]
        pytest.fail(f"{name}: max error {err.max().item():.3e} > {tol:.0e} x {scale.item():.3g}\n" + "\n".join(rows))
    return err.max().item()


def _on(case, device):
    """The case with every tensor on `device` (the inputs as fresh leaves requiring grad)."""
    def move(t, leaf=False):
        if t is None:
            return None
        t = t.detach().to(device)
        return t.requires_grad_() if leaf else t

    return replace(case, query=move(case.query, True), path_key=move(case.path_key, True),
                   path_value=move(case.path_value, True), key=move(case.key, True), value=move(case.value, True),
                   positions=move(case.positions), key_end=move(case.key_end), visible=move(case.visible))


def _check(case, backend, dtype, device="cpu"):
    run = _on(case, device)
    inputs = run.inputs()
    out = two_part_attention(*[run.query, run.path_key, run.path_value, run.key, run.value],
                             backend=backend, **run.kwargs())
    assert out.dtype == dtype and out.shape == case.query.shape and out.device.type == device
    assert torch.isfinite(out).all()
    ref_inputs = [t.detach().double().requires_grad_() for t in case.inputs()]
    ref_case = _with(case, ref_inputs)
    ref = reference_attention(ref_case)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads = torch.autograd.grad(out, inputs, grad_out.to(device, dtype))
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out)
    names = ["query", "path_key", "path_value", "key", "value"] if case.path_key is not None else \
        ["query", "key", "value"]
    tol = _tol(case, dtype)
    errors = {"out": _worst("out", out.cpu(), ref, tol)}
    for name, g, r in zip(names, grads, ref_grads):
        errors[name] = _worst(f"grad {name}", g.cpu(), r, tol)
    return errors


def _with(case, inputs):
    if case.path_key is None:
        q, k, v = inputs
        return replace(case, query=q, key=k, value=v)
    q, pk, pv, k, v = inputs
    return replace(case, query=q, path_key=pk, path_value=pv, key=k, value=v)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(CAUSAL))
@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_causal_rows(device, backend, name, dtype):
    case = causal_case(list(CAUSAL).index(name), dim=8, dtype=dtype, **CAUSAL[name])
    _check(case, backend, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(PACKED))
@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_packed_rows(device, backend, name, seed, dtype):
    case = packed_case(seed, dim=8, dtype=dtype, **PACKED[name])
    _check(case, backend, dtype, device)


def test_key_end_matches_tree_mask():
    """`key_end` of the random packed rows is exactly their tree mask, and the conversion refuses other masks."""
    for seed in range(5):
        case = packed_case(seed, batch=3, n_heads=1, n_kv=1, path_len=0, dim=4, dtype=torch.float64)
        assert torch.equal(key_end_from_row_mask(case.visible), case.key_end)
    bad = torch.ones(1, 3, 3, dtype=torch.bool)  # sees the future
    with pytest.raises(ValueError, match="pre-order tree mask"):
        key_end_from_row_mask(bad)


def test_no_grad_saves_nothing():
    case = causal_case(0, batch=2, n_heads=2, n_kv=1, length=4, path_len=3, dim=8, dtype=torch.float64)
    with torch.no_grad():
        out = two_part_attention(case.query, case.path_key, case.path_value, case.key, case.value, backend="torch")
    assert out.grad_fn is None


def test_errors_name_the_fix():
    case = causal_case(0, batch=2, n_heads=2, n_kv=1, length=4, path_len=3, dim=8, dtype=torch.float64)
    args = (case.query, case.path_key, case.path_value, case.key, case.value)
    with pytest.raises(ValueError, match=r"`backend` must be one of .*'sdpa'.*'torch'"):
        two_part_attention(*args, backend="fast")
    with pytest.raises(ValueError, match="keep the path once"):
        two_part_attention(case.query, case.path_key.expand(2, -1, -1, -1), case.path_value, case.key, case.value)
    with pytest.raises(TypeError, match="cast the path"):
        two_part_attention(case.query, case.path_key.float(), case.path_value, case.key, case.value)
    with pytest.raises(ValueError, match="need both `key_end` and `positions`"):
        two_part_attention(*args, key_end=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="sliding_window"):
        two_part_attention(*args, sliding_window=2.0)
    if not HAS_CUDA:
        with pytest.raises(ValueError, match=r"cannot run on cpu here; available: \['sdpa', 'torch'"):
            two_part_attention(*args, backend="flash")


def test_auto_resolves_to_an_available_backend():
    assert set(BACKENDS) == {"sdpa", "torch", "flash", "triton", "auto"}
    assert resolve_backend("auto", "cpu") == AUTO["cpu"][0] == "torch"
    assert resolve_backend("auto", "cpu") in available_backends("cpu")


@pytest.mark.parametrize(("backend", "options", "expected"), [
    ("torch", {}, ("torch", "torch")),
    ("torch", dict(sliding_window=3), ("torch", "torch")),
    ("torch", dict(softcap=2.0), ("math", "math")),
    ("sdpa", {}, ("concat", "concat")),
    pytest.param("triton", dict(softcap=2.0, sliding_window=3), ("triton", "triton"),
                 marks=pytest.mark.skipif(not TRITON_ON_CPU, reason=NO_TRITON_CPU)),
])
def test_kernel_choice(backend, options, expected):
    """Each part runs on the backend's own kernel where it is exact, on `math` otherwise (CPU)."""
    case = causal_case(0, batch=2, n_heads=2, n_kv=1, length=4, path_len=3, dim=8, dtype=torch.float64)
    assert part_kernels(case.query, case.path_key, case.key, backend=backend, **options) == expected
    assert part_kernels(case.query, None, case.key, backend=backend, **options)[0] in (None, "concat")


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
@pytest.mark.parametrize(("backend", "dtype", "expected"), [
    ("torch", torch.bfloat16, ("torch", "torch")),
    ("torch", torch.float32, ("math", "math")),
    pytest.param("triton", torch.bfloat16, ("triton", "triton"),
                 marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")),
    pytest.param("triton", torch.float16, ("triton", "triton"),
                 marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")),
    # Triton's float32 dot is slow and fragile on CUDA (see triton_parts): exact float32 `math` instead.
    pytest.param("triton", torch.float32, ("math", "math"),
                 marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")),
    pytest.param("triton", torch.float64, ("math", "math"),
                 marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")),
])
def test_kernel_choice_cuda(backend, dtype, expected):
    case = _on(causal_case(0, batch=2, n_heads=4, n_kv=2, length=8, path_len=5, dim=64, dtype=dtype), "cuda")
    assert part_kernels(case.query, case.path_key, case.key, backend=backend) == expected


# Half precision, the fused kernels' precision (the Triton interpreter has none). CPU: the `torch` backend (aten's CPU
# flash kernel). CUDA: every backend at the head dims of the families served (64, 128), with every kind of mask a DTA
# forward makes (causal rows, packed subtree rows, a window cutting into the path, soft-capping with a window); fp16
# on causal rows at head_dim 128. Each case compiles its Triton variants once.
LOW_MASKS = {"causal": {}, "packed": {}, "window": dict(window=96), "softcap-window": dict(window=96, softcap=2.0)}


def _low_precision_params():
    params = [pytest.param("cpu", "torch", torch.bfloat16, 64, mask, id=f"cpu-torch-bf16-64-{mask}")
              for mask in ("causal", "packed")]
    for backend in ("torch", "triton", "flash"):
        cases = [(torch.bfloat16, dim, mask) for dim in (64, 128) for mask in LOW_MASKS]
        cases.append((torch.float16, 128, "causal"))
        for dtype, dim, mask in cases:
            skip = NO_CUDA if not HAS_CUDA else "triton is not installed" if backend == "triton" and not HAS_TRITON \
                else "flash-attn is not installed" if backend == "flash" and "flash" not in available_backends("cuda") \
                else None
            name = f"cuda-{backend}-{str(dtype).split('.')[-1]}-{dim}-{mask}"
            params.append(pytest.param("cuda", backend, dtype, dim, mask, id=name,
                                       marks=[pytest.mark.skip(reason=skip)] if skip else []))
    return params


@pytest.mark.parametrize(("device", "backend", "dtype", "dim", "mask"), _low_precision_params())
def test_half_precision_no_worse_than_sdpa(device, backend, dtype, dim, mask):
    """Error against the float64 reference, in relative L2, within the derived multiple of the concatenating SDPA
    path's in the same precision (`bounds.py`), for the output and every gradient (the path's keys and values shared
    by the `batch` rows: `gradient_slack`). Both round inputs, outputs and gradients to `dtype` and accumulate in
    float32; a softmax or a gradient sum in half precision costs an order of magnitude."""
    shape = dict(batch=4, n_heads=8, n_kv=2, path_len=300 if device == "cuda" else 40, dim=dim, dtype=torch.float64,
                 **LOW_MASKS[mask])
    case = packed_case(3, **shape, pad=3) if mask == "packed" else causal_case(3, length=24, **shape)
    ref_inputs = case.inputs()
    ref = reference_attention(case)
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out)
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.kwargs().items()}
    errors = {}
    for name in ("sdpa", backend):
        inputs = [t.detach().to(device, dtype).requires_grad_() for t in ref_inputs]
        out = two_part_attention(*inputs, backend=name, **kwargs)
        grads = torch.autograd.grad(out, inputs, grad_out.to(device, dtype))
        errors[name] = [t.detach().double().cpu() for t in (out, *grads)]
    used = part_kernels(*[t.to(device, dtype) for t in (case.query, case.path_key, case.key)], backend=backend,
                        **kwargs)
    names = ("out", "query", "path_key", "path_value", "key", "value")
    for what, ours, theirs, exact in zip(names, errors[backend], errors["sdpa"], [ref, *ref_grads]):
        assert_as_precise_as_dense(ours, theirs, exact.detach(), f"{backend} ({used}) {what}",
                                   sharing=shape["batch"] if what.startswith("path") else None)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not TRITON_ON_CPU, reason=NO_TRITON_CPU))])
def test_transposed_inputs(backend):
    """Queries/keys as transformers passes them: `(batch, length, heads, dim)` storage viewed as `(b, h, l, d)`."""
    case = causal_case(5, batch=3, n_heads=4, n_kv=2, length=6, path_len=5, dim=8, dtype=torch.float64)
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
               for t in (case.query, case.key, case.value))
    out = two_part_attention(q, case.path_key, case.path_value, k, v, backend=backend, **case.kwargs())
    _worst("out", out, reference_attention(case).detach(), TOL[torch.float64])
