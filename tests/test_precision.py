"""Mixed precision (`trl_dta.precision`): DTA under bf16 autocast against the dense path under the same autocast, both
judged by the float64 oracle; the attention's input conversion against SDPA's own autocast policy; the precision of
a model prepared by accelerate (its autocast wrapper), as the engine and the model-support probe see it."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from bounds import assert_as_precise_as_dense, max_sharing, relative_l2
from conftest import FAMILIES, float64_twin, make_model, shared_batch
from reference import dense_forward_backward, dense_logps, grads_of
from test_models import REFUSED, build
from trl_dta import DTAEngine
from trl_dta.kernels import available_backends, part_kernels, two_part_attention
from trl_dta.modeling.support import check_model_support
from trl_dta.precision import Precision, attention_inputs

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)
OFF = dict(device_type="cpu", enabled=False)

# DTA's errors against the float64 oracle may be these multiples of the dense path's (both in the same precision,
# relative L2 over all values; derivations in `tests/bounds.py`): `forward_slack(n)` for log-probs and entropies, and
# `gradient_slack(m)` for the gradients, m = the most sequences sharing a token (8 in `SEQS`: sqrt(8) = 2.83). The
# dense path back-propagates each sequence on its own, so the bf16 rounding of its m backward passes through a shared
# prefix is independent and partly cancels; DTA back-propagates the prefix once with their summed gradient, and that
# one bf16 backward rounds relative to the sum. Measured (bf16 autocast, this machine's kinds, 1 and 2 threads, AVX512,
# AVX2, no vector ISA): log-probs 0.92x to 1.14x, gradients 0.93x to 1.34x. A precision defect (a bf16 softmax, a
# missed cast) costs 10x.


def loss_fn(i, lp, ent):
    """Non-linear over each sequence, with an entropy term (prefix outputs get gradients from every descendant)."""
    if lp.numel() == 0:
        return lp.sum()
    return torch.exp(lp.mean()) * (1 + 0.1 * i) - 0.01 * (lp**2).sum() + 0.05 * torch.tanh(ent).sum()


def _slow_unless_qwen2(family):
    return [] if family == "qwen2" else [pytest.mark.slow]


def _families():
    return [pytest.param(family, marks=_slow_unless_qwen2(family)) for family in sorted(FAMILIES)]


def _backends(*before):
    """"sdpa", "torch" and "triton" (slow under the interpreter), each where it runs, after the values `before`."""
    return [pytest.param(*before, b, id="-".join([*before, b]),
                         marks=[pytest.mark.skipif(b not in available_backends("cpu"), reason=f"no {b} here")]
                         + ([pytest.mark.slow] if b == "triton" else []))
            for b in ("sdpa", "torch", "triton")]


SEQS = shared_batch(3)


@functools.cache
def _oracle(family):
    """The float64 oracle on `SEQS`: per-sequence log-probs, entropies, and the parameter gradients of `loss_fn` (the
    float32 model's weights, exactly, with RMSNorm in float64: `conftest.float64_twin`)."""
    seqs = SEQS
    exact = make_model(family, torch.float64, exact_norms=True)
    _, lp64, ent64 = dense_forward_backward(exact, seqs, loss_fn)
    return lp64, ent64, grads_of(exact)


def _assert_as_precise(model, seqs, exact, autocast: dict, backend: str, what: str, **engine_kw):
    """DTA's log-probs, entropies and gradients with `model` under `autocast`, each within the derived multiple of
    the dense path's error (`bounds.py`), both against `exact` (float64 log-probs, entropies, gradients)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(**autocast):
        _, lp, ent = dense_forward_backward(model, seqs, loss_fn)
    dense = (lp, ent, grads_of(model))
    model.zero_grad(set_to_none=True)
    engine = DTAEngine(model, attn_backend=backend, **engine_kw)
    with torch.autocast(**autocast):
        out = engine.forward_backward(seqs, loss_fn, entropy=True)
        scored = engine.logprobs(seqs, entropy=True)
    if engine_kw.get("max_graph_tokens") == 0:
        assert out.stats["recomputed_tokens"] > 0
    if not engine_kw:  # the same forwards in both calls (recompute mode forwards in blocks instead)
        assert all(torch.equal(a, b) for a, b in zip(scored.logps, out.logps)), "logprobs and forward_backward disagree"
    for name, got, want, ref, sharing in zip(("log-probs", "entropies", "gradients"),
                                             (out.logps, out.entropies, grads_of(model)), dense, exact,
                                             (None, None, max_sharing(seqs))):
        assert_as_precise_as_dense(got, want, ref, f"{what}, {name}", sharing=sharing)


# Every family on the default backend ("torch" on CPU; gemma2's soft-capped attention on its `math` fallback), and
# the concatenating "sdpa" backend on a plain family and a soft-capped one. "triton" under the interpreter runs bf16
# parts on `math` (`test_triton_parts_fall_back_to_math_in_bf16_under_the_interpreter`).
# Families beyond qwen2 are marked slow.
AUTOCAST_CASES = [pytest.param(family, "auto", id=f"{family}-auto", marks=_slow_unless_qwen2(family))
                  for family in sorted(FAMILIES)] + [
    pytest.param(family, "sdpa", id=f"{family}-sdpa", marks=_slow_unless_qwen2(family))
    for family in ("qwen2", "gemma2")]


@pytest.mark.parametrize("family,backend", AUTOCAST_CASES)
def test_bf16_autocast_over_float32_weights(family, backend):
    """TRL's default precision: float32 weights, bf16 autocast over the forward (DTA and the dense path alike)."""
    _assert_as_precise(make_model(family, torch.float32, exact_norms=False), SEQS, _oracle(family), BF16, backend,
                       f"{family} bf16 autocast ({backend})")


@pytest.mark.parametrize("autocast", [BF16, OFF], ids=["autocast", "no_autocast"])
def test_bf16_weights(autocast):
    """A model loaded in bf16 (`dtype=torch.bfloat16`), with and without autocast around it."""
    family = "qwen2"
    model = make_model(family, torch.bfloat16, exact_norms=False)
    exact = float64_twin(model)  # the bf16 weights, exactly
    _, lp64, ent64 = dense_forward_backward(exact, SEQS, loss_fn)
    _assert_as_precise(model, SEQS, (lp64, ent64, grads_of(exact)), autocast, "auto", f"{family} bf16 weights")


def test_block_recompute_under_autocast():
    """Recompute mode (every segment forwarded without grad, then recomputed block by block when popped): the
    recomputed forwards run under the call's autocast again, so the gradients injected into them belong to the same
    bf16 computation."""
    family = "qwen2"
    _assert_as_precise(make_model(family, torch.float32, exact_norms=False), SEQS, _oracle(family), BF16, "auto",
                       "block recompute under bf16 autocast", max_graph_tokens=0, block_size=4, max_pack_tokens=0)


# ---------------------------------------------------------------------------------------------- the attention's inputs


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("path_len", [0, 5])
def test_attention_inputs_follow_sdpa_autocast(backend, path_len):
    """Under autocast, q and k after RoPE are float32 and v bfloat16: SDPA casts all three to the autocast dtype, and
    so does DTA (for the path's keys/values too). Without a path, the "sdpa" backend's result is SDPA's, bit for bit."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, path_k = torch.randn(2, 2, 6, 8, generator=g), torch.randn(1, 2, path_len, 8, generator=g)
    v, path_v = torch.randn(2, 2, 6, 8, generator=g).bfloat16(), torch.randn(1, 2, path_len, 8, generator=g)
    with torch.autocast(**BF16):
        got = attention_inputs(q, k, v, path_k, path_v, None)
        assert [t.dtype for t in got[:5]] == [torch.bfloat16] * 5 and got[5] is None
        assert attention_inputs(q.double())[0].dtype == torch.float64  # autocast leaves float64 alone
        keys, values = torch.cat([path_k.expand(2, -1, -1, -1), k], 2), torch.cat([path_v.expand(2, -1, -1, -1), v], 2)
        visible = torch.ones(6, path_len + 6).tril(path_len).bool()  # query i sees keys 0 .. path_len + i
        mask = dict(is_causal=True) if path_len == 0 else dict(attn_mask=visible)
        want = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True, **mask)  # SDPA's own autocast
    assert want.dtype == torch.bfloat16
    assert [t.dtype for t in attention_inputs(q, k, v)] == [torch.float32, torch.float32, torch.bfloat16]
    q16, k16, v16, pk16, pv16 = got[:5]
    with torch.autocast(**OFF):
        out = two_part_attention(q16, pk16 if path_len else None, pv16 if path_len else None, k16, v16,
                                 backend=backend)
    err = (out.double() - want.double()).abs().max().item() / want.double().abs().max().item()
    assert out.dtype == torch.bfloat16 and err <= 2**-7, err  # one bf16 rounding of the output, two merged parts
    if backend == "sdpa" and path_len == 0:
        assert torch.equal(out, want)


# ---------------------------------------------------------------------------------------------- accelerate's wrapper


def _prepared(model):
    """`model` prepared by accelerate with bf16 mixed precision on CPU: its forward wrapped in bf16 autocast."""
    # A trainer of an earlier test leaves accelerate's state set up with its own precision, which a new Accelerator
    # may not change: start from a fresh state, as a new process would.
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = accelerator.prepare(model)
    return accelerator, model


def test_precision_sources():
    model = make_model("qwen2", torch.float32)
    cpu = torch.device("cpu")
    assert Precision.of(model, device=cpu) == Precision("cpu")
    with torch.autocast(**BF16):
        assert Precision.of(model, device=cpu) == Precision("cpu", torch.bfloat16, "context")
    _, prepared = _prepared(model)
    assert Precision.of(prepared, device=cpu) == Precision("cpu", torch.bfloat16, "model")
    with torch.autocast(**OFF):  # the wrapper wins over the caller's context, as it does inside `model(...)`
        assert Precision.of(prepared, device=cpu).autocast_dtype == torch.bfloat16
    assert Precision("cpu", torch.bfloat16, "model").describe(torch.float32) == (
        "bfloat16 autocast over float32 weights (from the model's accelerate wrapper)")
    assert Precision("cpu", torch.bfloat16, "model").describe(torch.float64) == "float64"


@pytest.mark.parametrize("family", _families())
def test_model_prepared_by_accelerate(family):
    """A model the user prepared with accelerate's bf16 mixed precision: accepted by the probe (which runs both sides
    under the wrapper's autocast), and the engine's log-probs, called outside any autocast, are those of the wrapped
    dense forward: as close to the float64 oracle as the dense bf16 forward is."""
    seqs = SEQS
    lp64, _, _ = _oracle(family)
    _, model = _prepared(make_model(family, torch.float32, exact_norms=False))
    with torch.no_grad():
        dense = [dense_logps(model, s)[0] for s in seqs]  # `model(...)`: under the wrapper's bf16 autocast
    assert all(lp.dtype == torch.float32 for lp in dense)
    out = DTAEngine(model).logprobs(seqs)
    float32 = relative_l2([dense_logps(make_model(family, torch.float32, exact_norms=False), s)[0].detach()
                           for s in seqs], lp64)
    # bf16's unit roundoff is 2**16 times float32's: a forward that ran in bf16 is orders of magnitude farther off.
    assert relative_l2(dense, lp64) > 10 * float32, "the wrapped forward did not run in bf16"
    assert_as_precise_as_dense(out.logps, dense, lp64, "log-probs of the prepared model")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_probe_accepts_every_family_under_bf16_autocast(family):
    model = make_model(family, torch.float32, exact_norms=False)
    check_model_support(model, Precision("cpu", torch.bfloat16, "model"))


def test_probe_refusal_names_the_precision_and_the_gap():
    """A model DTA cannot reproduce (bidirectional attention) is still refused under bf16 autocast, and the message
    says in which precision the gap was measured, how large it was and what rounding would explain."""
    model = build(REFUSED["bert-bidirectional"][0]())
    with pytest.raises(NotImplementedError) as info:
        check_model_support(model, Precision("cpu", torch.bfloat16, "model"))
    message = str(info.value)
    assert "both computed in bfloat16 autocast over float32 weights (from the model's accelerate wrapper)" in message
    assert "relative difference" in message and "more than the 0.05 that rounding in that precision explains" in message


def test_triton_parts_fall_back_to_math_in_bf16_under_the_interpreter():
    """The interpreter computes with numpy (no bf16): under TRL's default bf16 autocast on CPU, `attn_backend="triton"`
    runs its parts on `math` instead of failing; float32 parts stay on Triton."""
    if "triton" not in available_backends("cpu"):
        pytest.skip("triton does not run here")
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8)
    path = torch.randn(1, 2, 4, 8)
    assert part_kernels(q, path, k, backend="triton") == ("triton", "triton")
    assert part_kernels(q.bfloat16(), path.bfloat16(), k.bfloat16(), backend="triton") == ("math", "math")


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_gpt_oss_bf16_autocast_over_float32_weights(backend):
    """GPT-OSS (sinks, sliding and full layers, MoE) under TRL's default precision: DTA as precise as the dense bf16
    path (its eager attention, which keeps the sink logits in float32 as DTA does), both against the float64 twin
    (the same weights, the experts' eager loop, RMSNorm in float64).

    Every token is routed to every expert (top-4 of 4): top-k routing is discontinuous, and a bf16 rounding that moves
    a near-tie token to another expert changes its output by O(1), so with top-2 of 4 the two errors measure which
    tokens flipped, not rounding (DTA over dense, relative L2, 4 seeds: 0.1x to 5x on the "auto" backend; 0.75x to
    1.5x with every expert routed; the "sdpa" backend repeats the dense eager arithmetic, 1.0x to 1.3x either way)."""
    from conftest import VOCAB
    from moe_models import MOE_FAMILIES
    from test_models import build

    config = MOE_FAMILIES["gpt_oss"](VOCAB)
    config.num_experts_per_tok = config.num_local_experts
    model = build(config, torch.float32)
    exact = float64_twin(model)
    _, lp64, ent64 = dense_forward_backward(exact, SEQS, loss_fn)
    _assert_as_precise(model, SEQS, (lp64, ent64, grads_of(exact)), BF16, backend, f"gpt_oss bf16 autocast ({backend})")
