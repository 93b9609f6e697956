"""Dynamic Tree Attention inside TRL's trainers: the TRL hooks `DTAGRPOTrainer` and `DTARLOOTrainer` override. TRL's
private state is read and written through `_trl.py` (the one module that touches it); what the hooks hand on are plain
values, and what they share between calls is one [`~trl_dta.trainers.state.HookState`] (`_dta_state`).

- `_prepare_inputs` (training): TRL's own, unless an opt-in regrouping applies (`micro_batches.py`: prompt groups kept
  in one micro-batch, `dta_group_shuffle`; groups exchanged between ranks, `dta_balance`). With
  `dta_sample_layout='per_turn'`, also when DTA is off, multi-turn episodes become one row per assistant turn
  (`per_turn.py`).
- `_get_per_token_logps_and_entropies` (no-grad calls: old-policy and reference log-probs, evaluation): the whole
  batch goes through `DTAEngine.logprobs` over its prefix tree.
- `compute_loss` (training): at the first micro-step of an accumulation window, the window's micro-batches TRL has
  buffered run as one forest (`window.run_window`, TRL-free: one `DTAEngine.forward_backward` with each sequence's
  term of TRL's loss, `losses.py`, or the exact two-pass path for objectives that are not a sum over sequences, and
  TRL's MoE router loss); every micro-step then replays its own micro-batch's log-probs through TRL's `_compute_loss`
  for its logged loss and metrics. Images (Qwen2-VL, Qwen2.5-VL) join the forest keyed by image (`vision/`: the
  tower once per distinct image, its embeddings in the shared prefix); micro-batches with other vision inputs or an
  unusual padding, and whole windows that compress less than `dta_min_compression`, run TRL's dense path.
- `training_step`: tracks the window; the distributed engine's strategy (`trl_dta.parallel`: DDP, FSDP2, DeepSpeed
  ZeRO, chosen from what accelerate set up) gathers at its start and reduces the gradients once at its end.

The replay: TRL's `_compute_loss` computes its log-probs itself, through `_get_per_token_logps_and_entropies`, so the
engine's are handed to it through that override (`_dta_replay` sets `HookState.replay` around the call).

Gradient scaling: the HF `Trainer` calls `accelerator.backward(compute_loss(...) / s)` with `s` the gradient
accumulation (GRPO returns a loss already scaled, RLOO does not). The engine has already back-propagated the same
`1 / s`-scaled loss, so `compute_loss` returns the loss value as a fresh autograd input: the `Trainer`'s backward then
adds nothing to the model's gradients, and the value it logs is TRL's.
"""

from __future__ import annotations

import contextlib

import torch
from trl.trainer.utils import (
    shuffle_sequence_dict,
    split_pixel_values_by_grid,
    split_tensor_dict,
    unsplit_pixel_values_by_grid,
)

from ..balance import CostModel, forest_stats
from ..batch import Layout, group_ids, num_rows
from ..engine import DTAEngine
from ..engine.router_loss import LoadBalancing
from ..parallel import StrategySettings, strategy_for
from ..tree import PrefixTree
from ..vision import keyed_rows
from . import _trl
from .arg_checks import check_trainer_args, graph_budget
from .config import DTAArguments, check_trl_version
from .launch import check_launch
from .micro_batches import RowSettings, balance_ranks, refit_cost_model, regrouping_exact, split_by_groups
from .model_checks import check_policy, check_schedule
from .per_turn import per_turn_buffer, per_turn_eval_rows, row_weight, unpadded_metrics
from .state import HookState
from .step_forest import Cadence, buffered_window
from .vllm_engine import check_vllm_mode, close_colocated_engine, colocated_engine
from .window import WindowContext, as_trl_head_output, decide, run_window


class DTATrainerMixin:
    """Dynamic Tree Attention for a TRL trainer; put it before the TRL class in the bases (see the module docstring).

    Subclasses set `_dta_trl_class` (the TRL trainer), `_dta_config_class` (its DTA config, for `args=None`) and
    `_dta_loss_class` (its per-sequence objective, `losses.py`).

    Metrics logged next to TRL's (averaged over a logging step): the forest's (`window.py` lists them),
    `dta/compression_ratio_micro_batch` (each micro-batch's own tree, as if it ran alone), `dta/step_time` (seconds of
    engine forward/backward per optimizer step), `dta/dense_fallback` (fraction of micro-batches that ran TRL's dense
    path: `dta_min_compression`, or an input layout DTA does not handle), and the regroupings' (`micro_batches.py`).
    """

    _dta_trl_class: type
    _dta_config_class: type
    _dta_loss_class: type
    _dta_aux_per_micro_step: bool = False  # TRL's `_compute_loss` divides the aux term by the accumulation steps

    def __init__(self, model, reward_funcs=None, args=None, *extra, **kwargs):
        if args is None:
            from trl.trainer.utils import get_config_model_id

            name = model if isinstance(model, str) else get_config_model_id(model.config)
            suffix = self._dta_trl_class.__name__.removesuffix("Trainer")
            args = self._dta_config_class(f"{name.split('/')[-1]}-{suffix}")
        self._dta_pre_init(args)
        with colocated_engine(self, args):  # vLLM's CPU settings; a no-op without colocated vLLM or on a GPU
            super().__init__(model, reward_funcs, args, *extra, **kwargs)
        self._dta_post_init()

    @property
    def dta_strategy(self) -> str:
        """The distributed engine DTA runs under, in words (`trl_dta.parallel`; empty with DTA disabled)."""
        strategy = getattr(self, "_dta_parallel", None)
        return strategy.description if strategy is not None else ""

    def end(self):
        """transformers' `Trainer.end` (trackers finished, the process group destroyed), the colocated vLLM engine
        shut down first (`vllm_engine.close_colocated_engine`)."""
        close_colocated_engine(self)
        return super().end()

    # ------------------------------------------------------------------ construction

    def _dta_pre_init(self, args) -> None:
        """Settings and config checks, before the TRL trainer is built."""
        self._dta = DTAArguments.from_config(args)
        self._dta_engines: dict[int, DTAEngine] = {}
        self._dta_state = HookState()
        check_vllm_mode(args)
        if not self._dta.dta_enabled:
            return
        check_trl_version()
        check_launch(args)
        check_trainer_args(args)
        self._dta_max_graph_tokens = graph_budget(self._dta, args)

    def _dta_post_init(self) -> None:
        """Checks that need the built trainer (model, processing class); builds the policy's engine."""
        self._dta_cadence = Cadence(self.args.steps_per_generation, self.num_iterations)
        if not self._dta.dta_enabled:
            return
        # refuses an unsupported distributed setting, whatever its source
        model = self.accelerator.unwrap_model(self.model)
        self._dta_parallel = strategy_for(self.accelerator, StrategySettings(
            self._dta.dta_fsdp_schedule, self._dta.dta_zero3_gather_budget_mb, model))
        # One refusal naming every blocker of the model and of TRL's use of it; builds the policy's engine.
        check_policy(model, is_vlm=_trl.is_vlm(self), aux_loss_enabled=self.aux_loss_enabled,
                     build_engine=lambda: self._dta_engine(model))
        check_schedule(self._dta_engine(model), self._dta_parallel)
        spec = self._dta_engine(model).vision  # a vision-language model whose images DTA runs: how they are keyed
        self._dta_image_keys = spec.keys() if spec is not None else None
        self._dta_cost_model = CostModel(hidden_size=model.config.get_text_config().hidden_size)
        if self._dta.dta_group_shuffle:
            regrouping_exact(self._dta_rows(), across_ranks=False)  # warns when it is not

    def _dta_engine(self, model, wrapped=None) -> DTAEngine:
        """The engine of an unwrapped model (policy, PEFT policy or reference), built on first use (`wrapped`: the
        model as the trainer holds it, when it differs: the construction probe runs it, gathered under ZeRO-3)."""
        engine = self._dta_engines.get(id(model))
        if engine is None or engine.model is not model:
            d = self._dta
            with self._dta_parallel.gathered(model if wrapped is None else wrapped):
                engine = self._dta_engines[id(model)] = DTAEngine(
                    model, block_size=d.dta_block_size, max_batch_tokens=d.dta_max_batch_tokens,
                    max_graph_tokens=self._dta_max_graph_tokens, max_pack_tokens=d.dta_max_pack_tokens,
                    attn_backend=d.dta_attn_backend)
        return engine

    def _dta_rows(self) -> RowSettings:
        """TRL's settings the regroupings and per-turn rows depend on (`micro_batches.py`, `per_turn.py`)."""
        return RowSettings(
            steps_per_generation=self.args.steps_per_generation,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
            num_generations=self.num_generations,
            loss_type=getattr(self, "loss_type", None),
            entropy_bonus=_trl.entropy_bonus_enabled(self),
            top_entropy_quantile=getattr(self, "top_entropy_quantile", 1.0),
            aux_loss=getattr(self, "aux_loss_enabled", False),
            importance_sampling_level=getattr(self, "importance_sampling_level", "token"),
            pad_token_id=_trl.tokenizer(self).pad_token_id or 0,
            pad_to_multiple_of=self.pad_to_multiple_of,
        )

    # ------------------------------------------------------------------ micro-batches

    def _dta_balances(self) -> bool:
        """Whether `dta_balance` applies: several processes, and exchanging rows leaves the updates TRL's."""
        return (self._dta.dta_balance and self.accelerator.num_processes > 1
                and regrouping_exact(self._dta_rows(), across_ranks=True))

    def _prepare_inputs(self, generation_batch):
        if self._dta.dta_sample_layout == "per_turn":
            return self._dta_prepare_per_turn(generation_batch)
        balance = self._dta.dta_enabled and self._dta_balances()
        if not (self._dta.dta_enabled and (self._dta.dta_group_shuffle or balance) and self.model.training):
            return super()._prepare_inputs(generation_batch)
        # TRL's `_prepare_inputs` (train mode), with the rows exchanged between ranks (`dta_balance`) and/or
        # `shuffle_sequence_dict` + `split_tensor_dict` replaced by the group-aware split (`dta_group_shuffle`).
        spg = self.args.steps_per_generation
        if self._dta_cadence.generates(_trl.step(self), _trl.buffered_inputs(self)):
            batch = split_pixel_values_by_grid(_trl.generate_and_score(self, generation_batch))
            if balance:
                if self._dta.dta_cost_model == "fit":
                    self._dta_refit_cost_model()
                batch, groups = balance_ranks(self.accelerator, self._dta_rows(), batch, self._dta_cost_model,
                                              _trl.metrics(self, "train"))
            else:
                groups = group_ids(self.accelerator.process_index, num_rows(batch), self.num_generations)
            if self._dta.dta_group_shuffle:
                batches = split_by_groups(batch, spg, groups, self._dta_cost_model)
            else:
                batches = split_tensor_dict(shuffle_sequence_dict(batch), spg)
            _trl.set_buffered_inputs(self, [unsplit_pixel_values_by_grid(b) for b in batches])
        return _trl.buffered_inputs(self)[self._dta_cadence.index(_trl.step(self))]

    def _dta_prepare_per_turn(self, generation_batch):
        """TRL's `_prepare_inputs` with one row per assistant turn, DTA on or off (`per_turn.per_turn_buffer`):
        each generation's episodes become turn rows (exchanged between ranks with `dta_balance`), shuffled by TRL's
        draw, cut into `steps_per_generation` micro-batches that keep every row and padded to equal counts across
        ranks (with the row-count factor of the row-mean loss types, applied by `_dta_trl_loss` and the per-sequence
        objective); in evaluation, the generation's turn rows, padded likewise."""
        if not self.model.training:
            return per_turn_eval_rows(self.accelerator, self._dta_rows(),
                                      _trl.generate_and_score(self, generation_batch))
        if self._dta_cadence.generates(_trl.step(self), _trl.buffered_inputs(self)):
            batch = _trl.generate_and_score(self, generation_batch)
            balance = self._dta.dta_enabled and self._dta.dta_balance and self.accelerator.num_processes > 1
            if balance and self._dta.dta_cost_model == "fit":
                self._dta_refit_cost_model()
            _trl.set_buffered_inputs(self, per_turn_buffer(self.accelerator, self._dta_rows(), batch,
                                                           _trl.metrics(self, "train"), balance,
                                                           self._dta_cost_model if balance else None))
        return _trl.buffered_inputs(self)[self._dta_cadence.index(_trl.step(self))]

    def _dta_refit_cost_model(self) -> None:
        self._dta_cost_model = refit_cost_model(self._dta_cost_model, self._dta_state.cost_samples)

    # ------------------------------------------------------------------ no-grad scoring

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        replay = self._dta_state.replay
        if replay is not None:
            logps, entropies, aux_loss = replay
            logps, entropies = as_trl_head_output(logps), as_trl_head_output(entropies)
            return logps, entropies if compute_entropy else None, aux_loss if compute_aux_loss else None
        args = (model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss)
        if not self._dta.dta_enabled:
            return super()._get_per_token_logps_and_entropies(*args, **multimodal)
        # Under FSDP2, the model is gathered for the call on every rank alike, whichever path runs (`parallel.fsdp2`).
        with self._dta_parallel.scoring(model):
            scored = self._dta_score(*args, **multimodal)
            if scored is None:  # TRL's dense path
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                    compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal,
                )
            return scored

    def _dta_score(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                   compute_aux_loss=False, **multimodal):
        """TRL's `_get_per_token_logps_and_entropies` through the engine for no-grad calls whose batch compresses;
        None when TRL's dense path runs the call."""
        layout = tree = table = None
        if not torch.is_grad_enabled():
            layout = Layout.from_padded(input_ids, attention_mask, logits_to_keep)
            keys = self._dta_image_keys
            keyed = keyed_rows(layout.seqs, layout.lengths, multimodal, keys) if layout is not None else None
            if keyed is not None:  # images keyed by image (`vision/`); None: vision inputs for TRL's dense path
                seqs, table = keyed
                tree = PrefixTree.from_sequences(seqs)
        if not decide(tree, self._dta.dta_min_compression, self._dta_parallel):
            return None
        engine = self._dta_engine(self.accelerator.unwrap_model(model), model)
        # TRL's aux loss (evaluation's `_compute_loss`): the mean over its chunks of `batch_size` rows
        rows, size = input_ids.size(0), batch_size or input_ids.size(0)
        chunks = [list(range(a, min(a + size, rows))) for a in range(0, rows, size)]
        router_loss = LoadBalancing(chunks, [1.0] * len(chunks)) if compute_aux_loss else None
        with self.accelerator.autocast(), self._dta_parallel.engine_call(model, False) as lockstep:
            out = engine.logprobs(tree, temperature=self.temperature, entropy=compute_entropy,
                                  n_scored=layout.lengths, router_loss=router_loss, lockstep=lockstep, images=table)
        logps = as_trl_head_output(layout.gather(out.logps, input_ids.device))
        entropies = as_trl_head_output(layout.gather(out.entropies, input_ids.device)) if compute_entropy else None
        aux_loss = out.router_aux.mean().to(input_ids.device, torch.float32) if compute_aux_loss else None
        return logps, entropies, aux_loss

    @contextlib.contextmanager
    def _dta_replay(self, logps: torch.Tensor, entropies: torch.Tensor | None, aux_loss: torch.Tensor | None = None):
        """Make TRL's `_compute_loss` read these `(B, T)` log-probs/entropies (and MoE load-balancing loss) instead of
        running the model."""
        self._dta_state.replay = (logps, entropies, aux_loss)
        try:
            yield
        finally:
            self._dta_state.replay = None

    # ------------------------------------------------------------------ training

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Tracks the accumulation window; the distributed strategy (`trl_dta.parallel`) begins it (FSDP2: groups
        gathered), wraps each micro-step (DDP: `no_sync`) and ends it with one gradient reduction (dense-path
        micro-steps included, so all ranks reduce the same way)."""
        if not self._dta.dta_enabled:
            return super().training_step(model, inputs, num_items_in_batch)
        state = self._dta_state
        if state.window_position == 0:
            self._dta_parallel.begin_window(model)
        with self._dta_parallel.micro_step(model):
            loss = super().training_step(model, inputs, num_items_in_batch)
        if not self.accelerator.sync_gradients:
            state.window_position += 1
            return loss
        state.window_position = 0
        state.micro_steps.clear()
        self._dta_parallel.end_window(model)
        if state.step_time:
            _trl.metrics(self, "train")["dta/step_time"].append(state.step_time)
            state.step_time = 0.0
        return loss

    def _dta_trl_loss(self, model, inputs: dict) -> torch.Tensor:
        """TRL's loss of a micro-batch as DTA's trainers train it: TRL's `_compute_loss`, its per-sequence metrics
        corrected for per-turn padding rows, times the micro-batch's row weight (per-turn rows on several processes,
        `per_turn.row_weights`). The one place TRL's objective gets the weight; the per-sequence objective gets
        it where it is built (`_dta_sequence_loss`)."""
        with unpadded_metrics(_trl.metrics(self), getattr(self, "importance_sampling_level", "token"), inputs):
            loss = _trl.compute_loss(self, model, inputs)
        weight = row_weight(inputs)
        return loss if weight == 1.0 else loss * weight

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:  # TRL's GRPO and RLOO refuse it
            return super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if not (self._dta.dta_enabled and self.model.training and torch.is_grad_enabled()):
            return self._dta_trl_loss(model, inputs)
        step, logged = _trl.step(self), _trl.metrics(self, "train")
        if step not in self._dta_state.micro_steps:
            self._dta_run_window(model, inputs, num_items_in_batch)
        micro_step = self._dta_state.micro_steps.pop(step)
        if micro_step.batch is not inputs:
            raise RuntimeError(
                f"micro-step {step} trains on another micro-batch than the one TRL buffered for it, whose "
                "gradient DTA has already accumulated with the window's forest. A `_prepare_inputs` override must "
                "return `self._buffered_inputs[self._step % steps_per_generation]` as TRL's does."
            )
        dense = micro_step.logps is None
        logged["dta/dense_fallback"].append(float(dense))
        if dense:
            return self._dta_trl_loss(model, inputs)
        logged["dta/compression_ratio_micro_batch"].append(micro_step.compression)
        with torch.no_grad(), self._dta_replay(micro_step.logps, micro_step.entropies, micro_step.aux_loss):
            loss = self._dta_trl_loss(model, inputs)  # the logged value and TRL's metrics
        return loss.detach().requires_grad_().clone()  # a `grad_fn` that reaches no parameter (DeepSpeed asks one)

    def _dta_sequence_loss(self, inputs: dict, scale: float):
        """The per-sequence objective of a micro-batch (times `scale` and its row weight), or None when the loss is
        not a sum over sequences."""
        if _trl.own_compute_loss(type(self), self._dta_trl_class):
            return None  # a subclass's own objective: only the two-pass path is exact for any function of logps
        return self._dta_loss_class(self, inputs, scale * row_weight(inputs),
                                    entropy_coef=_trl.entropy_coef(self))

    def _dta_loss_scale(self, num_items_in_batch) -> float:
        """The factor the HF `Trainer.training_step` applies to `compute_loss`'s result before `backward`."""
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                self.compute_loss_func is not None
            )
        scale = 1.0 if scaled else 1.0 / self.current_gradient_accumulation_steps
        return scale * self._dta_parallel.backward_scale(self.accelerator)

    def _dta_window(self, model, inputs: dict, num_items_in_batch) -> WindowContext:
        """The window from this micro-step on, read from TRL's state (`window.WindowContext`)."""
        steps, batches = buffered_window(inputs, _trl.buffered_inputs(self), _trl.step(self),
                                         self.current_gradient_accumulation_steps - self._dta_state.window_position,
                                         self._dta_cadence)
        scale = self._dta_loss_scale(num_items_in_batch)
        router_coef = None
        if self.aux_loss_enabled:  # weighted as TRL's `_compute_loss` adds it, times the scale of the backward
            router_coef = self.router_aux_loss_coef * scale
            if self._dta_aux_per_micro_step:
                router_coef /= self.current_gradient_accumulation_steps

        def batch_loss(batch, logps, entropies):
            aux = torch.zeros((), device=logps.device) if self.aux_loss_enabled else None  # a constant of dL/dlogps
            with self._dta_replay(logps, entropies, aux), _trl.unlogged(self):
                return self._dta_trl_loss(model, batch)

        return WindowContext(
            model=model, steps=tuple(steps), batches=tuple(batches), scale=scale, temperature=self.temperature,
            min_compression=self._dta.dta_min_compression,
            sequence_loss=lambda batch: self._dta_sequence_loss(batch, scale), batch_loss=batch_loss,
            router_coef=router_coef, autocast=self.accelerator.autocast, device=self.accelerator.device,
            image_keys=self._dta_image_keys,
        )

    def _dta_run_window(self, model, inputs: dict, num_items_in_batch) -> None:
        """Forward and backward of the window's buffered micro-batches, from this micro-step on, as one forest
        (`window.run_window`); stores a `MicroStep` per micro-step in `HookState.micro_steps` and logs the forest."""
        engine = self._dta_engine(self.accelerator.unwrap_model(model), model)
        result = run_window(engine, self._dta_window(model, inputs, num_items_in_batch), self._dta_parallel)
        state = self._dta_state
        state.micro_steps.update(result.micro_steps)
        if result.forest is None:
            return
        state.step_time += result.seconds
        if self._dta.dta_cost_model == "fit":
            s = forest_stats(result.forest.tree)
            state.cost_samples.append((s.tree_tokens, s.attention_work, s.leaves, result.seconds))
        logged = _trl.metrics(self, "train")
        for name, value in result.metrics.items():
            logged[name].append(value)
