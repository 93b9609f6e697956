"""Every Triton kernel variant the two-part attention can launch on CUDA, compiled offline (no GPU): registers, spills,
stack frame and shared memory per kernel x dtype x head_dim x mask flags x GPU architecture.

```
python -m benchmarks.gpu.triton_variants                     # sm_90 + sm_80, bf16 + fp16: results/triton-variants.csv
python -m benchmarks.gpu.triton_variants --arch 90 --dtype bf16 --jobs 2 --out /tmp/variants.csv
python -m benchmarks.gpu.triton_variants --selection ci   # what tests/attention_kernels/test_triton_compile.py compiles
```

A variant is what Triton compiles once: a kernel (`forward`, `dkdv`, `dq`), the input dtype (CUDA runs half precision
only, `triton_parts.TRITON.supports`), the padded head dim (`triton_parts.block_d`: 64 or 128 for the head dims served,
up to `MAX_HEAD_DIM`), and the constexpr mask flags (`CAUSAL`, `HAS_END`, `HAS_WINDOW`, `SOFTCAP`). The flag
combinations are not listed by hand: they are those `masks.plan_masks` produces for the path and the own part over
every kind of call (causal rows or packed rows, with or without a path, windows that cut into the path or not,
soft-capping or not). Tiles, warps and stages are `triton_parts.launch_config`'s. `triton.compile` with
`GPUTarget("cuda", arch, 32)` runs Triton's whole pipeline and its bundled `ptxas` (whose `-v` log gives registers and
spills); shared memory is Triton's own allocation, against the architecture's per-block limit (opt-in: sm_90 232,448 B,
sm_80 166,912 B).

Runs with `TRITON_INTERPRET` unset (the kernels must be `triton.jit` functions, not interpreted ones); every variant
is compiled afresh (`TRITON_ALWAYS_COMPILE=1`), `--jobs` at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import itertools
import os
import re
import sys
import time
from multiprocessing import get_context
from pathlib import Path

SHARED_LIMIT = {90: 232_448, 80: 166_912}  # bytes of shared memory a block may opt in to
HEAD_DIMS = (64, 128)
COLUMNS = ["arch", "kernel", "dtype", "head_dim", "flags", "block_m", "block_n", "num_warps", "num_stages",
           "registers", "spill_stores", "spill_loads", "stack_frame", "shared", "shared_limit", "compile_s",
           "triton", "error"]
_POINTERS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}  # the input dtype
_STATS = {"LSE", "DELTA"}  # the accumulation dtype (float32 for half precision)
_INDEX = {"QPOS", "KPOS", "KEND"}  # int64
_FLOATS = {"scale", "softcap"}
_CONSTEXPR = {"CAUSAL", "HAS_END", "HAS_WINDOW", "SOFTCAP", "BLOCK_M", "BLOCK_N", "BLOCK_D", "ACC"}


def reachable_flags() -> list[tuple[bool, bool, bool, bool]]:
    """`(CAUSAL, HAS_END, HAS_WINDOW, SOFTCAP)` of every part `two_part` can plan (path and own part)."""
    import torch

    from trl_dta.kernels.masks import plan_masks
    from trl_dta.kernels.triton_parts import mask_flags

    batch, q_len = 2, 4
    packed = (torch.arange(q_len).expand(batch, q_len), torch.arange(1, q_len + 1).expand(batch, q_len))
    found = set()
    for path_len, rows, window, softcap in itertools.product((0, 10), ("causal", "packed"), (None, 2, 100),
                                                             (None, 1.0)):
        positions, key_end = (None, None) if rows == "causal" else (packed[0] + path_len, packed[1])
        path_mask, own_mask = plan_masks(path_len, batch, q_len, positions, key_end, window, "cpu")
        for mask in (path_mask, own_mask):
            if mask is not None:
                found.add(tuple(mask_flags(mask, softcap).values()))
    return sorted(found)


def flags_name(flags) -> str:
    names = [n for n, on in zip(("causal", "end", "window", "softcap"), flags) if on]
    return "+".join(names) or "none"


def _signature(fn, dtype: str) -> dict[str, str]:
    types = {}
    for name in fn.arg_names:
        types[name] = ("*" + dtype if name in _POINTERS else "*fp32" if name in _STATS else "*i64" if name in _INDEX
                       else "fp32" if name in _FLOATS else "constexpr" if name in _CONSTEXPR else "i32")
    return types


def compile_variant(arch: int, kernel: str, dtype: str, head_dim: int, flags) -> dict:
    """Compile one variant for `sm_<arch>`; the row of `COLUMNS`."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trl_dta.kernels import triton_parts

    fn = triton_parts.jit_kernel(kernel)
    config = triton_parts.launch_config(kernel, head_dim)
    row = dict(arch=arch, kernel=kernel, dtype=dtype, head_dim=head_dim, flags=flags_name(flags),
               block_m=config.block_m, block_n=config.block_n, num_warps=config.num_warps,
               num_stages=config.num_stages, shared_limit=SHARED_LIMIT[arch], triton=triton.__version__, error="")
    signature = _signature(fn, dtype)
    constexprs = dict(zip(("CAUSAL", "HAS_END", "HAS_WINDOW", "SOFTCAP"), flags), BLOCK_M=config.block_m,
                      BLOCK_N=config.block_n, BLOCK_D=triton_parts.block_d(head_dim), ACC=tl.float32)
    # As the launcher specialises them: every pointer 16-byte aligned (PyTorch's allocations are).
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if signature[n].startswith("*")}
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG prints ptxas's -v report
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                                      options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    except Exception as e:  # a compile error is a result row
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        return row
    row["compile_s"] = round(time.perf_counter() - start, 2)
    row["shared"] = compiled.metadata.shared
    text = log.getvalue()
    for key, pattern in (("registers", r"Used (\d+) registers"), ("spill_stores", r"(\d+) bytes spill stores"),
                         ("spill_loads", r"(\d+) bytes spill loads"), ("stack_frame", r"(\d+) bytes stack frame")):
        found = re.findall(pattern, text)
        row[key] = int(found[-1]) if found else None
    if row["registers"] is None:
        row["error"] = "no ptxas report (TRITON_DUMP_PTXAS_LOG had no effect)"
    return row


def _job(args):
    return compile_variant(*args)


# The variant with the most mask code: the own part with every flag (packed rows, a window, soft-capping).
HEAVIEST = ((True, True, True, True),)
SELECTIONS = ("all", "ci")


def variants(archs, dtypes, selection: str = "all") -> list[tuple]:
    """`(arch, kernel, dtype, head_dim, flags)` to compile: `all` of them, or `ci`: every variant of sm_90 bf16 (the
    lent GPU under TRL's default precision) and the `HEAVIEST` flag sets of every other arch x dtype (a CI budget:
    one variant compiles in 1-4 s on one core)."""
    flag_sets = reachable_flags()
    out = []
    for arch, dtype in itertools.product(archs, dtypes):
        full = selection == "all" or (arch, dtype) == (90, "bf16")
        out += [(arch, kernel, dtype, dim, flags) for dim in HEAD_DIMS for flags in flag_sets
                if full or flags in HEAVIEST for kernel in ("forward", "dkdv", "dq")]
    return out


def run(archs=(90, 80), dtypes=("bf16", "fp16"), jobs: int | None = None, out: str | Path | None = None,
        selection: str = "all", max_variants: int | None = None, log=print) -> list[dict]:
    """Compile every variant (`jobs` processes); write the rows to `out` (CSV) and return them."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("benchmarks.gpu.triton_variants compiles the kernels: run it with TRITON_INTERPRET unset.")
    # Inherited by the spawned compile processes: every variant compiled afresh (a cached kernel skips ptxas, whose
    # log is the register report), ptxas's log printed, and Triton 3.9's fp-fusion default said explicitly.
    os.environ.update(TRITON_ALWAYS_COMPILE="1", TRITON_DUMP_PTXAS_LOG="1")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    todo = variants(archs, dtypes, selection)[:max_variants]
    jobs = jobs or os.cpu_count() or 1
    log(f"compiling {len(todo)} Triton variants ({len(reachable_flags())} mask-flag sets) on {jobs} processes")
    start = time.perf_counter()
    with get_context("spawn").Pool(jobs) as pool:
        rows = pool.map(_job, todo, chunksize=1)
    log(f"compiled in {time.perf_counter() - start:.0f} s")
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
    return rows


def summary(rows: list[dict]) -> str:
    """One line per (arch, kernel, dtype, head_dim): the worst registers, spills and shared memory over the flags."""
    lines = ["| arch | kernel | dtype | head_dim | tiles (m x n), warps, stages | registers (max) | spill bytes "
             "(max stores / loads) | shared B (max) | compile s (max) | errors |", "|" + "---|" * 10]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["arch"], r["kernel"], r["dtype"], r["head_dim"]), []).append(r)
    for (arch, kernel, dtype, dim), group in groups.items():
        ok = [r for r in group if not r["error"]]
        first = group[0]
        worst = {k: max((r[k] or 0) for r in ok) if ok else None
                 for k in ("registers", "spill_stores", "spill_loads", "shared", "compile_s")}
        lines.append(f"| sm_{arch} | {kernel} | {dtype} | {dim} | {first['block_m']} x {first['block_n']}, "
                     f"{first['num_warps']}, {first['num_stages']} | {worst['registers']} | {worst['spill_stores']} / "
                     f"{worst['spill_loads']} | {worst['shared']} | {worst['compile_s']} | "
                     f"{len(group) - len(ok)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=sorted(SHARED_LIMIT))
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    p.add_argument("--jobs", type=int, default=None, help="compile processes (default: all cores)")
    p.add_argument("--selection", default="all", choices=SELECTIONS, help="every variant, or the CI subset")
    p.add_argument("--max-variants", type=int, default=None, help="only the first N (the GPU check's dry run)")
    p.add_argument("--out", default="benchmarks/results/triton-variants.csv")
    args = p.parse_args(argv)
    rows = run(args.arch, args.dtype, args.jobs, args.out, args.selection, args.max_variants)
    print(summary(rows))
    print(f"wrote {args.out}")
    errors = [r for r in rows if r["error"]]
    if errors:
        raise SystemExit(f"{len(errors)} variants failed to compile, e.g. {errors[0]}")


if __name__ == "__main__":
    sys.exit(main())
