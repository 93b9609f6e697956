"""The oracle check of the benchmarks' methods: a wrong baseline is no baseline.

Before a method is timed, the log-probs of its warm-up step (the initial weights) are compared with the per-sequence
oracle's: the same model on each sequence alone, no padding, an exact `log_softmax` over the vocabulary. The check
passes when the relative L2 error (all sequences together) is at most `ORACLE_TOL` of the run's dtype.
"""

from __future__ import annotations

import torch

from ..baselines.sparse import torch_logprobs
from .cli import set_threads
from .models import build_model, parse_dtype

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


def per_sequence_logps(model, seqs, device, autocast: bool = False) -> list[torch.Tensor]:
    """The oracle's log-probs of `model`: each sequence alone, no padding, an exact `log_softmax` over the vocabulary
    in chunks (under bf16 autocast with `autocast`, TRL's precision).

    Args:
        model ([`~transformers.PreTrainedModel`]): a causal LM (its decoder and output embeddings are used).
        seqs (`list[torch.LongTensor]`): the sequences, each of shape `(len_i,)`.
        device (`str` or `torch.device`): the model's device.
        autocast (`bool`, *optional*, defaults to `False`): run under bf16 autocast.

    Returns:
        `list[torch.Tensor]`: float32 log-probs on the CPU, each of shape `(len_i - 1,)`.
    """
    head, out = model.get_output_embeddings(), []
    with torch.no_grad(), torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
        for s in seqs:
            ids = torch.as_tensor(s, device=device)[None]
            hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
            out.append(torch_logprobs(hidden, head.weight, head.bias, ids[0, 1:], 1.0).float().cpu())
    return out


def oracle_logps(workload, shape: str, device: str, dtype: str, seed: int = 0, family: str = "qwen",
                 threads: int | None = None) -> list[torch.Tensor]:
    """[`per_sequence_logps`] of a fresh model with the methods' initial weights (run in its own process) on the
    sequences of `workload` (a `benchmarks.workloads.Workload`)."""
    set_threads(threads)
    model = build_model(shape, parse_dtype(dtype), device, seed=seed, family=family)
    return per_sequence_logps(model, workload.seqs, device)
