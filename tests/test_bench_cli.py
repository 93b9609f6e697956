"""The benchmark scripts refuse a name they do not know (a method, a workload, a model shape, a backend) before
anything runs: argparse's exit status 2 and a message naming the unknown name and the known ones, instead of a run
that measures nothing and writes an empty CSV and plot. Only the parsers run here (an unknown name fails the parse, or
the workload selection just after it), so no model is built."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (module, argv with one unknown name, a known name the message lists)
CASES = [
    ("bench_engine", ["--methods", "dta,nope"], "dense-mb8"),
    ("bench_engine", ["--families", "nope"], "gpt_oss"),
    ("bench_engine", ["--quick", "--workloads", "nope"], "no-sharing"),
    ("bench_hybrid", ["--methods", "nope"], "dense-mb8"),
    ("bench_hybrid", ["--workloads", "nope"], "multi_turn"),
    ("bench_hybrid", ["--shapes", "nope"], "bench-cpu-quick"),
    ("bench_trainer", ["--methods", "nope"], "trl+ckpt"),
    ("run", ["--methods", "nope"], "dense-mb8"),
    ("run", ["--workloads", "nope"], "no-sharing"),
    ("bench_attention", ["--backends", "nope"], "triton"),
    ("bench_rollouts", ["--methods", "nope"], "reprefill"),
    ("bench_tree_rollouts", ["--methods", "nope"], "independent"),
    ("bench_tree_rollouts", ["--shapes", "nope"], "tiny"),
    ("bench_tree_memory", ["--shapes", "nope"], "tiny"),
    ("task_probe", ["--kinds", "nope"], "largest-of-4"),
]


@pytest.mark.parametrize("module,argv,known", CASES, ids=[f"{m}{a[-2]}" for m, a, _ in CASES])
def test_an_unknown_name_fails_the_parse(module, argv, known, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    main = importlib.import_module(f"benchmarks.suites.{module}").main
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "nope" in err and known in err, err


def test_bench_balance_refuses_an_unknown_workload(monkeypatch, capsys):
    from benchmarks.suites import bench_balance

    monkeypatch.setattr(sys, "argv", ["bench_balance", "--workloads", "nope"])
    with pytest.raises(SystemExit) as exit_info:
        bench_balance.main()
    assert exit_info.value.code == 2
    assert "nope" in capsys.readouterr().err


def test_the_command_line_exits_non_zero_and_writes_nothing(tmp_path):
    """The report's case: `python -m benchmarks.suites.bench_engine --methods <unknown> --workloads <unknown>`."""
    results = ROOT / "benchmarks" / "results"
    before = {p.name: p.stat().st_mtime for p in results.iterdir()}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.suites.bench_engine", "--methods", "nope", "--workloads",
                           "nope"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "unknown method ['nope']" in proc.stderr and "dense-mb8" in proc.stderr, proc.stderr
    assert {p.name: p.stat().st_mtime for p in results.iterdir()} == before
