"""The packed tree-mask ("sparse") peer: every tree token once, in one packed row, under a tree attention mask.

This is how AReaL's tree training, TRL AsyncGRPO `packing="tree"`, prime-rl and OpenPipe ART share prefixes: the
prefix tree of a micro-batch is flattened in pre-order into one row, each token gets its depth as position id (so
RoPE matches the dense computation) and attends exactly its ancestors-or-self:

```
tree:  [a b] -> [c], [d e]           packed row:  a b c d e      mask (row = query, 1 = attend)
depth:  0 1      2    2 3                                         a: 1 . . . .
                                                                  b: 1 1 . . .
                                                                  c: 1 1 1 . .
                                                                  d: 1 1 . 1 .
                                                                  e: 1 1 . 1 1
```

Token `j` sees token `k` iff `k`'s segment is an ancestor-or-self of `j`'s segment and `depth(k) <= depth(j)`. In
pre-order numbering the segments of a subtree are contiguous, so "ancestor-or-self" is one range test.

Every tree token does the linear work once, forward and backward, like DTA; the costs are attention and memory:

* `attention="mask"`: the `(T, T)` boolean mask goes to SDPA as a 4D mask: every query scores all `T` keys of the
  row (what a dense kernel with a mask does; FlexAttention on GPU would skip empty blocks).
* `attention="flex"` (the `sparse-flex` method): torch's FlexAttention (`torch.nn.attention.flex_attention`,
  compiled on CUDA) with a `BlockMask` built from the same ancestor-or-self test (`tree_block_mask`): key blocks no
  query of a block can see are skipped. torch 2.13 has no FlexAttention backward on CPU (`NotImplementedError`), so a
  CPU run that needs gradients takes the `"blocks"` fallback below and says so (`stats["attention"]`); a CPU forward
  without gradients runs FlexAttention eagerly.
* `attention="blocks"` (the fallback, the `sparse-blocks` method): a block-sparse emulation of FlexAttention: queries
  in blocks of `block_size`; each block gathers only the keys some query of it can see (its segments' ancestors), and
  runs SDPA on that `(B, K_b)` sub-problem. Work per query is the block's ancestor set, close to the path length.

Activations of all tree tokens of a micro-batch are alive at once (that is the memory DTA saves). Batches with more
tree tokens than `max_tokens` are cut into micro-batches of whole sequences in lexicographic order (sharing
across micro-batches is lost, as in AReaL), each with its own tree.

The LM head projects only tree tokens with a successor: the row of token `parent(j)` scores token `j`, once for all
sequences that contain `j` (a fork row serves each child). `lm_head="trl"` uses TRL's chunked log-prob kernel (the
one the dense path uses); `lm_head="torch"` a chunked `log_softmax` in the model's dtype (exact in float64, for the
tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from trl_dta.tree import PrefixTree

from .dense import ProviderOutput

ATTENTION_NAME = "bench_tree_blocks"
FLEX_ATTENTION_NAME = "bench_tree_flex"
ATTENTIONS = ("mask", "blocks", "flex")
CPU_FLEX_FALLBACK = "blocks (fallback: torch has no FlexAttention backward on CPU)"


def tree_layout(tree: PrefixTree) -> dict[str, torch.Tensor]:
    """Per-tree-token layout of a packed tree.

    Returns:
        `dict` with (all of shape `(T,)`, `T = tree.n_tree_tokens`, pre-order):
            `input_ids`: token ids; `depth`: positions; `segment`: pre-order segment index;
            `subtree_end`: one past the last segment index of the token's segment's subtree;
            `parent_token`: flat index of the previous token on the path (`-1` for roots' first tokens).
    """
    n_seg = len(tree.segments)
    seg_len = torch.tensor([s.length for s in tree.segments], dtype=torch.long)
    seg_start = torch.tensor([s.start for s in tree.segments], dtype=torch.long)
    seg_offset = torch.tensor([s.offset for s in tree.segments], dtype=torch.long)
    # subtree_end: pre-order subtree of s is [s, s + n_desc(s) + 1)
    size = [1] * n_seg
    for seg in reversed(tree.segments):
        if seg.parent >= 0:
            size[seg.parent] += size[seg.index]
    subtree_end = torch.arange(n_seg) + torch.tensor(size, dtype=torch.long)
    # the last token of each segment's parent, for the first token of each segment
    parent_last = torch.tensor(
        [tree.segments[s.parent].offset + tree.segments[s.parent].length - 1 if s.parent >= 0 else -1
         for s in tree.segments],
        dtype=torch.long,
    )
    segment = torch.repeat_interleave(torch.arange(n_seg), seg_len)
    within = torch.arange(tree.n_tree_tokens) - seg_offset[segment]
    parent_token = torch.where(within == 0, parent_last[segment], torch.arange(tree.n_tree_tokens) - 1)
    return {
        "input_ids": tree.tree_token_ids(),
        "depth": seg_start[segment] + within,
        "segment": segment,
        "subtree_end": subtree_end[segment],
        "parent_token": parent_token,
    }


def tree_attention_mask(tree: PrefixTree, layout: dict | None = None) -> torch.Tensor:
    """Boolean ancestor-or-self mask of the packed tree, shape `(T, T)` (`True` = attend; row = query)."""
    layout = layout or tree_layout(tree)
    return _mask_rows(layout, torch.arange(tree.n_tree_tokens), torch.arange(tree.n_tree_tokens))


def _mask_rows(layout: dict, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    seg, end, depth = layout["segment"], layout["subtree_end"], layout["depth"]
    q_seg, q_depth = seg[rows][:, None], depth[rows][:, None]
    return (q_seg >= seg[cols][None]) & (q_seg < end[cols][None]) & (depth[cols][None] <= q_depth)


def _block_plan(layout: dict, block_size: int, device) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """For each query block `[a, b)`: the key indices its queries can see and the `(b - a, K)` mask over them."""
    T = layout["segment"].numel()
    seg, end = layout["segment"], layout["subtree_end"]
    plan = []
    for a in range(0, T, block_size):
        b = min(a + block_size, T)
        lo, hi = int(seg[a]), int(seg[b - 1])
        # a key k (before b) is visible to some query of the block iff its segment's subtree meets [lo, hi]
        cand = torch.arange(b)
        keep = (end[cand] > lo) & (seg[cand] <= hi)
        keys = cand[keep]
        mask = _mask_rows(layout, torch.arange(a, b), keys)
        plan.append((a, b, keys.to(device), mask[None, None].to(device)))
    return plan


def _block_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, tree_plan=None, **kwargs):
    """Attention over a packed tree, block by block (see the module docstring). `query`: `(1, H, T, D)`."""
    if tree_plan is None:
        raise ValueError(f"attention {ATTENTION_NAME!r} needs the `tree_plan` keyword (use SparseProvider)")
    groups = getattr(module, "num_key_value_groups", 1)
    outs = []
    for a, b, keys, mask in tree_plan:
        k = key.index_select(2, keys)
        v = value.index_select(2, keys)
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        outs.append(torch.nn.functional.scaled_dot_product_attention(query[:, :, a:b], k, v, attn_mask=mask,
                                                                     scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def tree_block_mask(layout: dict, device, block_size: int = 128):
    """FlexAttention's `BlockMask` of the packed tree: the ancestor-or-self test of `tree_attention_mask` as its
    `mask_mod`, over `(T, T)` in blocks of `block_size`."""
    from torch.nn.attention.flex_attention import create_block_mask

    seg, end, depth = (layout[k].to(device) for k in ("segment", "subtree_end", "depth"))

    def ancestor_or_self(b, h, q, kv):
        return (seg[q] >= seg[kv]) & (seg[q] < end[kv]) & (depth[kv] <= depth[q])

    T = seg.numel()
    return create_block_mask(ancestor_or_self, None, None, T, T, device=device, BLOCK_SIZE=block_size)


_COMPILED_FLEX = {}


def _flex_fn(device_type: str):
    """`flex_attention`, compiled on CUDA (the fused kernel), eager elsewhere (forward only on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    if "cuda" not in _COMPILED_FLEX:
        _COMPILED_FLEX["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX["cuda"]


def _flex_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, tree_block_mask=None,
                    **kwargs):
    """FlexAttention over a packed tree. `query`: `(1, H, T, D)`; returns `((1, T, H, D), None)`."""
    if tree_block_mask is None:
        raise ValueError(f"attention {FLEX_ATTENTION_NAME!r} needs the `tree_block_mask` keyword (use SparseProvider)")
    key, value = key.to(query.dtype), value.to(query.dtype)
    out = _flex_fn(query.device.type)(query, key, value, block_mask=tree_block_mask, scale=scaling,
                                      enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _register_block_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _block_attention)
    AttentionInterface.register(FLEX_ATTENTION_NAME, _flex_attention)


def torch_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor, temperature: float,
                    chunk: int = 2048) -> torch.Tensor:
    """`log_softmax(hidden @ weight.T / temperature)[targets]`, chunked over rows, in the hidden dtype."""
    out = []
    for s in range(0, hidden.shape[0], chunk):
        logits = torch.nn.functional.linear(hidden[s : s + chunk], weight, bias) / temperature
        out.append(torch.log_softmax(logits, dim=-1).gather(-1, targets[s : s + chunk, None])[:, 0])
    return torch.cat(out) if out else hidden.new_zeros(0)


def _trl_logprobs(hidden, weight, bias, targets, temperature) -> torch.Tensor:
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    return ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, _CHUNKED_LOGPROB_CHUNK_SIZE,
                                        None, 1.0, ("log_probs",))[0]


def micro_batches(seqs: Sequence[torch.Tensor], max_tokens: int | None) -> list[list[int]]:
    """Cut the batch into runs of whole sequences, in lexicographic order, of at most `max_tokens` tree tokens each.

    A sequence longer than `max_tokens` gets a micro-batch of its own.
    """
    tree = PrefixTree.from_sequences(seqs)
    if max_tokens is None or tree.n_tree_tokens <= max_tokens:
        return [list(range(len(seqs)))]
    out, cur, cost = [], [], 0
    for k, i in enumerate(tree.order):
        new = tree.lengths[i] - (tree.order_lcp[k] if cur else 0)
        if cur and cost + new > max_tokens:
            out.append(cur)
            cur, cost, new = [], 0, tree.lengths[i]
        cur.append(i)
        cost += new
    if cur:
        out.append(cur)
    return out


class SparseProvider:
    """Packed tree-mask training: one packed row of tree tokens per micro-batch.

    Args:
        model ([`~transformers.PreTrainedModel`]): a causal LM with a `model.model` backbone and an LM head.
        attention (`str`, *optional*, defaults to `"blocks"`): `"mask"` (SDPA with the full `(T, T)` boolean mask),
            `"blocks"` (block-sparse gather) or `"flex"` (FlexAttention with a block mask; see the module docstring).
        block_size (`int`, *optional*, defaults to `256`): query block of `attention="blocks"`.
        max_tokens (`int`, *optional*, defaults to `8192`): tree tokens per micro-batch (None: the whole batch in
            one packed row).
        flex_block_size (`int`, *optional*, defaults to `128`): the block mask's block of `attention="flex"`.
        lm_head (`str`, *optional*, defaults to `"trl"`): `"trl"` (TRL's chunked kernel) or `"torch"` (exact in the
            model's dtype).
        temperature (`float`, *optional*, defaults to `1.0`): logits are divided by it.
    """

    def __init__(self, model, attention: str = "blocks", block_size: int = 256, max_tokens: int | None = 8192,
                 lm_head: str = "trl", temperature: float = 1.0, flex_block_size: int = 128):
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        if lm_head not in ("trl", "torch"):
            raise ValueError(f"lm_head must be 'trl' or 'torch', got {lm_head!r}")
        self.model = model
        self.attention = attention
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.lm_head = lm_head
        self.temperature = temperature
        self.flex_block_size = flex_block_size
        self.ran = attention  # what the last forward ran (`stats["attention"]`)
        if attention != "mask":
            _register_block_attention()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _tree_logprobs(self, layout: dict) -> torch.Tensor:
        """`out[j] = log p(token j | its path)` for every tree token (0 for first tokens of roots), shape `(T,)`."""
        device = self.device
        ids = layout["input_ids"].to(device)[None]
        position_ids = layout["depth"].to(device)[None]
        backbone = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        attention = self.attention
        if attention == "flex" and device.type != "cuda" and torch.is_grad_enabled():
            attention = CPU_FLEX_FALLBACK
        self.ran = attention
        if attention == "mask":
            every = torch.arange(ids.shape[1])
            mask = _mask_rows(layout, every, every)
            hidden = backbone(input_ids=ids, position_ids=position_ids, attention_mask=mask[None, None].to(device),
                              use_cache=False).last_hidden_state[0]
        else:
            if attention == "flex":
                name, extra = FLEX_ATTENTION_NAME, {"tree_block_mask": tree_block_mask(layout, device,
                                                                                       self.flex_block_size)}
            else:
                name, extra = ATTENTION_NAME, {"tree_plan": _block_plan(layout, self.block_size, device)}
            previous = self.model.config._attn_implementation
            self.model.set_attn_implementation(name)
            try:
                dummy = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)  # 4D: skips mask construction
                hidden = backbone(input_ids=ids, position_ids=position_ids, attention_mask=dummy, use_cache=False,
                                  **extra).last_hidden_state[0]
            finally:
                self.model.set_attn_implementation(previous)
        parent = layout["parent_token"].to(device)
        scored = (parent >= 0).nonzero()[:, 0]
        head = self.model.get_output_embeddings()
        fn = _trl_logprobs if self.lm_head == "trl" else torch_logprobs
        lp = fn(hidden[parent[scored]], head.weight, head.bias, ids[0, scored], self.temperature)
        return hidden.new_zeros(ids.shape[1], dtype=lp.dtype).index_copy(0, scored, lp)

    def forward_backward(self, seqs: Sequence[torch.Tensor], loss_fn: Callable) -> ProviderOutput:
        """Run the batch as packed trees, call `loss_fn(i, logps_i, None)` per sequence, back-propagate the sum.

        Args:
            seqs (`list[torch.LongTensor]`): rollouts, each of shape `(len_i,)` with `len_i >= 1`.
            loss_fn (`Callable`): per-sequence loss, as for [`~trl_dta.DTAEngine.forward_backward`].
        """
        seqs = [torch.as_tensor(s, dtype=torch.long) for s in seqs]
        logps_out, total, tree_tokens = [None] * len(seqs), 0.0, 0
        batches = micro_batches(seqs, self.max_tokens)
        for index in batches:
            tree = PrefixTree.from_sequences([seqs[i] for i in index])
            layout = tree_layout(tree)
            tree_lp = self._tree_logprobs(layout)
            losses = []
            for local, i in enumerate(index):
                lp = tree_lp[tree.token_index(local)[1:].to(tree_lp.device)]
                losses.append(loss_fn(i, lp, None))
                logps_out[i] = lp.detach()
            loss = torch.stack(losses).sum()
            loss.backward()
            total += loss.item()
            tree_tokens += tree.n_tree_tokens
        return ProviderOutput(loss=total, logps=logps_out,
                              stats={"micro_batches": len(batches), "forward_tokens": tree_tokens,
                                     "attention": self.ran})
