"""Hybrid models through DTA: a Qwen3.5-shaped model (three Gated DeltaNet layers per full-attention
layer) and a Nemotron-H-shaped one (Mamba2 / MLP / Mamba2 / attention blocks) beside the attention-only Qwen2-shaped
model of the same width and depth (`bench-cpu-quick`: hidden 256, 4 layers, vocab 4096), on the GRPO and
multi-turn workloads of `bench_engine --quick`: dense micro-batches (one row, and TRL's 8 padded rows) against
`DTAEngine.forward_backward`, one training step (+ AdamW), each (model, workload, method) in its own process
(`grid.run_grid`: steps interleaved, the best kept, peak memory above the model and optimizer).

The packed tree-mask peer (`sparse`) cannot run a recurrence over a tree and is left out; so is DTA's packing of
small subtrees, which the engine does not use for hybrids (`engine/core.py`): the hybrids' DTA walks every internal
segment, batching only leaves.

```
python -m benchmarks.suites.bench_hybrid              # CPU, ~10 min on 2 cores
python -m benchmarks.suites.bench_hybrid --rounds 1 --workloads grpo
```

Writes `benchmarks/results/hybrid[-<tag>].csv` and `.png`: per model and workload, DTA's speed-up over the faster
dense variant and its peak memory relative to it (`mem_vs_dense`), the ideal FLOP speed-up beside them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trl_dta.flops import MODEL_SHAPES, get_model_shape

from .. import workloads
from ..harness.cli import log, names
from ..reporting.results import markdown_table, write_csv
from .grid import run_grid
from .providers import PROVIDERS, MethodConfig

SHAPES = ("bench-cpu-quick", "bench-qwen3.5-quick", "bench-nemotron-h-quick")
FAMILY = {"bench-cpu-quick": "attention (Qwen2)", "bench-qwen3.5-quick": "Gated DeltaNet (Qwen3.5)",
          "bench-nemotron-h-quick": "Mamba2 (Nemotron-H)"}
COLUMNS = ["model_shape", "workload", "method", "n_tokens", "n_tree_tokens", "ideal_ratio", "step_s",
           "speedup_vs_dense", "dense_ref", "fraction_of_ideal", "peak_mem_mb", "mem_vs_dense", "loadavg", "error"]


# The workloads by name, each built for a vocabulary size.
WORKLOADS = {"grpo": lambda vocab: workloads.grpo(1024, 16, 256, scale=0.25, vocab_size=vocab),
             "multi_turn": lambda vocab: workloads.multi_turn(scale=0.125, vocab_size=vocab)}


def grid(names, vocab: int) -> list[workloads.Workload]:
    return [WORKLOADS[name](vocab) for name in names]


def plot(rows: list[dict], png_path) -> Path:
    """Two panels: DTA's speed-up over the faster dense variant, and its peak memory relative to it, per workload and
    model family (the ideal FLOP speed-up as a marker)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dta = [r for r in rows if r["method"] == "dta" and r.get("speedup_vs_dense")]
    loads = list(dict.fromkeys(r["workload"] for r in dta))
    shapes = list(dict.fromkeys(r["model_shape"] for r in dta))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(len(shapes), 1)
    for k, shape in enumerate(shapes):
        xs = [i + (k - (len(shapes) - 1) / 2) * width for i in range(len(loads))]
        by = {r["workload"]: r for r in dta if r["model_shape"] == shape}
        axes[0].bar(xs, [by[w]["speedup_vs_dense"] for w in loads], width, label=FAMILY.get(shape, shape))
        axes[0].scatter(xs, [by[w]["ideal_ratio"] for w in loads], marker="_", s=200, color="black")
        axes[1].bar(xs, [by[w].get("mem_vs_dense") or 0 for w in loads], width, label=FAMILY.get(shape, shape))
    for ax, title in zip(axes, ("DTA speed-up over dense (ideal: -)", "DTA peak memory / dense")):
        ax.set_xticks(range(len(loads)), loads)
        ax.set_title(title)
        ax.axhline(1.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return Path(png_path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), type=names(MODEL_SHAPES, "model shape"))
    p.add_argument("--workloads", default=",".join(WORKLOADS), type=names(WORKLOADS, "workload"))
    p.add_argument("--methods", default="dense,dense-mb8,dta", type=names(PROVIDERS, "method"))
    p.add_argument("--rounds", type=int, default=2, help="timed steps per method, interleaved (best kept)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (1: no OpenMP oversubscription)")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    rows = []
    for shape in args.shapes:
        log(f"#### {shape}: {FAMILY.get(shape, shape)}")
        loads = grid(args.workloads, get_model_shape(shape).vocab_size)
        rows += run_grid(loads, args.methods, shape, "cpu", "fp32", MethodConfig(), rounds=args.rounds,
                         threads=args.threads)  # ratios per shape: each model against its own dense runs
    name = "hybrid" + (f"-{args.tag}" if args.tag else "")
    path = write_csv(rows, f"benchmarks/results/{name}.csv")
    print(markdown_table(rows, COLUMNS))
    print(f"\nwrote {path} and {plot(rows, path.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
