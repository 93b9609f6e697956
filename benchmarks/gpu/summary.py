"""The GPU check's summary: `summary.md` (every table of the run), `throughput.png`, and the dry run's completeness
check (every planned row measured without an error, every column there). `python -m benchmarks.gpu.bench summary`."""

from __future__ import annotations

from pathlib import Path

from ..reporting.results import markdown_table
from .plan import COLUMNS, FILE_OF, METHODS, fill_ratios, planned, read_rows, shape_of


def check(out: Path, expect: list[tuple[str, str]], dry_run: bool) -> list[str]:
    """What a complete run lacks: for each `(step, model)` of `expect`, a measured, error-free row per workload and
    method in the step's file, with every column of `COLUMNS`."""
    problems = []
    for step, model in expect:
        name = FILE_OF[step]
        rows = read_rows(out / name)
        if not rows:
            problems.append(f"{name}: no rows")
            continue
        if set(COLUMNS) - set(rows[0]):
            problems.append(f"{name}: missing columns {sorted(set(COLUMNS) - set(rows[0]))}")
        shape = shape_of(model, dry_run).name
        names, methods = planned(step, dry_run)
        for workload in names:
            for method in methods:
                row = next((r for r in reversed(rows) if (r["model_shape"], r["workload"], r["method"]) ==
                            (shape, workload, method)), None)
                if row is None or not row.get("tokens_per_s") or row.get("error"):
                    problems.append(f"{name}: {shape} {workload} {method}: "
                                    + ("no row" if row is None else row.get("error") or "no tokens/s"))
    return problems


def _table(rows, columns) -> str:
    return markdown_table(rows, columns) if rows else "(no rows)"


def summary(out: Path, expect: list[tuple[str, str]], dry_run: bool) -> None:
    """Write `out/summary.md` and `out/throughput.png`; report what `expect` (`(step, model)` pairs) lacks, and in a
    dry run fail (SystemExit) if anything is missing."""
    parts = ["# GPU check: summary", ""]
    throughput_rows = read_rows(out / "throughput.csv")
    for row in throughput_rows:  # against every reference row of the run (DTA's were written before the baselines')
        fill_ratios(row, throughput_rows)
    parts += ["## Throughput (tokens/s of rollout tokens; ratios per workload)", "",
              "Seconds per optimizer step (best and median of `steps`), ratios of tokens/s (`vs_sparse`: over "
              "`sparse-flex`), the ideal FLOP ratio over dense, `forwards`: model calls per step (each a forward and "
              "its backward: with `step_s`, whether the walk is launch-bound), `padded_tokens`: tokens the model "
              "computed, padding included, `checked`: the correctness step's verdict on a DTA backend or the oracle "
              "check of `trl-tree` / `sparse-flex` (a failed one also fills `error`).", "",
              _table(throughput_rows, ["model_shape", "workload", "method", "n_tokens", "compression_ratio",
                                       "ideal_ratio", "step_s", "median_step_s", "steps", "tokens_per_s",
                                       "vs_dense_ckpt", "vs_trl_tree", "vs_sparse", "vs_dense", "peak_mem_mb",
                                       "mem_vs_dense_ckpt", "forwards", "padded_tokens", "forward_tokens",
                                       "micro_batches", "loss", "checked", "error"]), ""]
    parts += ["## Trainer step (TRL's defaults)", "",
              _table(read_rows(out / "trainer.csv"), ["model_shape", "workload", "method", "step_s", "tokens_per_s",
                                                      "vs_trl", "peak_mem_mb", "mem_vs_trl", "error"]), ""]
    parts += ["## Prefix memory", "", _table(read_rows(out / "prefix_memory.csv"),
                                             ["model_shape", "workload", "method", "peak_mem_mb", "mem_vs_first",
                                              "step_s", "error"]), ""]
    correctness = read_rows(out / "correctness.csv")
    if correctness:
        bad = [r for r in correctness if r.get("ok") != 1.0]
        parts += ["## Correctness", "", f"{len(correctness) - len(bad)} of {len(correctness)} checks passed"
                  + ("" if not bad else ": failed " + ", ".join(f"{r['family']}/{r['backend']}/{r['precision']}"
                                                                for r in bad)), ""]
    (out / "summary.md").write_text("\n".join(parts))
    print("\n".join(parts))
    if throughput_rows:
        _plot(throughput_rows, out / "throughput.png")
    problems = check(out, expect, dry_run)
    for problem in problems:
        print("NOT MEASURED " + problem)
    if expect and not problems:
        print(f"every planned row measured: {', '.join(f'{s} {m}' for s, m in expect)}")
    if problems and dry_run:
        raise SystemExit(f"FAIL: {len(problems)} planned rows missing or failed")


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["model_shape"], r["workload"]) for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(groups)), 4.5))
    width = 0.8 / len(METHODS)
    for m, method in enumerate(METHODS):
        xs, ys = [], []
        for g, (shape, workload) in enumerate(groups):
            r = next((r for r in rows if (r["model_shape"], r["workload"], r["method"]) == (shape, workload, method)
                      and r.get("tokens_per_s")), None)
            if r:
                xs.append(g + (m - (len(METHODS) - 1) / 2) * width)
                ys.append(r["tokens_per_s"])
        ax.bar(xs, ys, width, label=method)
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)), [f"{s}\n{w}" for s, w in groups], fontsize=8)
    ax.set_ylabel("rollout tokens / s")
    ax.set_title("GPU check: throughput per method (bf16 autocast)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
