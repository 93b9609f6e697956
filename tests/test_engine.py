"""DTAEngine against the per-sequence dense oracle: log-probs, entropies, loss and every parameter gradient, on the
default attention backend and on each backend that runs here ("triton" under `TRITON_INTERPRET=1`)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bounds import assert_as_precise_as_dense, max_sharing
from conftest import FAMILIES, FLOAT32_ONLY, VOCAB, float64_twin, make_model, shared_batch
from reference import compare_grads, compare_lists, dense_forward_backward, grads_of
from trl_dta import DTAEngine, PrefixTree
from trl_dta.kernels import available_backends

# float64: the exactness bound (float64 rounding through a few layers is ~1e-14); other dtypes are judged against
# the dense path's own error (`check`).
TOL = {torch.float64: 1e-10}


def nonlinear_loss(i, lp, ent):
    """Non-linear over the whole sequence (exp of a mean) plus an entropy term: prefix log-probs and entropies get
    gradients from every sequence through them, so they must be accumulated before the prefix is popped."""
    if lp.numel() == 0:
        return lp.sum()
    loss = torch.exp(lp.mean()) * (1 + 0.1 * i) - 0.01 * (lp**2).sum()
    if ent is not None:
        loss = loss + 0.05 * torch.tanh(ent).sum()
    return loss


def check(model, seqs, tol=TOL[torch.float64], *, loss_fn=nonlinear_loss, temperature=1.0, n_scored=None,
          entropy=True, engine=None, around=contextlib.nullcontext, twin=float64_twin, **engine_kw):
    """DTA's `forward_backward` against the per-sequence dense computation on the same model.

    float64 models (the exactness question): log-probs, entropies, the loss and every gradient within `tol` of the
    dense path's. Other dtypes (what that precision can promise, `bounds.py`): DTA's and the dense path's errors are
    both measured against a float64 twin of the model (`conftest.float64_twin`), in relative L2 over all log-probs,
    all entropies and all parameter gradients, and DTA's may be at most the derived multiple of the dense path's.
    `engine` (default: one built from `engine_kw`) runs inside the context `around()`; `twin` makes the float64
    model.
    """
    model.zero_grad(set_to_none=True)
    want_loss, want_lp, want_ent = dense_forward_backward(model, seqs, loss_fn, temperature, n_scored, entropy)
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    engine = engine or DTAEngine(model, **engine_kw)
    with around():
        out = engine.forward_backward(seqs, loss_fn, temperature=temperature, entropy=entropy, n_scored=n_scored)
    got = grads_of(model)
    if not entropy:
        assert out.entropies is None
    if next(model.parameters()).dtype != torch.float64:
        exact = twin(model)
        _, lp64, ent64 = dense_forward_backward(exact, seqs, loss_fn, temperature, n_scored, entropy)
        assert_as_precise_as_dense(out.logps, want_lp, lp64, "log-probs")
        if entropy:
            assert_as_precise_as_dense(out.entropies, want_ent, ent64, "entropies")
        assert_as_precise_as_dense(got, want, grads_of(exact), "gradients", sharing=max_sharing(seqs))
        return out
    err_lp, i = compare_lists(out.logps, want_lp)
    assert err_lp <= tol, f"log-probs differ by {err_lp:.3g} (sequence {i})"
    if entropy:
        err_ent, i = compare_lists(out.entropies, want_ent)
        assert err_ent <= tol, f"entropies differ by {err_ent:.3g} (sequence {i})"
    loss_err = abs(out.loss.item() - float(want_loss)) / max(abs(float(want_loss)), 1e-30)
    assert loss_err <= tol, f"loss {out.loss.item()} != {float(want_loss)}"
    err_g, name = compare_grads(got, want)
    assert err_g <= tol, f"gradient of {name} differs by {err_g:.3g} (relative to its max)"
    return out


@pytest.mark.parametrize("max_pack_tokens", [0, 1024], ids=["walk", "packed"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in FLOAT32_ONLY])
def test_float64_equals_oracle(family, max_pack_tokens):
    """`walk`: every internal segment pushed and popped; `packed`: small subtrees run as tree-masked rows."""
    model = make_model(family, torch.float64)
    out = check(model, shared_batch(), TOL[torch.float64], max_pack_tokens=max_pack_tokens)
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in model.parameters())
    assert out.stats["compression_ratio"] > 1.5
    assert out.stats["forward_tokens"] == out.stats["tree_tokens"]  # keep mode: every tree token forwarded once


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float32_stock_model_equals_oracle(family):
    model = make_model(family, torch.float32)
    check(model, shared_batch(1))


@pytest.mark.parametrize(
    "engine_kw",
    [
        dict(max_batch_tokens=1),  # no sibling batching
        dict(max_graph_tokens=0, block_size=3),  # everything recomputed in blocks smaller than the segments
        dict(max_graph_tokens=12, block_size=4),  # mixed keep / recompute
        dict(lm_head_chunk_size=3),  # LM head in many tiles
    ],
    ids=["no-batching", "recompute-all", "mixed", "head-chunks"],
)
def test_engine_modes_float64(engine_kw):
    model = make_model("qwen2", torch.float64)
    out = check(model, shared_batch(2), TOL[torch.float64], **engine_kw)
    if engine_kw.get("max_graph_tokens") == 0:
        assert out.stats["recomputed_tokens"] > 0
        assert out.stats["peak_graph_tokens"] <= engine_kw["block_size"]


@pytest.mark.parametrize("entropy", [True, False])
def test_temperature(entropy):
    model = make_model("llama", torch.float64)
    check(model, shared_batch(3), TOL[torch.float64], temperature=0.7, entropy=entropy)


def test_logprobs_matches_oracle_and_makes_no_grad():
    model = make_model("qwen3", torch.float64)
    seqs = shared_batch(4)
    _, want_lp, want_ent = dense_forward_backward(model, seqs, lambda i, lp, ent: lp.sum())
    model.zero_grad(set_to_none=True)
    out = DTAEngine(model).logprobs(seqs, entropy=True)
    assert out.loss is None
    assert compare_lists(out.logps, want_lp)[0] <= 1e-10
    assert compare_lists(out.entropies, want_ent)[0] <= 1e-10
    assert all(p.grad is None for p in model.parameters())
    assert DTAEngine(model).logprobs(seqs).entropies is None


def test_lora_only_adapter_grads():
    peft = pytest.importorskip("peft")
    base = make_model("qwen2", torch.float64)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                           "gate_proj"]))
    with torch.no_grad():  # LoRA B starts at zero: move it so the adapter changes the outputs
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    out = check(model, shared_batch(5), TOL[torch.float64])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {n for n, p in model.named_parameters() if p.grad is not None} == trainable
    assert out.stats["compression_ratio"] > 1.5


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_bf16_weights_as_precise_as_dense_bf16(backend):
    """A model in bf16: DTA's errors against the float64 twin within the derived multiple of the dense bf16 path's
    (`check`; autocast over float32 weights, TRL's default, is `tests/test_precision.py`)."""
    check(make_model("qwen2", torch.bfloat16, exact_norms=False), shared_batch(6), attn_backend=backend)


# ---------------------------------------------------------------------------------------------- attention backends


def _backend(name):
    return pytest.param(name, marks=pytest.mark.skipif(name not in available_backends("cpu"),
                                                       reason=f"{name} does not run here"))


BACKENDS = [_backend(name) for name in ("sdpa", "torch", "triton")]

# name -> (family, dtype, batch, engine kwargs): packed subtree rows and walked segments, GQA, sliding windows
# (Mistral; Gemma 3 mixes windowed and full layers), soft-capping (Gemma 2, float32 only), padded sibling rows,
# one and many siblings under one prompt.
BACKEND_CASES = {
    "gqa-packed": ("qwen2", torch.float64, lambda: shared_batch(11), dict(max_pack_tokens=1024)),
    "gqa-walk": ("qwen2", torch.float64, lambda: shared_batch(12), dict(max_pack_tokens=0, max_batch_tokens=24)),
    "window-packed": ("mistral", torch.float64, lambda: shared_batch(13), dict(max_pack_tokens=1024)),
    "window-mixed-walk": ("gemma3", torch.float64, lambda: shared_batch(14), dict(max_pack_tokens=0)),
    "softcap-window": ("gemma2", torch.float32, lambda: shared_batch(15), dict(max_pack_tokens=1024)),
    "one-sibling": ("qwen2", torch.float64, lambda: _grpo_like(1, prompt=20, completion=7), {}),
    "many-siblings": ("qwen2", torch.float64, lambda: _grpo_like(12, prompt=20, completion=7, ragged=True), {}),
    "float32": ("qwen3", torch.float32, lambda: shared_batch(16), {}),
}


# The Triton interpreter is slow: at engine level it runs the cases that reach every kernel path (packed rows, window,
# padded siblings); tests/attention_kernels covers each feature at op level.
TRITON_CASES = ("gqa-packed", "window-packed", "many-siblings")
BACKEND_PARAMS = [pytest.param(backend.values[0], case, marks=backend.marks, id=f"{backend.values[0]}-{case}")
                  for backend in BACKENDS for case in BACKEND_CASES
                  if backend.values[0] != "triton" or case in TRITON_CASES]


@pytest.mark.parametrize(("backend", "case"), BACKEND_PARAMS)
def test_backend_equals_oracle(backend, case):
    family, dtype, batch, engine_kw = BACKEND_CASES[case]
    model = make_model(family, dtype)
    out = check(model, batch(), attn_backend=backend, **engine_kw)
    assert out.stats["forward_tokens"] == out.stats["tree_tokens"]


RANDOM_TREE_PARAMS = [pytest.param(b.values[0], seed, marks=b.marks, id=f"{b.values[0]}-{seed}")
                      for b in BACKENDS for seed in range(3) if b.values[0] != "triton" or seed == 0]


@pytest.mark.parametrize(("backend", "seed"), RANDOM_TREE_PARAMS)
def test_backend_random_trees_float64(backend, seed):
    """Random trees (shared stems cut at random depths, random tails) under random budgets, one-layer model."""
    g = torch.Generator().manual_seed(100 + seed)
    stems = [torch.randint(3, VOCAB, (int(n),), generator=g) for n in torch.randint(0, 15, (3,), generator=g)]
    seqs = []
    for _ in range(int(torch.randint(2, 9, (1,), generator=g))):
        stem = stems[int(torch.randint(0, 3, (1,), generator=g))]
        cut = int(torch.randint(0, len(stem) + 1, (1,), generator=g))
        seqs.append(torch.cat([stem[:cut], torch.randint(3, VOCAB, (int(torch.randint(0, 7, (1,), generator=g)),),
                                                         generator=g)]))
    knobs = [dict(max_pack_tokens=1024), dict(max_pack_tokens=12, max_batch_tokens=7),
             dict(max_pack_tokens=0, max_graph_tokens=5, block_size=3)][seed]
    check(_HYPO_MODEL(), seqs, TOL[torch.float64], attn_backend=backend, **knobs)


def test_backend_choice_is_checked_at_construction():
    model = make_model("qwen2", torch.float32)
    assert DTAEngine(model).attn_backend == "auto"
    with pytest.raises(ValueError, match=r"`attn_backend` must be one of \['auto', 'flash', 'sdpa'"):
        DTAEngine(model, attn_backend="fast")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"`attn_backend`: .*'flash' cannot run on cpu"):
            DTAEngine(model, attn_backend="flash")


# ---------------------------------------------------------------------------------------------- hypothesis batches


@st.composite
def batches(draw):
    """Sequences grown from a few random stems: shared prefixes of random depth, duplicates, prefixes of one another,
    empty and single-token sequences, and sequences that share nothing."""
    tok = st.integers(3, VOCAB - 1)
    stems = draw(st.lists(st.lists(tok, min_size=0, max_size=14), min_size=1, max_size=3))
    seqs = []
    for _ in range(draw(st.integers(1, 7))):
        stem = draw(st.sampled_from(stems))
        cut = draw(st.integers(0, len(stem)))
        tail = draw(st.lists(tok, max_size=6))
        seqs.append(stem[:cut] + tail)
    if draw(st.booleans()):
        seqs.append(list(draw(st.sampled_from(seqs))))  # duplicate
    return seqs


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=batches(), block_size=st.integers(1, 6), budget=st.sampled_from([None, 0, 5, 20]),
       batch_tokens=st.sampled_from([1, 7, 64]), pack=st.sampled_from([None, 0, 12, 1024]), data=st.data())
def test_hypothesis_batches_float64(seqs, block_size, budget, batch_tokens, pack, data):
    model = _HYPO_MODEL()
    n_scored = None
    if data.draw(st.booleans(), label="score only completions"):
        n_scored = [data.draw(st.integers(0, len(s) + 1), label=f"n_scored[{i}]") for i, s in enumerate(seqs)]
    check(model, [torch.tensor(s, dtype=torch.long) for s in seqs], TOL[torch.float64], block_size=block_size,
          max_graph_tokens=budget, max_batch_tokens=batch_tokens, max_pack_tokens=pack, n_scored=n_scored)


def test_n_scored_projects_only_needed_positions():
    """GRPO layout: only completion log-probs are needed; the prompt's positions are never projected."""
    model = make_model("qwen2", torch.float64)
    seqs = _grpo_like(4, prompt=20, completion=5)
    out = check(model, seqs, TOL[torch.float64], n_scored=[5] * 4)
    assert [len(x) for x in out.logps] == [5] * 4
    assert out.stats["scored_positions"] == 4 * 5  # 4 forks out of the prompt + 4 in-completion targets each
    full = DTAEngine(model).logprobs(seqs)
    assert full.stats["scored_positions"] == 19 + 4 + 4 * 4
    with pytest.raises(ValueError, match="n_scored"):
        DTAEngine(model).logprobs(seqs, n_scored=[1, 2])


_MODEL_CACHE = {}


def _HYPO_MODEL():
    if "m" not in _MODEL_CACHE:
        _MODEL_CACHE["m"] = make_model("qwen2", torch.float64, num_hidden_layers=1)
    return _MODEL_CACHE["m"]


# ---------------------------------------------------------------------------------------------- memory


def _grpo_like(n_leaves, prompt=24, completion=6, seed=0, ragged=False):
    """One prompt and `n_leaves` completions (of `completion` tokens, or 1 .. `completion` with `ragged`)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(3, VOCAB, (prompt,), generator=g)
    sizes = [1 + i % completion if ragged else completion for i in range(n_leaves)]
    return [torch.cat([p, torch.randint(3, VOCAB, (n,), generator=g)]) for n in sizes]


def test_peak_graph_flat_in_number_of_leaves():
    model = make_model("qwen2", torch.float32)
    engine = DTAEngine(model, max_batch_tokens=12)  # two leaves per forward (and no subtree packed)
    peaks = []
    for n in (2, 8, 32):
        out = engine.forward_backward(_grpo_like(n), lambda i, lp, ent: lp.sum())
        peaks.append(out.stats["peak_graph_tokens"])
        assert out.stats["forward_tokens"] == out.stats["tree_tokens"]
    assert peaks[0] == peaks[1] == peaks[2] == 24 + 12, peaks


def test_peak_graph_bounded_by_block_size_with_recompute():
    model = make_model("qwen2", torch.float32)
    engine = DTAEngine(model, max_graph_tokens=0, block_size=5)
    for n in (2, 16):
        out = engine.forward_backward(_grpo_like(n, prompt=40, completion=9), lambda i, lp, ent: lp.sum())
        assert 0 < out.stats["peak_graph_tokens"] <= 5
        assert out.stats["recomputed_tokens"] > 0


# ---------------------------------------------------------------------------------------------- model handling


def test_gradient_checkpointing_is_suspended_and_restored():
    model = make_model("llama", torch.float64)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    check(model, shared_batch(7), TOL[torch.float64])
    assert model.is_gradient_checkpointing
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_gradient_checkpointing_warning_only_without_a_budget(monkeypatch):
    """The engine says once that HF checkpointing is suspended and advises `max_graph_tokens`, unless a budget is set
    (a DTA trainer sets it and says so in its own warning: one warning per fact)."""
    from trl_dta import _checks

    model = make_model("llama", torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    monkeypatch.setattr(_checks, "_warned", set())
    DTAEngine(model, max_graph_tokens=4).logprobs(shared_batch())
    assert "engine:gradient_checkpointing" not in _checks._warned
    DTAEngine(model).logprobs(shared_batch())
    assert "engine:gradient_checkpointing" in _checks._warned


def test_attention_implementation_restored_and_model_usable():
    model = make_model("qwen2", torch.float32)
    before = model.config._attn_implementation
    DTAEngine(model).logprobs(shared_batch())
    assert model.config._attn_implementation == before
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 6)


def test_accepts_prefix_tree_and_padded_batches():
    model = make_model("qwen2", torch.float64)
    seqs = _grpo_like(3)
    ids = torch.zeros(3, 32, dtype=torch.long)
    mask = torch.zeros(3, 32, dtype=torch.long)
    for r, s in enumerate(seqs):  # left-padded
        ids[r, 32 - len(s):] = s
        mask[r, 32 - len(s):] = 1
    a = DTAEngine(model).logprobs(PrefixTree.from_padded(ids, mask))
    b = DTAEngine(model).logprobs(seqs)
    assert all(torch.equal(x, y) for x, y in zip(a.logps, b.logps))


# ---------------------------------------------------------------------------------------------- errors


def test_errors_on_bad_input():
    model = make_model("qwen2", torch.float32)
    engine = DTAEngine(model)
    with pytest.raises(ValueError, match="empty"):
        engine.logprobs([])
    with pytest.raises(ValueError, match="vocab_size"):
        engine.logprobs([torch.tensor([1, VOCAB + 3])])
    with pytest.raises(ValueError, match="temperature"):
        engine.logprobs([[3, 4]], temperature=0.0)
    with pytest.raises(TypeError, match="scalar"):
        engine.forward_backward([[3, 4, 5]], lambda i, lp, ent: lp)
    with pytest.raises(TypeError, match="callable"):
        engine.forward_backward([[3, 4, 5]], None)
    for kw in (dict(block_size=0), dict(max_batch_tokens=-1), dict(max_graph_tokens=-2), dict(lm_head_chunk_size=0),
               dict(max_pack_tokens=-1)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            DTAEngine(model, **kw)


def test_error_on_dropout_in_training():
    model = make_model("qwen2", torch.float32, attention_dropout=0.1)
    model.train()
    with pytest.raises(ValueError, match="attention_dropout"):
        DTAEngine(model).forward_backward([[3, 4, 5]], lambda i, lp, ent: lp.sum())
    model.eval()
    DTAEngine(model).forward_backward([[3, 4, 5]], lambda i, lp, ent: lp.sum())


def test_error_on_dynamic_rope():
    model = make_model("llama", torch.float32, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                 "rope_theta": 10000.0})
    with pytest.raises(NotImplementedError, match="dynamic"):
        DTAEngine(model)
