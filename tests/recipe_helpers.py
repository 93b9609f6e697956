"""What the recipe tests (`test_recipe.py`, `test_recipe_agent.py`) share: loading a recipe script as a module and
running it as a subprocess from the repository root."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "recipes" / "configs"


def load_recipe(path: Path, name: str) -> Iterator:
    """Yield the recipe at `path` imported as module `name` (for a module-scoped fixture), then forget it."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def run(args: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `args` from the repository root with the package importable and no inherited `ACCELERATE_USE_CPU`
    (`env`: variables to add)."""
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("ACCELERATE_USE_CPU", None)
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
