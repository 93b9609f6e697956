"""The GPU check's completeness gate (`benchmarks/gpu/summary.check`, what fails CI's dry run): a complete set of rows
passes; a missing method, an error row, a row without tokens/s or a missing column is reported."""

from __future__ import annotations

from benchmarks.gpu import bench as gpu_bench
from benchmarks.gpu import plan
from benchmarks.gpu.plan import FILE_OF, planned
from benchmarks.gpu.summary import check

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
                           model_shape=plan.shape_of(model, True).name, tokens_per_s=100.0, peak_mem_mb=1.0)
                if (step, method) == broken:
                    row.update(tokens_per_s=None, error="out of memory")
                plan.append_row(path, row)


def test_complete_rows_pass(tmp_path):
    _write(tmp_path)
    assert check(tmp_path, EXPECT, dry_run=True) == []


def test_missing_and_failed_rows_are_reported(tmp_path):
    _write(tmp_path, skip=("throughput", "dta-triton"), broken=("trainer", "dta+ckpt"))
    problems = check(tmp_path, EXPECT, dry_run=True)
    assert len(problems) == len(plan.WORKLOADS) + 1
    assert all("dta-triton: no row" in p for p in problems[:2]) and "dta+ckpt: out of memory" in problems[2]


def test_missing_file_is_reported(tmp_path):
    _write(tmp_path)
    (tmp_path / "prefix_memory.csv").unlink()
    assert check(tmp_path, EXPECT, dry_run=True) == ["prefix_memory.csv: no rows"]


def test_the_plan_names_every_method_dta_right_after_dense_ckpt():
    """The dry run's CSVs must hold every method of issue 33 (the completeness gate above plans `METHODS`), the DTA
    methods right after TRL's default, so that a short deadline loses the baselines last measured, not DTA."""
    _, methods = planned("throughput", dry_run=True)
    assert set(methods) >= {"dense-ckpt", "dta-torch", "dta-triton", "trl-tree", "sparse-flex", "dense"}
    assert methods[:3] == ("dense-ckpt", "dta-torch", "dta-triton")


def test_a_method_past_the_deadline_writes_skipped_rows(tmp_path, monkeypatch):
    """`GPU_CHECK_SLOW_S` (the rehearsal of a slow step): the first method's worker does not answer before the step's
    deadline, so its rows say `skipped:` and the step goes on; a method with no time left is skipped without a worker.
    Every planned row exists, none measured."""
    import time

    from benchmarks import workloads

    monkeypatch.setenv("GPU_CHECK_SLOW_S", "120")
    shape = plan.shape_of("qwen3-1.7b", dry_run=True)
    grid = [workloads.grpo(16, 2, 4, vocab_size=shape.vocab_size), workloads.grpo(8, 2, 4, vocab_size=shape.vocab_size)]
    grid[1].name = "grpo-small"
    path = tmp_path / "throughput.csv"
    gpu_bench.run_methods("throughput", ("dta-torch", "trl-tree"), grid, shape, "cpu", path, time.time() + 22, 1, 1)
    rows = plan.read_rows(path)
    assert [(r["method"], r["workload"]) for r in rows] == [(m, w.name) for m in ("dta-torch", "trl-tree")
                                                            for w in grid]
    assert all(r["error"].startswith("skipped:") and not r.get("tokens_per_s") for r in rows)
    assert "before the step's deadline" in rows[0]["error"] and "no time left" in rows[2]["error"]


def test_rows_of_a_backend_that_failed_correctness_are_marked(tmp_path):
    from benchmarks.gpu.summary import summary

    correctness = [dict(family="qwen2", backend="triton", precision="bf16-autocast", ok=0.0),
                   dict(family="qwen2", backend="torch", precision="bf16-autocast", ok=1.0)]
    rows = [gpu_bench.mark_checked(dict(method=m, **extra), correctness) for m, extra in
            (("dta-triton", {}), ("dta-torch", {}), ("trl-tree", dict(oracle_ok=0, oracle_err=0.3)),
             ("sparse-flex", dict(oracle_ok=1, oracle_err=1e-6)), ("dense", {}))]
    assert rows[0]["checked"].startswith("FAILED: backend triton") and rows[0]["error"] == rows[0]["checked"]
    assert rows[1]["checked"] == "ok" and not rows[1].get("error")
    assert rows[2]["checked"].startswith("FAILED: its oracle check") and rows[3]["checked"] == "ok"
    assert "checked" not in rows[4]
    for r in rows:
        plan.append_row(tmp_path / "throughput.csv", dict(step="throughput", workload="w", model_shape="m",
                                                               tokens_per_s=1.0, step_s=1.0, **r))
    summary(tmp_path, [], dry_run=False)
    text = (tmp_path / "summary.md").read_text()
    assert "FAILED: backend triton" in text and "median_step_s" in text and "ideal_ratio" in text
    assert "| loss |" in text.replace("loss | checked", "loss |") and "trl-tree" in text
