"""Trace how control moves among `trl_dta` modules during one balance call (issue 26: planner and strategies).

    python tools/balance_trace.py            # the trainers' split and the default `partition`, on a fixed batch

Runs [`trace_calls`] (`sys.setprofile` on Python call / return events) over `partition_for_ranks` (the split
`micro_batches.balance_ranks` gets through `trainers.exchange.redistribute`: groups kept whole, equal count) and over
`partition(..., group_ids=...)` and `partition(...)` with the default strategy `"best"`, and prints per call:

- `returns`: returns from a function of one `trl_dta` module into a function of another (all of `trl_dta`);
- `balance returns`: those between two different `trl_dta.balance.*` modules;
- `visits`: per module, how often control entered it from another `trl_dta` module (by a call or by a return);
- `edges`: the distinct (caller module, callee module) pairs;
- `planner walk`: the functions of other balance modules that the planner (`balance.partition`) calls itself, in
  order, repeats collapsed: the path a reader follows through the planner.

The planner calls strategies and the cost primitives; a strategy calls only the cost primitives and returns its parts:
[`call_edges`] of a trace is what `tests/balance/test_planner.py` checks against that rule.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field

PREFIX = "trl_dta"


@dataclass
class Trace:
    """Module transitions of one traced call.

    Args:
        returns (`list[tuple[str, str]]`): `(from module, into module)` for each return that crosses `trl_dta` modules.
        calls (`list[tuple[str, str, str]]`): `(caller module, callee module, callee function)` for each call that
            crosses them.
    """

    returns: list[tuple[str, str]] = field(default_factory=list)
    calls: list[tuple[str, str, str]] = field(default_factory=list)

    def balance_returns(self) -> list[tuple[str, str]]:
        return [r for r in self.returns if all(m.startswith(f"{PREFIX}.balance.") for m in r)]

    def visits(self) -> Counter:
        """How often control entered each module from another one (calls into it plus returns into it)."""
        return Counter([callee for _, callee, _ in self.calls] + [into for _, into in self.returns])

    def call_edges(self) -> set[tuple[str, str]]:
        return {(caller, callee) for caller, callee, _ in self.calls}

    def planner_walk(self, planner: str = f"{PREFIX}.balance.partition") -> list[str]:
        """`module.function` of each call the planner makes into another balance module, consecutive repeats
        collapsed."""
        walk: list[str] = []
        for caller, callee, name in self.calls:
            step = f"{callee.removeprefix(f'{PREFIX}.balance.')}.{name}"
            if caller == planner and callee.startswith(f"{PREFIX}.balance.") and (not walk or walk[-1] != step):
                walk.append(step)
        return walk


def _module(frame) -> str | None:
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name if name == PREFIX or name.startswith(f"{PREFIX}.") else None


def trace_calls(fn, *args, **kwargs):
    """`(fn(*args, **kwargs), Trace)`: the call's result and its module transitions (Python frames only)."""
    trace = Trace()

    def profile(frame, event, _arg):
        if event not in ("call", "return"):
            return
        here, there = _module(frame), _module(frame.f_back)
        if here is None or there is None or here == there:
            return
        if event == "call":
            trace.calls.append((there, here, frame.f_code.co_name))
        else:
            trace.returns.append((here, there))

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(old)
    return result, trace


def example_batch(n_groups: int = 8, group_size: int = 4, seed: int = 0):
    """A GRPO-like global batch: `n_groups` prompts (some sharing a system prompt), `group_size` completions each;
    returns `(sequences, group_ids)`."""
    import random

    rng = random.Random(seed)
    system = [rng.randrange(1, 50) for _ in range(6)]
    seqs, groups = [], []
    for g in range(n_groups):
        prompt = (system if g % 2 else []) + [rng.randrange(1, 50) for _ in range(rng.randrange(3, 12))]
        for _ in range(group_size):
            seqs.append(prompt + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 10))])
            groups.append(g)
    return seqs, groups


def main() -> int:
    from trl_dta.balance import partition, partition_for_ranks

    seqs, groups = example_batch()
    calls = {
        "partition_for_ranks(seqs, 2, group_ids=groups)": lambda: partition_for_ranks(seqs, 2, group_ids=groups),
        "partition(seqs, 3, group_ids=groups)": lambda: partition(seqs, 3, group_ids=groups),
        "partition(seqs, 3)": lambda: partition(seqs, 3),
    }
    for name, call in calls.items():
        result, trace = trace_calls(call)
        modules = {m for pair in trace.returns for m in pair} | {m for edge in trace.call_edges() for m in edge}
        short = {m: m.removeprefix(f"{PREFIX}.") for m in modules}
        print(f"{name}: parts {result.parts}")
        print(f"  returns {len(trace.returns)} (balance returns {len(trace.balance_returns())}) among "
              f"{len(short)} modules")
        print("  visits  " + ", ".join(f"{short[m]} {c}" for m, c in sorted(trace.visits().items())))
        print("  edges   " + ", ".join(f"{short[a]}->{short[b]}" for a, b in sorted(trace.call_edges())))
        walk = trace.planner_walk()
        print(f"  planner walk ({len(walk)} steps): " + " -> ".join(walk))
    return 0


if __name__ == "__main__":
    sys.exit(main())
