"""Trainer-level benchmark: TRL's `GRPOTrainer` vs `DTAGRPOTrainer`, a whole optimizer step, generation excluded.

Both trainers get the same fixed rollout batch from `_generate_and_score_completions` (`trainer_steps.py`: overridden in
a subclass so that generation and rewards take no time and every step sees the same tokens; everything after it is the
trainers' own code: TRL's row shuffle or DTA's group-aware split, micro-batching, `_compute_loss` or the engine,
backward, gradient accumulation, AdamW, metrics). One optimizer step covers the whole generation batch
(`gradient_accumulation_steps = steps_per_generation`). By default a micro-batch holds one group
(`per_device_train_batch_size = num_generations`): DTA shares prefixes within a micro-batch only, so smaller
micro-batches split a group and lose sharing (with 4 rows per micro-batch a 16-completion group compresses 2.5x
instead of 4x).

```
python -m benchmarks.suites.bench_trainer --quick
python -m benchmarks.suites.bench_trainer --device cuda --dtype bf16 --model-shape qwen3-1.7b
python -m benchmarks.suites.bench_trainer --compression    # tree compression per micro-batch vs per optimizer step only
python -m benchmarks.suites.bench_trainer --agent --quick  # multi-turn agent episodes, episode and per-turn layouts
```

Methods: `trl` (GRPOTrainer, `gradient_checkpointing=False`), `trl+ckpt` (TRL's default, HF checkpointing), `dta`
(DTAGRPOTrainer keeping every graph), `dta+ckpt` (`gradient_checkpointing=True`: DTA's block recompute). Writes
`benchmarks/results/trainer[-quick][-<shape> with --model-shape].csv/.png/.md`.

`--agent`: multi-turn episodes of the offline retail environment (`trl_dta.envs`), played by a scripted agent and
replayed to `DTAGRPOTrainer` through TRL's `rollout_func` (`agent_steps.py`, `workloads/agent.py`), in both sample
layouts (`dta_sample_layout="episode"` and `"per_turn"`). Methods per layout: `dense` (`dta_enabled=False`: TRL's dense
path on the same rows; in the episode layout that is `GRPOTrainer`'s computation) and `dta`. The ideal FLOP ratio and
the compression are those of the step's forest (all rows of the generation: one generation per optimizer step) over the
dense run of the same layout; `step_vs_dense_episode` compares step times across layouts. Writes
`benchmarks/results/trainer-agent[-quick][-<shape>].csv/.png/.md`.

`--agent --domain airline|retail|telecom|mock`: the same on a real tau2-bench domain (`benchmarks.workloads.tau2`):
gold-action episodes and variants of them, tau2's system prompt and tool schemas, tool outputs from the real database,
lengths of a real BPE tokenizer (DeepSeek's, bundled with litellm). `--stats-only --domain all` prints the workload
numbers of every domain without training (`benchmarks/results/tau2-agent-stats.*`).
"""

from __future__ import annotations

import argparse

import torch

from .. import workloads
from ..harness.cli import log, names
from ..harness.isolation import run_isolated
from ..harness.models import PRETRAINED_SHAPES, model_shape
from ..reporting.plots import plot
from ..reporting.results import fill_ratios, markdown_table, write_csv
from .agent_steps import AGENT_LAYOUTS, AGENT_METHODS, run_agent
from .trainer_steps import measure

METHODS = ("trl", "trl+ckpt", "dta", "dta+ckpt")


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model-shape", default=None, help="bench-cpu (default), ...; smollm2: SmolLM2-135M's real weights")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--methods", default=",".join(METHODS), type=names(METHODS, "method"))
    p.add_argument("--micro-batch-size", type=int, default=0,
                   help="per_device_train_batch_size (default 0: one group per micro-batch, the group size)")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps (after one warm-up step)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-isolate", action="store_true")
    p.add_argument("--compression", action="store_true",
                   help="only print the tree compression per micro-batch vs per optimizer step (no training)")
    p.add_argument("--agent", action="store_true",
                   help="multi-turn agent episodes, dense and DTA in the episode and per-turn layouts")
    p.add_argument("--agent-tasks", type=int, default=None, help="--agent: tasks per optimizer step (preset: 2/4)")
    p.add_argument("--agent-group", type=int, default=None, help="--agent: episodes per task, G (preset: 4/8)")
    p.add_argument("--agent-methods", default=",".join(AGENT_METHODS), type=names(AGENT_METHODS, "method"),
                   help="--agent: methods to run (e.g. `dta` alone where the dense rows would take hours: airline "
                   "per-turn at SmolLM2's size is 546K dense tokens per step)")
    p.add_argument("--agent-layouts", default=",".join(AGENT_LAYOUTS), type=names(AGENT_LAYOUTS, "layout"),
                   help="--agent: sample layouts to run")
    p.add_argument("--policy-chars", type=int, default=None,
                   help="--agent: system prompt length in characters = tokens (preset: 0 (~500)/2048)")
    p.add_argument("--domain", default="standin", choices=["standin", "airline", "retail", "telecom", "mock", "all"],
                   help="--agent: the stand-in retail domain, or a real tau2-bench domain (trl-dta[tau2]): gold-action "
                   "episodes, real system prompt and tools, DeepSeek BPE lengths")
    p.add_argument("--stats-only", action="store_true",
                   help="--agent --domain: only the workload numbers (prompt tokens, turns, compression per layout, "
                   "gold reward), no training; writes benchmarks/results/tau2-agent-stats[-<domain>].*")
    args = p.parse_args(argv)
    if args.compression:
        rows = step_compression()
        print(markdown_table(rows, columns=list(rows[0])))
        return

    cpu = args.device == "cpu"
    shape = args.model_shape or ("bench-cpu-quick" if args.quick else "bench-cpu")
    threads = args.threads if args.threads is not None else (1 if cpu else None)
    if args.agent:
        run_agent(args, shape, threads)
        return
    vocab = min(model_shape(shape).vocab_size, 32768)
    scale_g, scale_m = (0.25, 0.125) if args.quick else (1.0, 1.0)
    if shape in PRETRAINED_SHAPES and args.quick:  # SmolLM2's real weights on this CPU: a quarter of that
        scale_g, scale_m = 1 / 16, 1 / 32
    grpo = workloads.grpo(1024, 16, 256, scale=scale_g, vocab_size=vocab)
    agent = workloads.multi_turn(scale=scale_m, vocab_size=vocab)
    grid = [
        (grpo, grpo.params["prompt_len"], 16),
        (agent, agent.params["system_len"] + agent.params["task_len"], agent.params["group"]),
    ]
    rows = []
    for w, prompt_len, group in grid:
        log(f"== {w.name} ({w.description})")
        for method in args.methods:
            try:
                row = run_isolated(measure, w, prompt_len, group, method, shape, args.device, args.dtype,
                                          args.micro_batch_size or group, args.steps, threads,
                                          isolate=not args.no_isolate)
                log(f"   {method:10s} {row['step_s']:8.2f} s/step {row['tokens_per_s']:9.0f} tok/s "
                           f"peak {row['peak_mem_mb']:8.0f} MB")
            except RuntimeError as e:
                msg = str(e).strip().splitlines()
                log(f"   {method:10s} FAILED: {msg[0] if msg else e}\n" + "\n".join(msg[-12:]))
                row = {"workload": w.name, "method": method, "error": msg[0] if msg else "failed"}
            rows.append(row)
    for r in rows:  # the dense reference of this benchmark is TRL's trainer
        r["method"] = {"trl": "dense", "trl+ckpt": "dense+ckpt"}.get(r["method"], r["method"])
    fill_ratios(rows)
    name = "trainer" + ("-quick" if args.quick else "") + ("" if cpu else f"-{args.device}-{args.dtype}") + \
        (f"-{shape}" if args.model_shape else "")
    path = write_csv(rows, f"benchmarks/results/{name}.csv")
    plot(path)
    table = markdown_table(rows)
    (path.with_suffix(".md")).write_text(f"model {shape}, {args.device}, {args.dtype}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
