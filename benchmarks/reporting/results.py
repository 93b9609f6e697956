"""The benchmarks' results as data: the fixed CSV schema, ratios per workload, CSV files and markdown tables.

Every benchmark writes `benchmarks/results/<name>.csv` with the columns of `CSV_COLUMNS` (missing values empty), a
separate plot step reads it back (`plots.py`), and the tables in `benchmarks/RESULTS.md` are `markdown_table` of it.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

# Where the benchmarks write their CSV, PNG and markdown files, whatever the working directory.
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
CSV_COLUMNS = [
    "workload",
    "method",
    "n_sequences",
    "n_tokens",
    "n_tree_tokens",
    "compression_ratio",
    "ideal_ratio",
    "step_s",
    "median_step_s",
    "cpu_step_s",
    "tokens_per_s",
    "speedup_vs_dense",
    "dense_ref",
    "speedup_vs_dense_mb1",
    "speedup_vs_dense_mb8",
    "speedup_vs_sparse",
    "speedup_vs_trl_tree",
    "speedup_vs_sparse_flex",
    "speedup_vs_dense_ckpt",
    "fraction_of_ideal",
    "peak_mem_mb",
    "mem_vs_dense",
    "tflops",
    "model_shape",
    "device",
    "dtype",
    "loadavg",
    "loss",
    "oracle_ok",
    "oracle_err",
    "micro_batches",
    "forwards",
    "forward_tokens",
    "padded_tokens",
    "attention",
    "error",
]


# Plain dense variants (no checkpointing) and their own speed-up columns. The reference of `speedup_vs_dense` and
# `fraction_of_ideal` is the fastest of them on each workload (`dense_ref` names it): a method is never credited with
# beating a dense setup that a user would not run.
DENSE_VARIANTS = {"dense": "speedup_vs_dense_mb1", "dense-mb8": "speedup_vs_dense_mb8"}


def fill_ratios(rows: list[dict]) -> list[dict]:
    """Add speed-ups over dense, `sparse`, `trl-tree`, `sparse-flex` and `dense-ckpt`, fraction of ideal and memory
    relative to dense, per workload.

    `speedup_vs_dense` and `fraction_of_ideal` are against the fastest plain dense variant (`DENSE_VARIANTS`) that ran
    on the workload, `speedup_vs_dense_mb1` / `speedup_vs_dense_mb8` against each variant, and `mem_vs_dense` against
    the variant with the smallest peak memory (the one-row `dense` when both ran): both references are the ones least
    favourable to the other methods.
    """
    by_workload: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_workload.setdefault(row["workload"], {})[row["method"]] = row
    for methods in by_workload.values():
        dense = [methods[m] for m in DENSE_VARIANTS if methods.get(m, {}).get("tokens_per_s")]
        fastest = max(dense, key=lambda r: r["tokens_per_s"], default=None)
        leanest = min((r for r in dense if r.get("peak_mem_mb") is not None), key=lambda r: r["peak_mem_mb"],
                      default=None)
        refs = {"speedup_vs_dense": fastest, "speedup_vs_sparse": methods.get("sparse"),
                "speedup_vs_trl_tree": methods.get("trl-tree"), "speedup_vs_sparse_flex": methods.get("sparse-flex"),
                "speedup_vs_dense_ckpt": methods.get("dense-ckpt")}
        refs.update({key: methods.get(m) for m, key in DENSE_VARIANTS.items()})
        for row in methods.values():
            tps = row.get("tokens_per_s")
            for key, ref in refs.items():
                row[key] = tps / ref["tokens_per_s"] if ref and ref.get("tokens_per_s") and tps else None
            row["dense_ref"] = fastest["method"] if fastest else None
            speedup = row["speedup_vs_dense"]
            row["fraction_of_ideal"] = speedup / row["ideal_ratio"] if speedup and row.get("ideal_ratio") else None
            mem = row.get("peak_mem_mb")
            row["mem_vs_dense"] = (
                mem / leanest["peak_mem_mb"] if leanest and leanest["peak_mem_mb"] and mem is not None else None
            )
    return rows


def fmt(value) -> str:
    """A CSV cell: empty for None and NaN, 6 significant digits for a float."""
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return f"{value:.6g}"
    return str(value)


def write_csv(rows: list[dict], path: str | Path, columns: Sequence[str] = CSV_COLUMNS) -> Path:
    """Write rows with `columns` (the fixed `CSV_COLUMNS` by default; missing values empty)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: fmt(row.get(k)) for k in columns})
    return path


def read_csv(path: str | Path) -> list[dict]:
    """The rows of a results CSV, numeric cells as floats (empty ones None), the text columns as strings."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for k, v in row.items():
            if k in ("workload", "method", "dense_ref", "model_shape", "device", "dtype", "error"):
                continue
            try:
                row[k] = float(v) if v != "" else None
            except ValueError:
                pass
    return rows


def markdown_table(rows: list[dict], columns: Sequence[str] | None = None) -> str:
    """Rows as a GitHub markdown table."""
    columns = list(columns or [
        "workload", "method", "n_tokens", "n_tree_tokens", "ideal_ratio", "tokens_per_s", "speedup_vs_dense",
        "dense_ref", "speedup_vs_sparse", "fraction_of_ideal", "peak_mem_mb", "mem_vs_dense",
    ])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for c in columns:
            v = row.get(c)
            if isinstance(v, float) and c in ("n_tokens", "n_tree_tokens", "n_sequences"):
                v = int(v)
            elif isinstance(v, float):
                v = f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
            cells.append("" if v is None else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
