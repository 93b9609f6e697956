"""What DTA knows about each model family, in one table: `FAMILIES`, keyed by `config.model_type`.

A family is one row ([`Family`]): whether the tests cover it, the recurrent token mixer of a hybrid (its other layers'
mixers follow from `config.layer_types`, see `recurrent/layout.py`), the config field holding a MoE family's expert
count (the load-balancing loss DTA reproduces), the factor its causal LM applies to the logits, the fields the FLOP
model reads for its recurrent layers, and a rule refusing configurations of the family DTA does not reproduce. Adding a
family is adding a row (and a test).

| column             | read by                            | without a row                                         |
|--------------------|------------------------------------|-------------------------------------------------------|
| `tested`           | `support.check_model_support`      | a model that passes the probe runs with a warning     |
| `recurrent`        | `support` (layer rule), hybrids    | recurrent layers (`linear_attention`, `hybrid`) refused |
| `experts`          | `routers.router_spec`              | TRL's router loss refused (`router_aux_loss_coef=0.0`) |
| `logit_multiplier` | `lm_head.HeadSpec`                 | a logit-scaling config field refused                  |
| `flops`            | `flops.ModelShape.from_config`     | the FLOP model counts every layer as attention + MLP  |
| `rule`             | `support.model_blockers`           | no family rule                                        |

The snapshots [`TESTED_MODEL_TYPES`], [`RECURRENT_FAMILIES`] and [`ROUTER_LOSS_FAMILIES`] are the table's columns as
the package loaded; the checks read `FAMILIES` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..refusal import Blocker


@dataclass(frozen=True)
class RecurrentFlops:
    """The config fields (or fixed values) of a hybrid's recurrent layers that `flops.ModelShape` reads.

    Args:
        kind (`str`): `"gated_deltanet"` or `"mamba2"` (`flops.RECURRENT_KINDS`).
        heads, groups, key_dim, value_dim, conv_kernel, chunk_size (`str` or `int`): a config attribute, or the value
            itself (the Gated DeltaNet scan's chunk is fixed in transformers): Gated DeltaNet value heads, key heads,
            `d_k`, `d_v`; Mamba2 heads, groups, state size, head channels; the short convolution; the scan chunk.
        mlp_every_layer (`bool`, *optional*, defaults to `True`): every layer has an MLP; False: only the position-wise
            layers (`mlp`, `moe`; Nemotron-H).
    """

    kind: str
    heads: str | int
    groups: str | int
    key_dim: str | int
    value_dim: str | int
    conv_kernel: str | int
    chunk_size: str | int
    mlp_every_layer: bool = True

    def values(self, config) -> tuple:
        """`(heads, groups, key_dim, value_dim, conv_kernel, chunk_size)` read from `config`."""
        fields = (self.heads, self.groups, self.key_dim, self.value_dim, self.conv_kernel, self.chunk_size)
        return tuple(getattr(config, f) if isinstance(f, str) else f for f in fields)


@dataclass(frozen=True)
class Family:
    """One model family (module docstring).

    Args:
        tested (`bool`, *optional*, defaults to `False`): the tests cover its equivalence with the dense per-sequence
            computation (`tests/test_models.py`, `tests/test_engine.py`, `tests/recurrent/`).
        recurrent (`str`, *optional*): a hybrid's recurrent token mixer (`"Mamba2"`, `"Gated DeltaNet"`), whose layers
            take their states from the forward's cache (`recurrent/carrier.py`); None: recurrent layers are refused.
        experts (`str`, *optional*): a MoE family whose causal LM adds transformers' Switch-style
            `load_balancing_loss_func` (top-k of the softmax, layers pooled, padding masked): the config attribute
            holding the number of experts (the top-k is `num_experts_per_tok`).
        logit_multiplier (`Callable[[config], float]`, *optional*): the factor its `*ForCausalLM.forward` applies to
            the head's output, before any soft-capping.
        flops ([`RecurrentFlops`], *optional*): a hybrid's recurrent-layer fields for the FLOP model.
        rule (`Callable[[config], Blocker | None]`, *optional*): the blocker of a configuration of the family, or None.
    """

    tested: bool = False
    recurrent: str | None = None
    experts: str | None = None
    logit_multiplier: Callable[[object], float] | None = None
    flops: RecurrentFlops | None = None
    rule: Callable[[object], Blocker | None] | None = None


def _times(field: str) -> Callable[[object], float]:
    return lambda config: float(getattr(config, field))


def _divided_by(field: str) -> Callable[[object], float]:
    return lambda config: 1.0 / float(getattr(config, field))


_ALIBI = Blocker("it adds ALiBi biases to the attention scores in its own attention code; DTA's attention has no "
                 "position bias")
_GATED_DELTANET = RecurrentFlops("gated_deltanet", "linear_num_value_heads", "linear_num_key_heads",
                                 "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", 64)
_MAMBA2 = RecurrentFlops("mamba2", "mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_head", "mamba_d_conv",
                         "mamba_chunk_size")
# The same config field means different things in different families (Granite divides the logits by `logits_scaling`,
# HyperCLOVAX multiplies them by it, MiniCPM3 divides the hidden states, which is the same for its bias-free head).
_COHERE = _times("logit_scale")
_GRANITE = _divided_by("logits_scaling")

FAMILIES: dict[str, Family] = {
    # Softmax-attention families.
    **dict.fromkeys(("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "gemma3", "phi3", "olmo",
                     "gpt_neox", "gpt2", "glm4_moe"), Family(tested=True)),
    # The text models of the vision-language families whose images DTA runs (`vision/families.py`; M-RoPE).
    **dict.fromkeys(("qwen2_vl_text", "qwen2_5_vl_text"), Family(tested=True)),
    "granite": Family(tested=True, logit_multiplier=_GRANITE),
    "minicpm3": Family(tested=True, logit_multiplier=_GRANITE),
    "cohere": Family(tested=True, logit_multiplier=_COHERE),
    "qwen3_moe": Family(tested=True, experts="num_experts"),
    "mixtral": Family(tested=True, experts="num_local_experts"),
    # Its router's top-k on the logits = the loss's top-k of their softmax.
    "gpt_oss": Family(tested=True, experts="num_local_experts"),
    # Hybrids: recurrent layers beside attention (`recurrent/`).
    "qwen3_5_text": Family(tested=True, recurrent="Gated DeltaNet", flops=_GATED_DELTANET),
    "qwen3_next": Family(tested=True, recurrent="Gated DeltaNet", experts="num_experts", flops=_GATED_DELTANET),
    "nemotron_h": Family(tested=True, recurrent="Mamba2", flops=RecurrentFlops(
        "mamba2", "mamba_num_heads", "n_groups", "ssm_state_size", "mamba_head_dim", "conv_kernel", "chunk_size",
        mlp_every_layer=False)),
    "granitemoehybrid": Family(tested=True, recurrent="Mamba2", experts="num_local_experts", flops=_MAMBA2),
    "bamba": Family(tested=True, recurrent="Mamba2", flops=_MAMBA2),
    "falcon_h1": Family(tested=True, recurrent="Mamba2 (beside attention in every layer)", flops=_MAMBA2),
    # Untested families whose logit scaling DTA applies (they still pass the probe before they run).
    **dict.fromkeys(("cohere2", "cohere2_moe"), Family(logit_multiplier=_COHERE)),
    **dict.fromkeys(("granitemoe", "granitemoeshared", "granite_swa", "granitemoe_swa"),
                    Family(logit_multiplier=_GRANITE)),
    "hyperclovax": Family(logit_multiplier=_times("logits_scaling")),
    # Refused families (ALiBi).
    "bloom": Family(rule=lambda config: _ALIBI),
    "mpt": Family(rule=lambda config: _ALIBI if config.attn_config.alibi else None),
    "falcon": Family(rule=lambda config: _ALIBI if config.alibi else None),
}


def family_of(config) -> Family:
    """The row of a text config's model type (an empty `Family()` for a type without one)."""
    return FAMILIES.get(config.model_type, Family())


def model_types(column: str) -> list[str]:
    """The model types whose `column` is set (truthy), sorted: e.g. `model_types("tested")`."""
    return sorted(t for t, f in FAMILIES.items() if getattr(f, column))


TESTED_MODEL_TYPES = frozenset(model_types("tested"))
RECURRENT_FAMILIES: dict[str, str] = {t: FAMILIES[t].recurrent for t in model_types("recurrent")}
ROUTER_LOSS_FAMILIES: dict[str, str] = {t: FAMILIES[t].experts for t in model_types("experts")}
