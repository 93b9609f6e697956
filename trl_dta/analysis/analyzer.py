"""The analyzer behind `trl-dta analyze`: prefix sharing of rollouts and what DTA would gain on them.

[`analyze`] takes token-id sequences and returns the table's values (compression, the ideal and predicted speed-ups, the
rank split, the peak memory of a training step); [`analyze_source`] reads a source first (`rollout_io.py`, TRL's
completion logs: `trl_logs.py`) and returns an [`Analysis`] (a result per training layout, the warnings to show);
`cli.py` parses the command line and formats it. The command's `--help` (the module docstring of `trl_dta.cli`) says
what each figure means.

The batches are what one optimizer step sees: each builds its own prefix tree. They come from `--batch-size`, or from
the source itself (the `step` column of TRL's completion logs); when neither gives them every row forms one batch, a
tree over all rows, which compresses more than training ever sees, so [`analyze_source`] warns and names
`--batch-size`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._checks import check_float, check_int
from ..batch import SAMPLE_LAYOUTS
from .rollout_io import (
    AnalysisError,
    is_conversation_source,
    is_tau2_source,
    layout_rows,
    load_conversations,
    load_sequences,
)
from .trl_logs import is_trl_log, load_trl_completions

__all__ = ["Analysis", "SourceOptions", "analyze", "analyze_source"]

# Fraction of the ideal FLOP speed-up assumed for `trl-dta analyze`'s predicted speed-up when none is given: a
# conservative guess below the measured `fraction_of_ideal` values of benchmarks/RESULTS.md; override with
# --fraction-of-ideal.
DEFAULT_FRACTION_OF_IDEAL = 0.8

# The DTA trainers' kept-graph budget under TRL's default `gradient_checkpointing=True` (`dta_max_graph_tokens`
# becomes `dta_block_size`, 1024): the budget of the peak-memory estimate unless one is given.
DEFAULT_MAX_GRAPH_TOKENS = 1024


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
    steps: list | None = None,
) -> dict:
    """Prefix-sharing statistics of rollouts and the speed-ups DTA can give on them.

    Args:
        seqs (`list[list[int]]`): the rollouts, in order (lists of token ids or 1-D integer tensors; not empty).
        model_shape (`str`, `ModelShape` or a config, *optional*, defaults to `"qwen3-1.7b"`): for the FLOP counts
            and the balance cost model's hidden size (a name, a [`~trl_dta.flops.ModelShape`] or a `transformers`
            config).
        batch_size (`int`, *optional*): sequences per global batch (default: the `steps`, else one batch of all).
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
        steps (`list[int]`, *optional*): each sequence's optimizer step (TRL's `step` column): a run of equal steps
            is one batch. Not with `batch_size`.

    Returns:
        `dict` of the table's values (`balance` is `None` without `num_processes`, or a dict of its row;
        `peak_memory` maps each attention backend to its [`~trl_dta.memory.MemoryEstimate`] fields and `total`, in
        bytes, at the worst batch or rank; `per_batch` lists each batch's index `batch`, `step` (or None),
        `sequences`, `tokens`, `tree_tokens` and `compression_ratio`, `mean_batch_compression` their mean;
        `batches_known` is false when all rows formed one batch by default).

    Raises:
        [`AnalysisError`] (a `ValueError`) or `TypeError`: on a bad argument, naming it and the fix.
    """
    from ..balance import CostModel
    from ..balance.partition import check_group_ids
    from ..memory import DTYPE_BYTES
    from ..tree import PrefixTree

    shape = _model_shape(model_shape)
    if not isinstance(seqs, list):  # any iterable: checked by the tree (which names a bad sequence), read once
        seqs = PrefixTree.from_sequences(seqs).seqs
    if not seqs:
        raise AnalysisError("`seqs` is empty: there is nothing to analyze")
    size = check_int("batch_size", batch_size, minimum=1, allow_none=True)
    k = check_int("num_processes", num_processes, minimum=1, allow_none=True)
    fraction_of_ideal = check_float("fraction_of_ideal", fraction_of_ideal, minimum=0.0, exclusive=True)
    if dtype not in DTYPE_BYTES:
        raise AnalysisError(f"unknown `dtype` (--dtype) {dtype!r}: choose one of {sorted(DTYPE_BYTES)}")
    budgets = dict(max_batch_tokens=check_int("max_batch_tokens", max_batch_tokens, minimum=1),
                   max_graph_tokens=check_int("max_graph_tokens", max_graph_tokens, minimum=0, allow_none=True))
    batches = _batches(len(seqs), size, steps)
    labels = check_group_ids(groups, len(seqs), name="groups")
    if rows is not None and (not isinstance(rows, list) or len(rows) != len(seqs)):
        raise ValueError(f"`rows` must be a list with the training rows of each of the {len(seqs)} sequences, got "
                         f"{len(rows) if isinstance(rows, list) else type(rows).__name__}")

    def training_rows(indices) -> list:
        return [seqs[j] for j in indices] if rows is None else [row for j in indices for row in rows[j]]

    if k is not None:
        _check_splittable(batches, k, labels)
    cost_model = CostModel(hidden_size=shape.hidden_size)
    balance = dict(max_share=[], imbalance=[], compression_kept=[])
    per_batch = []
    memory: dict = {}
    for i, (start, end) in enumerate(batches):
        episodes = _batch_tree(seqs, start, end, i)
        tree = episodes if rows is None else PrefixTree.from_sequences(training_rows(range(start, end)))
        per_batch.append(_tree_stats(tree, shape, i, None if steps is None else steps[start]))
        forests = [tree]
        if k is not None:
            parts = _balance(episodes, k, None if labels is None else labels[start:end], cost_model, balance)
            forests = [PrefixTree.from_sequences(training_rows(start + j for j in part)) for part in parts]
        for forest in forests:
            _peak_memory(forest, shape, dtype, budgets, memory)
    totals = _totals(per_batch)
    if not totals["sequences"]:
        raise AnalysisError("`rows` holds no training row: there is nothing to analyze")
    ideal = totals["dense_flops"] / totals["tree_flops"] if totals["tree_flops"] else 1.0
    result = {
        **totals,
        "mean_len": totals["tokens"] / totals["sequences"],
        "compression_ratio": totals["tokens"] / totals["tree_tokens"] if totals["tree_tokens"] else 1.0,
        "batches_known": size is not None or steps is not None,
        "per_batch": per_batch,
        "mean_batch_compression": sum(b["compression_ratio"] for b in per_batch) / len(per_batch),
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
        result["balance"] = _balance_summary(balance, labels is not None, cost_model.hidden_size)
    return result


def _tree_stats(tree, shape, i: int, step: int | None) -> dict:
    """Batch `i`'s row of `per_batch`: its tree's counts, compression and FLOPs (dense and tree)."""
    from ..flops import dense_flops, tree_flops

    return dict(batch=i, step=step, sequences=tree.n_sequences, tokens=tree.n_tokens, tree_tokens=tree.n_tree_tokens,
                compression_ratio=tree.compression_ratio, max_len=tree.max_path_len, depth=tree.depth,
                dense_flops=dense_flops(tree.lengths, shape).total, tree_flops=tree_flops(tree, shape).total)


def _totals(per_batch: list[dict]) -> dict:
    """The batches' counts and FLOPs summed in order, their lengths and depths' maximum."""
    totals = dict(batches=len(per_batch), sequences=0, tokens=0, tree_tokens=0, max_len=0, max_segments_depth=0,
                  dense_flops=0.0, tree_flops=0.0)
    for b in per_batch:
        for key in ("sequences", "tokens", "tree_tokens", "dense_flops", "tree_flops"):
            totals[key] += b[key]
        totals["max_len"] = max(totals["max_len"], b["max_len"])
        totals["max_segments_depth"] = max(totals["max_segments_depth"], b["depth"])
    return totals


def _balance_summary(balance: dict, whole_groups: bool, hidden_size: int) -> dict:
    """The balance row: each batch's split statistics averaged (the imbalance's worst kept too)."""
    n = len(balance["imbalance"])
    return {
        "imbalance": sum(balance["imbalance"]) / n,
        "worst_imbalance": max(balance["imbalance"]),
        "max_share": sum(balance["max_share"]) / n,
        "compression_kept": sum(balance["compression_kept"]) / n,
        "whole_groups": whole_groups,
        "hidden_size": hidden_size,
    }


def _batches(n: int, size: int | None, steps: list | None) -> list[tuple[int, int]]:
    """`(start, end)` of each batch: runs of `size` rows, runs of equal `steps`, or all `n` rows."""
    if steps is None:
        size = size or n
        return [(start, min(start + size, n)) for start in range(0, n, size)]
    if size is not None:
        raise AnalysisError("the source gives each row's optimizer step (TRL's `step` column), which cuts the batches; "
                            "drop `batch_size` (--batch-size)")
    if not isinstance(steps, list) or len(steps) != n:
        raise ValueError(f"`steps` must be a list with the step of each of the {n} sequences")
    bounds = [0, *(i for i in range(1, n) if steps[i] != steps[i - 1]), n]
    return list(zip(bounds, bounds[1:]))


def _batch_tree(seqs: list, start: int, end: int, i: int):
    """The prefix tree of `seqs[start:end]`; a bad sequence's error says where the batch starts."""
    from ..tree import PrefixTree

    try:
        return PrefixTree.from_sequences(seqs[start:end])
    except (TypeError, ValueError) as e:
        if start == 0:
            raise
        raise type(e)(f"{e} (batch {i}: `seqs[{start}:{end}]`; the index counts from the batch start)") from None


def _model_shape(model_shape):
    """The `ModelShape` of a name, a config path, a `ModelShape` or a config; errors name `model_shape` and the
    choices."""
    from ..flops import MODEL_SHAPES, ModelShape, get_model_shape

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
    from ..balance import partition_for_ranks

    part = partition_for_ranks(tree, k, group_ids=groups, cost_model=cost_model)
    total = sum(part.costs)
    acc["imbalance"].append(part.imbalance)
    acc["max_share"].append(part.max_cost / total if total else 0.0)
    acc["compression_kept"].append(part.compression_kept)
    return part.parts


def _peak_memory(forest, shape, dtype: str, budgets: dict, acc: dict) -> None:
    """Keep, per attention backend, the estimate of the forest with the largest peak so far."""
    from dataclasses import asdict

    from ..memory import ATTN_BACKENDS, peak_memory

    for backend in ATTN_BACKENDS:
        estimate = peak_memory(forest, shape, backend, dtype, **budgets)
        if backend not in acc or estimate.total > acc[backend]["total"]:
            acc[backend] = {**asdict(estimate), "total": estimate.total}


# ------------------------------------------------------------------------------------------------------ sources


@dataclass(frozen=True)
class SourceOptions:
    """How to read a source (the command's input flags; see [`~trl_dta.analysis.rollout_io.load_sequences`]).

    Args:
        field, prompt_field, completion_field, text_field (`str`, *optional*): the fields of sequences.
        tokenizer (`str`, *optional*): name or folder of the tokenizer (text, `messages`, TRL's completion logs).
        split (`str`, *optional*): dataset split.
        layout (`str`, *optional*): the training layout of conversations (`episode`, `per_turn`; default: both).
        group_field (`str`, *optional*): a per-row group label kept on one rank.
        no_groups (`bool`, *optional*, defaults to `False`): balance single rows.
    """

    field: str | None = None
    prompt_field: str | None = None
    completion_field: str | None = None
    text_field: str | None = None
    tokenizer: str | None = None
    split: str | None = None
    layout: str | None = None
    group_field: str | None = None
    no_groups: bool = False


@dataclass
class Analysis:
    """What [`analyze_source`] found.

    Args:
        results (`dict`): [`analyze`]'s result per training layout (`"episode"`, `"per_turn"`), or under `None` for
            sequences (one result).
        notes (`list[str]`): what the source is (a tau2 results file's summary), for the console.
        warnings (`list[str]`): what may make the figures wrong (unknown batches), each naming its fix.
    """

    results: dict
    notes: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)


def _unknown_batches(n: int) -> str:
    return (f"the batches are unknown (no --batch-size, and the source gives no optimizer steps): all {n} rows are "
            "analyzed as one batch, one prefix tree, which compresses more than training sees (each optimizer step "
            "builds its own). Pass --batch-size with the rows of one optimizer step (TRL: per_device_train_batch_size "
            "x gradient_accumulation_steps x processes), or TRL's completion logs (log_completions=True), whose "
            "`step` column gives the batches")


def _load(source: str, options: SourceOptions) -> tuple[list, list | None, dict, list | None, list[str]]:
    """The sequences of `source`, their group labels, per layout the training rows of each sequence (`{None: None}`
    for sequences, which train as themselves), their optimizer steps (TRL's logs), and notes about the source."""
    sequence_flags = (options.field, options.prompt_field, options.completion_field, options.text_field)
    if is_trl_log(source):
        if any(flag is not None for flag in sequence_flags) or options.layout is not None:
            raise AnalysisError("TRL's completion logs have fixed columns (step, prompt, completion): drop --field, "
                                "--prompt-field, --completion-field, --text-field and --layout")
        seqs, groups, steps = load_trl_completions(source, options.tokenizer, options.group_field)
        return seqs, groups, {None: None}, steps, [f"{source}: TRL's completion logs, {len(seqs)} rows, "
                                                   f"{len(set(steps))} steps"]
    if all(flag is None for flag in sequence_flags) and is_conversation_source(source, options.split):
        group_field, notes = options.group_field, []
        if is_tau2_source(source):
            from ..envs.tau2.results import describe

            notes.append(describe(source))
            if group_field is None and not options.no_groups:
                group_field = "task_id"  # the trials of a tau2 task
        conversations, groups = load_conversations(source, options.tokenizer, options.split, group_field)
        layouts = SAMPLE_LAYOUTS if options.layout in (None, "both") else (options.layout,)
        rows = {layout: None if layout == "episode" else [layout_rows(ids, mask, layout) for ids, mask in conversations]
                for layout in layouts}
        return [ids for ids, _ in conversations], groups, rows, None, notes
    if options.layout is not None:
        raise AnalysisError("--layout applies to conversations (rows with 'messages' or 'turns'); this source holds "
                            "sequences")
    seqs, groups = load_sequences(
        source, field=options.field, prompt_field=options.prompt_field, completion_field=options.completion_field,
        text_field=options.text_field, tokenizer=options.tokenizer, split=options.split,
        group_field=options.group_field,
    )
    return seqs, groups, {None: None}, None, []


def analyze_source(source: str, options: SourceOptions | None = None, **estimate) -> Analysis:
    """Read `source` and [`analyze`] it in each training layout.

    Args:
        source (`str`): a JSONL file, a dataset folder or name, a tau2-bench results file, or TRL's completion logs
            (a `.parquet` file, the `completions/` folder, or the output folder holding it).
        options ([`SourceOptions`], *optional*): how to read it (default: every field's default).
        **estimate: [`analyze`]'s keyword arguments (`model_shape`, `batch_size`, `num_processes`,
            `fraction_of_ideal`, `dtype`, `max_batch_tokens`, `max_graph_tokens`).

    Returns:
        [`Analysis`]: the results per layout, notes, and a warning when the batches are unknown.

    Raises:
        [`AnalysisError`] (a `ValueError`), `TypeError` or `OSError`: on a bad source or argument, naming the fix.
    """
    options = options or SourceOptions()
    if options.no_groups and options.group_field is not None:
        raise AnalysisError("--no-groups and --group-field contradict each other; give one")
    seqs, groups, layouts, steps, notes = _load(source, options)
    results = {layout: analyze(seqs, groups=None if options.no_groups else groups, rows=rows, steps=steps, **estimate)
               for layout, rows in layouts.items()}
    first = next(iter(results.values()))
    warnings = [] if first["batches_known"] or len(seqs) < 2 else [_unknown_batches(len(seqs))]
    return Analysis(results, notes, warnings)
