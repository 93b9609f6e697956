"""The measuring steps of the GPU check (`benchmarks/gpu/check.sh`); each appends its rows to `<out>/<step>.csv` the
moment they exist, so a run stopped at any point keeps every finished row.

```
python -m benchmarks.gpu.bench throughput --shape qwen3-1.7b --out DIR      # methods x workloads, bf16 autocast
python -m benchmarks.gpu.bench trainer --shape qwen3-0.6b --out DIR         # GRPOTrainer vs DTAGRPOTrainer
python -m benchmarks.gpu.bench prefix-memory --shape qwen3-1.7b --out DIR   # one long prompt, 4 / 32 / 128 siblings
python -m benchmarks.gpu.bench summary --out DIR                            # summary.md and throughput.png
```

`--dry-run`: CPU, a tiny model and small sizes, the same files, columns, methods and workloads (`summary --dry-run`
then fails unless every planned row exists without an error). `--deadline` (epoch seconds): work that would end after
it is skipped, with a row that says so.

**Throughput** (`throughput.csv`). Methods, in this order (the ones that matter first: a method that does not fit
before the step's deadline gets a `skipped` row), all under TRL's precision (float32 parameters, bf16 autocast):
`dense-ckpt`, TRL's default dense path (micro-batches of 8 padded rows, `per_device_train_batch_size`; HF gradient
checkpointing, `gradient_checkpointing=True`; TRL's fused LM head: `baselines/dense.py`); `dta-torch`, `dta-triton`,
`DTAEngine.forward_backward` on the named attention backend, every graph kept; `trl-tree`, TRL's own tree packing
(`baselines/trl_tree.py`: TRL's `TreeRow` planner and packer, the whole batch in one row, flash-attn's varlen kernel
where importable, else torch's, in place of FA3 from the kernels hub); `sparse-flex`, the packed tree under torch's
compiled FlexAttention with the ancestor test's block mask, the whole tree in one row (`baselines/sparse.py`); `dense`,
TRL's micro-batches of 8 padded rows without checkpointing (where it fits). `trl-tree` and `sparse-flex` are checked
against the per-sequence oracle (the same model on each row alone) before they are timed (`oracle_ok`,
`oracle_err`); the DTA rows carry the correctness step's verdict on their backend (`checked`).

Workloads: `tau2-airline` (per-turn rows of real airline episodes, `workloads.tau2_airline`) and the GRPO batch
`grpo-p1024-g16-c256` (`plan.py`: what each step runs). One worker process per method (`harness.isolation.Worker`; a
fork server on CUDA) builds the model and its
AdamW state once, then per workload runs one untimed warm-up step (Triton compilation, cuBLAS selection, the
allocator's pools) and `STEPS` timed steps (CUDA events), the same number for every method; the best step is kept
(the median beside it). Peak
memory: the allocator's peak over the workload's steps above the model and optimizer state. Running out of memory is
a result (an error row); the worker goes on with the next workload. Ratios per workload: `vs_dense_ckpt` (tokens/s
over `dense-ckpt`'s: the seed's 8.31x is against this baseline), `vs_trl_tree`, `vs_sparse` (over `sparse-flex`: the
seed's 1.70x was against a packed mask), `vs_dense`.

**Deadlines.** `--deadline` (epoch seconds; `check.sh` passes each step's own end, also as
`GPU_CHECK_STEP_DEADLINE`): a method whose worker would start too late, or does not answer before it, gets a row whose
`error` starts with `skipped:` and the step goes on. `GPU_CHECK_SLOW_S` (seconds) makes every method sleep that long
before its first workload: the dry run's rehearsal of a slow step (`GPU_CHECK_SLOW_S=100 bash
benchmarks/gpu/check.sh --dry-run --only throughput-1.7b` shows the skipped rows).

**Trainer** (`trainer.csv`): `suites.trainer_steps.measure`, TRL's `GRPOTrainer` (`trl+ckpt`) and
`DTAGRPOTrainer` (`dta+ckpt`) with TRL's defaults (bf16 autocast, gradient checkpointing, micro-batches of 8) on the
GRPO batch: whole optimizer steps, generation excluded; `vs_trl`.

**Prefix memory** (`prefix_memory.csv`): one 4,096-token prompt with 4 / 32 / 128 completions of 32 tokens;
`dta-sdpa` (the concatenating reference, the path once per sibling) against `dta-torch` and `dta-triton` (the path
once): peak memory, `mem_vs_first` (over the same method's at 4 siblings).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import time
from pathlib import Path

import torch

from trl_dta.flops import ModelShape, ideal_ratio

from .. import workloads
from ..harness.cli import log, set_threads
from ..harness.isolation import Worker, run_isolated
from ..harness.memory import PeakMemory
from ..harness.models import build_model, make_loss_fn, make_optimizer, parse_dtype
from ..harness.oracle import ORACLE_TOL, oracle_error, per_sequence_logps
from ..suites.providers import PROVIDERS, TRL_MICRO_BATCH_SIZE, MethodConfig, accounting
from ..suites.trainer_steps import measure
from .plan import (
    BACKEND_OF,
    METHODS,
    ORACLE_CHECKED,
    PRECISION,
    PREFIX_METHODS,
    STEPS,
    TRAINER_METHODS,
    append_row,
    fill_ratios,
    grid_workloads,
    prefix_workloads,
    read_rows,
    shape_of,
)


class _Timer:
    """Seconds of one region: CUDA events on the current stream on GPU, `perf_counter` on CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1000
        else:
            self.seconds = time.perf_counter() - self.t0


class GridRun:
    """One method on one model in a worker process: the model and AdamW state built once, then `run(workload)`.

    Args:
        method (`str`): a key of `suites.providers.PROVIDERS`.
        shape ([`~trl_dta.flops.ModelShape`]): the model.
        device (`str`): `"cuda"` or `"cpu"`.
        precision (`str`, *optional*, defaults to `"bf16-autocast"`): float32 parameters under bf16 autocast (TRL's
            default), or a parameter dtype of `harness.models.DTYPES`.
        threads (`int`, *optional*): torch threads (CPU).
    """

    def __init__(self, method: str, shape: ModelShape, device: str, precision: str = PRECISION,
                 threads: int | None = None, seed: int = 0):
        set_threads(threads)
        self.method, self.shape, self.device, self.precision = method, shape, device, precision
        self.autocast = precision == "bf16-autocast"
        dtype = torch.float32 if self.autocast else parse_dtype(precision)
        torch.manual_seed(seed)
        self.model = build_model(shape, dtype, device, seed=seed)
        self.optimizer = make_optimizer(self.model)
        # `dense` and `dense-ckpt`: TRL's micro-batch of 8 padded rows; the tree methods: the whole tree in one row
        self.provider = PROVIDERS[method](self.model, MethodConfig(micro_batch_size=TRL_MICRO_BATCH_SIZE))
        self.cuda = device.startswith("cuda")
        self.mem = PeakMemory(device)

    @staticmethod
    def pid() -> int:
        return os.getpid()

    def _step(self, seqs, loss_fn):
        with torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.provider.forward_backward(seqs, loss_fn)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def _accounting(self, stats: dict, n_rows: int) -> dict:
        """Micro-batches, model calls, forwarded and padded tokens, the attention run (`providers.accounting`)."""
        return accounting(self.provider, stats, n_rows)

    def _oracle(self, seqs) -> list[torch.Tensor]:
        """The per-sequence oracle's log-probs (each row alone, no padding) in this run's precision."""
        return per_sequence_logps(self.model, seqs, self.device, self.autocast)

    def run(self, workload: workloads.Workload, steps: int = STEPS) -> dict:
        """(`ORACLE_CHECKED` methods: the oracle's log-probs), one warm-up step (checked against them), then `steps`
        timed steps: the row. `GPU_CHECK_SLOW_S` sleeps first (the rehearsal of a slow step)."""
        time.sleep(float(os.environ.get("GPU_CHECK_SLOW_S", 0)))
        tree = workload.tree()
        row = dict(workload=workload.name, method=self.method, model_shape=self.shape.name, precision=self.precision,
                   device=self.device, n_sequences=tree.n_sequences, n_tokens=tree.n_tokens,
                   n_tree_tokens=tree.n_tree_tokens, compression_ratio=tree.compression_ratio,
                   ideal_ratio=ideal_ratio(tree, self.shape), description=workload.description)
        loss_fn = make_loss_fn(len(workload.seqs), tree.n_tokens)
        seqs = workload.seqs
        self.mem.reset()
        times, out = [], None
        try:
            reference = self._oracle(seqs) if self.method in ORACLE_CHECKED else None
            self.mem.reset()
            with _Timer(self.cuda) as warm:
                first = self._step(seqs, loss_fn)
            row["warmup_s"] = warm.seconds
            if reference is not None:
                row["oracle_err"] = oracle_error(first.logps, reference)
                row["oracle_ok"] = int(row["oracle_err"] <= ORACLE_TOL["bf16" if self.autocast else self.precision])
            row.update(self._accounting(first.stats, len(seqs)))
            while len(times) < steps:
                with _Timer(self.cuda) as t:
                    out = self._step(seqs, loss_fn)
                times.append(t.seconds)
        except torch.OutOfMemoryError as e:
            row["error"] = "out of memory: " + str(e).splitlines()[0][:200]
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            row["peak_mem_mb"] = max(self.mem.peak_mb(), 0.0)
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
        if times:
            best = min(times)
            row.update(step_s=best, median_step_s=sorted(times)[len(times) // 2], steps=len(times),
                       tokens_per_s=tree.n_tokens / best, loss=out.loss)
        return row


def mark_checked(row: dict, correctness: list[dict]) -> dict:
    """`row["checked"]`: `ok`, or `FAILED: ...` when the row's backend failed a correctness check (`correctness.csv`)
    or the method failed its oracle check; empty when nothing checked it. A failed row's `error` says so too."""
    backend = BACKEND_OF.get(row.get("method"))
    failed = [r for r in correctness if backend and r.get("backend") == backend and r.get("ok") != 1.0]
    if failed:
        cases = ", ".join(f"{r['family']}/{r['precision']}" for r in failed[:4])
        row["checked"] = f"FAILED: backend {backend} failed the correctness step ({cases})"
    elif row.get("oracle_ok") == 0:
        row["checked"] = f"FAILED: its oracle check (log-prob error {row['oracle_err']:.3g})"
    elif row.get("oracle_ok") == 1 or any(backend and r.get("backend") == backend for r in correctness):
        row["checked"] = "ok"
    if str(row.get("checked", "")).startswith("FAILED") and not row.get("error"):
        row["error"] = row["checked"]
    return row


def _skipped(step: str, workload, method: str, shape: ModelShape, why: str) -> dict:
    return dict(step=step, workload=workload.name, method=method, model_shape=shape.name, error=f"skipped: {why}",
                description=workload.description)


def run_methods(step: str, methods, grid, shape: ModelShape, device: str, path: Path, deadline: float,
                threads: int | None, steps: int = STEPS, precision: str = PRECISION) -> list[dict]:
    """Every method on every workload of `grid` (one worker per method), each row appended to `path` at once."""
    done = [r for r in read_rows(path) if r.get("step") == step]
    checks = read_rows(path.parent / "correctness.csv")
    for method in methods:
        left = deadline - time.time()
        if left < 15:
            for w in grid:
                append_row(path, _skipped(step, w, method, shape, "no time left before the deadline"))
            continue
        try:
            worker = Worker(GridRun, method, shape, device, precision, threads, timeout=left)
        except RuntimeError as e:
            why = str(e).splitlines()[0]
            why = "not started before the step's deadline" if "timed out" in why else "worker failed: " + why
            for w in grid:
                append_row(path, _skipped(step, w, method, shape, why))
            continue
        try:
            for w in grid:
                left = deadline - time.time()
                if worker is None or left < 5:
                    why = "the worker stopped (see the row above)" if worker is None else \
                        "no time left before the deadline"
                    append_row(path, _skipped(step, w, method, shape, why))
                    continue
                worker.timeout = left
                try:
                    row = worker.call("run", w, steps)
                except RuntimeError as e:  # timed out or died: the worker is gone
                    why = str(e).strip().splitlines()[0][:300]
                    if "timed out" in why:
                        why = f"skipped: not done before the step's deadline ({left:.0f} s left at its start)"
                    row = dict(step=step, workload=w.name, method=method, model_shape=shape.name,
                               description=w.description, error=why)
                    worker = None
                row["step"] = step
                mark_checked(row, checks)
                fill_ratios(row, done)
                done.append(row)
                append_row(path, row)
                log(_line(row))
        finally:
            if worker is not None:
                worker.close()
    return done


def _line(row: dict) -> str:
    if not row.get("tokens_per_s"):
        return f"   {row['workload']:22s} {row['method']:11s} {row.get('error', '')}"
    extra = "".join(f"  {k} {row[k]:.2f}x" for k in ("vs_dense_ckpt", "vs_sparse", "vs_trl") if row.get(k))
    return (f"   {row['workload']:22s} {row['method']:11s} {row['step_s']:8.3f} s {row['tokens_per_s']:10.0f} tok/s "
            f"peak {row['peak_mem_mb']:8.0f} MB{extra}")


# ---------------------------------------------------------------------------------------------------- steps


def throughput(args) -> None:
    from trl_dta.kernels import available_backends

    shape = shape_of(args.shape, args.dry_run)
    grid = grid_workloads(args.dry_run, shape.vocab_size)
    _announce("throughput", shape, grid)
    # flash-attn is never built here; with a carried wheel its backend is measured too.
    methods = METHODS + (("dta-flash",) if "flash" in available_backends(args.device) else ())
    run_methods("throughput", methods, grid, shape, args.device, args.out / "throughput.csv", args.deadline,
                args.threads, args.steps)


def prefix_memory(args) -> None:
    shape = shape_of(args.shape, args.dry_run)
    grid = prefix_workloads(args.dry_run, shape.vocab_size)
    _announce("prefix memory", shape, grid)
    path = args.out / "prefix_memory.csv"
    rows = run_methods("prefix-memory", PREFIX_METHODS, grid, shape, args.device, path, args.deadline, args.threads,
                       args.steps)
    for r in rows:
        if r.get("mem_vs_first"):
            log(f"   {r['workload']:22s} {r['method']:11s} peak {r['peak_mem_mb']:8.0f} MB "
                       f"({r['mem_vs_first']:.2f}x of its fewest siblings)")


def trainer(args) -> None:
    """`GRPOTrainer` vs `DTAGRPOTrainer` with TRL's defaults on the GRPO batch (whole optimizer steps)."""
    shape = shape_of(args.shape, args.dry_run)
    w = grid_workloads(args.dry_run, shape.vocab_size)[1]
    prompt_len, group = w.params["prompt_len"], w.params["group"]
    _announce("trainer", shape, [w])
    path = args.out / "trainer.csv"
    done = [r for r in read_rows(path) if r.get("step") == "trainer"]
    for method in TRAINER_METHODS:
        left = args.deadline - time.time()
        if left < 30:
            append_row(path, _skipped("trainer", w, method, shape, "no time left before the deadline"))
            continue
        try:
            row = run_isolated(measure, w, prompt_len, group, method, shape, args.device, "bf16", 8,
                                      args.steps, args.threads, timeout=left)
            row.update(step="trainer", precision="bf16-autocast (TRL's bf16=True)", description=w.description,
                       steps=args.steps)
        except RuntimeError as e:
            row = dict(step="trainer", workload=w.name, method=method, model_shape=shape.name,
                       error=str(e).strip().splitlines()[0][:300])
        fill_ratios(row, done)
        done.append(row)
        append_row(path, row)
        log(_line(row))


def _announce(step, shape, grid):
    for w in grid:
        tree = w.tree()
        log(f"== {step} {shape.name}: {w.name}: {tree.n_sequences} rows, {tree.n_tokens} tokens, "
                   f"{tree.n_tree_tokens} tree tokens ({tree.compression_ratio:.1f}x) [{w.description}]")


def summary(args) -> None:
    from .summary import summary as write_summary

    write_summary(args.out, [tuple(pair.split("=", 1)) for pair in args.expect], args.dry_run)


STEPS_BY_NAME = {"throughput": throughput, "trainer": trainer, "prefix-memory": prefix_memory, "summary": summary}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=list(STEPS_BY_NAME))
    p.add_argument("--shape", default="qwen3-1.7b")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model and sizes: the same files and columns")
    p.add_argument("--deadline", type=float, default=math.inf, help="epoch seconds; later work is skipped")
    p.add_argument("--expect", nargs="*", default=[],
                   help="summary: STEP=MODEL pairs a complete run has rows for (a dry run fails without them)")
    args = p.parse_args(argv)
    args.deadline = min(args.deadline, float(os.environ.get("GPU_CHECK_STEP_DEADLINE") or math.inf))
    args.device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("FAIL: no CUDA device; run with --dry-run on a CPU.")
    args.threads = 1 if args.dry_run else None
    args.steps = 1 if args.dry_run else STEPS  # timed steps (the trainer: optimizer steps after a warm-up one)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    STEPS_BY_NAME[args.step](args)


if __name__ == "__main__":
    # Run from the importable module, so that the worker classes pickle as `benchmarks.gpu.bench.*`, not `__main__.*`.
    from benchmarks.gpu.bench import main as _main

    _main()
