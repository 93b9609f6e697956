"""`two_part_attention(spans=...)`: shared rows (several subtrees side by side, `kernels/spans.py`) attended span by
span equal the reference (and the same call over the whole row's mask): outputs and the gradients of the query, the
path's and the rows' keys/values, float64 to 1e-10, on every CPU backend here; with a path and without, with a
sliding window, GQA; and spans that do not tile the rows are refused."""

from __future__ import annotations

import pytest
import torch

from tests.attention_kernels.reference import packed_case, reference_attention
from trl_dta.kernels import available_backends, two_part_attention

BACKENDS = [b for b in ("torch", "triton") if b in available_backends("cpu")]
CASES = {"path": dict(path_len=5), "no-path": dict(path_len=0), "window": dict(path_len=6, window=4)}


def _grads(out, inputs):
    return torch.autograd.grad(out, inputs, torch.ones_like(out))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_spans_equal_the_reference(backend, case):
    c = packed_case(3, batch=3, n_heads=4, n_kv=2, dim=8, dtype=torch.float64, items=3, **CASES[case])
    assert any(len(row) > 2 for row in c.spans)  # shared rows: several trees (and padding) per row
    inputs = [t.requires_grad_() for t in c.inputs()]
    path = (c.path_key, c.path_value) if c.path_key is not None else (None, None)
    got = two_part_attention(c.query, *path, c.key, c.value, spans=c.spans, backend=backend, **c.kwargs())
    whole = two_part_attention(c.query, *path, c.key, c.value, backend=backend, **c.kwargs())
    want = reference_attention(c)
    assert (got.double() - want).abs().max() <= 1e-10 and (whole - want).abs().max() <= 1e-10
    for g, w in zip(_grads(got, inputs), _grads(want, inputs)):
        assert (g - w).abs().max() <= 1e-10


def test_spans_must_tile_the_rows():
    c = packed_case(4, batch=2, n_heads=2, n_kv=1, path_len=2, dim=4, dtype=torch.float64, items=2)
    length = c.query.shape[2]
    args = (c.query, c.path_key, c.path_value, c.key, c.value)
    with pytest.raises(ValueError, match="one tuple of"):
        two_part_attention(*args, spans=c.spans[:1], backend="torch", **c.kwargs())
    with pytest.raises(ValueError, match=rf"tile the row's columns 0 .. {length}"):
        two_part_attention(*args, spans=(((0, 1, True),),) + c.spans[1:], backend="torch", **c.kwargs())
    with pytest.raises(ValueError, match="pass them with `key_end`"):
        two_part_attention(*args, spans=c.spans, backend="torch", scaling=c.scale)
