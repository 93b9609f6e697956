"""Real FSDP2 and DeepSpeed on a CPU machine, for the launched test scripts (`dist_run.py`, the benchmark).

accelerate 1.15 upgrades the distributed type to FSDP only for accelerator devices (`AcceleratorState.__init__`,
around `accelerate/state.py:986-1013`: MULTI_CPU is not in the list), so on CPU an FSDP config silently becomes DDP;
and it takes DeepSpeed only when `cpu=False`, which on a machine without GPU leaves no backend at all (one process).
[`enable_cpu_engines`] applies the same upgrades for MULTI_CPU (a gloo group, `use_cpu=True`) when FSDP or DeepSpeed
was asked for (`ACCELERATE_USE_FSDP` / `ACCELERATE_USE_DEEPSPEED`, or a plugin passed in code):
`torch.distributed.fsdp.fully_shard` then really shards the model over gloo (DTensor parameters, with bf16 the
`MixedPrecisionPolicy` accelerate sets for a GPU), and DeepSpeed (with `DS_ACCELERATOR=cpu`) really wraps it in its
engine. The scripts assert that they did ([`assert_fsdp2`],
`dist_run.assert_deepspeed`), so that a silent fall-back to DDP can never pass.

Under DeepSpeed it also turns off DeepSpeed's CPU shared-memory communication op (`deepspeed_shm_comm`), which
`deepspeed.comm` otherwise compiles with a C++ toolchain at its first initialisation (about a minute on 2 cores, again
whenever another environment built it into the shared `~/.cache/torch_extensions`): its one use is
`inference_all_reduce` of DeepSpeed's inference engine, never called in training (ZeRO reduces through
`torch.distributed`), and a GPU run has no such op.
"""

from __future__ import annotations

import os


def enable_cpu_engines() -> None:
    """Patch `AcceleratorState.__init__` (idempotent) to apply accelerate's FSDP and DeepSpeed upgrades on MULTI_CPU
    too."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState.__init__, "_dta_cpu_engines", False):
        return
    original = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        # Every `AcceleratorState()` copies PartialState's type (MULTI_CPU) over the shared state again: re-apply.
        if self.distributed_type != DistributedType.MULTI_CPU:
            return
        # A state already set up keeps its plugins (accelerate's `if not self.initialized`).
        if (fsdp_plugin is not None and getattr(self, "fsdp_plugin", None) is None
                and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"):
            self.fsdp_plugin = fsdp_plugin
        if getattr(self, "fsdp_plugin", None) is not None:
            if self.distributed_type != DistributedType.FSDP and self._mixed_precision != "no":
                # As accelerate does for a GPU (state.py ~1015): bf16 gives FSDP2 a MixedPrecisionPolicy with bf16
                # param, reduce and output dtypes (besides the autocast around the model's forward).
                self.fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.distributed_type = DistributedType.FSDP
        plugin = kwargs.get("deepspeed_plugin")
        if (plugin is not None and getattr(self, "deepspeed_plugins", None) is None
                and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"):
            plugin.set_mixed_precision(self._mixed_precision)  # as accelerate does for a GPU (state.py ~975)
            plugin.select(_from_accelerator_state=True)
            self.deepspeed_plugins = plugin
        if getattr(self, "deepspeed_plugins", None) is not None:
            self.distributed_type = DistributedType.DEEPSPEED

    __init__._dta_cpu_engines = True
    AcceleratorState.__init__ = __init__
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # `deepspeed.comm.torch.build_shm_op`


def assert_fsdp2(trainer) -> None:
    """The trainer's model really ran under FSDP2: accelerate's state says FSDP version 2 and every parameter is a
    DTensor."""
    from accelerate.utils import DistributedType
    from torch.distributed.tensor import DTensor

    accelerator = trainer.accelerator
    assert accelerator.distributed_type == DistributedType.FSDP, accelerator.distributed_type
    assert accelerator.is_fsdp2 and trainer.is_fsdp_enabled
    params = list(trainer.model.named_parameters())
    plain = [n for n, p in params if not isinstance(p, DTensor)]
    assert params and not plain, f"parameters not sharded by FSDP2: {plain[:5]}"


class CollectiveCounter:
    """Counts FSDP2's collectives (`torch.distributed.all_gather_single` / `reduce_scatter_single`, what
    `_fsdp_collectives` calls) while `active`; `count_training(trainer)` makes it active inside `training_step` except
    in `_prepare_inputs` (generation and scoring), i.e. the optimizer step's forward/backward and reduction."""

    def __init__(self):
        import torch.distributed as dist

        self.counts = {"all_gather": 0, "reduce_scatter": 0}
        self.active = False
        for key, name in (("all_gather", "all_gather_single"), ("reduce_scatter", "reduce_scatter_single")):
            original = getattr(dist, name)

            def counted(*args, _original=original, _key=key, **kwargs):
                if self.active:
                    self.counts[_key] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def count_training(self, trainer) -> None:
        active_in_optimizer_steps(trainer, self)


def active_in_optimizer_steps(trainer, holder) -> None:
    """Set `holder.active` inside the trainer's `training_step` except in its `_prepare_inputs` (generation and
    scoring): the optimizer steps' forward/backward and gradient reduction (the trainer's class is subclassed)."""
    cls = type(trainer)

    class InOptimizerSteps(cls):
        def training_step(self, *args, **kwargs):
            holder.active = True
            try:
                return super().training_step(*args, **kwargs)
            finally:
                holder.active = False

        def _prepare_inputs(self, *args, **kwargs):
            active, holder.active = holder.active, False
            try:
                return super()._prepare_inputs(*args, **kwargs)
            finally:
                holder.active = active

    trainer.__class__ = InOptimizerSteps
