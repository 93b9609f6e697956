"""The GPU check's completeness gate (`benchmarks/gpu_summary.check`, what fails CI's dry run): a complete set of rows
passes; a missing method, an error row, a row without tokens/s or a missing column is reported."""

from __future__ import annotations

from benchmarks import gpu_bench
from benchmarks.gpu_summary import FILE_OF, check, planned

EXPECT = [("throughput", "qwen3-1.7b"), ("trainer", "qwen3-0.6b"), ("prefix-memory", "qwen3-1.7b")]


def _write(out, skip=None, broken=None):
    for step, model in EXPECT:
        names, methods = planned(step, dry_run=True)
        path = out / FILE_OF[step]
        for workload in names:
            for method in methods:
                if (step, method) == skip:
                    continue
                row = dict(step=step, workload=workload, method=method,
                           model_shape=gpu_bench.shape_of(model, True).name, tokens_per_s=100.0, peak_mem_mb=1.0)
                if (step, method) == broken:
                    row.update(tokens_per_s=None, error="out of memory")
                gpu_bench.append_row(path, row)


def test_complete_rows_pass(tmp_path):
    _write(tmp_path)
    assert check(tmp_path, EXPECT, dry_run=True) == []


def test_missing_and_failed_rows_are_reported(tmp_path):
    _write(tmp_path, skip=("throughput", "dta-triton"), broken=("trainer", "dta+ckpt"))
    problems = check(tmp_path, EXPECT, dry_run=True)
    assert len(problems) == len(gpu_bench.WORKLOADS) + 1
    assert all("dta-triton: no row" in p for p in problems[:2]) and "dta+ckpt: out of memory" in problems[2]


def test_missing_file_is_reported(tmp_path):
    _write(tmp_path)
    (tmp_path / "prefix_memory.csv").unlink()
    assert check(tmp_path, EXPECT, dry_run=True) == ["prefix_memory.csv: no rows"]
