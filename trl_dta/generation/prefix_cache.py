"""A key/value cache for generation over a forest of sequences: every shared prefix stored once and forwarded once.

Rollouts share prefixes: all episodes of a step share the system prompt, a task's trials share its first user
message, a tree sampler's children share their parent. [`PrefixCache`] keeps the keys/values of such a forest:

```
node 0   system prompt (4.7K tokens)              stored once: (1, H_kv, 4.7K, D) per layer
├── node 1   task A's first user message          stored once
│   ├── row 0   [turn 0][tool reply][turn 1] ..   own part: a slot of the rows' buffer (slots, tokens, H_kv, D)
│   └── row 1   [turn 0][user reply] ..
└── node 2   task B's first user message
    └── row 2   ..
```

A *row* is a sequence that grows (an episode, a tree leaf being sampled). Its keys/values are its ancestor *nodes*
(frozen, read-only, shared by every row below them) followed by its *own* part (a slot of one padded buffer per layer,
rows of different lengths side by side). A row's tokens are either *cached* (forwarded, keys/values stored),
*pending* (appended with [`extend`], not yet forwarded: the sampled token, an environment's reply) or, once
everything is forwarded, the row has its next-token logits *ready*.

[`forward`] forwards the pending tokens of a batch of rows; each layer's attention (the `"dta_generate"`
implementation, `generation.cache_attention`) is the softmax over all of a row's keys, computed in parts merged by
log-sum-exp (the engine's two-part idea, `kernels.two_part`):

```
                    node 0 keys     node 1 keys     own cached keys    new keys
row 0 new queries:  [ all       ]   [ all       ]   [ < cached_0 ]     [ causal ]
row 1 new queries:  [ same      ]   [ same      ]   [ < cached_1 ]     [ causal ]
row 2 new queries:  [ same      ]                   [ < cached_2 ]     [ causal ]
```

- a node's part: the new queries of every row below it folded into one query sequence, one kernel call over the
  node's keys (never copied per row);
- the own part: each row's cached keys, padded to the batch's longest (a key-padding mask), and the new tokens
  causally among themselves.

Prefill is chunked: a forward takes at most `chunk_tokens` tokens per row, so no forward scores more than
`chunk_tokens x context` (never `context x context`). Rows with different numbers of pending tokens are levelled
longest first (the rows with the most pending tokens forward alone until they are level with the next ones), so every
forward is a full rectangle: no padding is ever forwarded, and every row's last pending token ends in the batch's
last forward, whose last position gives the logits.

How a sampler uses it (a tree sampler: a parent's cache shared by several children, each appending its own tokens):

```python
cache = PrefixCache(model)
[root] = cache.add_rows([prompt_ids])       # one row, the prompt pending
kids = cache.branch([root], [4])[0]          # forwards the prompt once; it becomes a node shared by 4 new rows
for _ in range(segment_length):
    logits = cache.logits(kids)               # (4, vocab): forwards what is pending (the first step: nothing)
    tokens = sample(logits)
    for row, token in zip(kids, tokens):
        cache.extend(row, [token])            # pending until the next `logits`
grandkids = cache.branch(kids, [2, 2, 2, 2])  # each kid's segment (and its last sampled token, forwarded once)
                                              # becomes a node; 2 rows continue each; nothing is copied per child
cache.release(rows)                           # rows that ended: their slots are reused
```

With TRL's sampling settings, use [`~generation.CachedGenerate`] instead of sampling by hand: its `generate` runs
`model.generate`'s own logits processors and stopping criteria over this cache, and branches a row whenever a call's
prefixes repeat it (one prefix per child), so a tree sampler calls it once per level.

`add_prompts(prompts)` builds the usual agent forest in one call: the prompts' longest common prefix (the system
prompt) and each distinct prompt's rest become nodes, prefilled once; one row per prompt. Branching freezes a row's
own part into a node: its keys/values are moved out of the rows' buffer once (a copy of that segment, not of anything
shared above it), and the children start with empty own parts and the parent's logits ready.

The cache holds the keys/values of the weights it was filled with: use one per rollout (per generation step).
Limits: causal LMs whose every layer calls the attention interface (no state-space or linear-attention layers, no
ALiBi, no attention sinks: refused at the first forward with the reason); no gradients (generation only).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from .._checks import check_int
from ..modeling.switch import attention_implementation
from ..refusal import Blocker, refuse
from .cache_attention import ATTN_IMPLEMENTATION, GenerationBatch, register


@dataclass
class CacheStats:
    """What a [`PrefixCache`] computed.

    Args:
        forward_calls (`int`): model forwards.
        forward_tokens (`int`): token positions forwarded (every one a real token: forwards hold no padding).
        frozen_tokens (`int`): own tokens moved into nodes by [`PrefixCache.branch`] (copied once, not per child).
        peak_kv_bytes (`int`): the most key/value bytes held ([`PrefixCache.kv_bytes`]) after a forward or a freeze.
        cached_tokens (`int`, *optional*): prompt tokens an engine's own prefix cache served without forwarding them,
            by its own count (vLLM's `num_cached_tokens`, [`~generation.VLLMGenerate`]); `None` where nobody counts
            them that way (a [`PrefixCache`] never forwards a stored token: its reuse is what `forward_tokens` omits).
    """

    forward_calls: int = 0
    forward_tokens: int = 0
    frozen_tokens: int = 0
    peak_kv_bytes: int = 0
    cached_tokens: int | None = None


@dataclass
class Node:
    """A frozen shared segment: the keys/values of `length` tokens at positions `start .. start + length - 1`.

    Args:
        keys, values (`list[torch.Tensor]`): per layer, `(1, n_kv_heads, length, head_dim)`.
        start (`int`): position of the first token.
        length (`int`): tokens.
        parent (`int`, *optional*): the node it continues.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    start: int
    length: int
    parent: int | None


@dataclass
class _Row:
    slot: int
    node: int | None  # the deepest node the row continues
    offset: int  # position of the first own token
    tokens: list[int]  # every token of the row: its nodes', its own, the pending ones
    cached: int = 0  # own tokens whose keys/values are in the buffer
    pending: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # (vocab,), next-token logits once nothing is pending


class PrefixCache:
    """Keys/values of a forest of sequences for generation (see the module docstring).

    Args:
        model ([`~transformers.PreTrainedModel`]): the causal LM (its own forward runs; attention is routed through
            the cache for the duration of each forward).
        chunk_tokens (`int`, *optional*, defaults to `512`): tokens per row in one forward (prefill is chunked: a
            forward scores at most `chunk_tokens x context` per head).
        max_batch_tokens (`int`, *optional*, defaults to `8192`): tokens (rows x chunk) in one forward.
    """

    def __init__(self, model, *, chunk_tokens: int = 512, max_batch_tokens: int = 8192):
        self.model = model
        self.chunk_tokens = check_int("chunk_tokens", chunk_tokens, minimum=1)
        self.max_batch_tokens = check_int("max_batch_tokens", max_batch_tokens, minimum=1)
        self.n_layers = model.config.get_text_config().num_hidden_layers
        self.device = model.get_input_embeddings().weight.device
        self.nodes: list[Node] = []
        self._node_bytes = 0  # keys/values held by `nodes`
        self.stats = CacheStats()
        self._rows: dict[int, _Row] = {}
        self._next_row = 0
        self._free_slots: list[int] = []  # a heap
        self._n_slots = 0  # slots of the buffers
        self._capacity = 0  # own tokens per slot
        self._keys: list[torch.Tensor | None] = [None] * self.n_layers  # (slots, tokens, H_kv, D)
        self._values: list[torch.Tensor | None] = [None] * self.n_layers
        register()

    # ------------------------------------------------------------------------------------------------- rows

    def add_rows(self, sequences: list[list[int]]) -> list[int]:
        """New rows (nothing shared), each sequence's tokens pending."""
        rows = []
        for tokens in sequences:
            row = self._new_row(None, 0, [])
            self.extend(row, tokens)
            rows.append(row)
        return rows

    def add_prompts(self, prompts: list[list[int]]) -> list[int]:
        """One row per prompt (input order), the shared parts prefilled once and stored once: the prompts' longest
        common prefix is one node, each distinct prompt's rest another below it; each row starts with its prompt's
        logits ready (identical prompts share them)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("`prompts` must be a non-empty list of non-empty token lists.")
        common = _common_prefix(prompts)
        distinct = list(dict.fromkeys(tuple(p) for p in prompts))
        [root] = self.add_rows([prompts[0][:common]])
        groups = self.branch([root], [len(distinct)])[0]
        for row, prompt in zip(groups, distinct):
            self.extend(row, list(prompt[common:]))
        counts = [sum(tuple(p) == prompt for p in prompts) for prompt in distinct]
        children = dict(zip(distinct, (iter(kids) for kids in self.branch(groups, counts))))
        return [next(children[tuple(p)]) for p in prompts]

    def extend(self, row: int, tokens: list[int]) -> None:
        """Appends `tokens` to `row` as pending (forwarded by the next [`forward`] or [`logits`])."""
        r = self._row(row)
        if tokens:
            r.pending.extend(int(t) for t in tokens)
            r.tokens.extend(int(t) for t in tokens)
            r.logits = None

    def tokens(self, row: int) -> list[int]:
        """Every token of `row` (its nodes', its own, the pending ones). Do not modify."""
        return self._row(row).tokens

    def rows(self) -> list[int]:
        """The live rows, oldest first."""
        return list(self._rows)

    def release(self, rows: list[int]) -> None:
        """Drops rows; their slots are reused (the nodes they continue stay)."""
        for row in rows:
            heapq.heappush(self._free_slots, self._row(row).slot)
            del self._rows[row]

    def branch(self, rows: list[int], counts: list[int]) -> list[list[int]]:
        """Continues each row `rows[i]` as `counts[i]` rows sharing it (see the module docstring).

        A row with count 1 is kept as it is; with count 0 it is released; otherwise its pending tokens are forwarded
        (all branching rows in one batched forward), its own part becomes a node and `counts[i]` new rows continue it
        with its logits ready, and the row itself is released.

        Returns:
            `list[list[int]]`: the rows continuing each input row.
        """
        if len(rows) != len(counts):
            raise ValueError(f"got {len(rows)} rows and {len(counts)} counts.")
        counts = [check_int("counts[]", c, minimum=0) for c in counts]
        self.forward([row for row, c in zip(rows, counts) if c > 1])
        out = []
        for row, count in zip(rows, counts):
            if count == 1:
                out.append([row])
                continue
            r = self._row(row)
            node = self._freeze(r) if count else None
            out.append([self._new_row(node, r.offset + r.cached, list(r.tokens), r.logits) for _ in range(count)])
            self.release([row])
        self._fit()
        return out

    def kv_bytes(self) -> int:
        """Bytes of keys/values the cache holds now: its nodes and its rows' buffer (every slot at full capacity)."""
        return self._node_bytes + sum(t.numel() * t.element_size() for t in (*self._keys, *self._values)
                                      if t is not None)

    # --------------------------------------------------------------------------------------------- forwards

    def logits(self, rows: list[int]) -> torch.Tensor:
        """Next-token logits of `rows`, `(len(rows), vocab)` in the model's output dtype (pending tokens forwarded)."""
        self.forward(rows)
        missing = [row for row in rows if self._row(row).logits is None]
        if missing:
            raise ValueError(f"rows {missing} have no tokens: there is nothing to predict from.")
        return torch.stack([self._rows[row].logits for row in rows])

    @torch.no_grad()
    def forward(self, rows: list[int]) -> None:
        """Forwards every pending token of `rows`: chunked, longest pending first, no padding (module docstring)."""
        remaining = {row: len(self._row(row).pending) for row in dict.fromkeys(rows)}
        remaining = {row: n for row, n in remaining.items() if n}
        if not remaining:
            return
        with attention_implementation(self.model, ATTN_IMPLEMENTATION):
            while remaining:
                longest = max(remaining.values())
                group = [row for row, n in remaining.items() if n == longest]
                level = max((n for n in remaining.values() if n < longest), default=0)
                width = min(self.chunk_tokens, longest - level, max(1, self.max_batch_tokens // len(group)))
                for start in range(0, len(group), max(1, self.max_batch_tokens // width)):
                    self._forward_block(group[start:start + max(1, self.max_batch_tokens // width)], width,
                                        keep_logits=width == longest)
                for row in group:
                    remaining[row] -= width
                    if not remaining[row]:
                        del remaining[row]

    def _forward_block(self, rows: list[int], width: int, keep_logits: bool) -> None:
        """One model forward: the next `width` pending tokens of each of `rows`."""
        rs = [self._rows[row] for row in rows]
        self._reserve(max(r.cached for r in rs) + width)
        device = self.device
        ids = torch.tensor([r.pending[:width] for r in rs], dtype=torch.long, device=device)  # (B, w)
        cached = torch.tensor([r.cached for r in rs], dtype=torch.long, device=device)  # (B,)
        starts = torch.tensor([r.offset + r.cached for r in rs], dtype=torch.long, device=device)
        positions = starts[:, None] + torch.arange(width, device=device)  # (B, w)
        batch = GenerationBatch(
            cache=self,
            slots=torch.tensor([r.slot for r in rs], dtype=torch.long, device=device),
            cached=cached,
            offsets=torch.tensor([r.offset for r in rs], dtype=torch.long, device=device),
            positions=positions,
            nodes=self._batch_nodes(rs),
        )
        out = self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1, dta_gen=batch)
        if batch.calls != self.n_layers:
            refuse(f"{type(self.model).__name__} in the generation cache", [Blocker(
                f"{batch.calls} of its {self.n_layers} layers called the attention interface during a forward, so the "
                "generation cache cannot hold its state (state-space, linear or own-code attention layers)",
                fix="generate without the cache (`generation_cache=False`: `model.generate` on every prefix)")],
                alternative="")
        self.stats.forward_calls += 1
        self.stats.forward_tokens += ids.numel()
        self._note_kv_bytes()
        last = out.logits[:, -1]  # (B, vocab)
        for i, r in enumerate(rs):
            r.cached += width
            del r.pending[:width]
            if keep_logits:
                r.logits = last[i]

    def _batch_nodes(self, rs: list[_Row]) -> list[tuple[Node, torch.Tensor | None]]:
        """Every node on the batch's rows' paths, with the batch indices of the rows below it (None: all rows)."""
        below: dict[int, list[int]] = {}
        for i, r in enumerate(rs):
            node = r.node
            while node is not None:
                below.setdefault(node, []).append(i)
                node = self.nodes[node].parent
        return [(self.nodes[node], None if len(idx) == len(rs) else torch.tensor(idx, device=self.device))
                for node, idx in sorted(below.items()) if self.nodes[node].length]

    # ------------------------------------------------------------------------- the rows' buffer (attention's)

    def own(self, layer: int, slots: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows' cached own keys/values, `(B, n_kv_heads, width, head_dim)` each (a view for consecutive slots,
        else a gathered copy), or None when `width` is 0."""
        if width == 0:
            return None
        keys, values = self._keys[layer][:, :width], self._values[layer][:, :width]  # (slots, width, H_kv, D)
        first, count = int(slots[0]), len(slots)
        if torch.equal(slots, torch.arange(first, first + count, device=slots.device)):
            keys, values = keys[first:first + count], values[first:first + count]
        else:
            keys, values = keys.index_select(0, slots), values.index_select(0, slots)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def write(self, layer: int, slots: torch.Tensor, cached: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor) -> None:
        """Stores new keys/values `(B, n_kv_heads, w, head_dim)` at own positions `cached .. cached + w - 1`."""
        if self._keys[layer] is None:
            shape = (self._n_slots, self._capacity, key.shape[1], key.shape[3])
            # zeros, not empty: padded keys are masked, but a masked weight 0 times an uninitialised NaN is NaN
            self._keys[layer] = torch.zeros(shape, dtype=key.dtype, device=key.device)
            self._values[layer] = torch.zeros(shape, dtype=value.dtype, device=value.device)
        where = cached[:, None] + torch.arange(key.shape[2], device=key.device)  # (B, w)
        self._keys[layer][slots[:, None], where] = key.transpose(1, 2).to(self._keys[layer].dtype)
        self._values[layer][slots[:, None], where] = value.transpose(1, 2).to(self._values[layer].dtype)

    def _reserve(self, tokens: int) -> None:
        """Room for `tokens` own tokens in every slot (the capacity at least doubles: one copy when it grows)."""
        if tokens > self._capacity:
            self._grow(self._n_slots, max(tokens, 2 * self._capacity, 64))

    def _fit(self) -> None:
        """Shrinks the rows' buffer to the live rows (slots renumbered in order) and their own tokens, when that frees
        more than half of it: after a branch froze a long own part (a prompt) into a node, the buffer would otherwise
        keep that length for every slot, i.e. every row would still hold the prompt's room."""
        live = sorted(self._rows.values(), key=lambda r: r.slot)
        capacity = max((r.cached for r in live), default=0)
        slots = max(len(live), 1)
        if 2 * slots * capacity > self._n_slots * self._capacity:
            return
        index = torch.tensor([r.slot for r in live], dtype=torch.long, device=self.device)
        for buffers in (self._keys, self._values):
            for layer, old in enumerate(buffers):
                if old is not None:
                    new = torch.zeros((slots, capacity, *old.shape[2:]), dtype=old.dtype, device=old.device)
                    new[:len(live)] = old.index_select(0, index)[:, :capacity]
                    buffers[layer] = new
        for slot, r in enumerate(live):
            r.slot = slot
        self._free_slots = list(range(len(live), slots))
        self._n_slots, self._capacity = slots, capacity

    def _note_kv_bytes(self) -> None:
        self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, self.kv_bytes())

    def _grow(self, slots: int, capacity: int) -> None:
        """Reallocates the buffers with `slots` slots of `capacity` tokens, keeping what they hold."""
        for buffers in (self._keys, self._values):
            for layer, old in enumerate(buffers):
                if old is not None:
                    new = torch.zeros((slots, capacity, *old.shape[2:]), dtype=old.dtype, device=old.device)
                    new[:old.shape[0], :old.shape[1]] = old
                    buffers[layer] = new
        self._n_slots, self._capacity = slots, capacity

    # ------------------------------------------------------------------------------------------- internals

    def _row(self, row: int) -> _Row:
        if row not in self._rows:
            raise ValueError(f"row {row} is not a live row of this cache.")
        return self._rows[row]

    def _new_row(self, node: int | None, offset: int, tokens: list[int], logits=None) -> int:
        if not self._free_slots:  # the lowest free slot is taken first, so rows made together get consecutive slots
            n = self._n_slots
            self._grow(max(2 * n, 1), self._capacity)
            for slot in range(n, self._n_slots):
                heapq.heappush(self._free_slots, slot)
        slot = heapq.heappop(self._free_slots)
        row = self._next_row
        self._next_row += 1
        self._rows[row] = _Row(slot, node, offset, tokens, logits=logits)
        return row

    def _freeze(self, r: _Row) -> int | None:
        """The row's own part as a new node (a copy out of the buffer), or the row's node when it owns nothing."""
        if r.cached == 0:
            return r.node
        keys, values = [], []
        for layer in range(self.n_layers):
            k = self._keys[layer][r.slot, :r.cached].transpose(0, 1)[None].clone()  # (1, H_kv, n, D)
            v = self._values[layer][r.slot, :r.cached].transpose(0, 1)[None].clone()
            keys.append(k)
            values.append(v)
        self.nodes.append(Node(keys, values, r.offset, r.cached, r.node))
        self._node_bytes += sum(t.numel() * t.element_size() for t in (*keys, *values))
        self.stats.frozen_tokens += r.cached
        self._note_kv_bytes()
        return len(self.nodes) - 1


def _common_prefix(sequences: list[list[int]]) -> int:
    """Length of the longest common prefix of `sequences`."""
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for s in sequences[1:]:
        k = 0
        while k < n and s[k] == first[k]:
            k += 1
        n = k
    return n
