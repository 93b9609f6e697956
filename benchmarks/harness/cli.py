"""Command-line helpers of the benchmark scripts: name lists that fail the parse on an unknown name, the log, the
thread count."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

import torch


def names(known: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """An argparse `type` for a comma-separated list of names, each one of `known`.

    An unknown name (or an empty list) fails the parse before anything runs: argparse exits with status 2 and a message
    naming the flag, the unknown names and the known ones, instead of a run that measures nothing.

    Args:
        known (sequence of `str`): the accepted names (methods, workloads, shapes).
        what (`str`): what a name is, for the message (`"method"`, `"workload"`).
    """
    known = list(known)

    def parse(text: str) -> list[str]:
        items = [name for name in text.split(",") if name]
        unknown = [name for name in items if name not in known]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown or text!r}; choose from {known}")
        return items

    return parse


def prefixed(parser: argparse.ArgumentParser, flag: str, prefixes: Sequence[str], names: Sequence[str]) -> None:
    """Fail the parse (`parser.error`, status 2) when a prefix of `flag` selects none of `names`, naming the known
    ones."""
    unknown = [p for p in prefixes if not any(name.startswith(p) for name in names)]
    if unknown:
        parser.error(f"argument {flag}: no name starts with {unknown}; choose from {list(names)}")


def log(msg: str) -> None:
    """Print a progress line to stderr (the tables go to stdout)."""
    print(msg, file=sys.stderr, flush=True)


def set_threads(n: int | None) -> None:
    """Use `n` torch threads (None or 0: torch's default); no tokenizer thread pools in forked children."""
    if n:
        torch.set_num_threads(n)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
