"""The oracle check of the benchmarks' methods (issue 33: a wrong baseline is no baseline).

Before a method is timed, the log-probs of its warm-up step (the initial weights) are compared with the per-sequence
oracle's: the same model on each sequence alone, no padding, an exact `log_softmax` over the vocabulary. The check
passes when the relative L2 error (all sequences together) is at most `ORACLE_TOL` of the run's dtype.
"""

from __future__ import annotations

import torch

from . import common, workloads
from .baselines.sparse import _torch_logprobs

# The bound per dtype, against the per-sequence forward in the run's own dtype. A wrong mask or position is an O(1)
# error; the kernels' reorderings stay far below these (measured ~1e-6 in float32 on this CPU).
ORACLE_TOL = {"fp32": 1e-4, "float32": 1e-4, "fp64": 1e-10, "float64": 1e-10, "bf16": 5e-2, "bfloat16": 5e-2,
              "fp16": 1e-2, "float16": 1e-2}


def oracle_error(logps: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Relative L2 error of the log-probs (all sequences together) against the reference's."""
    got = torch.cat([lp.detach().double().cpu().flatten() for lp in logps])
    want = torch.cat([lp.double().flatten() for lp in reference])
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).norm() / want.norm().clamp(min=1e-300))


def oracle_logps(workload: workloads.Workload, shape: str, device: str, dtype: str, seed: int = 0,
                 family: str = "qwen", threads: int | None = None) -> list[torch.Tensor]:
    """The per-sequence oracle: the model (the methods' initial weights) on each sequence alone, no padding, an exact
    `log_softmax` over the vocabulary in chunks; `[(len_i - 1,)]` on the CPU."""
    common.set_threads(threads)
    model = common.build_model(shape, common.parse_dtype(dtype), device, seed=seed, family=family)
    head = model.get_output_embeddings()
    out = []
    with torch.no_grad():
        for s in workload.seqs:
            ids = torch.as_tensor(s, device=device)[None]
            hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
            out.append(_torch_logprobs(hidden, head.weight, head.bias, ids[0, 1:], 1.0).float().cpu())
    return out


