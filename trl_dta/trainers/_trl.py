"""The one module that touches TRL's private state. Where TRL offers no public hook, the trainers read and write its
trainers' private attributes and call their private methods here, one small function each, with the TRL version it
was read from; everything else in `trl_dta` calls these functions and holds plain values
(`tests/trainers/test_trl_boundary.py` fails on a private TRL access anywhere else).

An upgrade of TRL is a read of this module against the new `trl/trainer/grpo_trainer.py` and `rloo_trainer.py`: each
entry of [`PRIVATE_ATTRIBUTES`] and [`OVERRIDDEN_HOOKS`] names what to check (another TRL minor version than
`config.TESTED_TRL_VERSIONS` gets a warning at construction; `tests/trainers/test_trl_signatures.py` compares every
overridden method's signature with the installed TRL's and names the drift).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

# TRL's private attributes and methods read, written or called below (name -> TRL version, what for).
PRIVATE_ATTRIBUTES = {
    "_metrics": ("1.16.0", "`{'train': defaultdict(list), 'eval': ...}`: every hook logs next to TRL's metrics"),
    "_step": ("1.16.0", "micro-steps done (incremented by TRL's `training_step`): the window's position"),
    "_buffered_inputs": ("1.16.0", "the generation's micro-batches (`None` before the first): read and written"),
    "_is_vlm": ("1.16.0", "a vision-language model's processor (its family's images checked; tree rollouts refuse it)"),
    "_tokenizer": ("1.16.0", "the tokenizer of the processing class: the pad id"),
    "_dist": ("1.16.0", "`DistributedBackend`: FSDP's full parameters summoned for generation"),
    "_entropy_bonus_enabled": ("1.16.0", "GRPO's entropy bonus is on (absent in RLOO)"),
    "_last_world_entropy": ("1.16.0", "GRPO's adaptive entropy controller: read, and restored after an unlogged loss"),
    "_entropy_window_stats": ("1.16.0", "GRPO's adaptive entropy controller: restored after an unlogged loss"),
    "_tag_names": ("1.16.0", "the class's Hub tags, extended by the subclasses"),
    "_generate_and_score_completions": ("1.16.0", "called by the regrouping `_prepare_inputs` (and overridden)"),
    "_compute_loss": ("1.16.0", "TRL's objective of a micro-batch: called, and compared to see a subclass's own"),
    "_last_loaded_step": ("1.16.0", "the optimizer step whose weights vLLM holds: read and written by a weight sync"),
}

# TRL's private hooks the trainers override (TRL calls them by name); each override delegates to TRL's with `super()`.
OVERRIDDEN_HOOKS = {
    "_prepare_inputs": ("1.16.0", "`_mixin.py`: the opt-in regroupings and per-turn rows"),
    "_get_per_token_logps_and_entropies": ("1.16.0", "`_mixin.py`: no-grad log-probs through the engine; the replay"),
    "_generate_single_turn": ("1.16.0", "`grpo.py`: tree rollouts"),
    "_calculate_rewards": ("1.16.0", "`grpo.py`: the rows TRL could score"),
    "_generate_and_score_completions": ("1.16.0", "`grpo.py`: tree advantages after TRL's scoring; `phases.py`: timed"),
    "_generate": ("1.16.0", "`phases.py`: the rollouts' sampling, timed"),
    "_tag_names": ("1.16.0", "`grpo.py`, `rloo.py`: TRL's tags plus 'trl-dta'"),
}

# TRL's module-level names replaced for the duration of a call (dotted name -> TRL version, what for).
REPLACED_GLOBALS = {
    "trl.generation.vllm_generation.LLM": ("1.16.0", "colocate mode's engine built with the CPU settings"),
}


# ---------------------------------------------------------------------------------------------------- reads


def metrics(trainer, mode: str | None = None) -> dict[str, list]:
    """TRL's metrics of `mode` (`"train"`/`"eval"`; default: the model's current mode): `name -> values`, averaged by
    TRL's `log` over a logging step. Appending to it logs next to TRL's metrics."""
    if mode is None:
        mode = "train" if trainer.model.training else "eval"
    return trainer._metrics[mode]  # TRL 1.16.0: `{"train": defaultdict(list), "eval": defaultdict(list)}`


def step(trainer) -> int:
    """TRL's micro-step counter (incremented after each `training_step`)."""
    return trainer._step  # TRL 1.16.0


def buffered_inputs(trainer) -> list[dict] | None:
    """TRL's buffered micro-batches of the current generation (`steps_per_generation` of them), None before one."""
    return trainer._buffered_inputs  # TRL 1.16.0


def set_buffered_inputs(trainer, batches: list[dict]) -> None:
    """Buffer a generation's micro-batches as TRL's `_prepare_inputs` does (micro-step `s` trains on
    `batches[s % steps_per_generation]`)."""
    trainer._buffered_inputs = batches  # TRL 1.16.0


def is_vlm(trainer) -> bool:
    """Whether TRL's processing class is a vision-language processor."""
    return trainer._is_vlm  # TRL 1.16.0


def tokenizer(trainer):
    """The tokenizer of TRL's processing class (the processor's, for a vision-language model)."""
    return trainer._tokenizer  # TRL 1.16.0


def entropy_bonus_enabled(trainer) -> bool:
    """Whether GRPO's entropy bonus is on (a fixed or adaptive coefficient); False for RLOO, which has none."""
    return getattr(trainer, "_entropy_bonus_enabled", False)  # TRL 1.16.0: set in GRPO's `__init__` only


def entropy_coef(trainer) -> float:
    """GRPO's entropy bonus coefficient in this window (TRL's adaptive mode gates it on the last measured entropy, as
    its `_compute_loss` does); 0 without one."""
    if not entropy_bonus_enabled(trainer):
        return 0.0
    last = trainer._last_world_entropy  # TRL 1.16.0: `inf` until the adaptive controller's first window
    gated = trainer.use_adaptive_entropy and not last <= trainer.args.entropy_target
    return 0.0 if gated else trainer.entropy_coef


def tag_names(trl_class: type, *extra: str) -> list[str]:
    """The Hub tags of a TRL trainer class plus `extra` (a subclass's class attribute `_tag_names`)."""
    return [*trl_class._tag_names, *extra]  # TRL 1.16.0


def own_compute_loss(cls: type, trl_class: type) -> bool:
    """Whether the trainer class `cls` overrides TRL's `_compute_loss` (its own objective, any function of logps)."""
    return cls._compute_loss is not trl_class._compute_loss  # TRL 1.16.0


# ---------------------------------------------------------------------------------------------------- calls


def generate_and_score(trainer, batch: dict) -> dict:
    """TRL's generation and scoring of a generation batch (the trainer's own override included)."""
    return trainer._generate_and_score_completions(batch)  # TRL 1.16.0


def compute_loss(trainer, model, inputs: dict) -> torch.Tensor:
    """TRL's objective of a micro-batch (the trainer's override, if any); logs its metrics into [`metrics`]."""
    return trainer._compute_loss(model, inputs)  # TRL 1.16.0


def summon_full_params(trainer):
    """TRL's context for generation under FSDP: the policy's full parameters summoned (a no-op otherwise)."""
    return trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False)  # TRL 1.16.0


# ---------------------------------------------------------------------------------------------------- writes


def sync_vllm_weights(trainer) -> None:
    """TRL's weight sync before vLLM generates (its `_generate_single_turn` and `_generate` do the same): the policy's
    weights pushed into the colocated engine (`vllm_generation.sync_weights`, which also resets its prefix cache) once
    per optimizer step."""
    from trl.extras.profiling import profiling_context

    if trainer.state.global_step != trainer._last_loaded_step:  # TRL 1.16.0
        with profiling_context(trainer, "sync_weights"):
            trainer.vllm_generation.sync_weights()
        trainer._last_loaded_step = trainer.state.global_step  # TRL 1.16.0


@contextlib.contextmanager
def unlogged(trainer) -> Iterator[None]:
    """Around a call of TRL's `_compute_loss` kept for its gradient only: what it appends to TRL's metrics (of either
    mode) is dropped afterwards, and GRPO's entropy controller (which it updates at a window's last micro-step) is
    restored. TRL's `_compute_loss` only appends to its metrics (TRL 1.16.0), so dropping the values past the lengths
    seen before the call (and the names it added) leaves them as they were."""
    logged = trainer._metrics  # TRL 1.16.0
    lengths = {mode: {name: len(values) for name, values in per_mode.items()} for mode, per_mode in logged.items()}
    names = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")  # TRL 1.16.0: GRPO's controller
    controller = {name: getattr(trainer, name) for name in names if hasattr(trainer, name)}
    try:
        yield
    finally:
        for mode, per_mode in logged.items():
            for name in [name for name in per_mode if name not in lengths.get(mode, {})]:
                del per_mode[name]
            for name, length in lengths.get(mode, {}).items():
                del per_mode[name][length:]
        for name, value in controller.items():  # GRPO's `_compute_loss` sets them at a window's last micro-step
            setattr(trainer, name, value)


@contextlib.contextmanager
def vllm_engine_builder(wrap: Callable[[Callable[..., object]], Callable[..., object]]) -> Iterator[None]:
    """Within the block, TRL's colocate mode builds its engine with `wrap(previous)(**kwargs)`, `kwargs` being what it
    passes to `vllm.LLM` and `previous` the builder in place before (`vllm.LLM`, or an outer block's). TRL 1.16.0
    passes no `enforce_eager` or `dtype` and has no option for them: the trainers wrap their construction in this to
    add vLLM's CPU settings (`trainers/vllm_cpu.py`); tests, outside, hand one session engine to every trainer (TRL
    syncs the trainer's weights into it before its first generation)."""
    from trl.generation import vllm_generation

    trl_build = vllm_generation.LLM  # TRL 1.16.0: `VLLMGeneration._init_vllm` calls `LLM(...)` by this module name
    vllm_generation.LLM = wrap(trl_build)  # TRL 1.16.0
    try:
        yield
    finally:
        vllm_generation.LLM = trl_build  # TRL 1.16.0
