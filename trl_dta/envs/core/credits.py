"""Shaped credits any domain shares: how much of the right tools and arguments an episode's calls got, from plain
`(tool, arguments)` pairs (the stand-in's parsed `call` turns, tau2's tool calls).

- [`tool_credit`]: per gold call, the best share of its tool name that one of the agent's calls starts with
  (`find-u` for `find-user` earns 6/9), averaged over the gold calls;
- [`argument_credit`]: the share of the gold calls' `(tool, key, value)` triples that some call of the same tool
  passed;
- [`common_prefix`]: the characters two strings share at their start (the partial credits' measure).

TRL's reward functions that read these credits from a rollout's columns are in `trl.py` (`SHAPED_REWARDS`).
"""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def tool_credit(gold: Sequence[tuple[str, dict]], called: Sequence[tuple[str, dict]]) -> float:
    """Per gold call, the largest `common prefix / len(gold tool name)` over the tool names of `called` (the
    agent's attempted calls, `(tool, arguments)`), averaged over `gold`. Without gold calls (a task solved by
    talking, e.g. 2 of tau2 mock's 9 tasks) the right thing is to call nothing: `1.0` if nothing was called, else
    `0.0`."""
    if not gold:
        return float(not called)
    return sum(max((common_prefix(tool, name) / len(name) for tool, _ in called), default=0.0)
               for name, _ in gold) / len(gold)


def argument_credit(gold: Sequence[tuple[str, dict]], called: Sequence[tuple[str, dict]]) -> float:
    """The share of the gold calls' `(tool, key, value)` triples that some call of `called` to that tool passed.
    Gold calls without arguments have nothing to pass: the credit is then the share of them whose tool was called
    (exact name), and without gold calls `1.0` if nothing was called, else `0.0` (as [`tool_credit`])."""
    if not gold:
        return float(not called)
    wanted = [(name, key, str(value)) for name, args in gold for key, value in args.items()]
    if not wanted:
        names = {tool for tool, _ in called}
        return sum(name in names for name, _ in gold) / len(gold)
    passed = {(tool, key, str(value)) for tool, args in called for key, value in args.items()}
    return sum(triple in passed for triple in wanted) / len(wanted)
