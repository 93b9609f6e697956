"""Console entry point `trl-dta`.

`trl-dta analyze` tells, before any training, how much prefix sharing a set of rollouts holds and what DTA would gain
on it:

```
trl-dta analyze rollouts.jsonl                                   # JSONL rows with `input_ids`
trl-dta analyze rollouts.jsonl --prompt-field prompt_ids --completion-field completion_ids
trl-dta analyze chats.jsonl --text-field text --tokenizer Qwen/Qwen3-1.7B
trl-dta analyze ./saved_dataset --split train --batch-size 512 --num-processes 8 --model-shape qwen3-1.7b
trl-dta analyze conversations.jsonl --tokenizer Qwen/Qwen3-1.7B                  # rows with `messages`
trl-dta analyze episodes.jsonl --layout per_turn                                # rows with `turns` + `roles`
trl-dta analyze tau2_results.json --tokenizer ./chat-tokenizer                  # a `tau2 run` results file
trl-dta analyze outputs/ --tokenizer Qwen/Qwen3-1.7B         # TRL's completion logs (GRPOConfig log_completions=True)
```

Input formats: JSONL (one JSON object per line), a dataset folder (`save_to_disk`) or name, TRL's completion logs (the
`completions_*.parquet` files `log_completions=True` writes: one file, the `completions/` folder or the output folder
holding it; needs pyarrow, which `datasets` installs; text, so `--tokenizer` is the trainer's; prompts tokenized as TRL
does, conversational ones through the chat template; `trl_dta.analysis.trl_logs` says what a log cannot give back, e.g.
a completion's end-of-sequence token), and a tau2-bench results file (`*.json`, the object `tau2 run` writes: tau2's
`Results`, validated by tau2 itself; needs `trl-dta[tau2]`; one conversation per simulation, tau2's system prompt and
the domain's tool schemas added, the trials of a task grouped, tau2's fixed first agent message kept as context but not
a policy turn). `--tokenizer` takes a folder (e.g. one written by
`trl_dta.envs.core.chat.build_chat_tokenizer().save_pretrained(...)`, the offline byte-level tokenizer with TRL's
Qwen2.5 chat template) or a hub name (cached, or online).

Rows are read in order and cut into global batches of `--batch-size` sequences (what one optimizer step sees), or by the
`step` column of TRL's completion logs; when neither gives the batches, all rows form one batch, which compresses more
than training sees, and a warning names `--batch-size`. For each batch the prefix tree is built; the table reports
totals over batches, each batch's (step's) compression and their mean, and the ideal FLOP speed-up (`trl_dta.flops`:
dense FLOPs over tree FLOPs, forward + backward, for `--model-shape`).

Conversations (rows with `messages`, rendered by the `--tokenizer`'s chat template, or `turns` of token ids with `roles`
or an `assistant_mask`; `trl_dta.analysis.rollout_io`) are analyzed in the training layouts of `dta_sample_layout`
(`--layout`, default both): `episode`, one sequence per conversation, and `per_turn`, one sequence per assistant turn
holding the conversation up to and including that turn. `--batch-size`, `--group-field` and `--num-processes` count
conversations (the trainers' generation batch holds episodes; each rank trains the turns of its own episodes), so the
balance rows are the same in both layouts, and the peak memory is that of each rank's rows in the layout.

The *predicted* DTA speed-up is `ideal x f`: `f` (`--fraction-of-ideal`, default 0.8) is the fraction of the ideal FLOP
speed-up that DTA reaches over TRL's dense path. The measured fractions, per workload and device, are the
`fraction_of_ideal` column of `benchmarks/RESULTS.md`; they depend on the hardware and on the batch (lowest when a tree
has many short segments), so the default is a conservative guess, not a measurement. It folds in what the FLOP count
leaves out (per-forward overhead, sibling padding, small matmuls). Measure with `python -m
benchmarks.suites.bench_engine` on your hardware and pass the fraction you see. The prediction is never below 1x: the
DTA trainers run batches that compress less than `dta_min_compression` through TRL's dense path.

With `--num-processes K` each batch is split across `K` ranks exactly as the DTA trainers split a generation batch
(`trl_dta.balance.partition_for_ranks`: the same number of rows per rank, whole groups, costs from a `CostModel` with
the hidden size of `--model-shape`). Groups are the `--group-field` labels, else (for prompt + completion input) the
rows with the same prompt; `--no-groups` lets rows move singly. Every batch must split into `K` equal parts, and the
groups into whole groups per rank. The table adds the most loaded rank's share, the imbalance (max / mean forest
cost) and the fraction of the single-forest compression that survives the split.

The table ends with the estimated peak memory of a DTA training step per attention backend, above the weights,
gradients and optimizer state (`trl_dta.memory.peak_memory`, for `--model-shape` in `--dtype`, the worst batch, or the
worst rank's forest with `--num-processes`): the path's keys/values, the kept graph, the largest forward, and for
`sdpa` the copies of the path's keys/values that a batch of sibling rows saves (one per row per layer), which the
two-part backends avoid. The engine budgets are the DTA trainers' defaults under TRL's default
`gradient_checkpointing=True` (`--max-graph-tokens 1024`, `--max-batch-tokens 8192`); `--max-graph-tokens none`
keeps every graph.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ._checks import check_float, check_int
from .analysis import SourceOptions, analyze_source
from .analysis.analyzer import DEFAULT_FRACTION_OF_IDEAL, DEFAULT_MAX_GRAPH_TOKENS
from .batch import SAMPLE_LAYOUTS

__all__ = ["format_table", "main"]


# ------------------------------------------------------------------------------------------------------ the table


def format_table(result: dict) -> str:
    """The analysis as an aligned two-column text table."""
    rows = [
        ("batches", f"{result['batches']}"),
        ("sequences", f"{result['sequences']}"),
        ("tokens", f"{result['tokens']:,}"),
        ("tree tokens", f"{result['tree_tokens']:,}"),
        (_compression_label(result), f"{result['compression_ratio']:.2f}x"),
        *_per_batch_rows(result),
        ("sequence length (mean / max)", f"{result['mean_len']:.0f} / {result['max_len']}"),
        ("tree depth (segments)", f"{result['max_segments_depth']}"),
        (f"ideal FLOP speed-up ({result['model_shape']})", f"{result['ideal_speedup']:.2f}x"),
        (f"predicted DTA speed-up (x {result['fraction_of_ideal']:.2f} of ideal)",
         f"{result['predicted_speedup']:.2f}x"),
    ]
    bal = result.get("balance")
    if bal is not None:
        k = result["num_processes"]
        unit = "whole groups" if bal["whole_groups"] else "single rows"
        rows += [
            (f"per-rank balance ({k} processes, {unit}): max / mean cost",
             f"{bal['imbalance']:.3f} (worst batch {bal['worst_imbalance']:.3f})"),
            ("  most loaded rank's share of the work", f"{bal['max_share']:.1%} (ideal {1 / k:.1%})"),
            ("  compression kept after the split", f"{bal['compression_kept']:.1%}"),
        ]
    memory = result.get("peak_memory") or {}
    if memory:
        where = "worst rank" if result.get("num_processes") else "worst batch"
        rows.append((f"peak memory per step ({result['dtype']}, {where})", "above weights and optimizer"))
        for backend, m in memory.items():
            rows.append((f"  {backend}", f"{_gb(m['total'])}  (path K/V {_gb(m['path_kv'])}, kept graph "
                         f"{_gb(m['path_graph'])}, forward of {m['rows']} x {m['row_tokens'] // max(m['rows'], 1)} "
                         f"tokens {_gb(m['batch_activations'])}, path copies {_gb(m['prefix_copies'])})"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# Batches listed one by one in the table (--json lists all).
_LISTED_BATCHES = 10


def _compression_label(result: dict) -> str:
    if result["batches_known"] or result["sequences"] < 2:
        return "compression ratio (all batches)" if result["batches"] > 1 else "compression ratio"
    return "compression ratio (all rows as one batch)"


def _per_batch_rows(result: dict) -> list[tuple[str, str]]:
    """The per-batch compression: the mean, min and max, and the first batches one by one."""
    batches = result["per_batch"]
    if len(batches) < 2:
        return []
    ratios = [b["compression_ratio"] for b in batches]
    unit = "step" if batches[0]["step"] is not None else "batch"
    rows = [(f"compression per {unit}: mean (min / max)",
             f"{result['mean_batch_compression']:.2f}x ({min(ratios):.2f}x / {max(ratios):.2f}x)")]
    for b in batches[:_LISTED_BATCHES]:
        rows.append((f"  {unit} {b[unit]}", f"{b['compression_ratio']:.2f}x  ({b['sequences']} sequences, "
                     f"{b['tokens']:,} tokens -> {b['tree_tokens']:,})"))
    if len(batches) > _LISTED_BATCHES:
        rows.append((f"  ... {len(batches) - _LISTED_BATCHES} more", "(--json lists all)"))
    return rows


# What one training row of a conversation is, per layout.
_LAYOUT_ROWS = {"episode": "one sequence per conversation", "per_turn": "one sequence per assistant turn"}


def _gb(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.2f} GB"




# ------------------------------------------------------------------------------------------------------ CLI


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (`trl-dta analyze: error: ...`) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    """An argparse type: a positive integer (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _fraction(text: str) -> float:
    """An argparse type for --fraction-of-ideal: a finite number > 0."""
    try:
        return check_float("fraction_of_ideal", float(text), minimum=0.0, exclusive=True)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}") from None


def _graph_budget(text: str) -> int | None:
    """An argparse type: an integer >= 0, or `none` (no budget)."""
    if text.lower() == "none":
        return None
    try:
        return check_int("max_graph_tokens", int(text), minimum=0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 or 'none', got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="trl-dta", description="Dynamic Tree Attention for TRL: tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("analyze", help="prefix sharing and predicted DTA speed-up of a set of rollouts",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="JSONL file, dataset folder (save_to_disk), dataset name, a tau2-bench results "
                   "file (*.json from `tau2 run`), or TRL's completion logs (a .parquet file, the completions/ folder "
                   "or the output folder holding it)")
    p.add_argument("--field", default=None, help="token-id field (default: input_ids, else prompt_ids+completion_ids)")
    p.add_argument("--prompt-field", default=None, help="token-id field of the prompt (with --completion-field)")
    p.add_argument("--completion-field", default=None, help="token-id field of the completion")
    p.add_argument("--text-field", default=None, help="text field (with --tokenizer; default: text, else "
                   "prompt+completion)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or hub name for text input, and whose chat "
                   "template renders 'messages' (offline: a folder, e.g. build_chat_tokenizer().save_pretrained(DIR))")
    p.add_argument("--layout", default=None, choices=[*SAMPLE_LAYOUTS, "both"],
                   help="training layout(s) of conversations (default: both)")
    p.add_argument("--split", default=None, help="dataset split")
    p.add_argument("--group-field", default=None, help="per-row group label kept on one rank (default: the prompt "
                   "for prompt + completion input)")
    p.add_argument("--no-groups", action="store_true", help="balance single rows (no group is kept whole)")
    p.add_argument("--batch-size", type=_positive_int, default=None,
                   help="sequences per global batch, one optimizer step's (default: TRL's `step` column, else all rows "
                   "as one batch, with a warning)")
    p.add_argument("--num-processes", type=_positive_int, default=None,
                   help="ranks to balance each batch over, as the DTA trainers do")
    p.add_argument("--model-shape", default="qwen3-1.7b",
                   help="model for FLOP counts and the balance cost model: a name (qwen3-1.7b, qwen2-0.5b, bench-cpu, "
                   "...) or a config path")
    p.add_argument("--fraction-of-ideal", type=_fraction, default=DEFAULT_FRACTION_OF_IDEAL,
                   help="fraction of the ideal speed-up DTA reaches (measured values: benchmarks/RESULTS.md)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32", "fp64"],
                   help="compute dtype of the peak-memory estimate")
    p.add_argument("--max-batch-tokens", type=_positive_int, default=8192,
                   help="the engine's sibling-batch budget, for the peak-memory estimate")
    p.add_argument("--max-graph-tokens", type=_graph_budget, default=DEFAULT_MAX_GRAPH_TOKENS,
                   help="the engine's kept-graph budget, for the peak-memory estimate ('none' keeps every graph)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`trl-dta` console entry point; returns the exit code (2 on bad input, with a one-line message)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a malformed flag (2, after a one-line message)
        return int(e.code or 0)
    options = SourceOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SourceOptions)})
    try:
        analysis = analyze_source(
            args.source, options, model_shape=args.model_shape, batch_size=args.batch_size,
            num_processes=args.num_processes, fraction_of_ideal=args.fraction_of_ideal, dtype=args.dtype,
            max_batch_tokens=args.max_batch_tokens, max_graph_tokens=args.max_graph_tokens,
        )
    except (ValueError, TypeError, OSError) as e:
        message = " ".join(str(e).split())
        print(f"trl-dta analyze: error: {message}", file=sys.stderr)
        return 2
    for note in analysis.notes:
        print(note, file=sys.stderr)
    for warning in analysis.warnings:
        print(f"trl-dta analyze: warning: {warning}", file=sys.stderr)
    results = analysis.results
    if None in results:  # sequences: one result
        print(json.dumps(results[None], indent=2) if args.json else format_table(results[None]))
    elif args.json:  # conversations: one result per layout
        print(json.dumps(results, indent=2))
    else:
        print("\n\n".join(f"layout: {layout} ({_LAYOUT_ROWS[layout]})\n{format_table(result)}"
                          for layout, result in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
