"""The benchmarks' models: a causal LM of a [`~trl_dta.flops.ModelShape`] with random weights (or a pretrained
checkpoint's real weights), its AdamW state, and the loss every provider is given.

A model family is a row of the package's families table (`trl_dta.modeling.families.FAMILIES`, keyed by
`config.model_type`); the benchmarks keep no table of their own. A config is transformers' own for the model type
(`AutoConfig.for_model`) at the shape's widths, and the row says where the family keeps what a shape does not name:
a MoE family's expert count (`Family.experts`), a hybrid's recurrent-layer fields (`Family.flops`, the fields
`ModelShape.from_config` reads back, so that a built config is checked against the shape it was built from). What the
benchmarks choose on top is spelled out here: how many experts, the layer pattern of a hybrid, tied embeddings.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trl_dta.flops import ModelShape, get_model_shape
from trl_dta.modeling.families import FAMILIES

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp64": torch.float64, "float64": torch.float64, "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name of `DTYPES` (`"fp32"`, `"bf16"`, ...)."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


# Shapes built from a pretrained checkpoint instead of random weights: name -> (shape, `trl_dta.demos.pretrained` key).
# `smollm2`: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9/3 heads, vocab 49,152, tied embeddings).
PRETRAINED_SHAPES = {"smollm2": (ModelShape(576, 1536, 30, 9, 3, 64, 49152, name="smollm2"), "smollm2-135m-instruct")}

# `build_model(family=...)` and `--families`: `qwen` is the shape's own model (Qwen3 for `qwen3-*` shapes, else
# Qwen2); another name is a model type of the families table, built at the shape's width.
FAMILY_NAMES = ("qwen", "gpt_oss")

# A MoE family at a shape's width: `MOE_EXPERTS` experts of half the shape's MLP width, `MOE_ROUTED` routed per
# token, so that the active MLP FLOPs are the shape's.
MOE_EXPERTS, MOE_ROUTED = 4, 2


def _gpt_oss(max_position_embeddings: int) -> dict:
    """GPT-OSS's own settings: attention sinks, which only its eager attention has (transformers has no SDPA one for
    them); sliding (window 128) and full layers alternating (its default `layer_types`); YaRN stretching RoPE 32-fold
    up to the position table; an untied LM head."""
    return dict(attn_implementation="eager", tie_word_embeddings=False, sliding_window=128,
                rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "rope_theta": 150000.0,
                                 "original_max_position_embeddings": max_position_embeddings // 32})


# Settings of a model type that are neither the shape's nor its row's (`max_position_embeddings` -> config fields).
MODEL_SETTINGS: dict[str, Callable[[int], dict]] = {"gpt_oss": _gpt_oss}


def _qwen3_5_layers(shape: ModelShape) -> dict:
    """Gated DeltaNet as Qwen3.5 lays it out: three linear-attention layers, then a full-attention one."""
    return dict(layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                             for i in range(shape.num_layers)])


def _nemotron_h_layers(shape: ModelShape) -> dict:
    """Mamba2 as Nemotron-H lays it out (`M` Mamba2, `-` MLP, `*` attention blocks): Mamba2 and MLP blocks
    alternating, the attention blocks last."""
    pattern = "".join("M-"[i % 2] for i in range(shape.recurrent_layers + shape.n_mlp_layers))
    return dict(hybrid_override_pattern=pattern + "*" * shape.n_attention_layers)


# A hybrid shape (`recurrent_layers > 0`) per recurrent kind: the model type it builds and its layer pattern.
HYBRIDS: dict[str, tuple[str, Callable[[ModelShape], dict]]] = {
    "gated_deltanet": ("qwen3_5_text", _qwen3_5_layers),
    "mamba2": ("nemotron_h", _nemotron_h_layers),
}


def model_shape(shape: str | ModelShape) -> ModelShape:
    """`trl_dta.flops.get_model_shape`, and the pretrained shapes of `PRETRAINED_SHAPES`."""
    if isinstance(shape, str) and shape in PRETRAINED_SHAPES:
        return PRETRAINED_SHAPES[shape][0]
    return get_model_shape(shape)


def model_type(shape: ModelShape, family: str = "qwen") -> str:
    """The `config.model_type` that `build_model` builds for `shape` and `family` (a hybrid shape: its kind's)."""
    if family not in FAMILY_NAMES:
        raise ValueError(f"unknown model family {family!r}; choose one of {sorted(FAMILY_NAMES)}")
    if shape.recurrent_layers:
        return HYBRIDS[shape.recurrent_kind][0]
    if family == "qwen":
        return "qwen3" if shape.name.startswith("qwen3") else "qwen2"
    return family


def _recurrent_fields(shape: ModelShape, spec) -> dict:
    """The config fields of a hybrid's recurrent layers, named by its row's `Family.flops` (a fixed value there, e.g.
    Gated DeltaNet's scan chunk, is no field: the round trip through `ModelShape.from_config` checks it)."""
    names = (spec.heads, spec.groups, spec.key_dim, spec.value_dim, spec.conv_kernel, spec.chunk_size)
    values = (shape.recurrent_heads, shape.recurrent_groups, shape.recurrent_key_dim, shape.recurrent_value_dim,
              shape.conv_kernel, shape.chunk_size)
    return {name: value for name, value in zip(names, values) if isinstance(name, str)}


def build_config(shape: ModelShape, family: str = "qwen", max_position_embeddings: int = 32768,
                 attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32):
    """The transformers config `build_model` builds (module docstring): the model type of `model_type`, its row of
    the families table, `MOE_EXPERTS` / `MOE_ROUTED` for a MoE row, `HYBRIDS` for a hybrid shape, `MODEL_SETTINGS`.

    Raises:
        `ValueError`: an unknown family, a model type without a row, or a config whose shape is not `shape`.
    """
    from transformers import AutoConfig

    kind = model_type(shape, family)
    if kind not in FAMILIES:
        raise ValueError(f"model type {kind!r} has no row in trl_dta.modeling.families.FAMILIES; add one there")
    row = FAMILIES[kind]
    fields = dict(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, num_hidden_layers=shape.num_layers,
                  num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                  max_position_embeddings=max_position_embeddings, attn_implementation=attn_implementation,
                  dtype=dtype, intermediate_size=shape.intermediate_size, tie_word_embeddings=True)
    if row.experts:
        fields.update({row.experts: MOE_EXPERTS, "num_experts_per_tok": MOE_ROUTED,
                       "intermediate_size": shape.intermediate_size // 2})
    if shape.recurrent_layers:
        fields.update(_recurrent_fields(shape, row.flops), **HYBRIDS[shape.recurrent_kind][1](shape))
    if kind in MODEL_SETTINGS:
        fields.update(MODEL_SETTINGS[kind](max_position_embeddings))
    config = AutoConfig.for_model(kind, **fields)
    if not row.experts:  # a MoE model's MLP is the shape's in active FLOPs, not in `intermediate_size`
        got = ModelShape.from_config(config, name=shape.name)
        if got != shape:
            raise ValueError(f"{shape.name}: the built config has the shape {got}, not {shape}")
    return config


def _pretrained(shape: ModelShape, dtype, device, attn_implementation: str):
    """The real weights of a `PRETRAINED_SHAPES` shape (converted once, cached: `demos.pretrained`), in train mode."""
    from transformers import AutoModelForCausalLM

    from trl_dta.demos.pretrained import pretrained_folder

    model = AutoModelForCausalLM.from_pretrained(pretrained_folder(PRETRAINED_SHAPES[shape.name][1]), dtype=dtype,
                                                 attn_implementation=attn_implementation).to(device)
    got = ModelShape.from_config(model.config, name=shape.name)
    if got != shape:
        raise ValueError(f"{shape.name}: the checkpoint has the shape {got}, not {shape}")
    return model.train()


def build_model(
    shape: str | ModelShape,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    max_position_embeddings: int = 32768,
    family: str = "qwen",
):
    """A causal LM of `shape` with random weights, in train mode: the shape's own Qwen2 (Qwen3 for `qwen3-*` shapes),
    or another family of `FAMILY_NAMES` at the same width; a hybrid shape (`recurrent_layers > 0`) builds a Qwen3.5 text
    model (Gated DeltaNet) or a Nemotron-H (Mamba2), `HYBRIDS`. The config: [`build_config`].

    Args:
        shape (`str` or [`~trl_dta.flops.ModelShape`]): the model's shape (a name of `trl_dta.flops.MODEL_SHAPES`, or
            of `PRETRAINED_SHAPES`: the pretrained model's real weights, `seed` and `family` unused).
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): parameter dtype.
        device (`str`, *optional*, defaults to `"cpu"`): where the parameters live.
        seed (`int`, *optional*, defaults to `0`): initialisation seed (the global RNG is left untouched).
        attn_implementation (`str`, *optional*, defaults to `"sdpa"`): attention backend of the dense path.
        max_position_embeddings (`int`, *optional*, defaults to `32768`): longest position (RoPE table).
        family (`str`, *optional*, defaults to `"qwen"`): one of `FAMILY_NAMES`.
    """
    from transformers import AutoModelForCausalLM

    if family not in FAMILY_NAMES:
        raise ValueError(f"unknown model family {family!r}; choose one of {sorted(FAMILY_NAMES)}")
    shape = model_shape(shape)
    if shape.name in PRETRAINED_SHAPES:
        if family != "qwen":
            raise ValueError(f"shape {shape.name!r} loads its own pretrained model; drop family={family!r}")
        return _pretrained(shape, dtype, device, attn_implementation)
    config = build_config(shape, family, max_position_embeddings, attn_implementation, dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config).to(dtype)
    return model.train()


def make_optimizer(model) -> torch.optim.Optimizer:
    """AdamW with its state already allocated (so that peak-memory deltas hold activations only)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0, foreach=False)
    for p in params:
        state = opt.state[p]
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return opt


def make_loss_fn(n_sequences: int, n_tokens: int, seed: int = 0) -> Callable:
    """A GRPO-like per-sequence loss: `-A_i * sum_t logp_i[t] / n_tokens` with fixed random advantages `A_i`.

    The same function is given to every provider, so that their losses and gradients are comparable; its signature is
    `loss_fn(i, logps_i, entropy_i)`, the per-sequence loss of [`~trl_dta.DTAEngine.forward_backward`].
    """
    gen = torch.Generator().manual_seed(seed)
    advantages = torch.randn(n_sequences, generator=gen, dtype=torch.float64).tolist()
    scale = 1.0 / max(n_tokens, 1)

    def loss_fn(i: int, logps: torch.Tensor, entropy: torch.Tensor | None = None) -> torch.Tensor:
        return logps.sum() * (-advantages[i] * scale)

    return loss_fn
