"""The attention function a [`~generation.PrefixCache`] forward registers: new tokens over shared nodes, the rows' own
cached keys and themselves, merged by log-sum-exp.

For a batch of `B` rows with `w` new tokens each, at layer `l` (after RoPE, as transformers hands them over):

```
query (B, H, w, D) ─┬─ node parts: for each node on the rows' paths, the queries of the rows below it folded into
                    │             (1, H, rows * w, D), over the node's (1, H_kv, n, D): no mask (every node key is
                    │             earlier than every new query), except where a sliding window cuts into it
                    ├─ cached own: (B, H_kv, K, D) padded to the longest row, key padding `j < cached[b]`
                    └─ new:        the batch's own (B, H_kv, w, D), causal (the square bottom-right mask)
merge (float32, float64 for float64 inputs): lse = logaddexp over parts, out = sum_p exp(lse_p - lse) out_p
```

Every new query sees at least its own key, so the merged log-sum-exp is finite. The parts run on `kernels.attend_part`
and merge by `kernels.merge_parts` (the two-part attention's merge), on the part kernels of `kernels.torch_parts`
(aten's fused CPU kernel, which takes the key-padding mask broadcast over queries, or the
`math` kernel for soft-capping and masked parts on CUDA), in the dtype SDPA would compute in here
(`precision.attention_inputs`: under autocast the autocast dtype). The new keys/values are stored in the rows' buffer
(`PrefixCache.write`) in the dtypes the layer produced them.
"""

from __future__ import annotations

import torch

from ..kernels import attend_part, merge_parts
from ..kernels.masks import PartMask
from ..modeling.attention import IGNORED_KWARGS
from ..precision import acc_dtype, attention_inputs
from ..refusal import Blocker, refuse

ATTN_IMPLEMENTATION = "dta_generate"


class GenerationBatch:
    """What one forward of a [`~generation.PrefixCache`] hands its attention layers (through the forward's kwargs; a
    plain object, as `attention.AttentionContext`).

    Args:
        cache (`PrefixCache`): the cache (the rows' buffer).
        slots (`torch.LongTensor` of shape `(B,)`): the rows' buffer slots.
        cached (`torch.LongTensor` of shape `(B,)`): own tokens already cached per row.
        offsets (`torch.LongTensor` of shape `(B,)`): position of each row's first own token.
        positions (`torch.LongTensor` of shape `(B, w)`): the new tokens' positions.
        nodes (`list[tuple[Node, torch.LongTensor | None]]`): the nodes on the rows' paths and the batch indices of
            the rows below each (None: every row).
    """

    __slots__ = ("cache", "slots", "cached", "offsets", "positions", "nodes", "calls")

    def __init__(self, cache, slots, cached, offsets, positions, nodes):
        self.cache, self.slots, self.cached, self.offsets = cache, slots, cached, offsets
        self.positions, self.nodes = positions, nodes
        self.calls = 0

    def __repr__(self) -> str:
        return f"GenerationBatch(rows={len(self.slots)}, width={self.positions.shape[1]}, nodes={len(self.nodes)})"


def _merge(out, lse, out_p, lse_p):
    """Log-sum-exp merge of a part into the running `(out, lse)` (accumulation dtype)."""
    return merge_parts([(out, lse), (out_p, lse_p.to(lse.dtype))])


def generation_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dta_gen: GenerationBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of the batch's new tokens over their rows' whole prefixes (module docstring).

    Args:
        query (`torch.Tensor` of shape `(B, n_heads, w, head_dim)`), key, value (`(B, n_kv_heads, w, head_dim)`): the
            new tokens'.
        dta_gen (`GenerationBatch`): the cache's batch (passed through the model's forward kwargs).

    Returns:
        `(output (B, w, n_heads, head_dim), None)`.
    """
    if dta_gen is None:
        raise RuntimeError(f"the model reached the '{ATTN_IMPLEMENTATION}' attention outside a PrefixCache forward "
                           "(use 'sdpa' or 'eager' as the model's attention implementation).")
    unknown = {k for k, v in kwargs.items() if v is not None and k not in IGNORED_KWARGS}
    if unknown or dropout:
        refuse(f"{type(module).__name__} in the generation cache", [Blocker(
            f"it passes {sorted(unknown) or 'attention dropout'} to its attention function, which the generation "
            "cache does not implement", fix="generate without it (`generation_cache=False`)")], alternative="")
    layer, batch, cache = module.layer_idx, dta_gen, dta_gen.cache
    batch.calls += 1
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    longest = int(batch.cached.max())
    own = cache.own(layer, batch.slots, longest)  # before the write: (B, H_kv, K, D) each, or None
    cache.write(layer, batch.slots, batch.cached, key, value)
    own_key, own_value = own if own is not None else (None, None)
    query, key, value, own_key, own_value = attention_inputs(query, key, value, own_key, own_value)
    window = sliding_window
    positions = batch.positions  # (B, w)
    with torch.autocast(query.device.type, enabled=False):
        new_mask = PartMask(causal=True) if window is None else \
            PartMask(causal=True, q_pos=positions, k_pos=positions, window=window)
        out, lse = attend_part(query, key, value, new_mask, scale, softcap)  # (B, H, w, D), (B, H, w)
        acc = acc_dtype(query.dtype)
        out, lse = out.to(acc), lse.to(acc)
        if own is not None:
            padded = None if bool((batch.cached == longest).all()) else batch.cached
            k_pos = batch.offsets[:, None] + torch.arange(longest, device=query.device)  # (B, K)
            own_mask = PartMask(key_length=padded) if window is None else \
                PartMask(key_length=padded, q_pos=positions, k_pos=k_pos, window=window)
            out, lse = _merge(out, lse, *attend_part(query, own_key.to(key.dtype), own_value.to(value.dtype), own_mask,
                                                     scale, softcap))
        for node, rows in batch.nodes:
            q = query if rows is None else query.index_select(0, rows)  # (b, H, w, D)
            mask = PartMask()
            if window is not None:
                q_pos = (positions if rows is None else positions.index_select(0, rows)).reshape(1, -1)
                mask = PartMask(q_pos=q_pos, k_pos=node.start + torch.arange(node.length, device=q.device)[None],
                                window=window)
            out_p, lse_p = attend_part(q, node.keys[layer].to(key.dtype), node.values[layer].to(value.dtype), mask,
                                       scale, softcap, folded=True)  # (b, H, w, D), (b, H, w)
            if rows is None:
                out, lse = _merge(out, lse, out_p, lse_p)
            else:
                merged = _merge(out.index_select(0, rows), lse.index_select(0, rows), out_p, lse_p)
                out, lse = out.index_copy(0, rows, merged[0]), lse.index_copy(0, rows, merged[1])
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


_REGISTERED = False


def register() -> str:
    """Registers the `"dta_generate"` attention with transformers (idempotent; no mask function: transformers then
    passes `attention_mask=None` and builds no dense mask)."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, generation_attention)
        _REGISTERED = True
    return ATTN_IMPLEMENTATION
