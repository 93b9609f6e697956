"""Two GRPO recipe runs side by side (with DTA, and TRL's dense path with `--dta_enabled false`): every logged step as
one CSV, and a plot of both reward curves and of where a step's time went.

    python recipes/grpo.py --model_name_or_path smollm2-135m-instruct --output_dir outputs/grpo-smollm2
    python recipes/grpo.py --model_name_or_path smollm2-135m-instruct --dta_enabled false \\
        --output_dir outputs/grpo-smollm2-dense
    python benchmarks/reporting/grpo_runs.py outputs/grpo-smollm2 outputs/grpo-smollm2-dense \\
        --out benchmarks/results/grpo-smollm2

Reads each run's `trainer_state.json` (the recipe writes it into `output_dir`; the dense run may be left out);
writes `<out>.csv` (columns `CSV_COLUMNS`, one row per run and logged step) and `<out>.png`.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

# CSV column -> logged metric (TRL's names; `training_time` is `step_time` less generation and scoring).
METRICS = {
    "reward": "reward",
    "answer_reward": "rewards/answer_reward/mean",
    "number_format_reward": "rewards/number_format_reward/mean",
    "step_time": "step_time",
    "generation_time": "generation_time",
    "scoring_time": "scoring_time",
    "dta_engine_time": "dta/step_time",
    "compression_ratio": "dta/compression_ratio",
    "completion_length": "completions/mean_length",
}
CSV_COLUMNS = ["run", "step", *METRICS, "training_time"]


def read_steps(output_dir: Path, run: str) -> list[dict]:
    """One row per logged step of a recipe run (`CSV_COLUMNS`; a metric the run did not log is empty)."""
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    rows = []
    for entry in history:
        if "reward" not in entry:
            continue
        row = {"run": run, "step": entry["step"], **{column: entry.get(key) for column, key in METRICS.items()}}
        if None not in (row["step_time"], row["generation_time"], row["scoring_time"]):
            row["training_time"] = row["step_time"] - row["generation_time"] - row["scoring_time"]
        rows.append(row)
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Reward per step of each run (left); mean seconds per step split into generation, scoring, training (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(dict.fromkeys(row["run"] for row in rows))
    fig, (curve, split) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for run in runs:
        mine = [row for row in rows if row["run"] == run]
        curve.plot([r["step"] for r in mine], [r["reward"] for r in mine], marker=".", label=f"{run}: reward")
        for part, style in (("number_format_reward", "--"), ("answer_reward", ":")):
            if mine[0][part] is not None:
                curve.plot([r["step"] for r in mine], [r[part] for r in mine], linestyle=style, label=f"{run}: {part}")
    curve.set_xlabel("optimizer step")
    curve.set_ylabel("mean reward")
    curve.set_title(title)
    curve.legend(fontsize=8)
    curve.grid(alpha=0.3)
    bottom = [0.0] * len(runs)
    for phase in ("generation_time", "scoring_time", "training_time"):
        means = []
        for run in runs:
            values = [row[phase] for row in rows if row["run"] == run and row.get(phase) is not None]
            means.append(sum(values) / len(values) if values else 0.0)
        split.bar(runs, means, bottom=bottom, label=phase.removesuffix("_time"))
        bottom = [b + m for b, m in zip(bottom, means, strict=True)]
    split.set_ylabel("seconds per step (mean)")
    split.set_title("where a step's time went")
    split.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dta_dir", type=Path, help="output_dir of the run with DTA")
    parser.add_argument("dense_dir", type=Path, nargs="?", help="output_dir of the run with --dta_enabled false")
    parser.add_argument("--out", type=Path, required=True, help="path without suffix of the CSV and PNG to write")
    parser.add_argument("--title", default="GRPO, SmolLM2-135M-Instruct + LoRA, word problems (CPU)")
    args = parser.parse_args(argv)
    rows = read_steps(args.dta_dir, "DTA") + (read_steps(args.dense_dir, "TRL dense") if args.dense_dir else [])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out.with_suffix(".png"), args.title)


if __name__ == "__main__":
    main()
