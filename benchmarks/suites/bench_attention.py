"""Attention-op benchmark: peak memory and time of one forward+backward of `two_part_attention` per backend.

The prefix-memory case: B sibling completions of 32 tokens under one 4096-token prompt, Qwen2-shaped attention
(hidden 256 = 4 heads x 64, 2 KV heads, 4 layers, fp32). Per layer the path's keys/values `(1, 2, 4096, 64)` are
autograd leaves (as the engine's stack frames are) and the rows' queries/keys/values are fresh leaves; one step is the
attention of all layers forward, then backward of `sum(out * weight)`. The concatenating reference (`sdpa`) saves
`[path.expand(B) ; own]` per layer, B copies of the path; the two-part backends save the path once, so their memory
grows with the rows' own tokens only.

Each (backend, siblings) runs in its own forked process, the backends' steps interleaved; peak memory (first step) is
the resident-set high-water mark above the resident set once the inputs exist (CPU), or the CUDA allocator peak
above the allocation at that point; time is the median step after a warm-up step. `measure()` is also how the
`"auto"` table (`trl_dta.kernels.AUTO`) was chosen: run it for the device at hand.

```
python -m benchmarks.suites.bench_attention                          # CPU: sdpa vs torch, 4 / 32 / 128 siblings
python -m benchmarks.suites.bench_attention --device cuda --dtype bf16 --backends sdpa torch flash triton
```

Writes `benchmarks/results/attention[-<tag>].csv` (columns in `COLUMNS`).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time

import torch

from trl_dta.kernels import BACKENDS

from ..harness.cli import log, set_threads
from ..harness.isolation import Worker
from ..harness.memory import PeakMemory
from ..harness.models import parse_dtype
from ..reporting.results import RESULTS_DIR, markdown_table

COLUMNS = ["backend", "device", "dtype", "layers", "n_heads", "n_kv_heads", "head_dim", "prompt", "completion",
           "siblings", "peak_mem_mb", "fwd_bwd_s", "path_kernel", "own_kernel", "error"]


class _Bench:
    """One configuration in its own forked process: the inputs, then `step()` = one timed forward+backward."""

    def __init__(self, backend: str, siblings: int, args):
        from trl_dta.kernels import part_kernels

        set_threads(args.threads)
        self.backend = backend
        self.device, dtype = torch.device(args.device), parse_dtype(args.dtype)
        gen = torch.Generator(device="cpu").manual_seed(0)

        def leaf(*shape):
            return torch.randn(*shape, generator=gen).to(device=self.device, dtype=dtype).requires_grad_()

        # Rows' tensors as transformers makes them: (B, L, heads, D) storage, passed transposed to (B, heads, L, D).
        self.layers = [dict(
            path_key=leaf(1, args.n_kv_heads, args.prompt, args.head_dim),  # (1, H_kv, P, D), stored once
            path_value=leaf(1, args.n_kv_heads, args.prompt, args.head_dim),
            query=leaf(siblings, args.completion, args.n_heads, args.head_dim),  # (B, L, H, D)
            key=leaf(siblings, args.completion, args.n_kv_heads, args.head_dim),  # (B, L, H_kv, D)
            value=leaf(siblings, args.completion, args.n_kv_heads, args.head_dim),
        ) for _ in range(args.layers)]
        self.weight = torch.randn(args.head_dim, generator=gen).to(device=self.device, dtype=dtype)
        first = self.layers[0]
        self.kernels = part_kernels(first["query"].transpose(1, 2), first["path_key"], first["key"].transpose(1, 2),
                                    backend=backend)
        self.peak = PeakMemory(args.device)
        self.peak_mb = None

    def step(self) -> float:
        """Seconds of one forward+backward over all layers; the first call also measures the peak memory."""
        from trl_dta.kernels import two_part_attention

        for tensors in self.layers:
            for t in tensors.values():
                t.grad = None
        if self.peak_mb is None:
            self.peak.reset()
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # nothing queued before the timed region
        start = time.perf_counter()
        loss = 0.0
        for t in self.layers:
            out = two_part_attention(t["query"].transpose(1, 2), t["path_key"], t["path_value"],
                                     t["key"].transpose(1, 2), t["value"].transpose(1, 2), backend=self.backend)
            loss = loss + (out.transpose(1, 2).contiguous() * self.weight).sum()  # as dta_attention returns it
        loss.backward()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if self.peak_mb is None:
            self.peak_mb = self.peak.peak_mb()
        return seconds

    def result(self) -> dict:
        return dict(peak_mem_mb=round(self.peak_mb, 1), path_kernel=self.kernels[0], own_kernel=self.kernels[1])


def measure(backends, siblings: int, args) -> list[dict]:
    """Rows for `backends` at one sibling count; their steps are interleaved (round-robin), each in its own process,
    so that interference from other processes on a shared machine is spread evenly."""
    workers, times, errors = {}, {}, {}
    for backend in backends:
        try:
            workers[backend] = Worker(_Bench, backend, siblings, args, timeout=1800)
            times[backend] = []
        except RuntimeError as e:
            errors[backend] = str(e).splitlines()[0]
    for _ in range(args.reps):
        for backend, worker in list(workers.items()):
            try:
                times[backend].append(worker.call("step"))
            except RuntimeError as e:
                errors[backend] = str(e).splitlines()[0]
                del workers[backend]
    rows = []
    for backend in backends:
        row = dict(backend=backend, device=args.device, dtype=args.dtype, layers=args.layers, n_heads=args.n_heads,
                   n_kv_heads=args.n_kv_heads, head_dim=args.head_dim, prompt=args.prompt,
                   completion=args.completion, siblings=siblings, error=errors.get(backend, ""))
        if backend in workers:
            row.update(workers[backend].call("result"))
            row["fwd_bwd_s"] = round(statistics.median(times[backend][1:] or times[backend]), 4)  # 1st: warm-up
            workers[backend].close()
        rows.append(row)
        log(" ".join(f"{k}={row.get(k, '')}" for k in COLUMNS))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["sdpa", "torch"], choices=BACKENDS)
    parser.add_argument("--siblings", nargs="+", type=int, default=[4, 32, 128])
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--completion", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--n-kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=5, help="steps per configuration (the first is the warm-up)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    rows = [row for siblings in args.siblings for row in measure(args.backends, siblings, args)]
    out = RESULTS_DIR / f"attention{'-' + args.tag if args.tag else ''}.csv"
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    log(f"wrote {out}")
    print(markdown_table(rows, ["backend", "siblings", "peak_mem_mb", "fwd_bwd_s", "path_kernel",
                                       "own_kernel", "error"]))


if __name__ == "__main__":
    main()
