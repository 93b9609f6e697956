"""Engine calls that cannot be confused: one call per model at a time, a clear error for any other forward of the
model during a call, and sequence lengths limited only where the dense model is limited."""

from __future__ import annotations

import threading

import pytest
import torch
import transformers

from conftest import VOCAB, make_model
from reference import compare_lists, dense_forward_backward
from trl_dta import DTAEngine
from trl_dta.refusal import DTAUnsupportedError

SEQS = [[5, 6, 7, 8], [5, 6, 9]]


@pytest.fixture(scope="module")
def model():
    return make_model("qwen2", torch.float32, num_hidden_layers=1)


def _assert_restored(model, before):
    assert model.config._attn_implementation == before
    model(torch.tensor([SEQS[0]]))  # the dense forward works again after the failed call


def test_model_forward_inside_loss_fn_says_what_happened(model):
    before = model.config._attn_implementation

    def loss_fn(i, lp, ent):
        model(torch.tensor([SEQS[0]]))
        return lp.sum()

    with pytest.raises(RuntimeError, match=r"without a DTAEngine context.*inside `loss_fn`"):
        DTAEngine(model).forward_backward(SEQS, loss_fn)
    _assert_restored(model, before)


def test_engine_call_inside_loss_fn_is_refused(model):
    before = model.config._attn_implementation
    engine = DTAEngine(model)

    def loss_fn(i, lp, ent):
        DTAEngine(model).logprobs(SEQS)
        return lp.sum()

    with pytest.raises(RuntimeError, match="already running in this thread"):
        engine.forward_backward(SEQS, loss_fn)
    _assert_restored(model, before)
    engine.forward_backward(SEQS, lambda i, lp, ent: lp.sum())  # the model is free again


@pytest.mark.parametrize("other", ["engine", "model"])
def test_other_thread_during_a_call_is_refused(model, other):
    """While a call runs (here: paused inside `loss_fn`), another thread's engine call or model forward fails with a
    message that names the cause."""
    errors = []

    def other_thread():
        try:
            if other == "engine":
                DTAEngine(model).logprobs(SEQS)
            else:
                model(torch.tensor([SEQS[0]]))
        except RuntimeError as e:
            errors.append(str(e))

    def loss_fn(i, lp, ent):
        if i == 0:
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
        return lp.sum()

    DTAEngine(model).forward_backward(SEQS, loss_fn)
    want = "already running in another thread" if other == "engine" else "another thread"
    assert len(errors) == 1 and want in errors[0], errors
    _assert_restored(model, model.config._attn_implementation)


def test_rope_model_runs_past_max_position_embeddings():
    """The dense RoPE model runs past `max_position_embeddings`, so DTA must too, with the same results."""
    model = make_model("qwen2", torch.float64, max_position_embeddings=16)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, VOCAB, (14,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(3, VOCAB, (n,), generator=g)]) for n in (9, 20, 3)]
    model.zero_grad(set_to_none=True)
    _, want, _ = dense_forward_backward(model, seqs, lambda i, lp, ent: lp.sum())
    model.zero_grad(set_to_none=True)
    got = DTAEngine(model).forward_backward(seqs, lambda i, lp, ent: lp.sum()).logps
    assert compare_lists(got, want)[0] <= 1e-10


def test_learned_position_table_limits_length_before_any_forward():
    """GPT-2's learned position embeddings hold `n_positions` rows: the dense model fails past them, so DTA refuses
    such a sequence up front, without naming options TRL does not have."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=8,
                                     bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(IndexError):
        model(torch.arange(3, 12)[None])  # the dense model cannot run 9 tokens
    with pytest.raises(ValueError, match="position embeddings") as info:
        DTAEngine(model).logprobs([list(range(3, 12))])
    assert "max_prompt_length" not in str(info.value)


def test_longrope_beyond_original_length_is_refused():
    """Longrope picks its frequencies from the longest position of each forward: exact only within the original
    length."""
    half = 4  # head_dim 8 / 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
            "long_factor": [2.0] * half, "original_max_position_embeddings": 8, "factor": 2.0}
    model = make_model("phi3", torch.float32, rope_parameters=rope, max_position_embeddings=16,
                       original_max_position_embeddings=8)
    engine = DTAEngine(model)
    engine.logprobs([list(range(3, 11))])
    with pytest.raises(DTAUnsupportedError, match="original_max_position_embeddings"):
        engine.logprobs([list(range(3, 12))])
