"""DTAEngine: the depth-first walk over a prefix tree, forward and backward.

One traversal serves both entry points: [`DTAEngine.logprobs`] (no grad) and [`DTAEngine.forward_backward`]
(training). For each segment of the tree (see `tree.py`):

- **Push** (`_enter`): forward the segment's tokens with the path's keys/values as the attention prefix
  (positions continue the path), score its positions with the LM head, and push its keys/values. In training the
  pushed keys/values and the segment's log-probs/entropies are autograd leaves: descendants accumulate their
  gradients there. The segment's own graph is either kept (*keep* mode) or dropped and recomputed later in blocks
  of `block_size` tokens (*recompute* mode, token-wise checkpointing), chosen per segment from `max_graph_tokens`.
- **Fork logits**: the last position of a segment predicts the first token of each child; its log-prob is scored
  once per child at push time (the hidden state is shared).
- **Visit**: a sequence ending at a segment gets its log-prob vector from the pieces on the path and `loss_fn` is
  called; its backward stops at the leaves (and runs through the segment's own graph for leaf batches).
- **Sibling batching**: the leaf children of a segment (segments without children) are forwarded together, right-
  padded, with the path's keys/values broadcast, at most `max_batch_tokens` padded tokens per forward, and
  back-propagated with one backward call. A leaf's private suffix is thus forwarded exactly once, with grad.
- **Pop** (`_exit`): inject the accumulated gradients of the segment's keys/values and log-probs as the incoming
  gradients of its graph (`torch.autograd.backward(outputs, grads)`); in recompute mode, re-forward the blocks last
  to first with grad, each block's gradient including what later blocks sent to it.

Every shared token is therefore forwarded once and back-propagated once (plus one re-forward in recompute mode), and
the parameter gradients are exactly those of the dense per-sequence computation.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from . import attention
from .attention import AttentionContext
from .kv_stack import Frame, KVStack
from .lm_head import HeadSpec, head_logprobs
from .tree import PrefixTree

logger = logging.getLogger(__name__)

LossFn = Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor]

# Model families whose equivalence with the dense path is covered by the test suite. Others run if their attention
# goes through transformers' AttentionInterface (checked on every forward), with a one-time warning.
TESTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "gemma3", "phi3"})
_UNSUPPORTED_ROPE = frozenset({"dynamic"})
_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg)


@dataclass
class DTAOutput:
    """Result of an engine call.

    Args:
        loss (`torch.Tensor`, *optional*): detached sum of the `loss_fn` values (None for `logprobs`).
        logps (`list[torch.Tensor]`): per sequence, detached, shape `(len_i - 1,)`.
        entropies (`list[torch.Tensor]`, *optional*): per sequence, same shapes, when asked.
        stats (`dict`): tree shape and work done (see [`DTAEngine`]).
    """

    loss: torch.Tensor | None
    logps: list[torch.Tensor]
    entropies: list[torch.Tensor] | None
    stats: dict = field(default_factory=dict)


@dataclass
class _SegState:
    """A segment on the current path: its scored outputs and how to back-propagate it."""

    seg: int
    out_lp: torch.Tensor  # (n_out,) leaf in training: internal targets, then one fork per child
    out_ent: torch.Tensor | None
    n_frames: int
    graph: tuple | None = None  # keep mode: (kv per layer, lp, ent) with autograd history
    blocks: list[tuple[int, int]] | None = None  # recompute mode: block bounds within the segment


def _causal_lm(model):
    """The transformers causal LM inside `model` (unwraps a PEFT model; its LoRA layers stay active)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "get_output_embeddings") or base.get_output_embeddings() is None:
        raise TypeError(f"{type(base).__name__} has no output embeddings: DTAEngine needs a causal language model.")
    return base


class DTAEngine:
    """Dynamic Tree Attention over a Hugging Face decoder-only causal LM.

    Args:
        model (`transformers.PreTrainedModel` or `peft.PeftModel`): the policy. Its attention implementation is switched
            to the engine's only during engine calls; HF gradient checkpointing is suspended during them too (the
            engine's own recompute replaces it).
        block_size (`int`, *optional*, defaults to `1024`): tokens per re-forward block in recompute mode.
        max_batch_tokens (`int`, *optional*, defaults to `8192`): padded-token budget of one forward of sibling leaves.
        max_graph_tokens (`int`, *optional*): memory budget, in tokens of kept autograd graph (the path's kept segments
            plus the running forward). A segment that would exceed it is recomputed in blocks. None keeps every graph
            (fastest: no token is forwarded twice). With `0`, the live graph never exceeds `block_size` tokens (or one
            sibling leaf).
        max_pack_tokens (`int`, *optional*, defaults to `1024`): a subtree of at most this many tokens (and at most
            `max_batch_tokens`) is not walked
            segment by segment but packed into one row of a batched forward (its tokens at their depths, a tree mask
            inside the row): one forward and one backward instead of one per segment, at the price of attention over
            the whole row (`O(n^2)` for `n` packed tokens). Leaves are always batched. `0` walks every internal
            segment.
        lm_head_chunk_size (`int`, *optional*, defaults to `4096`): rows projected through the LM head at once.

    Stats of the last call (`engine.last_stats`, also `DTAOutput.stats`): `sequences`, `tokens`, `tree_tokens`,
    `compression_ratio`, `forward_tokens` (real tokens forwarded, recompute included), `padded_tokens` (with sibling
    padding), `recomputed_tokens`, `scored_positions` (rows projected through the LM head), `peak_graph_tokens`, `forwards`, `backwards`, `seconds`.
    """

    def __init__(
        self,
        model,
        *,
        block_size: int = 1024,
        max_batch_tokens: int = 8192,
        max_graph_tokens: int | None = None,
        max_pack_tokens: int = 1024,
        lm_head_chunk_size: int = 4096,
    ):
        for name, value in (("block_size", block_size), ("max_batch_tokens", max_batch_tokens),
                            ("lm_head_chunk_size", lm_head_chunk_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        if max_graph_tokens is not None and (not isinstance(max_graph_tokens, int) or max_graph_tokens < 0):
            raise ValueError(f"`max_graph_tokens` must be None or a non-negative integer, got {max_graph_tokens!r}")
        if not isinstance(max_pack_tokens, int) or max_pack_tokens < 0:
            raise ValueError(f"`max_pack_tokens` must be a non-negative integer, got {max_pack_tokens!r}")
        self.max_pack_tokens = max_pack_tokens
        self.model = model
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_graph_tokens = max_graph_tokens
        self.lm_head_chunk_size = lm_head_chunk_size
        self.last_stats: dict = {}
        lm = _causal_lm(model)
        self._config = lm.config.get_text_config()
        if getattr(lm.config, "is_encoder_decoder", False):
            raise TypeError("DTAEngine supports decoder-only causal LMs, not encoder-decoder models.")
        self._check_config(self._config)
        self.n_layers = self._config.num_hidden_layers
        attention.register()

    # ------------------------------------------------------------------ model checks and modes

    @staticmethod
    def _check_config(config) -> None:
        model_type = getattr(config, "model_type", "?")
        if model_type not in TESTED_MODEL_TYPES:
            _warn_once(
                f"type:{model_type}",
                f"DTAEngine: model type '{model_type}' is not among the tested families {sorted(TESTED_MODEL_TYPES)}; "
                "it runs if its attention layers use transformers' AttentionInterface.",
            )
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        params = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
        for p in params:
            kind = (p or {}).get("rope_type", (p or {}).get("type"))
            if kind in _UNSUPPORTED_ROPE:
                raise NotImplementedError(
                    f"rope_type '{kind}' rescales positions from the length of each forward call, so a prefix and its "
                    "continuation would use different frequencies; DTA cannot reproduce the dense result. Use a model "
                    "with static RoPE scaling."
                )

    def _lm(self):
        return _causal_lm(self.model)

    @contextlib.contextmanager
    def _dta_mode(self, lm):
        """Route attention through the engine and suspend HF gradient checkpointing, restoring both on exit."""
        configs = {id(m.config): m.config for m in lm.modules() if hasattr(getattr(m, "config", None),
                                                                            "_attn_implementation")}
        configs[id(lm.config)] = lm.config
        saved = {k: c._attn_implementation for k, c in configs.items()}
        checkpointed = [m for m in lm.modules() if getattr(m, "gradient_checkpointing", False) is True]
        if checkpointed:
            _warn_once(
                "ckpt",
                "DTAEngine: HF gradient checkpointing is suspended during engine calls (it drops the key/value prefix); "
                "set `max_graph_tokens` to bound memory with the engine's own recompute instead.",
            )
        try:
            for c in configs.values():
                c._attn_implementation = attention.ATTN_IMPLEMENTATION
            for m in checkpointed:
                m.gradient_checkpointing = False
            yield
        finally:
            for k, c in configs.items():
                c._attn_implementation = saved[k]
            for m in checkpointed:
                m.gradient_checkpointing = True

    def _check_training_mode(self, lm) -> None:
        if not lm.training:
            return
        for name, m in lm.named_modules():
            if isinstance(m, torch.nn.Dropout) and m.p > 0:
                raise ValueError(
                    f"dropout is active in training mode ({name}: p={m.p}); DTA cannot reproduce the random dropout "
                    "masks of the dense path. Set the dropout probabilities to 0 or call model.eval()."
                )
        if getattr(self._config, "attention_dropout", 0.0):
            raise ValueError(
                f"attention_dropout={self._config.attention_dropout} is active in training mode; DTA cannot reproduce "
                "it. Set `attention_dropout=0` in the model config or call model.eval()."
            )

    def _tree(self, seqs) -> PrefixTree:
        tree = seqs if isinstance(seqs, PrefixTree) else PrefixTree.from_sequences(seqs)
        if tree.n_sequences == 0:
            raise ValueError("`seqs` is empty: pass at least one sequence.")
        limit = getattr(self._config, "max_position_embeddings", None)
        if limit is not None and tree.max_path_len > limit:
            i = max(range(tree.n_sequences), key=tree.lengths.__getitem__)
            raise ValueError(
                f"sequence {i} has {tree.lengths[i]} tokens, more than the model's max_position_embeddings ({limit}); "
                "truncate the sequences (e.g. `max_prompt_length` / `max_completion_length`)."
            )
        vocab = self._config.vocab_size
        for i, s in enumerate(tree.seqs):
            if len(s) and (int(s.min()) < 0 or int(s.max()) >= vocab):
                raise ValueError(f"sequence {i} has token ids outside [0, {vocab}) (the model's vocab_size).")
        return tree

    # ------------------------------------------------------------------ public API

    @torch.no_grad()
    def logprobs(self, seqs: Sequence | PrefixTree, *, temperature: float = 1.0, entropy: bool = False,
                 n_scored: int | Sequence[int] | None = None) -> DTAOutput:
        """Per-sequence next-token log-probs (and entropies), without grad.

        Args:
            seqs (`list[torch.LongTensor | list[int]]` or `PrefixTree`): the sequences.
            temperature (`float`, *optional*, defaults to `1.0`): logits are divided by it.
            entropy (`bool`, *optional*, defaults to `False`): also return the entropies.
            n_scored (`int` or `list[int]`, *optional*): how many trailing log-probs each sequence needs (TRL's
                `logits_to_keep`, per sequence: the completion length). Positions no sequence needs are never
                projected through the LM head. None scores all `len_i - 1` positions.

        Returns:
            [`DTAOutput`] with `logps[i][t - 1] = log p(s_i[t] | s_i[:t])` for `t = 1 .. len_i - 1` (only the last
            `n_scored[i]` of them when given).
        """
        tree = self._tree(seqs)
        return _Walk(self, tree, None, temperature, entropy, _n_scored(tree, n_scored)).run()

    def forward_backward(
        self, seqs: Sequence | PrefixTree, loss_fn: LossFn, *, temperature: float = 1.0, entropy: bool = False,
        n_scored: int | Sequence[int] | None = None,
    ) -> DTAOutput:
        """Run `sum_i loss_fn(i, logps_i, entropy_i)` forward and backward through the tree.

        Afterwards every parameter's `.grad` has been increased by exactly what
        `sum_i loss_fn(i, dense_logps_i, dense_entropy_i).backward()` would add.

        Args:
            seqs (`list[torch.LongTensor | list[int]]` or `PrefixTree`): the sequences.
            loss_fn (`Callable[[int, Tensor, Tensor | None], Tensor]`): scalar loss of sequence `i` from its log-probs
                `(len_i - 1,)` and entropies (or None); any differentiable function of the whole vectors.
            temperature (`float`, *optional*, defaults to `1.0`): logits are divided by it.
            entropy (`bool`, *optional*, defaults to `False`): compute entropies and pass them to `loss_fn`.
            n_scored (`int` or `list[int]`, *optional*): as in [`~DTAEngine.logprobs`]; `loss_fn` then receives the
                last `n_scored[i]` log-probs of sequence `i`.

        Returns:
            [`DTAOutput`] with the detached total loss and per-sequence log-probs (and entropies).
        """
        if not callable(loss_fn):
            raise TypeError("`loss_fn` must be a callable (i, logps_i, entropy_i) -> scalar tensor")
        tree = self._tree(seqs)
        return _Walk(self, tree, loss_fn, temperature, entropy, _n_scored(tree, n_scored)).run()


def _n_scored(tree: PrefixTree, n_scored) -> list[int]:
    """Per-sequence number of trailing log-probs, clipped to `len_i - 1`."""
    lengths = tree.lengths
    if n_scored is None:
        return [max(n - 1, 0) for n in lengths]
    if isinstance(n_scored, int):
        n_scored = [n_scored] * len(lengths)
    n_scored = [int(n) for n in n_scored]
    if len(n_scored) != len(lengths):
        raise ValueError(f"`n_scored` has {len(n_scored)} entries for {len(lengths)} sequences")
    if any(n < 0 for n in n_scored):
        raise ValueError("`n_scored` entries must be non-negative")
    return [min(n, max(length - 1, 0)) for n, length in zip(n_scored, lengths)]


def _cat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if not parts:
        return like.new_zeros(0)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _Walk:
    """State of one engine call: the tree, the K/V stack, the path's segment states, results and counters."""

    def __init__(self, engine: DTAEngine, tree: PrefixTree, loss_fn: LossFn | None, temperature: float,
                 entropy: bool, n_scored: list[int]):
        if temperature <= 0:
            raise ValueError(f"`temperature` must be positive, got {temperature}")
        self.e = engine
        self.tree = tree
        self.loss_fn = loss_fn
        self.train = loss_fn is not None
        self.temperature = temperature
        self.want_ent = entropy
        self.lm = engine._lm()
        self.backbone = self.lm.get_decoder()
        self.head = HeadSpec.from_model(self.lm)
        self.device = self.lm.get_output_embeddings().weight.device
        self.stack = KVStack(engine.n_layers)
        self.path: list[_SegState] = []
        segs = tree.segments
        self.tokens = [tree.tokens(s.index).to(self.device) for s in segs]
        # Scored targets. Sequence i needs the log-probs of its tokens at depths >= first[i]; a segment scores a
        # target if some sequence through it needs it. A segment's outputs are its scored internal targets (positions
        # p0[s] .. length-2, each predicting the next token), then one fork per scored child (the child's first
        # token, predicted from the segment's last position).
        self.first = [n - k for n, k in zip(tree.lengths, n_scored)]
        need = [float("inf")] * len(segs)
        for i, s in enumerate(tree.end_segment):
            if s >= 0:
                need[s] = min(need[s], self.first[i])
        for seg in reversed(segs):  # children come after their parent in pre-order
            if seg.parent >= 0:
                need[seg.parent] = min(need[seg.parent], need[seg.index])
        self.p0 = [int(min(max(need[s.index] - s.start - 1, 0), s.length - 1)) for s in segs]
        self.n_internal = [s.length - 1 - self.p0[s.index] for s in segs]
        self.fork_index = [-1] * len(segs)
        self.fork_targets: list[torch.Tensor | None] = [None] * len(segs)
        for s in segs:
            scored = [c for c in s.children if segs[c].start >= need[c]]
            for j, c in enumerate(scored):
                self.fork_index[c] = self.n_internal[s.index] + j
            if scored:
                self.fork_targets[s.index] = torch.stack([self.tokens[c][0] for c in scored])
        self.subtree = tree.subtree_tokens()
        self.n_segs = [1] * len(segs)  # segments in each subtree (a contiguous pre-order range)
        for seg in reversed(segs):
            if seg.parent >= 0:
                self.n_segs[seg.parent] += self.n_segs[seg.index]
        self.logps: list[torch.Tensor | None] = [None] * tree.n_sequences
        self.ents: list[torch.Tensor | None] = [None] * tree.n_sequences
        self.total = None
        self._pending = None  # sum of the losses visited since the last backward
        self.live = 0
        self.stats = dict(forward_tokens=0, padded_tokens=0, recomputed_tokens=0, scored_positions=0,
                          peak_graph_tokens=0, forwards=0, backwards=0)

    # ------------------------------------------------------------------ driver

    def run(self) -> DTAOutput:
        t0 = time.perf_counter()
        if self.train:
            self.e._check_training_mode(self.lm)
        with self.e._dta_mode(self.lm), torch.set_grad_enabled(self.train):
            todo: list[tuple[str, int]] = [("children", -1)]
            while todo:
                kind, s = todo.pop()
                if kind == "enter":
                    self._enter(s)
                elif kind == "exit":
                    self._exit(s)
                else:
                    todo.extend(self._children(s))
            for i in self.tree.empty:
                self._visit(i, -1, self._empty(), self._empty() if self.want_ent else None)
            self._backward_total()
        tree = self.tree
        self.stats.update(sequences=tree.n_sequences, tokens=tree.n_tokens, tree_tokens=tree.n_tree_tokens,
                          compression_ratio=tree.compression_ratio, seconds=time.perf_counter() - t0)
        self.e.last_stats = dict(self.stats)
        loss = None
        if self.train:
            loss = self.total if self.total is not None else torch.zeros((), device=self.device)
        return DTAOutput(loss, self.logps, self.ents if self.want_ent else None, dict(self.stats))

    def _empty(self) -> torch.Tensor:
        dtype = self.lm.get_output_embeddings().weight.dtype
        dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        return torch.zeros(0, device=self.device, dtype=dtype)

    def _children(self, s: int) -> list[tuple[str, int]]:
        """Run the small children of `s` (leaves, and internal subtrees of at most `max_pack_tokens` tokens) as rows
        of batched forwards; return the walk events for the large ones (LIFO order)."""
        segs = self.tree.segments
        kids = self.tree.roots if s < 0 else segs[s].children
        pack = min(self.e.max_pack_tokens, self.e.max_batch_tokens)
        small = sorted((c for c in kids if not segs[c].children or self.subtree[c] <= pack),
                       key=lambda c: self.subtree[c])
        large = [c for c in kids if segs[c].children and self.subtree[c] > pack]
        for batch in self._batches(small):
            c = batch[0]
            if len(batch) == 1 and not self._fits(self.subtree[c]):
                if segs[c].children:
                    large.append(c)  # walk it segment by segment instead of packing it
                else:
                    self._enter(c)  # a leaf too large to keep its graph: recompute mode
                    self._exit(c)
            else:
                self._run_rows(batch)
        events = []
        for c in sorted(large, key=lambda c: self.subtree[c], reverse=True):
            events += [("exit", c), ("children", c), ("enter", c)]
        return events

    def _fits(self, n_tokens: int) -> bool:
        budget = self.e.max_graph_tokens
        return not self.train or budget is None or self.live + n_tokens <= budget

    def _batches(self, rows: list[int]) -> list[list[int]]:
        """Group rows (sorted by size) so that each batch's padded size fits `max_batch_tokens` and the graph budget."""
        out, cur = [], []
        for c in rows:  # sorted: the padded size of a batch is its last row's size times its number of rows
            size = self.subtree[c]
            if cur and ((len(cur) + 1) * size > self.e.max_batch_tokens or not self._fits((len(cur) + 1) * size)):
                out.append(cur)
                cur = []
            cur.append(c)
        if cur:
            out.append(cur)
        return out

    # ------------------------------------------------------------------ model calls

    def _forward(self, ids: torch.Tensor, n_real: int, positions: torch.Tensor | None = None,
                 row_mask: torch.Tensor | None = None):
        """Forward `ids` `(batch, length)` after the current path. Returns hidden `(batch, length, hidden)` and the
        new keys/values per layer, each `(batch, n_kv_heads, length, head_dim)`.

        Without `row_mask` the rows continue the path causally (positions `path_len + arange(length)`). With it (packed
        subtrees) `positions` `(batch, length)` are the tokens' depths and `row_mask` `(batch, length, length)` says
        which tokens of its row each token sees (the path's keys are visible to all)."""
        batch, length = ids.shape
        ctx = AttentionContext(self.stack, row_mask=row_mask, positions=positions)
        start = self.stack.length
        if positions is None:
            positions = torch.arange(start, start + length, device=self.device).expand(batch, length)
        out = self.backbone(input_ids=ids, position_ids=positions, use_cache=False, dta_ctx=ctx)
        if ctx.calls != self.e.n_layers or len(ctx.record) != self.e.n_layers:
            raise NotImplementedError(
                f"{type(self.lm).__name__}: {ctx.calls} attention calls through transformers' AttentionInterface for "
                f"{self.e.n_layers} layers; DTA needs every layer to use it, so this model is not supported."
            )
        self.stats["forwards"] += 1
        self.stats["forward_tokens"] += n_real
        self.stats["padded_tokens"] += batch * length
        graph = self.live + (batch * length if torch.is_grad_enabled() else 0)
        self.stats["peak_graph_tokens"] = max(self.stats["peak_graph_tokens"], graph)
        kv = [ctx.record[layer] for layer in range(self.e.n_layers)]
        return out.last_hidden_state, kv

    def _score(self, hidden: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor):
        """Log-probs (and entropies) of `targets` at rows `positions` of `hidden` `(length, hidden_size)`."""
        self.stats["scored_positions"] += len(targets)
        return head_logprobs(self.head, hidden[positions], targets, temperature=self.temperature,
                             entropy=self.want_ent, chunk_size=self.e.lm_head_chunk_size)

    def _block_targets(self, s: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scored positions (relative to `lo`) and targets of block `[lo, hi)` of segment `s`, in output order:
        internal next tokens, then (if the block ends the segment) the first token of each child."""
        tok, length = self.tokens[s], self.tree.segments[s].length
        first, inner = max(lo, self.p0[s]), min(hi, length - 1)
        pos = torch.arange(first - lo, max(inner - lo, first - lo), device=self.device)
        tgt = tok[first + 1 : max(inner, first) + 1]
        forks = self.fork_targets[s]
        if hi == length and forks is not None:
            pos = torch.cat([pos, torch.full((len(forks),), length - 1 - lo, device=self.device)])
            tgt = torch.cat([tgt, forks])
        return pos, tgt

    def _out_range(self, s: int, lo: int, hi: int) -> tuple[int, int]:
        """Slice of segment `s`'s outputs that block `[lo, hi)` produces."""
        n, p0 = self.n_internal[s], self.p0[s]
        a, b = min(max(lo - p0, 0), n), min(max(hi - p0, 0), n)
        if hi == self.tree.segments[s].length and self.fork_targets[s] is not None:
            b += len(self.fork_targets[s])
        return a, b

    # ------------------------------------------------------------------ push / visit / pop

    def _leaf(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Detached copy that collects gradients (float32 for half precision, so many children sum accurately)."""
        if t is None or not self.train:
            return t
        t = t.detach()
        if t.dtype in (torch.float16, torch.bfloat16):
            t = t.float()
        return t.requires_grad_()

    def _enter(self, s: int) -> None:
        seg = self.tree.segments[s]
        length = seg.length
        if not self.train or self._fits(length):
            hidden, kv = self._forward(self.tokens[s][None], length)
            lp, ent = self._score(hidden[0], *self._block_targets(s, 0, length))
            self.stack.push(Frame([self._leaf(k) for k, _ in kv], [self._leaf(v) for _, v in kv], length))
            graph = (kv, lp, ent) if self.train else None
            state = _SegState(s, self._leaf(lp), self._leaf(ent), 1, graph=graph)
            if self.train:
                self.live += length
        else:
            blocks = [(lo, min(lo + self.e.block_size, length)) for lo in range(0, length, self.e.block_size)]
            lps, ents = [], []
            with torch.no_grad():
                for lo, hi in blocks:
                    hidden, kv = self._forward(self.tokens[s][None, lo:hi], hi - lo)
                    lp, ent = self._score(hidden[0], *self._block_targets(s, lo, hi))
                    lps.append(lp)
                    ents.append(ent)
                    self.stack.push(Frame([self._leaf(k) for k, _ in kv], [self._leaf(v) for _, v in kv], hi - lo))
            ent = torch.cat(ents) if self.want_ent else None
            state = _SegState(s, self._leaf(torch.cat(lps)), self._leaf(ent), len(blocks), blocks=blocks)
        self.path.append(state)
        for i in seg.ends:
            self._visit(i, s, state.out_lp, state.out_ent, ancestors=self.path[:-1])
        self._backward_total()

    def _exit(self, s: int) -> None:
        state = self.path.pop()
        if not self.train:
            for _ in range(state.n_frames):
                self.stack.pop()
            return
        if state.graph is not None:
            frame = self.stack.pop()
            kv, lp, ent = state.graph
            self._inject(frame, kv, (lp, state.out_lp.grad), (ent, None if ent is None else state.out_ent.grad))
            self.live -= self.tree.segments[s].length
            return
        for lo, hi in reversed(state.blocks):
            frame = self.stack.pop()
            hidden, kv = self._forward(self.tokens[s][None, lo:hi], hi - lo)
            lp, ent = self._score(hidden[0], *self._block_targets(s, lo, hi))
            self.stats["recomputed_tokens"] += hi - lo
            a, b = self._out_range(s, lo, hi)
            g_lp = None if state.out_lp.grad is None else state.out_lp.grad[a:b]
            g_ent = None if ent is None or state.out_ent.grad is None else state.out_ent.grad[a:b]
            self._inject(frame, kv, (lp, g_lp), (ent, g_ent))

    def _inject(self, frame: Frame, kv, *outputs) -> None:
        """Back-propagate a segment's graph with the gradients accumulated on its leaves."""
        tensors, grads = [], []
        for (k, v), k_leaf, v_leaf in zip(kv, frame.keys, frame.values):
            for t, leaf in ((k, k_leaf), (v, v_leaf)):
                if leaf.grad is not None and t.requires_grad:  # e.g. frozen first-layer keys under LoRA
                    tensors.append(t)
                    grads.append(leaf.grad.to(t.dtype))
        for t, g in outputs:
            if t is not None and g is not None and t.requires_grad:
                tensors.append(t)
                grads.append(g.to(t.dtype))
        if tensors:
            torch.autograd.backward(tensors, grads)
            self.stats["backwards"] += 1

    def _run_rows(self, roots: list[int]) -> None:
        """Forward small subtrees as the rows of one batch, visit their sequences, back-propagate once.

        Each row holds one subtree in pre-order (a leaf segment is a subtree of one segment), right-padded; its tokens
        sit at their depths and see the path's keys plus their ancestors-or-self in the row (a causal mask for a
        single segment). Every token of the rows is forwarded and back-propagated exactly once."""
        segs, dev = self.tree.segments, self.device
        rows = [list(range(r, r + self.n_segs[r])) for r in roots]
        width = max(self.subtree[r] for r in roots)
        ids = torch.zeros(len(roots), width, dtype=torch.long, device=dev)
        offset = {}  # segment -> (row, column of its first token)
        for b, row in enumerate(rows):
            col = 0
            for g in row:
                offset[g] = (b, col)
                ids[b, col : col + segs[g].length] = self.tokens[g]
                col += segs[g].length
        positions = row_mask = None
        if any(len(row) > 1 for row in rows):
            positions, row_mask = self._row_layout(rows, width)
        hidden, _ = self._forward(ids, sum(self.subtree[r] for r in roots), positions, row_mask)
        # Score every segment's outputs in the standard layout: internal targets, then forks to scored children.
        r_idx, c_idx, tgt, sizes = [], [], [], []
        for g in offset:
            b, col = offset[g]
            pos, t = self._block_targets(g, 0, segs[g].length)
            r_idx.append(torch.full((len(t),), b, device=dev))
            c_idx.append(pos + col)
            tgt.append(t)
            sizes.append(len(t))
        targets = torch.cat(tgt)
        self.stats["scored_positions"] += len(targets)
        lp, ent = head_logprobs(self.head, hidden[torch.cat(r_idx), torch.cat(c_idx)], targets,
                                temperature=self.temperature, entropy=self.want_ent,
                                chunk_size=self.e.lm_head_chunk_size)
        lps = lp.split(sizes)
        ents = ent.split(sizes) if ent is not None else [None] * len(sizes)
        state = {g: _SegState(g, a, e, 0) for g, a, e in zip(offset, lps, ents)}
        for row in rows:
            for g in row:
                chain = []  # segments of this row from its root down to g's parent
                p = segs[g].parent
                while p in state and p >= row[0]:
                    chain.append(state[p])
                    p = segs[p].parent
                for i in segs[g].ends:
                    self._visit(i, g, state[g].out_lp, state[g].out_ent, ancestors=self.path + chain[::-1])
        self._backward_total()

    def _row_layout(self, rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Depths `(batch, width)` and visibility `(batch, width, width)` of packed subtree rows: token j is visible
        to token i when j's segment is an ancestor-or-self of i's (pre-order intervals) and j is not deeper."""
        segs, dev = self.tree.segments, self.device
        batch = len(rows)
        positions = torch.zeros(batch, width, dtype=torch.long, device=dev)
        seg_of = torch.full((batch, width), -1, dtype=torch.long, device=dev)
        for b, row in enumerate(rows):
            col = 0
            for g in row:
                n = segs[g].length
                positions[b, col : col + n] = torch.arange(segs[g].start, segs[g].end, device=dev)
                seg_of[b, col : col + n] = g
                col += n
        n_segs = torch.tensor(self.n_segs, device=dev)
        si, sj = seg_of[:, :, None], seg_of[:, None, :]
        ancestor = (sj <= si) & (si < sj + n_segs[sj.clamp(min=0)]) & (sj >= 0)
        mask = ancestor & (positions[:, None, :] <= positions[:, :, None])
        mask |= torch.eye(width, dtype=torch.bool, device=dev)  # padding sees itself (never an empty softmax row)
        return positions, mask

    def _visit(self, i: int, last_seg: int, last_lp, last_ent, ancestors: Sequence[_SegState] = ()) -> None:
        """Assemble sequence `i`'s scored log-probs (and entropies) from the outputs of the segments on its path
        (`ancestors`, then `last_seg` whose outputs are `last_lp`/`last_ent`), and call the loss."""
        first, segs = self.first[i], self.tree.segments
        lp_parts, ent_parts = [], []

        def take(seg, lp, ent, child):
            a = max(first - segs[seg].start - 1, 0) - self.p0[seg]
            pieces = [(a, self.n_internal[seg])] if a < self.n_internal[seg] else []
            if child >= 0 and segs[seg].end >= first:
                pieces.append((self.fork_index[child], self.fork_index[child] + 1))
            for x, y in pieces:
                lp_parts.append(lp[x:y])
                if self.want_ent:
                    ent_parts.append(ent[x:y])

        for k, a in enumerate(ancestors):
            take(a.seg, a.out_lp, a.out_ent, ancestors[k + 1].seg if k + 1 < len(ancestors) else last_seg)
        if last_seg >= 0:
            take(last_seg, last_lp, last_ent, -1)
        lp = _cat(lp_parts, last_lp)
        ent = _cat(ent_parts, last_lp) if self.want_ent else None
        self.logps[i] = lp.detach()
        if self.want_ent:
            self.ents[i] = ent.detach()
        if self.train:
            loss = self.loss_fn(i, lp, ent)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} for sequence {i}")
            loss = loss.reshape(())
            self.total = loss.detach() if self.total is None else self.total + loss.detach()
            self._pending = loss if self._pending is None else self._pending + loss

    def _backward_total(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and pending.requires_grad:
            pending.backward()
            self.stats["backwards"] += 1
