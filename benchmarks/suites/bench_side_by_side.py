"""DTA side by side with TRL's own tree packing and the strongest baselines, in one run per size.

Methods (`providers.PROVIDERS`): `dense-ckpt` (TRL's default: micro-batches of 8 padded rows, gradient
checkpointing), `dense` (one row per micro-batch, no checkpointing: no padding, the fastest dense on these CPU sizes),
`sparse-flex` (the packed tree, the whole tree in one row, FlexAttention's block mask; on CPU its block-loop fallback,
torch having no CPU FlexAttention backward), `trl-tree` (TRL's `TreeRow` planner and packer, the whole batch in one row,
an exact varlen attention in place of FA3 from the hub), `dta-torch` (`DTAEngine` on its torch backend). Each is checked
against the per-sequence oracle before it is timed (`oracle_ok`). Workloads: tau2 airline per-turn trees
(`bench_engine.TAU2_SIZES`) and GRPO p1024/g16/c256 scaled to the size. Sizes: the quick shape (`bench-cpu-quick`,
random weights) and SmolLM2-135M-Instruct's real weights (`smollm2`).

```
python -m benchmarks.suites.bench_side_by_side                   # both sizes on this CPU (~30 min on 2 shared cores)
python -m benchmarks.suites.bench_side_by_side --sizes bench-cpu-quick --rounds 2
```

Writes `benchmarks/results/side-by-side.csv` (one row per size, workload and method; `model_shape` says the size) and
`side-by-side.png` (seconds per step and peak memory per method, one panel per size and workload).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..harness.cli import names
from ..harness.models import PRETRAINED_SHAPES, model_shape
from ..reporting.results import markdown_table, write_csv
from .bench_engine import SIDE_BY_SIDE_COLUMNS, engine_workloads
from .grid import run_grid
from .providers import MethodConfig

METHODS = ("dense-ckpt", "dense", "sparse-flex", "trl-tree", "dta-torch")
SIZES = ("bench-cpu-quick", "smollm2")
COLUMNS = ["model_shape", *SIDE_BY_SIDE_COLUMNS, "n_tokens", "n_tree_tokens", "loss", "oracle_err", "loadavg", "error"]


def size_workloads(shape: str) -> list:
    """tau2 airline and GRPO at the size of `shape` on this CPU (`bench_engine --quick`'s)."""
    pretrained = shape in PRETRAINED_SHAPES
    grid = engine_workloads(1 / 16 if pretrained else 0.25, 0.125, (8, 512), model_shape(shape).vocab_size,
                            "cpu-pretrained" if pretrained else "cpu")
    return [w for w in grid if w.name.startswith(("tau2-airline", "grpo"))]


def plot(rows: list[dict], png_path: Path) -> Path:
    """Seconds per step (bars) and peak memory (dots, right axis) per method, one panel per size and workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["model_shape"], r["workload"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), squeeze=False)
    for ax, (shape, workload) in zip(axes[0], panels):
        sel = [r for r in rows if (r["model_shape"], r["workload"]) == (shape, workload) and r.get("step_s")]
        methods = [r["method"] for r in sel]
        ax.bar(methods, [r["step_s"] for r in sel], color="tab:blue")
        ax.set_ylabel("s / optimizer step (best)")
        ax.tick_params(axis="x", rotation=35, labelsize=8)
        mem = ax.twinx()
        mem.plot(methods, [r.get("peak_mem_mb") or 0 for r in sel], "o", color="tab:red")
        mem.set_ylabel("peak memory above the model (MB)", color="tab:red")
        ax.set_title(f"{shape}\n{workload}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(SIZES), type=names([*SIZES, "bench-cpu"], "size"))
    p.add_argument("--methods", default=",".join(METHODS), type=names(METHODS + ("dta", "dense-mb8"), "method"))
    p.add_argument("--rounds", default=None, type=int,
                   help="timed steps per method (default: 2 at the quick shape, 1 at a pretrained size)")
    p.add_argument("--workloads", default=None, help="comma-separated name prefixes to keep (tau2, grpo)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/side-by-side.csv")
    args = p.parse_args(argv)
    rows = []
    for shape in args.sizes:
        grid = size_workloads(shape)
        if args.workloads:
            grid = [w for w in grid if w.name.startswith(tuple(args.workloads.split(",")))]
        rounds = args.rounds or (1 if shape in PRETRAINED_SHAPES else 2)
        # a pretrained size: one method's process alive at a time (five SmolLM2 workers with AdamW state at once
        # met the OOM killer on a shared 24 GiB machine); the quick shape: interleaved rounds
        rows += run_grid(grid, list(args.methods), shape, "cpu", "fp32", MethodConfig(), rounds=rounds,
                         threads=args.threads, interleave=shape not in PRETRAINED_SHAPES)
        path = write_csv(rows, args.out, COLUMNS)  # after each size: a stopped run keeps the first
    print(markdown_table(rows, COLUMNS[:17]))
    print(f"\nwrote {path} and {plot(rows, path.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
