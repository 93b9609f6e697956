"""Console entry point `trl-dta`.

`trl-dta analyze` tells, before any training, how much prefix sharing a set of rollouts holds and what DTA would gain
on it:

```
trl-dta analyze rollouts.jsonl                                   # JSONL rows with `input_ids`
trl-dta analyze rollouts.jsonl --prompt-field prompt_ids --completion-field completion_ids
trl-dta analyze chats.jsonl --text-field text --tokenizer Qwen/Qwen3-1.7B
trl-dta analyze ./saved_dataset --split train --batch-size 512 --num-processes 8 --model-shape qwen3-1.7b
```

Rows are read in order and cut into global batches of `--batch-size` sequences (what one optimizer step sees; default:
all rows form one batch). For each batch the prefix tree is built; the table reports totals over batches and the
ideal FLOP speed-up (`trl_dta.flops`: dense FLOPs over tree FLOPs, forward + backward, for `--model-shape`).

The *predicted* DTA speed-up is `ideal x f`: `f` (`--fraction-of-ideal`, default 0.8) is the fraction of the ideal
FLOP speed-up that DTA reached over TRL's dense path in the repository's benchmarks (`benchmarks/RESULTS.md`: 0.75-1.0
on CPU for GRPO and multi-turn batches, lowest when a tree has many short segments). It folds in what the FLOP count
leaves out (per-forward overhead, sibling padding, small matmuls). It is a rough guide, not a promise: measure with
`python -m benchmarks.bench_engine` on your hardware and pass the fraction you see. It is never below 1x: the DTA
trainers run batches that compress less than `dta_min_compression` through TRL's dense path.

With `--num-processes K` each batch is split across `K` ranks by `trl_dta.balance.partition` (groups kept together
with `--group-field`); the table adds the most loaded rank's share, the imbalance (max / mean forest cost) and the
fraction of the single-forest compression that survives the split.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path


__all__ = ["AnalysisError", "analyze", "load_sequences", "main"]

# Fraction of the ideal FLOP speed-up that DTA reaches over dense (benchmarks/RESULTS.md, CPU runs: 0.75-1.0), used by
# `trl-dta analyze` for its predicted speed-up; override with --fraction-of-ideal.
DEFAULT_FRACTION_OF_IDEAL = 0.8


class AnalysisError(ValueError):
    """Malformed input for `trl-dta analyze` (the message names the row and the field)."""


# ------------------------------------------------------------------------------------------------------ loading


def _ids(value, where: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise AnalysisError(f"{where}: expected a list of token ids, got {type(value).__name__}")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise AnalysisError(f"{where}: token ids must be non-negative integers, found {t!r}")
    return list(value)


class _RowParser:
    """Turns one record (dict) into a list of token ids according to the command-line options."""

    def __init__(self, field: str | None, prompt_field: str | None, completion_field: str | None,
                 text_field: str | None, tokenizer):
        self.field, self.prompt_field, self.completion_field = field, prompt_field, completion_field
        self.text_field, self.tokenizer = text_field, tokenizer
        if (prompt_field is None) != (completion_field is None):
            raise AnalysisError("--prompt-field and --completion-field go together; give both or neither")

    def __call__(self, row, where: str) -> list[int]:
        if not isinstance(row, dict):
            raise AnalysisError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if self.tokenizer is not None:
            return self._text(row, where)
        if self.prompt_field is not None:
            fields = [self.prompt_field, self.completion_field]
        elif self.field is not None:
            fields = [self.field]
        elif "input_ids" in row:
            fields = ["input_ids"]
        elif "prompt_ids" in row and "completion_ids" in row:
            fields = ["prompt_ids", "completion_ids"]
        else:
            text = [k for k in ("text", "prompt", "completion", "messages") if k in row]
            hint = f"; it has text fields {text}: pass --tokenizer NAME_OR_PATH" if text else ""
            raise AnalysisError(
                f"{where}: no token ids: expected field 'input_ids' (or --field NAME, or prompt_ids + "
                "completion_ids); "
                f"fields present: {sorted(row)}{hint}"
            )
        out: list[int] = []
        for f in fields:
            if f not in row:
                raise AnalysisError(f"{where}: missing field '{f}' (fields present: {sorted(row)})")
            out += _ids(row[f], f"{where}, field '{f}'")
        return out

    def _text(self, row, where: str) -> list[int]:
        if self.text_field is not None:
            fields = [self.text_field]
        elif "text" in row:
            fields = ["text"]
        elif "prompt" in row and "completion" in row:
            fields = ["prompt", "completion"]
        else:
            raise AnalysisError(
                f"{where}: no text: expected field 'text' (or --text-field NAME, or prompt + completion); "
                f"fields present: {sorted(row)}"
            )
        text = ""
        for f in fields:
            if f not in row:
                raise AnalysisError(f"{where}: missing field '{f}' (fields present: {sorted(row)})")
            if not isinstance(row[f], str):
                raise AnalysisError(f"{where}, field '{f}': expected a string, got {type(row[f]).__name__}")
            text += row[f]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _jsonl_rows(path: Path) -> Iterator[tuple[dict, str]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line), f"{path.name} line {n}"
            except json.JSONDecodeError as e:
                raise AnalysisError(f"{path.name} line {n}: invalid JSON ({e.msg} at column {e.colno})") from None


def _dataset_rows(source: str, split: str | None) -> Iterator[tuple[dict, str]]:
    import datasets

    path = Path(source)
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
    else:
        ds = datasets.load_dataset(source, split=split)
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            if len(ds) != 1:
                raise AnalysisError(f"{source} has splits {list(ds)}; choose one with --split")
            split = next(iter(ds))
        if split not in ds:
            raise AnalysisError(f"{source} has no split '{split}'; splits: {list(ds)}")
        ds = ds[split]
    for n, row in enumerate(ds):
        yield row, f"{source} row {n}"


def load_sequences(
    source: str,
    field: str | None = None,
    prompt_field: str | None = None,
    completion_field: str | None = None,
    text_field: str | None = None,
    tokenizer: str | None = None,
    split: str | None = None,
    group_field: str | None = None,
) -> tuple[list[list[int]], list | None]:
    """Read rollouts as token-id lists (and group labels when `group_field` is given).

    Args:
        source (`str`): a `.jsonl`/`.json` file (one JSON object per line), a folder written by
            `datasets.Dataset.save_to_disk`, or a dataset name for `datasets.load_dataset`.
        field (`str`, *optional*): the token-id field (default: `input_ids`, else `prompt_ids` + `completion_ids`).
        prompt_field, completion_field (`str`, *optional*): two token-id fields to concatenate.
        text_field (`str`, *optional*): the text field when `tokenizer` is given (default: `text`, else
            `prompt` + `completion`).
        tokenizer (`str`, *optional*): name or path for `transformers.AutoTokenizer` (text input).
        split (`str`, *optional*): dataset split.
        group_field (`str`, *optional*): a per-row group label (e.g. the prompt index), kept together across ranks.

    Raises:
        [`AnalysisError`]: on malformed input, naming the line (or row) and the field.
    """
    tok = None
    if tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    elif text_field is not None:
        raise AnalysisError("--text-field needs --tokenizer NAME_OR_PATH to turn text into token ids")
    parse = _RowParser(field, prompt_field, completion_field, text_field, tok)
    path = Path(source)
    if path.is_file():
        rows: Iterable = _jsonl_rows(path)
    elif path.is_dir() or not path.suffix:
        rows = _dataset_rows(source, split)
    else:
        raise AnalysisError(f"{source}: no such file")
    seqs, groups = [], [] if group_field else None
    for row, where in rows:
        seqs.append(parse(row, where))
        if group_field:
            if group_field not in row:
                raise AnalysisError(f"{where}: missing group field '{group_field}'")
            groups.append(row[group_field])
    if not seqs:
        raise AnalysisError(f"{source}: no rows")
    return seqs, groups


# ------------------------------------------------------------------------------------------------------ analysis


def analyze(
    seqs: list[list[int]],
    model_shape="qwen3-1.7b",
    batch_size: int | None = None,
    num_processes: int | None = None,
    groups: list | None = None,
    fraction_of_ideal: float = DEFAULT_FRACTION_OF_IDEAL,
) -> dict:
    """Prefix-sharing statistics of rollouts and the speed-ups DTA can give on them.

    Args:
        seqs (`list[list[int]]`): the rollouts, in order.
        model_shape (`str`, [`~trl_dta.flops.ModelShape`] or a `transformers` config): for the FLOP counts.
        batch_size (`int`, *optional*): sequences per global batch (default: one batch of all).
        num_processes (`int`, *optional*): ranks to balance each batch over.
        groups (`list`, *optional*): a group label per sequence (kept on one rank).
        fraction_of_ideal (`float`, *optional*): see the module docstring.

    Returns:
        `dict` of the table's values (`balance` is `None` without `num_processes`, or a dict of its row).
    """
    from .flops import dense_flops, get_model_shape, tree_flops
    from .tree import PrefixTree

    shape = get_model_shape(model_shape)
    if batch_size is not None and batch_size < 1:
        raise AnalysisError(f"--batch-size must be >= 1, got {batch_size}")
    if num_processes is not None and num_processes < 1:
        raise AnalysisError(f"--num-processes must be >= 1, got {num_processes}")
    if not 0 < fraction_of_ideal <= 1:
        raise AnalysisError(f"--fraction-of-ideal must be in (0, 1], got {fraction_of_ideal}")
    size = batch_size or len(seqs)
    totals = dict(batches=0, sequences=0, tokens=0, tree_tokens=0, max_len=0, max_segments_depth=0,
                  dense_flops=0.0, tree_flops=0.0)
    balance = dict(max_share=[], imbalance=[], compression_kept=[], rank_tree_tokens_max=0.0, dense_max=0.0)
    for start in range(0, len(seqs), size):
        batch = seqs[start : start + size]
        tree = PrefixTree.from_sequences(batch)
        totals["batches"] += 1
        totals["sequences"] += tree.n_sequences
        totals["tokens"] += tree.n_tokens
        totals["tree_tokens"] += tree.n_tree_tokens
        totals["max_len"] = max(totals["max_len"], tree.max_path_len)
        totals["max_segments_depth"] = max(totals["max_segments_depth"], tree.depth)
        totals["dense_flops"] += dense_flops(tree.lengths, shape).total
        totals["tree_flops"] += tree_flops(tree, shape).total
        if num_processes:
            _balance(batch, tree, num_processes, groups[start : start + size] if groups else None, balance)
    ideal = totals["dense_flops"] / totals["tree_flops"] if totals["tree_flops"] else 1.0
    result = {
        **totals,
        "mean_len": totals["tokens"] / max(totals["sequences"], 1),
        "compression_ratio": totals["tokens"] / totals["tree_tokens"] if totals["tree_tokens"] else 1.0,
        "model_shape": shape.name,
        "ideal_speedup": ideal,
        "fraction_of_ideal": fraction_of_ideal,
        # the trainers send batches that compress less than `dta_min_compression` down TRL's dense path: never < 1x
        "predicted_speedup": max(ideal * fraction_of_ideal, 1.0),
        "num_processes": num_processes,
        "balance": None,
    }
    if num_processes and balance["imbalance"]:
        n = len(balance["imbalance"])
        result["balance"] = {
            "imbalance": sum(balance["imbalance"]) / n,
            "worst_imbalance": max(balance["imbalance"]),
            "max_share": sum(balance["max_share"]) / n,
            "compression_kept": sum(balance["compression_kept"]) / n,
        }
    return result


def _balance(batch, tree, k: int, groups, acc: dict) -> None:
    try:
        from .balance import partition
    except ImportError:  # balance.py is optional for the analyzer
        return
    part = partition(tree, k, group_ids=groups)
    total = sum(part.costs)
    acc["imbalance"].append(part.imbalance)
    acc["max_share"].append(part.max_cost / total if total else 0.0)
    acc["compression_kept"].append(part.compression_kept)


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
        rows += [
            (f"per-rank balance ({k} processes): max / mean cost",
             f"{bal['imbalance']:.3f} (worst batch {bal['worst_imbalance']:.3f})"),
            ("  most loaded rank's share of the work", f"{bal['max_share']:.1%} (ideal {1 / k:.1%})"),
            ("  compression kept after the split", f"{bal['compression_kept']:.1%}"),
        ]
    elif result.get("num_processes"):
        rows.append((f"per-rank balance ({result['num_processes']} processes)", "unavailable (trl_dta.balance)"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# ------------------------------------------------------------------------------------------------------ CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-dta", description="Dynamic Tree Attention for TRL: tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("analyze", help="prefix sharing and predicted DTA speed-up of a set of rollouts",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="JSONL file, dataset folder (save_to_disk) or dataset name")
    p.add_argument("--field", default=None, help="token-id field (default: input_ids, else prompt_ids+completion_ids)")
    p.add_argument("--prompt-field", default=None, help="token-id field of the prompt (with --completion-field)")
    p.add_argument("--completion-field", default=None, help="token-id field of the completion")
    p.add_argument("--text-field", default=None, help="text field (with --tokenizer; default: text, else "
                   "prompt+completion)")
    p.add_argument("--tokenizer", default=None, help="tokenizer name or path for text input")
    p.add_argument("--split", default=None, help="dataset split")
    p.add_argument("--group-field", default=None, help="per-row group label kept on one rank (e.g. prompt index)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per global batch (default: all)")
    p.add_argument("--num-processes", type=int, default=None, help="ranks to balance each batch over")
    p.add_argument("--model-shape", default="qwen3-1.7b",
                   help="model for FLOP counts: a name (qwen3-1.7b, qwen2-0.5b, bench-cpu, ...) or a config path")
    p.add_argument("--fraction-of-ideal", type=float, default=DEFAULT_FRACTION_OF_IDEAL,
                   help="fraction of the ideal speed-up DTA reaches (benchmarks/RESULTS.md)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def _shape(name: str):
    from .flops import MODEL_SHAPES, ModelShape

    if name.lower() in MODEL_SHAPES:
        return name
    path = Path(name)
    if path.exists():
        from transformers import AutoConfig

        return ModelShape.from_config(AutoConfig.from_pretrained(name), name=path.name or name)
    raise AnalysisError(f"unknown --model-shape {name!r}: choose one of {sorted(MODEL_SHAPES)} or give a config path")


def main(argv: list[str] | None = None) -> int:
    """`trl-dta` console entry point; returns the exit code (2 on bad input)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        seqs, groups = load_sequences(
            args.source, field=args.field, prompt_field=args.prompt_field, completion_field=args.completion_field,
            text_field=args.text_field, tokenizer=args.tokenizer, split=args.split, group_field=args.group_field,
        )
        result = analyze(seqs, _shape(args.model_shape), args.batch_size, args.num_processes, groups,
                         args.fraction_of_ideal)
    except (AnalysisError, ValueError, FileNotFoundError) as e:
        print(f"trl-dta analyze: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
