"""Engine benchmark: dense micro-batches vs packed tree mask vs `DTAEngine.forward_backward`.

Dense runs with `--micro-batch-size` rows per micro-batch (`dense`, one row by default) and with TRL's default
micro-batch of 8 padded rows (`dense-mb8`); speed ratios are against the faster of the two
(`reporting.results.fill_ratios`).

One training step = `provider.forward_backward(seqs, loss_fn)` + AdamW step, on a Qwen2-shaped model with random
weights (hidden 512, 8 layers, GQA 8/2 heads, vocab 8192, fp32 on CPU). Each (workload, method) runs in a fresh
forked process so that its peak memory is its own (`grid.run_grid`). Workloads:

  (a) GRPO-like: prompt 1024, 16 completions of 256 (compression 4.0x)
  (b) multi-turn agent tree, compression ~9x (4.8K-token system prompt, 2 tasks x 8 rollouts, 4 turns)
  (c) no sharing (compression 1.0x)

```
python -m benchmarks.suites.bench_engine                  # CPU, scaled workloads (see --scale), ~10-15 min on 2 cores
python -m benchmarks.suites.bench_engine --quick          # the quick shape and sizes of `benchmarks.suites.run --quick`
python -m benchmarks.suites.bench_engine --device cuda --dtype bf16 --model-shape qwen3-1.7b --scale 1
python -m benchmarks.suites.bench_engine --prefix-memory  # prompt 4096, 4/32/128 siblings, dta-sdpa vs dta
python -m benchmarks.suites.bench_engine --quick --families qwen,gpt_oss --workloads grpo \
    --methods dense,dense-mb8,dta --tag families           # GPT-OSS (sinks, MoE) beside Qwen2 of the same width
```

Writes `benchmarks/results/engine[-<tag>].csv` and `.png` (`prefix-memory[-<tag>]` with `--prefix-memory`). The
general suite (all workloads, dense+ckpt) is `run.py`; the methods are `providers.py`'s, the grid runner
`grid.py`.
"""

from __future__ import annotations

import argparse

from .. import workloads
from ..harness.cli import names, prefixed
from ..harness.models import FAMILY_NAMES, PRETRAINED_SHAPES, model_shape
from ..reporting.plots import plot, plot_prefix_memory
from ..reporting.results import markdown_table, write_csv
from .grid import run_grid
from .providers import PROVIDERS, MethodConfig

# The tau2 airline per-turn trees per size (`workloads.tau2_airline`): the GPU's (1 task x 4 episodes, 36 rows,
# 205K tokens, 8.6K tree tokens, 24x); this CPU's, 1 x 2 episodes, their first 3 turns over the first 1,024 tokens
# of the shared prefix (6 rows, 8.1K tokens, 2.3K tree tokens, 3.6x); at a pretrained model's width on this CPU,
# 2 turns over 512 prefix tokens (4 rows, 2.7K tokens, 1.05K tree tokens, 2.6x).
TAU2_SIZES = {"gpu": dict(tasks=1, group=4), "cpu": dict(tasks=1, group=2, max_turns=3, prefix_tokens=1024),
              "cpu-pretrained": dict(tasks=1, group=2, max_turns=2, prefix_tokens=512)}


def engine_workloads(scale_grpo: float, scale_multi_turn: float, no_sharing: tuple[int, int], vocab_size: int,
                     tau2: str = "cpu"):
    """GRPO p1024/g16/c256, the multi-turn tree, no sharing (each at its scale) and tau2 airline (`TAU2_SIZES`)."""
    return [
        workloads.grpo(1024, 16, 256, scale=scale_grpo, vocab_size=vocab_size),
        workloads.multi_turn(scale=scale_multi_turn, vocab_size=vocab_size),
        workloads.no_sharing(*no_sharing, vocab_size=vocab_size),
        workloads.tau2_airline(vocab_size=vocab_size, **TAU2_SIZES[tau2]),
    ]


def prefix_memory(siblings=(4, 32, 128), methods=("dta-sdpa", "dta"), shape: str = "bench-cpu-quick",
                  device: str = "cpu", dtype: str = "fp32", prompt: int = 4096, completion: int = 32,
                  rounds: int = 2, threads: int | None = 1) -> list[dict]:
    """The prefix-memory case: one `prompt`-token prompt, `siblings` completions of `completion` tokens,
    `forward_backward` (+ AdamW step) in a fresh process per run; peak memory above the model and optimizer.

    The concatenating attention (`dta-sdpa`) holds one copy of the prompt's keys/values per sibling in every layer,
    the two-part backends one in all; so the peak must grow with the siblings' own tokens only (target: 32 siblings
    within 1.5x of 4). Rows as `run_grid`'s, plus `mem_vs_first` (peak over the same method's at the fewest
    siblings)."""
    vocab = model_shape(shape).vocab_size
    grid = [workloads.grpo(prompt, n, completion, vocab_size=vocab) for n in siblings]
    rows = run_grid(grid, list(methods), shape, device, dtype, MethodConfig(), rounds=rounds, threads=threads,
                    oracle=False)
    for row in rows:
        first = next(r for r in rows if r["method"] == row["method"])
        if row.get("peak_mem_mb") and first.get("peak_mem_mb"):
            row["mem_vs_first"] = row["peak_mem_mb"] / first["peak_mem_mb"]
    return rows


PREFIX_MEMORY_COLUMNS = ["workload", "method", "n_sequences", "peak_mem_mb", "mem_vs_first", "step_s", "loadavg",
                         "error"]


# The columns of the side-by-side tables (`bench_side_by_side.py`).
SIDE_BY_SIDE_COLUMNS = ["workload", "method", "step_s", "median_step_s", "cpu_step_s", "steps", "peak_mem_mb",
                        "forward_tokens", "padded_tokens", "forwards", "micro_batches", "oracle_ok",
                        "speedup_vs_trl_tree", "speedup_vs_sparse_flex", "speedup_vs_dense_ckpt", "speedup_vs_dense",
                        "fraction_of_ideal", "ideal_ratio", "attention"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="quick model and sizes (as benchmarks.suites.run --quick)")
    p.add_argument("--prefix-memory", action="store_true",
                   help="the prefix-memory case instead: prompt 4096, 4 / 32 / 128 completions of 32, `--methods` "
                        "default dta-sdpa,dta, `bench-cpu-quick` shape unless --model-shape")
    p.add_argument("--model-shape", default=None,
                   help="bench-cpu (default), bench-cpu-quick with --quick, ...; smollm2: SmolLM2-135M's real weights")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--scale", type=float, default=None,
                   help="length scale of all workloads (default: 0.5 GRPO / 0.25 multi-turn on CPU, 1 on GPU)")
    p.add_argument("--methods", default=None, type=names(PROVIDERS, "method"),
                   help="comma-separated (default: dense,dense-mb8,sparse,dta)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="rows per micro-batch of `dense` and `dense+ckpt`")
    p.add_argument("--rounds", type=int, default=3, help="timed steps per method, interleaved (best kept)")
    p.add_argument("--families", default="qwen", type=names(FAMILY_NAMES, "family"),
                   help=f"comma-separated, of {sorted(FAMILY_NAMES)}: each family "
                   "at the shape's width (rows `<workload>@<family>`)")
    p.add_argument("--workloads", default=None, help="comma-separated name prefixes to keep (e.g. grpo)")
    p.add_argument("--tag", default="")
    p.add_argument("--no-isolate", action="store_true")
    p.add_argument("--no-oracle", action="store_true", help="skip the per-sequence oracle check of each method")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per run on CPU (1 avoids OpenMP oversubscription on a shared machine)")
    args = p.parse_args(argv)

    cpu = args.device == "cpu"
    if args.prefix_memory:
        methods = args.methods or ["dta-sdpa", "dta"]
        rows = prefix_memory(methods=methods, shape=args.model_shape or "bench-cpu-quick", device=args.device,
                             dtype=args.dtype, rounds=args.rounds, threads=args.threads if cpu else None)
        name = "prefix-memory" + (f"-{args.tag}" if args.tag else "")
        path = write_csv(rows, f"benchmarks/results/{name}.csv")
        print(markdown_table(rows, PREFIX_MEMORY_COLUMNS))
        print(f"\nwrote {path} and {plot_prefix_memory(rows, path.with_suffix('.png'))}")
        return
    shape = args.model_shape or ("bench-cpu-quick" if args.quick else "bench-cpu")
    vocab = model_shape(shape).vocab_size
    pretrained = shape in PRETRAINED_SHAPES
    tau2 = "gpu" if not cpu else "cpu-pretrained" if pretrained else "cpu"
    if args.quick:  # a pretrained model's width on CPU: a quarter of the quick GRPO lengths
        grid = engine_workloads(1 / 16 if pretrained else 0.25, 0.125, (8, 512), vocab, tau2)
    elif args.scale is not None:
        grid = engine_workloads(args.scale, args.scale, (16, round(2048 * args.scale)), vocab, tau2)
    elif cpu:
        grid = engine_workloads(0.5, 0.25, (8, 1024), vocab, tau2)
    else:
        grid = engine_workloads(1.0, 1.0, (16, 2048), vocab, tau2)
    if args.workloads:
        prefixes = [w for w in args.workloads.split(",") if w]
        prefixed(p, "--workloads", prefixes, [w.name for w in grid])
        grid = [w for w in grid if w.name.startswith(tuple(prefixes))]
    cfg = MethodConfig(micro_batch_size=args.micro_batch_size)
    methods = args.methods or ["dense", "dense-mb8", "sparse", "dta"]
    rows = []
    for family in args.families:
        rows += run_grid(grid, methods, shape, args.device, args.dtype, cfg, rounds=args.rounds,
                         isolate=not args.no_isolate, threads=args.threads if cpu else None, family=family,
                         oracle=not args.no_oracle)
    name = "engine" + ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else "")
    path = write_csv(rows, f"benchmarks/results/{name}.csv")
    print(markdown_table(rows, SIDE_BY_SIDE_COLUMNS))
    print(f"\nwrote {path} and {plot(path)}")


if __name__ == "__main__":
    main()
