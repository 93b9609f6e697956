"""`tools/import_graph.py`: the package's imports form layers (no cycle, no upward import), and the script catches both.

The script reads source with `ast`, so each run takes well under a second; the small packages written here check that
a cycle of module-level imports, a cycle closed by a deferred import and a clean chain are each told apart.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "import_graph.py"


def run(package: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(package)], capture_output=True, text=True, timeout=60)


def write(root: Path, files: dict[str, str]) -> Path:
    """A package `pkg` under `root` with `files` (relative path -> source); every folder gets an `__init__.py`."""
    package = root / "pkg"
    for name, source in {"__init__.py": "", **files}.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(source)
    return package


def test_the_package_has_no_cycle_and_no_upward_import():
    proc = run(ROOT / "trl_dta")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: no cycle, no upward import" in proc.stdout
    heading = proc.stdout.splitlines()[0]
    assert heading.startswith("trl_dta: ") and " layers" in heading, heading
    for package in ("analysis", "balance", "engine", "envs", "generation", "kernels", "modeling", "parallel",
                    "trainers", "envs.tau2"):
        assert f"\ntrl_dta.{package}: " in proc.stdout, package


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


def test_a_folder_without_init_is_refused(tmp_path):
    proc = run(tmp_path)
    assert proc.returncode == 2 and "is not a package folder" in proc.stderr
