"""The trainer's policy as a [`~trl_dta.generation.Generator`]: the one place that knows how TRL holds the model for
generation and which generator samples it. Tree rollouts (`tree_rollouts.py`) and the rollout functions
(`envs/trl_rollout.py`, `envs/tau2/trl.py`) take their generator from here, so a second implementation (vLLM's
`LLM.generate`) is chosen here, from the trainer, without changing them.

Unwrapping is TRL 1.16's (`GRPOTrainer._generate_single_turn`, its transformers branch): profiled as
`transformers.generate`, the model unwrapped by `unwrap_model_for_generation` (DeepSpeed ZeRO-3 parameters gathered
when `ds3_gather_for_generation`, TRL's `generation_kwargs` over the model's generation config, gradient checkpointing
off), under `torch.no_grad()`, with FSDP's full parameters summoned by TRL's distributed backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..generation import CachedGenerate, Generator, reprefill_generate_fn
from . import _trl


@contextlib.contextmanager
def unwrapped_policy(trainer) -> Iterator[torch.nn.Module]:
    """The policy as TRL's transformers generation path holds it while generating (see the module docstring).

    Args:
        trainer (`GRPOTrainer`): the trainer (TRL's or a subclass).
    """
    from trl.extras.profiling import profiling_context
    from trl.models import unwrap_model_for_generation

    with (
        profiling_context(trainer, "transformers.generate"),
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=trainer.generation_kwargs,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as model,
        torch.no_grad(),
        _trl.summon_full_params(trainer),
    ):
        yield model


@contextlib.contextmanager
def policy_generator(trainer, tokenizer=None, *, cache: bool = True) -> Iterator[Generator]:
    """The trainer's policy with its sampling settings (`trainer.generation_config`) as a generator for one rollout.

    Args:
        trainer (`GRPOTrainer`): the trainer.
        tokenizer (*optional*): pad and eos ids (an eos the generation config does not set); defaults to the trainer's
            `processing_class`.
        cache (`bool`, *optional*, defaults to `True`): [`~trl_dta.generation.CachedGenerate`] (every shared prefix
            forwarded once); `False`: `model.generate` on whole prefixes
            ([`~trl_dta.generation.reprefill_generate_fn`]).

    Yields:
        [`~trl_dta.generation.Generator`]: valid inside the block (the unwrapped model's weights).
    """
    tokenizer = trainer.processing_class if tokenizer is None else tokenizer
    with unwrapped_policy(trainer) as model:
        if cache:
            yield CachedGenerate(model, tokenizer, trainer.generation_config)
        else:
            yield reprefill_generate_fn(model, tokenizer, trainer.generation_config)
