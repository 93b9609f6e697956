"""TRL's private state is touched in one module, `trl_dta/trainers/_trl.py`: an `ast` walk over `trl_dta/` (nothing is
imported from it but the adapter's lists) finds every read or write of a private attribute of TRL's trainers elsewhere.

TRL's private names come from the installed TRL by introspection: the `_x` names defined on the classes of
`GRPOTrainer`'s and `RLOOTrainer`'s MRO that come from TRL or transformers (methods, class attributes) and the `self._x`
attributes their sources use (instance attributes). An access is `anything._x` (a read, a write, a call) or the string
`"_x"` (`getattr`/`setattr`/`hasattr`); the overridden hooks themselves (a method or class attribute of that name
defined in a class) and an override's `super()._x(...)` delegation to TRL's are not accesses, and must be listed in
the adapter's `OVERRIDDEN_HOOKS`.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
from trl import GRPOTrainer, RLOOTrainer

from trl_dta.trainers import _trl
from trl_dta.trainers.config import TESTED_TRL_VERSIONS

PACKAGE = Path(__file__).resolve().parents[2] / "trl_dta"
ADAPTER = PACKAGE / "trainers" / "_trl.py"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and not name.startswith("_dta")


def trl_private_names() -> set[str]:
    """The private attributes and methods of TRL's GRPO and RLOO trainers and the classes under them from TRL and
    transformers (see the module docstring)."""
    names = set()
    classes = {c for trainer in (GRPOTrainer, RLOOTrainer) for c in trainer.__mro__
               if c.__module__.split(".")[0] in ("trl", "transformers")}
    for cls in classes:
        names |= {name for name in vars(cls) if _private(name)}
        tree = ast.parse(inspect.getsource(cls))
        names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                  and isinstance(node.value, ast.Name) and node.value.id == "self" and _private(node.attr)}
    return names


class _Finder(ast.NodeVisitor):
    """Private accesses and overrides of `names` in one module's tree (see the module docstring)."""

    def __init__(self, names: set[str]):
        self.names = names
        self.accesses: list[tuple[int, str]] = []  # (line, name)
        self.overrides: list[tuple[int, str]] = []
        self.functions: list[str] = []  # the enclosing functions, innermost last

    def visit_ClassDef(self, node: ast.ClassDef):
        for statement in node.body:
            targets = [statement.name] if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
            if isinstance(statement, (ast.Assign, ast.AnnAssign)):
                found = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                targets = [t.id for t in found if isinstance(t, ast.Name)]
            self.overrides += [(statement.lineno, name) for name in targets if name in self.names]
        self.generic_visit(node)

    def visit_FunctionDef(self, node):
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node: ast.Attribute):
        if node.attr in self.names and not self._delegation(node):
            self.accesses.append((node.lineno, node.attr))
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant):
        if isinstance(node.value, str) and node.value in self.names:
            self.accesses.append((node.lineno, node.value))

    def _delegation(self, node: ast.Attribute) -> bool:
        """`super()._x` inside a method `_x`: an override calling TRL's."""
        call = node.value
        return (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "super"
                and bool(self.functions) and self.functions[-1] == node.attr)


def find(source: str, names: set[str], skip: tuple[str, ...] = ()) -> _Finder:
    """The finder's result over `source`, leaving out the module-level assignments to the names in `skip`."""
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if not (isinstance(node, ast.Assign) and any(
        isinstance(target, ast.Name) and target.id in skip for target in node.targets))]
    finder = _Finder(names)
    finder.visit(tree)
    return finder


@pytest.fixture(scope="module")
def names() -> set[str]:
    found = trl_private_names()
    # the introspection sees what the trainers use (instance attributes, private methods, class attributes)
    assert {"_metrics", "_step", "_buffered_inputs", "_compute_loss", "_tag_names"} <= found
    return found


def _modules():
    return sorted(path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts)


def test_no_private_trl_access_outside_the_adapter(names):
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {name}" for path in _modules() if path != ADAPTER
             for line, name in find(path.read_text(), names).accesses]
    assert not found, "TRL private state touched outside trl_dta/trainers/_trl.py (add a function there):\n" + \
        "\n".join(found)


def test_the_adapter_lists_every_access_and_override(names):
    adapter = find(ADAPTER.read_text(), names, skip=("PRIVATE_ATTRIBUTES", "OVERRIDDEN_HOOKS"))  # the lists
    assert {name for _, name in adapter.accesses} == set(_trl.PRIVATE_ATTRIBUTES)
    overrides = {name for path in _modules() for _, name in find(path.read_text(), names).overrides}
    assert overrides == set(_trl.OVERRIDDEN_HOOKS)
    for name, (version, _) in {**_trl.PRIVATE_ATTRIBUTES, **_trl.OVERRIDDEN_HOOKS}.items():
        assert name in names, f"TRL no longer has `{name}`: see trl_dta/trainers/_trl.py"
        assert ".".join(version.split(".")[:2]) in TESTED_TRL_VERSIONS, (name, version)
    lines = ADAPTER.read_text().splitlines()
    unversioned = [f"{line}: {lines[line - 1].strip()}" for line, _ in adapter.accesses
                   if not re.search(r"# TRL \d+\.\d+", lines[line - 1])]
    assert not unversioned, "a private access without the TRL version it was read from:\n" + "\n".join(unversioned)


def test_the_walk_finds_a_private_access(names):
    source = '''
class Trainer(GRPOTrainer):
    _tag_names = ["trl-dta"]

    def _prepare_inputs(self, batch):
        return super()._prepare_inputs(batch)

    def score(self, batch):
        self._dta_state.replay = None
        return super()._get_per_token_logps_and_entropies(batch)


def log(trainer, value):
    trainer._metrics["train"]["x"].append(value)
    trainer._buffered_inputs = []
    return getattr(trainer, "_step")
'''
    finder = find(source, names)
    assert finder.accesses == [(10, "_get_per_token_logps_and_entropies"), (14, "_metrics"),
                               (15, "_buffered_inputs"), (16, "_step")]
    assert finder.overrides == [(3, "_tag_names"), (5, "_prepare_inputs")]
