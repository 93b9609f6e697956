"""The benchmarks' charts, drawn from their CSV files (`results.read_csv`) or rows: a separate step from measuring
(`python -m benchmarks.suites.run --plot <csv>` redraws one)."""

from __future__ import annotations

from pathlib import Path

from .results import read_csv


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(csv_path: str | Path, png_path: str | Path | None = None) -> Path:
    """Bar chart of tokens/s per workload and method (log scale), with the ideal speed-up marked over the fastest dense
    variant (`dense_ref`)."""
    plt = _pyplot()
    rows = [r for r in read_csv(csv_path) if r.get("tokens_per_s")]
    png_path = Path(png_path or Path(csv_path).with_suffix(".png"))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(workloads) + 2), 4.5))
    for m, method in enumerate(methods):
        xs, ys = [], []
        for w, workload in enumerate(workloads):
            for r in rows:
                if r["workload"] == workload and r["method"] == method:
                    xs.append(w + (m - (len(methods) - 1) / 2) * width)
                    ys.append(r["tokens_per_s"])
        ax.bar(xs, ys, width, label=method)
    for w, workload in enumerate(workloads):
        dense = [r for r in rows if r["workload"] == workload and r["method"] == (r.get("dense_ref") or "dense")]
        if dense and dense[0].get("ideal_ratio"):
            ideal = dense[0]["tokens_per_s"] * dense[0]["ideal_ratio"]
            ax.hlines(ideal, w - 0.45, w + 0.45, colors="black", linestyles="dashed")
    ax.set_yscale("log")
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("training tokens / s (rollout tokens)")
    ax.set_title(f"{Path(csv_path).stem}: dashed = fastest dense x ideal FLOP ratio")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def plot_prefix_memory(rows: list[dict], png_path) -> Path:
    """Peak memory above the model against the number of siblings, one line per method."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        points = [(r["n_sequences"], r["peak_mem_mb"]) for r in rows if r["method"] == method and r.get("peak_mem_mb")]
        ax.plot(*zip(*points), marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("siblings (completions of the one prompt)")
    ax.set_ylabel("peak memory above the model (MB)")
    ax.set_title(f"prefix memory: {rows[0]['model_shape']}, {rows[0]['device']}, {rows[0]['dtype']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return Path(png_path)


def plot_tau2_stats(rows: list[dict], png_path) -> Path:
    """The compression of each tau2 domain's gold-action episodes in the episode and per-turn layouts."""
    plt = _pyplot()
    names = [r["domain"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([i - 0.2 for i in x], [r["episode_compression"] for r in rows], 0.4, label="episode layout")
    ax.bar([i + 0.2 for i in x], [r["per_turn_compression"] for r in rows], 0.4, label="per-turn layout")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("tokens / tree tokens")
    ax.set_title(f"tau2 gold-action episodes, {rows[0]['tasks']} tasks x {rows[0]['group']} trials (DeepSeek BPE)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return Path(png_path)
