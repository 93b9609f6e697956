"""Distributed engines under DTA: what each of accelerate's distributed types needs, read from the state accelerate
actually set up.

The engine runs many forward and backward calls per optimizer window, on the model's submodules (the decoder, the LM
head) rather than through a wrapper's forward, so every distributed engine needs its own handling of (1) what is
gathered while the engine runs and (2) how the window's gradients are reduced. One strategy object per kind, with
the few operations the trainer calls (`trainers/_mixin.py` only dispatches):

- `begin_window(model)` / `end_window(model)`: at the first micro-step of an optimizer window and after its last one
  (`end_window` reduces the gradients).
- `micro_step(model)`: a context around each micro-step.
- `engine_call(model, train)`: a context around each engine call, yielding the call's `lockstep` argument (None, or
  FSDP2's `"layer"` agreement); `scoring(model)` around each no-grad scoring call (TRL's
  `_get_per_token_logps_and_entropies`, DTA or dense path).
- `gathered(model)`: a context in which `model`'s parameters are whole (ZeRO-3; the construction probe runs in it).
- `backward_scale(accelerator)`: the factor `accelerator.backward` applies to the loss.
- `all_ranks(flag)`: whether `flag` holds on every rank, for strategies whose ranks must take one path (`agreed`:
  FSDP2's `"layer"` schedule and ZeRO-3, where the model's calls or the engine call's gathering are collectives);
  `flag` itself elsewhere. `lockstep`: the engine calls themselves run in lockstep (the per-layer schedules).

| accelerate `distributed_type`         | strategy       | the engine runs on                    | gradients reduced            |
|---------------------------------------|----------------|---------------------------------------|------------------------------|
| `NO`                                  | `Local`        | the model                             | -                            |
| `MULTI_CPU`, `MULTI_GPU`, ...         | `DataParallel` | the unwrapped model (no DDP hooks)    | one all-reduce pass per step |
| `FSDP`, `fsdp_version: 2`             | `fsdp2.FSDP2`  | the model, every group gathered       | one reduce-scatter per group |
| same, `dta_fsdp_schedule="layer"`     | `fsdp2.FSDP2`  | held groups gathered, layers per call | layers: after every backward |
| `DEEPSPEED`, ZeRO-0/1/2               | `zero.Zero`    | the model, replicated parameters      | one DeepSpeed reduction pass |
| `DEEPSPEED`, ZeRO-3                   | `zero3.Zero3`  | the model gathered per engine call    | one DeepSpeed reduction pass |
| same, over `dta_zero3_gather_budget_mb` | `zero3.Zero3` | layers gathered by DeepSpeed's hooks | layers: during each backward |

Refused at construction (one `DTAUnsupportedError`), each with the supported alternative: FSDP1 (`fsdp_version: 1`),
FSDP2 with CPU offload or FSDP activation checkpointing, DeepSpeed ZeRO offload, tensor/context/sequence parallelism,
Megatron-LM, XLA. The table is keyed on what accelerate set up (`accelerator.distributed_type`, its FSDP and DeepSpeed
plugins), whatever the source: `TrainingArguments.fsdp` / `deepspeed`, an accelerate config file, `ACCELERATE_*`
environment variables, or plugins passed in code.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..refusal import DISTRIBUTED, TRAINER_ALTERNATIVE, Blocker, DTAUnsupportedError, refuse
from .ddp import DataParallel, Local


@dataclass(frozen=True)
class StrategySettings:
    """The trainer's settings a strategy depends on.

    Args:
        fsdp_schedule (`str`, *optional*, defaults to `"window"`): FSDP2's schedule (`dta_fsdp_schedule`).
        zero3_gather_budget_mb (`float`, *optional*): ZeRO-3's memory budget (`dta_zero3_gather_budget_mb`).
        model (`torch.nn.Module`, *optional*): the unwrapped policy (ZeRO-3's budget is compared with its size).
    """

    fsdp_schedule: str = "window"
    zero3_gather_budget_mb: float | None = None
    model: object = None


def _fsdp(accelerator, settings: StrategySettings):
    plugin = accelerator.state.fsdp_plugin
    version = getattr(plugin, "fsdp_version", 1)
    blockers = []
    if version != 2:
        blockers.append(Blocker(
            f"FSDP version {version} is not supported with DTA: DTA's gathered optimizer step drives FSDP2's "
            "parameter groups (`trl_dta.parallel.fsdp2`), not FSDP1's flat parameters",
            fix="use FSDP2 (`fsdp_version: 2` in the accelerate config, or `fsdp_config={'version': 2}` in the "
                "training arguments)"))
    if type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy":
        blockers.append(Blocker(
            "FSDP2 CPU offload (`fsdp_offload_params: true`) is not supported with DTA: the gathered optimizer step "
            "(`trl_dta.parallel.fsdp2`) is untested with host-resident shards and gradients",
            fix="turn offload off, or use DeepSpeed ZeRO without offload"))
    if plugin.activation_checkpointing:
        blockers.append(Blocker(
            "FSDP activation checkpointing (`fsdp_activation_checkpointing: true`) is not supported with DTA: it "
            "recomputes a layer's forward during the backward, when the engine's key/value stack has moved on to "
            "another path",
            fix="turn it off; DTA bounds activation memory with its own block recompute (`dta_max_graph_tokens`)"))
    refuse(DISTRIBUTED, blockers, alternative=TRAINER_ALTERNATIVE)
    from .fsdp2 import FSDP2

    return FSDP2(settings.fsdp_schedule, accelerator.device)


def _deepspeed(accelerator, settings: StrategySettings):
    if int(accelerator.state.deepspeed_plugin.zero_stage) == 3:
        from .zero3 import Zero3

        return Zero3.from_accelerator(accelerator, settings.model, settings.zero3_gather_budget_mb)
    from .zero import Zero

    return Zero.from_accelerator(accelerator)


def _refusing(blocker: Blocker):
    def refuse_kind(accelerator, settings):
        raise DTAUnsupportedError(DISTRIBUTED, [blocker], alternative=TRAINER_ALTERNATIVE)

    return refuse_kind


_MEGATRON = Blocker("Megatron-LM is not supported with DTA",
                    fix="use FSDP2 (`fsdp_version: 2`), DeepSpeed ZeRO or DDP")
_XLA = Blocker("XLA (TPU) is not supported with DTA", fix="use a GPU or CPU device with DDP, FSDP2 or DeepSpeed ZeRO")


def _data_parallel(accelerator, settings: StrategySettings):
    return DataParallel(accelerator) if accelerator.num_processes > 1 else Local()


# accelerate `DistributedType` value -> factory (accelerator, settings) -> strategy.
STRATEGIES = {
    "NO": lambda accelerator, settings: Local(),
    **{kind: _data_parallel for kind in ("MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA",
                                         "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON")},
    "FSDP": _fsdp,
    "DEEPSPEED": _deepspeed,
    "MEGATRON_LM": _refusing(_MEGATRON),
    "XLA": _refusing(_XLA),
}


def _check_parallelism(accelerator) -> None:
    config = getattr(accelerator, "parallelism_config", None)
    if config is None:
        return
    used = [name for name in ("tp", "cp", "sp") if getattr(config, f"{name}_enabled", False)]
    if used:
        refuse(DISTRIBUTED, [Blocker(
            f"accelerate's parallelism_config enables {', '.join(n.upper() for n in used)} parallelism, which splits "
            "each sequence or layer across ranks; DTA's walk needs whole sequences and whole layers on a rank",
            fix="use data parallelism only (`dp_shard_size` / `dp_replicate_size`)")], alternative=TRAINER_ALTERNATIVE)


def strategy_for(accelerator, settings: StrategySettings | None = None):
    """The strategy for what `accelerator` actually set up; refuses an unsupported setting (at construction: call it
    once the TRL trainer is built).

    Args:
        accelerator (`accelerate.Accelerator`): the trainer's.
        settings ([`StrategySettings`], *optional*): the trainer's settings (defaults: `StrategySettings()`).
    """
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    factory = STRATEGIES.get(kind)
    if factory is None:
        refuse(DISTRIBUTED, [Blocker(f"accelerate distributed_type {kind} is not supported with DTA",
                                     fix="use DDP (MULTI_CPU, MULTI_GPU, ...), FSDP2 or DeepSpeed ZeRO")],
               alternative=TRAINER_ALTERNATIVE)
    _check_parallelism(accelerator)
    return factory(accelerator, settings if settings is not None else StrategySettings())


__all__ = ["STRATEGIES", "DataParallel", "Local", "StrategySettings", "strategy_for"]
