"""Real FSDP2 and DeepSpeed on a CPU machine, for the launched test scripts (`dist_run.py`, `refuse_run.py`, the
benchmarks): accelerate's upgrade to them on CPU processes (`trl_dta.parallel.cpu.enable_cpu_engines`, re-exported
here), assertions that they really ran ([`assert_fsdp2`], `run_probes.assert_deepspeed`, [`Zero3Probe`]), so that a
silent fall-back to DDP can never pass, and counters of their collectives.
"""

from __future__ import annotations

from trl_dta.parallel.cpu import enable_cpu_engines  # noqa: F401 (the scripts import it from here)


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


class Zero3Probe:
    """What ZeRO-3 really did in a DTA run: DeepSpeed's stage and partitioning (every trainable parameter partitioned
    over the ranks, none kept gathered between uses, all released after training) and, inside every engine call of
    the optimizer steps, how many decoder layers had gathered parameters at once (sampled at each `nn.Linear` of the
    layers) and how many all-gathers and reduce-scatters ran (`torch.distributed`'s collectives, which DeepSpeed's
    `all_gather_into_tensor` / `reduce_scatter_tensor` reach)."""

    def __init__(self, trainer):
        import torch
        import torch.distributed.distributed_c10d as c10d

        self.trainer = trainer
        self.calls: list[dict] = []  # per engine call: train, layers gathered at most, collectives
        self.current = None
        lm = trainer.accelerator.unwrap_model(trainer.model)
        lm = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
        self.layers = [m for c in lm.get_decoder().children() if isinstance(c, torch.nn.ModuleList) for m in c]
        probe = self

        def sample(module, args, output):  # registered before DeepSpeed's hooks: runs before its release
            if probe.current is not None:
                probe.current["layers_gathered"] = max(probe.current["layers_gathered"], probe.gathered_layers())

        self.handles = [m.register_forward_hook(sample) for layer in self.layers for m in layer.modules()
                        if isinstance(m, torch.nn.Linear)]
        for key, name in (("all_gather", "all_gather_single"), ("reduce_scatter", "reduce_scatter_single")):
            original = getattr(c10d, name)

            def counted(*args, _original=original, _key=key, **kwargs):
                if probe.current is not None:
                    probe.current[_key] += 1
                return _original(*args, **kwargs)

            setattr(c10d, name, counted)
        strategy = trainer._dta_parallel
        engine_call = strategy.engine_call

        def watched(model, train):
            import contextlib

            @contextlib.contextmanager
            def scope():
                outer, probe.current = probe.current, {"train": train, "layers_gathered": 0, "all_gather": 0,
                                                       "reduce_scatter": 0}
                try:
                    with engine_call(model, train) as lockstep:
                        yield lockstep
                finally:
                    if outer is None:  # a call inside another (a DTA scoring call in its `scoring` scope) is its own
                        probe.calls.append(probe.current)
                    probe.current = outer

            return scope()

        strategy.engine_call = watched

    def gathered_layers(self) -> int:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        return sum(any(p.ds_status == ZeroParamStatus.AVAILABLE for p in layer.parameters()) for layer in self.layers)

    def result(self) -> dict:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        for handle in self.handles:
            handle.remove()
        engine = self.trainer.model_wrapped
        params = list(self.trainer.accelerator.unwrap_model(self.trainer.model).parameters())
        return {
            "stage": int(engine.zero_optimization_stage()),
            "schedule": self.trainer._dta_parallel.schedule,
            "params": len(params),
            "partitioned": sum(hasattr(p, "ds_id") and p.ds_tensor.numel() < p.ds_numel for p in params),
            "persistent": sum(bool(getattr(p, "ds_persist", False)) for p in params),
            "gathered_after": sum(getattr(p, "ds_status", None) != ZeroParamStatus.NOT_AVAILABLE for p in params),
            "layers": len(self.layers),
            "calls": self.calls,
        }
