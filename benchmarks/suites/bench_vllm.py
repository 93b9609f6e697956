"""Generation with vLLM vs transformers under the DTA trainers: seconds of generation and of the whole step, per
optimizer step, for the GRPO recipe (`recipes/grpo.py`) at its defaults.

Each run is the recipe as a user starts it, in a process of its own, `--use_vllm true` (TRL's colocated engine, with
the CPU settings of `trl_dta/trainers/vllm_cpu.py` on a CPU) or `--use_vllm false` (transformers' `generate`); the
figures are the recipe summary's means over the logged steps (TRL's `step_time` and trl-dta's `generation_time`).
Both runs train the same model: the embedded tiny model with 2 attention heads (head size 32), since vLLM's CPU
attention has no head size 16 (the recipe's default 4 heads); `--model_name_or_path` and any other recipe argument
pass through after `--`.

```
python -m benchmarks.suites.bench_vllm                          # this CPU: 20 steps each, the recipe's defaults
python -m benchmarks.suites.bench_vllm --steps 20 --tag gpu -- --use_cpu false    # the GPU check (CUDA vLLM installed)
```

Writes `benchmarks/results/vllm-grpo[-TAG].csv` (one row per generation backend) and `.png`. The engine's start
(7-20 s here) is not in the per-step figures; the first step (the engine's warm-up, the first weight sync) is.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..reporting.results import RESULTS_DIR

ROOT = Path(__file__).resolve().parents[2]  # the repository
RECIPE = ROOT / "recipes" / "grpo.py"
FIELDS = ["workload", "generation", "device", "steps", "generation_s", "step_s", "training_s", "wall_s",
          "compression_ratio", "reward_first", "reward_last", "command"]
BACKENDS = {"vllm": ["--use_vllm", "true"], "transformers": ["--use_vllm", "false"]}
SPLIT = re.compile(r"time per step: ([\d.]+) s = generation ([\d.]+) s \+ scoring ([\d.]+) s \+ training ([\d.]+) s")
WALL = re.compile(r"wall time: ([\d.]+) s")
REWARD = re.compile(r"reward: mean of first \d+ logged steps ([-\d.]+) -> last \d+ logged steps ([-\d.]+)")
RATIO = re.compile(r"DTA: compression ratio ([\d.]+)x")


def _device(extra: list[str]) -> str:
    """`cuda` when the passed-through arguments say `--use_cpu false`, else `cpu` (the recipe's default config)."""
    pairs = list(zip(extra, extra[1:]))
    return "cuda" if ("--use_cpu", "false") in pairs else "cpu"


def run_recipe(generation: str, steps: int, extra: list[str], output_dir: Path) -> dict:
    """One recipe run; the summary's figures as a CSV row."""
    command = [sys.executable, str(RECIPE), *BACKENDS[generation], "--max_steps", str(steps),
               "--tiny_num_attention_heads", "2", "--output_dir", str(output_dir), *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    out = result.stdout
    step, gen, _, training = (float(x) for x in SPLIT.search(out).groups())
    first, last = (float(x) for x in REWARD.search(out).groups())
    ratio = RATIO.search(out)
    return {"workload": "grpo-recipe", "generation": generation, "device": _device(extra),
            "steps": steps, "generation_s": gen, "step_s": step, "training_s": training,
            "wall_s": float(WALL.search(out).group(1)), "compression_ratio": float(ratio.group(1)) if ratio else "",
            "reward_first": first, "reward_last": last,
            "command": " ".join(["python", "recipes/grpo.py", *command[2:]]).replace(str(output_dir), "OUT")}


def plot(rows: list[dict], path: Path) -> None:
    """Generation and the rest of the step, seconds per step, one bar per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = [row["generation"] for row in rows]
    gen = [row["generation_s"] for row in rows]
    rest = [row["step_s"] - row["generation_s"] for row in rows]
    ax.bar(names, gen, label="generation")
    ax.bar(names, rest, bottom=gen, label="scoring + training")
    ax.set_ylabel("seconds per optimizer step")
    ax.set_title(f"GRPO recipe, {rows[0]['steps']} steps ({rows[0]['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (the recipe's default: 100)")
    parser.add_argument("--generation", default="vllm,transformers", help="backends, comma-separated")
    parser.add_argument("--tag", default="", help="suffix of the result files (e.g. gpu)")
    args = parser.parse_args(argv)
    unknown = set(args.generation.split(",")) - set(BACKENDS)
    if unknown:
        parser.exit(2, f"unknown --generation {sorted(unknown)}; choose from {sorted(BACKENDS)}\n")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for generation in args.generation.split(","):
            start = time.perf_counter()
            rows.append(run_recipe(generation, args.steps, extra, Path(tmp) / generation))
            print(f"{generation}: {rows[-1]['generation_s']:.3f} s generation, {rows[-1]['step_s']:.3f} s per step "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    stem = RESULTS_DIR / f"vllm-grpo{'-' + args.tag if args.tag else ''}"
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, stem.with_suffix(".png"))
    return rows


if __name__ == "__main__":
    main()
