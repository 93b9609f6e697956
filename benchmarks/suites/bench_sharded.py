"""DTA under FSDP2 against TRL's dense path under FSDP2: collectives and time per optimizer step (2 CPU processes).

One `accelerate launch` (FSDP2: `fsdp_version: 2`, transformer-layer auto wrap) of the distributed test script
(`tests/trainers/dist_run.py`, which makes FSDP2 real on CPU and asserts DTensor parameters) trains, one after the
other on the same fixed global batch: TRL's `GRPOTrainer` (`dense`), `DTAGRPOTrainer` with its defaults (`dta`: the
`"window"` schedule, model gathered for the step; small subtrees packed into rows, few engine calls), with every segment
its own engine call (`dta-walk`: `dta_max_pack_tokens=0`, many forward/backward calls per step), and with the
per-layer schedule (`dta-layer`: `dta_fsdp_schedule="layer"`, decoder layers gathered inside every forward and
backward, engine calls in lockstep; `dta-layer-small`: the same with batches of at most 48 padded tokens, several
per step and unequal across ranks, so that one rank runs idle batches). The script counts FSDP2's all-gathers and
reduce-scatters inside the optimizer steps (generation and scoring excluded) and TRL logs each step's time.

    python -m benchmarks.suites.bench_sharded            # writes results/sharded.{csv,png}

The model: a random-weight Qwen2, `--layers` decoder layers of width `--hidden`, untied embeddings, so FSDP2 holds
`layers + 2` parameter groups (each layer, the embeddings, the `[final norm, LM head]` tail; the root holds none).
"""

from __future__ import annotations

import argparse
import csv
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..reporting.results import RESULTS_DIR

ROOT = Path(__file__).resolve().parents[2]  # the repository
SCRIPT = ROOT / "tests" / "trainers" / "dist_run.py"
COLUMNS = ["method", "layers", "fsdp_groups", "steps", "all_gathers_per_step", "reduce_scatters_per_step",
           "batches_per_step", "idle_batches_per_step", "step_s", "step_s_ratio_vs_dense", "loadavg"]
METHODS = {"trl": "dense", "dta": "dta", "dta_walk": "dta-walk", "dta_layer": "dta-layer",
           "dta_layer_small": "dta-layer-small"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_model_dir(path: Path, layers: int, hidden: int) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "trainers"))
    sys.path.insert(1, str(ROOT / "tests"))  # `bounds`, which the trainers' conftest imports
    from conftest import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    build_model(len(tokenizer), num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                num_attention_heads=4, num_key_value_heads=2).save_pretrained(path)
    tokenizer.save_pretrained(path)


def run(layers: int, hidden: int, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build_model_dir(tmp / "model", layers, hidden)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version=2",
               "--fsdp_auto_wrap_policy=TRANSFORMER_BASED_WRAP", "--fsdp_state_dict_type=FULL_STATE_DICT",
               "--fsdp_reshard_after_forward=true", "--num_processes=2", "--num_machines=1", "--mixed_precision=no",
               "--dynamo_backend=no", f"--main_process_port={free_port()}", str(SCRIPT), f"--out={tmp / 'run.pt'}",
               "--processes=2", f"--model_dir={tmp / 'model'}", f"--variants={','.join(METHODS)}", "--expect=fsdp2",
               "--trainer=grpo", f"--steps={steps}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        runs = {v: torch.load(tmp / f"run-{v}.pt") for v in METHODS}
    rows = []
    for variant, method in METHODS.items():
        counts, logs = runs[variant]["collectives"], runs[variant]["logs"]
        times = [log["step_time"] for log in logs[1:]]  # the first step pays one-off set-up
        calls = [c for c in runs[variant]["engine_calls"][0] if c["train"]]  # rank 0's training engine calls
        rows.append({
            "method": method, "layers": layers, "fsdp_groups": counts["groups"], "steps": steps,
            "all_gathers_per_step": counts["all_gather"] / steps,
            "reduce_scatters_per_step": counts["reduce_scatter"] / steps,
            "batches_per_step": sum(c["forwards"] for c in calls) / steps,
            "idle_batches_per_step": sum(c["idle_batches"] for rank in runs[variant]["engine_calls"] for c in rank
                                         if c["train"]) / steps,
            "step_s": sum(times) / len(times), "loadavg": os.getloadavg()[0],
        })
    dense = rows[0]["step_s"]
    for row in rows:
        row["step_s_ratio_vs_dense"] = row["step_s"] / dense
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4))
    labels = [f"{r['method']}\nL={r['layers']}" for r in rows]
    x = range(len(rows))
    axes[0].bar([i - 0.2 for i in x], [r["all_gathers_per_step"] for r in rows], 0.4, label="all-gathers")
    axes[0].bar([i + 0.2 for i in x], [r["reduce_scatters_per_step"] for r in rows], 0.4, label="reduce-scatters")
    axes[0].set_ylabel("collectives per optimizer step")
    axes[0].legend()
    axes[1].bar(list(x), [r["step_s"] for r in rows])
    axes[1].set_ylabel("seconds per optimizer step")
    for ax in axes:
        ax.set_xticks(list(x), labels, fontsize=7, rotation=45)
    fig.suptitle("FSDP2, 2 CPU processes: TRL dense vs DTA (window and per-layer schedules)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--name", default="sharded")
    args = parser.parse_args()
    rows = [row for layers in args.layers for row in run(layers, args.hidden, args.steps)]
    RESULTS_DIR.mkdir(exist_ok=True)
    with open(RESULTS_DIR / f"{args.name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, RESULTS_DIR / f"{args.name}.png")
    for row in rows:
        print(", ".join(f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}" for k in COLUMNS))


if __name__ == "__main__":
    main()
