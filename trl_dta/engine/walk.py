"""The depth-first walk of one engine call: push, visit, pop, gradient injection and recompute.

The walk executes the op stream of `ops.py` (`walk_ops`: what runs, in which order, kept or recomputed) and what the
[`ScorePlan`] scores, over a model whose attention is already routed to DTA (the engine's job), and returns its
results and counters in a [`WalkResult`]; it decides no order itself (`memory.py` replays the same stream). One rule
is applied on both sides: a hybrid's one-token forward after a path is padded to two tokens (`_forward`, and the
stream's `Forward.length`), which `tests/engine/test_ops.py` holds equal.

Gradient sinks: in training the keys/values pushed on the stack and a segment's scored log-probs/entropies are
detached copies that require grad (`_grad_sink`); every descendant's backward accumulates into their `.grad`, and
popping the segment injects those sums into the segment's own graph (`_inject`).

Precision (`precision.py`): the whole walk runs under the autocast of the dense forward it reproduces
([`Precision.forward`]), recomputed blocks included; `loss_fn` and every backward call run with autocast off
([`Precision.outside`]), as TRL computes its loss and `accelerator.backward` runs outside `accelerator.autocast()`.

MoE router loss (`router_loss.py`): with a `router`, each forward hands its tokens' tree indices to it; in training the
scalar router term it returns joins the forward's own backward (the segment's `_inject`, or the rows' pending loss).

Lockstep (`lockstep`, for a model sharded layer by layer across processes: FSDP2's and ZeRO-3's per-layer schedules):
every process must make the same sequence of model forwards and backwards, because each layer's forward and backward
is a collective. The walk then runs the roots' subtrees as rows only (`ops.lockstep_batches`), one forward and, in
training, one backward per batch that enters every layer through its output (a zero multiple of the last hidden
state joins the loss), and `lockstep(n)`'s count, the largest of the processes', minus its own as idle batches (one
padding token, no loss).

Hybrid models (`recurrent/`, a `layout` with recurrent layers): every forward passes a [`StateCarrier`] as the model's
`cache=`, which hands the recurrent layers the path's states (the top frame's) and records their new ones; a frame
pushes those as sinks beside its keys/values and `_inject` back-propagates their summed gradients with the run's
graph. Such a walk has no tree rows, no shared rows and no lockstep (a recurrence cannot follow a tree mask), and no
one-token segment with children (`PrefixTree.unshared`); a forward of one token after a non-empty path is padded to
two tokens on the right (transformers' layers decode one token with in-place state updates), its states not kept.

Inputs adapter (`inputs`, vision-language models: `vision/inputs.py`): every forward takes `inputs_embeds` and
`position_ids` from `inputs(ids, nodes)` (`nodes`: flat tree-token indices, `-1` for padding); attention keeps depths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .._checks import check_loss_value
from ..kv_stack import Frame, KVStack
from ..modeling.attention import AttentionContext
from ..modeling.lm_head import HeadSpec, head_logprobs
from ..precision import Precision, acc_dtype, is_half
from ..recurrent import LayerLayout, StateCarrier
from ..refusal import Blocker, refuse
from ..tree import PrefixTree
from .ops import Op, Pop, Push, Rows, lockstep_batches, walk_ops
from .plan import ScorePlan
from .rows import pack_rows
from .schedule import Budgets, TreeShape
from .targets import Targets

LossFn = Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor]
Lockstep = Callable[[int], int]  # agree(n): the largest n over the processes (an all-reduce)


@dataclass
class WalkResult:
    """What one walk produced.

    Args:
        logps (`list[torch.Tensor]`): per sequence, its scored log-probs `(n_scored_i,)`, detached.
        entropies (`list[torch.Tensor]`, *optional*): same shapes, when asked.
        loss (`torch.Tensor`, *optional*): detached sum of the `loss_fn` values (training only).
        stats (`dict[str, int]`): work done: `forward_tokens`, `padded_tokens`, `recomputed_tokens`,
            `scored_positions`, `peak_graph_tokens`, `forwards`, `backwards`.
    """

    logps: list[torch.Tensor]
    entropies: list[torch.Tensor] | None
    loss: torch.Tensor | None
    stats: dict = field(default_factory=dict)


@dataclass
class _Outputs:
    """Where a live segment's scored outputs are: `lp[offset : offset + n_outputs]` (and `ent` likewise), inside the
    outputs of the run or the rows that computed it."""

    lp: torch.Tensor  # (n,) the run's gradient sink in training, or the rows' scored log-probs (with their graph)
    ent: torch.Tensor | None
    offset: int


@dataclass
class _RunState:
    """A pushed run: its scored outputs and how to back-propagate it."""

    out_lp: torch.Tensor  # (n_outputs,) gradient sink in training: per segment, internal targets then forks
    out_ent: torch.Tensor | None  # (n_outputs,) or None
    n_frames: int  # frames it pushed on the stack
    graph: tuple | None = None  # keep mode: (kv per layer, states per layer, lp, ent, aux) with autograd history


class TreeWalk:
    """One depth-first traversal of `tree` through `lm` (see the package docstring for the three modes).

    Args:
        lm (`transformers.PreTrainedModel`): the causal LM, attention already switched to DTA.
        layout (`LayerLayout`): its attention and recurrent layers.
        tree (`PrefixTree`), plan (`ScorePlan`): the batch and what to score.
        budgets (`Budgets`): the engine's knobs.
        loss_fn (`LossFn`, *optional*): None for a no-grad call.
        temperature (`float`, *optional*, defaults to `1.0`), entropy (`bool`, *optional*, defaults to `False`): as in
            [`DTAEngine.logprobs`].
        attn_backend (`str`, *optional*, defaults to `"sdpa"`): the attention backend (`modeling/attention.py`).
        precision (`Precision`, *optional*): the autocast of the dense forward; None: the caller's.
        router (`RouterObserver`, *optional*): MoE load-balancing loss (`router_loss.py`): called after every forward
            with its tokens' tree indices; in training, the router term it returns is back-propagated with the
            forward's graph.
        lockstep (`Callable[[int], int]`, *optional*): run in lockstep with other processes (module docstring): called
            once with this walk's number of row batches, returns the number every process runs.
        inputs (`Callable[[Tensor, Tensor], dict]`, *optional*): the inputs adapter (module docstring).
    """

    def __init__(self, lm, layout: LayerLayout, tree: PrefixTree, plan: ScorePlan, budgets: Budgets, *,
                 loss_fn: LossFn | None = None, temperature: float = 1.0, entropy: bool = False,
                 attn_backend: str = "sdpa", precision: Precision | None = None, router=None,
                 lockstep: Lockstep | None = None, inputs=None):
        self.lm = lm
        self.backbone = lm.get_decoder()
        self.head = HeadSpec.from_model(lm)
        self.device = lm.get_output_embeddings().weight.device
        self.precision = precision if precision is not None else Precision.of(device=self.device)
        self.layout = layout
        self.n_layers = layout.n_layers
        self.tree, self.plan, self.budgets = tree, plan, budgets
        self.loss_fn = loss_fn
        self.train = loss_fn is not None
        self.temperature = temperature
        self.want_ent = entropy
        self.attn_backend = attn_backend
        self.router = router
        self.lockstep = lockstep
        self.inputs = inputs
        self.wants_nodes = router is not None or inputs is not None  # forwards pass their tree-token indices on
        self.stack = KVStack(layout.n_layers)
        self.tokens = [tree.tokens(s.index).to(self.device) for s in tree.segments]  # per segment (length,)
        self.targets = Targets(plan, self.tokens)
        self.shape = TreeShape.of(tree)
        self.live_outputs: dict[int, _Outputs] = {}  # segments of the current path and of the running rows
        self.runs: dict[tuple[int, ...], _RunState] = {}  # the pushed runs
        self.logps: list[torch.Tensor | None] = [None] * tree.n_sequences
        self.ents: list[torch.Tensor | None] = [None] * tree.n_sequences
        self.total = None
        self.pending = None  # sum of the losses visited since the last backward
        self.live = 0  # graph tokens kept on the path
        self.stats = dict(forward_tokens=0, padded_tokens=0, recomputed_tokens=0, scored_positions=0,
                          peak_graph_tokens=0, forwards=0, backwards=0, idle_batches=0)

    def run(self) -> WalkResult:
        with torch.set_grad_enabled(self.train), self.precision.forward():
            agreed = None
            if self.lockstep is not None:  # never for a hybrid (`DTAEngine` refuses it)
                agreed = int(self.lockstep(len(lockstep_batches(self.tree, self.budgets, train=self.train))))
            for op in walk_ops(self.tree, self.budgets, train=self.train, hybrid=self.layout.hybrid,
                               lockstep=agreed):
                self._execute(op)
            for i in self.tree.empty:
                self._visit(i)
            self._backward_pending()
        loss = None
        if self.train:
            loss = self.total if self.total is not None else torch.zeros((), device=self.device)
        return WalkResult(self.logps, self.ents if self.want_ent else None, loss, dict(self.stats))

    def _execute(self, op: Op) -> None:
        """The tensor work of one op of the schedule (`ops.py`)."""
        if isinstance(op, Rows):
            self._run_rows(op.rows)
        elif isinstance(op, Push):
            self._push(op.segments, op.blocks)
        elif isinstance(op, Pop):
            self._pop(op.segments, op.blocks)
        else:
            self._idle_batch()

    def _idle_batch(self) -> None:
        """A forward (and backward) that computes nothing, so that the layers' collectives match the other
        processes': one padding token at position 0, no loss; a router sees it as padding."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        nodes = torch.full((1, 1), -1, dtype=torch.long, device=self.device) if self.wants_nodes else None
        hidden, _, _, aux = self._forward(ids, 0, nodes)
        self.stats["idle_batches"] += 1
        if self.train:
            self.pending = _zero_multiple(hidden) if aux is None else _zero_multiple(hidden) + aux * 0
            self._backward_pending()

    # ------------------------------------------------------------------ model calls

    def _forward(self, ids: torch.Tensor, n_real: int, nodes: torch.Tensor | None,
                 positions: torch.Tensor | None = None, key_end: torch.Tensor | None = None, spans=None):
        """Forward `ids` `(batch, length)` after the current path; `nodes` `(batch, length)` are their flat tree-token
        indices (`-1` for padding). Returns hidden `(batch, length, hidden)`, the new keys/values per layer, each
        `(batch, n_kv_heads, length, head_dim)` (None for a layer without attention), the new recurrent states per
        layer (`StateCarrier.states`; None for an attention-only model, or when a padded one-token forward's states
        are not kept), and the router term of the forward (None without one).

        Without `key_end` the rows continue the path causally (positions `path_len + arange(length)`). With it
        (packed rows) `positions` `(batch, length)` are the tokens' depths and `key_end` `(batch, length)` says which
        tokens of its row see each token (`rows.py`; the path's keys are visible to all), and `spans` the column ranges
        of a shared row's subtrees."""
        batch, length = ids.shape
        pad = self.layout.hybrid and length == 1 and self.stack.frames  # see the module docstring
        if pad:
            ids = torch.nn.functional.pad(ids, (0, 1))  # (batch, 2): one padding column on the right
            nodes = None if nodes is None else torch.nn.functional.pad(nodes, (0, 1), value=-1)
            length = 2
        ctx = AttentionContext(self.stack, positions=positions, key_end=key_end, backend=self.attn_backend,
                               spans=spans)
        if positions is None:
            start = self.stack.length
            positions = torch.arange(start, start + length, device=self.device).expand(batch, length)
        carrier = None
        if self.layout.hybrid:
            carrier = StateCarrier(self.layout, self.stack.states, batch, length, self.stack.length)
        model_inputs = {"input_ids": ids, "position_ids": positions} if self.inputs is None else self.inputs(ids, nodes)
        out = self.backbone(**model_inputs, use_cache=False, dta_ctx=ctx,
                            **({"cache": carrier} if carrier is not None else {}))
        attention = self.layout.attention
        if ctx.calls != len(attention) or sorted(ctx.record) != list(attention):
            refuse(type(self.lm).__name__, [Blocker(
                f"{ctx.calls} attention calls through transformers' AttentionInterface, from layers "
                f"{sorted(ctx.record)}, for the attention layers {list(attention)}; DTA needs every attention layer to "
                "use it once")])
        states = carrier.states() if carrier is not None else None
        self.stats["forwards"] += 1
        self.stats["forward_tokens"] += n_real
        self.stats["padded_tokens"] += batch * length
        graph = self.live + (batch * length if torch.is_grad_enabled() else 0)
        self.stats["peak_graph_tokens"] = max(self.stats["peak_graph_tokens"], graph)
        aux = self.router.observe(nodes) if self.router is not None else None
        hidden = out.last_hidden_state
        kv = [ctx.record.get(layer) for layer in range(self.n_layers)]
        if pad:
            hidden = hidden[:, :1]
            kv = [None if t is None else (t[0][:, :, :1], t[1][:, :, :1]) for t in kv]
            states = None
        return hidden, kv, states, aux

    def _nodes(self, run: tuple[int, ...], lo: int, hi: int) -> torch.Tensor | None:
        """Flat tree-token indices `(1, hi - lo)` of tokens `lo .. hi - 1` of a run (consecutive segments in pre-order:
        consecutive tree tokens), None without a router term or an inputs adapter: nobody needs them."""
        if not self.wants_nodes:
            return None
        offset = self.tree.segments[run[0]].offset
        return torch.arange(offset + lo, offset + hi, device=self.device)[None]

    def _score(self, hidden: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor):
        """Log-probs (and entropies) `(n,)` of `targets` `(n,)` at `positions` `(n,)` of `hidden` `(length, d)`."""
        self.stats["scored_positions"] += len(targets)
        return head_logprobs(self.head, hidden[positions], targets, temperature=self.temperature,
                             entropy=self.want_ent, chunk_size=self.budgets.lm_head_chunk_size)

    # ------------------------------------------------------------------ push / visit / pop

    def _grad_sink(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Detached copy that collects gradients (float32 for half precision, so many children sum accurately)."""
        if t is None or not self.train:
            return t
        t = t.detach()
        if is_half(t.dtype):
            t = t.float()
        return t.requires_grad_()

    def _push_frame(self, kv, length: int, states) -> None:
        keys = [None if t is None else self._grad_sink(t[0]) for t in kv]
        values = [None if t is None else self._grad_sink(t[1]) for t in kv]
        if states is not None:
            states = [None if t is None else tuple(self._grad_sink(x) for x in t) for t in states]
        self.stack.push(Frame(keys, values, length, states))

    def _push(self, run: tuple[int, ...], blocks: tuple[tuple[int, int], ...] | None) -> None:
        """Forward a run (consecutive segments, each the only child of the one before) after the path (keep mode,
        `blocks` None; or no-grad `blocks` over the run in recompute mode) and visit the sequences that end in it."""
        length = sum(self.shape.lengths[s] for s in run)
        ids = self.targets.ids(run)  # (length,)
        if blocks is None:
            hidden, kv, states, aux = self._forward(ids[None], length, self._nodes(run, 0, length))
            pos, tgt, _, _ = self.targets.run(run, 0, length)
            lp, ent = self._score(hidden[0], pos, tgt)
            self._push_frame(kv, length, states)
            graph = (kv, states, lp, ent, aux) if self.train else None
            state = _RunState(self._grad_sink(lp), self._grad_sink(ent), 1, graph=graph)
            if self.train:
                self.live += length
        else:
            lps, ents = [], []
            with torch.no_grad():
                for lo, hi in blocks:
                    hidden, kv, states, _ = self._forward(ids[None, lo:hi], hi - lo, self._nodes(run, lo, hi))
                    pos, tgt, _, _ = self.targets.run(run, lo, hi)
                    lp, ent = self._score(hidden[0], pos, tgt)
                    lps.append(lp)
                    ents.append(ent)
                    self._push_frame(kv, hi - lo, states)
            ent = torch.cat(ents) if self.want_ent else None
            state = _RunState(self._grad_sink(torch.cat(lps)), self._grad_sink(ent), len(blocks))
        self.runs[run] = state
        offset = 0
        for s in run:
            self.live_outputs[s] = _Outputs(state.out_lp, state.out_ent, offset)
            offset += self.plan.n_outputs(s)
        for s in run:
            for i in self.tree.segments[s].ends:
                self._visit(i)
        self._backward_pending()

    def _pop(self, run: tuple[int, ...], blocks: tuple[tuple[int, int], ...] | None) -> None:
        """Pop a run: inject its accumulated gradients into its graph (recomputing it block by block, last to first,
        in recompute mode: `blocks`, as pushed)."""
        state = self.runs.pop(run)
        for s in run:
            del self.live_outputs[s]
        if not self.train:
            for _ in range(state.n_frames):
                self.stack.pop()
            return
        if blocks is None:
            frame = self.stack.pop()
            kv, states, lp, ent, aux = state.graph
            self._inject(frame, kv, states, (lp, state.out_lp.grad),
                         (ent, None if ent is None else state.out_ent.grad), _unit(aux))
            self.live -= sum(self.shape.lengths[s] for s in run)
            return
        ids = self.targets.ids(run)  # (length,)
        for lo, hi in reversed(blocks):
            frame = self.stack.pop()
            hidden, kv, states, aux = self._forward(ids[None, lo:hi], hi - lo, self._nodes(run, lo, hi))
            pos, tgt, a, b = self.targets.run(run, lo, hi)
            lp, ent = self._score(hidden[0], pos, tgt)
            self.stats["recomputed_tokens"] += hi - lo
            g_lp = None if state.out_lp.grad is None else state.out_lp.grad[a:b]
            g_ent = None if ent is None or state.out_ent.grad is None else state.out_ent.grad[a:b]
            self._inject(frame, kv, states, (lp, g_lp), (ent, g_ent), _unit(aux))

    def _inject(self, frame: Frame, kv, states, *outputs) -> None:
        """Back-propagate a segment's graph with the gradients accumulated on its sinks (keys/values, recurrent
        states, scored outputs)."""
        pairs = []
        for t, k_sink, v_sink in zip(kv, frame.keys, frame.values):
            if t is not None:
                pairs += [(t[0], k_sink), (t[1], v_sink)]
        if states is not None and frame.states is not None:
            for layer_states, sinks in zip(states, frame.states):
                if layer_states is not None:
                    pairs += [(t, sink) for t, sink in zip(layer_states, sinks) if t is not None]
        tensors, grads = [], []
        for t, sink in pairs:
            if sink.grad is not None and t.requires_grad:  # e.g. frozen first-layer keys under LoRA
                tensors.append(t)
                grads.append(sink.grad.to(t.dtype))
        for t, g in outputs:
            if t is not None and g is not None and t.requires_grad:
                tensors.append(t)
                grads.append(g.to(t.dtype))
        if tensors:
            with self.precision.outside():
                torch.autograd.backward(tensors, grads)
            self.stats["backwards"] += 1

    def _run_rows(self, rows: tuple[tuple[int, ...], ...]) -> None:
        """Forward subtrees as the rows of one batch (`rows.py`: each row the subtrees of its roots side by side),
        visit their sequences, back-propagate once. Every token of the rows is forwarded and back-propagated exactly
        once."""
        segs = self.tree.segments
        packed = pack_rows(self.tree, rows, self.shape, self.tokens, self.device)
        nodes = None
        if self.wants_nodes:
            nodes = torch.full(packed.ids.shape, -1, dtype=torch.long, device=self.device)  # (batch, width)
            for g, (b, col) in packed.columns.items():
                nodes[b, col : col + segs[g].length] = self._nodes((g,), 0, segs[g].length)[0]
        hidden, _, _, aux = self._forward(packed.ids, packed.n_real, nodes, packed.positions, packed.key_end,
                                          packed.spans)
        if aux is not None:
            self.pending = aux if self.pending is None else self.pending + aux
        # Score every segment's outputs in the standard layout: internal targets, then forks to scored children.
        rows_idx, cols, targets, offsets = [], [], [], []
        n = 0
        for g, (b, col) in packed.columns.items():
            pos, tgt = self.targets.segment(g, 0, self.plan.block(g, 0, segs[g].length))
            rows_idx.append(torch.full((len(tgt),), b, device=self.device))
            cols.append(pos + col)
            targets.append(tgt)
            offsets.append(n)
            n += len(tgt)
        targets = torch.cat(targets)  # (n_scored,)
        self.stats["scored_positions"] += len(targets)
        lp, ent = head_logprobs(self.head, hidden[torch.cat(rows_idx), torch.cat(cols)], targets,
                                temperature=self.temperature, entropy=self.want_ent,
                                chunk_size=self.budgets.lm_head_chunk_size)
        for g, offset in zip(packed.columns, offsets):
            self.live_outputs[g] = _Outputs(lp, ent, offset)
        for g in packed.columns:
            for i in segs[g].ends:
                self._visit(i)
        for g in packed.columns:
            del self.live_outputs[g]
        if self.lockstep is not None and self.train:  # the backward reaches every layer through its output
            self.pending = _zero_multiple(hidden) if self.pending is None else self.pending + _zero_multiple(hidden)
        self._backward_pending()

    def _visit(self, i: int) -> None:
        """Assemble sequence `i`'s scored log-probs (and entropies) from the live outputs of its path's segments
        (`ScorePlan.slices`) and add its loss."""
        lp_parts, ent_parts = [], []
        for s, a, b in self.plan.slices(i):
            out = self.live_outputs[s]
            lp_parts.append(out.lp[out.offset + a : out.offset + b])
            if self.want_ent:
                ent_parts.append(out.ent[out.offset + a : out.offset + b])
        lp = self._cat(lp_parts)
        ent = self._cat(ent_parts) if self.want_ent else None
        self.logps[i] = lp.detach()
        if self.want_ent:
            self.ents[i] = ent.detach()
        if self.train:
            with self.precision.outside():
                loss = check_loss_value(self.loss_fn(i, lp, ent), i, self.device)
            self.total = loss.detach() if self.total is None else self.total + loss.detach()
            self.pending = loss if self.pending is None else self.pending + loss

    def _cat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if not parts:  # nothing scored: an empty vector in the dtype log-probs come in
            return torch.zeros(0, device=self.device, dtype=acc_dtype(self.lm.get_output_embeddings().weight.dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _backward_pending(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None and pending.requires_grad:
            with self.precision.outside():
                pending.backward()
            self.stats["backwards"] += 1


def _zero_multiple(hidden: torch.Tensor) -> torch.Tensor:
    """`0 * sum(hidden)` in float32: a term with zero gradient whose backward runs through every layer."""
    return hidden.float().sum() * 0.0


def _unit(t: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`(t, 1)`: a scalar term of a segment's graph back-propagated as it is (the router term), or `(None, None)`."""
    return (t, None) if t is None else (t, torch.ones_like(t))
