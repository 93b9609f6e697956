"""Peak memory per rank under DeepSpeed ZeRO-2 and ZeRO-3, TRL's dense path and DTA's schedules (2 CPU processes).

One `accelerate launch` per configuration (a process's peak resident set covers its whole life) of the distributed test
script (`tests/trainers/dist_run.py`: DeepSpeed made real on CPU, the same fixed global batch in every run, AdamW as in
TRL's defaults, float32) trains `--steps` GRPO steps of a random-weight Qwen2 (`--layers` layers of width `--hidden`,
`4 hidden` MLP, tied embeddings) with:

- `dense-zero2`, `dta-zero2`: TRL's `GRPOTrainer` and `DTAGRPOTrainer` under ZeRO-2 (`zero.Zero`: parameters
  replicated, the step's gradients local until one reduce-scatter);
- `dense-zero3`, `dta-zero3-window`: the same under ZeRO-3 (`zero3.Zero3`, the whole model gathered per engine call);
- `dta-zero3-layer`: ZeRO-3 with `dta_zero3_gather_budget_mb=0` (decoder layers gathered one at a time by DeepSpeed's
  hooks, their gradients reduce-scattered during each backward).

ZeRO-3 runs generate with `ds3_gather_for_generation=False` (TRL's option: generation gathers module by module), so that
the peak is the optimizer step's, not generation's whole-model gather. Each rank reports its resident set at the end of
the first optimizer step (DeepSpeed's engine and optimizer set up, its states allocated) and its peak over
the later steps (`steps_peak_mb`; Linux's high-water mark, reset then), the growth above the former (`steps_growth_mb`:
gathered parameters, gradients, buckets, activations), and the whole run's peak (`peak_mb`, DeepSpeed's set-up
included: under ZeRO-3 it gathers every trainable parameter once to register its gradient hooks).
On CPU the device memory is the resident set: every allocation of 128 KiB or more is its own mapping
(`MALLOC_MMAP_THRESHOLD_`), returned to the system when the tensor is freed, so that the resident set follows the live
tensors rather than what glibc's heap keeps after the repeated gathers and frees of ZeRO-3.

    python -m benchmarks.suites.bench_zero3             # writes results/zero3-memory.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..reporting.results import RESULTS_DIR
from .bench_sharded import ROOT, SCRIPT, free_port

COLUMNS = ["method", "stage", "layers", "hidden", "params_m", "steps", "steps_peak_mb_rank0", "steps_peak_mb_rank1",
           "steps_growth_mb_rank0", "steps_growth_mb_rank1", "peak_mb_rank0", "peak_mb_rank1", "step_s", "loadavg"]
# method -> (ZeRO stage, dist_run variant, extra dist_run arguments)
RUNS = {
    "dense-zero2": (2, "trl", []),
    "dta-zero2": (2, "dta", []),
    "dense-zero3": (3, "trl", ["--ds3_gather_for_generation=0"]),
    "dta-zero3-window": (3, "dta", ["--ds3_gather_for_generation=0"]),
    "dta-zero3-layer": (3, "dta_zero3_layer", ["--ds3_gather_for_generation=0"]),
}


def zero_config(hidden: int) -> dict:
    """DeepSpeed's bucket and persistence sizes as transformers fills their `"auto"` (and TRL sets them for its
    reference model), the same for both stages: without them ZeRO-2/3 take DeepSpeed's defaults (buckets of 5e8
    elements, parameters under 1e5 elements kept gathered), made for models far larger than this one."""
    return {"reduce_bucket_size": hidden * hidden, "allgather_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden}


def build_model_dir(path: Path, layers: int, hidden: int) -> int:
    """The model and tokenizer in `path`; returns its parameter count."""
    sys.path.insert(0, str(ROOT / "tests" / "trainers"))
    sys.path.insert(1, str(ROOT / "tests"))  # `bounds`, which the trainers' conftest imports
    from conftest import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), num_hidden_layers=layers, hidden_size=hidden, intermediate_size=4 * hidden,
                        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def run(method: str, model_dir: Path, tmp: Path, steps: int, zero_config: dict) -> dict:
    stage, variant, extra = RUNS[method]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", f"--zero_stage={stage}",
           "--zero3_init_flag=true", "--num_processes=2", "--num_machines=1", "--mixed_precision=no",
           "--dynamo_backend=no", f"--main_process_port={free_port()}", str(SCRIPT), f"--out={tmp / method}.pt",
           "--processes=2", f"--model_dir={model_dir}", f"--variants={variant}", "--expect=deepspeed", "--trainer=grpo",
           f"--steps={steps}", "--max_grad_norm=0", "--learning_rate=1e-4", "--optim=adamw_torch",
           f"--zero_config={json.dumps(zero_config)}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu",
           "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}  # freed tensors leave the resident set (no glibc retention)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    saved = torch.load(tmp / f"{method}-{variant}.pt")
    if saved["zero3"] is not None:  # the schedule that really ran
        assert saved["zero3"]["schedule"] == ("layer" if "layer" in method else "window"), saved["zero3"]["schedule"]
    memory, logs = saved["memory"], saved["logs"]
    times = [log["step_time"] for log in logs[1:]]  # the first step pays one-off set-up
    return {"method": method, "stage": stage, "steps": steps, "step_s": sum(times) / len(times),
            "loadavg": os.getloadavg()[0],
            **{f"steps_peak_mb_rank{r}": m["steps_peak_mb"] for r, m in enumerate(memory)},
            **{f"steps_growth_mb_rank{r}": m["steps_peak_mb"] - m["after_first_step_mb"] for r, m in enumerate(memory)},
            **{f"peak_mb_rank{r}": m["peak_mb"] for r, m in enumerate(memory)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--name", default="zero3-memory")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        params = build_model_dir(tmp / "model", args.layers, args.hidden)
        for method in args.methods:
            row = run(method, tmp / "model", tmp, args.steps, zero_config(args.hidden))
            rows.append({**row, "layers": args.layers, "hidden": args.hidden, "params_m": params / 1e6})
            print(", ".join(f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}" for k in row))
    RESULTS_DIR.mkdir(exist_ok=True)
    with open(RESULTS_DIR / f"{args.name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
