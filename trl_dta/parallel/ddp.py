"""The strategies without sharding: one process ([`Local`], also the base of every strategy: its no-op operations)
and DDP ([`DataParallel`]: replicas, one explicit all-reduce per optimizer window)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist

_BUCKET_BYTES = 32 * 1024 * 1024


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
    averaged once per window, explicitly ([`all_reduce_gradients`]: bucketed, flattened all-reduces)."""

    name = "ddp"
    description = "DDP, one all-reduce per optimizer step"

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def micro_step(self, model):
        return self.accelerator.no_sync(model)

    def end_window(self, model) -> None:
        all_reduce_gradients(trainable_parameters(self.accelerator.unwrap_model(model)),
                             self.accelerator.num_processes)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """Parameters that receive gradients, in a fixed order (the same on every rank)."""
    return [p for p in model.parameters() if p.requires_grad]


@torch.no_grad()
def all_reduce_gradients(params: Iterable[torch.nn.Parameter], world_size: int, group=None) -> None:
    """Average `.grad` over all ranks, in place, as DDP would (sum / world size).

    Every rank must pass the same parameters in the same order; a missing gradient counts as zeros (and is then
    allocated), so that a rank whose micro-batches did not touch a parameter still takes part in its reduction.
    """
    params = list(params)
    if world_size == 1 or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list[torch.Tensor] = []
    size = 0
    for p in params + [None]:
        if p is not None and (not bucket or (size + p.grad.nbytes <= _BUCKET_BYTES and p.grad.dtype == bucket[0].dtype
                                             and p.grad.device == bucket[0].device)):
            bucket.append(p.grad)
            size += p.grad.nbytes
            continue
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(world_size)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        if p is not None:
            bucket, size = [p.grad], p.grad.nbytes
