"""Tree rollouts vs independent sampling: one GRPO step (generation + training) at the same number of completions
and the same token budget.

Each workload of the GRPO grid (`benchmarks/workloads/batches.py`: prompts of `P` random tokens, `G` completions per
prompt, `max_completion_length = R`) trains real `DTAGRPOTrainer` steps with real generation from a model with random
weights (so completions mostly run to the `R`-token budget), by three methods:

- `trl`: independent sampling (TRL's `generate`) and TRL's dense training (`dta_enabled=False`): what a TRL user runs;
- `independent`: independent sampling, DTA training (the prompt shared in training only);
- `tree`: tree rollouts (`dta_tree_branching`, segments of `R / depth` tokens, e.g. `[2, 2, 2]` for `G = 8`) and DTA
  training: shared segments generated once and trained once.

A step's generation time is the time spent in `_generate_single_turn`; its training time is the rest of the optimizer
step (scoring, the loss, backward, the optimizer). Reported per run: completion tokens generated (`gen_tokens`) vs the
same leaves sampled independently (`gen_tokens_independent`), the training forest's compression
(`forest_compression`, DTA's `dta/compression_ratio`), times, and the ratios against `independent` and `trl` measured
in the same run. One warm-up step, then `--steps` timed steps (the fastest is reported).

```
python -m benchmarks.suites.bench_tree_rollouts --quick     # tiny and bench-cpu-quick models, GRPO grid at 1/8 scale
python -m benchmarks.suites.bench_tree_rollouts --shapes bench-cpu --scale 0.25
```

Writes `benchmarks/results/tree-rollouts[-quick].csv`, `.png` (generation and training seconds per method) and `.md`.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path

import torch

from trl_dta.flops import MODEL_SHAPES

from .. import workloads
from ..harness.cli import log, set_threads
from ..harness.models import build_model
from ..reporting.results import RESULTS_DIR, write_csv

METHODS = ("trl", "independent", "tree")
# children per level by group size: binary splits, the last level taking what is left
BRANCHING = {4: [2, 2], 8: [2, 2, 2], 16: [2, 2, 4]}
COLUMNS = [
    "workload", "model_shape", "method", "branching", "segment_length", "prompt_len", "group", "max_completion_length",
    "n_prompts", "gen_tokens", "gen_tokens_independent", "gen_compression", "train_tokens", "forest_compression",
    "gen_s", "train_s", "step_s", "gen_speedup_vs_independent", "train_speedup_vs_independent",
    "step_speedup_vs_independent", "step_speedup_vs_trl", "reward", "loadavg",
]


def tiny_shape():
    """The tests' model size (2 layers of width 64) with the workloads' vocabulary."""
    from trl_dta.flops import ModelShape

    return ModelShape(64, 128, 2, 4, 2, 16, 4096, name="tiny")


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer over `t0 .. t{V-1}` (ids 0-2: pad, bos, eos), so that random token ids are text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   padding_side="left")


def reward(completions, completion_ids, **kwargs):
    """Deterministic, with spread: the fraction of a completion's tokens in the lower half of the vocabulary."""
    return [sum(t < 2048 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def measure(workload: workloads.Workload, prompt_len: int, group: int, completion_len: int, method: str, shape,
            steps: int, n_prompts: int, seed: int = 0) -> dict:
    """Train `1 + steps` optimizer steps of `n_prompts` prompts each (one micro-batch per prompt group) and time
    them."""
    from datasets import Dataset

    from trl_dta import DTAGRPOConfig, DTAGRPOTrainer

    from .trainer_steps import step_timer

    shape_name = shape if isinstance(shape, str) else shape.name
    model = build_model(shape, torch.float32, "cpu", seed=seed)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    tokenizer = word_tokenizer(model.config.vocab_size)
    prompts = [" ".join(f"t{int(t)}" for t in workload.seqs[g * group][:prompt_len])
               for g in range(len(workload.seqs) // group)]
    rows = [prompts[i % len(prompts)] for i in range(n_prompts * (1 + steps))]
    branching = BRANCHING[group]
    segment = completion_len // len(branching)
    tree = dict(dta_tree_branching=branching, dta_tree_segment_length=segment) if method == "tree" else {}
    gen_times: list[float] = []

    class Timed(DTAGRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            start = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            gen_times.append(time.perf_counter() - start)
            return out

    timer = step_timer("cpu")
    with tempfile.TemporaryDirectory() as out:
        config = DTAGRPOConfig(
            output_dir=out, per_device_train_batch_size=group, gradient_accumulation_steps=n_prompts,
            steps_per_generation=n_prompts, num_generations=group, max_completion_length=completion_len,
            max_steps=1 + steps, learning_rate=1e-6, bf16=False, use_cpu=True, report_to="none", logging_steps=1,
            save_strategy="no", disable_dropout=True, gradient_checkpointing=False, dta_min_compression=0.0,
            dta_enabled=method != "trl", seed=seed, shuffle_dataset=False, **tree,
        )
        trainer = Timed(model=model, reward_funcs=reward, args=config,
                        train_dataset=Dataset.from_dict({"prompt": rows}), processing_class=tokenizer,
                        callbacks=[timer])
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry][1:]  # the timed steps
    best = min(range(steps), key=lambda k: timer.times[1 + k])
    log, step_s, gen_s = logs[best], timer.times[1 + best], gen_times[1 + best]
    lengths = log["completions/mean_length"] * n_prompts * group
    return {
        "workload": workload.name, "model_shape": shape_name, "method": method,
        "branching": "x".join(map(str, branching)) if tree else "", "segment_length": segment if tree else None,
        "prompt_len": prompt_len, "group": group, "max_completion_length": completion_len, "n_prompts": n_prompts,
        "gen_tokens": log.get("dta/generated_tokens", lengths),
        "gen_tokens_independent": log.get("dta/generated_tokens_independent", lengths),
        "gen_compression": log.get("dta/generation_compression", 1.0),
        "train_tokens": n_prompts * group * prompt_len + lengths,
        "forest_compression": log.get("dta/compression_ratio"),
        "gen_s": gen_s, "train_s": step_s - gen_s, "step_s": step_s, "reward": log["reward"],
        "loadavg": os.getloadavg()[0],
    }


def fill_ratios(rows: list[dict]) -> list[dict]:
    """Speed-ups against `independent` (generation, training, step) and `trl` (step) on the same workload and model."""
    ref = {(r["workload"], r["model_shape"], r["method"]): r for r in rows}
    for r in rows:
        ind = ref.get((r["workload"], r["model_shape"], "independent"))
        trl = ref.get((r["workload"], r["model_shape"], "trl"))
        for key in ("gen", "train", "step"):
            r[f"{key}_speedup_vs_independent"] = ind[f"{key}_s"] / r[f"{key}_s"] if ind else None
        r["step_speedup_vs_trl"] = trl["step_s"] / r["step_s"] if trl else None
    return rows


def write(rows: list[dict], stem: str) -> None:
    path = write_csv(rows, RESULTS_DIR / f"{stem}.csv", COLUMNS)
    shown = COLUMNS[:3] + COLUMNS[9:12] + COLUMNS[13:]  # the markdown table: three significant digits
    table = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    table += ["| " + " | ".join(_fmt(r.get(k)) for k in shown) + " |" for r in rows]
    (RESULTS_DIR / f"{stem}.md").write_text("\n".join(table) + "\n")
    plot(rows, RESULTS_DIR / f"{stem}.png")
    log(f"wrote {path} (+ .md, .png)")


def _fmt(value) -> str:
    """A markdown cell: floats to three significant digits, NaN and None empty."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def plot(rows: list[dict], png: Path) -> None:
    """Stacked bars: generation and training seconds of one step, per workload/model and method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["workload"], r["model_shape"]) for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(cases) + 2), 4.5))
    for m, method in enumerate(methods):
        xs, gen, train = [], [], []
        for c, case in enumerate(cases):
            for r in rows:
                if (r["workload"], r["model_shape"]) == case and r["method"] == method:
                    xs.append(c + (m - (len(methods) - 1) / 2) * width)
                    gen.append(r["gen_s"])
                    train.append(r["train_s"])
        bars = ax.bar(xs, gen, width, label=f"{method}: generation")
        ax.bar(xs, train, width, bottom=gen, label=f"{method}: training", color=bars.patches[0].get_facecolor(),
               alpha=0.45)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"{w}\n{s}" for w, s in cases], fontsize=7)
    ax.set_ylabel("seconds per optimizer step")
    ax.set_title("tree rollouts vs independent sampling (solid: generation, light: training)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="GRPO grid at 1/8 scale, tiny and bench-cpu-quick models")
    parser.add_argument("--scale", type=float, default=None, help="length scale of the GRPO grid (default 1/8 quick)")
    parser.add_argument("--shapes", nargs="+", default=None, choices=["tiny", *MODEL_SHAPES],
                        help="model shapes (`tiny` or trl_dta.flops names)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step")
    parser.add_argument("--steps", type=int, default=1, help="timed steps after one warm-up step")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a shared, loaded CPU more threads contend and run far slower)")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    scale = args.scale if args.scale is not None else 0.125
    shapes = args.shapes or ["tiny", "bench-cpu-quick"]
    rows = []
    for p, g, c in workloads.GRPO_GRID:
        workload = workloads.grpo(p, g, c, scale=scale, n_prompts=args.prompts)
        prompt_len, completion_len = workload.params["prompt_len"], workload.params["completion_len"]
        for shape in shapes:
            for method in args.methods:
                row = measure(workload, prompt_len, g, completion_len, method,
                              tiny_shape() if shape == "tiny" else shape, args.steps, args.prompts)
                log(f"{workload.name} {row['model_shape']} {method}: gen {row['gen_s']:.2f}s train "
                           f"{row['train_s']:.2f}s gen tokens {row['gen_tokens']:.0f}/"
                           f"{row['gen_tokens_independent']:.0f} forest {row['forest_compression']}")
                rows.append(row)
    stem = "tree-rollouts-quick" if args.quick or args.scale is None else f"tree-rollouts-s{scale:g}"
    write(fill_ratios(rows), stem)


if __name__ == "__main__":
    main()
