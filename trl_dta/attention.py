"""The attention function the engine registers with transformers.

While the engine runs, the model's `config._attn_implementation` is switched to `"dta"`, so every attention layer
calls [`dta_attention`] with the new tokens' query/key/value (after RoPE and any q/k norm). The function appends the
path's cached keys/values in front of the new ones and attends with a *bottom-right aligned* causal mask: query `i`
of an `L`-token block on a `P`-token path sees keys `0 .. P + i` (and, under a sliding window `w`, only keys
`> P + i - w`, the transformers convention). For `P = 2, L = 3`:

```
            keys:  p0 p1 n0 n1 n2
  query n0:         1  1  1  0  0
  query n1:         1  1  1  1  0
  query n2:         1  1  1  1  1
```

A batch of sibling leaves shares one path: the path's keys are broadcast over the batch (`expand`, no copy until the
concatenation). The rows are right-padded; padding sits after every real key of its row, so causal masking already
hides it from real queries.

Backends: SDPA (CPU and GPU, GQA through `enable_gqa`), and an explicit softmax for logit soft-capping (Gemma 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .kv_stack import KVStack

ATTN_IMPLEMENTATION = "dta"

# Keyword arguments the models pass to the attention function that do not change the attention itself.
_IGNORED_KWARGS = frozenset(
    {"position_ids", "use_cache", "cache_position", "output_attentions", "is_causal", "layer_idx", "cache"}
)


@dataclass
class AttentionContext:
    """What one forward call of the model needs from (and gives back to) the engine.

    Args:
        stack (`KVStack`): keys/values of the path the new tokens continue.
        record (`dict[int, tuple[Tensor, Tensor]]`): filled by the attention layers with the new tokens' keys and values,
            `(batch, n_kv_heads, length, head_dim)`, keyed by layer index.
        calls (`int`): number of attention calls made in this forward (checked against the layer count).
        row_mask (`torch.BoolTensor` of shape `(batch, length, length)`, *optional*): for packed subtrees, which new
            tokens each new token sees (the path's keys are visible to every token). None: causal.
        positions (`torch.LongTensor` of shape `(batch, length)`, *optional*): the new tokens' positions, with
            `row_mask` (for sliding windows).
    """

    stack: KVStack
    record: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    calls: int = 0
    row_mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None


def _mask(q_len: int, prefix_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """Bottom-right aligned causal mask, `(q_len, prefix_len + q_len)` booleans (True = attend)."""
    q_pos = torch.arange(q_len, device=device).unsqueeze(1) + prefix_len
    k_pos = torch.arange(prefix_len + q_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _packed_mask(row_mask: torch.Tensor, positions: torch.Tensor, prefix_len: int,
                 sliding_window: int | None) -> torch.Tensor:
    """`(batch, 1, length, prefix_len + length)` mask for packed rows: every path key, then the row's own mask."""
    batch, length, _ = row_mask.shape
    prefix = torch.ones(batch, length, prefix_len, dtype=torch.bool, device=row_mask.device)
    mask = torch.cat([prefix, row_mask], dim=-1)
    if sliding_window is not None:
        k_pos = torch.cat([torch.arange(prefix_len, device=positions.device).expand(batch, -1), positions], dim=-1)
        mask = mask & (k_pos[:, None, :] > positions[:, :, None] - sliding_window)  # keeps the diagonal
    return mask[:, None]


def _sdpa(query, key, value, mask, scaling, is_causal):
    gqa = query.shape[1] != key.shape[1]
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=None if is_causal else mask, is_causal=is_causal, scale=scaling, enable_gqa=gqa
    )


def _softcapped(query, key, value, mask, scaling, softcap):
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    probs = torch.softmax(scores, dim=-1, dtype=acc).to(query.dtype)
    return torch.matmul(probs, value)


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
    dta_ctx: AttentionContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over `[path keys ; new keys]` for the new tokens.

    Args:
        query (`torch.Tensor` of shape `(batch, n_heads, length, head_dim)`): new tokens' queries.
        key, value (`torch.Tensor` of shape `(batch, n_kv_heads, length, head_dim)`): new tokens' keys/values.
        dta_ctx (`AttentionContext`): the engine's context (passed through the model's forward kwargs).

    Returns:
        `(output, None)` with output of shape `(batch, length, n_heads, head_dim)`.
    """
    if dta_ctx is None:
        raise RuntimeError(
            f"the model reached the '{ATTN_IMPLEMENTATION}' attention without a DTAEngine context. DTAEngine switches the "
            "model's attention to DTA for the duration of an engine call, so this forward of the model ran during "
            "an engine call (from inside `loss_fn`, or from another thread): run other forwards of the model before "
            "or after the engine call, not inside `loss_fn` or concurrently. (If you set "
            f"attn_implementation='{ATTN_IMPLEMENTATION}' yourself, use 'sdpa' or 'eager' instead.)"
        )
    if dropout:
        raise ValueError(
            f"attention dropout ({dropout}) is active: DTA cannot reproduce random dropout masks of the dense path. "
            "Call model.eval() or set `attention_dropout=0` in the model config."
        )
    unknown = {k for k, v in kwargs.items() if v is not None and k not in _IGNORED_KWARGS}
    if unknown:
        raise NotImplementedError(
            f"{type(module).__name__} passes {sorted(unknown)} to its attention function, which DTA does not "
            "implement; this model family is not supported."
        )
    layer = module.layer_idx
    dta_ctx.calls += 1
    dta_ctx.record[layer] = (key, value)
    batch, _, q_len, _ = query.shape
    prefix_k, prefix_v = dta_ctx.stack.prefix(layer)
    prefix_len = 0
    if prefix_k is not None:
        prefix_len = prefix_k.shape[2]
        prefix_k = prefix_k.to(key.dtype).expand(batch, -1, -1, -1)
        prefix_v = prefix_v.to(value.dtype).expand(batch, -1, -1, -1)
        key = torch.cat([prefix_k, key], dim=2)
        value = torch.cat([prefix_v, value], dim=2)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if dta_ctx.row_mask is not None:
        mask = _packed_mask(dta_ctx.row_mask, dta_ctx.positions, prefix_len, sliding_window)
        windowed = True  # never the plain causal shortcut
    else:
        windowed = sliding_window is not None and prefix_len + q_len > sliding_window
        mask = _mask(q_len, prefix_len, sliding_window if windowed else None, query.device)
    if softcap is not None:
        out = _softcapped(query, key, value, mask, scaling, softcap)
    else:
        out = _sdpa(query, key, value, mask, scaling, is_causal=prefix_len == 0 and not windowed)
    return out.transpose(1, 2).contiguous(), None


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

