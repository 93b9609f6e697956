"""The concatenating reference backend ("sdpa"): `[path.expand(batch) ; own]` keys and one explicit boolean mask.

This is how `dta_attention` attended before the two-part op: simple, any mask, autograd through SDPA (or through an
explicit softmax for logit soft-capping), but it holds `batch` copies of the path's keys/values per layer and SDPA
saves them for backward. Kept to compare the two-part backends against, in tests and benchmarks. Query `i` of a row
sees path key `p` when `p > pos_i - window` and own key `j` under the causal or tree mask (see `masks`):

```
            keys:  p0 p1 | n0 n1 n2
  query n0:         1  1 |  1  0  0
  query n1:         1  1 |  1  1  0
  query n2:         1  1 |  1  1  1
```
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..precision import acc_dtype
from .masks import PartMask


def _mask(q_len, path_len, positions, key_end, window, device) -> torch.Tensor:
    """`(batch or 1, 1, q_len, path_len + q_len)` booleans (True = attend)."""
    if positions is None:
        positions = path_len + torch.arange(q_len, device=device)[None]  # (1, L)
    path = torch.ones(1, 1, q_len, path_len, dtype=torch.bool, device=device)
    if window is not None:
        path = torch.arange(path_len, device=device) > positions[:, None, :, None] - window  # (B|1, 1, L, P)
    own = PartMask(causal=True, key_end=key_end, q_pos=positions, k_pos=positions,
                   window=window).dense(q_len, q_len, device)
    rows = max(path.shape[0], own.shape[0])
    return torch.cat([path.expand(rows, -1, -1, -1), own.expand(rows, -1, -1, -1)], dim=-1)


def concat_attention(query, path_key, path_value, key, value, *, scale, positions, key_end, window, softcap,
                     sinks=None):
    """Reference two-part attention by concatenation; arguments as in [`two_part_attention`]. Soft-capping and sinks
    take an explicit softmax (the sinks as one more score column, dropped after the softmax, as GPT-OSS's eager
    attention does)."""
    batch, n_heads, q_len, _ = query.shape
    path_len = 0
    if path_key is not None:
        path_len = path_key.shape[2]
        key = torch.cat([path_key.expand(batch, -1, -1, -1), key], dim=2)  # (B, H_kv, P + L, D)
        value = torch.cat([path_value.expand(batch, -1, -1, -1), value], dim=2)
    groups = n_heads // key.shape[1]
    explicit = softcap is not None or sinks is not None
    if not explicit and path_len == 0 and window is None and key_end is None:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=groups > 1)
    if query.is_cuda and groups > 1:  # CUDA's fused SDPA kernels take a mask or GQA, not both (else: the math kernel)
        key, value, groups = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1), 1
    mask = _mask(q_len, path_len, positions, key_end, window, query.device)
    if not explicit:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=groups > 1)
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(-1, -2) * scale  # (B, H, L, P + L)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    acc = acc_dtype(query.dtype)
    if sinks is not None:  # (B, H, L, P + L + 1), in the accumulation dtype (GPT-OSS's `cat` promotes so)
        scores = torch.cat([scores.to(acc), sinks.to(acc)[None, :, None, None].expand(*scores.shape[:-1], 1)], -1)
    probs = torch.softmax(scores, dim=-1, dtype=acc)
    if sinks is not None:
        probs = probs[..., :-1]
    return probs.to(query.dtype) @ value
