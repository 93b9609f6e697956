"""Reward curves of `recipes/agent.py` runs as CSV and PNG: one row per logged step from each run's
`log_history.json` (written to its `--output_dir`), or from the console's `step k/n  reward r ...` lines of a run
that has none (runs before the recipe wrote it).

    python -m benchmarks.reporting.agent_curves --name agent-smollm2 \\
        standin=outputs/agent-standin mock=outputs/agent-mock standin-log=run.log

Writes `benchmarks/results/<name>.csv` (run, step, reward, each `rewards/<f>/mean`, step time and its split) and
`<name>.png` (reward per step, one panel per run, the reward components where logged).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
_CONSOLE = re.compile(r"step +(\d+)/\d+ +reward ([\d.]+) +compression ([\d.]+)x +step ([\d.]+) s")
SPLIT = {"step_s": "step_time", "generation_s": "dta/rollout_generation_s", "env_s": "dta/rollout_env_s",
         "reward_s": "dta/rollout_reward_s", "dta_train_s": "dta/step_time"}


def read_run(source: Path) -> list[dict]:
    """The logged steps of one run: `log_history.json` of an output folder, or a console log's step lines."""
    if source.is_dir():
        rows = []
        for entry in json.loads((source / "log_history.json").read_text()):
            if "reward" not in entry:
                continue
            row = {"step": entry.get("step"), "reward": entry["reward"]}
            row.update({key[len("rewards/"):-len("/mean")]: value for key, value in entry.items()
                        if key.startswith("rewards/") and key.endswith("/mean")})
            row.update({key: entry.get(metric) for key, metric in SPLIT.items()})
            row["compression_ratio"] = entry.get("dta/compression_ratio")
            rows.append(row)
        return rows
    return [{"step": int(m[1]), "reward": float(m[2]), "compression_ratio": float(m[3]), "step_s": float(m[4])}
            for m in _CONSOLE.finditer(source.read_text(errors="replace"))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="label=path (an output folder with log_history.json, or a log)")
    parser.add_argument("--name", default="agent-smollm2")
    args = parser.parse_args(argv)
    runs = {label: read_run(Path(path)) for label, _, path in (run.partition("=") for run in args.runs)}
    columns = ["run"] + list(dict.fromkeys(key for rows in runs.values() for row in rows for key in row))
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / f"{args.name}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        for label, rows in runs.items():
            for row in rows:
                writer.writerow({"run": label, **row})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(max(6.5, 5 * len(runs)), 3.8), squeeze=False)
    for ax, (label, rows) in zip(axes[0], runs.items()):
        steps = [row["step"] for row in rows]
        ax.plot(steps, [row["reward"] for row in rows], "k-o", label="reward (weighted)")
        for key in ("format_reward", "tool_reward", "arguments_reward", "outcome_reward"):
            if any(key in row for row in rows):
                ax.plot(steps, [row.get(key) for row in rows], "--", marker=".", label=key)
        ax.set_title(label)
        ax.set_xlabel("optimizer step")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("mean reward")
    fig.suptitle("recipes/agent.py, SmolLM2-135M-Instruct (LoRA), 2-core CPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.name}.png", dpi=110)


if __name__ == "__main__":
    main()
