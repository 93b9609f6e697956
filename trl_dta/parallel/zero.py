"""DeepSpeed ZeRO under the DTA engine: one gradient reduction per optimizer window (the one module that imports
`deepspeed`, lazily; written against DeepSpeed 0.19.8). ZeRO-3's gathering is `zero3.py`'s, on top of this.

DeepSpeed reduces gradients from hooks on every parameter, once per `engine.backward`. The engine back-propagates many
times per window, directly, and every rank walks its own forest: reductions issued from those backward calls would be
repeated per parameter (DeepSpeed refuses a second reduction of a parameter in one backward) and would not line up
across ranks. [`Zero`] therefore keeps the whole window's gradient local and lets DeepSpeed reduce it once, at the
window's last micro-step, with DeepSpeed's own means:

- ZeRO-1/2/3: the window runs inside DeepSpeed's `engine.coalesce_grad_reduction()` (from `begin_window` to the last
  micro-step): its gradient hooks reduce nothing, every backward (the engine's, and each micro-step's
  `accelerator.backward`) accumulates into the parameters' `.grad`, and the block's exit runs DeepSpeed's single
  reduction pass over them (its bucketed ZeRO-1 all-reduce or ZeRO-2/3 reduce-scatter into its partitions).
- ZeRO-0: the window runs inside `engine.no_sync()`, left just before the last micro-step's backward, whose epilogue
  all-reduces the accumulated gradients (DeepSpeed's own `allreduce_gradients`).

accelerate's `DeepSpeedEngineWrapper.backward` is replaced for the window (the HF Trainer's `training_step` calls
`accelerator.backward` itself at every micro-step, dense-path ones included): every micro-step's loss goes through
DeepSpeed's `engine.backward` (DTA's value-only loss reaches no parameter; a dense-path micro-step's loss adds its
gradient, scaled as DeepSpeed scales it), and the last one is followed by the reduction and `engine.step()`. ZeRO
offload is refused at construction.
"""

from __future__ import annotations

import contextlib

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


def refuse_offload(config: dict) -> None:
    """Refuse ZeRO offload (any stage) at construction."""
    offloaded = _offloaded(config)
    if offloaded:
        refuse(DISTRIBUTED, [Blocker(
            f"DeepSpeed ZeRO offload ({', '.join(offloaded)}) is not supported with DTA: DTA keeps an optimizer "
            "window's gradients local and has DeepSpeed reduce them once (under ZeRO-3 it also gathers the "
            "partitions for its walk), untested with host- or NVMe-resident partitions and optimizer states",
            fix="set the offload devices to 'none'")], alternative=TRAINER_ALTERNATIVE)


def check_deepspeed_api() -> None:
    """Refuse, at construction, a DeepSpeed without the engine methods the window drives."""
    deepspeed = _deepspeed()
    missing = [name for name in ("coalesce_grad_reduction", "no_sync", "set_gradient_accumulation_boundary")
               if not hasattr(deepspeed.DeepSpeedEngine, name)]
    if missing:
        refuse(DISTRIBUTED, [Blocker(
            f"DTA under DeepSpeed drives engine methods missing here ({missing}; written against DeepSpeed 0.19.8, "
            f"installed {deepspeed.__version__})", fix=f"install DeepSpeed 0.19.8 (`{_EXTRA}`)")],
            alternative=TRAINER_ALTERNATIVE)


class Zero(Local):
    """One DeepSpeed reduction per optimizer window (module docstring).

    Args:
        accelerator (`accelerate.Accelerator`): the trainer's.
        stage (`int`): the ZeRO stage.
    """

    name = "deepspeed"

    def __init__(self, accelerator, stage: int):
        self.accelerator = accelerator
        self.stage = stage
        self.description = f"DeepSpeed ZeRO-{stage}, one reduction per optimizer step"
        self._window = None  # (accelerate's engine wrapper, DeepSpeed's local-accumulation block) while one is open

    @classmethod
    def from_accelerator(cls, accelerator) -> Zero:
        """The strategy for accelerate's DeepSpeed plugin at stage 0, 1 or 2; refuses offload at construction."""
        plugin = accelerator.state.deepspeed_plugin
        refuse_offload(plugin.deepspeed_config)
        check_deepspeed_api()
        return cls(accelerator, int(plugin.zero_stage))

    @staticmethod
    def backward_scale(accelerator) -> float:
        return 1.0  # accelerate leaves the loss to DeepSpeed, and the HF Trainer calls it with `scale_wrt_gas=False`

    def begin_window(self, model) -> None:
        wrapper = self.accelerator.deepspeed_engine_wrapped
        if wrapper is None or self._window is not None:
            return
        engine = wrapper.engine
        local = engine.coalesce_grad_reduction() if self.stage >= 1 else engine.no_sync()
        local.__enter__()
        self._window = (wrapper, local)
        strategy = self

        def backward(loss, sync_gradients=True, **kwargs):
            """accelerate's `DeepSpeedEngineWrapper.backward` for the window: DeepSpeed's backward, the gradients kept
            local; at the window's end its one reduction and step."""
            if sync_gradients:
                strategy._fill_missing_grads(engine)  # every rank reduces every trainable parameter
                if strategy.stage == 0:
                    strategy._close_window()  # this backward's epilogue all-reduces the window's gradients
            engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)  # as accelerate's backward does
            engine.backward(loss, **kwargs)
            if sync_gradients:
                if strategy._window is not None:
                    strategy._close_window()  # DeepSpeed's reduction pass of the local gradients
                strategy._reduced()
                engine.set_gradient_accumulation_boundary(is_boundary=True)
                engine.step()

        wrapper.backward = backward

    def _close_window(self) -> None:
        wrapper, local = self._window
        self._window = None
        del wrapper.backward  # back to the class's method
        local.__exit__(None, None, None)

    @staticmethod
    def _fill_missing_grads(engine) -> None:
        """Zeros for a trainable parameter without a gradient (under ZeRO-3 the gathering scopes do it, while the
        parameters are whole)."""
        for p in engine.module.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def _reduced(self) -> None:
        """After DeepSpeed's reduction of the window, before its step (`Zero3`: the layers' reduced gradients)."""

    def end_window(self, model) -> None:
        if self._window is not None:
            raise RuntimeError("DeepSpeed's reduction did not run at the last micro-step of the optimizer window.")

    @contextlib.contextmanager
    def micro_step(self, model):
        yield
