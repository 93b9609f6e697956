"""`DTAEngine`: the public entry points, their argument checks, and the model switch around each call.

An engine call (1) validates every argument before any forward, (2) builds the [`PrefixTree`] and the [`ScorePlan`],
(3) takes the model for itself (one engine call per model at a time) and routes its attention to DTA, and (4) runs a
[`TreeWalk`], whose counters become `DTAOutput.stats` and `engine.last_stats`. A call with images (vision-language
models, `vision/`) keys its sequences' image tokens by image, runs the vision tower once per distinct image before the
walk (its inputs adapter) and back-propagates it once after.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

import torch

from .. import _checks, kernels, vision
from ..flops import ModelShape
from ..modeling import attention
from ..modeling.routers import RouterCapture, router_spec
from ..modeling.support import check_model_support, refusal_subject, rope_kinds
from ..modeling.switch import attention_implementation
from ..precision import Precision
from ..recurrent import LayerLayout
from ..refusal import Blocker, refuse
from ..tree import PrefixTree
from .plan import ScorePlan
from .router_loss import LoadBalancing, RouterObserver, new_record, router_weights
from .schedule import DEFAULT_COST, Budgets, RowCost
from .walk import Lockstep, LossFn, TreeWalk

# How an engine user turns off active dropout modules (at call time, in training mode).
_DROPOUT_FIX = Blocker("", fix="set the dropout probabilities to 0, or call `model.eval()`")

# One engine call per model at a time: id(causal LM) -> ident of the thread running a call on it.
_CALLS: dict[int, int] = {}
_CALLS_LOCK = threading.Lock()


@dataclass
class DTAOutput:
    """Result of an engine call.

    Args:
        loss (`torch.Tensor`, *optional*): detached sum of the `loss_fn` values (None for `logprobs`), plus
            `sum_m coefs[m] * router_aux[m]` with a `router_loss`.
        logps (`list[torch.Tensor]`): per sequence, detached, shape `(n_scored_i,)` (`(len_i - 1,)` by default).
        entropies (`list[torch.Tensor]`, *optional*): per sequence, same shapes, when asked.
        stats (`dict`): tree shape and work done (see [`DTAEngine`]).
        router_aux (`torch.Tensor` of shape `(n_groups,)`, *optional*): with a `router_loss`, each group's
            load-balancing loss (without its coefficient), detached: the dense model's `aux_loss` on that group.
    """

    loss: torch.Tensor | None
    logps: list[torch.Tensor]
    entropies: list[torch.Tensor] | None
    stats: dict = field(default_factory=dict)
    router_aux: torch.Tensor | None = None


def _causal_lm(model):
    """The transformers causal LM inside `model` (unwraps a PEFT model; its LoRA layers stay active)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"`model` must be a transformers causal LM (or a PEFT model), got {type(model).__name__}.")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "get_output_embeddings") or base.get_output_embeddings() is None:
        raise TypeError(f"{type(base).__name__} has no output embeddings: DTAEngine needs a causal language model.")
    return base


def _position_table(lm) -> tuple[str, int] | None:
    """`(name, positions)` of a learned absolute position embedding of fixed size, if the model has one."""
    inputs = lm.get_input_embeddings()
    for name, module in lm.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Embedding) and module is not inputs and ("pos" in leaf or leaf == "wpe"):
            return name, module.num_embeddings - getattr(module, "offset", 0)
    return None


class DTAEngine:
    """Dynamic Tree Attention over a Hugging Face decoder-only causal LM.

    Args:
        model (`transformers.PreTrainedModel` or `peft.PeftModel`): the policy. Its attention implementation is switched
            to the engine's only during engine calls; HF gradient checkpointing is suspended during them too (the
            engine's own recompute replaces it). One engine call per model at a time: a second call on the same model
            while one runs (from `loss_fn`, or from another thread) raises a `RuntimeError`, and so does any other
            forward of the model during a call (run it before or after).
        block_size (`int`, *optional*, defaults to `1024`): tokens per re-forward block in recompute mode.
        max_batch_tokens (`int`, *optional*, defaults to `8192`): padded-token budget of one batched forward of rows
            (sibling leaves and packed subtrees).
        max_graph_tokens (`int`, *optional*): memory budget, in tokens of kept autograd graph (the path's kept segments
            plus the running forward). A segment that would exceed it is recomputed in blocks. None keeps every graph
            (fastest: no token is forwarded twice). With `0`, the live graph never exceeds `block_size` tokens (or one
            sibling leaf).
        max_pack_tokens (`int`, *optional*): tree rows. A branching subtree may run as one row of a batched forward
            (its tokens at their depths, a tree mask inside the row) instead of being walked: one forward and one
            backward instead of one per walked run, at the price of attention over the whole row (`O(n^2)` for `n`
            packed tokens, the masked pairs included); rows shared by several subtrees side by side carry the same
            mask. None (the default): the schedule's cost model decides, from the model's shape and device
            (`engine/schedule.py`: linear work per token, attention per query-key pair, a fixed cost per model call;
            on a CPU a walk mostly wins, on a GPU, where a call costs thousands of tokens' work, packing does). An
            int: pack every branching subtree of at most this many tokens (and at most `max_batch_tokens`). `0`: no
            tree row (every branching subtree walked, one chain per row). Chains (subtrees that never branch: leaves,
            the per-turn rows of an episode) always run as causal rows, up to `max_batch_tokens`.
        lm_head_chunk_size (`int`, *optional*, defaults to `4096`): rows projected through the LM head at once, at most
            `lm_head.MAX_TILE_LOGITS // vocab_size` (a tile holds at most 2**24 logits: 110 rows for a 152k vocabulary).
        attn_backend (`str`, *optional*, defaults to `"auto"`): the attention kernels (`trl_dta.modeling.attention`
            has the table). `"sdpa"`: the reference, which concatenates the path in front of every row (the path's
            keys and values held once per row of a batched forward); `"torch"`, `"flash"`, `"triton"`: two-part
            attention, the path stored once and attended by all rows in one call, merged with the rows' own part by
            log-sum-exp; `"auto"`: the fastest exact backend on the model's device (CPU: `"torch"`; CUDA: `"flash"`
            when flash-attn is installed, else `"torch"`). All are exact; an unavailable choice is refused here.

    Lockstep (the calls' `lockstep` argument; `engine.lockstep`, defaults to `None`, is its default): for a model whose
    layers are sharded across processes and gathered inside each forward and backward (FSDP2's per-layer schedule,
    `parallel/fsdp2.py`, whose `engine_call` context yields the argument), every process must make the same model
    calls. Pass a function `agree(n) -> int` that returns the largest `n` over the processes (an all-reduce); the call
    then runs its tree as batches of packed subtree rows, as many as every process runs (`engine/walk.py`,
    "Lockstep"; stat `idle_batches`). Exact like every schedule.

    Hybrid models (recurrent layers beside attention, the hybrid rows of `modeling.FAMILIES`): the recurrent layers'
    states are carried along the tree (`engine.layout`); `max_pack_tokens` has no effect on them (a recurrence cannot
    follow a tree mask, so every internal segment is walked and only leaves are batched) and `lockstep` is refused.

    Precision: each call runs the model under the autocast its dense forward would run under, the caller's (e.g.
    `accelerator.autocast()`) or the one accelerate's mixed-precision wrapper puts around a prepared model's forward
    (`trl_dta.precision`); the loss and the backward run outside autocast, as `accelerator.backward` does.

    Vision-language models (the rows of `vision.VISION_FAMILIES` without a rule: Qwen2-VL, Qwen2.5-VL): the calls'
    `images` argument gives each sequence's images; the sequences hold the processor's ids, each image's placeholder
    token repeated once per image token. The engine keys every image token by its image (`vision.key_images`), so the
    tree shares an image's tokens exactly where the images are equal, runs the vision tower once per distinct image,
    numbers the tree tokens with the model's M-RoPE positions, and sums the gradients of every sequence on the
    tower's output before back-propagating it once (`vision/inputs.py`). Images must lie outside the scored tokens
    (in the prompt). Without `images` a vision-language model runs text-only sequences as any causal LM.

    Stats of the last call (`engine.last_stats`, also `DTAOutput.stats`): `sequences`, `tokens`, `tree_tokens`,
    `compression_ratio`, `forward_tokens` (real tokens forwarded, recompute included), `padded_tokens` (with row
    padding), `recomputed_tokens`, `scored_positions` (rows projected through the LM head), `peak_graph_tokens`,
    `forwards`, `backwards`, `idle_batches` (lockstep batches without work), `seconds`; with images, `images`
    (distinct images through the tower), `image_tokens` (their tokens) and `image_rows` (images over all sequences:
    what the dense path runs the tower on). `tokens` and `tree_tokens` count image tokens like text tokens.
    """

    def __init__(self, model, *, block_size: int = 1024, max_batch_tokens: int = 8192,
                 max_graph_tokens: int | None = None, max_pack_tokens: int | None = None,
                 lm_head_chunk_size: int = 4096,
                 attn_backend: str = "auto"):
        self.block_size = _checks.check_int("block_size", block_size, minimum=1)
        self.max_batch_tokens = _checks.check_int("max_batch_tokens", max_batch_tokens, minimum=1)
        self.max_graph_tokens = _checks.check_int("max_graph_tokens", max_graph_tokens, minimum=0, allow_none=True)
        self.max_pack_tokens = _checks.check_int("max_pack_tokens", max_pack_tokens, minimum=0, allow_none=True)
        self.lm_head_chunk_size = _checks.check_int("lm_head_chunk_size", lm_head_chunk_size, minimum=1)
        self.attn_backend = _checks.check_choice("attn_backend", attn_backend, kernels.BACKENDS)
        self.model = model
        self.last_stats: dict = {}
        self.lockstep: Lockstep | None = None  # the calls' default `lockstep` (class docstring)
        lm = _causal_lm(model)
        if getattr(lm.config, "is_encoder_decoder", False):
            raise TypeError("DTAEngine supports decoder-only causal LMs, not encoder-decoder models.")
        self._config = lm.config.get_text_config()
        with _CALLS_LOCK:
            _refuse_running_call(_CALLS.get(id(lm)))  # the probe below runs the model, which a running call holds
        check_model_support(lm, self._precision(lm))  # rules + a 4-token probe against the dense forward
        self._device_backend(lm)  # an unavailable backend is refused here, not at the first call
        self.n_layers = self._config.num_hidden_layers
        self.layout = LayerLayout.from_config(self._config)
        self.vision = vision.spec_of(lm)  # None: no vision tower, or one whose images DTA does not run
        attention.register()

    def _precision(self, lm) -> Precision:
        """The autocast `model(...)` would run under now: accelerate's wrapper of the model's forward, else the
        caller's (`precision.py`)."""
        return Precision.of(self.model, lm, device=lm.get_output_embeddings().weight.device)

    def row_cost(self, lm=None) -> RowCost:
        """The cost model that lays out this engine's rows (`engine/schedule.py`): the model's shape on its device,
        with the threads torch runs on a CPU (the generic [`DEFAULT_COST`] for a config the FLOP count cannot read)."""
        device = (_causal_lm(self.model) if lm is None else lm).get_output_embeddings().weight.device
        try:
            return RowCost.from_shape(ModelShape.from_config(self._config), device.type, torch.get_num_threads())
        except (ValueError, TypeError, AttributeError):
            return DEFAULT_COST

    def _device_backend(self, lm) -> str:
        """The concrete backend `attn_backend` means on the model's device ("auto" resolved)."""
        device = lm.get_output_embeddings().weight.device
        try:
            return kernels.resolve_backend(self.attn_backend, device)
        except ValueError as exc:
            raise ValueError(f"`attn_backend`: {exc}") from None

    # ------------------------------------------------------------------ public API

    @torch.no_grad()
    def logprobs(self, seqs: Iterable | PrefixTree, *, temperature: float = 1.0, entropy: bool = False,
                 n_scored: int | Sequence[int] | None = None,
                 router_loss: LoadBalancing | None = None, lockstep: Lockstep | None = None,
                 images: Sequence[vision.ImageInputs | None] | vision.ImageTable | None = None) -> DTAOutput:
        """Per-sequence next-token log-probs (and entropies), without grad.

        Args:
            seqs (iterable of `torch.LongTensor | list[int]`, or `PrefixTree`): the sequences (see
                [`PrefixTree.from_sequences`] for what is accepted; for a padded batch pass
                `PrefixTree.from_padded(input_ids, attention_mask)`).
            temperature (`float`, *optional*, defaults to `1.0`): logits are divided by it (finite, > 0).
            entropy (`bool`, *optional*, defaults to `False`): also return the entropies.
            n_scored (`int` or `list[int]`, *optional*): how many trailing log-probs each sequence needs (TRL's
                `logits_to_keep`, per sequence: the completion length), clipped to `len_i - 1`. Positions no sequence
                needs are never projected through the LM head. None scores all `len_i - 1` positions.
            router_loss (`LoadBalancing`, *optional*): MoE models: also return each group's load-balancing loss
                (`DTAOutput.router_aux`; counted in the same walk, no extra forward).
            lockstep (`Callable[[int], int]`, *optional*): run in lockstep with the other processes (class docstring);
                defaults to `engine.lockstep`.
            images (`list[ImageInputs | None]` or `ImageTable`, *optional*): vision-language models: each sequence's
                images (class docstring), None for a sequence without (with a `PrefixTree`, in the order of its
                `seqs`); or the `ImageTable` of sequences already keyed by `vision.key_images`.

        Returns:
            [`DTAOutput`] with `logps[i][t - 1] = log p(s_i[t] | s_i[:t])` for `t = 1 .. len_i - 1` (only the last
            `n_scored[i]` of them when given).
        """
        return self._call(seqs, loss_fn=None, temperature=temperature, entropy=entropy, n_scored=n_scored,
                          router_loss=_router_request(router_loss), lockstep=lockstep, images=images)

    def forward_backward(self, seqs: Iterable | PrefixTree, loss_fn: LossFn, *, temperature: float = 1.0,
                         entropy: bool = False, n_scored: int | Sequence[int] | None = None,
                         router_loss: LoadBalancing | None = None, lockstep: Lockstep | None = None,
                         images: Sequence[vision.ImageInputs | None] | vision.ImageTable | None = None) -> DTAOutput:
        """Run `sum_i loss_fn(i, logps_i, entropy_i)` forward and backward through the tree.

        Afterwards every parameter's `.grad` has been increased by exactly what
        `sum_i loss_fn(i, dense_logps_i, dense_entropy_i).backward()` would add.

        Args:
            seqs (iterable of `torch.LongTensor | list[int]`, or `PrefixTree`): the sequences.
            loss_fn (`Callable[[int, Tensor, Tensor | None], Tensor]`): scalar loss of sequence `i` from its log-probs
                `(n_scored_i,)` and entropies (or None); any differentiable function of the whole vectors, on the
                model's device. It must not call the model or the engine (the model is in DTA mode during the call).
            temperature (`float`, *optional*, defaults to `1.0`): logits are divided by it (finite, > 0).
            entropy (`bool`, *optional*, defaults to `False`): compute entropies and pass them to `loss_fn`.
            n_scored (`int` or `list[int]`, *optional*): as in [`~DTAEngine.logprobs`]; `loss_fn` then receives the
                last `n_scored[i]` log-probs of sequence `i`.
            router_loss (`LoadBalancing`, *optional*): MoE models: also back-propagate `sum_m coefs[m] * aux_m`, the
                load-balancing loss of each group of sequences as transformers computes it on the group's padded
                batch (`router_loss.py`; costs one no-grad forward over the tree, without the LM head, first).
            lockstep (`Callable[[int], int]`, *optional*): as in [`~DTAEngine.logprobs`].
            images (`list[ImageInputs | None]`, *optional*): as in [`~DTAEngine.logprobs`]; the gradients reach the
                vision tower and projector (their trainable parameters).

        Returns:
            [`DTAOutput`] with the detached total loss and per-sequence log-probs (and entropies).
        """
        if not callable(loss_fn):
            raise TypeError(
                f"`loss_fn` must be a callable (i, logps_i, entropy_i) -> scalar tensor, got {type(loss_fn).__name__}."
            )
        return self._call(seqs, loss_fn=loss_fn, temperature=temperature, entropy=entropy, n_scored=n_scored,
                          router_loss=_router_request(router_loss), lockstep=lockstep, images=images)

    # ------------------------------------------------------------------ one call

    def _call(self, seqs, *, loss_fn: LossFn | None, temperature: float, entropy: bool, n_scored,
              router_loss: LoadBalancing | None, lockstep: Lockstep | None, images=None) -> DTAOutput:
        t0 = time.perf_counter()
        lockstep = self.lockstep if lockstep is None else lockstep
        temperature = _checks.check_float("temperature", temperature, minimum=0.0, exclusive=True)
        entropy = _checks.check_bool("entropy", entropy)
        lm = _causal_lm(self.model)
        tree, table = self._tree(seqs, lm, images)
        walked = tree
        if self.layout.hybrid:
            self._refuse_lockstep(lockstep)
            walked = tree.unshared(min_length=2)  # no one-token continuation of a path (`walk.py`)
        scored = _n_scored(tree, n_scored)
        if table is not None:
            vision.check_call(lm, tree, scored, table, lockstep is not None)
        plan = ScorePlan(walked, scored)
        if loss_fn is not None:
            _checks.check_no_dropout(lm, refusal_subject(lm), _DROPOUT_FIX)
        # Hybrid models: no tree rows (a recurrence cannot follow a tree mask); chains still run as causal rows.
        pack = 0 if self.layout.hybrid else self.max_pack_tokens
        budgets = Budgets(block_size=self.block_size, max_batch_tokens=self.max_batch_tokens,
                          max_graph_tokens=self.max_graph_tokens, max_pack_tokens=pack,
                          lm_head_chunk_size=self.lm_head_chunk_size, cost=self.row_cost(lm))
        spec = None
        if router_loss is not None:
            spec = router_spec(lm)
            router_loss.check(tree.n_sequences)
        aux, counted, record = None, {}, None
        tower = self.vision.family.tower(lm) if self.vision is not None else None
        with _engine_call(lm, self.max_graph_tokens is not None, keep=tower), \
                (RouterCapture(lm, spec) if spec else contextlib.nullcontext()) as capture:
            backend = self._device_backend(lm)
            inputs = None  # the walk's inputs adapter: the vision tower runs here, once per distinct image
            if table is not None and table.n_tokens:
                inputs = vision.VisionInputs(lm, self.vision, walked, table, train=loss_fn is not None,
                                             precision=self._precision(lm))
            observer = None
            if spec is not None and loss_fn is not None:  # training: the counting pass first
                observer, aux, counted = self._router_counts(lm, walked, budgets, backend, spec, capture, router_loss,
                                                             lockstep, inputs)
            elif spec is not None:  # no grad: the walk itself counts
                record = new_record(walked, spec, lm.dtype, lm.get_output_embeddings().weight.device)
                observer = RouterObserver(capture, spec, record=record)
            result = TreeWalk(lm, self.layout, walked, plan, budgets, loss_fn=loss_fn, temperature=temperature,
                              entropy=entropy, attn_backend=backend, precision=self._precision(lm), router=observer,
                              lockstep=lockstep, inputs=inputs).run()
            if inputs is not None:
                result.stats["backwards"] += int(inputs.backward())  # the tower, once, with every sequence's gradient
                result.stats.update(inputs.stats)
        if record is not None:
            aux = router_weights(record, walked, router_loss, spec.n_experts).aux
        elif aux is not None:
            coefs = torch.tensor([float(c) for c in router_loss.coefs], dtype=aux.dtype, device=aux.device)
            result.loss = result.loss + (coefs * aux).sum().to(result.loss.device, result.loss.dtype)
        for key in ("forward_tokens", "padded_tokens", "forwards", "idle_batches"):  # the counting pass's too
            result.stats[key] += counted.get(key, 0)
        stats = {**result.stats, "sequences": tree.n_sequences, "tokens": tree.n_tokens,
                 "tree_tokens": tree.n_tree_tokens, "compression_ratio": tree.compression_ratio,
                 "seconds": time.perf_counter() - t0}
        self.last_stats = dict(stats)
        return DTAOutput(result.loss, result.logps, result.entropies, stats, aux)

    def _router_counts(self, lm, tree: PrefixTree, budgets: Budgets, backend: str, spec, capture, request,
                       lockstep: Lockstep | None, inputs=None):
        """The counting pass of the load-balancing loss (`router_loss.py`): a no-grad walk without the LM head.
        Returns the training walk's observer, each group's loss value `(n_groups,)` and the pass's counters."""
        device = lm.get_output_embeddings().weight.device
        record = new_record(tree, spec, lm.dtype, device)
        counting = RouterObserver(capture, spec, record=record)
        plan = ScorePlan(tree, [0] * tree.n_sequences)
        with torch.no_grad():
            walk = TreeWalk(lm, self.layout, tree, plan, budgets, attn_backend=backend,  # no grad, log-probs only
                             precision=self._precision(lm), router=counting, lockstep=lockstep, inputs=inputs)
            stats = walk.run().stats
        weights = router_weights(record, tree, request, spec.n_experts)
        return RouterObserver(capture, spec, weights=weights.weights), weights.aux, stats

    def _refuse_lockstep(self, lockstep: Lockstep | None) -> None:
        if lockstep is not None:
            refuse(f"DTAEngine.lockstep with {refusal_subject(_causal_lm(self.model))}", [Blocker(
                f"it has recurrent layers {list(self.layout.recurrent)}, which cannot run the lockstep walk's packed "
                "subtree rows (a recurrence cannot follow a tree mask)",
                fix="leave `lockstep` unset (under FSDP2: the trainers' `dta_fsdp_schedule='window'`)")])

    def _tree(self, seqs, lm, images=None) -> tuple[PrefixTree, vision.ImageTable | None]:
        """The batch as a tree (its image tokens keyed by image, with the table of distinct images, when `images` are
        given), refused before any forward if the dense model could not run it."""
        table = None
        if images is not None:
            seqs, table = vision.keyed_batch(lm, self.vision, seqs, images)
        if not isinstance(seqs, PrefixTree):
            seqs = PrefixTree.from_sequences(seqs)
        tree = seqs
        if tree.n_sequences == 0:
            raise ValueError("`seqs` is empty: pass at least one sequence.")
        vocab = self._config.vocab_size
        limit = vocab + (table.n_tokens if table is not None else 0)
        for i, s in enumerate(tree.seqs):
            if len(s) and (int(s.min()) < 0 or int(s.max()) >= limit):
                keys = f" and the {table.n_tokens} image keys above it" if table is not None else ""
                raise ValueError(f"`seqs[{i}]` has token ids outside [0, {limit}) (the model's vocab_size{keys}).")
        self._check_lengths(tree, lm)
        return tree, table

    def _check_lengths(self, tree: PrefixTree, lm) -> None:
        """Refuse lengths only where the dense model is limited too: RoPE models run past `max_position_embeddings`."""
        longest = max(range(tree.n_sequences), key=tree.lengths.__getitem__)
        n = tree.lengths[longest]
        table = _position_table(lm)
        if table is not None and n > table[1]:
            raise ValueError(
                f"`seqs[{longest}]` has {n} tokens, but the model's learned position embeddings (`{table[0]}`) hold "
                f"{table[1]} positions, so the dense model cannot run it either; truncate the sequences (in TRL: "
                "shorter prompts or `max_completion_length`)."
            )
        for p in rope_kinds(self._config):
            limit = (p or {}).get("original_max_position_embeddings")
            if (p or {}).get("rope_type") == "longrope" and limit is not None and n > limit:
                refuse(refusal_subject(lm), [Blocker(
                    f"`seqs[{longest}]` has {n} tokens, more than original_max_position_embeddings ({limit}) of this "
                    "longrope model: its RoPE switches frequencies by the longest position of each forward call, so a "
                    "shared prefix would be rotated differently than in the dense run of the longer sequence",
                    fix=f"keep sequences within {limit} tokens")])


def _router_request(router_loss):
    """`router_loss` checked for its type (its groups are checked against the tree)."""
    if router_loss is not None and not isinstance(router_loss, LoadBalancing):
        raise TypeError(f"`router_loss` must be a `LoadBalancing` or None, got {type(router_loss).__name__}.")
    return router_loss


def _n_scored(tree: PrefixTree, n_scored) -> list[int]:
    """Per-sequence number of trailing log-probs, checked and clipped to `len_i - 1`."""
    lengths = tree.lengths
    if n_scored is None:
        return [max(n - 1, 0) for n in lengths]
    if _checks.is_int(n_scored):
        n_scored = [_checks.check_int("n_scored", n_scored, minimum=0)] * len(lengths)
    elif isinstance(n_scored, (str, bytes, Mapping, Set)) or not isinstance(n_scored, Iterable):
        raise TypeError(
            f"`n_scored` must be None, an integer or one integer per sequence, got {type(n_scored).__name__}."
        )
    else:
        if isinstance(n_scored, torch.Tensor) and n_scored.dim() != 1:
            raise ValueError(f"`n_scored` must be 1-D (one entry per sequence), got shape {tuple(n_scored.shape)}.")
        n_scored = [_checks.check_int(f"n_scored[{i}]", n, minimum=0) for i, n in enumerate(n_scored)]
    if len(n_scored) != len(lengths):
        raise ValueError(f"`n_scored` has {len(n_scored)} entries for {len(lengths)} sequences; pass one per sequence.")
    return [min(n, max(length - 1, 0)) for n, length in zip(n_scored, lengths)]


def _refuse_running_call(owner: int | None) -> None:
    """Raise if `owner` (the thread holding the model, or None) runs an engine call on it."""
    if owner is not None:
        where = "in this thread (a `loss_fn` that calls the engine?)" if owner == threading.get_ident() else \
            "in another thread"
        raise RuntimeError(
            f"DTAEngine: an engine call on this model is already running {where}. Only one engine call per model "
            "runs at a time, because the model's attention is switched to DTA for the duration of a call; call the "
            "engine again after the running call returns, or give each thread its own model."
        )


@contextlib.contextmanager
def _engine_call(lm, budgeted: bool, keep=None):
    """Hold `lm` for one engine call: refuse a second call on it, route its attention through DTA (except `keep`'s, a
    vision tower's) and suspend HF gradient checkpointing (`modeling.switch`; warned once unless the engine is
    `budgeted`: `max_graph_tokens` set), restoring everything on exit."""
    key, me = id(lm), threading.get_ident()
    with _CALLS_LOCK:
        owner = _CALLS.get(key)
        if owner is None:
            _CALLS[key] = me
    _refuse_running_call(owner)
    try:
        with attention_implementation(lm, attention.ATTN_IMPLEMENTATION, suspend_checkpointing=True,
                                      warn=not budgeted, keep=keep):
            yield
    finally:
        with _CALLS_LOCK:
            del _CALLS[key]
