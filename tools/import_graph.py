"""The repository's import graph on layers, and its long modules: fails on an import cycle, an import that runs
upward, or a module of a package over `MAX_LINES` lines.

    python tools/import_graph.py [FOLDER]     # default: the repository (the folder above tools/)

FOLDER is the repository (a folder without `__init__.py`) or one package folder. In a repository, every top-level
folder holding Python is a node of the repository's own scope, `repository`: the packages (`trl_dta`, `benchmarks`:
folders with an `__init__.py`) and the script folders (`recipes`, `tools`, `docs`, whose scripts import each other by
bare name, `from grpo import ...`); `tests/` is no node (it holds both the references that benchmarks import, at the
bottom, and the test modules that import everything, at the top), but its modules are counted for length.

Reads the source with `ast` (nothing is imported). Every package is one scope: its nodes are its direct children
(modules and sub-packages, a sub-package standing for every module under it), and child `a` depends on child `b`
when a module under `a` imports anything under `b`; a script folder is a scope of its scripts. In each scope:

- the **module-level** imports (run when the module loads) must form no cycle: a CYCLE fails;
- every import, the **deferred** ones included (inside a function, or under `if TYPE_CHECKING:`), gives the layers: a
  node's layer is 0 if it imports no sibling, else 1 + the highest layer among the siblings it imports. Every import
  then points to a lower layer, unless deferred imports close a cycle (the usual way a cycle is hidden): those run
  UPWARD and fail (the layers shown are then those of the module-level imports).

A package's `__init__.py` is a node of its own scope (it usually re-exports its children, so it sits on top); the
node and layer counts below leave it out.

**Long modules.** Every Python file over `MAX_LINES` lines (`--max-lines`) is reported: LONG, and a failure, in a
package (split it by responsibility); listed without failing elsewhere (tests, recipes, tools, docs). Exit status 1
on a cycle, an upward import or a LONG module.

    repository: 5 folders on 2 layers
      layer 0: trl_dta
      layer 1: benchmarks, docs, recipes, tools
    trl_dta: 23 modules and packages on 9 layers
      layer 0: batch, kv_stack, precision, refusal
      ...
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

INIT = "__init__"
MAX_LINES = 450
# Top-level folders that are no node of the repository's graph (their files still count for length), and folders
# never read (build outputs and caches, as `.gitignore` lists them; hidden folders too).
NOT_NODES = ("tests",)
SKIPPED = {"__pycache__", "build", "dist", "outputs", "runs", "site"}
REPOSITORY = ()  # the repository's own scope: its nodes are the top-level folders


@dataclass(frozen=True)
class Import:
    """One import statement's target among the checked modules.

    Args:
        source (`tuple[str, ...]`): the importing module's dotted path, e.g. `("trl_dta", "engine", "core")` (a
            package's `__init__.py` is `(..., "engine", "__init__")`).
        target (`tuple[str, ...]`): the imported module or package, resolved to a checked file or folder.
        deferred (`bool`): inside a function or under `if TYPE_CHECKING:` (not run when the module loads).
        line (`int`): the statement's line in the importing file.
    """

    source: tuple[str, ...]
    target: tuple[str, ...]
    deferred: bool
    line: int


@dataclass
class Scope:
    """One package's (a script folder's, the repository's) children and the imports between them (module docstring)."""

    package: tuple[str, ...]
    nodes: list[str]
    edges: dict[tuple[str, str], list[Import]] = field(default_factory=dict)
    layers: dict[str, int] = field(default_factory=dict)
    cycles: list[list[str]] = field(default_factory=list)
    upward: list[Import] = field(default_factory=list)


def _skipped(part: str) -> bool:
    return part.startswith(".") or part in SKIPPED or part.endswith(".egg-info")


def _files(folder: Path) -> list[Path]:
    """The `.py` files under `folder`, skipped folders left out."""
    return [path for path in sorted(folder.rglob("*.py"))
            if not any(_skipped(part) for part in path.relative_to(folder).parts[:-1])]


def _folders(root: Path) -> list[Path]:
    """A repository's top-level folders that hold Python (a package folder: itself)."""
    if (root / f"{INIT}.py").is_file():
        return [root]
    return [path for path in sorted(root.iterdir()) if path.is_dir() and not _skipped(path.name) and _files(path)]


def _modules(root: Path) -> dict[tuple[str, ...], Path]:
    """Every `.py` file of the graph under `root` (a package folder, or a repository's top-level folders but
    `NOT_NODES`), keyed by dotted path from the folder's name (`__init__` kept as a last part)."""
    out = {}
    for folder in _folders(root):
        if folder.name in NOT_NODES and folder != root:
            continue
        for path in _files(folder):
            out[(folder.name, *path.relative_to(folder).with_suffix("").parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.Module):
    """`(node, deferred)` for every import statement of a module."""
    stack = [(node, False) for node in reversed(tree.body)]
    while stack:
        node, deferred = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, deferred
            continue
        inner = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack += [(child, True) for child in reversed(node.body)]
            stack += [(child, inner) for child in reversed(node.orelse)]
            continue
        stack += [(child, inner) for child in reversed(list(ast.iter_child_nodes(node)))]


def _resolve(name: tuple[str, ...], modules: dict, packages: set) -> tuple[str, ...] | None:
    """The longest prefix of `name` that is a checked module or package, or None (outside them)."""
    for end in range(len(name), 0, -1):
        prefix = name[:end]
        if prefix in packages or prefix in modules:
            return prefix
    return None


def imports(root: Path) -> tuple[list[Import], dict[tuple[str, ...], Path]]:
    """Every import of the modules under `root` (see [`_modules`]) that lands among them, and the modules."""
    modules = _modules(root)
    packages = {key[:-1] for key in modules if key[-1] == INIT}
    scripts = {key[:-1] for key in modules if key[:-1] not in packages}  # folders of scripts (no `__init__.py`)
    packages |= scripts | {key[:1] for key in modules}
    plain = {key for key in modules if key[-1] != INIT}
    found = []
    for key, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        here = key[:-1]  # the package this module's relative imports start from
        for node, deferred in _statements(tree):
            if isinstance(node, ast.Import):
                names = [tuple(alias.name.split(".")) for alias in node.names]
            else:
                base = here[: len(here) - node.level + 1] if node.level else ()
                base += tuple(node.module.split(".")) if node.module else ()
                names = [base + (alias.name,) for alias in node.names if alias.name != "*"] or [base]
                names = [n if n in plain or n in packages else n[:-1] for n in names]
            if here in scripts:  # a script imports its folder's scripts by bare name (its folder is on `sys.path`)
                names = [here + n if here + n[:1] in plain else n for n in names]
            for name in names:
                target = _resolve(name, plain, packages)
                if target is not None:
                    found.append(Import(key, target, deferred, node.lineno))
    return found, modules


def _child(package: tuple[str, ...], module: tuple[str, ...]) -> str | None:
    """The child of `package` that `module` lies under (`__init__` for the package itself), or None."""
    if module[: len(package)] != package:
        return None
    return module[len(package)] if len(module) > len(package) else INIT


def _cycles(nodes: list[str], adjacency: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(adjacency[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in nodes:
        if v not in index:
            visit(v)
    return out


def _layers(nodes: list[str], adjacency: dict[str, set[str]]) -> dict[str, int]:
    """Each node's layer in an acyclic graph: 0 without successors, else 1 + the highest successor's layer."""
    layers: dict[str, int] = {}

    def layer(v):
        if v not in layers:
            layers[v] = 1 + max((layer(w) for w in adjacency[v]), default=-1)
        return layers[v]

    for v in nodes:
        layer(v)
    return layers


def scopes(root: Path) -> list[Scope]:
    """One `Scope` per package and script folder under `root` (a repository's own scope first, then outer packages
    before inner ones), layers, cycles and upward imports filled."""
    found, modules = imports(root)
    packages = sorted({key[:-1] for key in modules}, key=lambda p: (len(p), p))
    if not (root / f"{INIT}.py").is_file():
        packages.insert(0, REPOSITORY)
    out = []
    for package in packages:
        nodes = sorted({_child(package, key) for key in modules if _child(package, key) is not None})
        scope = Scope(package, nodes)
        for imp in found:
            a, b = _child(package, imp.source), _child(package, imp.target)
            if a is None or b is None or a == b:
                continue
            scope.edges.setdefault((a, b), []).append(imp)
        full = {v: set() for v in nodes}
        eager = {v: set() for v in nodes}
        for (a, b), found_here in scope.edges.items():
            full[a].add(b)
            if any(not imp.deferred for imp in found_here):
                eager[a].add(b)
        scope.cycles = _cycles(nodes, eager)
        for component in _cycles(nodes, full):  # cycles closed only by deferred imports: those imports run upward
            if not any(set(cycle) <= set(component) for cycle in scope.cycles):
                scope.upward += [imp for (a, b), found_here in sorted(scope.edges.items())
                                 if a in component and b in component for imp in found_here if imp.deferred]
        if not scope.cycles:
            scope.layers = _layers(nodes, eager if scope.upward else full)
        out.append(scope)
    return out


def report(scope: Scope) -> list[str]:
    """The scope's lines: a heading, one line per layer, then each cycle and upward import."""
    name = ".".join(scope.package) or "repository"
    what = "folders" if scope.package == REPOSITORY else "modules and packages"
    counted = [v for v in scope.nodes if v != INIT]
    lines = []
    if scope.layers:
        layers = sorted({scope.layers[v] for v in counted})
        lines.append(f"{name}: {len(counted)} {what} on {len(layers)} layers")
        for level in layers:
            lines.append(f"  layer {level}: " + ", ".join(v for v in counted if scope.layers[v] == level))
    else:
        lines.append(f"{name}: {len(counted)} {what}, not layered (a cycle)")
    for cycle in scope.cycles:
        where = [f"{'.'.join(imp.source)}:{imp.line} -> {'.'.join(imp.target)}"
                 for (a, b), found_here in sorted(scope.edges.items()) if a in cycle and b in cycle
                 for imp in found_here if not imp.deferred]
        lines.append(f"  CYCLE {' <-> '.join(cycle)}: " + "; ".join(where))
    for imp in scope.upward:
        a, b = _child(scope.package, imp.source), _child(scope.package, imp.target)
        lines.append(f"  UPWARD {'.'.join(imp.source)}:{imp.line} imports {'.'.join(imp.target)} "
                     f"(layer {scope.layers[a]} -> {scope.layers[b]})")
    return lines


def long_modules(root: Path, max_lines: int = MAX_LINES) -> list[tuple[str, int, bool]]:
    """Every Python file under `root` (tests included) over `max_lines` lines: `(path, lines, in_package)`, the path
    relative to `root`'s parent for a package folder, else to `root`; `in_package`: it fails the check."""
    base = root.parent if (root / f"{INIT}.py").is_file() else root
    out = []
    for folder in _folders(root):
        package = (folder / f"{INIT}.py").is_file()
        for path in _files(folder):
            lines = len(path.read_text().splitlines())
            if lines > max_lines:
                out.append((path.relative_to(base).as_posix(), lines, package))
    return sorted(out, key=lambda item: (not item[2], -item[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the repository (default: the one holding this script) or one package folder")
    parser.add_argument("--max-lines", type=int, default=MAX_LINES,
                        help=f"longest module a package may hold (default {MAX_LINES})")
    args = parser.parse_args(argv)
    root = args.folder.resolve()
    if not root.is_dir() or not _folders(root):
        parser.error(f"{args.folder} is neither a package folder (with an {INIT}.py) nor a repository holding one or "
                     "more folders of Python; pass the repository, or a package's folder, e.g. trl_dta")
    failed = False
    for scope in scopes(root):
        print("\n".join(report(scope)))
        failed |= bool(scope.cycles or scope.upward)
    long = long_modules(root, args.max_lines)
    for path, lines, package in long:
        if package:
            print(f"LONG {path}: {lines} lines, over {args.max_lines}: split it by responsibility")
    listed = [f"{path} ({lines})" for path, lines, package in long if not package]
    if listed:
        print(f"over {args.max_lines} lines outside the packages (listed, not failed): " + ", ".join(listed))
    too_long = any(package for _, _, package in long)
    if failed or too_long:
        print("FAILED: " + " and ".join(what for what, bad in (("an import cycle or an upward import", failed),
                                                               (f"a module over {args.max_lines} lines", too_long))
                                        if bad) + " (above)")
    else:
        print(f"OK: no cycle, no upward import, no module of a package over {args.max_lines} lines")
    return 1 if failed or too_long else 0


if __name__ == "__main__":
    sys.exit(main())
