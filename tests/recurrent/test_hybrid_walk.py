"""Hybrid models through DTAEngine against the per-sequence dense oracle: every recurrent family, on a tree with deep
branching, siblings, one-token segments, segments shorter than the conv kernel, long segments across the recurrences'
chunks and a sequence that is only the system prompt (`hybrid_models.hybrid_batch`).

- float64, the model's float32 casts removed on both sides (`hybrid_models.float64_internals`): log-probs,
  entropies, loss and every parameter gradient within 1e-10, in every walk mode (keep, recompute in blocks shorter
  than the segments, no sibling batching).
- The stock arithmetic (transformers' recurrences in float32), float32 weights and TRL's bf16 autocast over them:
  DTA's error against that float64 oracle bounded by the dense path's own error in the same precision (`_bars`).
"""

from __future__ import annotations

import functools

import pytest
import torch

from hybrid_models import HYBRID_FAMILIES, PRIMARY, float64_internals, hybrid_batch, make_hybrid
from reference import compare_grads, compare_lists, dense_forward_backward, grads_of
from test_engine import nonlinear_loss
from trl_dta import DTAEngine, PrefixTree
from trl_dta.refusal import DTAUnsupportedError

TOL = 1e-10
SEQS = hybrid_batch()
# The largest number of sequences through one tree token (the system prompt's: 13).
_TREE = PrefixTree.from_sequences(SEQS)
N_SHARE = max(sum(s in _TREE.path(i) for i in range(_TREE.n_sequences)) for s in range(_TREE.n_segments))
# Stock precision (against the float64 oracle, DTA and the dense path in the same precision):
# - forward outputs (log-probs, entropies; worst element): DTA computes every token with the dense arithmetic, except
#   that a segment's recurrence restarts its chunks at the segment's start (from the state handed on) where the dense
#   scan chunks the whole sequence, and that sibling rows run batched: other roundings of the same size, at most
#   SLACK x the dense error (measured 1.0x to 1.2x above FLOOR), and never held below FLOOR, four float32 ulps of the
#   largest output: the LM head's last steps (log-sum-exp, subtraction, the entropy's sum over the vocabulary) round
#   at a few ulps on any path (the dense float32 entropies' own error is 1.6 ulps).
# - gradients, all parameters together (relative L2, the trainer tests' `update_gap` statistic): at most SLACK x
#   (measured 1.07x to 1.35x in float32, 0.99x to 1.03x under bf16 autocast).
# - gradients, each parameter on its own (relative L2): DTA back-propagates a prefix shared by n sequences once, with
#   their summed gradient, where the dense path rounds n backward passes of parts 1/n the size: where those parts
#   cancel (the decay parameters `A_log`, `dt_bias`, whose gradients are sums of large terms of both signs), one
#   rounding of the sum can be as large as n roundings of the parts, so the bar is n x the dense error (both floored
#   at FLOOR; measured up to 2.9x).
# A state lost or handed to the wrong row, or a precision defect, costs orders of magnitude.
SLACK = 2.0
FLOOR = 4 * torch.finfo(torch.float32).eps
MODES = {
    "keep": {},
    "recompute": dict(max_graph_tokens=0, block_size=5),  # every segment in blocks shorter than it
    "one-row": dict(max_batch_tokens=1),  # no sibling batching: every leaf its own forward
}


def _family_params(primary_modes=tuple(MODES), other_modes=("keep",)):
    """family x mode: the primary families (one per recurrence) in every mode, the others in `other_modes`; all but
    the primary families' first mode marked slow."""
    out = []
    for family in HYBRID_FAMILIES:
        modes = primary_modes if family in PRIMARY else other_modes
        for mode in modes:
            fast = family in PRIMARY and mode == modes[0]
            out.append(pytest.param(family, mode, id=f"{family}-{mode}", marks=[] if fast else [pytest.mark.slow]))
    return out


def _run_dta(model, **engine_kw):
    model.zero_grad(set_to_none=True)
    engine = DTAEngine(model, **engine_kw)
    out = engine.forward_backward(SEQS, nonlinear_loss, entropy=True)
    return out, grads_of(model)


@functools.cache
def _oracle(family):
    """The float64 oracle with float64 internals: loss, log-probs, entropies, gradients."""
    model = make_hybrid(family)
    with float64_internals(model):
        loss, lps, ents = dense_forward_backward(model, SEQS, nonlinear_loss)
    return float(loss), lps, ents, grads_of(model)


@pytest.mark.parametrize("family,mode", _family_params())
def test_float64_equals_oracle(family, mode):
    model = make_hybrid(family)
    want_loss, want_lp, want_ent, want = _oracle(family)
    with float64_internals(model):
        out, got = _run_dta(model, **MODES[mode])
        scored = DTAEngine(model, **MODES[mode]).logprobs(SEQS, entropy=True)
    errors = {"log-probs": compare_lists(out.logps, want_lp), "entropies": compare_lists(out.entropies, want_ent),
              "no-grad log-probs": compare_lists(scored.logps, want_lp), "gradients": compare_grads(got, want)}
    for what, (err, where) in errors.items():
        assert err <= TOL, f"{family} ({mode}): {what} differ by {err:.3g} (at {where})"
    assert abs(out.loss.item() - want_loss) <= TOL * abs(want_loss)
    assert all(p.grad is not None and p.grad.abs().max() > 0 for n, p in model.named_parameters()
               if "router" not in n and "experts" not in n), "a parameter got no gradient"
    assert out.stats["compression_ratio"] > 1.5 and out.stats["tree_tokens"] < out.stats["tokens"]
    if mode == "recompute":
        assert out.stats["recomputed_tokens"] > 0


def _rel_l2(got: dict, want: dict, names) -> float:
    num = sum((got[n].double() - want[n]).pow(2).sum() for n in names)
    return float((num / sum(want[n].pow(2).sum() for n in names)).sqrt())


def _errors(lps, ents, grads, oracle):
    """Worst-element errors of log-probs and entropies, relative L2 error of all gradients, and of each parameter's."""
    _, lp64, ent64, g64 = oracle
    assert grads.keys() == g64.keys()
    per_param = {n: _rel_l2(grads, g64, [n]) for n in g64 if g64[n].abs().max() > 0}
    return compare_lists(lps, lp64)[0], compare_lists(ents, ent64)[0], _rel_l2(grads, g64, g64), per_param


def _dense_and_dta(model, oracle, autocast):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", **autocast):
        _, lp, ent = dense_forward_backward(model, SEQS, nonlinear_loss)
    dense = _errors(lp, ent, grads_of(model), oracle)
    with torch.autocast("cpu", **autocast):
        out, grads = _run_dta(model)
    return dense, _errors(out.logps, out.entropies, grads, oracle)


def _bars(dense, dta, what):
    """DTA's errors within the bars above (see `SLACK`, `N_SHARE`)."""
    for name, d, t in zip(("log-probs", "entropies", "gradients (all parameters)"), dense[:3], dta[:3]):
        assert d > 0, f"{what}, {name}: the dense path has no error, so the bar measures nothing"
        floor = FLOOR if name != "gradients (all parameters)" else 0.0
        assert t <= SLACK * max(d, floor), f"{what}, {name}: DTA's error {t:.3g} > {SLACK} x the dense path's {d:.3g}"
    for name, d in dense[3].items():
        t = dta[3][name]
        assert t <= N_SHARE * max(d, FLOOR), \
            f"{what}, gradient of {name}: DTA's error {t:.3g} > {N_SHARE} x dense {d:.3g}"


@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f in PRIMARY else [pytest.mark.slow])
                                    for f in HYBRID_FAMILIES])
def test_float32_stock_within_the_dense_error(family):
    """transformers' own arithmetic (recurrences in float32) on float32 weights."""
    dense, dta = _dense_and_dta(make_hybrid(family, torch.float32), _oracle(family), {"enabled": False})
    _bars(dense, dta, f"{family} float32")


@pytest.mark.parametrize("family", PRIMARY)
def test_bf16_autocast_within_the_dense_error(family):
    """TRL's default precision: float32 weights under bf16 autocast, DTA and the dense path alike."""
    dense, dta = _dense_and_dta(make_hybrid(family, torch.float32), _oracle(family), {"dtype": torch.bfloat16})
    _bars(dense, dta, f"{family} bf16 autocast")


def test_one_token_segments_are_unshared_and_nothing_is_packed():
    """The schedule of a hybrid: no packed subtree row (each forward of rows continues one path), the two one-token
    internal segments computed once per child, every other tree token once."""
    model = make_hybrid("nemotron_h")
    with float64_internals(model):
        out, _ = _run_dta(model, max_pack_tokens=1024)
    # `one` (3 children and a sequence's end: 4 copies) and `deep` (3 children: 3 copies): 5 extra tokens.
    assert out.stats["forward_tokens"] == out.stats["tree_tokens"] + 5


def test_lockstep_is_refused():
    model = make_hybrid("qwen3_5_text")
    engine = DTAEngine(model)
    engine.lockstep = lambda n: n
    with pytest.raises(DTAUnsupportedError, match=r"recurrent layers \[0, 2\].*dta_fsdp_schedule='window'"):
        engine.logprobs(SEQS[:3])
