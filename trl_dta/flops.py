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
    """

    hidden_size: int = field(metadata={"help": "Width of the residual stream."})
    intermediate_size: int = field(metadata={"help": "Width of the (SwiGLU) MLP."})
    num_layers: int = field(metadata={"help": "Number of decoder layers."})
    num_heads: int = field(metadata={"help": "Number of query heads."})
    num_kv_heads: int = field(metadata={"help": "Number of key/value heads."})
    head_dim: int = field(metadata={"help": "Width of one attention head."})
    vocab_size: int = field(metadata={"help": "Rows of the LM head."})
    name: str = field(default="custom", metadata={"help": "A label for tables."})

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
        )

    def to_dict(self) -> dict:
        return asdict(self)

    # ------------------------------------------------------------------ per-token forward FLOPs

    @property
    def linear_flops_per_token(self) -> int:
        """Forward matmul FLOPs of all layers' projections and MLPs for one token."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        h = self.hidden_size
        per_layer = 2 * h * (q + 2 * kv) + 2 * q * h + 6 * h * self.intermediate_size
        return self.num_layers * per_layer

    @property
    def attention_flops_per_key(self) -> int:
        """Forward FLOPs of QK^T and AV, all layers, for one (query, key) pair."""
        return self.num_layers * 4 * self.num_heads * self.head_dim

    @property
    def lm_head_flops_per_position(self) -> int:
        """Forward FLOPs of the LM head for one projected position."""
        return 2 * self.hidden_size * self.vocab_size


MODEL_SHAPES: dict[str, ModelShape] = {
    # Qwen/Qwen3-1.7B config.json
    "qwen3-1.7b": ModelShape(2048, 6144, 28, 16, 8, 128, 151936, name="qwen3-1.7b"),
    # Qwen/Qwen3-0.6B config.json (tied embeddings, as 1.7B)
    "qwen3-0.6b": ModelShape(1024, 3072, 28, 16, 8, 128, 151936, name="qwen3-0.6b"),
    # Qwen/Qwen3-8B config.json (36 layers, 8 KV heads of 128: 147,456 bytes of bf16 K/V per token)
    "qwen3-8b": ModelShape(4096, 12288, 36, 32, 8, 128, 151936, name="qwen3-8b"),
    # Qwen/Qwen2-0.5B config.json
    "qwen2-0.5b": ModelShape(896, 4864, 24, 14, 2, 64, 151936, name="qwen2-0.5b"),
    # The CPU benchmark's Qwen2-shaped model with random weights (benchmarks/common.py builds it from this shape).
    "bench-cpu": ModelShape(512, 1408, 8, 8, 2, 64, 8192, name="bench-cpu"),
    # The `--quick` benchmark model.
    "bench-cpu-quick": ModelShape(256, 704, 4, 4, 2, 64, 4096, name="bench-cpu-quick"),
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
    shape = get_model_shape(shape)
    tree = _as_tree(tree)
    tokens, keys, positions = _tree_counts(tree)
    return _count(shape, tokens, keys, positions, training)


def ideal_ratio(seqs_or_tree, shape: str | ModelShape | Any) -> float:
    """Ideal training speed-up of tree over dense (unpadded) execution: `dense_flops / tree_flops`.

    Args:
        seqs_or_tree (list of sequences or [`~trl_dta.PrefixTree`]): the batch.
        shape (`str`, [`ModelShape`] or a `transformers` config): the model.
    """
    tree = _as_tree(seqs_or_tree)
    tree_total = tree_flops(tree, shape).total
    return dense_flops(tree.lengths, shape).total / tree_total if tree_total else 1.0


def _as_tree(seqs_or_tree):
    if hasattr(seqs_or_tree, "segments") and hasattr(seqs_or_tree, "lengths"):
        return seqs_or_tree
    from .tree import PrefixTree  # torch-only import, kept local so that `flops` loads without torch

    return PrefixTree.from_sequences(list(seqs_or_tree))
