"""Attention kernels for DTA: the two-part (path + own rows) attention and its backends.

`two_part_attention(query, path_key, path_value, key, value, ...)` attends a batch of new rows over one shared path
stored once (no expand, no concatenation), see `two_part`. What each backend runs, per part:

| backend  | device | path part (folded)   | own part, causal rows | own part, packed rows | `math` fallback for    |
|----------|--------|----------------------|-----------------------|-----------------------|------------------------|
| `sdpa`   | any    | concatenated, B copies | (one explicit mask) | (one explicit mask)   | - (the reference)      |
| `torch`  | CPU    | aten CPU flash       | aten CPU flash        | aten CPU flash + mask | soft-capping           |
| `torch`  | CUDA   | aten flash (16-bit)  | aten flash            | `math`                | window, soft-cap, fp32 |
| `flash`  | CUDA   | flash-attn >= 2.7    | flash-attn            | `torch` / `math`      | window cutting path    |
| `triton` | CUDA*  | interval kernel      | interval kernel       | interval kernel       | fp32, fp64 (CUDA)      |

(*) and CPU under `TRITON_INTERPRET=1` (tests only: fp32/fp64, no bf16, slow). `auto` picks per device from `AUTO` (CPU:
`torch`; CUDA: `flash` when installed, else `torch`), measured with `benchmarks/suites/bench_attention.py`. Every
backend is exact (GQA without repeating the path, sliding windows, soft-capping, attention sinks, padding); `math` is
the plain-PyTorch part kernel (one part's scores materialised transiently, the path still stored once). Sinks enter at
the merge (`two_part`), so every part kernel serves them unchanged. `merge_parts` (the log-sum-exp merge) and
`attend_part` (one part, rows optionally folded over shared keys) are what the generation cache's attention builds on.
"""

from .masks import PartMask, key_end_from_row_mask
from .two_part import (
    AUTO,
    BACKENDS,
    attend_part,
    available_backends,
    merge_parts,
    part_kernels,
    resolve_backend,
    two_part_attention,
)

__all__ = ["AUTO", "BACKENDS", "PartMask", "attend_part", "available_backends", "key_end_from_row_mask", "merge_parts",
           "part_kernels", "resolve_backend", "two_part_attention"]
