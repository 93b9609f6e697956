"""FSDP and DeepSpeed on processes of a CPU machine (a gloo group): what accelerate sets up only for accelerators.

accelerate 1.16 upgrades the distributed type to FSDP only for accelerator devices (`AcceleratorState.__init__`:
MULTI_CPU is not in the list), so on CPU an FSDP config silently becomes DDP; and it takes DeepSpeed only when
`cpu=False`, which on a machine without an accelerator leaves no backend at all (one process). [`enable_cpu_engines`]
applies the same upgrades for MULTI_CPU (`use_cpu=True` in the training arguments) when FSDP or DeepSpeed was asked for
(`ACCELERATE_USE_FSDP` / `ACCELERATE_USE_DEEPSPEED`, as `accelerate launch` sets them from a config file, or a plugin
passed in code): `torch.distributed.fsdp.fully_shard` then really shards the model over gloo, and DeepSpeed (its CPU
accelerator: chosen by itself on a machine without GPU, or `DS_ACCELERATOR=cpu`) really wraps it in its engine. The
recipe calls it (`recipes/configs/zero3_cpu.yaml`); on an accelerator, or without FSDP/DeepSpeed, it changes nothing.
The tests call it in every launched script and assert that the engine ran.

Under DeepSpeed it also turns off DeepSpeed's CPU shared-memory communication op (`deepspeed_shm_comm`), which
`deepspeed.comm` otherwise compiles with a C++ toolchain at its first initialisation (about a minute on 2 cores): its
one use is `inference_all_reduce` of DeepSpeed's inference engine, never called in training (ZeRO reduces through
`torch.distributed`).
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
