"""Two GRPO recipe runs side by side (with DTA, and TRL's dense path with `--dta_enabled false`): every logged step as
one CSV, and a plot of both runs' answer reward and policy entropy per step, their held-out greedy accuracy before and
after training, and where a step's time went.

    python recipes/grpo.py --model_name_or_path smollm2-135m-instruct --output_dir outputs/grpo-smollm2
    python recipes/grpo.py --model_name_or_path smollm2-135m-instruct --dta_enabled false \\
        --output_dir outputs/grpo-smollm2-dense
    python benchmarks/reporting/grpo_runs.py outputs/grpo-smollm2 outputs/grpo-smollm2-dense \\
        --out benchmarks/results/grpo-smollm2

Reads each run's `trainer_state.json` and `summary.json` (the recipe writes both into `output_dir`; the dense run may
be left out); writes `<out>.csv` (columns `CSV_COLUMNS`, one row per run and logged step; `heldout_before` and
`heldout_after` repeat the run's held-out accuracy on each of its rows) and `<out>.png`.
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
    "entropy": "entropy",
}
CSV_COLUMNS = ["run", "step", *METRICS, "training_time", "heldout_before", "heldout_after"]


def read_steps(output_dir: Path, run: str) -> list[dict]:
    """One row per logged step of a recipe run (`CSV_COLUMNS`; a metric the run did not log is empty)."""
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    summary = output_dir / "summary.json"
    heldout = json.loads(summary.read_text()).get("heldout_accuracy") if summary.is_file() else None
    before, after = heldout if heldout else (None, None)
    rows = []
    for entry in history:
        if "reward" not in entry:
            continue
        row = {"run": run, "step": entry["step"], **{column: entry.get(key) for column, key in METRICS.items()},
               "heldout_before": before, "heldout_after": after}
        if None not in (row["step_time"], row["generation_time"], row["scoring_time"]):
            row["training_time"] = row["step_time"] - row["generation_time"] - row["scoring_time"]
        rows.append(row)
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Per run: the answer reward per step with the held-out greedy accuracy before and after training as two
    points (left), the policy's entropy per step (middle), mean seconds per step split into generation, scoring,
    training (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(dict.fromkeys(row["run"] for row in rows))
    fig, (curve, entropy, split) = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw={"width_ratios": [2, 1.3, 1]})
    for k, run in enumerate(runs):
        mine = [row for row in rows if row["run"] == run]
        steps = [r["step"] for r in mine]
        color = f"C{k}"
        style = {"marker": "." if k == 0 else "x", "linestyle": "-" if k == 0 else "--", "color": color}
        key = "answer_reward" if mine[0]["answer_reward"] is not None else "reward"
        curve.plot(steps, [r[key] for r in mine], label=f"{run}: {key} (sampled, per step)", **style)
        if mine[0]["heldout_before"] is not None:
            curve.plot([0, steps[-1]], [mine[0]["heldout_before"], mine[0]["heldout_after"]], marker="o",
                       markersize=8, linestyle=":", color=color, label=f"{run}: held-out greedy accuracy")
        if mine[0]["entropy"] is not None:
            entropy.plot(steps, [r["entropy"] for r in mine], label=run, **style)
    curve.set_xlabel("optimizer step")
    curve.set_ylabel("answer reward / accuracy")
    curve.set_ylim(0, 1.05)
    curve.set_title(title, fontsize=10)
    curve.legend(fontsize=8)
    curve.grid(alpha=0.3)
    entropy.set_xlabel("optimizer step")
    entropy.set_ylabel("nats per completion token")
    entropy.set_title("policy entropy (sampled completions)", fontsize=10)
    entropy.set_ylim(bottom=0)
    entropy.legend(fontsize=8)
    entropy.grid(alpha=0.3)
    bottom = [0.0] * len(runs)
    for phase in ("generation_time", "scoring_time", "training_time"):
        means = []
        for run in runs:
            values = [row[phase] for row in rows if row["run"] == run and row.get(phase) is not None]
            means.append(sum(values) / len(values) if values else 0.0)
        split.bar(runs, means, bottom=bottom, label=phase.removesuffix("_time"))
        bottom = [b + m for b, m in zip(bottom, means, strict=True)]
    split.set_ylabel("seconds per step (mean)")
    split.set_title("where a step's time went", fontsize=10)
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
