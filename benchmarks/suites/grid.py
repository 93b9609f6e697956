"""A grid of methods x workloads, each (workload, method) in its own process: build, check against the oracle, time.

[`run_grid`] is what `bench_engine`, `run`, `bench_hybrid` and `bench_side_by_side` measure with; [`MethodRun`] is one
method on one workload inside its worker process. One training step = `provider.forward_backward(seqs, loss_fn)` +
an AdamW step; the fastest of the timed steps is kept (other processes only ever add time), the median beside it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING

import torch

from trl_dta.flops import dense_flops, ideal_ratio, padded_dense_flops, tree_flops

from ..baselines.dense import DenseProvider
from ..harness.cli import log, set_threads
from ..harness.isolation import Worker, run_isolated
from ..harness.memory import PeakMemory
from ..harness.models import build_model, make_loss_fn, make_optimizer, model_shape, parse_dtype
from ..harness.oracle import ORACLE_TOL, oracle_error, oracle_logps
from ..reporting.results import DENSE_VARIANTS, fill_ratios, fmt
from .providers import PROVIDERS, MethodConfig, accounting

if TYPE_CHECKING:
    from ..workloads import Workload


class MethodRun:
    """One method on one workload: model, optimizer and provider built once, then timed steps on demand.

    Built inside a `Worker` process: the constructor builds everything, takes the memory baseline and runs
    one untimed warm-up step on the whole batch; `step()` times one training step (forward + backward + AdamW step)
    on the whole batch; `result()` returns the CSV row (peak memory over all steps, warm-up included).
    """

    def __init__(self, workload: Workload, method: str, shape: str, device: str = "cpu",
                 dtype: str = "fp32", cfg: MethodConfig | None = None, threads: int | None = None, seed: int = 0,
                 family: str = "qwen", reference: list[torch.Tensor] | None = None):
        if method not in PROVIDERS:
            raise ValueError(f"unknown method {method!r}; choose from {list(PROVIDERS)}")
        self.workload, self.method, self.device, self.dtype = workload, method, device, dtype
        self.cfg = cfg or MethodConfig()
        self.shape = model_shape(shape)
        set_threads(threads)
        torch.manual_seed(seed)
        self.model = build_model(self.shape, parse_dtype(dtype), device, seed=seed, family=family)
        self.optimizer = make_optimizer(self.model)
        self.provider = PROVIDERS[method](self.model, self.cfg)
        self.tree = workload.tree()
        self.loss_fn = make_loss_fn(len(workload.seqs), self.tree.n_tokens, seed)
        self.cuda = device.startswith("cuda")
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # CPU seconds of this process per step: on a loaded machine, the steadier
        self.loss = None
        self.stats: dict = {}
        self.mem = PeakMemory(device)
        self.mem.reset()
        # warm-up: one full step (allocator pools, kernel selection, lazily built state), not timed; its log-probs
        # (the initial weights) against the per-sequence oracle's
        out = self._step(workload.seqs, self.loss_fn)
        self.oracle_err = None if reference is None else oracle_error(out.logps, reference)

    def _step(self, seqs, loss_fn):
        out = self.provider.forward_backward(seqs, loss_fn)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def step(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        out = self._step(self.workload.seqs, self.loss_fn)
        if self.cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.times.append(dt)
        self.cpu_times.append(time.process_time() - c0)
        if self.loss is None:
            self.loss = out.loss  # the first timed step's loss (same parameters for every method)
        self.stats = {k: v for k, v in out.stats.items() if isinstance(v, (int, float, str))}
        return dt

    def _accounting(self) -> dict:
        """The oracle check, micro-batches, forwards, forwarded tokens and attention of the row."""
        tol = ORACLE_TOL[self.dtype]
        return {"oracle_err": self.oracle_err,
                "oracle_ok": None if self.oracle_err is None else int(self.oracle_err <= tol),
                **accounting(self.provider, self.stats, self.tree.n_sequences)}

    def result(self) -> dict:
        tree, times = self.tree, sorted(self.times)
        if isinstance(self.provider, DenseProvider):
            work = padded_dense_flops(tree.lengths, self.shape, self.provider.micro_batch_size).total
        else:
            work = tree_flops(tree, self.shape).total
        return {
            "workload": self.workload.name,
            "method": self.method,
            "n_sequences": tree.n_sequences,
            "n_tokens": tree.n_tokens,
            "n_tree_tokens": tree.n_tree_tokens,
            "compression_ratio": tree.compression_ratio,
            "ideal_ratio": ideal_ratio(tree, self.shape),
            "step_s": times[0],
            "median_step_s": times[len(times) // 2],
            "cpu_step_s": min(self.cpu_times),
            "steps": len(times),
            "tokens_per_s": tree.n_tokens / times[0],
            "peak_mem_mb": max(self.mem.peak_mb(), 0.0),
            "tflops": work / times[0] / 1e12,
            "dense_tflop": dense_flops(tree.lengths, self.shape).total / 1e12,
            "loss": self.loss,
            **self._accounting(),
            "stats": self.stats,
            "model_shape": self.shape.name,
            "device": self.device,
            "dtype": self.dtype,
            "loadavg": os.getloadavg()[0],
        }


def _error_row(w, tree, method, shape, device, dtype, error):
    return {"workload": w.name, "method": method, "n_sequences": tree.n_sequences, "n_tokens": tree.n_tokens,
            "n_tree_tokens": tree.n_tree_tokens, "compression_ratio": tree.compression_ratio,
            "ideal_ratio": ideal_ratio(tree, model_shape(shape)), "error": error, "model_shape": shape,
            "device": device, "dtype": dtype}


def run_grid(
    grid: list[Workload],
    methods: list[str],
    shape: str,
    device: str,
    dtype: str,
    cfg: MethodConfig,
    rounds: int = 2,
    interleave: bool | None = None,
    isolate: bool = True,
    threads: int | None = None,
    timeout: float | None = None,
    family: str = "qwen",
    oracle: bool = True,
) -> list[dict]:
    """Every method on every workload, each in its own process; failures become rows with an `error`.

    `oracle`: first the per-sequence oracle's log-probs (`oracle_logps`, its own process), against which each method's
    warm-up step is checked before it is timed (`oracle_ok`, `oracle_err`; a failed check also fills `error`).

    `family` builds the model of another family at the shape's width (`harness.models.FAMILY_NAMES`); its rows'
    workloads are named `<workload>@<family>`, so that each family's methods are compared with its own dense path.

    Per workload, one `Worker` process per method is built (model, optimizer, warm-up); then `rounds` timed
    steps per method, interleaved round-robin across the methods (`interleave`, default on CPU: other processes'
    load then hits every method alike) or one method after the other (default on GPU, where only one model is alive
    at a time). The fastest step is kept (other processes only ever add time); the median is reported too.
    """
    interleave = (not device.startswith("cuda")) if interleave is None else interleave
    rows = []
    if family != "qwen":
        grid = [dataclasses.replace(w, name=f"{w.name}@{family}") for w in grid]
    for w in grid:
        tree = w.tree()
        log(f"== {w.name}: {len(w.seqs)} seqs, {tree.n_tokens} tokens, {tree.n_tree_tokens} tree tokens "
                   f"({tree.compression_ratio:.2f}x), ideal {ideal_ratio(tree, model_shape(shape)):.2f}x  "
                   f"[{w.description}]")
        results: dict[str, dict] = {}
        errors: dict[str, str] = {}
        reference = None
        if oracle:
            try:
                reference = run_isolated(oracle_logps, w, shape, device, dtype, 0, family, threads,
                                                isolate=isolate, timeout=timeout)
            except RuntimeError as e:
                log(f"   oracle FAILED (no oracle check): {str(e).strip().splitlines()[-1]}")

        def fail(method, e):
            msg = str(e).strip().splitlines()
            errors[method] = msg[0] if msg else "failed"
            log(f"   {method:12s} FAILED: {errors[method]}\n" + "\n".join(msg[-12:]))

        def start(method):
            try:
                return Worker(MethodRun, w, method, shape, device, dtype, cfg, threads, isolate=isolate,
                                     timeout=timeout, family=family, reference=reference)
            except RuntimeError as e:
                fail(method, e)
                return None

        def run_steps(method, worker, n):
            try:
                for _ in range(n):
                    dt = worker.call("step")
                    log(f"   {method:12s} {dt:8.2f} s/step {tree.n_tokens / dt:9.0f} tok/s")
                return True
            except RuntimeError as e:
                fail(method, e)
                worker.close()
                return False

        def finish(method, worker):
            try:
                results[method] = worker.call("result")
                r = results[method]
                if r.get("oracle_ok") == 0:
                    r["error"] = f"failed its oracle check: log-prob error {r['oracle_err']:.3g}"
                log(f"   {method:12s} best {r['step_s']:.2f} s  peak {r['peak_mem_mb']:.0f} MB  "
                           f"loss {r['loss']:.6g}  oracle {fmt(r.get('oracle_err'))}  "
                           f"load {r['loadavg']:.1f}")
            except RuntimeError as e:
                fail(method, e)
            worker.close()

        if interleave:
            workers = {m: start(m) for m in methods}
            workers = {m: x for m, x in workers.items() if x is not None}
            for _ in range(rounds):
                for m in list(workers):
                    if not run_steps(m, workers[m], 1):
                        del workers[m]
            for m, x in workers.items():
                finish(m, x)
        else:
            for m in methods:
                x = start(m)
                if x is not None and run_steps(m, x, rounds):
                    finish(m, x)
        for m in methods:
            rows.append(results[m] if m in results else _error_row(w, tree, m, shape, device, dtype,
                                                                   errors.get(m, "failed")))
    fill_ratios(rows)
    check_losses(rows)
    return rows


def check_losses(rows: list[dict], rtol: float = 1e-3) -> None:
    """Flag methods whose first-step loss differs from a plain dense variant's: every provider computes the same
    loss."""
    for row in rows:
        ref = next((r for r in rows if r["workload"] == row["workload"] and r["method"] in DENSE_VARIANTS
                    and r.get("loss") is not None), None)
        if ref is None or ref.get("loss") is None or row.get("loss") is None:
            continue
        if abs(row["loss"] - ref["loss"]) > rtol * max(abs(ref["loss"]), 1e-6):
            row["error"] = f"loss {row['loss']:.6g} != {ref['method']} {ref['loss']:.6g}"
            log(f"!! {row['workload']}/{row['method']}: {row['error']}")
