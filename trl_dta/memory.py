"""Peak memory of a DTA training step, per attention backend, from the shape of the model and the tree.

DTA trades recomputation of shared prefixes for a stack: at any moment of the walk it holds the keys/values of one
root-to-leaf path (`2 x layers x kv_heads x head_dim x bytes` per token: 147,456 bytes for Qwen3-8B in bf16), the
activations of the path's kept segments, and the activations of one forward. Where that peaks depends on the walk, so
the estimate consumes the op stream the engine's walk executes (`engine/ops.py`, the same budgets) and keeps the
worst forward:

```
         root ── prompt (P tokens, kept) ──┬── leaf 1 ┐
                                           ├── leaf 2 ├─ one forward of B sibling rows under a P-token path
                                           └── leaf B ┘
peak  =  path K/V (P)  +  kept graph (P)  +  B rows' activations  [+ B copies of the path's K/V with "sdpa"]
```

The `"sdpa"` attention backend concatenates `[path.expand(B) ; own]` in every layer, and SDPA saves that for its
backward: `B x P x` the per-token K/V (4.8 GB for a 2K-token prompt with 16 completions on Qwen3-8B). The two-part
backends hold the path once. Parameters, gradients, optimizer state and allocator slack are not counted.

Hybrid models (`ModelShape.recurrent_layers > 0`): keys/values only for the attention layers; the recurrent layers
hold per frame of the path (a segment or block) their states after it, a size independent of its length
([`state_bytes_per_frame`]), and the replay follows the hybrid schedule (no packed subtree rows, one-token internal
segments unshared, `engine/core.py`; one-token forwards after a path padded to two, `engine/ops.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .engine.ops import lockstep_batches, walk_ops
from .engine.schedule import Budgets, RowCost
from .flops import ModelShape, get_model_shape
from .tree import as_tree

__all__ = [
    "ATTN_BACKENDS",
    "DTYPE_BYTES",
    "MemoryEstimate",
    "activation_bytes_per_token",
    "kv_bytes_per_token",
    "peak_memory",
    "state_bytes_per_frame",
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
    """Bytes of keys and values of one token, all attention layers: `2 * layers * num_kv_heads * head_dim * bytes`.

    Args:
        shape (`str`, [`~trl_dta.flops.ModelShape`] or a `transformers` config): the model.
        dtype (`str`, *optional*, defaults to `"bf16"`): one of `DTYPE_BYTES`.
    """
    shape = get_model_shape(shape)
    return 2 * shape.n_attention_layers * shape.num_kv_heads * shape.head_dim * _dtype_bytes(dtype)


def activation_bytes_per_token(shape: str | ModelShape | Any, dtype: str = "bf16") -> int:
    """Bytes the forward of one token saves for its backward, all layers (the graph a training forward keeps).

    Per layer, the tensors a Hugging Face Llama/Qwen decoder layer saves, in the compute dtype: each RMSNorm's
    normalised input and output (`2 * 2 * hidden`), the post-RoPE q, k, v (`q + 2 kv` with `q = n_heads * head_dim`,
    `kv = n_kv_heads * head_dim`), the attention output and the o-projection's input (`2 q`), and the SwiGLU MLP's
    gate, up, activation and product (`4 * intermediate`); in float32, each RMSNorm's upcast input (`2 * hidden`) and
    the attention's log-sum-exp (`n_heads`). Plus the final norm (`hidden`, and `hidden` in float32); the LM head keeps
    only its input (its logits are recomputed in the backward). Small transients (one logit tile, one layer's
    gradients) are left out. The attention terms count for `attention_layers`, the MLP's for `mlp_layers`; a
    recurrent layer (hybrids) saves its projections' outputs, its convolution's output, its gated norm's input and
    output and its output projection's input in the compute dtype, and in float32 the chunked scan's upcast inputs,
    three chunk-local `(C, C)` matrices per head (`3 C` per token and head) and the state at every chunk boundary
    (a `(d_k, d_v)` state per head every `C` tokens).

    Args:
        shape (`str`, [`~trl_dta.flops.ModelShape`] or a `transformers` config): the model.
        dtype (`str`, *optional*, defaults to `"bf16"`): the compute dtype, one of `DTYPE_BYTES`.
    """
    shape = get_model_shape(shape)
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    size = _dtype_bytes(dtype)
    norms = size * 4 * h + 4 * 2 * h
    attention = size * (q + 2 * kv + 2 * q) + 4 * shape.num_heads
    mlp = size * 4 * i
    return (shape.num_layers * norms + shape.n_attention_layers * attention + shape.n_mlp_layers * mlp
            + shape.recurrent_layers * _recurrent_activation_bytes(shape, size) + size * h + 4 * h)


def _recurrent_activation_bytes(shape: ModelShape, size: int) -> int:
    """Bytes one recurrent layer saves per token (see [`activation_bytes_per_token`])."""
    if not shape.recurrent_layers:
        return 0
    heads, groups, dk, dv, c = (shape.recurrent_heads, shape.recurrent_groups, shape.recurrent_key_dim,
                                shape.recurrent_value_dim, shape.chunk_size)
    if shape.recurrent_kind == "gated_deltanet":
        conv, inner, extra = 2 * groups * dk + heads * dv, heads * dv, 2 * heads
        upcast = 2 * heads * dk + heads * dv + 2 * heads  # q, k repeated to the value heads; v; beta; decay
    else:  # Mamba2: dk = state N, dv = head channels P
        inner = heads * dv
        conv, extra = inner + 2 * groups * dk, heads
        upcast = inner + 2 * heads * dk + heads  # x; B, C repeated to the heads; dt
    own = size * ((conv + inner + extra) + conv + 2 * inner + inner)
    return own + 4 * (upcast + 3 * heads * c + heads * dk * dv // c)


def state_bytes_per_frame(shape: str | ModelShape | Any, dtype: str = "bf16") -> int:
    """Bytes of the recurrent layers' states after one frame of the path, all recurrent layers (0 for attention-only
    models): each layer's recurrent state `(heads, d_k, d_v)` in float32 and its conv state `(channels, k - 1)` in
    `dtype`.

    Args:
        shape (`str`, [`~trl_dta.flops.ModelShape`] or a `transformers` config): the model.
        dtype (`str`, *optional*, defaults to `"bf16"`): the compute dtype, one of `DTYPE_BYTES`.
    """
    shape = get_model_shape(shape)
    if not shape.recurrent_layers:
        return 0
    heads, groups, dk, dv = shape.recurrent_heads, shape.recurrent_groups, shape.recurrent_key_dim, \
        shape.recurrent_value_dim
    conv = (2 * groups * dk + heads * dv) if shape.recurrent_kind == "gated_deltanet" else heads * dv + 2 * groups * dk
    return shape.recurrent_layers * (4 * heads * dk * dv + _dtype_bytes(dtype) * conv * (shape.conv_kernel - 1))


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
        row_tokens (`int`): padded tokens of the peak forward (`rows x` its longest row; a hybrid's one-token rows
            after a path are padded to two, as the walk forwards them).
        path_kv (`int`): the stack's keys/values of the path and their gradient buffers (gradient sinks, float32
            for half precision), held once whatever the backend; for a hybrid model also the recurrent states of the
            path's frames and their gradient buffers (`2 x frames x state_bytes_per_frame`).
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
    max_pack_tokens: int | None = None,
    block_size: int = 1024,
    lockstep: int | None = None,
    row_cost: RowCost | str = "cuda",
) -> MemoryEstimate:
    """Estimated peak memory of a DTA training step on a batch, per attention backend.

    The walk of [`~trl_dta.DTAEngine`] is replayed from the op stream it executes (`engine/ops.py`, the same
    budgets; in lockstep, FSDP2's per-layer schedule, its packed root subtrees and idle batches): at every forward
    with grad (a batch of sibling rows, a kept segment, a recomputed block) the memory is

    ```
    path_kv            2 x path_tokens x kv_bytes_per_token(sink dtype)     keys/values on the stack + their gradients
                     + 2 x frames x state_bytes_per_frame(sink dtype)       hybrids: the path's recurrent states
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
        row_cost (`RowCost` or `str`, *optional*, defaults to `"cuda"`): the cost model that lays out the rows and
            decides which branching subtrees the walk packs (`engine/schedule.py`; with `max_pack_tokens=None`): a
            device type (`"cuda"`, `"cpu"` with one thread), priced for `shape`, or the engine's own
            (`DTAEngine.row_cost()`), so that the replay follows that engine's schedule.
        lockstep (`int`, *optional*): the walk in lockstep (`DTAEngine.lockstep`, FSDP2's `"layer"` schedule): the
            number of row batches the processes agreed on (their largest count, at least this batch's own,
            `engine.ops.lockstep_batches`); the batches beyond this batch's are idle. Refused for a hybrid model.

    Returns:
        [`MemoryEstimate`]: the breakdown at the peak (all zeros for an empty batch).
    """
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {sorted(ATTN_BACKENDS)}")
    shape = get_model_shape(shape)
    size = _dtype_bytes(dtype)
    hybrid = shape.recurrent_layers > 0
    cost = RowCost.from_shape(shape, row_cost) if isinstance(row_cost, str) else row_cost
    budgets = Budgets(block_size=block_size, max_batch_tokens=max_batch_tokens, max_graph_tokens=max_graph_tokens,
                      max_pack_tokens=0 if hybrid else max_pack_tokens, lm_head_chunk_size=1, cost=cost)
    kv = kv_bytes_per_token(shape, dtype)
    sink = kv_bytes_per_token(shape, "fp32") if size < 4 else kv
    states = state_bytes_per_frame(shape, "fp32" if size < 4 else dtype)
    act = activation_bytes_per_token(shape, dtype)
    copies = ATTN_BACKENDS[backend]

    def estimate(path: int, graph: int, rows: int, row_tokens: int, frames: int) -> MemoryEstimate:
        return MemoryEstimate(backend=backend, dtype=dtype, path_tokens=path, graph_tokens=graph, rows=rows,
                              row_tokens=row_tokens, path_kv=2 * path * sink + 2 * frames * states,
                              path_graph=graph * act, batch_activations=row_tokens * act,
                              prefix_copies=rows * path * kv if copies and path else 0)

    best = estimate(0, 0, 0, 0, 0)
    tree = as_tree(tree_or_seqs)
    if hybrid:
        tree = tree.unshared(min_length=2)
    if lockstep is not None:
        if hybrid:
            raise ValueError("peak_memory: `lockstep` with a hybrid model (recurrent layers), which the engine refuses "
                             "to run in lockstep; leave `lockstep=None`.")
        own = len(lockstep_batches(tree, budgets, train=True))
        if isinstance(lockstep, bool) or not isinstance(lockstep, int) or lockstep < own:
            raise ValueError(f"peak_memory: `lockstep` is the number of row batches the processes agreed on, at least "
                             f"this batch's own {own} (`engine.ops.lockstep_batches`), got {lockstep!r}.")
    for forward in _grad_forwards(tree, budgets, hybrid=hybrid, lockstep=lockstep):
        candidate = estimate(*forward)
        if candidate.total > best.total:
            best = candidate
    return best


def _grad_forwards(tree, budgets, hybrid: bool = False, lockstep: int | None = None):
    """Yield `(path_tokens, graph_tokens, rows, row_tokens, frames)` for every forward with grad of the engine's
    training walk: the op stream the walk executes (`engine/ops.py`; `hybrid`: a hybrid model's walk; `lockstep`: the
    agreed number of row batches), `frames` being the stack's frames under the forward."""
    for op in walk_ops(tree, budgets, train=True, hybrid=hybrid, lockstep=lockstep):
        for f in op.forwards:
            if f.grad:
                yield f.path_tokens, f.graph_tokens, f.rows, f.row_tokens, f.frames
