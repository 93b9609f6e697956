"""The trainers' vLLM engine: TRL builds it (`use_vllm=True`); this module adds what vLLM's CPU build needs to that
construction (`vllm_cpu.py` beside it holds the settings and why) and refuses server mode where its weight sync
cannot work. On a GPU both are no-ops: TRL's engine is built exactly as TRL builds it."""

from __future__ import annotations

import contextlib

from . import _trl, vllm_cpu


def colocated_engine(trainer, args) -> contextlib.AbstractContextManager:
    """Around the TRL trainer's construction: its colocated engine (`use_vllm=True, vllm_mode="colocate"`) built with
    the CPU settings when vLLM runs on a CPU (`enforce_eager`, the policy's dtype, linear weights kept as parameters,
    the environment's defaults), in the policy's dtype read from `trainer.model` when TRL builds the engine (after
    loading the model).

    Args:
        trainer (`GRPOTrainer`): the trainer under construction.
        args (`GRPOConfig` or `RLOOConfig`): its config.

    Returns:
        a context manager (a no-op without colocated vLLM, or without vLLM installed: TRL's `ImportError` then says how
        to install it).
    """
    if not (args.use_vllm and args.vllm_mode == "colocate" and vllm_cpu.vllm_available()):
        return contextlib.nullcontext()

    def wrap(previous):
        def build(**kwargs):
            extra = vllm_cpu.engine_arguments(trainer.model.dtype, trainer.model.config)
            with vllm_cpu.keeping_torch_threads():
                return previous(**{**kwargs, **extra})

        return build

    return _trl.vllm_engine_builder(wrap)


def check_vllm_mode(args) -> None:
    """Refuses `vllm_mode="server"` without CUDA before TRL's client connects (its weight sync needs NCCL); see
    [`~trl_dta.trainers.vllm_cpu.check_server_mode`]."""
    if args.use_vllm:
        vllm_cpu.check_server_mode(args.vllm_mode)


def close_colocated_engine(trainer) -> None:
    """Shuts the trainer's colocated engine down (once; later calls do nothing). `Trainer.end()` destroys the
    distributed process group that the engine's own groups were made in; vLLM's shutdown at interpreter exit then
    fails with `ValueError: Invalid process group specified` (`destroy_model_parallel`), so the trainers close the
    engine first."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is not None and getattr(trainer.args, "vllm_mode", None) == "colocate":
        generation.llm.llm_engine.engine_core.shutdown()  # vLLM 0.32: `InprocClient.shutdown`, idempotent
