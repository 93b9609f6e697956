"""Analytic FLOP counts for dense and tree execution of a decoder-only transformer, and DTA's peak memory.

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

**Peak memory** (`peak_memory`): DTA holds the keys/values of one root-to-leaf path (`2 x layers x kv_heads x
head_dim x bytes` per token: 147,456 bytes for Qwen3-8B in bf16) plus the activations of the path's kept segments and
of one forward. The `"sdpa"` attention backend also saves, for a forward of `B` sibling rows under a `P`-token path,
`B` copies of the path's keys/values in every layer (`B x P x` the per-token K/V: 4.8 GB for a 2K-token prompt with
16 completions on Qwen3-8B); the two-part backends hold the path once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


__all__ = [
    "ATTN_BACKENDS",
    "DTYPE_BYTES",
    "MODEL_SHAPES",
    "FlopCount",
    "MemoryEstimate",
    "ModelShape",
    "dense_flops",
    "get_model_shape",
    "ideal_ratio",
    "padded_dense_flops",
    "peak_memory",
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

    # ------------------------------------------------------------------ per-token memory

    def kv_bytes_per_token(self, dtype: str = "bf16") -> int:
        """Bytes of keys and values of one token, all layers: `2 * num_layers * num_kv_heads * head_dim * bytes`."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _dtype_bytes(dtype)

    def activation_bytes_per_token(self, dtype: str = "bf16") -> int:
        """Bytes the forward of one token saves for its backward, all layers (the graph a training forward keeps).

        Per layer, the tensors a Hugging Face Llama/Qwen decoder layer saves, in the compute dtype: each RMSNorm's
        normalised input and output (`2 * 2 * hidden`), the post-RoPE q, k, v (`q + 2 kv` with `q = n_heads *
        head_dim`, `kv = n_kv_heads * head_dim`), the attention output and the o-projection's input (`2 q`), and
        the SwiGLU MLP's gate, up, activation and product (`4 * intermediate`); in float32, each RMSNorm's upcast
        input (`2 * hidden`) and the attention's log-sum-exp (`n_heads`). Plus the final norm (`hidden`, and
        `hidden` in float32); the LM head keeps only its input (its logits are recomputed in the backward). Small
        transients (one logit tile, one layer's gradients) are left out.
        """
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        size = _dtype_bytes(dtype)
        per_layer = size * (4 * h + q + 2 * kv + 2 * q + 4 * i) + 4 * (2 * h + self.num_heads)
        return self.num_layers * per_layer + size * h + 4 * h


MODEL_SHAPES: dict[str, ModelShape] = {
    # Qwen/Qwen3-1.7B config.json
    "qwen3-1.7b": ModelShape(2048, 6144, 28, 16, 8, 128, 151936, name="qwen3-1.7b"),
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


# ---------------------------------------------------------------------------------------------------- peak memory

DTYPE_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}

# Attention backends (`DTAEngine(attn_backend=...)`) -> whether a batch of B sibling rows saves B copies of the path's
# keys/values for its backward. "sdpa" concatenates `[path.expand(B) ; own]` per layer and SDPA saves the result; the
# two-part backends attend the path once (all rows' queries folded into one sequence) and merge by log-sum-exp.
ATTN_BACKENDS = {"sdpa": True, "torch": False, "flash": False, "triton": False}


def _dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclass
class MemoryEstimate:
    """Peak memory of one DTA training step (`DTAEngine.forward_backward`) above the model, optimizer and gradients,
    in bytes, split by what holds it, at the forward where the sum peaks.

    Args:
        backend (`str`): the attention backend.
        dtype (`str`): compute dtype of the model.
        path_tokens (`int`): tokens of the path the peak forward runs under (its keys/values sit on the stack).
        graph_tokens (`int`): tokens of the path whose autograd graph is kept at that point.
        rows (`int`): rows of the peak forward (a batch of siblings, or one segment or block).
        row_tokens (`int`): padded tokens of the peak forward (`rows x` its longest row).
        path_kv (`int`): the stack's keys/values of the path and their gradient buffers (gradient sinks, float32
            for half precision), held once whatever the backend.
        path_graph (`int`): activations of the path's kept segments.
        batch_activations (`int`): activations of the peak forward.
        prefix_copies (`int`): the copies of the path's keys/values that the forward saves for its backward: one per
            row in every layer with `"sdpa"`, none with a two-part backend.
    """

    backend: str
    dtype: str
    path_tokens: int
    graph_tokens: int
    rows: int
    row_tokens: int
    path_kv: int
    path_graph: int
    batch_activations: int
    prefix_copies: int

    @property
    def total(self) -> int:
        return self.path_kv + self.path_graph + self.batch_activations + self.prefix_copies


def peak_memory(
    tree_or_seqs,
    shape: str | ModelShape | Any,
    backend: str = "sdpa",
    dtype: str = "bf16",
    *,
    max_batch_tokens: int = 8192,
    max_graph_tokens: int | None = None,
    max_pack_tokens: int = 1024,
    block_size: int = 1024,
) -> MemoryEstimate:
    """Estimated peak memory of a DTA training step on a batch, per attention backend.

    The walk of [`~trl_dta.DTAEngine`] is replayed with the engine's own schedule (`engine/schedule.py`, the same
    budgets): at every forward with grad (a batch of sibling rows, a kept segment, a recomputed block) the memory is

    ```
    path_kv            2 x path_tokens x kv_bytes_per_token(sink dtype)     keys/values on the stack + their gradients
    path_graph         graph_tokens x activation_bytes_per_token            kept segments of the path
    batch_activations  row_tokens x activation_bytes_per_token              the forward itself
    prefix_copies      rows x path_tokens x kv_bytes_per_token(dtype)       "sdpa" only: [path.expand(rows) ; own]
    ```

    and the estimate is the forward where the sum peaks. The `"sdpa"` copies grow with siblings x prefix, which is what
    the two-part backends (`"torch"`, `"flash"`, `"triton"`) remove. Per-token sizes: [`ModelShape.kv_bytes_per_token`]
    and [`ModelShape.activation_bytes_per_token`]. Not counted: parameters, gradients and optimizer state, the LM
    head's logit tile, allocator slack.

    Example: a 4K-token prompt with 64 leaves of 512 tokens on Qwen3-8B in bf16 (147,456 bytes of K/V per token,
    6.96 MB of activations per token). With the default budgets the prompt's graph is kept and the leaves run in 4
    batches of 16 rows; each batch of 16 saves 16 copies of the prompt's K/V with `"sdpa"`, 64 when all leaves run in
    one forward:

    ```python
    >>> from trl_dta.flops import peak_memory
    >>> seqs = [[0] * 4096 + [1 + leaf] * 512 for leaf in range(64)]
    >>> for backend, batch in (("sdpa", 8192), ("flash", 8192), ("sdpa", 32768)):
    ...     m = peak_memory(seqs, "qwen3-8b", backend, max_batch_tokens=batch)
    ...     print(backend, m.rows, f"copies {m.prefix_copies / 1e9:.2f} GB, total {m.total / 1e9:.1f} GB")
    sdpa 16 copies 9.66 GB, total 97.6 GB
    flash 16 copies 0.00 GB, total 87.9 GB
    sdpa 64 copies 38.65 GB, total 297.6 GB

    ```

    Args:
        tree_or_seqs ([`~trl_dta.PrefixTree`] or a list of sequences): the batch.
        shape (`str`, [`ModelShape`] or a `transformers` config): the model.
        backend (`str`, *optional*, defaults to `"sdpa"`): one of `ATTN_BACKENDS`.
        dtype (`str`, *optional*, defaults to `"bf16"`): compute dtype, one of `DTYPE_BYTES`.
        max_batch_tokens, max_graph_tokens, max_pack_tokens, block_size: the engine's budgets (see
            [`~trl_dta.DTAEngine`]).

    Returns:
        [`MemoryEstimate`]: the breakdown at the peak (all zeros for an empty batch).
    """
    from .engine.schedule import Budgets  # the engine's own schedule: torch-free, like this module

    if backend not in ATTN_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {sorted(ATTN_BACKENDS)}")
    shape = get_model_shape(shape)
    size = _dtype_bytes(dtype)
    budgets = Budgets(block_size=block_size, max_batch_tokens=max_batch_tokens, max_graph_tokens=max_graph_tokens,
                      max_pack_tokens=max_pack_tokens, lm_head_chunk_size=1)
    kv = shape.kv_bytes_per_token(dtype)
    sink = shape.kv_bytes_per_token("fp32") if size < 4 else kv
    act = shape.activation_bytes_per_token(dtype)
    copies = ATTN_BACKENDS[backend]

    def estimate(path: int, graph: int, rows: int, row_tokens: int) -> MemoryEstimate:
        return MemoryEstimate(backend=backend, dtype=dtype, path_tokens=path, graph_tokens=graph, rows=rows,
                              row_tokens=row_tokens, path_kv=2 * path * sink, path_graph=graph * act,
                              batch_activations=row_tokens * act,
                              prefix_copies=rows * path * kv if copies and path else 0)

    best = estimate(0, 0, 0, 0)
    for forward in _grad_forwards(_as_tree(tree_or_seqs), budgets):
        candidate = estimate(*forward)
        if candidate.total > best.total:
            best = candidate
    return best


def _grad_forwards(tree, budgets):
    """Yield `(path_tokens, graph_tokens, rows, row_tokens)` for every forward with grad of the engine's training walk
    (the same decisions as `engine/walk.py`: rows batches, kept segments, blocks re-forwarded at pop)."""
    from .engine.schedule import graph_fits, schedule_children

    subtree_tokens = tree.subtree_tokens()
    has_children = [bool(seg.children) for seg in tree.segments]
    block = budgets.block_size

    def blocks(path: int, graph: int, length: int):
        for lo in range(0, length, block):  # re-forwarded with grad at pop, each after the earlier blocks' keys
            yield path + lo, graph, 1, min(block, length - lo)

    def children(kids: list[int], path: int, graph: int):
        plan = schedule_children(kids, has_children, subtree_tokens, budgets, train=True, live=graph)
        for kind, batch in plan.steps:
            if kind == "rows":  # sorted by size: the last row is the longest
                yield path, graph, len(batch), len(batch) * subtree_tokens[batch[-1]]
            else:
                yield from blocks(path, graph, tree.segments[batch[0]].length)
        for c in plan.walk:
            length = tree.segments[c].length
            if graph_fits(budgets, True, graph, length):
                yield path, graph, 1, length
                yield from children(tree.segments[c].children, path + length, graph + length)
            else:
                yield from children(tree.segments[c].children, path + length, graph)
                yield from blocks(path, graph, length)

    yield from children(tree.roots, 0, 0)
