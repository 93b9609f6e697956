"""The benchmark suite: every workload of `benchmarks/workloads/batches.py` x every method, side by side.

```
python -m benchmarks.suites.run --quick       # < 10 min on 2 CPU cores: quick model (hidden 256, 4 layers), quick sizes
python -m benchmarks.suites.run --full        # bench-cpu model (hidden 512, 8 layers), full sizes (long on a CPU)
python -m benchmarks.suites.run --full --device cuda --dtype bf16 --model-shape qwen3-1.7b
python -m benchmarks.suites.run --quick --methods dense,dense-mb8,dta-sdpa,dta   # attention backends side by side
python -m benchmarks.suites.run --plot benchmarks/results/quick.csv   # redraw a chart from a CSV
```

Methods (see `providers.PROVIDERS`): `dense` (TRL's GRPO path: padded micro-batches, fused LM head; one row
per micro-batch unless `--micro-batch-size`), `dense-mb8` (TRL's default micro-batch of 8 padded rows), `dense+ckpt`
(with HF gradient checkpointing), `sparse` (packed tree mask, `baselines/sparse.py`), `dta`
(`DTAEngine.forward_backward`, every graph kept, `--dta-attn-backend`: the engine's default `auto`), `dta-lowmem`
(`max_graph_tokens` budget: recompute) and `dta-<backend>` (`dta` on one attention backend: `dta-sdpa` is the
concatenating reference, one copy of the path per sibling; `dta-torch`, `dta-flash`, `dta-triton`). A step is
forward + backward + AdamW step; tokens/s counts raw rollout tokens (`n_tokens`), the same for every method.
Speed-ups and fractions of ideal are against the faster of `dense` and `dense-mb8` on each workload (`dense_ref`),
memory ratios against the leaner of them (`reporting.results.fill_ratios`).

Outputs: `benchmarks/results/<name>.csv` (columns `reporting.results.CSV_COLUMNS`), `<name>.png` (bar chart, separate
`--plot` step possible) and `<name>.md` (markdown table). `<name>` is `quick`, `full` or `--name`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from trl_dta.flops import get_model_shape
from trl_dta.kernels import BACKENDS

from .. import workloads
from ..harness.cli import names
from ..reporting.plots import plot
from ..reporting.results import markdown_table, write_csv
from .grid import run_grid
from .providers import PROVIDERS, MethodConfig

RESULTS = Path("benchmarks/results")


def targets(rows: list[dict]) -> list[tuple[str, str, bool | None]]:
    """The project's speed and memory targets, checked on a run's rows: (target, measured, met)."""

    def get(workload_prefix, method, key):
        for r in rows:
            if r["workload"].startswith(workload_prefix) and r["method"] == method and r.get(key) is not None:
                return r[key]
        return None

    out = []
    f = get("multiturn-9x", "dta", "fraction_of_ideal")
    out.append(("multi-turn 9x: DTA >= 0.8 of ideal over the faster dense", f"{f:.2f}" if f else "n/a",
                f >= 0.8 if f else None))
    s = get("multiturn-9x", "dta", "speedup_vs_sparse")
    out.append(("multi-turn 9x: DTA >= 1.7x over sparse", f"{s:.2f}x" if s else "n/a", s >= 1.7 if s else None))
    for r in rows:
        if r["workload"].startswith("grpo") and r["method"] == "dta" and r.get("fraction_of_ideal"):
            f = r["fraction_of_ideal"]
            out.append((f"{r['workload']}: DTA >= 0.85 of ideal over the faster dense", f"{f:.2f}", f >= 0.85))
    s = get("no-sharing", "dta", "speedup_vs_dense")
    out.append(("no sharing: DTA >= 0.95x the faster dense", f"{s:.2f}x" if s else "n/a", s >= 0.95 if s else None))
    for method in ("dta", "dta-lowmem"):
        m = get("multiturn-9x", method, "mem_vs_dense")
        if m is not None:
            out.append((f"multi-turn 9x: {method} peak memory <= 0.5x the leaner dense", f"{m:.2f}x", m <= 0.5))
    return out


def targets_table(rows: list[dict]) -> str:
    lines = ["| target | measured | met |", "|---|---|---|"]
    for name, value, met in targets(rows):
        lines.append(f"| {name} | {value} | {'yes' if met else 'no' if met is not None else 'n/a'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="quick suite (default)")
    size.add_argument("--full", action="store_true", help="full-size suite")
    p.add_argument("--plot", default=None, metavar="CSV", help="only redraw the chart of a results CSV")
    p.add_argument("--model-shape", default=None,
                   help="bench-cpu-quick (quick) / bench-cpu (full) by default; qwen3-1.7b, qwen2-0.5b, ...")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", help="fp32, bf16, fp16, fp64")
    p.add_argument("--methods", default="dense,dense-mb8,dense+ckpt,sparse,dta,dta-lowmem",
                   type=names(PROVIDERS, "method"),
                   help=f"comma-separated, from {list(PROVIDERS)}")
    p.add_argument("--workloads", default="", help="comma-separated workload names (default: all)")
    p.add_argument("--micro-batch-size", type=int, default=1,
                   help="rows per micro-batch of `dense` and `dense+ckpt` (`dense-mb8` always runs 8)")
    p.add_argument("--sparse-attention", default="blocks", choices=["blocks", "mask"])
    p.add_argument("--dta-max-batch-tokens", type=int, default=8192)
    p.add_argument("--dta-lowmem-graph-tokens", type=int, default=1024)
    p.add_argument("--dta-max-pack-tokens", type=int, default=None, help="engine default when omitted")
    p.add_argument("--dta-attn-backend", default="auto", choices=list(BACKENDS),
                   help="attention backend of `dta` and `dta-lowmem` (`dta-<backend>` methods name their own)")
    p.add_argument("--rounds", type=int, default=2,
                   help="timed steps per method (interleaved across methods on CPU); the fastest is kept")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per run (default 1 on CPU: avoids OpenMP oversubscription on a shared machine)")
    p.add_argument("--name", default=None, help="results file name (default: quick / full)")
    p.add_argument("--no-isolate", action="store_true", help="run in-process (debugging; memory numbers leak)")
    args = p.parse_args(argv)

    if args.plot:
        print(plot(args.plot))
        return
    full = args.full
    cpu = args.device == "cpu"
    shape = args.model_shape or ("bench-cpu" if full else "bench-cpu-quick")
    threads = args.threads if args.threads is not None else (1 if cpu else None)
    vocab = min(get_model_shape(shape).vocab_size, 32768)
    try:
        grid = workloads.by_name(workloads.suite("full" if full else "quick", vocab_size=vocab),
                                 [w for w in args.workloads.split(",") if w])
    except ValueError as e:
        p.error(f"argument --workloads: {e}")
    cfg = MethodConfig(
        micro_batch_size=args.micro_batch_size,
        sparse_attention=args.sparse_attention,
        dta_max_batch_tokens=args.dta_max_batch_tokens,
        dta_lowmem_graph_tokens=args.dta_lowmem_graph_tokens,
        dta_max_pack_tokens=args.dta_max_pack_tokens,
        dta_attn_backend=args.dta_attn_backend,
    )
    name = args.name or ("full" if full else "quick") + ("" if cpu else f"-{args.device}-{args.dtype}")
    start = time.perf_counter()
    rows = run_grid(grid, args.methods, shape, args.device, args.dtype, cfg, rounds=args.rounds,
                    isolate=not args.no_isolate, threads=threads)
    elapsed = time.perf_counter() - start
    csv_path = write_csv(rows, RESULTS / f"{name}.csv")
    png_path = plot(csv_path)
    table = markdown_table(rows)
    command = " ".join(["python -m benchmarks.suites.run", *(sys.argv[1:] if argv is None else argv)])
    header = f"`{command}`: model {shape}, {args.device}, {args.dtype}, threads {threads}, {elapsed / 60:.1f} min"

    md = f"{header}\n\n{table}\n\n{targets_table(rows)}\n"
    (RESULTS / f"{name}.md").write_text(md)
    print(md)
    print(f"wrote {csv_path}, {png_path}, {RESULTS / f'{name}.md'} in {elapsed / 60:.1f} min")


if __name__ == "__main__":
    main()
