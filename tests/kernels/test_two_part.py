"""`two_part_attention`, every backend against the float64 concatenating reference: outputs and the gradients of
the query, the path's keys/values and the rows' own keys/values."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from bounds import assert_as_precise_as_dense, chain_bound
from tests.kernels.reference import causal_case, packed_case, reference_attention
from trl_dta.kernels import AUTO, BACKENDS, available_backends, key_end_from_row_mask, part_kernels, \
    resolve_backend, two_part_attention

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_FLASH = importlib.util.find_spec("flash_attn") is not None

TOL = {torch.float64: 1e-10}


def _tol(case, dtype) -> float:
    """float64: exactness. float32: two computations of the same attention within `bounds.chain_bound` of each other,
    the longest chain being a score (`dim` products and sums, the soft-cap), the softmax sum and the value sum over every
    key (path and own), the two-part merge (5 roundings), and in the backward the same again for `dO . V` and the
    sums of the query's and keys' gradients over keys and queries (2x)."""
    if dtype == torch.float64:
        return TOL[dtype]
    keys = case.key.shape[-2] + (0 if case.path_key is None else case.path_key.shape[-2])
    return chain_bound(2 * (case.query.shape[-1] + 2 * keys + 5 + case.query.shape[-2]))
BACKEND_PARAMS = [
    "sdpa",
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")),
    pytest.param("flash", marks=pytest.mark.skipif(not (HAS_CUDA and HAS_FLASH), reason="needs CUDA and flash-attn")),
]

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


def _check(case, backend, dtype):
    inputs = case.inputs()
    out = two_part_attention(*[case.query, case.path_key, case.path_value, case.key, case.value],
                             backend=backend, **case.kwargs())
    assert out.dtype == dtype and out.shape == case.query.shape
    assert torch.isfinite(out).all()
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref_case = _with(case, ref_inputs)
    ref = reference_attention(ref_case)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads = torch.autograd.grad(out, inputs, grad_out.to(dtype))
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out)
    names = ["query", "path_key", "path_value", "key", "value"] if case.path_key is not None else \
        ["query", "key", "value"]
    tol = _tol(case, dtype)
    errors = {"out": _worst("out", out, ref, tol)}
    for name, g, r in zip(names, grads, ref_grads):
        errors[name] = _worst(f"grad {name}", g, r, tol)
    return errors


def _with(case, inputs):
    from dataclasses import replace

    if case.path_key is None:
        q, k, v = inputs
        return replace(case, query=q, key=k, value=v)
    q, pk, pv, k, v = inputs
    return replace(case, query=q, path_key=pk, path_value=pv, key=k, value=v)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(CAUSAL))
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_causal_rows(backend, name, dtype):
    case = causal_case(list(CAUSAL).index(name), dim=8, dtype=dtype, **CAUSAL[name])
    _check(case, backend, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(PACKED))
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_packed_rows(backend, name, seed, dtype):
    case = packed_case(seed, dim=8, dtype=dtype, **PACKED[name])
    _check(case, backend, dtype)


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
                 marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")),
])
def test_kernel_choice(backend, options, expected):
    """Each part runs on the backend's own kernel where it is exact, on `math` otherwise (CPU)."""
    case = causal_case(0, batch=2, n_heads=2, n_kv=1, length=4, path_len=3, dim=8, dtype=torch.float64)
    assert part_kernels(case.query, case.path_key, case.key, backend=backend, **options) == expected
    assert part_kernels(case.query, None, case.key, backend=backend, **options)[0] in (None, "concat")


LOW_PRECISION = [
    pytest.param("cpu", "torch", id="cpu-torch"),
    pytest.param("cuda", "torch", id="cuda-torch", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")),
    pytest.param("cuda", "triton", id="cuda-triton", marks=pytest.mark.skipif(
        not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and triton")),
    pytest.param("cuda", "flash", id="cuda-flash", marks=pytest.mark.skipif(
        not (HAS_CUDA and HAS_FLASH), reason="needs CUDA and flash-attn")),
]


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize(("device", "backend"), LOW_PRECISION)
def test_bf16_no_worse_than_sdpa(device, backend, packed):
    """bf16 (the fused kernels' precision; the Triton interpreter has none): error against the float64 reference, in
    relative L2, within the derived multiple of the concatenating SDPA path's in bf16 (`bounds.py`), for the output
    and every gradient (the path's keys and values shared by the `batch` rows: `gradient_slack`)."""
    shape = dict(batch=4, n_heads=8, n_kv=2, path_len=300 if device == "cuda" else 40, dim=64, dtype=torch.float64)
    case = packed_case(3, **shape, pad=3) if packed else causal_case(3, length=24, **shape)
    ref_inputs = case.inputs()
    ref = reference_attention(case)
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out)
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.kwargs().items()}
    errors = {}
    for name in ("sdpa", backend):
        inputs = [t.detach().to(device, torch.bfloat16).requires_grad_() for t in ref_inputs]
        out = two_part_attention(*inputs, backend=name, **kwargs)
        grads = torch.autograd.grad(out, inputs, grad_out.to(device, torch.bfloat16))
        errors[name] = [t.detach().double().cpu() for t in (out, *grads)]
    names = ("out", "query", "path_key", "path_value", "key", "value")
    for what, ours, theirs, exact in zip(names, errors[backend], errors["sdpa"], [ref, *ref_grads]):
        assert_as_precise_as_dense(ours, theirs, exact.detach(), f"{backend} {what}",
                                   sharing=shape["batch"] if what.startswith("path") else None)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed"))])
def test_transposed_inputs(backend):
    """Queries/keys as transformers passes them: `(batch, length, heads, dim)` storage viewed as `(b, h, l, d)`."""
    case = causal_case(5, batch=3, n_heads=4, n_kv=2, length=6, path_len=5, dim=8, dtype=torch.float64)
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
               for t in (case.query, case.key, case.value))
    out = two_part_attention(q, case.path_key, case.path_value, k, v, backend=backend, **case.kwargs())
    _worst("out", out, reference_attention(case).detach(), TOL[torch.float64])
