"""`trl-tree`: TRL's own tree packing (TRL 1.16, `trl/experimental/async_grpo/packing.py`), as a benchmark peer.

What `AsyncGRPOTrainer` does with a rank's samples, run through TRL's own code:

* planning: TRL's planner (`TokenBudgetBatcher._place`) puts each sample into the open row that holds its `group_id`
  if it `fits` there (TRL's `TreeRow.fits`: at most `token_budget` unique tokens *and* `token_budget` trained tokens
  per row), else closes the row; the default budget here holds the whole batch in one row ("no token cap where the
  tree fits"); every row is one forward;
* packing: `TreeRow.add` folds the samples into a trie keyed on (token, next token), `TreeRow.pack` lays it out in DFS
  pre-order and gives every segment the K/V indices of its root-to-segment path (`tree_kv_index`,
  `tree_cu_seqlens_q/k`);
* the forward: the model with TRL's attention interface entry, `model(input_ids, position_ids, shift_labels,
  fused_lm_head=True, **tree_kwargs)` and the loss terms at `log_probs.flatten()[token_index]`, as in
  `AsyncGRPOTrainer.compute_loss`.

TRL's `tree_attention` calls FlashAttention-3's varlen kernel from the kernels hub (CUDA only; no machine of this
project reaches the hub). Where it is absent, an exact varlen attention of the same signature takes its place
(`varlen_tree_attention`): flash-attn's `flash_attn_varlen_func` on CUDA in half precision when flash-attn is
importable, else torch's SDPA per segment with the bottom-right causal mask the varlen kernel applies. Every row names
the one it ran (`stats["attention"]`). `attention="trl-fa3"` registers TRL's own `tree_attention` instead.

Every sample is trained on every position (`completion_mask` all ones), so that its log-probs are those of the other
peers; a row's trained tokens are then its samples' raw tokens, and TRL's `fits` caps those too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from .dense import ProviderOutput, patch_fused_head

ATTENTION_NAME = "bench_trl_tree_varlen"
ATTENTIONS = ("auto", "torch", "flash", "trl-fa3")


def _flash_varlen():
    """flash-attn's `flash_attn_varlen_func`, or None where it does not import."""
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or its CUDA ops do not load
        return None
    return flash_attn_varlen_func


def _torch_segment(q, k, v, scaling, sliding_window, softcap):
    """One segment: `q` `(1, H, Lq, D)`, `k`/`v` `(1, Hkv, Lk, D)`, causal aligned bottom-right (the segment's tokens
    are the last `Lq` of its path)."""
    lq, lk = q.shape[2], k.shape[2]
    row = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
    col = torch.arange(lk, device=q.device)[None]
    mask = col <= row
    if sliding_window:
        mask &= col > row - sliding_window
    if softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                                                enable_gqa=q.shape[1] != k.shape[1])
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    scores = softcap * torch.tanh(scores / softcap)
    return torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), v)


def varlen_tree_attention(module, query, key, value, attention_mask, *, tree_kv_index, tree_cu_seqlens_q,
                          tree_cu_seqlens_k, tree_max_seqlen_q, tree_max_seqlen_k, scaling=None, sliding_window=None,
                          softcap=None, **kwargs):
    """TRL's `tree_attention` without FlashAttention-3 from the hub: the same signature and result.

    Args:
        query (`torch.Tensor` of shape `(1, H, N, D)`), key / value (`(1, Hkv, N, D)`): the packed row's projections.
        tree_kv_index (`torch.LongTensor` of shape `(K,)`): the root-to-segment paths, end to end (`TreeRow.pack`).
        tree_cu_seqlens_q / tree_cu_seqlens_k (`torch.IntTensor` of shape `(S + 1,)`): segment / path boundaries.

    Returns:
        `(torch.Tensor of shape (1, N, H, D), None)`.
    """
    flash = _flash_varlen() if query.is_cuda else None
    if flash is not None and not (query.dtype == torch.float32 and not torch.is_autocast_enabled("cuda")):
        from transformers.integrations.flash_attention import get_target_dtype

        dtype = get_target_dtype(query, module) or query.dtype
        if dtype in (torch.float16, torch.bfloat16):
            q, k, v = (x.transpose(1, 2)[0].to(dtype) for x in (query, key, value))
            out = flash(q, k.index_select(0, tree_kv_index), v.index_select(0, tree_kv_index), tree_cu_seqlens_q,
                        tree_cu_seqlens_k, tree_max_seqlen_q, tree_max_seqlen_k, softmax_scale=scaling, causal=True,
                        window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
                        **({"softcap": softcap} if softcap else {}))
            return (out[0] if isinstance(out, tuple) else out).unsqueeze(0), None
    key = key.index_select(2, tree_kv_index)
    value = value.index_select(2, tree_kv_index)
    cu_q, cu_k = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    outs = [_torch_segment(query[:, :, cu_q[s]:cu_q[s + 1]], key[:, :, cu_k[s]:cu_k[s + 1]],
                           value[:, :, cu_k[s]:cu_k[s + 1]], scaling, sliding_window, softcap)
            for s in range(len(cu_q) - 1)]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def attention_in_use(attention: str, device: torch.device) -> str:
    """What `attention` resolves to on `device`: `"trl-fa3"`, `"flash"` or `"torch"` (the row's `attention`)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if attention == "auto":
        return "flash" if device.type == "cuda" and _flash_varlen() is not None else "torch"
    if attention == "flash" and (device.type != "cuda" or _flash_varlen() is None):
        raise ValueError("attention='flash' needs CUDA and an importable flash-attn; use attention='auto'")
    return attention


def register(attention: str) -> str:
    """Register the tree attention under its name (TRL's for `"trl-fa3"`) and return the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if attention == "trl-fa3":
        from trl.experimental.async_grpo.packing import TREE_ATTENTION, register_tree_attention

        register_tree_attention()
        return TREE_ATTENTION
    AttentionInterface.register(ATTENTION_NAME, varlen_tree_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, lambda **kwargs: None)  # as TRL: the paths are the mask
    return ATTENTION_NAME


def plan_rows(seqs: Sequence[torch.Tensor], token_budget: int | None) -> list:
    """The batch as TRL's planner cuts it: a list of filled `TreeRow`s (one forward each), in order.

    Args:
        seqs (`list[torch.LongTensor]`): the rollouts, each `(len_i,)`.
        token_budget (`int`, *optional*): TRL's `token_budget` (unique and trained tokens per row); None: the batch's
            raw tokens, so one row holds it all.
    """
    from trl.experimental.async_grpo.async_grpo_trainer import TokenBudgetBatcher
    from trl.experimental.async_grpo.packing import TreeRow

    budget = sum(len(s) for s in seqs) if token_budget is None else token_budget
    planner = TokenBudgetBatcher(None, 1, budget, defaultdict(list))
    rows, open_rows = [], [TreeRow()]
    for i, s in enumerate(seqs):
        if len(s) > budget:  # TRL drops such a sample with a warning; a benchmark must not
            raise ValueError(f"sequence {i} has {len(s)} tokens, more than token_budget={budget}; raise token_budget")
        sample = dict(input_ids=s, completion_mask=torch.ones(len(s), dtype=torch.long),
                      old_log_probs=torch.zeros(len(s)), advantage=0.0, group_id=0, index=i)
        while (row := planner._place(open_rows, sample)) is None:
            rows.append(open_rows[0])
            open_rows = [TreeRow()]
        row.add(sample)
    return rows + [r for r in open_rows if r.samples]


class TRLTreeProvider:
    """TRL's tree packing (see the module docstring) behind the providers' interface.

    Args:
        model ([`~transformers.PreTrainedModel`]): a causal LM of attention layers only (TRL refuses the others).
        token_budget (`int`, *optional*): TRL's `token_budget`; None holds the whole batch in one row.
        attention (`str`, *optional*, defaults to `"auto"`): one of `ATTENTIONS` (`attention_in_use`).
        lm_head (`str`, *optional*, defaults to `"trl"`): `"trl"`, TRL's fused LM head over `shift_labels` (what
            `AsyncGRPOTrainer` runs), or `"torch"`, a `log_softmax` in the model's dtype (exact in float64: the tests).
        temperature (`float`, *optional*, defaults to `1.0`): logits are divided by it.
    """

    def __init__(self, model, token_budget: int | None = None, attention: str = "auto", lm_head: str = "trl",
                 temperature: float = 1.0):
        if lm_head not in ("trl", "torch"):
            raise ValueError(f"lm_head must be 'trl' or 'torch', got {lm_head!r}")
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"token_budget must be >= 1 or None, got {token_budget}")
        self.model, self.token_budget, self.lm_head, self.temperature = model, token_budget, lm_head, temperature
        self.attention = attention_in_use(attention, next(model.parameters()).device)
        self.attention_name = register(self.attention)
        if lm_head == "trl":
            patch_fused_head(model, temperature, entropy=False)

    def _row_logprobs(self, packed: dict) -> torch.Tensor:
        """The loss terms' log-probs of one packed row, shape `(M,)` (`packed["token_index"]` order)."""
        device = next(self.model.parameters()).device
        ids, positions = packed["input_ids"].to(device)[None], packed["position_ids"].to(device)[None]
        tree_kwargs = {k: packed[k].to(device) for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
        tree_kwargs["tree_max_seqlen_q"], tree_kwargs["tree_max_seqlen_k"] = packed["tree_max_seqlens"].tolist()
        token_index = packed["token_index"].to(device)
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.attention_name)
        try:
            if self.lm_head == "trl":
                out = self.model(input_ids=ids, position_ids=positions, shift_labels=packed["shift_labels"][None]
                                 .to(device), fused_lm_head=True, **tree_kwargs)
                return out.log_probs.flatten()[token_index]
            backbone = self.model.get_decoder()
            hidden = backbone(input_ids=ids, position_ids=positions, use_cache=False, **tree_kwargs)
            hidden = hidden.last_hidden_state[0].index_select(0, token_index)
        finally:
            self.model.set_attn_implementation(previous)
        head = self.model.get_output_embeddings()
        logits = torch.nn.functional.linear(hidden, head.weight, head.bias) / self.temperature
        targets = packed["shift_labels"].to(device).index_select(0, token_index)
        return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]

    def forward_backward(self, seqs: Sequence[torch.Tensor], loss_fn: Callable) -> ProviderOutput:
        """Each planned row packed and run once; `loss_fn(i, logps_i, None)` per sequence; the sum back-propagated.

        Args:
            seqs (`list[torch.LongTensor]`): rollouts, each of shape `(len_i,)` with `len_i >= 1`.
            loss_fn (`Callable`): per-sequence loss, as for [`~trl_dta.DTAEngine.forward_backward`].
        """
        seqs = [torch.as_tensor(s, dtype=torch.long).cpu() for s in seqs]
        logps_out, total, forwarded = [None] * len(seqs), 0.0, 0
        rows = plan_rows(seqs, self.token_budget)
        for row in rows:
            packed = row.pack()
            forwarded += packed["input_ids"].numel()
            lp = self._row_logprobs(packed)
            segment_id = packed["segment_id"]  # the row's sample of each loss term; a sample's terms are contiguous
            counts = torch.bincount(segment_id, minlength=len(row.samples)).tolist()
            losses = []
            for sample, part in zip(row.samples, torch.split(lp, counts)):
                i = sample["index"]
                losses.append(loss_fn(i, part, None))
                logps_out[i] = part.detach()
            loss = torch.stack(losses).sum()
            loss.backward()
            total += loss.item()
        return ProviderOutput(loss=total, logps=logps_out, stats={"micro_batches": len(rows),
                                                                  "forward_tokens": forwarded,
                                                                  "attention": self.attention})
