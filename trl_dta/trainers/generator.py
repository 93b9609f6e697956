"""The trainer's policy as a [`~trl_dta.generation.Generator`]: the one place that knows how TRL holds the model for
generation and which generator samples it. Tree rollouts (`tree_rollouts.py`) and the rollout functions
(`envs/core/trl.py`, for the stand-in's and tau2's rollout functions) take their generator from here, chosen from the
trainer:

| trainer                                   | generator                                                            |
|-------------------------------------------|----------------------------------------------------------------------|
| `use_vllm=False` (TRL's default)          | transformers' `generate` ([`~trl_dta.generation.CachedGenerate`])      |
| `use_vllm=True, vllm_mode="colocate"`     | TRL's colocated engine ([`~trl_dta.generation.VLLMGenerate`])         |

With vLLM, the weights are synced into the engine first as TRL syncs them (once per optimizer step,
`_trl.sync_vllm_weights`), and the sampling settings are TRL's vLLM ones ([`vllm_generation_config`]).

Unwrapping is TRL 1.16's (`GRPOTrainer._generate_single_turn`, its transformers branch): profiled as
`transformers.generate`, the model unwrapped by `unwrap_model_for_generation` (DeepSpeed ZeRO-3 parameters gathered
when `ds3_gather_for_generation`, TRL's `generation_kwargs` over the model's generation config, gradient checkpointing
off), under `torch.no_grad()`, with FSDP's full parameters summoned by TRL's distributed backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import GenerationConfig

from ..generation import CachedGenerate, Generator, VLLMGenerate, reprefill_generate_fn
from . import _trl

# What a rollout through the trainer's vLLM engine cannot use, and why (the setting, its value when refused).
_VLLM_REFUSED = {
    ("vllm_mode", "server"): "a rollout's calls run on each process's own engine, and a `trl vllm-serve` server is "
    "shared by all processes (TRL gathers every process's prompts into one request); use `vllm_mode='colocate'`",
    ("vllm_enable_sleep_mode", True): "the engine would sleep between TRL's calls, not between the rollout's; use "
    "`vllm_enable_sleep_mode=False`",
}


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


def check_vllm_rollouts(trainer, what: str) -> None:
    """Refuse the vLLM settings a rollout through the trainer's engine cannot run with (colocate mode, one process per
    engine, no sleep mode); each error names the setting and the fix.

    Args:
        trainer (`GRPOTrainer`): the trainer, `use_vllm=True`.
        what (`str`): the rollout, as the message names it (`"tree rollouts"`, `"AgentRolloutFunc"`).
    """
    args = trainer.args
    for (name, value), why in _VLLM_REFUSED.items():
        if getattr(args, name, None) == value:
            raise ValueError(f"{what} through vLLM cannot run with `{name}={value!r}`: {why}, or generate with "
                             "transformers (`use_vllm=False`).")
    if args.vllm_tensor_parallel_size != 1:
        raise ValueError(f"{what} through vLLM run on each process's own engine, so their calls cannot be "
                         f"collective over a tensor-parallel group: use `vllm_tensor_parallel_size=1` (got "
                         f"{args.vllm_tensor_parallel_size}), or generate with transformers (`use_vllm=False`).")


def vllm_generation_config(trainer, tokenizer=None) -> tuple[GenerationConfig, dict]:
    """TRL's vLLM sampling settings (`GRPOTrainer` builds no `generation_config` with `use_vllm=True`: its
    `vllm_generation` holds `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and the `generation_kwargs`
    it hands to `SamplingParams`) as a `GenerationConfig` with the trainer's stop ids, and the `SamplingParams`
    arguments left over. vLLM's `min_tokens` becomes `min_new_tokens`, so that tree rollouts reduce it per level.

    Returns:
        `(generation_config, sampling_kwargs)`: the arguments of [`~trl_dta.generation.VLLMGenerate`].
    """
    engine = trainer.vllm_generation
    tokenizer = trainer.processing_class if tokenizer is None else tokenizer
    sampling_kwargs = dict(engine.generation_kwargs or {})
    config = GenerationConfig(
        do_sample=True, temperature=engine.temperature, top_p=engine.top_p, top_k=engine.top_k, min_p=engine.min_p,
        repetition_penalty=engine.repetition_penalty, min_new_tokens=sampling_kwargs.pop("min_tokens", None),
        eos_token_id=list(trainer.eos_token_ids), pad_token_id=getattr(tokenizer, "pad_token_id", None),
    )
    return config, sampling_kwargs


@contextlib.contextmanager
def policy_generator(trainer, tokenizer=None, *, cache: bool = True) -> Iterator[Generator]:
    """The trainer's policy with its sampling settings as a generator for one rollout (the module docstring's table).

    Args:
        trainer (`GRPOTrainer`): the trainer.
        tokenizer (*optional*): pad and eos ids (an eos the generation config does not set); defaults to the trainer's
            `processing_class`.
        cache (`bool`, *optional*, defaults to `True`): transformers' generation only:
            [`~trl_dta.generation.CachedGenerate`] (every shared prefix forwarded once); `False`: `model.generate` on
            whole prefixes ([`~trl_dta.generation.reprefill_generate_fn`]). vLLM's prefix cache is the engine's.

    Yields:
        [`~trl_dta.generation.Generator`]: valid inside the block (the unwrapped model's weights, or the engine's,
        synced).
    """
    if trainer.use_vllm:
        _trl.sync_vllm_weights(trainer)
        config, sampling_kwargs = vllm_generation_config(trainer, tokenizer)
        from trl.extras.profiling import profiling_context

        with profiling_context(trainer, "vLLM.generate"):
            yield VLLMGenerate(trainer.vllm_generation.llm, config, sampling_kwargs=sampling_kwargs)
        return
    tokenizer = trainer.processing_class if tokenizer is None else tokenizer
    with unwrapped_policy(trainer) as model:
        if cache:
            yield CachedGenerate(model, tokenizer, trainer.generation_config)
        else:
            yield reprefill_generate_fn(model, tokenizer, trainer.generation_config)
