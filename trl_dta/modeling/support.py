"""Which model families DTA runs: decided once, when the engine is built, before any forward of the user's.

DTA feeds each forward only the new tokens and gives every attention layer the keys/values of the path before them
through the forward's keyword arguments (`dta_ctx=...`, see `attention.py`). A decoder-only causal LM runs through DTA
exactly when

1. every layer mixes tokens only in a call of transformers' `AttentionInterface` (no recurrent, convolution or linear
   attention state, no attention code of its own), or, in the hybrid families (`families.py`, `Family.recurrent`), in
   recurrent layers that take their states from the forward's cache (`recurrent/carrier.py`),
2. its decoder layers hand the forward's keyword arguments on to that call,
3. that attention is causal softmax attention over post-RoPE keys/values, optionally windowed, soft-capped or with
   attention sinks (no ALiBi biases, no chunked or sparse attention, no bidirectional attention), and
4. its logits are post-processed in a way [`HeadSpec`] knows.

[`model_blockers`] finds every reason a model fails this in two steps, and [`check_model_support`] refuses it with one
message that names each, with its fix (`refusal.py`), the dense alternative and the tested families:

- **Rules**, of what is known not to hold: families by their row of `families.FAMILIES` (ALiBi models),
  configurations by their layer types (state-space and linear-attention layers outside the hybrid families,
  chunked-attention layers) and logit scalings of unknown meaning; and training features a four-token probe cannot
  see: MoE routers with random noise or capacity limits, dynamic RoPE.
- **Probe**: the real model on four tokens, once densely and once through DTA as a one-token prefix plus a
  three-token continuation, compared on the log-probs and entropies of the three next tokens. A failure inside
  transformers, a layer that never reaches the DTA attention (1, 2) or a different result (3, 4) becomes a blocker.
  Both sides run in the precision the engine's calls will run in ([`Precision`]: accelerate's
  autocast wrapper of the model's forward, or the caller's autocast), and the gap is judged with the tolerance of
  that precision. A gap beyond it is judged against the model's own precision: transformers' recurrent layers compute
  in float32 inside a float64 model, so the dense path disagrees with itself at that level too. The model decodes the
  same tokens densely, one at a time over its own cache, and DTA passes within `OWN_GAP_MULTIPLE` (10) times that
  disagreement, at most the float32 tolerance (a wrong model, a position bias or bidirectional attention, misses by
  far more), or within the tolerance of the dtype its recurrent layers hand on their states in, when coarser than the
  model's (float32 states in a float64 model: transformers 5.25's cached decoding agrees with its own forward
  exactly, so only the states' dtype shows that precision). A refusal names the precision, the measured gap and the
  model's own. The probe costs three forwards of at most four tokens (three more of one token when the gap exceeds
  the dtype's tolerance) and leaves the model as it was (attention implementation, training mode, gradients). It is
  skipped when a rule about the attention or the logits already refuses the model (its finding would only restate
  that rule).

```
dense:   t0 t1 t2 t3                  -> log p(t1 | t0), log p(t2 | t0 t1), log p(t3 | t0 t1 t2)
DTA:     t0          (push its K/V)
            t1 t2 t3 (after the path) -> the same three log-probs
```
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import torch

from .. import _checks
from ..kv_stack import Frame, KVStack
from ..precision import Precision, is_half
from ..recurrent import LAYER_MIXERS, LayerLayout, StateCarrier
from ..refusal import DENSE_ALTERNATIVE, MODEL_CONFIG, Blocker, DTAUnsupportedError, refuse  # noqa: F401 (re-exported)
from . import attention, families
from .lm_head import HeadSpec, head_logprobs, unknown_logit_scaling
from .switch import attention_implementation

_MIXERS_RUN = frozenset({"attention"})  # the token mixers DTA runs in every family; hybrids' rows add "recurrent"


def _layer_types(config) -> Blocker | None:
    recurrent = families.family_of(config).recurrent  # hybrids whose recurrent layers walk the tree with their states
    runs = _MIXERS_RUN | ({"recurrent"} if recurrent else set())
    kinds = set(getattr(config, "layer_types", None) or ())
    other = sorted(kind for kind in kinds if kind not in LAYER_MIXERS or not LAYER_MIXERS[kind] <= runs)
    if other:
        attention_only = sorted(kind for kind, mixers in LAYER_MIXERS.items() if mixers == _MIXERS_RUN)
        return Blocker(
            f"it has {other} layers (a token mixer with a state of its own: state-space, linear or otherwise "
            f"non-softmax attention); DTA runs softmax attention layers ({attention_only}), whose "
            "whole state is the path's keys/values, position-wise MLP/MoE layers, and the recurrent layers of the "
            f"hybrid families {families.model_types('recurrent')}"
        )
    return None


def _chunked_attention(config) -> Blocker | None:
    if getattr(config, "attention_chunk_size", None):
        return Blocker(f"its attention is chunked (`attention_chunk_size={config.attention_chunk_size}`): a token sees "
                       "only the keys of its own chunk, a mask DTA's attention does not build")
    return None


def _logit_scaling(config) -> Blocker | None:
    field = unknown_logit_scaling(config)
    if field is not None:
        return Blocker(f"it scales its logits with `{field}={getattr(config, field)}`, and what that field means "
                       "differs between families (see `lm_head.py`)")
    return None


# Config fields of MoE routers that add random noise to the routing in training mode (Mixtral, PhiMoE, MiniMax,
# ...): like dropout, a dense run and DTA would draw different noise.
_ROUTER_NOISE_FIELDS = ("router_jitter_noise", "input_jitter_noise", "jitter_noise")


def _router_noise(config) -> Blocker | None:
    noisy = {name: getattr(config, name) for name in _ROUTER_NOISE_FIELDS if getattr(config, name, None)}
    if noisy:
        shown = ", ".join(f"`{name}={value}`" for name, value in noisy.items())
        return Blocker(f"its MoE router adds random jitter noise in training ({shown}), which DTA cannot reproduce "
                       "(shared tokens would be routed with other noise than in each dense row)",
                       settings={name: 0.0 for name in noisy}, where=MODEL_CONFIG)
    return None


def _expert_capacity(config) -> Blocker | None:
    if getattr(config, "expert_capacity", None):
        return Blocker(f"its MoE layers drop the tokens beyond an expert's capacity (`expert_capacity="
                       f"{config.expert_capacity}`), which depends on the other tokens of the forward")
    return None


def rope_kinds(config) -> list[dict]:
    """The RoPE parameter dicts of `config` (one per layer type for models with several)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]


def _dynamic_rope(config) -> Blocker | None:
    for p in rope_kinds(config):
        kind = (p or {}).get("rope_type", (p or {}).get("type"))
        if kind == "dynamic":
            return Blocker(f"rope_type '{kind}' rescales positions from the length of each forward call, so a prefix "
                           "and its continuation would use different frequencies; DTA cannot reproduce the dense "
                           "result", fix="use a model with static RoPE scaling")
    return None


# Checks of every family's config, each returning a blocker or None. The first table concerns the attention and the
# logits themselves: when one of them refuses a model, the probe (which compares the two) is not run, as its finding
# would restate it. The second holds features the four-token probe in eval mode does not see.
_MIXER_RULES: tuple[Callable[[object], Blocker | None], ...] = (_layer_types, _chunked_attention, _logit_scaling)
_TRAINING_RULES: tuple[Callable[[object], Blocker | None], ...] = (_router_noise, _expert_capacity, _dynamic_rope)


def _where(exc: Exception) -> str:
    """`"TypeError in forward, modeling_falcon.py:352: <message>"`: an exception and the line that raised it."""
    frame = exc.__traceback__
    while frame.tb_next is not None:
        frame = frame.tb_next
    code = frame.tb_frame.f_code
    return f"{type(exc).__name__} in {code.co_name}, {code.co_filename.rsplit('/', 1)[-1]}:{frame.tb_lineno}: {exc}"


class _ProbeFailure(Exception):
    """Raised inside the probe's attention function; carries the reason."""


def _probe_attention(module, query, key, value, attention_mask, dta_ctx=None, **kwargs):
    """The DTA attention, run under its own registered name so that the probe sees which layers reach it, and with
    what."""
    if dta_ctx is None:
        raise _ProbeFailure(
            f"its {type(module).__name__} layers call the attention without the keyword arguments of the model's "
            "forward (a decoder layer does not pass `**kwargs` on), so the engine's context never reaches them"
        )
    return attention.dta_attention(module, query, key, value, attention_mask, dta_ctx=dta_ctx, **kwargs)


_PROBE_IMPLEMENTATION = "dta_probe"
_REGISTERED = False


def _register_probe() -> str:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(_PROBE_IMPLEMENTATION, _probe_attention)
        _REGISTERED = True
    return _PROBE_IMPLEMENTATION


@contextlib.contextmanager
def _eval_mode(lm):
    """Eval mode (no dropout), restoring each module's training flag on exit."""
    modes = [(m, m.training) for m in lm.modules()]
    try:
        lm.eval()
        yield
    finally:
        for m, training in modes:
            m.training = training


def _tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """Relative tolerance of the probe's comparison for matmuls computed in `dtype` (the autocast dtype under
    autocast): far above the rounding of a four-token forward in that precision, far below the error of a model DTA
    computes wrongly. float32 matmuls on CUDA may run in TF32 (10-bit mantissa), as coarse as half precision."""
    if dtype == torch.float64:
        return 1e-8
    if dtype == torch.float32 and (device.type != "cuda" or torch.get_float32_matmul_precision() == "highest"):
        return 1e-4
    return 5e-2


# How many times the dense path's own disagreement (its forward of the four tokens against its own cached decoding of
# them, token by token) the probe accepts. A correct model's prefix + continuation through DTA rounds like its own
# cached decoding (float32 inside a float64 model's recurrent layers: about 1e-7 either way); 10x leaves room for
# rounding in another order. A wrong model (a position bias, bidirectional attention) misses by orders more.
OWN_GAP_MULTIPLE = 10.0


def _judged_tolerance(dtype: torch.dtype, device: torch.device, own_gap: float) -> float:
    """The probe's tolerance: [`OWN_GAP_MULTIPLE`] times the dense path's own gap, at least the tolerance of `dtype`
    (the floor) and at most that of float32 (a transformers layer computes parts of itself in float32 whatever the
    model's dtype, never coarser), so that a model whose dense path disagrees with itself by more (bidirectional
    attention: its cached decoding differs too) is still judged by float32 rounding."""
    floor = _tolerance(dtype, device)
    return max(floor, min(OWN_GAP_MULTIPLE * own_gap, _tolerance(torch.float32, device)))


def _carried_dtype(states) -> torch.dtype | None:
    """The least precise dtype of the states a hybrid's recurrent layers handed on after the probe's first token
    (transformers' Mamba2 and Gated DeltaNet layers keep float32 states in a float64 model: what follows them on the
    path is computed from float32 values, whatever the model's dtype), or None (no states; attention-only models)."""
    dtypes = [t.dtype for layer in (states or ()) if layer is not None for t in layer
              if t is not None and t.is_floating_point()]
    return max(dtypes, key=lambda d: torch.finfo(d).eps, default=None)


def _dense_decode(lm, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """The dense logits `(3, vocab)` of the probe's first three tokens decoded one at a time, each continuing the
    model's own cache (its recurrent layers' step form, its attention over cached keys/values). None when the model
    keeps no cache of its own."""
    name = "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"
    cache, logits = None, []
    try:
        for i in range(3):
            past = {} if cache is None else {name: cache}
            out = lm(input_ids=ids[:, i:i + 1], position_ids=positions[:, i:i + 1], use_cache=True, **past)
            cache = getattr(out, name, None)
            if cache is None:
                return None
            logits.append(out.logits[0])  # (1, vocab)
    except Exception:  # no cache it can continue: the dtype's tolerance alone judges the model
        return None
    return torch.cat(logits)  # (3, vocab)


def _log_probs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(log p(targets) (3,), entropy (3,))` of dense logits `(3, vocab)`, float32 for half precision."""
    logits = logits.float() if is_half(logits.dtype) else logits
    log_p = logits.log_softmax(-1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _probe_forward(backbone, ids: torch.Tensor, positions: torch.Tensor, stack: KVStack, layout: LayerLayout):
    """One DTA forward of `ids` `(1, length)` after the tokens on `stack`: final hidden states `(1, length, hidden)`,
    the new keys/values per layer, each `(1, n_kv_heads, length, head_dim)` (None for layers without attention), and
    a hybrid model's new recurrent states per layer (`recurrent/carrier.py`; None for attention-only models)."""
    ctx = attention.AttentionContext(stack)
    carrier = StateCarrier(layout, stack.states, 1, ids.shape[1], stack.length) if layout.hybrid else None
    try:
        hidden = backbone(input_ids=ids, position_ids=positions, use_cache=False, dta_ctx=ctx,
                          **({"cache": carrier} if carrier is not None else {})).last_hidden_state
    except (_ProbeFailure, DTAUnsupportedError):  # the latter: DTA's attention or carrier refused a layer
        raise
    except Exception as exc:
        if ctx.calls:
            raise
        raise _ProbeFailure(
            f"its forward fails before any layer reaches transformers' AttentionInterface ({_where(exc)}): it computes "
            "attention in its own code, or does not accept the engine's keyword arguments"
        ) from exc
    if ctx.calls == 0:
        raise _ProbeFailure(
            "its layers never call transformers' AttentionInterface: it computes attention (or another token mixer) "
            "in its own code, which DTA cannot give the path's keys/values"
        )
    attention_layers = list(layout.attention)
    if ctx.calls != len(attention_layers) or sorted(ctx.record) != attention_layers:
        raise _ProbeFailure(
            f"its {len(attention_layers)} attention layers make {ctx.calls} calls of transformers' "
            f"AttentionInterface, under the layer indices {sorted(ctx.record)}; DTA needs exactly one call per "
            "attention layer (layers without attention, or with looped or several attentions, keep state DTA does not "
            "carry along the path)"
        )
    states = None
    if carrier is not None:
        try:
            states = carrier.states()
        except DTAUnsupportedError as refusal:
            raise _ProbeFailure(refusal.blockers[0].feature) from None
    return hidden, [ctx.record.get(layer) for layer in range(layout.n_layers)], states


def _probe(lm, head: HeadSpec, layout: LayerLayout, precision: Precision) -> None:
    """Compare the model's dense log-probs of four tokens with DTA's (one-token prefix, three-token continuation), both
    under `precision`'s autocast."""
    config = lm.config.get_text_config()
    device = lm.get_input_embeddings().weight.device
    vocab = config.vocab_size
    ids = torch.tensor([[vocab // 2, vocab // 3, vocab // 5, vocab // 7]], device=device)  # (1, 4)
    positions = torch.arange(4, device=device)[None]  # (1, 4)
    targets = ids[0, 1:]  # (3,)
    with torch.no_grad(), _eval_mode(lm), precision.forward():
        logits = lm(input_ids=ids, position_ids=positions, use_cache=False).logits[0, :-1]  # (3, vocab)
        with attention_implementation(lm, _register_probe()):
            backbone = lm.get_decoder()
            stack = KVStack(layout.n_layers)
            first, kv, states = _probe_forward(backbone, ids[:, :1], positions[:, :1], stack, layout)
            stack.push(Frame([None if t is None else t[0] for t in kv], [None if t is None else t[1] for t in kv], 1,
                             states))
            rest, _, _ = _probe_forward(backbone, ids[:, 1:], positions[:, 1:], stack, layout)
        hidden = torch.cat([first, rest], dim=1)[0, :-1]  # (3, hidden)
        logps, entropy = head_logprobs(head, hidden, targets, entropy=True)  # (3,), (3,)
        want_lp, want_ent = _log_probs(logits, targets)
        scale = max(1.0, want_lp.abs().max().item(), want_ent.abs().max().item())

        def gap(lp: torch.Tensor, ent: torch.Tensor) -> float:
            return max((lp - want_lp).abs().max().item(), (ent - want_ent).abs().max().item()) / scale

        err, own = gap(logps, entropy), None
        tolerance = _tolerance(precision.compute_dtype(lm.dtype), device)
        if not err <= tolerance:  # beyond the dtype's rounding: measure the model's own precision on the same tokens
            decoded = _dense_decode(lm, ids, positions)  # (3, vocab) or None
            own = 0.0 if decoded is None else gap(*_log_probs(decoded, targets))
            tolerance = _judged_tolerance(precision.compute_dtype(lm.dtype), device, own)
            carried = _carried_dtype(states)  # a hybrid's recurrent layers may hand on states in a coarser dtype
            if carried is not None:
                tolerance = max(tolerance, _tolerance(carried, device))
    if not err <= tolerance:
        raise _ProbeFailure(
            f"a one-token prefix and its continuation through DTA give other log-probs than the dense forward of the "
            f"same tokens, both computed in {precision.describe(lm.dtype)}: relative difference {err:.2g}, more than "
            f"the {tolerance:g} that rounding in that precision explains (the dense forward differs from its own "
            f"cached decoding by {own:.2g}). Its outputs depend on something DTA does not "
            "reproduce (a position bias or mask of its own, bidirectional attention, or a logit post-processing DTA "
            "does not apply)"
        )


def model_blockers(lm, precision: Precision) -> list[Blocker]:
    """Every blocker of `lm` that the rules and the probe find (empty: DTA runs it), in a stable order: the family's
    and the attention's rules, the probe (unless those refused), then the features the probe cannot see."""
    config = lm.config.get_text_config()
    family_rule = families.family_of(config).rule
    mixer = [rule(config) for rule in ((family_rule,) if family_rule is not None else ()) + _MIXER_RULES]
    blockers = [b for b in mixer if b is not None]
    if not blockers:
        try:
            _probe(lm, HeadSpec.from_model(lm), LayerLayout.from_config(config), precision)
        except _ProbeFailure as failure:
            blockers.append(Blocker(str(failure)))
        except DTAUnsupportedError as refusal:  # DTA's attention or carrier refused a layer
            blockers += refusal.blockers
        except Exception as exc:  # raised inside transformers or torch: the model cannot run this way at all
            blockers.append(Blocker(f"its forward fails with DTA's attention ({_where(exc)})"))
    return blockers + [b for b in (rule(config) for rule in _TRAINING_RULES) if b is not None]


def refusal_subject(lm) -> str:
    """`"MixtralForCausalLM (model type 'mixtral')"`: how a refusal names the model."""
    return f"{type(lm).__name__} (model type '{lm.config.get_text_config().model_type}')"


def refusal_tail() -> str:
    """The refusal's closing sentence: the families the tests cover."""
    return f"Model types tested with DTA: {', '.join(families.model_types('tested'))}."


def check_model_support(lm, precision: Precision | None = None) -> None:
    """Refuse, before any forward of the user's, a causal LM that runs densely but not through DTA.

    Applies the rules, then the probe (see the module docstring), and refuses with one message naming every blocker
    found and its fix ([`refusal.DTAUnsupportedError`]). Model types without a tested row in the family table
    (`families.FAMILIES`) that pass get a one-time warning.

    Args:
        lm (`transformers.PreTrainedModel`): the causal LM (a PEFT model's base model, adapters active).
        precision (`Precision`, *optional*): the autocast the engine's calls run under; None: what `lm(...)` runs
            under here (its accelerate wrapper, else the caller's autocast).

    Raises:
        `DTAUnsupportedError` (a `NotImplementedError`): naming the model type, every blocker with its fix, the dense
            alternative and the tested families.
    """
    if precision is None:
        precision = Precision.of(lm, device=lm.get_input_embeddings().weight.device)
    refuse(refusal_subject(lm), model_blockers(lm, precision), refusal_tail())
    warn_untested(lm)


def warn_untested(lm) -> None:
    """The one-time warning for a model type without a tested row in `families.FAMILIES` that passed the checks."""
    model_type = lm.config.get_text_config().model_type
    if not families.family_of(lm.config.get_text_config()).tested:
        _checks.warn_once(
            f"models:untested:{model_type}",
            f"DTA: model type '{model_type}' is not among the tested families "
            f"({', '.join(families.model_types('tested'))}); it passed the construction probe (four tokens as a prefix "
            "and its continuation, checked against its dense forward).",
        )
