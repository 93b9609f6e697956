"""DeepSpeed ZeRO stage 0, 1 and 2 under the DTA engine (the one module that imports `deepspeed`, lazily).

Under ZeRO-1/2 every rank holds the whole model (parameters replicated; optimizer states, and with ZeRO-2 gradients,
partitioned), so the engine runs on the module as it is. What differs is the gradient reduction: DeepSpeed reduces
from hooks on every parameter, once per `engine.backward`, and asserts that the loss it is given has a `grad_fn`.
The engine back-propagates many times per window, directly, and every rank walks its own forest, so reductions
issued from those backward calls would be repeated per parameter (DeepSpeed refuses a second reduction of a
parameter in one backward) and would not line up across ranks.

[`Zero`] therefore gives DeepSpeed **one backward per optimizer window**, at its last micro-step, carrying the whole
window's gradient:

- At the window's first micro-step DeepSpeed's gradient hooks are detached and accelerate's
  `DeepSpeedEngineWrapper.backward` is replaced for the window: every backward of the window (the engine's, and the
  HF Trainer's backward of each micro-step's loss: DTA's value-only loss, or a dense-path micro-step's real one)
  accumulates plainly into the parameters' `.grad`, no DeepSpeed involved. (A replaced method rather than an
  explicit call: the HF Trainer's `training_step` calls `accelerator.backward` itself at every micro-step, dense-path
  ones included; an explicit call would mean copying that `training_step` into the mixin.)
- At the last micro-step, the accumulated gradients are taken off the parameters (zeros for a trainable parameter
  without one, so every rank reduces the same buckets), the hooks re-attached, and `engine.backward` runs on a scalar
  whose backward hands each parameter its accumulated gradient (`_WindowGradient`): DeepSpeed's own path (its bucketed
  ZeRO-1 all-reduce or ZeRO-2 reduce-scatter, its fp32 partitions) sees exactly one gradient per parameter; then
  `engine.step()`.

ZeRO-3 (parameters partitioned and gathered by module hooks that the engine's direct calls bypass) and ZeRO offload
are refused at construction. The DeepSpeed internals used (the ZeRO optimizer's `_grad_acc_hooks` and
`create_gradient_handling_hooks`) are those of DeepSpeed 0.19's `stage_1_and_2.py`.
"""

from __future__ import annotations

import torch

from ..refusal import DISTRIBUTED, TRAINER_ALTERNATIVE, Blocker, refuse
from .ddp import Local

_EXTRA = 'pip install wheel "setuptools>=68" && pip install --no-build-isolation "trl-dta[deepspeed]"'


def _deepspeed():
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(f"DeepSpeed is not installed; `{_EXTRA}` (then run with accelerate's DeepSpeed plugin).") \
            from exc
    return deepspeed


def _offloaded(config: dict) -> list[str]:
    zero = config.get("zero_optimization", {}) or {}
    return [key for key in ("offload_optimizer", "offload_param")
            if str((zero.get(key) or {}).get("device", "none")).lower() not in ("none", "")]


class Zero(Local):
    """One gradient reduction per optimizer window through DeepSpeed's coalesced reduction (module docstring)."""

    name = "deepspeed"

    def __init__(self, accelerator, stage: int):
        self.accelerator = accelerator
        self.stage = stage
        self._window = None  # (accelerate's engine wrapper, whether DeepSpeed had gradient hooks) while one is open

    @classmethod
    def from_accelerator(cls, accelerator) -> Zero:
        """The strategy for accelerate's DeepSpeed plugin; refuses ZeRO-3 and offload at construction."""
        plugin = accelerator.state.deepspeed_plugin
        stage = int(plugin.zero_stage)
        blockers = []
        if stage == 3:
            blockers.append(Blocker(
                "DeepSpeed ZeRO-3 is not supported with DTA: it partitions the parameters and gathers them in module "
                "hooks, which the engine's direct calls into the decoder and the LM head bypass",
                fix="use ZeRO-2 (`zero_stage: 2`) or FSDP2 (`fsdp_version: 2`)"))
        offloaded = _offloaded(plugin.deepspeed_config)
        if offloaded:
            blockers.append(Blocker(
                f"DeepSpeed ZeRO offload ({', '.join(offloaded)}) is not supported with DTA (untested with the "
                "window's coalesced reduction)", fix="set the offload devices to 'none'"))
        refuse(DISTRIBUTED, blockers, alternative=TRAINER_ALTERNATIVE)
        _deepspeed()
        return cls(accelerator, stage)

    @staticmethod
    def backward_scale(accelerator) -> float:
        return 1.0  # accelerate leaves the loss to DeepSpeed, and the HF Trainer calls it with `scale_wrt_gas=False`

    def begin_window(self, model) -> None:
        wrapper = self.accelerator.deepspeed_engine_wrapped
        if wrapper is None or self._window is not None:
            return
        engine = wrapper.engine
        optimizer = engine.optimizer
        hooks = getattr(optimizer, "_grad_acc_hooks", [])  # none under ZeRO-0 (DeepSpeed all-reduces in its epilogue)
        if hooks and not hasattr(optimizer, "create_gradient_handling_hooks"):
            refuse(DISTRIBUTED, [Blocker(
                f"DTA under DeepSpeed drives the ZeRO optimizer's gradient hooks ({type(optimizer).__name__} has none "
                "of DeepSpeed 0.19's `_grad_acc_hooks`)", fix=f"install DeepSpeed 0.19 (`{_EXTRA}`)")],
                alternative=TRAINER_ALTERNATIVE)
        had_hooks = bool(hooks)
        for hook in hooks:
            hook.remove()
        hooks.clear()
        self._window = (wrapper, had_hooks)
        strategy = self

        def backward(loss, sync_gradients=True, **kwargs):
            """accelerate's `DeepSpeedEngineWrapper.backward` for the window: local accumulation, then DeepSpeed's one
            backward and step at the window's end."""
            loss.backward()
            if sync_gradients:
                strategy._reduce(engine, loss, **kwargs)
                engine.step()

        wrapper.backward = backward

    def _reduce(self, engine, loss, **kwargs) -> None:
        """DeepSpeed's backward of the window's accumulated gradients (its hooks back on)."""
        wrapper, had_hooks = self._window
        self._window = None
        del wrapper.backward  # back to the class's method
        params = [p for p in engine.module.parameters() if p.requires_grad]
        grads = []
        for p in params:
            grads.append(torch.zeros_like(p) if p.grad is None else p.grad)
            p.grad = None
        if had_hooks:
            engine.optimizer.create_gradient_handling_hooks()
        engine.set_gradient_accumulation_boundary(is_boundary=True)
        engine.backward(_WindowGradient.apply(loss.detach(), grads, *params), **kwargs)

    def end_window(self, model) -> None:
        if self._window is not None:
            raise RuntimeError("DeepSpeed's backward did not run at the last micro-step of the optimizer window.")


class _WindowGradient(torch.autograd.Function):
    """`value` (a scalar), whose backward gives each of `params` its gradient in `grads` (times the incoming one)."""

    @staticmethod
    def forward(ctx, value, grads, *params):
        ctx.grads = grads
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        grads, ctx.grads = ctx.grads, None
        if bool(grad == 1):  # DeepSpeed's backward of an unscaled loss: hand the accumulated tensors over as they are
            return (None, None, *grads)
        return (None, None, *[g * grad.to(g.dtype) for g in grads])
