"""One optimizer window through the engine, without TRL: `run_window(engine, context, strategy) -> WindowResult`.

The mixin (`_mixin.py`) reads TRL's state once into a frozen [`WindowContext`] (the window's micro-steps and
micro-batches, the backward's scale, the temperature, the per-sequence objective, TRL's objective of a micro-batch for
the two-pass path, the router loss's coefficient) and writes the [`WindowResult`] back (the micro-steps stored in its
`state.HookState`, the metrics). Everything in between is here and depends on nothing of TRL:

1. the window's forest (`step_forest.StepForest`) of the micro-batches DTA handles (images keyed by image,
   `vision/`; unusual padding and vision inputs other than a supported family's images are left to TRL's dense path;
   under a strategy whose ranks must agree on the path (`agreed`: FSDP2's per-layer schedule, ZeRO-3) all or none of
   them, so that the ranks' model calls pair);
2. [`decide`]: DTA or TRL's dense path for the whole forest (`dta_min_compression`), agreed by every rank that must
   take the same path (the strategy's `all_ranks`);
3. one `DTAEngine.forward_backward` over the forest with each sequence's term of its own micro-batch's objective, or
   the exact two-pass path (a no-grad pass, TRL's objective on each micro-batch's log-probs as autograd inputs for
   `dL/dlogps`, then the backward of the linear surrogate) when the objective is not a sum over sequences;
4. the outputs split back into each micro-step's `(B, T)` log-probs / entropies / load-balancing loss, and the
   forest's metrics (`WindowResult.metrics`, logged by the trainer next to TRL's):

- `dta/compression_ratio`, `dta/tokens`, `dta/tree_tokens`: the forest (normally all of an optimizer step's
  micro-batches; tokens / tree tokens).
- `dta/micro_batches_per_forest`: micro-batches in the forest.
- `dta/forward_tokens`: tokens the engine actually forwarded (block recompute and the two-pass path's no-grad first
  pass included); `dta/padded_tokens`: the same with the rows' padding (what the model computed); `dta/forwards`:
  the engine's model calls (each one forward and, in training, its backward).
- `dta/peak_memory_mb`: peak allocated memory of the forest on CUDA; elsewhere the process's peak resident set.
- `dta/idle_batches` (lockstep strategies: the per-layer schedules of FSDP2 and ZeRO-3): row batches this rank ran
  without work so that its layers' collectives pair with the other ranks'.
- `dta/images`, `dta/image_rows` (vision-language models, a forest with images): the distinct images the vision tower
  ran on, and the images the forest's rows show (what TRL's dense path runs the tower on). The compression counts
  image tokens like text tokens.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from ..batch import Layout
from ..engine import DTAEngine
from ..engine.router_loss import LoadBalancing
from ..tree import PrefixTree
from ..vision import batch_images
from .step_forest import StepForest

SequenceLoss = Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor]  # (row j, logps_j, entropies_j)


@dataclass
class MicroStep:
    """What the window's forest computed for one of its micro-steps (None values: TRL's dense path runs it).

    Args:
        batch (`dict`): the micro-batch.
        logps (`torch.Tensor` of shape `(B, T)`, *optional*): the policy's log-probs, detached.
        entropies (`torch.Tensor` of shape `(B, T)`, *optional*): their entropies.
        compression (`float`): the micro-batch's own tree compression.
        aux_loss (`torch.Tensor`, *optional*): MoE models: the micro-batch's load-balancing loss (0-d, detached), the
            value TRL's dense forward returns as `aux_loss`.
    """

    batch: dict
    logps: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    compression: float = 1.0
    aux_loss: torch.Tensor | None = None


@dataclass(frozen=True)
class WindowContext:
    """What one window's engine run needs, read from the trainer once.

    Args:
        model (`torch.nn.Module`): the (wrapped) policy, for the strategy's scopes.
        steps (`tuple[int, ...]`): the micro-steps (TRL's `_step`) the forest may cover, in order.
        batches (`tuple[dict, ...]`): their micro-batches.
        scale (`float`): the factor of the backward (`1 / gradient_accumulation_steps` where the HF `Trainer` applies
            it, times the strategy's).
        temperature (`float`): the sampling temperature (logits divided by it).
        min_compression (`float`): below this forest compression, TRL's dense path runs (`dta_min_compression`).
        sequence_loss (`Callable[[dict], SequenceLoss | None]`): a micro-batch's per-sequence objective, times `scale`
            and its row weight; None when the objective is not a sum over sequences (the two-pass path).
        batch_loss (`Callable[[dict, Tensor, Tensor], Tensor]`): TRL's loss of a micro-batch (row weight included) from
            its `(B, T)` log-probs and entropies as autograd inputs, unlogged (the two-pass path's `dL/dlogps`).
        router_coef (`float`, *optional*): MoE models with TRL's router loss: each micro-batch's load-balancing loss
            enters the backward with this factor (already times `scale`); None without it.
        autocast (`Callable[[], AbstractContextManager]`): the autocast of the model computation (accelerate's).
        device (`torch.device`): the accelerator's device (peak memory statistics).
        image_keys (`dict`, *optional*): a vision-language model whose images DTA runs: `vision.key_images`'s keyword
            arguments (`VisionSpec.keys`); None: micro-batches with images run TRL's dense path.
    """

    model: torch.nn.Module
    steps: tuple[int, ...]
    batches: tuple[dict, ...]
    scale: float
    temperature: float
    min_compression: float
    sequence_loss: Callable[[dict], SequenceLoss | None]
    batch_loss: Callable[[dict, torch.Tensor, torch.Tensor], torch.Tensor]
    router_coef: float | None
    autocast: Callable[[], AbstractContextManager]
    device: torch.device
    image_keys: dict | None = None


@dataclass
class WindowResult:
    """What [`run_window`] computed.

    Args:
        micro_steps (`dict[int, MicroStep]`): one per micro-step of the context (without log-probs: TRL's dense path).
        forest (`StepForest`, *optional*): the forest the engine ran; None when the dense path runs the window.
        seconds (`float`): the engine's time.
        metrics (`dict[str, float]`): the forest's `dta/...` metrics (empty on the dense path).
    """

    micro_steps: dict[int, MicroStep]
    forest: StepForest | None = None
    seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


def as_trl_head_output(values: torch.Tensor | None) -> torch.Tensor | None:
    """Per-token log-probs or entropies `(B, T)` in the dtype TRL's fused LM head gives `_compute_loss`: float32
    whatever the model's dtype (`trl.kernels.ChunkedLogProbFunction` keeps its statistics in float32). The engine's
    are float64 in a float64 model; TRL's loss then compares them with thresholds it rounds to float32 (the entropy
    quantile), so they are rounded as TRL's would be. Differentiable: gradients flow back through the cast."""
    return values if values is None or values.dtype == torch.float32 else values.float()


def decide(tree: PrefixTree | None, min_compression: float, strategy) -> bool:
    """Whether DTA runs a tree (else TRL's dense path): it exists and compresses at least `min_compression`, on every
    rank that must take the same path (`strategy.all_ranks`: `agreed` strategies agree, the others decide alone)."""
    return strategy.all_ranks(tree is not None and tree.compression_ratio >= min_compression)


def window_forest(context: WindowContext, agreed: bool) -> StepForest | None:
    """The forest of the context's micro-batches DTA handles (`vision.batch_images` reads their images); None when there
    is none (or, under a strategy whose ranks must agree on the path, `agreed`, when one micro-batch needs the dense
    path: then all do, so that the ranks' model calls pair)."""
    kept, layouts, images = [], [], []
    for k, batch in enumerate(context.batches):
        layout = Layout.from_batch(batch)
        rows = batch_images(layout.seqs, layout.lengths, batch, context.image_keys) if layout is not None else None
        if rows is None:
            continue
        kept.append(k)
        layouts.append(layout)
        images.append(rows)
    if not kept or (agreed and len(kept) < len(context.batches)):
        return None
    with_images = any(row is not None for rows in images for row in rows)
    return StepForest([context.steps[k] for k in kept], [context.batches[k] for k in kept], layouts,
                      images if with_images else None, context.image_keys if with_images else None)


def router_request(forest: StepForest, coef: float | None) -> LoadBalancing | None:
    """The forest's load-balancing loss for the engine: one group per micro-batch (TRL computes it per micro-batch
    forward), each with `coef`; None without one."""
    if coef is None:
        return None
    groups = [list(range(lo, hi)) for lo, hi in zip(forest.offsets, forest.offsets[1:])]
    return LoadBalancing(groups, [coef] * len(groups))


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated memory since the last reset on a CUDA device; the process's peak resident set elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_window(engine: DTAEngine, context: WindowContext, strategy) -> WindowResult:
    """Forward and backward of a window's micro-batches as one forest (module docstring).

    Args:
        engine ([`~trl_dta.DTAEngine`]): the policy's engine.
        context ([`WindowContext`]): the window.
        strategy (`trl_dta.parallel` strategy): `lockstep`, `all_ranks`, `engine_call`.

    Returns:
        [`WindowResult`]: every micro-step's outputs (or none: TRL's dense path), the forest and its metrics.
    """
    micro_steps = {step: MicroStep(batch) for step, batch in zip(context.steps, context.batches)}
    forest = window_forest(context, strategy.agreed)
    if not decide(forest.tree if forest is not None else None, context.min_compression, strategy):
        return WindowResult(micro_steps)
    if context.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(context.device)
    start = time.perf_counter()
    out_device = context.batches[0]["completion_ids"].device
    terms = [context.sequence_loss(batch) for batch in forest.batches]
    router_loss = router_request(forest, context.router_coef)
    run = dict(temperature=context.temperature, n_scored=forest.n_scored, images=forest.table)
    # Autocast covers the model computation only, as in TRL's `_get_per_token_logps_and_entropies`.
    if all(term is not None for term in terms):
        with context.autocast(), strategy.engine_call(context.model, True) as lockstep:
            out = engine.forward_backward(forest.tree, forest.objective(terms), entropy=True, router_loss=router_loss,
                                          lockstep=lockstep, **run)
        passes, aux = [out.stats], out.router_aux
    else:
        with context.autocast(), strategy.engine_call(context.model, False) as lockstep:
            out = engine.logprobs(forest.tree, entropy=True, lockstep=lockstep, **run)
        surrogate, entropy = _surrogate(context, forest, out, out_device)
        with context.autocast(), strategy.engine_call(context.model, True) as lockstep:
            second = engine.forward_backward(forest.tree, surrogate, entropy=entropy, router_loss=router_loss,
                                             lockstep=lockstep, **run)
        passes, aux = [out.stats, second.stats], second.router_aux
    logps, entropies = forest.split(out.logps, out_device), forest.split(out.entropies, out_device)
    seconds = time.perf_counter() - start  # the engine's work; the per-micro-batch trees below are metrics only
    for k, step in enumerate(forest.steps):
        compression = PrefixTree.from_sequences(forest.sequences(k)).compression_ratio
        aux_k = None if aux is None else aux[k].to(out_device, torch.float32)
        micro_steps[step] = MicroStep(forest.batches[k], logps[k], entropies[k], compression, aux_k)
    tree = forest.tree
    metrics = {"dta/compression_ratio": tree.compression_ratio, "dta/tokens": float(tree.n_tokens),
               "dta/tree_tokens": float(tree.n_tree_tokens)}
    for key in ("forward_tokens", "padded_tokens", "forwards"):  # both passes of the two-pass path
        metrics[f"dta/{key}"] = float(sum(stats[key] for stats in passes))
    if strategy.lockstep:
        metrics["dta/idle_batches"] = float(sum(stats["idle_batches"] for stats in passes))
    if (table := forest.table) is not None:
        metrics["dta/images"], metrics["dta/image_rows"] = float(passes[-1].get("images", 0)), float(table.image_rows)
    metrics["dta/micro_batches_per_forest"] = float(len(forest.steps))
    metrics["dta/peak_memory_mb"] = peak_memory_mb(context.device)
    return WindowResult(micro_steps, forest, seconds, metrics)


def _surrogate(context: WindowContext, forest: StepForest, first, device):
    """The two-pass path's per-sequence surrogate: TRL's loss on each micro-batch's first-pass log-probs (autograd
    inputs) gives `dL/dlogps` and `dL/dentropies`; returns the surrogate and whether it needs entropies."""
    grads = []
    for batch, logps, entropies in zip(forest.batches, forest.split(first.logps, device),
                                       forest.split(first.entropies, device)):
        logps, entropies = logps.requires_grad_(), entropies.requires_grad_()
        loss = context.batch_loss(batch, logps, entropies)
        grad_logps, grad_entropies = torch.autograd.grad(loss * context.scale, (logps, entropies), allow_unused=True)
        grads.append((torch.zeros_like(logps) if grad_logps is None else grad_logps, grad_entropies))
    entropy = any(g is not None for _, g in grads)

    def surrogate(i, seq_logps, seq_entropies):
        """`<logps_i, dL/dlogps_i> + <entropies_i, dL/dentropies_i>`: TRL's gradient, one sequence."""
        k, j = forest.locate(i)
        grad_logps, grad_entropies = grads[k]
        n = seq_logps.size(0)
        term = (seq_logps * grad_logps[j, :n].to(seq_logps.device, seq_logps.dtype)).sum()
        if grad_entropies is not None:
            grad = grad_entropies[j, :n].to(seq_entropies.device, seq_entropies.dtype)
            term = term + (seq_entropies * grad).sum()
        return term

    return surrogate, entropy
