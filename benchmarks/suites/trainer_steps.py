"""TRL's `GRPOTrainer` and `DTAGRPOTrainer` on a fixed rollout batch: whole optimizer steps, generation excluded.

Both trainers get the same batch from `_generate_and_score_completions` (overridden in a subclass so that generation
and rewards take no time and every step sees the same tokens; everything after it is the trainers' own code). One
optimizer step covers the whole generation batch ([`bench_config`]); [`step_timer`] times each step and the peak
memory after the first; [`measure`] is one trainer on one workload (the trainer benchmark's and the GPU check's).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import TYPE_CHECKING

import torch

from trl_dta.flops import dense_flops, tree_flops

from ..harness.cli import set_threads
from ..harness.memory import PeakMemory
from ..harness.models import build_model, model_shape, parse_dtype

if TYPE_CHECKING:
    from trl_dta.trainers import DTAGRPOConfig

    from ..workloads import Workload


def rollout_batch(workload: Workload, prompt_len: int, seed: int = 0) -> dict:
    """The workload as the dict `_generate_and_score_completions` returns (prompts left-, completions right-padded).

    Rows are in generation order (a group's completions adjacent), advantages are seeded random numbers.
    """
    seqs = workload.seqs
    completions = [s[prompt_len:] for s in seqs]
    width = max(len(c) for c in completions)
    n = len(seqs)
    prompt_ids = torch.stack([s[:prompt_len] for s in seqs])
    completion_ids = torch.zeros(n, width, dtype=torch.long)
    completion_mask = torch.zeros(n, width, dtype=torch.long)
    for i, c in enumerate(completions):
        completion_ids[i, : len(c)] = c
        completion_mask[i, : len(c)] = 1
    gen = torch.Generator().manual_seed(seed)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(n, generator=gen),
        "num_items_in_batch": completion_mask.sum(),
    }


def _trainer_class(method: str):
    from trl import GRPOTrainer

    from trl_dta.trainers.grpo import DTAGRPOTrainer

    base = DTAGRPOTrainer if method.startswith("dta") else GRPOTrainer

    class FixedRollouts(base):
        """`_generate_and_score_completions` returns the benchmark's fixed batch (on the trainer's device)."""

        bench_batch: dict = {}

        def _generate_and_score_completions(self, inputs):
            return {k: v.to(self.accelerator.device) for k, v in self.bench_batch.items()}

    return FixedRollouts


def bench_config(out: str, *, micro_batch_size: int, micro_batches: int, group: int, steps: int, dtype: str,
                 device: str, seed: int, **overrides) -> DTAGRPOConfig:
    """The config every trainer benchmark uses: one generation per optimizer step (`steps_per_generation` =
    gradient accumulation = `micro_batches`), one warm-up step plus `steps` timed ones, every batch through DTA when it
    is enabled (`dta_min_compression=0`), no logging, saving or dropout; `overrides` are the run's own settings."""
    from trl_dta.trainers.grpo import DTAGRPOConfig

    return DTAGRPOConfig(
        output_dir=out, per_device_train_batch_size=micro_batch_size, gradient_accumulation_steps=micro_batches,
        steps_per_generation=micro_batches, num_generations=group, max_steps=1 + steps, learning_rate=1e-6,
        bf16=dtype == "bf16", use_cpu=device == "cpu", report_to="none", logging_steps=10_000, save_strategy="no",
        disable_dropout=True, dta_min_compression=0.0, dataloader_num_workers=0, seed=seed, **overrides,
    )


def step_timer(device: str):
    """A `TrainerCallback` timing each optimizer step (`.times`, seconds) and the peak memory of the steps after the
    first (`.memory`, a `PeakMemory` reset at the end of the warm-up step, optimizer state allocated)."""
    from transformers import TrainerCallback

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.memory = PeakMemory(device)

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            self.times.append(time.perf_counter() - self.t0)
            if len(self.times) == 1:
                self.memory.reset()

    return StepTimer()


def measure(workload: Workload, prompt_len: int, group: int, method: str, shape: str, device: str,
            dtype: str, micro_batch_size: int, steps: int, threads: int | None, seed: int = 0) -> dict:
    """Train `1 + steps` optimizer steps and time the last `steps` (call through `harness.isolation.run_isolated`)."""
    from datasets import Dataset

    from trl_dta.demos.tiny import build_tokenizer

    set_threads(threads)
    # bf16 runs keep float32 parameters and let the trainers autocast (`bf16=True`), as TRL does by default
    model = build_model(shape, parse_dtype(dtype) if dtype != "bf16" else torch.float32, device,
                               seed=seed)
    n = len(workload.seqs)
    if n % micro_batch_size:
        raise ValueError(f"{n} rollouts are not a multiple of micro_batch_size {micro_batch_size}")
    k = n // micro_batch_size
    cls = _trainer_class(method)
    cls.bench_batch = rollout_batch(workload, prompt_len, seed)
    timer = step_timer(device)
    with tempfile.TemporaryDirectory() as out:
        config = bench_config(out, micro_batch_size=micro_batch_size, micro_batches=k, group=group, steps=steps,
                              dtype=dtype, device=device, seed=seed,
                              gradient_checkpointing=method.endswith("+ckpt"))
        prompts = Dataset.from_dict({"prompt": ["x"] * (n // group) * (2 + steps)})
        trainer = cls(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
                      train_dataset=prompts, processing_class=build_tokenizer(), callbacks=[timer])
        trainer.train()
        peak = timer.memory.peak_mb()
    timed = sorted(timer.times[1:])
    tree = workload.tree()
    # a micro-batch is a tree of its own: the ideal ratio is over micro-batches of whole groups (DTA's split)
    seqs = workload.seqs
    parts = [seqs[i : i + micro_batch_size] for i in range(0, n, micro_batch_size)]
    dims = model_shape(shape)
    ideal = dense_flops(tree.lengths, dims).total / sum(tree_flops(p, dims).total for p in parts)
    return {
        "workload": workload.name,
        "method": method,
        "n_sequences": n,
        "n_tokens": tree.n_tokens,
        "n_tree_tokens": tree.n_tree_tokens,
        "compression_ratio": tree.compression_ratio,
        "ideal_ratio": ideal,
        "micro_batch_size": micro_batch_size,
        "step_s": timed[0],
        "median_step_s": timed[len(timed) // 2],
        "tokens_per_s": tree.n_tokens / timed[0],
        "peak_mem_mb": max(peak, 0.0),
        "model_shape": dims.name,
        "device": device,
        "dtype": dtype,
        "loadavg": os.getloadavg()[0],
    }
