"""The attention function the engine registers with transformers.

While the engine runs, the model's `config._attn_implementation` is switched to `"dta"`, so every attention layer
calls [`dta_attention`] with the new tokens' query/key/value (after RoPE and any q/k norm). The new tokens continue
the path whose keys/values the engine holds on its stack, with a *bottom-right aligned* causal mask: query `i` of an
`L`-token block on a `P`-token path sees keys `0 .. P + i` (and, under a sliding window `w`, only keys `> P + i - w`,
the transformers convention). For `P = 2, L = 3`:

```
            keys:  p0 p1 | n0 n1 n2
  query n0:         1  1 |  1  0  0
  query n1:         1  1 |  1  1  0
  query n2:         1  1 |  1  1  1
```

A batch of sibling rows shares one path. The attention itself is [`trl_dta.kernels.two_part_attention`]: the path
part (every row's queries folded into one sequence over the path, stored once) and the rows' own part, merged by
log-sum-exp, so the path is never copied per row. Packed subtree rows describe their tree mask by `key_end` (one int
per key, pre-order intervals, see `kernels.masks`) and their tokens' depths. Rows are right-padded; padding sits
after every real key of its row, so no real query sees it.

Precision: the attention receives q, k, v in the dtypes the model produced them (under bf16 autocast: q, k float32
after RoPE, v bfloat16) and computes in the dtype autocast gives SDPA, the autocast dtype (`precision.py`): every
input, the path's keys/values included, is converted there once, and the kernels run with autocast off.

Backends (`DTAEngine(attn_backend=...)`), all exact (GQA without repeating keys, sliding windows, soft-capping,
attention sinks, padding; float64 where the device has it):

| backend  | device                  | path     | kernels                                     | `math` fallback for   |
|----------|-------------------------|----------|---------------------------------------------|-----------------------|
| `sdpa`   | CPU, CUDA               | B copies | SDPA over `[path ; own]`, one explicit mask | - (the reference)     |
| `torch`  | CPU                     | once     | aten CPU flash (float64/32/16, masks)       | soft-capping          |
| `torch`  | CUDA                    | once     | aten flash (16-bit, causal or no mask)      | fp32, packed, window  |
| `flash`  | CUDA, flash-attn >= 2.7 | once     | flash-attn (window, soft-cap)               | packed rows (`torch`) |
| `triton` | CUDA; CPU tests*        | once     | one interval-mask kernel pair, every part   | 16-bit under (*)      |
| `auto`   | `kernels.AUTO`          |          | CPU: `torch`; CUDA: `flash`, else `torch`   |                       |

(*) under `TRITON_INTERPRET=1`: slow, no bf16 (those parts run on `math`).

`math` is the plain-PyTorch part kernel: one part's scores materialised transiently, the path still stored once.
"""

from __future__ import annotations

import torch

from ..kernels import two_part_attention
from ..kv_stack import KVStack
from ..precision import attention_inputs
from ..refusal import Blocker, refuse

ATTN_IMPLEMENTATION = "dta"

# Keyword arguments the models pass to the attention function that do not change the attention itself.
IGNORED_KWARGS = frozenset(
    {"position_ids", "use_cache", "cache_position", "output_attentions", "is_causal", "layer_idx", "cache"}
)


class AttentionContext:
    """What one forward call of the model needs from (and gives back to) the engine.

    A plain object on purpose, not a dataclass: it travels through the model's forward kwargs, and FSDP2's pre-forward
    hook rebuilds every dataclass argument holding tensors that require grad (`dataclasses.replace`), so a dataclass
    would be copied at every layer once the stack holds a previous layer's keys/values and `record`/`calls` would be
    filled in copies the engine never sees. FSDP2 does not look inside other objects.

    Args:
        stack (`KVStack`): keys/values of the path the new tokens continue.
        record (`dict[int, tuple[Tensor, Tensor]]`): filled by the attention layers with the new tokens' keys and
            values, `(batch, n_kv_heads, length, head_dim)`, keyed by layer index.
        calls (`int`): number of attention calls made in this forward (checked against the layer count).
        positions (`torch.LongTensor` of shape `(batch, length)`, *optional*): packed subtree rows only: the new
            tokens' positions (depths). None: causal rows continuing the path.
        key_end (`torch.LongTensor` of shape `(batch, length)`, *optional*): packed subtree rows only, with
            `positions`: key `j` of a row is visible to the row's columns `j .. key_end[j] - 1` (pre-order intervals,
            see `kernels.masks`; the path's keys are visible to every token).
        backend (`str`, *optional*, defaults to `"sdpa"`): the attention backend, one of `kernels.BACKENDS`.
        spans (`tuple`, *optional*): shared rows (several subtrees side by side, `engine/rows.py`): per row, the
            `(lo, hi, tree)` column ranges no key is visible across (`kernels.two_part_attention`).
    """

    __slots__ = ("stack", "record", "calls", "positions", "key_end", "spans", "backend")

    def __init__(self, stack: KVStack, positions: torch.Tensor | None = None, key_end: torch.Tensor | None = None,
                 backend: str = "sdpa", spans: tuple | None = None):
        self.stack = stack
        self.record: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.calls = 0
        self.positions = positions
        self.key_end = key_end
        self.spans = spans
        self.backend = backend

    def __repr__(self) -> str:
        return (f"AttentionContext(path_len={self.stack.length}, calls={self.calls}, backend={self.backend!r}, "
                f"packed={self.positions is not None})")


def dta_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    dta_ctx: AttentionContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of the new tokens over `[path keys ; their row's keys]`, on the context's backend.

    Args:
        query (`torch.Tensor` of shape `(batch, n_heads, length, head_dim)`): new tokens' queries.
        key, value (`torch.Tensor` of shape `(batch, n_kv_heads, length, head_dim)`): new tokens' keys/values.
        s_aux (`torch.Tensor` of shape `(n_heads,)`, *optional*): attention sinks (GPT-OSS), one logit per head added
            to every query's softmax denominator; kept in its own dtype (float32 under autocast, as GPT-OSS's eager
            attention promotes it), see `kernels.two_part`.
        dta_ctx (`AttentionContext`): the engine's context (passed through the model's forward kwargs).

    Returns:
        `(output, None)` with output of shape `(batch, length, n_heads, head_dim)`.
    """
    if dta_ctx is None:
        raise RuntimeError(
            f"the model reached the '{ATTN_IMPLEMENTATION}' attention without a DTAEngine context. DTAEngine switches "
            "the model's attention to DTA for the duration of an engine call, so this forward of the model ran during "
            "an engine call (from inside `loss_fn`, or from another thread): run other forwards of the model before "
            "or after the engine call, not inside `loss_fn` or concurrently. (If you set "
            f"attn_implementation='{ATTN_IMPLEMENTATION}' yourself, use 'sdpa' or 'eager' instead.)"
        )
    blockers = []
    if dropout:
        blockers.append(Blocker(
            f"attention dropout ({dropout}) is active: DTA cannot reproduce random dropout masks of the dense path",
            fix="call `model.eval()`, or set `attention_dropout=0.0` in the model config"))
    unknown = {k for k, v in kwargs.items() if v is not None and k not in IGNORED_KWARGS}
    if unknown:
        blockers.append(Blocker(f"its attention layers pass {sorted(unknown)} to the attention function, which DTA "
                                "does not implement"))
    refuse(f"{type(module).__name__} (layer {module.layer_idx})", blockers)
    layer = module.layer_idx
    dta_ctx.calls += 1
    dta_ctx.record[layer] = (key, value)
    path_key, path_value = dta_ctx.stack.prefix(layer)  # (1, n_kv_heads, path_len, head_dim) or None
    # The dtype SDPA computes in here (the autocast dtype under autocast; see `precision.py`). Without autocast the
    # float32 gradient sinks of a half-precision model come back to the model's dtype (`key.dtype`).
    query, key, value, path_key, path_value = attention_inputs(query, key, value, path_key, path_value)
    if path_key is not None:
        path_key, path_value = path_key.to(key.dtype), path_value.to(value.dtype)
    with torch.autocast(query.device.type, enabled=False):  # the kernels run in their inputs' dtype, as SDPA's do
        out = two_part_attention(query, path_key, path_value, key, value, scaling=scaling,
                                 positions=dta_ctx.positions, key_end=dta_ctx.key_end, sliding_window=sliding_window,
                                 softcap=softcap, sinks=s_aux, spans=dta_ctx.spans,
                                 backend=dta_ctx.backend)  # (batch, n_heads, length, D)
    return out.transpose(1, 2).contiguous(), None  # two-part backends: already (batch, length, ...) in memory


_REGISTERED = False


def register() -> str:
    """Register the 'dta' attention with transformers; idempotent.

    No mask function is registered on purpose: for an implementation without one, transformers skips building the
    dense mask and passes `attention_mask=None`, and `dta_attention` builds its own.
    """
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, dta_attention)
        _REGISTERED = True
    return ATTN_IMPLEMENTATION

