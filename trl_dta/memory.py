"""Peak memory of a DTA training step, per attention backend, from the shape of the model and the tree.

DTA trades recomputation of shared prefixes for a stack: at any moment of the walk it holds the keys/values of one
root-to-leaf path (`2 x layers x kv_heads x head_dim x bytes` per token: 147,456 bytes for Qwen3-8B in bf16), the
activations of the path's kept segments, and the activations of one forward. Where that peaks depends on the walk, so
the estimate replays the engine's own schedule (`engine/schedule.py`, the same budgets) and keeps the worst forward:

```
         root ── prompt (P tokens, kept) ──┬── leaf 1 ┐
                                           ├── leaf 2 ├─ one forward of B sibling rows under a P-token path
                                           └── leaf B ┘
peak  =  path K/V (P)  +  kept graph (P)  +  B rows' activations  [+ B copies of the path's K/V with "sdpa"]
```

The `"sdpa"` attention backend concatenates `[path.expand(B) ; own]` in every layer, and SDPA saves that for its
backward: `B x P x` the per-token K/V (4.8 GB for a 2K-token prompt with 16 completions on Qwen3-8B). The two-part
backends hold the path once. Parameters, gradients, optimizer state and allocator slack are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .engine.schedule import Budgets, graph_fits, schedule_children
from .flops import ModelShape, _as_tree, get_model_shape


__all__ = [
    "ATTN_BACKENDS",
    "DTYPE_BYTES",
    "MemoryEstimate",
    "activation_bytes_per_token",
    "kv_bytes_per_token",
    "peak_memory",
]

DTYPE_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}

# Attention backends (`DTAEngine(attn_backend=...)`) -> whether a batch of B sibling rows saves B copies of the path's
# keys/values for its backward. "sdpa" concatenates `[path.expand(B) ; own]` per layer and SDPA saves the result; the
# two-part backends attend the path once (all rows' queries folded into one sequence) and merge by log-sum-exp.
ATTN_BACKENDS = {"sdpa": True, "torch": False, "flash": False, "triton": False}


def _dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]



def kv_bytes_per_token(shape: str | ModelShape | Any, dtype: str = "bf16") -> int:
    """Bytes of keys and values of one token, all layers: `2 * num_layers * num_kv_heads * head_dim * bytes`.

    Args:
        shape (`str`, [`~trl_dta.flops.ModelShape`] or a `transformers` config): the model.
        dtype (`str`, *optional*, defaults to `"bf16"`): one of `DTYPE_BYTES`.
    """
    shape = get_model_shape(shape)
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * _dtype_bytes(dtype)


def activation_bytes_per_token(shape: str | ModelShape | Any, dtype: str = "bf16") -> int:
    """Bytes the forward of one token saves for its backward, all layers (the graph a training forward keeps).

    Per layer, the tensors a Hugging Face Llama/Qwen decoder layer saves, in the compute dtype: each RMSNorm's
    normalised input and output (`2 * 2 * hidden`), the post-RoPE q, k, v (`q + 2 kv` with `q = n_heads * head_dim`,
    `kv = n_kv_heads * head_dim`), the attention output and the o-projection's input (`2 q`), and the SwiGLU MLP's
    gate, up, activation and product (`4 * intermediate`); in float32, each RMSNorm's upcast input (`2 * hidden`) and
    the attention's log-sum-exp (`n_heads`). Plus the final norm (`hidden`, and `hidden` in float32); the LM head keeps
    only its input (its logits are recomputed in the backward). Small transients (one logit tile, one layer's
    gradients) are left out.

    Args:
        shape (`str`, [`~trl_dta.flops.ModelShape`] or a `transformers` config): the model.
        dtype (`str`, *optional*, defaults to `"bf16"`): the compute dtype, one of `DTYPE_BYTES`.
    """
    shape = get_model_shape(shape)
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    size = _dtype_bytes(dtype)
    per_layer = size * (4 * h + q + 2 * kv + 2 * q + 4 * i) + 4 * (2 * h + shape.num_heads)
    return shape.num_layers * per_layer + size * h + 4 * h


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
    the two-part backends (`"torch"`, `"flash"`, `"triton"`) remove. Per-token sizes: [`kv_bytes_per_token`] and
    [`activation_bytes_per_token`]. Not counted: parameters, gradients and optimizer state, the LM
    head's logit tile, allocator slack.

    Example: a 4K-token prompt with 64 leaves of 512 tokens on Qwen3-8B in bf16 (147,456 bytes of K/V per token,
    6.96 MB of activations per token). With the default budgets the prompt's graph is kept and the leaves run in 4
    batches of 16 rows; each batch of 16 saves 16 copies of the prompt's K/V with `"sdpa"`, 64 when all leaves run in
    one forward:

    ```python
    >>> from trl_dta.memory import peak_memory
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
        shape (`str`, [`~trl_dta.flops.ModelShape`] or a `transformers` config): the model.
        backend (`str`, *optional*, defaults to `"sdpa"`): one of `ATTN_BACKENDS`.
        dtype (`str`, *optional*, defaults to `"bf16"`): compute dtype, one of `DTYPE_BYTES`.
        max_batch_tokens, max_graph_tokens, max_pack_tokens, block_size: the engine's budgets (see
            [`~trl_dta.DTAEngine`]).

    Returns:
        [`MemoryEstimate`]: the breakdown at the peak (all zeros for an empty batch).
    """
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {sorted(ATTN_BACKENDS)}")
    shape = get_model_shape(shape)
    size = _dtype_bytes(dtype)
    budgets = Budgets(block_size=block_size, max_batch_tokens=max_batch_tokens, max_graph_tokens=max_graph_tokens,
                      max_pack_tokens=max_pack_tokens, lm_head_chunk_size=1)
    kv = kv_bytes_per_token(shape, dtype)
    sink = kv_bytes_per_token(shape, "fp32") if size < 4 else kv
    act = activation_bytes_per_token(shape, dtype)
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
