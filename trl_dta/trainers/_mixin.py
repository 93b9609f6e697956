"""Dynamic Tree Attention inside TRL's trainers: the logic `DTAGRPOTrainer` and `DTARLOOTrainer` share.

The mixin overrides three hooks of TRL's `GRPOTrainer` / `RLOOTrainer` and nothing else:

- `_prepare_inputs` (training, `dta_group_shuffle=True`): TRL shuffles the rows of a generation batch and cuts it into
  `steps_per_generation` micro-batches, which scatters a prompt's completions over micro-batches (each piece then
  recomputes the prompt). Here the rows are permuted with the very same random draw, then assigned to micro-batches of
  TRL's size that keep a prompt's completions together where the size allows, balanced by tree cost
  (`trl_dta.balance.partition`).
- `_get_per_token_logps_and_entropies` (no-grad calls: old-policy and reference log-probs, evaluation): the whole
  batch goes through `DTAEngine.logprobs` over its prefix tree.
- `compute_loss` (training): the policy loss goes through `DTAEngine.forward_backward`, which back-propagates while it
  walks the tree. TRL's loss is a sum of per-sequence terms (`losses.py`), each computed at its leaf. Objectives that
  are not such a sum (`top_entropy_quantile < 1`, or a subclass that overrides `_compute_loss`) take the exact
  two-pass path: a no-grad pass gives the log-probs, TRL's own `_compute_loss` runs on them as leaves to give
  `dL/dlogps` (and `dL/dentropies`), and a second pass back-propagates the linear surrogate
  `sum_i <logps_i, dL/dlogps_i> + <entropies_i, dL/dentropies_i>`, whose parameter gradient is TRL's. It costs one
  extra no-grad forward over the tree.

In both training paths TRL's `_compute_loss` also runs on the engine's (detached) log-probs and entropies, so the
logged loss and every metric TRL computes there (clip ratios, KL, entropy, the adaptive entropy controller) come from
TRL's own code.

Gradient scaling: the HF `Trainer` calls `accelerator.backward(compute_loss(...) / s)` with `s` the gradient
accumulation (GRPO returns a loss already scaled, RLOO does not). The engine has already back-propagated the same
`1 / s`-scaled loss, so `compute_loss` returns the loss value as a fresh leaf: the `Trainer`'s backward then adds
nothing to the model's gradients, and the value it logs is TRL's.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from dataclasses import dataclass, field, fields

import torch
from accelerate.utils import is_peft_model
from accelerate.utils import gather_object
from trl.trainer.utils import (
    shuffle_sequence_dict,
    split_pixel_values_by_grid,
    split_tensor_dict,
    unsplit_pixel_values_by_grid,
)

from ..balance import CostModel, forest_stats, partition
from ..distributed import all_reduce_gradients, redistribute, trainable_parameters
from ..engine import DTAEngine, _warn_once
from ..lm_head import HeadSpec
from ..tree import PrefixTree


# Inputs of vision-language models: a micro-batch carrying any of them runs TRL's dense path.
_VISION_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
    "num_images",
    "num_tiles",
)
@dataclass
class DTAArguments:
    """The `dta_*` fields shared by [`DTAGRPOConfig`] and [`DTARLOOConfig`] (see their docstrings)."""

    dta_enabled: bool = field(
        default=True,
        metadata={
            "help": "Whether to run the policy loss and the no-grad old-policy/reference log-probs through the prefix "
            "tree of each batch (Dynamic Tree Attention). With `False` the trainer is exactly the TRL trainer."
        },
    )
    dta_block_size: int = field(
        default=1024,
        metadata={
            "help": "Tokens per re-forward block when a tree segment's autograd graph is dropped and recomputed in "
            "the backward (DTA's token-wise checkpointing, used when `dta_max_graph_tokens` is exceeded)."
        },
    )
    dta_max_batch_tokens: int = field(
        default=8192,
        metadata={
            "help": "Padded-token budget of one forward of sibling leaves: the completions of one prompt are "
            "forwarded together, with the prompt's keys/values shared, up to this many tokens per forward."
        },
    )
    dta_max_pack_tokens: int = field(
        default=1024,
        metadata={
            "help": "A subtree of the prefix tree with at most this many tokens (e.g. a group of short multi-turn "
            "branches) runs as one tree-masked row of a batched forward instead of segment by segment: fewer, larger "
            "forward/backward calls, at the price of attention over the whole row. `0` walks every segment."
        },
    )
    dta_max_graph_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Memory budget, in tokens of kept autograd graph; segments beyond it are recomputed in blocks of "
            "`dta_block_size` tokens. `None` keeps every graph (fastest), except that with "
            "`gradient_checkpointing=True` (TRL's default) it becomes `dta_block_size`: HF gradient checkpointing "
            "cannot reuse a prefix's keys/values, so DTA micro-batches run without it and bound memory this way."
        },
    )
    dta_min_compression: float = field(
        default=1.1,
        metadata={
            "help": "A batch whose prefix tree compresses its tokens less than this ratio (tokens / tree tokens) "
            "runs TRL's dense path unchanged. `1.0` or less sends every batch through DTA."
        },
    )
    dta_group_shuffle: bool = field(
        default=True,
        metadata={
            "help": "Keep each prompt's completions in one micro-batch where `per_device_train_batch_size` allows, "
            "and balance micro-batches by tree cost, with TRL's row count per micro-batch and the same random draw "
            "as TRL's shuffle. With `False`, TRL's row shuffle and split are reproduced exactly."
        },
    )

    dta_balance: bool = field(
        default=True,
        metadata={
            "help": "With several processes: after each generation, exchange whole prompt groups between ranks so that "
            "every rank trains on a forest of equal tree cost (each rank keeps its number of rows). Needs each "
            "process's generation batch to hold whole groups (a multiple of `num_generations` rows)."
        },
    )
    dta_cost_model: str = field(
        default="default",
        metadata={
            "help": "Cost of a rank's forest for `dta_balance`: 'default' (tree tokens + attention work + a per-leaf "
            "overhead, from the model width) or 'fit' (coefficients fitted by least squares to the engine's measured "
            "micro-batch times, gathered from all ranks, once 8 samples exist)."
        },
    )

    def validate_dta(self) -> None:
        """Check the `dta_*` values; errors name the field and the fix."""
        for name in ("dta_block_size", "dta_max_batch_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        value = self.dta_max_pack_tokens
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"`dta_max_pack_tokens` must be a non-negative integer, got {value!r}.")
        value = self.dta_max_graph_tokens
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"`dta_max_graph_tokens` must be None or a non-negative integer, got {value!r}.")
        if self.dta_cost_model not in ("default", "fit"):
            raise ValueError(f"`dta_cost_model` must be 'default' or 'fit', got {self.dta_cost_model!r}.")
        value = self.dta_min_compression
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(
                f"`dta_min_compression` must be a finite number >= 0 (1.0 sends every batch through DTA), got "
                f"{value!r}."
            )

    @classmethod
    def from_config(cls, args) -> DTAArguments:
        """The `dta_*` settings of a config; defaults for a plain TRL config."""
        settings = cls(**{f.name: getattr(args, f.name, f.default) for f in fields(cls)})
        settings.validate_dta()
        return settings


def check_trainer_args(args) -> None:
    """Options of the HF/TRL config that DTA cannot honour exactly; each error names the option and the fix."""
    off = "or set `dta_enabled=False` to train with the TRL trainer's dense path."
    if args.fp16:
        raise ValueError(
            "`fp16=True` is not supported with DTA: the engine back-propagates inside `compute_loss`, outside the fp16 "
            f"gradient scaler. Use `bf16=True` or float32, {off}"
        )
    if args.deepspeed or args.fsdp:
        raise ValueError(
            "DeepSpeed and FSDP are not supported with DTA: the engine runs on the unwrapped model and needs every "
            f"parameter materialised. Use plain data parallelism, {off}"
        )
    if args.use_liger_kernel:
        raise ValueError(
            "`use_liger_kernel=True` is not supported with DTA: Liger replaces the model's layers with kernels whose "
            f"equivalence with DTA is untested. Set `use_liger_kernel=False`, {off}"
        )
    if getattr(args.optim, "value", args.optim) in ("lomo", "adalomo"):
        raise ValueError(
            f"`optim={args.optim!r}` fuses the optimizer step into `backward`, which DTA calls many times per "
            f"micro-batch. Choose another optimizer, {off}"
        )


@dataclass
class _Layout:
    """Where each row's scored completion tokens sit in its unpadded sequence.

    TRL's batches are `[left-padded prompt | right-padded completion]`: row `i` has `P_i` prompt and `C_i` completion
    tokens, the sequence is its `P_i + C_i` real tokens, and its completion's log-probs are the last `C_i` of the
    sequence (the engine's `n_scored`): completion column `j < C_i` is the `j`-th of them.

    Args:
        seqs (`list[torch.LongTensor]`): row `i`'s real tokens, shape `(P_i + C_i,)`, on CPU.
        lengths (`list[int]`): `C_i`.
        width (`int`): `T`, the number of completion columns.
    """

    seqs: list[torch.Tensor]
    lengths: list[int]
    width: int

    @classmethod
    def from_padded(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> _Layout | None:
        """From `input_ids`/`attention_mask` of shape `(B, P + T)` with `T = logits_to_keep`; None for a mask that is
        not `[0..0 1..1 | 1..1 0..0]` per row (or a row that scores a token without any prompt)."""
        ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
        width = logits_to_keep
        prompt_width = ids.size(1) - width
        prompt, completion = mask[:, :prompt_width], mask[:, prompt_width:]
        p, c = prompt.sum(1), completion.sum(1)
        if not torch.equal(prompt, torch.arange(prompt_width) >= (prompt_width - p)[:, None]):
            return None
        if not torch.equal(completion, torch.arange(width) < c[:, None]):
            return None
        if ((p == 0) & (c > 0)).any():
            return None
        p, c = p.tolist(), c.tolist()
        seqs = [ids[i, prompt_width - p[i] : prompt_width + c[i]] for i in range(len(p))]
        return cls(seqs, c, width)

    @classmethod
    def from_inputs(cls, inputs: dict) -> _Layout | None:
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        return cls.from_padded(input_ids, attention_mask, inputs["completion_ids"].size(1))

    def gather(self, values: list[torch.Tensor], device) -> torch.Tensor:
        """TRL's `(B, T)` per-token tensor from the engine's per-sequence vectors of `C_i` values (zeros elsewhere)."""
        dtype = values[0].dtype if values else torch.float32
        out = torch.zeros(len(self.seqs), self.width, dtype=dtype, device=device)
        for i, n in enumerate(self.lengths):
            if n:
                out[i, :n] = values[i][-n:]
        return out


def _take(batch: dict, rows: torch.Tensor) -> dict:
    """Rows `rows` of every per-row entry of a TRL batch (as `split_tensor_dict` slices them)."""
    out = {}
    for key, value in batch.items():
        if value is None:
            out[key] = None
        elif isinstance(value, torch.Tensor):
            out[key] = value if value.ndim == 0 else value[rows.to(value.device)]
        elif isinstance(value, list):
            out[key] = [value[i] for i in rows.tolist()]
        else:
            out[key] = value
    return out


def _peak_memory_mb(device: torch.device) -> float:
    """Peak allocated memory since the last reset on a CUDA device; the process's peak resident set elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class DTATrainerMixin:
    """Dynamic Tree Attention for a TRL trainer; put it before the TRL class in the bases (see the module docstring).

    Subclasses set `_dta_trl_class` (the TRL trainer) and `_dta_loss_class` (its per-sequence objective, `losses.py`).

    Metrics logged next to TRL's (averaged over the micro-batches of a logging step):

    - `dta/compression_ratio`, `dta/tokens`, `dta/tree_tokens`: the micro-batch's prefix tree (tokens / tree tokens).
    - `dta/forward_tokens`: tokens the engine actually forwarded (block recompute and the no-grad first pass of the
      two-pass path included).
    - `dta/step_time`: seconds of engine forward/backward per optimizer step.
    - `dta/peak_memory_mb`: peak allocated memory of the micro-batch on CUDA; elsewhere the process's peak resident set.
    - `dta/dense_fallback`: fraction of micro-batches that ran TRL's dense path (`dta_min_compression`, or an input
      layout DTA does not handle).
    """

    _dta_trl_class: type
    _dta_loss_class: type
    _dta_replay_values: tuple[torch.Tensor, torch.Tensor | None] | None = None

    # ------------------------------------------------------------------ construction

    def _dta_pre_init(self, args) -> None:
        """Settings and config checks, before the TRL trainer is built."""
        self._dta = DTAArguments.from_config(args)
        self._dta_engines: dict[int, DTAEngine] = {}
        self._dta_step_time = 0.0
        self._dta_cost_samples: list[tuple[float, float, float, float]] = []
        if not self._dta.dta_enabled:
            return
        check_trainer_args(args)
        self._dta_max_graph_tokens = self._dta.dta_max_graph_tokens
        if self._dta_max_graph_tokens is None and args.gradient_checkpointing:
            self._dta_max_graph_tokens = self._dta.dta_block_size
            _warn_once(
                "gradient_checkpointing",
                "gradient_checkpointing=True: HF gradient checkpointing cannot reuse a prefix's keys/values, so DTA "
                "micro-batches run without it and bound memory with DTA's block recompute instead "
                f"(dta_max_graph_tokens={self._dta_max_graph_tokens}). Micro-batches on TRL's dense path keep HF "
                "checkpointing. Set `dta_max_graph_tokens` to choose the budget, or `gradient_checkpointing=False` to "
                "keep every graph (fastest).",
            )

    def _dta_post_init(self) -> None:
        """Checks that need the built trainer (model, processing class); builds the policy's engine."""
        if not self._dta.dta_enabled:
            return
        off = "or set `dta_enabled=False` to train with the TRL trainer's dense path."
        if self._is_vlm:
            raise ValueError(f"DTA supports text-only models; vision-language inputs need TRL's dense path: {off}")
        if self.aux_loss_enabled:
            raise ValueError(
                "The MoE load-balancing loss is not a sum over sequences (it is non-linear in the whole batch's router "
                f"statistics), so DTA cannot reproduce it. Set `router_aux_loss_coef=0.0`, {off}"
            )
        model = self.accelerator.unwrap_model(self.model)
        if is_peft_model(model) and any(c.is_prompt_learning for c in model.peft_config.values()):
            raise ValueError(
                "Prompt-learning adapters (prompt/prefix/p-tuning) add virtual tokens in the PEFT model's forward, "
                f"which DTA does not run. Use a LoRA-style adapter, {off}"
            )
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Dropout) and module.p > 0:
                raise ValueError(
                    f"Dropout is active ({name}: p={module.p}) and DTA cannot reproduce the dense path's random masks. "
                    f"Set `disable_dropout=True`, {off}"
                )
        config = model.config.get_text_config()
        if getattr(config, "attention_dropout", 0.0):
            raise ValueError(
                f"Attention dropout is active (attention_dropout={config.attention_dropout}) and DTA cannot reproduce "
                f"it. Set `attention_dropout=0.0` in the model config, {off}"
            )
        HeadSpec.from_model(model.get_base_model() if is_peft_model(model) else model)
        self._dta_engine(model)
        self._dta_cost_model = CostModel(hidden_size=config.hidden_size)

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
            )
            self._dta_engines[id(model)] = engine
        return engine

    # ------------------------------------------------------------------ micro-batching

    def _prepare_inputs(self, generation_batch):
        balance = self._dta.dta_enabled and self._dta.dta_balance and self.accelerator.num_processes > 1
        if not (self._dta.dta_enabled and (self._dta.dta_group_shuffle or balance) and self.model.training):
            return super()._prepare_inputs(generation_batch)
        # TRL's `_prepare_inputs` (train mode), with the rows exchanged between ranks (`dta_balance`) and
        # `shuffle_sequence_dict` + `split_tensor_dict` replaced (`dta_group_shuffle`).
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            generation_batch = self._generate_and_score_completions(generation_batch)
            generation_batch = split_pixel_values_by_grid(generation_batch)
            groups = None
            if balance:
                generation_batch, groups = self._dta_balance(generation_batch)
            if self._dta.dta_group_shuffle:
                batches = self._dta_split_generation_batch(generation_batch, groups)
            else:
                batches = split_tensor_dict(shuffle_sequence_dict(generation_batch), self.args.steps_per_generation)
            self._buffered_inputs = [unsplit_pixel_values_by_grid(batch) for batch in batches]
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _dta_balance(self, batch: dict) -> tuple[dict, torch.Tensor | None]:
        """Exchange whole prompt groups between ranks so that each trains on a forest of equal cost.

        Returns this rank's new generation batch and the global group id of each of its rows (None when the batch
        is left as it is: vision inputs, or a per-process batch that does not hold whole groups)."""
        n, size = len(batch["prompt_ids"]), self.num_generations
        groups = (self.accelerator.process_index * n + torch.arange(n)) // size
        if any(batch.get(key) is not None for key in _VISION_KEYS):
            return batch, groups
        if n % size:
            _warn_once(
                "balance_groups",
                f"dta_balance: each process holds {n} rows of a generation batch, not a multiple of num_generations="
                f"{size}, so prompt groups straddle processes and cannot be exchanged whole; ranks keep TRL's rows. "
                "Make `per_device_train_batch_size * steps_per_generation` a multiple of `num_generations`.",
            )
            return batch, groups
        if self._dta.dta_cost_model == "fit":
            self._dta_refit_cost_model()
        before = [forest_stats(_Layout.from_inputs(batch).seqs)]
        before = gather_object(before)
        local, local_groups, result = redistribute(
            self.accelerator, batch, groups, pad_token_id=self._tokenizer.pad_token_id or 0, cost_model=self._dta_cost_model
        )
        metrics = self._metrics["train"]
        metrics["dta/compression_ratio_before_balance"].append(
            sum(s.tokens for s in before) / max(sum(s.tree_tokens for s in before), 1)
        )
        metrics["dta/compression_ratio_after_balance"].append(result.compression_after)
        metrics["dta/rank_cost_imbalance"].append(result.imbalance)
        return local, local_groups

    def _dta_refit_cost_model(self) -> None:
        """Refit the balancer's cost model to the engine times of all ranks (identically on every rank)."""
        samples = [row for rows in gather_object([self._dta_cost_samples]) for row in rows]
        if len(samples) >= 8:
            self._dta_cost_model = CostModel.fit(samples, hidden_size=self._dta_cost_model.hidden_size)

    def _dta_split_generation_batch(self, batch: dict, groups: torch.Tensor | None = None) -> list[dict]:
        """Cut a generation batch into `steps_per_generation` micro-batches of TRL's size, groups kept together.

        The rows are first permuted with `torch.randperm(n)`, the draw TRL's `shuffle_sequence_dict` makes (so the
        random stream, hence later generations, stay the same as TRL's). Groups are the runs of `num_generations` rows
        the `RepeatSampler` produced. When all groups have one size that divides the micro-batch size, whole groups
        are assigned by cost; otherwise the lexicographically sorted batch is cut into equal runs (a group is split
        only where the sizes force it). The micro-batches come in the order of their first row in the permutation.
        """
        k = self.args.steps_per_generation
        n = len(batch["prompt_ids"])
        permutation = torch.randperm(n)
        layout = None if any(batch.get(key) is not None for key in _VISION_KEYS) else _Layout.from_inputs(batch)
        if layout is None:
            return split_tensor_dict(_take(batch, permutation), k)
        if groups is None:
            groups = (self.accelerator.process_index * n + torch.arange(n)) // self.num_generations
        labels = groups[permutation].tolist()
        sizes = {labels.count(g) for g in set(labels)}
        keep = len(sizes) == 1 and (n // k) % sizes.pop() == 0
        parts = partition(
            [layout.seqs[j] for j in permutation.tolist()],
            k,
            cost_model=self._dta_cost_model,
            group_ids=labels if keep else None,
            keep_groups=keep,
            equal_count=True,
        ).parts
        parts.sort(key=min)
        return [_take(batch, permutation[torch.tensor(part, dtype=torch.long)]) for part in parts]

    # ------------------------------------------------------------------ no-grad scoring

    def _get_per_token_logps_and_entropies(
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
        if self._dta_replay_values is not None:
            logps, entropies = self._dta_replay_values
            return logps, entropies if compute_entropy else None, None
        if (
            self._dta.dta_enabled
            and not torch.is_grad_enabled()
            and not compute_aux_loss
            and all(v is None for v in multimodal.values())
        ):
            layout = _Layout.from_padded(input_ids, attention_mask, logits_to_keep)
            if layout is not None:
                tree = PrefixTree.from_sequences(layout.seqs)
                if tree.compression_ratio >= self._dta.dta_min_compression:
                    engine = self._dta_engine(self.accelerator.unwrap_model(model))
                    with self.accelerator.autocast():
                        out = engine.logprobs(
                            tree, temperature=self.temperature, entropy=compute_entropy, n_scored=layout.lengths
                        )
                    logps = layout.gather(out.logps, input_ids.device)
                    entropies = layout.gather(out.entropies, input_ids.device) if compute_entropy else None
                    return logps, entropies, None
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
    def _dta_replay(self, logps: torch.Tensor, entropies: torch.Tensor | None):
        """Make TRL's `_compute_loss` read these `(B, T)` log-probs/entropies instead of running the model."""
        self._dta_replay_values = (logps, entropies)
        try:
            yield
        finally:
            self._dta_replay_values = None

    # ------------------------------------------------------------------ training

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not (self._dta.dta_enabled and not return_outputs and self.model.training and torch.is_grad_enabled()):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        loss = self._dta_compute_loss(model, inputs, num_items_in_batch)
        self._metrics["train"]["dta/dense_fallback"].append(float(loss is None))
        if loss is None:
            loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if (self._step + 1) % self.current_gradient_accumulation_steps == 0 and self._dta_step_time:
            self._metrics["train"]["dta/step_time"].append(self._dta_step_time)
            self._dta_step_time = 0.0
        return loss

    def _dta_sequence_loss(self, inputs: dict, scale: float):
        """The per-sequence objective of this micro-batch, or None when the loss is not a sum over sequences."""
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
        return scale / self.accelerator.gradient_accumulation_steps

    def _dta_backward_context(self, model):
        """Context of the engine's backward calls (they run on the unwrapped model; see `training_step`)."""
        return contextlib.nullcontext()

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Under DDP, every micro-step runs without DDP's synchronisation (the engine back-propagates many times, on
        the unwrapped model, which DDP's reducer never sees), and the gradients are averaged once, explicitly, at the
        end of the accumulation window (dense-fallback micro-steps included, so all ranks reduce the same way)."""
        if not (self._dta.dta_enabled and self.accelerator.num_processes > 1):
            return super().training_step(model, inputs, num_items_in_batch)
        with self.accelerator.no_sync(model):
            loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:
            params = trainable_parameters(self.accelerator.unwrap_model(model))
            all_reduce_gradients(params, self.accelerator.num_processes)
        return loss

    def _dta_compute_loss(self, model, inputs: dict, num_items_in_batch) -> torch.Tensor | None:
        """Forward and backward of one micro-batch through the engine; None when it must take TRL's dense path."""
        if any(inputs.get(key) is not None for key in _VISION_KEYS):
            return None
        layout = _Layout.from_inputs(inputs)
        if layout is None:
            return None
        tree = PrefixTree.from_sequences(layout.seqs)
        if tree.compression_ratio < self._dta.dta_min_compression:
            return None

        device = self.accelerator.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        engine = self._dta_engine(self.accelerator.unwrap_model(model))
        scale = self._dta_loss_scale(num_items_in_batch)
        objective = self._dta_sequence_loss(inputs, scale)
        out_device = inputs["completion_ids"].device
        scored = layout.lengths  # the engine projects only the completion positions through the LM head

        # Autocast covers the model computation only, as in TRL's `_get_per_token_logps_and_entropies`.
        run = dict(temperature=self.temperature, n_scored=scored)
        if objective is not None:
            with self._dta_backward_context(model), self.accelerator.autocast():
                out = engine.forward_backward(tree, objective, entropy=True, **run)
            forward_tokens = out.stats["forward_tokens"]
            logps = layout.gather(out.logps, out_device)
            entropies = layout.gather(out.entropies, out_device)
            with torch.no_grad(), self._dta_replay(logps, entropies):
                loss = self._compute_loss(model, inputs)  # the logged value and TRL's metrics
        else:
            with self.accelerator.autocast():
                first = engine.logprobs(tree, entropy=True, **run)
            logps = layout.gather(first.logps, out_device).requires_grad_()
            entropies = layout.gather(first.entropies, out_device).requires_grad_()
            with self._dta_replay(logps, entropies):
                loss = self._compute_loss(model, inputs)
            grad_logps, grad_entropies = torch.autograd.grad(loss * scale, (logps, entropies), allow_unused=True)
            if grad_logps is None:
                grad_logps = torch.zeros_like(logps)

            def surrogate(i, seq_logps, seq_entropies):
                """`<logps_i, dL/dlogps_i> + <entropies_i, dL/dentropies_i>`: TRL's gradient, one sequence."""
                n = seq_logps.size(0)
                term = (seq_logps * grad_logps[i, :n].to(seq_logps.device, seq_logps.dtype)).sum()
                if grad_entropies is not None:
                    h = grad_entropies[i, :n].to(seq_entropies.device, seq_entropies.dtype)
                    term = term + (seq_entropies * h).sum()
                return term

            with self._dta_backward_context(model), self.accelerator.autocast():
                out = engine.forward_backward(tree, surrogate, entropy=grad_entropies is not None, **run)
            forward_tokens = first.stats["forward_tokens"] + out.stats["forward_tokens"]

        seconds = time.perf_counter() - start
        self._dta_step_time += seconds
        if self._dta.dta_cost_model == "fit":
            s = forest_stats(tree)
            self._dta_cost_samples.append((s.tree_tokens, s.attention_work, s.leaves, seconds))
        metrics = self._metrics["train"]
        metrics["dta/compression_ratio"].append(tree.compression_ratio)
        metrics["dta/tokens"].append(float(tree.n_tokens))
        metrics["dta/tree_tokens"].append(float(tree.n_tree_tokens))
        metrics["dta/forward_tokens"].append(float(forward_tokens))
        metrics["dta/peak_memory_mb"].append(_peak_memory_mb(device))
        return loss.detach().requires_grad_()


def dta_parameters_doc() -> str:
    """The `dta_*` parameters in the Hugging Face docstring format, from the fields' help text (one source)."""
    import textwrap

    lines = ["    Parameters:", "        > Parameters that control Dynamic Tree Attention", ""]
    for f in fields(DTAArguments):
        kind = {"bool": "bool", "int": "int", "float": "float", "str": "str", "int | None": "int` or `None"}[str(f.type)]
        lines.append(f"        {f.name} (`{kind}`, *optional*, defaults to `{f.default}`):")
        lines += textwrap.wrap(f.metadata["help"], width=116, initial_indent=" " * 12, subsequent_indent=" " * 12)
    return "\n".join(lines) + "\n"
