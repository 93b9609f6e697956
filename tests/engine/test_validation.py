"""Input validation of `DTAEngine`: every argument, wrong types and values, each refused before any forward with an
error naming the argument, or accepted with exactly the result of its plain form."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import VOCAB, make_model
from trl_dta import DTAEngine

SEQS = [[5, 6, 7, 8], [5, 6, 9], [4]]


@pytest.fixture(scope="module")
def model():
    return make_model("qwen2", torch.float64, num_hidden_layers=1)


def _count_forwards(model):
    calls = []
    handle = model.model.register_forward_pre_hook(lambda *a, **k: calls.append(1))
    return calls, handle


def _sum_loss(i, lp, ent):
    return lp.sum()


@pytest.mark.parametrize(
    "kw, error, name",
    [
        (dict(block_size=True), TypeError, "block_size"),
        (dict(block_size=2.0), TypeError, "block_size"),
        (dict(block_size="8"), TypeError, "block_size"),
        (dict(block_size=None), TypeError, "block_size"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(max_batch_tokens=-1), ValueError, "max_batch_tokens"),
        (dict(max_batch_tokens=float("inf")), TypeError, "max_batch_tokens"),
        (dict(max_graph_tokens=True), TypeError, "max_graph_tokens"),
        (dict(max_graph_tokens=-2), ValueError, "max_graph_tokens"),
        (dict(max_graph_tokens=1.5), TypeError, "max_graph_tokens"),
        (dict(max_pack_tokens=False), TypeError, "max_pack_tokens"),
        (dict(max_pack_tokens=-1), ValueError, "max_pack_tokens"),
        (dict(lm_head_chunk_size=0), ValueError, "lm_head_chunk_size"),
        (dict(lm_head_chunk_size=np.float64(4)), TypeError, "lm_head_chunk_size"),
    ],
)
def test_constructor_refuses(model, kw, error, name):
    with pytest.raises(error, match=name):
        DTAEngine(model, **kw)


@pytest.mark.parametrize("bad", [None, "gpt2", torch.nn.Linear(2, 2)], ids=["none", "str", "linear"])
def test_constructor_refuses_non_causal_lm(bad):
    with pytest.raises(TypeError, match="causal"):
        DTAEngine(bad)


def test_constructor_accepts_numpy_and_tensor_ints(model):
    engine = DTAEngine(model, block_size=np.int64(4), max_graph_tokens=torch.tensor(3))
    assert engine.block_size == 4 and type(engine.block_size) is int and engine.max_graph_tokens == 3


# Each row: (keyword arguments of `logprobs` / `forward_backward`, expected error, text the message must contain).
BAD_CALLS = [
    (dict(seqs="abc"), TypeError, "seqs"),
    (dict(seqs=None), TypeError, "seqs"),
    (dict(seqs=5), TypeError, "seqs"),
    (dict(seqs={0: [3, 4]}), TypeError, "seqs"),
    (dict(seqs=torch.ones(2, 3, dtype=torch.long)), TypeError, "from_padded"),
    (dict(seqs=np.ones((2, 3), dtype=np.int64)), TypeError, "from_padded"),
    (dict(seqs=[]), ValueError, "empty"),
    (dict(seqs=[[3.0, 4.0]]), TypeError, r"seqs\[0\]\[0\]"),
    (dict(seqs=[[3, None]]), TypeError, r"seqs\[0\]\[1\]"),
    (dict(seqs=[[True, 3]]), TypeError, r"seqs\[0\]\[0\]"),
    (dict(seqs=[["a"]]), TypeError, r"seqs\[0\]\[0\]"),
    (dict(seqs=["ab"]), TypeError, r"seqs\[0\]"),
    (dict(seqs=[None]), TypeError, r"seqs\[0\]"),
    (dict(seqs=[torch.tensor([3.0, 4.0])]), TypeError, "dtype"),
    (dict(seqs=[torch.tensor([True, False])]), TypeError, "dtype"),
    (dict(seqs=[np.array([3.0, 4.0])]), TypeError, "dtype"),
    (dict(seqs=[torch.zeros(2, 2, dtype=torch.long)]), ValueError, "1-D"),
    (dict(seqs=[torch.zeros(2, dtype=torch.long, device="meta")]), ValueError, "meta"),
    (dict(seqs=[[-1, 3]]), ValueError, "negative"),
    (dict(seqs=[[3, VOCAB]]), ValueError, "vocab_size"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(temperature=True), TypeError, "temperature"),
    (dict(temperature="1"), TypeError, "temperature"),
    (dict(temperature=None), TypeError, "temperature"),
    (dict(temperature=torch.tensor(1.0)), TypeError, "temperature"),
    (dict(entropy=1), TypeError, "entropy"),
    (dict(entropy=None), TypeError, "entropy"),
    (dict(entropy="yes"), TypeError, "entropy"),
    (dict(n_scored=True), TypeError, "n_scored"),
    (dict(n_scored=1.5), TypeError, "n_scored"),
    (dict(n_scored=-1), ValueError, "n_scored"),
    (dict(n_scored="12"), TypeError, "n_scored"),
    (dict(n_scored=[1, 2.0, 0]), TypeError, r"n_scored\[1\]"),
    (dict(n_scored=[1, True, 0]), TypeError, r"n_scored\[1\]"),
    (dict(n_scored=[1, -1, 0]), ValueError, r"n_scored\[1\]"),
    (dict(n_scored=[1, 2]), ValueError, "n_scored"),
    (dict(n_scored=[1, None, 0]), TypeError, r"n_scored\[1\]"),
    (dict(n_scored=torch.tensor([1.0, 2.0, 0.0])), TypeError, r"n_scored\[0\]"),
    (dict(n_scored=torch.ones(3, 1, dtype=torch.long)), ValueError, "1-D"),
]


@pytest.mark.parametrize("training", [False, True], ids=["logprobs", "forward_backward"])
@pytest.mark.parametrize("kw, error, text", BAD_CALLS)
def test_call_refuses_before_any_forward(model, training, kw, error, text):
    kw = dict(kw)
    seqs = kw.pop("seqs", SEQS)
    engine = DTAEngine(model)
    calls, handle = _count_forwards(model)
    try:
        with pytest.raises(error, match=text):
            if training:
                engine.forward_backward(seqs, _sum_loss, **kw)
            else:
                engine.logprobs(seqs, **kw)
    finally:
        handle.remove()
    assert not calls, "a forward ran before the argument was refused"


def _same(a, b):
    return len(a.logps) == len(b.logps) and all(torch.equal(x, y) for x, y in zip(a.logps, b.logps))


@pytest.mark.parametrize(
    "seqs",
    [
        (s for s in SEQS),
        tuple(tuple(s) for s in SEQS),
        [np.array(s, dtype=np.int32) for s in SEQS],
        [torch.tensor(s, dtype=torch.int32) for s in SEQS],
        [[np.int64(t) for t in s] for s in SEQS],
        [[torch.tensor(t) for t in s] for s in SEQS],
    ],
    ids=["generator", "tuples", "numpy-int32", "tensor-int32", "numpy-scalars", "0d-tensors"],
)
def test_accepted_sequence_forms_equal_plain_lists(model, seqs):
    engine = DTAEngine(model)
    assert _same(engine.logprobs(seqs), engine.logprobs(SEQS))


@pytest.mark.parametrize(
    "n_scored",
    [(n for n in [2, 1, 0]), (2, 1, 0), np.array([2, 1, 0]), torch.tensor([2, 1, 0])],
    ids=["generator", "tuple", "numpy", "tensor"],
)
def test_accepted_n_scored_forms_equal_plain_list(model, n_scored):
    engine = DTAEngine(model)
    assert _same(engine.logprobs(SEQS, n_scored=n_scored), engine.logprobs(SEQS, n_scored=[2, 1, 0]))


def test_integer_temperature_equals_float(model):
    engine = DTAEngine(model)
    assert _same(engine.logprobs(SEQS, temperature=2), engine.logprobs(SEQS, temperature=2.0))


@pytest.mark.parametrize("loss_fn", [None, 5, "loss"], ids=["none", "int", "str"])
def test_non_callable_loss_fn(model, loss_fn):
    with pytest.raises(TypeError, match="loss_fn"):
        DTAEngine(model).forward_backward(SEQS, loss_fn)


@pytest.mark.parametrize(
    "loss_fn",
    [lambda i, lp, ent: lp, lambda i, lp, ent: 1.0, lambda i, lp, ent: None, lambda i, lp, ent: lp.sum().item()],
    ids=["vector", "float", "none", "python-number"],
)
def test_loss_fn_must_return_a_scalar_tensor(model, loss_fn):
    with pytest.raises(TypeError, match="loss_fn.*scalar"):
        DTAEngine(model).forward_backward([[3, 4, 5]], loss_fn)


def test_non_finite_loss_gives_the_dense_result(model):
    """A NaN loss is not refused: like the dense `loss.backward()`, it makes the total and the gradients NaN."""
    def nan_loss(i, lp, ent):
        return lp.sum() * math.nan

    model.zero_grad(set_to_none=True)
    out = DTAEngine(model).forward_backward(SEQS, nan_loss)
    dta_nan = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.isnan().any()}
    model.zero_grad(set_to_none=True)
    for i, s in enumerate(SEQS):
        lp = model(torch.tensor([s])).logits[0, :-1].log_softmax(-1).gather(-1, torch.tensor(s[1:])[:, None])
        nan_loss(i, lp[:, 0], None).backward()
    dense_nan = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.isnan().any()}
    model.zero_grad(set_to_none=True)
    assert out.loss.isnan() and dta_nan == dense_nan and dense_nan
