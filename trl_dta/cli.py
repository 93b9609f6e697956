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
```

Input formats: JSONL (one JSON object per line), a dataset folder (`save_to_disk`) or name, and a tau2-bench results
file (`*.json`, the object `tau2 run` writes: tau2's `Results`, validated by tau2 itself; needs `trl-dta[tau2]`; one
conversation per simulation, tau2's system prompt and the domain's tool schemas added, the trials of a task grouped,
tau2's fixed first agent message kept as context but not a policy turn). `--tokenizer` takes a folder (e.g. one
written by `trl_dta.envs.chat.build_chat_tokenizer().save_pretrained(...)`, the offline byte-level tokenizer with
TRL's Qwen2.5 chat template) or a hub name (cached, or online).

Rows are read in order and cut into global batches of `--batch-size` sequences (what one optimizer step sees; default:
all rows form one batch). For each batch the prefix tree is built; the table reports totals over batches and the
ideal FLOP speed-up (`trl_dta.flops`: dense FLOPs over tree FLOPs, forward + backward, for `--model-shape`).

Conversations (rows with `messages`, rendered by the `--tokenizer`'s chat template, or `turns` of token ids with
`roles` or an `assistant_mask`; `trl_dta.rollout_io`) are analyzed in the training layouts of `dta_sample_layout`
(`--layout`, default both): `episode`, one sequence per conversation, and `per_turn`, one sequence per assistant turn
holding the conversation up to and including that turn. `--batch-size`, `--group-field` and `--num-processes` count
conversations (the trainers' generation batch holds episodes; each rank trains the turns of its own episodes), so
the balance rows are the same in both layouts, and the peak memory is that of each rank's rows in the layout.

The *predicted* DTA speed-up is `ideal x f`: `f` (`--fraction-of-ideal`, default 0.8) is the fraction of the ideal
FLOP speed-up that DTA reaches over TRL's dense path. The measured fractions, per workload and device, are the
`fraction_of_ideal` column of `benchmarks/RESULTS.md`; they depend on the hardware and on the batch (lowest when a
tree has many short segments), so the default is a conservative guess, not a measurement. It folds in what the FLOP
count leaves out (per-forward overhead, sibling padding, small matmuls). Measure with `python -m
benchmarks.bench_engine` on your hardware and pass the fraction you see. The prediction is never below 1x: the DTA
trainers run batches that compress less than `dta_min_compression` through TRL's dense path.

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
import json
import sys
from pathlib import Path

import numpy as np

from ._checks import check_float, check_int
from .rollout_io import (
    LAYOUTS,
    AnalysisError,
    is_conversation_source,
    is_tau2_source,
    layout_rows,
    load_conversations,
    load_sequences,
)

__all__ = ["AnalysisError", "analyze", "format_table", "main"]

# Fraction of the ideal FLOP speed-up assumed for `trl-dta analyze`'s predicted speed-up when none is given: a
# conservative guess below the measured `fraction_of_ideal` values of benchmarks/RESULTS.md; override with
# --fraction-of-ideal.
DEFAULT_FRACTION_OF_IDEAL = 0.8

# The DTA trainers' kept-graph budget under TRL's default `gradient_checkpointing=True` (`dta_max_graph_tokens`
# becomes `dta_block_size`, 1024): the budget of the peak-memory estimate unless one is given.
DEFAULT_MAX_GRAPH_TOKENS = 1024


# ------------------------------------------------------------------------------------------------------ analysis


def analyze(
    seqs,
    model_shape="qwen3-1.7b",
    batch_size: int | None = None,
    num_processes: int | None = None,
    groups=None,
    fraction_of_ideal: float = DEFAULT_FRACTION_OF_IDEAL,
    dtype: str = "bf16",
    max_batch_tokens: int = 8192,
    max_graph_tokens: int | None = DEFAULT_MAX_GRAPH_TOKENS,
    rows: list | None = None,
) -> dict:
    """Prefix-sharing statistics of rollouts and the speed-ups DTA can give on them.

    Args:
        seqs (`list[list[int]]`): the rollouts, in order (lists of token ids or 1-D integer tensors; not empty).
        model_shape (`str`, `ModelShape` or a config, *optional*, defaults to `"qwen3-1.7b"`): for the FLOP counts
            and the balance cost model's hidden size (a name, a [`~trl_dta.flops.ModelShape`] or a `transformers`
            config).
        batch_size (`int`, *optional*): sequences per global batch (default: one batch of all).
        num_processes (`int`, *optional*): ranks to balance each batch over, as the DTA trainers do
            ([`~trl_dta.balance.partition_for_ranks`]); it must divide the size of every batch.
        groups (sequence of `int` or `str`, *optional*): a group label per sequence; groups are dealt out whole, so
            all groups of a batch must have one size `G` with `batch / num_processes` a multiple of `G`.
        fraction_of_ideal (`float`, *optional*, defaults to `0.8`): see the module docstring.
        dtype (`str`, *optional*, defaults to `"bf16"`): compute dtype of the peak-memory estimate (`fp32`, `bf16`,
            `fp16`, `fp64`).
        max_batch_tokens (`int`, *optional*, defaults to `8192`): the engine's sibling-batch budget, for the estimate.
        max_graph_tokens (`int`, *optional*, defaults to `1024`): the engine's kept-graph budget, for the estimate
            (None keeps every graph).
        rows (`list[list[list[int]]]`, *optional*): the training rows each sequence becomes, e.g. the per-turn rows
            of a conversation ([`~trl_dta.rollout_io.layout_rows`]); default: the sequence itself. Batches, groups and
            the rank split count sequences (conversations, as the trainers' generation batch counts episodes, and
            each rank trains the rows of its own conversations); tokens, trees, FLOPs and memory are the rows'.

    Returns:
        `dict` of the table's values (`balance` is `None` without `num_processes`, or a dict of its row;
        `peak_memory` maps each attention backend to its [`~trl_dta.memory.MemoryEstimate`] fields and `total`, in
        bytes, at the worst batch or rank).

    Raises:
        [`AnalysisError`] (a `ValueError`) or `TypeError`: on a bad argument, naming it and the fix.
    """
    from .balance import CostModel
    from .balance.partition import check_group_ids
    from .flops import dense_flops, tree_flops
    from .memory import DTYPE_BYTES
    from .tree import PrefixTree

    shape = _model_shape(model_shape)
    if not isinstance(seqs, list):  # any iterable: checked by the tree (which names a bad sequence), read once
        seqs = PrefixTree.from_sequences(seqs).seqs
    if not seqs:
        raise AnalysisError("`seqs` is empty: there is nothing to analyze")
    size = check_int("batch_size", batch_size, minimum=1, allow_none=True) or len(seqs)
    k = check_int("num_processes", num_processes, minimum=1, allow_none=True)
    fraction_of_ideal = check_float("fraction_of_ideal", fraction_of_ideal, minimum=0.0, exclusive=True)
    if dtype not in DTYPE_BYTES:
        raise AnalysisError(f"unknown `dtype` (--dtype) {dtype!r}: choose one of {sorted(DTYPE_BYTES)}")
    budgets = dict(max_batch_tokens=check_int("max_batch_tokens", max_batch_tokens, minimum=1),
                   max_graph_tokens=check_int("max_graph_tokens", max_graph_tokens, minimum=0, allow_none=True))
    batches = [(start, min(start + size, len(seqs))) for start in range(0, len(seqs), size)]
    labels = check_group_ids(groups, len(seqs), name="groups")
    if rows is not None and (not isinstance(rows, list) or len(rows) != len(seqs)):
        raise ValueError(f"`rows` must be a list with the training rows of each of the {len(seqs)} sequences, got "
                         f"{len(rows) if isinstance(rows, list) else type(rows).__name__}")

    def training_rows(indices) -> list:
        return [seqs[j] for j in indices] if rows is None else [row for j in indices for row in rows[j]]

    if k is not None:
        _check_splittable(batches, k, labels)
    cost_model = CostModel(hidden_size=shape.hidden_size)
    totals = dict(batches=0, sequences=0, tokens=0, tree_tokens=0, max_len=0, max_segments_depth=0,
                  dense_flops=0.0, tree_flops=0.0)
    balance = dict(max_share=[], imbalance=[], compression_kept=[])
    memory: dict = {}
    for i, (start, end) in enumerate(batches):
        episodes = _batch_tree(seqs, start, end, i)
        tree = episodes if rows is None else PrefixTree.from_sequences(training_rows(range(start, end)))
        totals["batches"] += 1
        totals["sequences"] += tree.n_sequences
        totals["tokens"] += tree.n_tokens
        totals["tree_tokens"] += tree.n_tree_tokens
        totals["max_len"] = max(totals["max_len"], tree.max_path_len)
        totals["max_segments_depth"] = max(totals["max_segments_depth"], tree.depth)
        totals["dense_flops"] += dense_flops(tree.lengths, shape).total
        totals["tree_flops"] += tree_flops(tree, shape).total
        forests = [tree]
        if k is not None:
            parts = _balance(episodes, k, None if labels is None else labels[start:end], cost_model, balance)
            forests = [PrefixTree.from_sequences(training_rows(start + j for j in part)) for part in parts]
        for forest in forests:
            _peak_memory(forest, shape, dtype, budgets, memory)
    if not totals["sequences"]:
        raise AnalysisError("`rows` holds no training row: there is nothing to analyze")
    ideal = totals["dense_flops"] / totals["tree_flops"] if totals["tree_flops"] else 1.0
    result = {
        **totals,
        "mean_len": totals["tokens"] / totals["sequences"],
        "compression_ratio": totals["tokens"] / totals["tree_tokens"] if totals["tree_tokens"] else 1.0,
        "model_shape": shape.name,
        "ideal_speedup": ideal,
        "fraction_of_ideal": fraction_of_ideal,
        # the trainers send batches that compress less than `dta_min_compression` down TRL's dense path: never < 1x
        "predicted_speedup": max(ideal * fraction_of_ideal, 1.0),
        "num_processes": k,
        "balance": None,
        "dtype": dtype,
        "peak_memory": memory,
    }
    if k is not None:
        n = len(balance["imbalance"])
        result["balance"] = {
            "imbalance": sum(balance["imbalance"]) / n,
            "worst_imbalance": max(balance["imbalance"]),
            "max_share": sum(balance["max_share"]) / n,
            "compression_kept": sum(balance["compression_kept"]) / n,
            "whole_groups": labels is not None,
            "hidden_size": cost_model.hidden_size,
        }
    return result


def _batch_tree(seqs: list, start: int, end: int, i: int):
    """The prefix tree of `seqs[start:end]`; a bad sequence's error says where the batch starts."""
    from .tree import PrefixTree

    try:
        return PrefixTree.from_sequences(seqs[start:end])
    except (TypeError, ValueError) as e:
        if start == 0:
            raise
        raise type(e)(f"{e} (batch {i}: `seqs[{start}:{end}]`; the index counts from the batch start)") from None


def _model_shape(model_shape):
    """The `ModelShape` of a name, a config path, a `ModelShape` or a config; errors name `model_shape` and the
    choices."""
    from .flops import MODEL_SHAPES, ModelShape, get_model_shape

    if isinstance(model_shape, str) and model_shape.lower() not in MODEL_SHAPES:
        path = Path(model_shape)
        if not path.exists():
            raise AnalysisError(f"unknown `model_shape` (--model-shape) {model_shape!r}: choose one of "
                                f"{sorted(MODEL_SHAPES)} or give a config path")
        from transformers import AutoConfig

        return ModelShape.from_config(AutoConfig.from_pretrained(model_shape), name=path.name or model_shape)
    if not isinstance(model_shape, (str, ModelShape)) and not hasattr(model_shape, "hidden_size"):
        raise TypeError(
            f"`model_shape` must be a name in {sorted(MODEL_SHAPES)}, a `ModelShape` or a `transformers` config, got "
            f"{type(model_shape).__name__}"
        )
    return get_model_shape(model_shape)


def _check_splittable(batches: list[tuple[int, int]], k: int, labels) -> None:
    """Refuse batches the trainers could not split: every rank gets the same number of rows, groups whole."""
    for i, (start, end) in enumerate(batches):
        rows = end - start
        if rows % k:
            raise AnalysisError(
                f"batch {i} has {rows} sequences, not a multiple of `num_processes` (--num-processes) = {k}: the DTA "
                "trainers give every rank the same number of rows. Choose a batch size (--batch-size) that is a "
                f"multiple of {k} and divides the number of sequences"
            )
        if labels is None:
            continue
        sizes = sorted(set(np.unique(labels[start:end], return_counts=True)[1].tolist()))
        if len(sizes) > 1 or (rows // k) % sizes[0]:
            raise AnalysisError(
                f"batch {i}: groups of sizes {sizes} cannot be dealt out whole with {rows // k} rows per rank, as the "
                "DTA trainers do (one group size G, rows per rank a multiple of G). Choose a batch size that is a "
                "multiple of num_processes x G, or balance single rows (--no-groups, or `groups=None`)"
            )


def _balance(tree, k: int, groups, cost_model, acc: dict) -> list[list[int]]:
    """Split one batch as the trainers do; add its statistics to `acc` and return each rank's batch indices."""
    from .balance import partition_for_ranks

    part = partition_for_ranks(tree, k, group_ids=groups, cost_model=cost_model)
    total = sum(part.costs)
    acc["imbalance"].append(part.imbalance)
    acc["max_share"].append(part.max_cost / total if total else 0.0)
    acc["compression_kept"].append(part.compression_kept)
    return part.parts


def _peak_memory(forest, shape, dtype: str, budgets: dict, acc: dict) -> None:
    """Keep, per attention backend, the estimate of the forest with the largest peak so far."""
    from dataclasses import asdict

    from .memory import ATTN_BACKENDS, peak_memory

    for backend in ATTN_BACKENDS:
        estimate = peak_memory(forest, shape, backend, dtype, **budgets)
        if backend not in acc or estimate.total > acc[backend]["total"]:
            acc[backend] = {**asdict(estimate), "total": estimate.total}


def format_table(result: dict) -> str:
    """The analysis as an aligned two-column text table."""
    rows = [
        ("batches", f"{result['batches']}"),
        ("sequences", f"{result['sequences']}"),
        ("tokens", f"{result['tokens']:,}"),
        ("tree tokens", f"{result['tree_tokens']:,}"),
        ("compression ratio", f"{result['compression_ratio']:.2f}x"),
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
    p.add_argument("source", help="JSONL file, dataset folder (save_to_disk), dataset name, or a tau2-bench results "
                   "file (*.json from `tau2 run`)")
    p.add_argument("--field", default=None, help="token-id field (default: input_ids, else prompt_ids+completion_ids)")
    p.add_argument("--prompt-field", default=None, help="token-id field of the prompt (with --completion-field)")
    p.add_argument("--completion-field", default=None, help="token-id field of the completion")
    p.add_argument("--text-field", default=None, help="text field (with --tokenizer; default: text, else "
                   "prompt+completion)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or hub name for text input, and whose chat "
                   "template renders 'messages' (offline: a folder, e.g. build_chat_tokenizer().save_pretrained(DIR))")
    p.add_argument("--layout", default=None, choices=[*LAYOUTS, "both"],
                   help="training layout(s) of conversations (default: both)")
    p.add_argument("--split", default=None, help="dataset split")
    p.add_argument("--group-field", default=None, help="per-row group label kept on one rank (default: the prompt "
                   "for prompt + completion input)")
    p.add_argument("--no-groups", action="store_true", help="balance single rows (no group is kept whole)")
    p.add_argument("--batch-size", type=_positive_int, default=None,
                   help="sequences per global batch (default: all)")
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


def _load(args) -> tuple[list, list | None, dict]:
    """The sequences of `args.source`, their group labels, and per layout the training rows of each sequence
    (`{None: None}` for sequences, which train as themselves)."""
    sequence_flags = (args.field, args.prompt_field, args.completion_field, args.text_field)
    if all(flag is None for flag in sequence_flags) and is_conversation_source(args.source, args.split):
        group_field = args.group_field
        if is_tau2_source(args.source):
            from .envs.tau2.results import describe

            print(describe(args.source), file=sys.stderr)
            if group_field is None and not args.no_groups:
                group_field = "task_id"  # the trials of a tau2 task
        conversations, groups = load_conversations(args.source, args.tokenizer, args.split, group_field)
        layouts = LAYOUTS if args.layout in (None, "both") else (args.layout,)
        rows = {layout: None if layout == "episode" else [layout_rows(ids, mask, layout) for ids, mask in conversations]
                for layout in layouts}
        return [ids for ids, _ in conversations], groups, rows
    if args.layout is not None:
        raise AnalysisError("--layout applies to conversations (rows with 'messages' or 'turns'); this source holds "
                            "sequences")
    seqs, groups = load_sequences(
        args.source, field=args.field, prompt_field=args.prompt_field, completion_field=args.completion_field,
        text_field=args.text_field, tokenizer=args.tokenizer, split=args.split, group_field=args.group_field,
    )
    return seqs, groups, {None: None}


def main(argv: list[str] | None = None) -> int:
    """`trl-dta` console entry point; returns the exit code (2 on bad input, with a one-line message)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a malformed flag (2, after a one-line message)
        return int(e.code or 0)
    try:
        if args.no_groups and args.group_field is not None:
            raise AnalysisError("--no-groups and --group-field contradict each other; give one")
        seqs, groups, layouts = _load(args)
        results = {
            layout: analyze(seqs, args.model_shape, args.batch_size, args.num_processes,
                            None if args.no_groups else groups, args.fraction_of_ideal, dtype=args.dtype,
                            max_batch_tokens=args.max_batch_tokens, max_graph_tokens=args.max_graph_tokens, rows=rows)
            for layout, rows in layouts.items()
        }
    except (ValueError, TypeError, OSError) as e:
        message = " ".join(str(e).split())
        print(f"trl-dta analyze: error: {message}", file=sys.stderr)
        return 2
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
