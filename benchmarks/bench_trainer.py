"""Trainer-level benchmark: TRL's `GRPOTrainer` vs `DTAGRPOTrainer`, a whole optimizer step, generation excluded.

Both trainers get the same fixed rollout batch from `_generate_and_score_completions` (overridden in a subclass so that
generation and rewards take no time and every step sees the same tokens; everything after it is the trainers' own
code: TRL's row shuffle or DTA's group-aware split, micro-batching, `_compute_loss` or the engine, backward,
gradient accumulation, AdamW, metrics). One optimizer step covers the whole generation batch
(`gradient_accumulation_steps = steps_per_generation`). By default a micro-batch holds one group
(`per_device_train_batch_size = num_generations`): DTA shares prefixes within a micro-batch only, so smaller
micro-batches split a group and lose sharing (with 4 rows per micro-batch a 16-completion group compresses 2.5x
instead of 4x).

```
python -m benchmarks.bench_trainer --quick
python -m benchmarks.bench_trainer --device cuda --dtype bf16 --model-shape qwen3-1.7b
python -m benchmarks.bench_trainer --compression     # tree compression per micro-batch vs per optimizer step only
```

Methods: `trl` (GRPOTrainer, `gradient_checkpointing=False`), `trl+ckpt` (TRL's default, HF checkpointing), `dta`
(DTAGRPOTrainer keeping every graph), `dta+ckpt` (`gradient_checkpointing=True`: DTA's block recompute). Writes
`benchmarks/results/trainer[-quick].csv/.png/.md`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from trl_dta.flops import dense_flops, get_model_shape, tree_flops

from . import common, workloads


METHODS = ("trl", "trl+ckpt", "dta", "dta+ckpt")


def rollout_batch(workload: workloads.Workload, prompt_len: int, seed: int = 0) -> dict:
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


def step_compression(accumulations=(1, 4, 8), micro_batch_size: int = 8, micro_batches: int = 8,
                     seed: int = 0) -> list[dict]:
    """Compression per micro-batch vs per optimizer step on the GRPO grid, computed from the trees (no training).

    A generation batch of `micro_batch_size * micro_batches` rows (whole prompt groups) is shuffled with TRL's draw
    (`torch.randperm`, as `shuffle_sequence_dict`) and cut into `micro_batches` micro-batches of TRL's size; an
    optimizer step accumulates `gradient_accumulation_steps` of them. `per_micro_batch` = tokens / the summed tree
    tokens of the micro-batches (DTA before whole-step forests), `per_step` = tokens / the summed tree tokens of the
    steps' forests (one forest per optimizer step), `whole_batch` = the generation batch as one tree.
    """
    from trl_dta.tree import PrefixTree

    rows = []
    n = micro_batch_size * micro_batches
    for prompt_len, group, completion_len in workloads.GRPO_GRID:
        w = workloads.grpo(prompt_len, group, completion_len, n_prompts=n // group, seed=seed)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        seqs = [w.seqs[i] for i in order]
        micro = [seqs[i : i + micro_batch_size] for i in range(0, n, micro_batch_size)]
        tokens = sum(len(s) for s in seqs)
        micro_tree = sum(PrefixTree.from_sequences(m).n_tree_tokens for m in micro)
        for accumulation in accumulations:
            steps = [[s for m in micro[i : i + accumulation] for s in m] for i in range(0, micro_batches, accumulation)]
            step_tree = sum(PrefixTree.from_sequences(step).n_tree_tokens for step in steps)
            rows.append({
                "workload": w.name,
                "rows": n,
                "micro_batch_size": micro_batch_size,
                "gradient_accumulation_steps": accumulation,
                "per_micro_batch": round(tokens / micro_tree, 3),
                "per_step": round(tokens / step_tree, 3),
                "whole_batch": round(w.tree().compression_ratio, 3),
            })
    return rows


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


def measure(workload: workloads.Workload, prompt_len: int, group: int, method: str, shape: str, device: str,
            dtype: str, micro_batch_size: int, steps: int, threads: int | None, seed: int = 0) -> dict:
    """Train `1 + steps` optimizer steps and time the last `steps` (call through `common.run_isolated`)."""
    from datasets import Dataset
    from transformers import TrainerCallback

    from trl_dta.tiny import build_tokenizer
    from trl_dta.trainers.grpo import DTAGRPOConfig

    common.set_threads(threads)
    # bf16 runs keep float32 parameters and let the trainers autocast (`bf16=True`), as TRL does by default
    model = common.build_model(shape, common.parse_dtype(dtype) if dtype != "bf16" else torch.float32, device,
                               seed=seed)
    n = len(workload.seqs)
    if n % micro_batch_size:
        raise ValueError(f"{n} rollouts are not a multiple of micro_batch_size {micro_batch_size}")
    k = n // micro_batch_size
    cls = _trainer_class(method)
    cls.bench_batch = rollout_batch(workload, prompt_len, seed)
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)
            if len(times) == 1:
                mem.reset()  # peak memory of the timed steps, optimizer state already allocated

    mem = common.PeakMemory(device)
    with tempfile.TemporaryDirectory() as out:
        config = DTAGRPOConfig(
            output_dir=out,
            per_device_train_batch_size=micro_batch_size,
            gradient_accumulation_steps=k,
            steps_per_generation=k,
            num_generations=group,
            max_steps=1 + steps,
            learning_rate=1e-6,
            gradient_checkpointing=method.endswith("+ckpt"),
            bf16=dtype == "bf16",
            use_cpu=device == "cpu",
            report_to="none",
            logging_steps=10_000,
            save_strategy="no",
            disable_dropout=True,
            dta_min_compression=0.0,
            dataloader_num_workers=0,
            seed=seed,
        )
        prompts = Dataset.from_dict({"prompt": ["x"] * (n // group) * (2 + steps)})
        trainer = cls(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
                      train_dataset=prompts, processing_class=build_tokenizer(), callbacks=[Timer()])
        trainer.train()
        peak = mem.peak_mb()
    timed = sorted(times[1:])
    tree = workload.tree()
    # a micro-batch is a tree of its own: the ideal ratio is over micro-batches of whole groups (DTA's split)
    seqs = workload.seqs
    parts = [seqs[i : i + micro_batch_size] for i in range(0, n, micro_batch_size)]
    ideal = dense_flops(tree.lengths, shape).total / sum(tree_flops(p, shape).total for p in parts)
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
        "model_shape": get_model_shape(shape).name,
        "device": device,
        "dtype": dtype,
        "loadavg": os.getloadavg()[0],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model-shape", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--micro-batch-size", type=int, default=0,
                   help="per_device_train_batch_size (default 0: one group per micro-batch, the group size)")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps (after one warm-up step)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-isolate", action="store_true")
    p.add_argument("--compression", action="store_true",
                   help="only print the tree compression per micro-batch vs per optimizer step (no training)")
    args = p.parse_args(argv)
    if args.compression:
        rows = step_compression()
        print(common.markdown_table(rows, columns=list(rows[0])))
        return

    cpu = args.device == "cpu"
    shape = args.model_shape or ("bench-cpu-quick" if args.quick else "bench-cpu")
    threads = args.threads if args.threads is not None else (1 if cpu else None)
    vocab = min(get_model_shape(shape).vocab_size, 32768)
    scale_g, scale_m = (0.25, 0.125) if args.quick else (1.0, 1.0)
    grpo = workloads.grpo(1024, 16, 256, scale=scale_g, vocab_size=vocab)
    agent = workloads.multi_turn(scale=scale_m, vocab_size=vocab)
    grid = [
        (grpo, grpo.params["prompt_len"], 16),
        (agent, agent.params["system_len"] + agent.params["task_len"], agent.params["group"]),
    ]
    rows = []
    for w, prompt_len, group in grid:
        common.log(f"== {w.name} ({w.description})")
        for method in args.methods.split(","):
            try:
                row = common.run_isolated(measure, w, prompt_len, group, method, shape, args.device, args.dtype,
                                          args.micro_batch_size or group, args.steps, threads,
                                          isolate=not args.no_isolate)
                common.log(f"   {method:10s} {row['step_s']:8.2f} s/step {row['tokens_per_s']:9.0f} tok/s "
                           f"peak {row['peak_mem_mb']:8.0f} MB")
            except RuntimeError as e:
                msg = str(e).strip().splitlines()
                common.log(f"   {method:10s} FAILED: {msg[0] if msg else e}\n" + "\n".join(msg[-12:]))
                row = {"workload": w.name, "method": method, "error": msg[0] if msg else "failed"}
            rows.append(row)
    for r in rows:  # the dense reference of this benchmark is TRL's trainer
        r["method"] = {"trl": "dense", "trl+ckpt": "dense+ckpt"}.get(r["method"], r["method"])
    common.fill_ratios(rows)
    name = "trainer" + ("-quick" if args.quick else "") + ("" if cpu else f"-{args.device}-{args.dtype}")
    path = common.write_csv(rows, f"benchmarks/results/{name}.csv")
    common.plot(path)
    table = common.markdown_table(rows)
    (path.with_suffix(".md")).write_text(f"model {shape}, {args.device}, {args.dtype}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
