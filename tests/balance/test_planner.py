"""`trl_dta.balance`'s layout: one planner (`partition.py`) calling self-contained strategies (`contiguous.py`,
`packing.py`) that import only the cost primitives (`cost.py`) and never call back into the planner.

Read from the source with `ast`, and from a run: `tools/balance_trace.py` records every call and return between
`trl_dta` modules (`sys.setprofile`) during the trainers' split and the default `partition`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from trl_dta.balance import partition, partition_for_ranks

ROOT = Path(__file__).resolve().parents[2]
BALANCE = ROOT / "trl_dta" / "balance"
PLANNER, STRATEGIES, PRIMITIVES = "partition", ("contiguous", "packing"), "cost"


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


TOOL = _load_tool("balance_trace")


def balance_imports(module: str) -> set[str]:
    """The `trl_dta.balance` siblings that `balance/<module>.py` imports (relative or absolute, anywhere in it), as
    `tools/import_graph.py` reads them."""
    graph = _load_tool("import_graph")
    (scope,) = [s for s in graph.scopes(ROOT / "trl_dta") if s.package == ("trl_dta", "balance")]
    return {b for a, b in scope.edges if a == module}


def test_the_balance_modules_are_the_ones_named_here():
    assert {p.stem for p in BALANCE.glob("*.py")} == {"__init__", PLANNER, PRIMITIVES, *STRATEGIES}


@pytest.mark.parametrize("module", STRATEGIES)
def test_strategies_import_only_the_primitives(module):
    assert balance_imports(module) <= {PRIMITIVES}


def test_primitives_import_no_sibling():
    assert balance_imports(PRIMITIVES) == set()


def _short(module: str) -> str:
    return module.removeprefix("trl_dta.balance.")


CALLS = {
    "trainers' split": lambda seqs, groups: partition_for_ranks(seqs, 2, group_ids=groups),
    "best, groups": lambda seqs, groups: partition(seqs, 3, group_ids=groups),
    "best, no groups": lambda seqs, groups: partition(seqs, 3),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_the_planner_calls_each_strategy_once_and_nothing_calls_it_back(name):
    seqs, groups = TOOL.example_batch()
    result, trace = TOOL.trace_calls(CALLS[name], seqs, groups)
    untraced = CALLS[name](seqs, groups)
    assert result.parts == untraced.parts and result.costs == untraced.costs  # tracing changes nothing
    balance = "trl_dta.balance."
    edges = {(_short(a), _short(b)) for a, b in trace.call_edges() if a.startswith(balance) and b.startswith(balance)}
    allowed = {(PLANNER, PRIMITIVES)} | {(PLANNER, s) for s in STRATEGIES} | {(s, PRIMITIVES) for s in STRATEGIES}
    assert edges <= allowed, f"calls outside planner -> strategy -> primitives: {sorted(edges - allowed)}"
    # One call into a strategy module per strategy the planner runs, and one return from it: the strategy gets its
    # inputs as arguments and hands back whole parts.
    entered = [step for step in trace.planner_walk() if step.split(".")[0] in STRATEGIES]
    returned = [(a, b) for a, b in trace.returns if _short(a) in STRATEGIES and _short(b) == PLANNER]
    expected = {
        "trainers' split": ["contiguous.equal_runs", "packing.group_packing"],
        "best, groups": ["contiguous.contiguous_parts", "packing.group_packing"],
        "best, no groups": ["contiguous.contiguous_parts", "packing.subtree_packings"],
    }[name]
    assert entered == expected
    assert len(returned) == len(expected)


def test_the_trace_sees_a_callback_into_the_planner():
    """A function that runs as part of a strategy module and calls the planner's `summarize` shows up as the edge
    `contiguous -> partition` (so the test above can fail)."""
    from trl_dta.balance import cost
    from trl_dta.tree import as_tree

    planner = importlib.import_module("trl_dta.balance.partition")  # the module (the package exports the function)

    namespace = {"__name__": "trl_dta.balance.contiguous", "planner": planner, "cost": cost}
    exec("def strategy(batch):\n    return planner.summarize(batch, [[0, 1]], cost.CostModel())\n", namespace)
    batch = cost.SortedBatch(as_tree([[1, 2], [1, 3]]))
    _, trace = TOOL.trace_calls(namespace["strategy"], batch)
    edges = {(_short(a), _short(b)) for a, b in trace.call_edges()}
    assert ("contiguous", PLANNER) in edges
