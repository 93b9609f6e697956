"""The walk in lockstep (`engine.lockstep`, what FSDP2's per-layer schedule sets): exact against the per-sequence
oracle whatever the batch count the processes agree on, and every process's model calls are the same sequence: one
forward per agreed batch, and in training one backward per batch that runs through every decoder layer."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bounds import assert_as_precise_as_dense
from conftest import FAMILIES, FLOAT32_ONLY, float64_twin, make_model, shared_batch
from reference import dense_forward_backward
from test_engine import TOL, batches, check, nonlinear_loss
from trl_dta import DTAEngine


class Agree:
    """A stand-in for the all-reduce of the other processes: the largest batch count is this one's plus `extra`
    (another process holds a larger forest). Records what it was asked."""

    def __init__(self, extra: int):
        self.extra = extra
        self.asked: list[int] = []

    def __call__(self, n: int) -> int:
        self.asked.append(n)
        return n + self.extra


class LayerCalls:
    """Forward and backward calls of every decoder layer (module hooks: the layer's output took part)."""

    def __init__(self, model):
        self.forwards, self.backwards = {}, {}
        self.handles = []
        for i, layer in enumerate(model.get_decoder().layers):
            self.forwards[i] = self.backwards[i] = 0
            self.handles.append(layer.register_forward_hook(lambda *a, i=i: self._bump(self.forwards, i)))
            self.handles.append(layer.register_full_backward_hook(lambda *a, i=i: self._bump(self.backwards, i)))

    @staticmethod
    def _bump(counts, i):
        counts[i] += 1

    def remove(self):
        for h in self.handles:
            h.remove()


def lockstep_check(model, seqs, tol, extra: int, n_scored=None, **engine_kw):
    """Oracle vs the lockstep walk (`test_engine.check`); returns its output, the agree stand-in and the layer calls
    of the engine call."""
    engine = DTAEngine(model, **engine_kw)
    engine.lockstep = agree = Agree(extra)
    calls = []

    @contextlib.contextmanager
    def counted():
        calls.append(LayerCalls(model))
        try:
            yield
        finally:
            calls[0].remove()

    out = check(model, seqs, tol, loss_fn=nonlinear_loss, n_scored=n_scored, engine=engine, around=counted)
    return out, agree, calls[0]


def assert_same_calls(out, agree, calls):
    """One agreement; the agreed number of forwards, every one with its backward through every layer."""
    assert len(agree.asked) == 1
    n = agree.asked[0] + agree.extra
    assert out.stats["idle_batches"] == agree.extra
    assert out.stats["forwards"] == n
    assert set(calls.forwards.values()) == {n}, calls.forwards
    assert set(calls.backwards.values()) == {n}, calls.backwards


@pytest.mark.parametrize("extra", [0, 2])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in FLOAT32_ONLY])
def test_lockstep_float64_equals_oracle(family, extra):
    model = make_model(family, torch.float64)
    out, agree, calls = lockstep_check(model, shared_batch(), TOL[torch.float64], extra, max_batch_tokens=40)
    assert agree.asked[0] > 1  # the budget splits the roots into several batches
    assert out.stats["forward_tokens"] == out.stats["tree_tokens"]  # every tree token forwarded once
    assert_same_calls(out, agree, calls)


def test_lockstep_float32_stock_model_and_no_grad():
    model = make_model("qwen2", torch.float32)
    out, agree, calls = lockstep_check(model, shared_batch(1), None, 1)
    assert_same_calls(out, agree, calls)
    engine = DTAEngine(model)
    engine.lockstep = agree = Agree(3)
    calls = LayerCalls(model)
    got = engine.logprobs(shared_batch(1), entropy=True)
    calls.remove()
    _, dense, _ = dense_forward_backward(model, shared_batch(1), nonlinear_loss)
    _, exact, _ = dense_forward_backward(float64_twin(model), shared_batch(1), nonlinear_loss)
    assert_as_precise_as_dense(got.logps, dense, exact, "lockstep log-probs")
    n = agree.asked[0] + 3
    assert got.stats["forwards"] == n and set(calls.forwards.values()) == {n}
    assert set(calls.backwards.values()) == {0}


def test_idle_process_runs_only_idle_batches():
    """A process whose tree needs fewer batches than another's pads with idle ones: zero gradient, same calls."""
    model = make_model("llama", torch.float64)
    seqs = [torch.tensor([5, 6, 7]), torch.tensor([5, 6, 8])]
    out, agree, calls = lockstep_check(model, seqs, TOL[torch.float64], 4)
    assert_same_calls(out, agree, calls)


def test_lockstep_refuses_an_agreement_below_its_own_count():
    model = make_model("qwen2", torch.float64)
    engine = DTAEngine(model, max_batch_tokens=20)
    engine.lockstep = lambda n: n - 1
    with pytest.raises(RuntimeError, match="must return the largest count"):
        engine.forward_backward(shared_batch(), nonlinear_loss)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=batches(), batch_tokens=st.sampled_from([1, 9, 64]), budget=st.sampled_from([None, 0, 8]),
       extra=st.integers(0, 2), data=st.data())
def test_lockstep_hypothesis_batches_float64(seqs, batch_tokens, budget, extra, data):
    model = _MODEL()
    n_scored = None
    if data.draw(st.booleans(), label="score only completions"):
        n_scored = [data.draw(st.integers(0, len(s) + 1), label=f"n_scored[{i}]") for i, s in enumerate(seqs)]
    seqs = [torch.tensor(s, dtype=torch.long) for s in seqs]
    out, agree, calls = lockstep_check(model, seqs, TOL[torch.float64], extra, n_scored=n_scored,
                                       max_batch_tokens=batch_tokens, max_graph_tokens=budget)
    assert_same_calls(out, agree, calls)


_CACHE = {}


def _MODEL():
    if "m" not in _CACHE:
        _CACHE["m"] = make_model("qwen2", torch.float64)
    return _CACHE["m"]
