"""The strategies without sharding: one process ([`Local`], also the base of every strategy: its no-op operations)
and DDP ([`DataParallel`]: replicas, one explicit all-reduce per optimizer window)."""

from __future__ import annotations

import contextlib

from ..distributed import all_reduce_gradients, trainable_parameters


class Local:
    """One process: nothing to gather or reduce."""

    name = "local"
    description = "one process"
    lockstep = False  # whether the ranks' engine calls must make the same model calls (the per-layer schedules)
    agreed = False  # whether the ranks must take the same path, DTA or dense (the model's calls are collectives)
    layer_schedule = ""  # the per-layer schedule, as a refusal names it
    window_settings: dict = {}  # the trainer settings that leave it (a refusal's fix)

    @staticmethod
    def all_ranks(flag: bool) -> bool:
        """Whether `flag` holds on every rank that must take the same path (lockstep strategies ask the others)."""
        return flag

    def begin_window(self, model) -> None:
        pass

    def end_window(self, model) -> None:
        pass

    @contextlib.contextmanager
    def micro_step(self, model):
        yield

    @contextlib.contextmanager
    def engine_call(self, model, train: bool):
        """A context around each engine call on `model`; yields the engine call's `lockstep` argument (None: each
        rank walks its own forest)."""
        yield None

    @contextlib.contextmanager
    def scoring(self, model):
        yield

    @contextlib.contextmanager
    def gathered(self, model):
        """A context in which `model`'s parameters are whole (ZeRO-3 partitions them; construction-time checks run the
        model in it)."""
        yield

    @staticmethod
    def backward_scale(accelerator) -> float:
        return 1.0 / accelerator.gradient_accumulation_steps


class DataParallel(Local):
    """DDP: every rank holds a replica. The engine back-propagates on the unwrapped model, which DDP's reducer never
    sees (it arms its hooks in its own `forward`), so every micro-step runs under `no_sync` and the gradients are
    averaged once per window, explicitly (`distributed.all_reduce_gradients`: bucketed, flattened all-reduces)."""

    name = "ddp"
    description = "DDP, one all-reduce per optimizer step"

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def micro_step(self, model):
        return self.accelerator.no_sync(model)

    def end_window(self, model) -> None:
        all_reduce_gradients(trainable_parameters(self.accelerator.unwrap_model(model)),
                             self.accelerator.num_processes)
