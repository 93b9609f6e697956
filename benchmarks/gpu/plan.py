"""The GPU check's plan: what each measuring step runs (methods, workloads, models, precision), the CSV schema of its
rows and the files they go to. `bench.py` measures it and `summary.py` checks a run against it; both import this
module, neither the other.
"""

from __future__ import annotations

import csv
from pathlib import Path

from trl_dta.flops import ModelShape, get_model_shape

from .. import workloads
from ..reporting.results import fmt, read_csv

METHODS = ("dense-ckpt", "dta-torch", "dta-triton", "trl-tree", "sparse-flex", "dense")
ORACLE_CHECKED = ("trl-tree", "sparse-flex")  # the DTA backends are checked by the correctness step
BACKEND_OF = {"dta-torch": "torch", "dta-triton": "triton", "dta-flash": "flash"}
WORKLOADS = ("tau2-airline", "grpo-p1024-g16-c256")
TRAINER_METHODS = ("trl+ckpt", "dta+ckpt")
PREFIX_METHODS = ("dta-sdpa", "dta-torch", "dta-triton")
PRECISION = "bf16-autocast"
STEPS = 2  # timed steps per workload, the same for every method

COLUMNS = ["step", "workload", "method", "model_shape", "precision", "device", "n_sequences", "n_tokens",
           "n_tree_tokens", "compression_ratio", "ideal_ratio", "warmup_s", "step_s", "median_step_s", "steps",
           "tokens_per_s", "vs_dense_ckpt", "vs_trl_tree", "vs_sparse", "vs_dense", "vs_trl", "peak_mem_mb",
           "mem_vs_dense_ckpt", "mem_vs_trl", "mem_vs_first", "loss", "micro_batches", "forwards", "forward_tokens",
           "padded_tokens", "attention",
           "oracle_ok", "oracle_err", "checked", "description", "error"]
# The dry run's model: the real model's name with a `dry-` prefix, tiny dimensions.
DRY_DIMS = dict(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                vocab_size=512)


def shape_of(name: str, dry_run: bool) -> ModelShape:
    """The model shape a step runs: the named one, or in a dry run a tiny one named `dry-<name>`."""
    if not dry_run:
        return get_model_shape(name)
    d = DRY_DIMS
    return ModelShape(d["hidden_size"], d["intermediate_size"], d["num_layers"], d["num_heads"], d["num_kv_heads"],
                      d["head_dim"], d["vocab_size"], name=f"dry-{name}")


def grid_workloads(dry_run: bool, vocab_size: int) -> list[workloads.Workload]:
    """`WORKLOADS` at the GPU sizes (tau2: 1 task x 4 episodes, 36 per-turn rows, ~205K tokens, 24x; GRPO: 16 x
    1,280 tokens, 4x), or the dry run's (tau2: 2 episodes, 3 turns each, a 48-token shared prefix; GRPO at 1/32)."""
    if dry_run:
        return [workloads.tau2_airline(1, 2, vocab_size, prefix_tokens=48, max_turns=3),
                workloads.grpo(1024, 16, 256, scale=1 / 32, vocab_size=vocab_size)]
    return [workloads.tau2_airline(1, 4, vocab_size), workloads.grpo(1024, 16, 256, vocab_size=vocab_size)]


def prefix_workloads(dry_run: bool, vocab_size: int) -> list[workloads.Workload]:
    """One long prompt with 4 / 32 / 128 completions of 32 tokens (the dry run: 128 tokens, 2 / 8 completions of 4)."""
    prompt, completion, siblings = (128, 4, (2, 8)) if dry_run else (4096, 32, (4, 32, 128))
    out = []
    for n in siblings:
        w = workloads.grpo(prompt, n, completion, vocab_size=vocab_size)
        w.name = f"prefix-p{prompt}-g{n}-c{completion}"
        out.append(w)
    return out


def append_row(path: Path, row: dict) -> None:
    """Append one row (`COLUMNS`, missing values empty) to `path`, writing the header first for a new file."""
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow({k: fmt(row.get(k)) for k in COLUMNS})


def read_rows(path: Path) -> list[dict]:
    """The rows of a step's CSV (none for a missing file)."""
    return read_csv(path) if path.exists() else []


def _ratio(a, b):
    return a / b if a and b else None


def fill_ratios(row: dict, done: list[dict]) -> dict:
    """The row's ratios against the reference rows among `done` of its step, workload and model (the latest, after
    a rerun)."""
    def ref(method):
        return next((r for r in reversed(done) if r["method"] == method and r["workload"] == row["workload"]
                     and r["model_shape"] == row["model_shape"] and r.get("tokens_per_s")), None)

    for key, method in (("vs_dense_ckpt", "dense-ckpt"), ("vs_trl_tree", "trl-tree"), ("vs_sparse", "sparse-flex"),
                        ("vs_dense", "dense"), ("vs_trl", "trl+ckpt")):
        other = ref(method)
        row[key] = _ratio(row.get("tokens_per_s"), other and other["tokens_per_s"])
    for key, method in (("mem_vs_dense_ckpt", "dense-ckpt"), ("mem_vs_trl", "trl+ckpt")):
        other = ref(method)
        row[key] = _ratio(row.get("peak_mem_mb"), other and other.get("peak_mem_mb"))
    if row.get("step") == "prefix-memory":  # over the same method's run at the fewest siblings
        first = next((r for r in done if r["method"] == row["method"] and r["model_shape"] == row["model_shape"]
                      and r.get("peak_mem_mb")), None)
        row["mem_vs_first"] = _ratio(row.get("peak_mem_mb"), first and first["peak_mem_mb"]) if first else 1.0
    return row


FILE_OF = {"throughput": "throughput.csv", "trainer": "trainer.csv", "prefix-memory": "prefix_memory.csv"}


def planned(step: str, dry_run: bool) -> tuple[list[str], tuple[str, ...]]:
    """The workloads and methods a step measures."""
    if step == "throughput":
        return list(WORKLOADS), METHODS
    if step == "trainer":
        return [WORKLOADS[1]], TRAINER_METHODS
    return [w.name for w in prefix_workloads(dry_run, DRY_DIMS["vocab_size"])], PREFIX_METHODS
