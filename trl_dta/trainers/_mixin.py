"""Dynamic Tree Attention inside TRL's trainers: the TRL hooks `DTAGRPOTrainer` and `DTARLOOTrainer` override.

- `_prepare_inputs` (training): TRL's own, unless an opt-in regrouping applies (`micro_batches.py`: prompt groups kept
  in one micro-batch, `dta_group_shuffle`; groups exchanged between ranks, `dta_balance`). With
  `dta_sample_layout='per_turn'`, also when DTA is off, multi-turn episodes become one row per assistant turn
  (`layouts.py`).
- `_get_per_token_logps_and_entropies` (no-grad calls: old-policy and reference log-probs, evaluation): the whole
  batch goes through `DTAEngine.logprobs` over its prefix tree.
- `compute_loss` (training): at the first micro-step of an accumulation window, all the window's micro-batches TRL has
  buffered run as one forest through `DTAEngine.forward_backward` (`step_forest.py`), which back-propagates while it
  walks the tree; every micro-step then replays its own micro-batch's log-probs through TRL's `_compute_loss` for its
  logged loss and metrics.
- `training_step`: tracks the window; the distributed engine's strategy (`trl_dta.parallel`: DDP, FSDP2, DeepSpeed
  ZeRO, chosen from what accelerate set up) gathers at its start and reduces the gradients once at its end.

TRL's loss is a sum of per-sequence terms (`losses.py`), each computed at its leaf with the constants of the
micro-batch the sequence belongs to. Objectives that are not such a sum (`top_entropy_quantile < 1`, or a subclass
that overrides `_compute_loss`) take the exact two-pass path, also per window: a no-grad pass over the forest gives the
log-probs, TRL's `_compute_loss` runs on each micro-batch's log-probs as autograd inputs to give `dL/dlogps` (and
`dL/dentropies`), and a second pass back-propagates the linear surrogate `sum_i <logps_i, dL/dlogps_i> +
<entropies_i, dL/dentropies_i>`, whose parameter gradient is TRL's. It costs one extra no-grad forward over the forest.

MoE models with TRL's router auxiliary loss (`aux_loss_enabled`, on by default): TRL adds each micro-batch's
load-balancing loss to its loss; the engine back-propagates it over the forest, one group per micro-batch, after a
no-grad counting pass (`engine/router_loss.py`), and the replay hands TRL's `_compute_loss` each micro-batch's value.

When an optimizer step is not one forest: micro-batches of the window that come from a later generation (the window
crosses a generation, e.g. `steps_per_generation=3, gradient_accumulation_steps=2`) get their own forest when they
arrive; a micro-batch that is not TRL's buffered one (a `_prepare_inputs` override that does not buffer like TRL's)
runs as a forest of its own; a micro-batch with vision inputs or an unusual padding runs TRL's dense path; and when the
window's forest compresses less than `dta_min_compression`, all its micro-batches run TRL's dense path.

Gradient scaling: the HF `Trainer` calls `accelerator.backward(compute_loss(...) / s)` with `s` the gradient
accumulation (GRPO returns a loss already scaled, RLOO does not). The engine has already back-propagated the same
`1 / s`-scaled loss, so `compute_loss` returns the loss value as a fresh autograd input: the `Trainer`'s backward then
adds nothing to the model's gradients, and the value it logs is TRL's.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from trl.trainer.utils import (
    shuffle_sequence_dict,
    split_pixel_values_by_grid,
    split_tensor_dict,
    unsplit_pixel_values_by_grid,
)

from .. import _checks
from ..balance import CostModel, forest_stats
from ..batch import Layout, group_ids, has_vision_inputs, num_rows
from ..engine import DTAEngine
from ..engine.router_loss import LoadBalancing
from ..parallel import strategy_for
from ..refusal import DENSE_FALLBACK
from ..tree import PrefixTree
from .config import DTAArguments, check_trainer_args, check_trl_version
from .layouts import ROW_WEIGHT_KEY
from .micro_batches import (
    balance_ranks,
    per_turn_buffer,
    per_turn_eval_rows,
    regrouping_changes,
    split_by_groups,
    unpadded_metrics,
)
from .step_forest import StepForest, buffered_window
from .support import check_policy


@dataclass
class _MicroStep:
    """What the window's forest computed for one of its micro-steps (None values: TRL's dense path runs it).

    Args:
        batch (`dict`): the micro-batch.
        logps (`torch.Tensor` of shape `(B, T)`, *optional*): the policy's log-probs, detached.
        entropies (`torch.Tensor` of shape `(B, T)`, *optional*): their entropies.
        compression (`float`): the micro-batch's own tree compression.
        aux_loss (`torch.Tensor`, *optional*): MoE models: the micro-batch's load-balancing loss (0-d, detached), the
            value TRL's dense forward returns as `aux_loss`.
    """

    batch: dict
    logps: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    compression: float = 1.0
    aux_loss: torch.Tensor | None = None


def _as_trl_head_output(values: torch.Tensor | None) -> torch.Tensor | None:
    """Per-token log-probs or entropies `(B, T)` in the dtype TRL's fused LM head gives `_compute_loss`: float32
    whatever the model's dtype (`trl.kernels.ChunkedLogProbFunction` keeps its statistics in float32). The engine's
    are float64 in a float64 model; TRL's loss then compares them with thresholds it rounds to float32 (the entropy
    quantile), so they are rounded as TRL's would be. Differentiable: gradients flow back through the cast."""
    return values if values is None or values.dtype == torch.float32 else values.float()


def _peak_memory_mb(device: torch.device) -> float:
    """Peak allocated memory since the last reset on a CUDA device; the process's peak resident set elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class DTATrainerMixin:
    """Dynamic Tree Attention for a TRL trainer; put it before the TRL class in the bases (see the module docstring).

    Subclasses set `_dta_trl_class` (the TRL trainer), `_dta_config_class` (its DTA config, for `args=None`) and
    `_dta_loss_class` (its per-sequence objective, `losses.py`).

    Metrics logged next to TRL's (averaged over a logging step):

    - `dta/compression_ratio`, `dta/tokens`, `dta/tree_tokens`: the forest an engine call ran (normally all of an
      optimizer step's micro-batches; tokens / tree tokens).
    - `dta/compression_ratio_micro_batch`: each micro-batch's own tree, as if it ran alone.
    - `dta/micro_batches_per_forest`: micro-batches in each forest.
    - `dta/forward_tokens`: tokens the engine actually forwarded per forest (block recompute and the no-grad first pass
      of the two-pass path included).
    - `dta/step_time`: seconds of engine forward/backward per optimizer step.
    - `dta/peak_memory_mb`: peak allocated memory of a forest on CUDA; elsewhere the process's peak resident set.
    - `dta/dense_fallback`: fraction of micro-batches that ran TRL's dense path (`dta_min_compression`, or an input
      layout DTA does not handle).
    - `dta/idle_batches` (FSDP2's per-layer schedule): row batches this rank ran without work so that its layers'
      collectives pair with the other ranks'.
    """

    _dta_trl_class: type
    _dta_config_class: type
    _dta_loss_class: type
    _dta_replay_values: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None
    _dta_aux_per_micro_step: bool = False  # TRL's `_compute_loss` divides the aux term by the accumulation steps

    def __init__(self, model, reward_funcs=None, args=None, *extra, **kwargs):
        if args is None:
            from trl.trainer.utils import get_config_model_id

            name = model if isinstance(model, str) else get_config_model_id(model.config)
            suffix = self._dta_trl_class.__name__.removesuffix("Trainer")
            args = self._dta_config_class(f"{name.split('/')[-1]}-{suffix}")
        self._dta_pre_init(args)
        super().__init__(model, reward_funcs, args, *extra, **kwargs)
        self._dta_post_init()

    # ------------------------------------------------------------------ construction

    def _dta_pre_init(self, args) -> None:
        """Settings and config checks, before the TRL trainer is built."""
        self._dta = DTAArguments.from_config(args)
        self._dta_engines: dict[int, DTAEngine] = {}
        self._dta_step_time = 0.0
        self._dta_cost_samples: list[tuple[float, float, float, float]] = []
        self._dta_window_position = 0  # micro-steps done in the current accumulation window
        self._dta_micro_steps: dict[int, _MicroStep] = {}  # computed by the window's forest, keyed by TRL's `_step`
        if not self._dta.dta_enabled:
            return
        check_trl_version()
        check_trainer_args(args)
        self._dta_max_graph_tokens = self._dta.dta_max_graph_tokens
        if self._dta_max_graph_tokens is None and args.gradient_checkpointing:
            self._dta_max_graph_tokens = self._dta.dta_block_size
            _checks.warn_once(
                "gradient_checkpointing",
                "gradient_checkpointing=True: HF gradient checkpointing cannot reuse a prefix's keys/values, so DTA "
                "runs without it and bounds memory with DTA's block recompute instead "
                f"(dta_max_graph_tokens={self._dta_max_graph_tokens}). Micro-batches on TRL's dense path keep HF "
                "checkpointing. Set `dta_max_graph_tokens` to choose the budget, or `gradient_checkpointing=False` to "
                "keep every graph (fastest).",
            )

    def _dta_post_init(self) -> None:
        """Checks that need the built trainer (model, processing class); builds the policy's engine."""
        if not self._dta.dta_enabled:
            return
        self._dta_parallel = strategy_for(self)  # refuses an unsupported distributed setting, whatever its source
        model = self.accelerator.unwrap_model(self.model)
        # One refusal naming every blocker of the model and of TRL's use of it; builds the policy's engine.
        check_policy(model, is_vlm=self._is_vlm, aux_loss_enabled=self.aux_loss_enabled,
                     build_engine=lambda: self._dta_engine(model))
        lockstep = getattr(self._dta_parallel, "lockstep", False)
        if not self._is_vlm and self._dta_engine(model).layout.hybrid and lockstep:
            raise ValueError(
                "dta_fsdp_schedule='layer' runs packed subtree rows in lockstep across the ranks, which the recurrent "
                "layers of this hybrid model cannot run exactly (a recurrence cannot follow a tree mask). Use "
                f"dta_fsdp_schedule='window' (the default), {DENSE_FALLBACK}"
            )
        self._dta_cost_model = CostModel(hidden_size=model.config.get_text_config().hidden_size)
        if self._dta.dta_group_shuffle:
            reason = regrouping_changes(self, across_ranks=False)
            if reason:
                _checks.warn_once(
                    "group_shuffle",
                    f"dta_group_shuffle=True changes the updates relative to TRL's trainer here: {reason}. Set "
                    "`dta_group_shuffle=False` (the default) for TRL's updates; DTA still shares prefixes across an "
                    "optimizer step's micro-batches.",
                )

    def _dta_engine(self, model) -> DTAEngine:
        """The engine of an unwrapped model (policy, PEFT policy or reference), built on first use."""
        engine = self._dta_engines.get(id(model))
        if engine is None or engine.model is not model:
            engine = DTAEngine(
                model,
                block_size=self._dta.dta_block_size,
                max_batch_tokens=self._dta.dta_max_batch_tokens,
                max_graph_tokens=self._dta_max_graph_tokens,
                max_pack_tokens=self._dta.dta_max_pack_tokens,
                attn_backend=self._dta.dta_attn_backend,
            )
            self._dta_engines[id(model)] = engine
        return engine

    # ------------------------------------------------------------------ micro-batches

    def _dta_balances(self) -> bool:
        """Whether `dta_balance` applies: several processes, and exchanging rows leaves the updates TRL's."""
        if not (self._dta.dta_balance and self.accelerator.num_processes > 1):
            return False
        reason = regrouping_changes(self, across_ranks=True)
        if reason:
            _checks.warn_once(
                "balance_exact",
                f"dta_balance: ranks keep TRL's rows, because exchanging rows between them would change the updates "
                f"here: {reason}.",
            )
        return reason is None

    def _prepare_inputs(self, generation_batch):
        if self._dta.dta_sample_layout == "per_turn":
            return self._dta_prepare_per_turn(generation_batch)
        balance = self._dta.dta_enabled and self._dta_balances()
        if not (self._dta.dta_enabled and (self._dta.dta_group_shuffle or balance) and self.model.training):
            return super()._prepare_inputs(generation_batch)
        # TRL's `_prepare_inputs` (train mode), with the rows exchanged between ranks (`dta_balance`) and/or
        # `shuffle_sequence_dict` + `split_tensor_dict` replaced by the group-aware split (`dta_group_shuffle`).
        spg = self.args.steps_per_generation
        if self._step % (spg * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = split_pixel_values_by_grid(self._generate_and_score_completions(generation_batch))
            if balance:
                if self._dta.dta_cost_model == "fit":
                    self._dta_refit_cost_model()
                batch, groups = balance_ranks(self, batch, self._dta_cost_model)
            else:
                groups = group_ids(self.accelerator.process_index, num_rows(batch), self.num_generations)
            if self._dta.dta_group_shuffle:
                batches = split_by_groups(batch, spg, groups, self._dta_cost_model)
            else:
                batches = split_tensor_dict(shuffle_sequence_dict(batch), spg)
            self._buffered_inputs = [unsplit_pixel_values_by_grid(b) for b in batches]
        return self._buffered_inputs[self._step % spg]

    def _dta_prepare_per_turn(self, generation_batch):
        """TRL's `_prepare_inputs` with one row per assistant turn, DTA on or off (`micro_batches.per_turn_buffer`):
        each generation's episodes become turn rows (exchanged between ranks with `dta_balance`), shuffled by TRL's
        draw, cut into `steps_per_generation` micro-batches that keep every row and padded to equal counts across
        ranks (with the row-count factor of the row-mean loss types, applied by `compute_loss`); in evaluation, the
        generation's turn rows, padded likewise."""
        if not self.model.training:
            return per_turn_eval_rows(self, self._generate_and_score_completions(generation_batch))
        spg = self.args.steps_per_generation
        if self._step % (spg * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            balance = self._dta.dta_enabled and self._dta.dta_balance and self.accelerator.num_processes > 1
            if balance and self._dta.dta_cost_model == "fit":
                self._dta_refit_cost_model()
            self._buffered_inputs = per_turn_buffer(self, batch, balance, self._dta_cost_model if balance else None)
        return self._buffered_inputs[self._step % spg]

    def _dta_refit_cost_model(self) -> None:
        """Refit the balancer's cost model to the engine times of all ranks (identically on every rank)."""
        from accelerate.utils import gather_object

        samples = [row for rows in gather_object([self._dta_cost_samples]) for row in rows]
        if len(samples) >= 8:
            self._dta_cost_model = CostModel.fit(samples, hidden_size=self._dta_cost_model.hidden_size)

    # ------------------------------------------------------------------ no-grad scoring

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        if self._dta_replay_values is not None:
            logps, entropies, aux_loss = self._dta_replay_values
            logps, entropies = _as_trl_head_output(logps), _as_trl_head_output(entropies)
            return logps, entropies if compute_entropy else None, aux_loss if compute_aux_loss else None
        args = (model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss)
        if not self._dta.dta_enabled:
            return super()._get_per_token_logps_and_entropies(*args, **multimodal)
        # Under FSDP2, the model is gathered for the call on every rank alike, whichever path runs (`parallel.fsdp2`).
        with self._dta_parallel.scoring(model):
            return self._dta_score(*args, **multimodal)

    def _dta_score(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's `_get_per_token_logps_and_entropies`, through the engine for no-grad calls whose batch compresses."""
        layout = tree = None
        if not torch.is_grad_enabled() and all(v is None for v in multimodal.values()):
            layout = Layout.from_padded(input_ids, attention_mask, logits_to_keep)
            tree = PrefixTree.from_sequences(layout.seqs) if layout is not None else None
        compresses = tree is not None and tree.compression_ratio >= self._dta.dta_min_compression
        if self._dta_parallel.all_ranks(compresses):  # lockstep strategies: every rank takes one path
            engine = self._dta_engine(self.accelerator.unwrap_model(model))
            # TRL's aux loss (evaluation's `_compute_loss`): the mean over its chunks of `batch_size` rows
            rows, size = input_ids.size(0), batch_size or input_ids.size(0)
            chunks = [list(range(a, min(a + size, rows))) for a in range(0, rows, size)]
            router_loss = LoadBalancing(chunks, [1.0] * len(chunks)) if compute_aux_loss else None
            with self.accelerator.autocast(), self._dta_parallel.engine_call(engine, model, False):
                out = engine.logprobs(tree, temperature=self.temperature, entropy=compute_entropy,
                                      n_scored=layout.lengths, router_loss=router_loss)
            logps = _as_trl_head_output(layout.gather(out.logps, input_ids.device))
            entropies = _as_trl_head_output(layout.gather(out.entropies, input_ids.device)) if compute_entropy else None
            aux_loss = out.router_aux.mean().to(input_ids.device, torch.float32) if compute_aux_loss else None
            return logps, entropies, aux_loss
        return super()._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=batch_size,
            compute_entropy=compute_entropy,
            compute_aux_loss=compute_aux_loss,
            **multimodal,
        )

    @contextlib.contextmanager
    def _dta_replay(self, logps: torch.Tensor, entropies: torch.Tensor | None, aux_loss: torch.Tensor | None = None):
        """Make TRL's `_compute_loss` read these `(B, T)` log-probs/entropies (and MoE load-balancing loss) instead of
        running the model."""
        self._dta_replay_values = (logps, entropies, aux_loss)
        try:
            yield
        finally:
            self._dta_replay_values = None

    @contextlib.contextmanager
    def _dta_unlogged(self):
        """Run TRL's `_compute_loss` for its gradient only: its metrics are discarded and the entropy controller's
        state (updated at the window's last micro-step) is restored."""
        state = {name: getattr(self, name) for name in ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")
                 if hasattr(self, name)}
        metrics = self._metrics
        self._metrics = {mode: defaultdict(list) for mode in metrics}
        try:
            yield
        finally:
            self._metrics = metrics
            for name, value in state.items():
                setattr(self, name, value)

    # ------------------------------------------------------------------ training

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Tracks the accumulation window; the distributed strategy (`trl_dta.parallel`) begins it (FSDP2: groups
        gathered), wraps each micro-step (DDP: `no_sync`) and ends it with one gradient reduction (dense-path
        micro-steps included, so all ranks reduce the same way)."""
        if not self._dta.dta_enabled:
            return super().training_step(model, inputs, num_items_in_batch)
        if self._dta_window_position == 0:
            self._dta_parallel.begin_window(model)
        with self._dta_parallel.micro_step(model):
            loss = super().training_step(model, inputs, num_items_in_batch)
        if not self.accelerator.sync_gradients:
            self._dta_window_position += 1
            return loss
        self._dta_window_position = 0
        self._dta_micro_steps.clear()
        self._dta_parallel.end_window(model)
        if self._dta_step_time:
            self._metrics["train"]["dta/step_time"].append(self._dta_step_time)
            self._dta_step_time = 0.0
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        weight = inputs.get(ROW_WEIGHT_KEY, 1.0)  # per-turn rows on several processes (`micro_batches.row_weights`)
        if not (self._dta.dta_enabled and not return_outputs and self.model.training and torch.is_grad_enabled()):
            with unpadded_metrics(self, inputs):
                out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                           num_items_in_batch=num_items_in_batch)
            return out if weight == 1.0 else (out[0] * weight, *out[1:]) if return_outputs else out * weight
        if self._step not in self._dta_micro_steps:
            self._dta_run_window(model, inputs, num_items_in_batch)
        micro_step = self._dta_micro_steps.pop(self._step)
        if micro_step.batch is not inputs:
            raise RuntimeError(
                f"micro-step {self._step} trains on another micro-batch than the one TRL buffered for it, whose "
                "gradient DTA has already accumulated with the window's forest. A `_prepare_inputs` override must "
                "return `self._buffered_inputs[self._step % steps_per_generation]` as TRL's does."
            )
        dense = micro_step.logps is None
        self._metrics["train"]["dta/dense_fallback"].append(float(dense))
        if dense:
            with unpadded_metrics(self, inputs):
                return super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch) * weight
        self._metrics["train"]["dta/compression_ratio_micro_batch"].append(micro_step.compression)
        with torch.no_grad(), self._dta_replay(micro_step.logps, micro_step.entropies, micro_step.aux_loss), \
                unpadded_metrics(self, inputs):
            loss = self._compute_loss(model, inputs) * weight  # the logged value and TRL's metrics
        return loss.detach().requires_grad_().clone()  # a `grad_fn` that reaches no parameter (DeepSpeed asks one)

    def _dta_sequence_loss(self, inputs: dict, scale: float):
        """The per-sequence objective of a micro-batch, or None when the loss is not a sum over sequences."""
        if type(self)._compute_loss is not self._dta_trl_class._compute_loss:
            return None  # a subclass's own objective: only the two-pass path is exact for any function of logps
        return self._dta_loss_class(self, inputs, scale)

    def _dta_loss_scale(self, num_items_in_batch) -> float:
        """The factor the HF `Trainer.training_step` applies to `compute_loss`'s result before `backward`."""
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                self.compute_loss_func is not None
            )
        scale = 1.0 if scaled else 1.0 / self.current_gradient_accumulation_steps
        return scale * self._dta_parallel.backward_scale(self.accelerator)

    def _dta_run_window(self, model, inputs: dict, num_items_in_batch) -> None:
        """Forward and backward of the window's buffered micro-batches, from this micro-step on, as one forest.

        Stores a [`_MicroStep`] per micro-step in `_dta_micro_steps`; micro-batches DTA does not handle (vision
        inputs, an unusual mask), or all of them when the forest compresses less than `dta_min_compression`, are left
        to TRL's dense path at their own micro-step.
        """
        steps, batches = buffered_window(
            inputs,
            self._buffered_inputs,
            self._step,
            self.current_gradient_accumulation_steps - self._dta_window_position,
            self.args.steps_per_generation,
            self.args.steps_per_generation * self.num_iterations,
        )
        layouts = [None if has_vision_inputs(b) else Layout.from_batch(b) for b in batches]
        for step, batch in zip(steps, batches):
            self._dta_micro_steps[step] = _MicroStep(batch)
        kept = [k for k, layout in enumerate(layouts) if layout is not None]
        forest = None
        if kept and (len(kept) == len(layouts) or not self._dta_parallel.lockstep):  # lockstep: all or none dense
            forest = StepForest([steps[k] for k in kept], [batches[k] for k in kept], [layouts[k] for k in kept])
        compresses = forest is not None and forest.tree.compression_ratio >= self._dta.dta_min_compression
        if not self._dta_parallel.all_ranks(compresses):
            return

        device = self.accelerator.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        engine = self._dta_engine(self.accelerator.unwrap_model(model))
        scale = self._dta_loss_scale(num_items_in_batch)
        terms = [self._dta_sequence_loss(batch, scale * batch.get(ROW_WEIGHT_KEY, 1.0)) for batch in forest.batches]
        out_device = inputs["completion_ids"].device
        run = dict(temperature=self.temperature, n_scored=forest.n_scored)
        call = self._dta_parallel.engine_call
        router_loss = self._dta_router_loss(forest, scale)
        # Autocast covers the model computation only, as in TRL's `_get_per_token_logps_and_entropies`.
        if all(term is not None for term in terms):
            with self.accelerator.autocast(), call(engine, model, True):
                out = engine.forward_backward(forest.tree, forest.objective(terms), entropy=True,
                                              router_loss=router_loss, **run)
            forward_tokens, aux = out.stats["forward_tokens"], out.router_aux
            idle = out.stats["idle_batches"]
        else:
            with self.accelerator.autocast(), call(engine, model, False):
                out = engine.logprobs(forest.tree, entropy=True, **run)
            forward_tokens = out.stats["forward_tokens"]
            surrogate, entropy = self._dta_surrogate(model, forest, out, scale, out_device)
            with self.accelerator.autocast(), call(engine, model, True):
                second = engine.forward_backward(forest.tree, surrogate, entropy=entropy, router_loss=router_loss,
                                                 **run)
            forward_tokens, aux = forward_tokens + second.stats["forward_tokens"], second.router_aux
            idle = out.stats["idle_batches"] + second.stats["idle_batches"]
        logps = forest.split(out.logps, out_device)
        entropies = forest.split(out.entropies, out_device)
        seconds = time.perf_counter() - start  # the engine's work; the per-micro-batch trees below are metrics only
        for k, step in enumerate(forest.steps):
            compression = PrefixTree.from_sequences(forest.layouts[k].seqs).compression_ratio
            aux_k = None if aux is None else aux[k].to(out_device, torch.float32)
            self._dta_micro_steps[step] = _MicroStep(forest.batches[k], logps[k], entropies[k], compression, aux_k)

        self._dta_step_time += seconds
        if self._dta.dta_cost_model == "fit":
            s = forest_stats(forest.tree)
            self._dta_cost_samples.append((s.tree_tokens, s.attention_work, s.leaves, seconds))
        metrics = self._metrics["train"]
        metrics["dta/compression_ratio"].append(forest.tree.compression_ratio)
        metrics["dta/tokens"].append(float(forest.tree.n_tokens))
        metrics["dta/tree_tokens"].append(float(forest.tree.n_tree_tokens))
        metrics["dta/forward_tokens"].append(float(forward_tokens))
        if self._dta_parallel.lockstep:
            metrics["dta/idle_batches"].append(float(idle))
        metrics["dta/micro_batches_per_forest"].append(float(len(forest.steps)))
        metrics["dta/peak_memory_mb"].append(_peak_memory_mb(device))

    def _dta_router_loss(self, forest: StepForest, scale: float) -> LoadBalancing | None:
        """The window's MoE load-balancing loss for the engine, or None without one: a group per micro-batch (TRL
        computes it per micro-batch forward), weighted as TRL's `_compute_loss` adds it (`router_aux_loss_coef`,
        divided by the accumulation steps where TRL divides it) times the scale of the backward."""
        if not self.aux_loss_enabled:
            return None
        coef = self.router_aux_loss_coef * scale
        if self._dta_aux_per_micro_step:
            coef /= self.current_gradient_accumulation_steps
        groups = [list(range(lo, hi)) for lo, hi in zip(forest.offsets, forest.offsets[1:])]
        return LoadBalancing(groups, [coef] * len(groups))

    def _dta_surrogate(self, model, forest: StepForest, first, scale: float, device):
        """The two-pass path's per-sequence surrogate: TRL's `_compute_loss` on each micro-batch's first-pass
        log-probs (autograd inputs) gives `dL/dlogps` and `dL/dentropies`; returns the surrogate and whether it needs
        entropies."""
        grads = []
        for batch, logps, entropies in zip(forest.batches, forest.split(first.logps, device),
                                           forest.split(first.entropies, device)):
            logps, entropies = logps.requires_grad_(), entropies.requires_grad_()
            aux = torch.zeros((), device=device) if self.aux_loss_enabled else None  # a constant of dL/dlogps
            with self._dta_replay(logps, entropies, aux), self._dta_unlogged():
                loss = self._compute_loss(model, batch)
            grad_logps, grad_entropies = torch.autograd.grad(loss * (scale * batch.get(ROW_WEIGHT_KEY, 1.0)),
                                                             (logps, entropies), allow_unused=True)
            grads.append((torch.zeros_like(logps) if grad_logps is None else grad_logps, grad_entropies))
        entropy = any(g is not None for _, g in grads)

        def surrogate(i, seq_logps, seq_entropies):
            """`<logps_i, dL/dlogps_i> + <entropies_i, dL/dentropies_i>`: TRL's gradient, one sequence."""
            k, j = forest.locate(i)
            grad_logps, grad_entropies = grads[k]
            n = seq_logps.size(0)
            term = (seq_logps * grad_logps[j, :n].to(seq_logps.device, seq_logps.dtype)).sum()
            if grad_entropies is not None:
                grad = grad_entropies[j, :n].to(seq_entropies.device, seq_entropies.dtype)
                term = term + (seq_entropies * grad).sum()
            return term

        return surrogate, entropy
