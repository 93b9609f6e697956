"""What a launched distributed run (`dist_run.py`) records about itself and asserts: the resident set over the
optimizer steps (`StepMemory`), the trainable parameters (`StepParams`, `initial_values`, `full`: whole under FSDP2 and
ZeRO), the dtypes its optimizer steps really ran in (`PrecisionProbe`, `assert_precision`, `BF16_RUNS`) and that
DeepSpeed really ran (`assert_deepspeed`). Imported by the launched scripts, which put this folder on `sys.path`.
"""

from __future__ import annotations

import os

import torch

from cpu_engines import active_in_optimizer_steps


def current_rss_mb() -> float:
    """This process's resident set now, MiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """This process's peak resident set so far, MiB (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StepMemory:
    """The resident set's peak over the optimizer steps after the first (the engine's set-up and first step excluded):
    Linux's high-water mark, reset at the end of step 1 (`/proc/self/clear_refs`), and the resident set then."""

    def __init__(self, trainer):
        from transformers import TrainerCallback

        self.after_first_step_mb = None
        outer = self

        class Reset(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 1:
                    outer.after_first_step_mb = current_rss_mb()
                    with open("/proc/self/clear_refs", "w") as f:
                        f.write("5")

        trainer.add_callback(Reset())

    def result(self) -> dict:
        if self.after_first_step_mb is None:
            return {}
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        return {"after_first_step_mb": self.after_first_step_mb, "steps_peak_mb": hwm / 1024}


class StepParams:
    """The trainable parameters after every optimizer step (`full`: collective under FSDP2 and ZeRO-3)."""

    def __init__(self, trainer):
        from transformers import TrainerCallback

        self.params: list[dict[str, torch.Tensor]] = []
        outer = self

        class Record(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                model = trainer.accelerator.unwrap_model(trainer.model)
                outer.params.append({n: full(p, trainer.is_deepspeed_enabled) for n, p in model.named_parameters()
                                     if p.requires_grad})

        trainer.add_callback(Record())


def initial_values(model) -> dict[str, torch.Tensor]:
    """The trainable parameters before training, on CPU (ZeRO-3's partitioned ones gathered: collective)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    partitioned = [p for _, p in trainable if hasattr(p, "ds_id")]
    if not partitioned:
        return {n: p.detach().cpu().clone() for n, p in trainable}
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned):
        return {n: p.detach().cpu().clone() for n, p in trainable}


def full(p: torch.Tensor, deepspeed: bool = False) -> torch.Tensor:
    """A parameter's whole value on CPU (an FSDP2 DTensor gathered from its shards; under DeepSpeed with a bf16
    module or under ZeRO-3, the float32 master weight the ZeRO optimizer trains, gathered from its partitions)."""
    from torch.distributed.tensor import DTensor

    if deepspeed and (p.dtype != torch.float32 or hasattr(p, "ds_id")):
        from deepspeed.utils import safe_get_full_fp32_param

        master = safe_get_full_fp32_param(p)
        assert master is not None, "DeepSpeed keeps no float32 master weight of this parameter"
        return master.cpu().clone()
    p = p.detach()
    return (p.full_tensor() if isinstance(p, DTensor) else p).cpu().clone()


class PrecisionProbe:
    """What precision really ran in the optimizer steps (`training_step`, generation and scoring excluded): for every
    `nn.Linear` call, the dtype of the weight it multiplied by, of its output, and whether autocast was on."""

    def __init__(self, trainer):
        probe = self
        self.calls: set[tuple[str, str, bool]] = set()
        self.active = False

        def hook(module, inputs, output):
            if probe.active:
                probe.calls.add((dtype_name(module.weight.dtype), dtype_name(output.dtype),
                                 torch.is_autocast_enabled(output.device.type)))

        model = trainer.accelerator.unwrap_model(trainer.model)
        self.handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear)]

        active_in_optimizer_steps(trainer, self)

    def result(self, trainer) -> dict:
        """The calls seen, with accelerate's precision, the stored parameters' dtypes and the engine's own setting
        (FSDP2's `MixedPrecisionPolicy`, DeepSpeed's bf16 section)."""
        for handle in self.handles:
            handle.remove()
        accelerator = trainer.accelerator
        model = accelerator.unwrap_model(trainer.model)
        ran = {
            "calls": sorted(self.calls),
            "mixed_precision": accelerator.mixed_precision,
            "native_amp": accelerator.native_amp,
            "stored": sorted({dtype_name(p.dtype) for p in model.parameters() if p.requires_grad}),
        }
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        policy = getattr(plugin, "mixed_precision_policy", None) if accelerator.is_fsdp2 else None
        if policy is not None:
            ran["fsdp_param_dtype"] = dtype_name(policy.param_dtype)
            ran["fsdp_reduce_dtype"] = dtype_name(policy.reduce_dtype)
        if trainer.is_deepspeed_enabled:
            ran["deepspeed_bf16"] = bool(trainer.model_wrapped.bfloat16_enabled())
        return ran


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


# What each engine runs under TRL's default `bf16=True` (accelerate's mapping): (weight dtype in the matmuls, stored
# trainable dtype). DDP: autocast over float32 weights. FSDP2: autocast, and FSDP2's MixedPrecisionPolicy gathers the
# float32 shards into bfloat16 parameters. DeepSpeed: no autocast, the module cast to bfloat16 (float32 master weights
# in the ZeRO optimizer).
BF16_RUNS = {
    "": ("float32", "float32", True),
    "fsdp2": ("bfloat16", "float32", True),
    "deepspeed": ("bfloat16", "bfloat16", False),
}


def assert_precision(ran: dict, precision: str, expect: str) -> None:
    """The optimizer steps ran in `precision` as accelerate maps it for the engine, so that a silent float32 run (or a
    bf16 one where float32 was asked for) cannot pass."""
    assert ran["calls"], "no nn.Linear ran in the optimizer steps"
    if precision == "fp64":
        assert ran["calls"] == [("float64", "float64", False)], ran
        assert ran["mixed_precision"] == "no" and ran["stored"] == ["float64"], ran
        return
    if precision == "fp32":
        assert ran["calls"] == [("float32", "float32", False)], ran
        assert ran["mixed_precision"] == "no" and ran["stored"] == ["float32"], ran
        return
    weight, stored, autocast = BF16_RUNS[expect]
    assert ran["mixed_precision"] == "bf16" and ran["native_amp"] == autocast, ran
    assert ran["calls"] == [(weight, "bfloat16", autocast)], ran
    assert ran["stored"] == [stored], ran
    if expect == "fsdp2":
        assert ran["fsdp_param_dtype"] == ran["fsdp_reduce_dtype"] == "bfloat16", ran
    if expect == "deepspeed":
        assert ran["deepspeed_bf16"], ran


def assert_deepspeed(trainer) -> None:
    """The trainer really ran under DeepSpeed: accelerate's state says so and the model is a DeepSpeed engine."""
    from accelerate.utils import DistributedType

    assert trainer.accelerator.distributed_type == DistributedType.DEEPSPEED, trainer.accelerator.distributed_type
    assert trainer.is_deepspeed_enabled and type(trainer.model_wrapped).__name__ == "DeepSpeedEngine", \
        type(trainer.model_wrapped).__name__
