"""`benchmarks.harness.isolation.Worker`, the benchmarks' process isolation, under the start methods the GPU check
needs: a CUDA build starts workers from a fork server (a child forked after the parent touched CUDA cannot use it), a
CPU-only build forks; either builds a real model in the child and measures a training step there."""

from __future__ import annotations

import os

import pytest

from benchmarks import workloads
from benchmarks.gpu.bench import GridRun
from benchmarks.gpu.plan import shape_of
from benchmarks.harness.isolation import Worker, start_method


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_worker_measures_a_step_in_a_child(start):
    shape = shape_of("qwen3-0.6b", dry_run=True)
    w = workloads.grpo(16, 3, 4, vocab_size=shape.vocab_size)
    worker = Worker(GridRun, "dta-torch", shape, "cpu", "fp32", 1, start=start, timeout=300)
    try:
        assert worker.call("pid") != os.getpid()
        row = worker.call("run", w, 2)
    finally:
        worker.close()
    assert not row.get("error") and row["steps"] == 2 and row["tokens_per_s"] > 0
    assert row["n_sequences"] == 3 and row["n_tree_tokens"] == 16 + 3 * 4 and row["model_shape"] == "dry-qwen3-0.6b"


def test_start_method(monkeypatch):
    import torch

    monkeypatch.delenv("DTA_BENCH_START_METHOD", raising=False)
    assert start_method() == ("fork" if torch.version.cuda is None else "forkserver")
    monkeypatch.setenv("DTA_BENCH_START_METHOD", "spawn")
    assert start_method() == "spawn"
    monkeypatch.setenv("DTA_BENCH_START_METHOD", "thread")
    with pytest.raises(ValueError, match="DTA_BENCH_START_METHOD must be one of"):
        start_method()
