"""Analytic FLOP counts for dense and tree execution of a decoder-only transformer.

The benchmarks put a FLOP count beside every time, and the analyzer predicts speed-ups from them. Counts are matmul
FLOPs (2 per multiply-add); norms, activations, RoPE and softmax are left out (they are a few percent and scale with
the same token counts).

Per layer, per token (forward):

```
linear     2 * hidden * (n_heads * head_dim)            q projection
         + 2 * 2 * hidden * (n_kv_heads * head_dim)     k and v projections
         + 2 * (n_heads * head_dim) * hidden            o projection
         + 2 * 3 * hidden * intermediate                gate, up, down (SwiGLU MLP)
attention  2 * 2 * n_heads * head_dim * (d + 1)         QK^T and AV for a token at depth d (it sees d + 1 keys)
```

plus `2 * hidden * vocab` per position projected by the LM head. The backward pass costs twice the forward
(gradients with respect to inputs and to weights), so a training step costs `3 x` the forward count.

Hybrid models (`ModelShape.recurrent_layers > 0`: Gated DeltaNet or Mamba2 layers beside `attention_layers` attention
layers, `mlp_layers` MLPs) add per recurrent layer and token a cost that does **not** grow with the depth (the state
has a fixed size), so only the attention layers' term below grows with the path:

```
gated_deltanet  2 * hidden * (2 Hk dk + 2 Hv dv + 2 Hv) + 2 * Hv dv * hidden     q, k, v, z, a, b and out projections
              + 2 * k * (2 Hk dk + Hv dv)                                       the short convolution
              + 2 * Hv * (3 dk dv + C (dk + dv))                                state read, delta, rank-1 update;
                                                                                 intra-chunk part (chunks of C)
mamba2          2 * hidden * (2 H P + 2 G N + H) + 2 * H P * hidden             in and out projections
              + 2 * k * (H P + 2 G N)                                           the short convolution
              + 2 * H * (2 P N + C (N + P) / 2)                                 state update and read; intra-chunk
```

(`Hk`/`Hv` key/value heads of `dk`/`dv`; Mamba2's `H` heads of `P` channels, `G` groups, state `N`; kernel `k`.) These
are the chunked algorithms' matmuls, approximate (elementwise decays and gates left out, like norms above).

Dense execution computes each sequence on its own; tree execution computes each distinct prefix once: a tree token
at depth `d` does the linear work once and attends its `d + 1` ancestors-or-self, exactly like the same token in any
sequence that contains it. The ideal speed-up `dense / tree` is therefore the compression ratio for token-linear work
and a little less once attention (whose per-token cost grows with depth) matters.

```
    seqs: a b c d | a b c e          dense: 8 tokens, attention keys 1+2+3+4 per sequence = 20
    tree: [a b c] -> [d], [e]        tree: 5 tokens, attention keys 1+2+3 + 4 + 4 = 14
```

The peak-memory estimate of a DTA step, which replays the engine's walk over the same trees, is in `memory.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "MODEL_SHAPES",
    "FlopCount",
    "ModelShape",
    "dense_flops",
    "get_model_shape",
    "ideal_ratio",
    "padded_dense_flops",
    "tree_flops",
]


@dataclass(frozen=True)
class ModelShape:
    """Shape of a decoder-only transformer, as far as FLOPs are concerned.

    Args:
        hidden_size (`int`): width of the residual stream.
        intermediate_size (`int`): width of the (SwiGLU) MLP.
        num_layers (`int`): number of decoder layers.
        num_heads (`int`): number of query heads.
        num_kv_heads (`int`): number of key/value heads (grouped-query attention when smaller than `num_heads`).
        head_dim (`int`): width of one attention head.
        vocab_size (`int`): rows of the LM head.
        name (`str`, *optional*, defaults to `"custom"`): a label for tables.
        attention_layers (`int`, *optional*): layers with softmax attention; None: all `num_layers`.
        mlp_layers (`int`, *optional*): layers with an MLP; None: all `num_layers`.
        recurrent_layers (`int`, *optional*, defaults to `0`): layers with a recurrent token mixer (hybrids).
        recurrent_kind (`str`, *optional*): `"gated_deltanet"` or `"mamba2"` (with `recurrent_layers > 0`).
        recurrent_heads (`int`), recurrent_groups (`int`), recurrent_key_dim (`int`), recurrent_value_dim (`int`):
            Gated DeltaNet: value heads `Hv`, key heads `Hk`, `dk`, `dv`; Mamba2: heads `H`, groups `G`, state `N`,
            head channels `P`.
        conv_kernel (`int`, *optional*, defaults to `4`), chunk_size (`int`, *optional*, defaults to `64`): the
            recurrent layers' short convolution and scan chunk.
    """

    hidden_size: int = field(metadata={"help": "Width of the residual stream."})
    intermediate_size: int = field(metadata={"help": "Width of the (SwiGLU) MLP."})
    num_layers: int = field(metadata={"help": "Number of decoder layers."})
    num_heads: int = field(metadata={"help": "Number of query heads."})
    num_kv_heads: int = field(metadata={"help": "Number of key/value heads."})
    head_dim: int = field(metadata={"help": "Width of one attention head."})
    vocab_size: int = field(metadata={"help": "Rows of the LM head."})
    name: str = field(default="custom", metadata={"help": "A label for tables."})
    attention_layers: int | None = field(default=None, metadata={"help": "Layers with softmax attention (all)."})
    mlp_layers: int | None = field(default=None, metadata={"help": "Layers with an MLP (all)."})
    recurrent_layers: int = field(default=0, metadata={"help": "Layers with a recurrent token mixer."})
    recurrent_kind: str = field(default="", metadata={"help": "'gated_deltanet' or 'mamba2'."})
    recurrent_heads: int = field(default=0, metadata={"help": "Gated DeltaNet value heads / Mamba2 heads."})
    recurrent_groups: int = field(default=0, metadata={"help": "Gated DeltaNet key heads / Mamba2 groups."})
    recurrent_key_dim: int = field(default=0, metadata={"help": "Gated DeltaNet d_k / Mamba2 state size."})
    recurrent_value_dim: int = field(default=0, metadata={"help": "Gated DeltaNet d_v / Mamba2 head channels."})
    conv_kernel: int = field(default=4, metadata={"help": "The recurrent layers' short convolution."})
    chunk_size: int = field(default=64, metadata={"help": "The recurrent layers' scan chunk."})

    def __post_init__(self):
        for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "vocab_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelShape.{key} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelShape.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.recurrent_layers:
            if self.recurrent_kind not in RECURRENT_KINDS:
                raise ValueError(f"ModelShape.recurrent_kind must be one of {sorted(RECURRENT_KINDS)} with "
                                 f"recurrent_layers > 0, got {self.recurrent_kind!r}")
            for key in ("recurrent_heads", "recurrent_groups", "recurrent_key_dim", "recurrent_value_dim"):
                value = getattr(self, key)
                if not isinstance(value, int) or value <= 0:
                    raise ValueError(
                        f"ModelShape.{key} must be a positive int with recurrent_layers > 0, got {value!r}")
        for key in ("attention_layers", "mlp_layers"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= self.num_layers):
                raise ValueError(f"ModelShape.{key} must be None or an int in [0, num_layers], got {value!r}")

    @property
    def n_attention_layers(self) -> int:
        return self.num_layers if self.attention_layers is None else self.attention_layers

    @property
    def n_mlp_layers(self) -> int:
        return self.num_layers if self.mlp_layers is None else self.mlp_layers

    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> ModelShape:
        """Read the shape from a `transformers` config (or any object with the same attribute names).

        Multimodal configs are reduced to their text config (`get_text_config()`).
        """
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        missing = [
            k
            for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if getattr(config, k, None) is None
        ]
        if missing:
            raise ValueError(f"config {type(config).__name__} lacks {missing}; pass a `ModelShape` instead")
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            name=name or getattr(config, "name_or_path", None) or getattr(config, "model_type", "custom") or "custom",
            **_hybrid_fields(config),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    # ------------------------------------------------------------------ per-token forward FLOPs

    @property
    def linear_flops_per_token(self) -> int:
        """Forward matmul FLOPs of all layers' projections, MLPs and recurrences for one token (everything whose cost
        per token does not grow with the depth)."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        h = self.hidden_size
        attention = 2 * h * (q + 2 * kv) + 2 * q * h
        mlp = 6 * h * self.intermediate_size
        return (self.n_attention_layers * attention + self.n_mlp_layers * mlp
                + self.recurrent_layers * self.recurrent_flops_per_token)

    @property
    def recurrent_flops_per_token(self) -> int:
        """Forward matmul FLOPs of one recurrent layer for one token (module docstring; 0 without one)."""
        if not self.recurrent_layers:
            return 0
        h, k, c = self.hidden_size, self.conv_kernel, self.chunk_size
        heads, groups, dk, dv = (self.recurrent_heads, self.recurrent_groups, self.recurrent_key_dim,
                                 self.recurrent_value_dim)
        if self.recurrent_kind == "gated_deltanet":
            conv = 2 * groups * dk + heads * dv
            return (2 * h * (conv + heads * dv + 2 * heads) + 2 * heads * dv * h + 2 * k * conv
                    + 2 * heads * (3 * dk * dv + c * (dk + dv)))
        inner, conv = heads * dv, heads * dv + 2 * groups * dk  # Mamba2: dk = state N, dv = head channels P
        return (2 * h * (inner + conv + heads) + 2 * inner * h + 2 * k * conv
                + 2 * heads * (2 * dv * dk + c * (dk + dv) // 2))

    @property
    def attention_flops_per_key(self) -> int:
        """Forward FLOPs of QK^T and AV, all attention layers, for one (query, key) pair."""
        return self.n_attention_layers * 4 * self.num_heads * self.head_dim

    @property
    def lm_head_flops_per_position(self) -> int:
        """Forward FLOPs of the LM head for one projected position."""
        return 2 * self.hidden_size * self.vocab_size


RECURRENT_KINDS = frozenset({"gated_deltanet", "mamba2"})

def _hybrid_fields(config) -> dict:
    """`ModelShape` fields of a hybrid's recurrent, attention and MLP layers from its `layer_types` and its family's
    row (`modeling/families.py`, `Family.flops`; none for other configs). Nemotron-H has MLPs only in its `mlp`/`moe`
    layers; the other hybrids in every layer."""
    from .modeling.families import FAMILIES  # transformers' configs only: `flops` loads without torch
    from .recurrent import ATTENTION_LAYER_TYPES, POSITION_WISE_LAYER_TYPES, RECURRENT_LAYER_TYPES

    kinds = list(getattr(config, "layer_types", None) or ())
    family = FAMILIES.get(getattr(config, "model_type", ""))
    spec = None if family is None else family.flops
    if spec is None or not kinds:
        return {}
    heads, groups, dk, dv, kernel, chunk = spec.values(config)
    fields = dict(recurrent_layers=sum(k in RECURRENT_LAYER_TYPES for k in kinds), recurrent_kind=spec.kind,
                  recurrent_heads=heads, recurrent_groups=groups, recurrent_key_dim=dk, recurrent_value_dim=dv,
                  conv_kernel=kernel, chunk_size=chunk, attention_layers=sum(k in ATTENTION_LAYER_TYPES for k in kinds))
    if not spec.mlp_every_layer:
        fields["mlp_layers"] = sum(k in POSITION_WISE_LAYER_TYPES for k in kinds)
    return fields


MODEL_SHAPES: dict[str, ModelShape] = {
    # Qwen/Qwen3-1.7B config.json
    "qwen3-1.7b": ModelShape(2048, 6144, 28, 16, 8, 128, 151936, name="qwen3-1.7b"),
    # Qwen/Qwen3-0.6B config.json (tied embeddings, as 1.7B)
    "qwen3-0.6b": ModelShape(1024, 3072, 28, 16, 8, 128, 151936, name="qwen3-0.6b"),
    # Qwen/Qwen3-8B config.json (36 layers, 8 KV heads of 128: 147,456 bytes of bf16 K/V per token)
    "qwen3-8b": ModelShape(4096, 12288, 36, 32, 8, 128, 151936, name="qwen3-8b"),
    # Qwen/Qwen2-0.5B config.json
    "qwen2-0.5b": ModelShape(896, 4864, 24, 14, 2, 64, 151936, name="qwen2-0.5b"),
    # The CPU benchmark's Qwen2-shaped model with random weights (benchmarks/harness/models.py builds it).
    "bench-cpu": ModelShape(512, 1408, 8, 8, 2, 64, 8192, name="bench-cpu"),
    # The `--quick` benchmark model.
    "bench-cpu-quick": ModelShape(256, 704, 4, 4, 2, 64, 4096, name="bench-cpu-quick"),
    # The hybrid benchmark's models (benchmarks/suites/bench_hybrid.py), the width and depth of `bench-cpu-quick`:
    # Qwen3.5's three Gated DeltaNet layers per full-attention layer, and Nemotron-H's Mamba2 / MLP / Mamba2 /
    # attention blocks.
    "bench-qwen3.5-quick": ModelShape(256, 704, 4, 4, 2, 64, 4096, name="bench-qwen3.5-quick", attention_layers=1,
                                      recurrent_layers=3, recurrent_kind="gated_deltanet", recurrent_heads=4,
                                      recurrent_groups=2, recurrent_key_dim=64, recurrent_value_dim=64),
    "bench-nemotron-h-quick": ModelShape(256, 704, 4, 4, 2, 64, 4096, name="bench-nemotron-h-quick",
                                         attention_layers=1, mlp_layers=1, recurrent_layers=2, recurrent_kind="mamba2",
                                         recurrent_heads=8, recurrent_groups=2, recurrent_key_dim=64,
                                         recurrent_value_dim=64, chunk_size=128),
    # transformers' `Qwen3_5TextConfig()` defaults (its docstring: the Qwen3.5-9B style configuration): 32 layers,
    # 3 Gated DeltaNet layers per full-attention layer.
    "qwen3.5-9b": ModelShape(4096, 12288, 32, 16, 4, 256, 248320, name="qwen3.5-9b", attention_layers=8,
                             recurrent_layers=24, recurrent_kind="gated_deltanet", recurrent_heads=32,
                             recurrent_groups=16, recurrent_key_dim=128, recurrent_value_dim=128),
}


def get_model_shape(shape: str | ModelShape | Any) -> ModelShape:
    """A `ModelShape` from a name in `MODEL_SHAPES`, a `ModelShape`, or a `transformers` config."""
    if isinstance(shape, ModelShape):
        return shape
    if isinstance(shape, str):
        key = shape.lower()
        if key not in MODEL_SHAPES:
            raise ValueError(f"unknown model shape {shape!r}; choose one of {sorted(MODEL_SHAPES)} or pass a config")
        return MODEL_SHAPES[key]
    return ModelShape.from_config(shape)


@dataclass
class FlopCount:
    """FLOPs of one pass over a batch, split by kind.

    Args:
        tokens (`int`): token positions run through the layers (padding included for padded batches).
        attention_keys (`int`): (query, key) pairs attended, summed over tokens (layers and heads not multiplied in).
        lm_head_positions (`int`): positions projected by the LM head.
        linear (`float`): forward FLOPs of projections and MLPs.
        attention (`float`): forward FLOPs of QK^T and AV.
        lm_head (`float`): forward FLOPs of the LM head.
        training (`bool`): whether `total` includes the backward pass (`3 x` forward) or only the forward.
    """

    tokens: int
    attention_keys: int
    lm_head_positions: int
    linear: float
    attention: float
    lm_head: float
    training: bool = True

    @property
    def forward(self) -> float:
        return self.linear + self.attention + self.lm_head

    @property
    def total(self) -> float:
        return 3.0 * self.forward if self.training else self.forward


def _count(shape: ModelShape, tokens: int, keys: int, positions: int, training: bool) -> FlopCount:
    return FlopCount(
        tokens=tokens,
        attention_keys=keys,
        lm_head_positions=positions,
        linear=float(tokens) * shape.linear_flops_per_token,
        attention=float(keys) * shape.attention_flops_per_key,
        lm_head=float(positions) * shape.lm_head_flops_per_position,
        training=training,
    )


def _lengths(seqs: Iterable) -> list[int]:
    out = []
    for s in seqs:
        n = s if isinstance(s, int) else len(s)
        if n < 0:
            raise ValueError(f"sequence lengths must be >= 0, got {n}")
        out.append(int(n))
    return out


def dense_flops(
    lengths: Iterable[int] | Iterable[Sequence[int]], shape: str | ModelShape | Any, training: bool = True
) -> FlopCount:
    """FLOPs of running each sequence on its own, unpadded.

    Every position but the last of a sequence is projected by the LM head (it predicts the next token).

    Args:
        lengths (`Iterable[int]` or `Iterable[Sequence[int]]`): sequence lengths, or the sequences themselves.
        shape (`str`, [`ModelShape`] or a `transformers` config): the model.
        training (`bool`, *optional*, defaults to `True`): count forward and backward (`3 x` forward).
    """
    shape = get_model_shape(shape)
    lens = _lengths(lengths)
    tokens = sum(lens)
    keys = sum(n * (n + 1) // 2 for n in lens)
    positions = sum(max(n - 1, 0) for n in lens)
    return _count(shape, tokens, keys, positions, training)


def padded_dense_flops(
    lengths: Iterable[int] | Iterable[Sequence[int]],
    shape: str | ModelShape | Any,
    micro_batch_size: int,
    training: bool = True,
    causal_skip: bool = True,
) -> FlopCount:
    """FLOPs of running the sequences in padded micro-batches of `micro_batch_size` rows, in the given order.

    Each micro-batch is padded to its longest row; padding does the full linear and LM-head work (the fused LM head
    projects every position on CPU). Attention per row covers `L (L + 1) / 2` keys for a micro-batch of width `L`
    with `causal_skip` (a kernel that skips masked blocks), `L * L` without.

    Args:
        lengths (`Iterable[int]` or `Iterable[Sequence[int]]`): sequence lengths, or the sequences themselves.
        shape (`str`, [`ModelShape`] or a `transformers` config): the model.
        micro_batch_size (`int`): rows per micro-batch.
        training (`bool`, *optional*, defaults to `True`): count forward and backward.
        causal_skip (`bool`, *optional*, defaults to `True`): whether the attention kernel skips the masked half.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    shape = get_model_shape(shape)
    lens = _lengths(lengths)
    tokens = keys = positions = 0
    for start in range(0, len(lens), micro_batch_size):
        chunk = lens[start : start + micro_batch_size]
        width = max(chunk)
        rows = len(chunk)
        tokens += rows * width
        keys += rows * (width * (width + 1) // 2 if causal_skip else width * width)
        positions += rows * max(width - 1, 0)
    return _count(shape, tokens, keys, positions, training)


def _tree_counts(tree) -> tuple[int, int, int]:
    tokens = keys = positions = 0
    for seg in tree.segments:
        n = seg.end - seg.start
        tokens += n
        # depths start..end-1 attend depth+1 keys each
        keys += (seg.start + 1 + seg.end) * n // 2
        # every token predicts a next token, except the last token of a leaf segment
        positions += n if seg.children else n - 1
    return tokens, keys, positions


def tree_flops(tree, shape: str | ModelShape | Any, training: bool = True) -> FlopCount:
    """FLOPs of computing each tree token once (DTA, or a packed tree mask with a block-sparse kernel).

    A tree token at depth `d` attends its `d + 1` ancestors-or-self. The LM head projects every tree token that has
    a successor in some sequence (a fork row is projected once and serves all children).

    Args:
        tree ([`~trl_dta.PrefixTree`] or a list of sequences): the batch; a list is turned into a tree.
        shape (`str`, [`ModelShape`] or a `transformers` config): the model.
        training (`bool`, *optional*, defaults to `True`): count forward and backward.
    """
    from .tree import as_tree  # torch-only import, kept local so that `flops` loads without torch

    shape = get_model_shape(shape)
    tree = as_tree(tree)
    tokens, keys, positions = _tree_counts(tree)
    return _count(shape, tokens, keys, positions, training)


def ideal_ratio(seqs_or_tree, shape: str | ModelShape | Any) -> float:
    """Ideal training speed-up of tree over dense (unpadded) execution: `dense_flops / tree_flops`.

    Args:
        seqs_or_tree (list of sequences or [`~trl_dta.PrefixTree`]): the batch.
        shape (`str`, [`ModelShape`] or a `transformers` config): the model.
    """
    from .tree import as_tree  # torch-only import, kept local so that `flops` loads without torch

    tree = as_tree(seqs_or_tree)
    tree_total = tree_flops(tree, shape).total
    return dense_flops(tree.lengths, shape).total / tree_total if tree_total else 1.0
