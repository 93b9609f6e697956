"""`tools/import_graph.py`: the repository's imports form layers (no cycle, no upward import) and no module of a package
is over 450 lines, and the script catches each.

The script reads source with `ast`, so each run takes well under a second; the small packages written here check that
a cycle of module-level imports, a cycle closed by a deferred import and a clean chain are each told apart, and that a
repository's top-level folders, its script folders and its long modules are.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "import_graph.py"


def run(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(folder), *args], capture_output=True, text=True,
                          timeout=60)


def write(root: Path, files: dict[str, str]) -> Path:
    """A package `pkg` under `root` with `files` (relative path -> source); every folder gets an `__init__.py`."""
    package = root / "pkg"
    for name, source in {"__init__.py": "", **files}.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(source)
    return package


def test_the_repository_has_no_cycle_no_upward_import_and_no_long_package_module():
    proc = run(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: no cycle, no upward import, no module of a package over 450 lines" in proc.stdout
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("repository: ") and " folders on " in lines[0], lines[0]
    assert lines[1] == "  layer 0: trl_dta", proc.stdout  # everything else imports the package, never the reverse
    for package in ("analysis", "balance", "engine", "envs", "generation", "kernels", "modeling", "parallel",
                    "trainers", "envs.tau2"):
        assert f"\ntrl_dta.{package}: " in proc.stdout, package
    for room in ("baselines", "gpu", "harness", "reporting", "suites", "workloads"):
        assert f"\nbenchmarks.{room}: " in proc.stdout, room
    assert "\nrecipes: " in proc.stdout and "LONG" not in proc.stdout


def test_a_repository_of_packages_and_script_folders(tmp_path):
    """The repository's own scope (top-level folders), a bare-name import between scripts, `tests/` counted for length
    but no node; a long module fails in a package and is only listed elsewhere."""
    write(tmp_path, {"core.py": "X = 1\n", "big.py": "x = 1\n" * 451})
    for name, source in {"bench/__init__.py": "", "bench/run.py": "from pkg import core\n",
                         "scripts/base.py": "import bench.run\n", "scripts/top.py": "from base import X\n",
                         "tests/test_x.py": "import bench\n" + "x = 1\n" * 460}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    proc = run(tmp_path)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[:4] == ["repository: 3 folders on 3 layers", "  layer 0: pkg", "  layer 1: bench",
                         "  layer 2: scripts"]
    assert "scripts: 2 modules and packages on 2 layers" in lines and "  layer 1: top" in lines, proc.stdout
    assert "LONG pkg/big.py: 451 lines, over 450: split it by responsibility" in lines
    assert "over 450 lines outside the packages (listed, not failed): tests/test_x.py (461)" in lines
    assert lines[-1] == "FAILED: a module over 450 lines (above)"
    assert run(tmp_path, "--max-lines", "500").returncode == 0


def test_a_cycle_between_top_level_packages_fails(tmp_path):
    write(tmp_path, {"a.py": "def f():\n    import bench\n"})
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("from pkg import a\n")
    proc = run(tmp_path)
    assert proc.returncode == 1
    assert "  UPWARD pkg.a:2 imports bench (layer 0 -> 1)" in proc.stdout, proc.stdout


def test_layers_of_a_clean_chain(tmp_path):
    package = write(tmp_path, {
        "base.py": "import os\n",
        "mid.py": "from . import base\n",
        "sub/__init__.py": "from .inner import X\n",
        "sub/inner.py": "from ..mid import Y\nX = 1\n",
        "top.py": "from pkg.sub import X\n\n\ndef f():\n    from . import base\n",
        "__init__.py": "def __getattr__(name):\n    from . import top\n",
    })
    proc = run(package)
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.splitlines()
    assert lines[:5] == ["pkg: 4 modules and packages on 4 layers", "  layer 0: base", "  layer 1: mid",
                         "  layer 2: sub", "  layer 3: top"], proc.stdout


def test_a_cycle_of_module_level_imports_fails(tmp_path):
    package = write(tmp_path, {"a.py": "from .b import B\nA = 1\n", "b.py": "from . import c\nB = 1\n",
                               "c.py": "import pkg.a\n"})
    proc = run(package)
    assert proc.returncode == 1
    assert "CYCLE a <-> b <-> c: pkg.a:1 -> pkg.b; pkg.b:1 -> pkg.c; pkg.c:1 -> pkg.a" in proc.stdout, proc.stdout


def test_a_cycle_closed_by_a_deferred_import_runs_upward(tmp_path):
    package = write(tmp_path, {
        "low.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .high import H\n",
        "high.py": "from .low import L\n",
        "sub/__init__.py": "",
        "sub/x.py": "def f():\n    from .y import g\n",
        "sub/y.py": "from .x import f\n",
    })
    proc = run(package)
    assert proc.returncode == 1
    assert "UPWARD pkg.low:4 imports pkg.high" in proc.stdout, proc.stdout
    assert "UPWARD pkg.sub.x:2 imports pkg.sub.y" in proc.stdout, proc.stdout
    assert "CYCLE" not in proc.stdout


def test_a_folder_without_python_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    proc = run(tmp_path)
    assert proc.returncode == 2 and "is neither a package folder" in proc.stderr
