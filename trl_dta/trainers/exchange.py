"""Rows exchanged between ranks (`dta_balance`): one balanced forest per rank.

After the rollouts of a step are generated and scored, every rank holds an equal number of rows, and a prompt's group
may straddle two ranks. [`redistribute`] gathers the global batch, cuts it into one forest per rank with
[`~trl_dta.balance.partition`] (lexicographic order, equal cost, groups kept whole), and returns this rank's rows:

```
global batch (sorted):  g0 g0 g0 g0 | g1 g1 g1 g1 | g2 g2 g2 g2 g2 g2 g2 g2 (long prompt) | g3 g3 g3 g3
rank 0:                 g0 ........ g1 ........ g3 ........          (cost 0.98 of the mean)
rank 1:                                          g2 ................   (cost 1.02 of the mean)
```

Ranks then hold different numbers of rows; the loss normalisers TRL uses for its default objectives are global counts
(`num_items_in_batch`), so the sum of the ranks' gradients is still the single-process gradient. The regroupings that
call it: `micro_batches.balance_ranks` (episode rows, equal counts) and `micro_batches.balance_turn_rows` (turn rows).
"""

from __future__ import annotations

import torch

from ..balance import CostModel, Partition, partition
from ..batch import num_rows, sequences, take_rows
from ..refusal import DISTRIBUTED, TRAINER_ALTERNATIVE, TRAINER_CONFIG, Blocker, refuse
from ..tree import PrefixTree

# Keys of a TRL generation batch whose second dimension is the (left-padded) prompt.
_PROMPT_KEYS = ("prompt_ids", "prompt_mask")


def gather_batch(accelerator, batch: dict, pad_token_id: int) -> dict:
    """The global generation batch, rows in rank order (the order TRL's reward gathering uses).

    Per-row tensors are padded to the widest rank first (prompt tensors on the left, everything else on the right);
    scalars (`num_items_in_batch`) are already global and kept; None stays None. Ranks may hold different numbers of
    rows (per-turn rows, `per_turn.py`): the rows are then padded to the largest count for the gather and the
    padding dropped from the result.
    """
    from accelerate.utils import gather_object

    n = num_rows(batch)
    counts = gather_object([n])
    most = max(counts)
    keep = None
    if min(counts) != most:  # rank r's rows sit at [r * most, r * most + counts[r]) of the padded gather
        keep = torch.cat([torch.arange(r * most, r * most + c) for r, c in enumerate(counts)])
    out = {}
    for key, value in batch.items():
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            out[key] = value
            continue
        if not isinstance(value, torch.Tensor) or value.shape[0] != n:
            refuse(DISTRIBUTED, [Blocker(
                f"rank balancing cannot redistribute generation-batch entry '{key}' ({type(value).__name__}) across "
                "processes", settings={"dta_balance": False}, where=TRAINER_CONFIG)], alternative=TRAINER_ALTERNATIVE)
        if value.ndim > 1:
            pad = pad_token_id if key == "prompt_ids" else 0
            value = accelerator.pad_across_processes(value, dim=1, pad_index=pad, pad_first=key in _PROMPT_KEYS)
        if keep is not None:
            value = accelerator.pad_across_processes(value, dim=0)
        value = accelerator.gather(value)
        out[key] = value if keep is None else value[keep.to(value.device)]
    return out


def redistribute(
    accelerator,
    batch: dict,
    group_ids: torch.Tensor,
    *,
    pad_token_id: int,
    cost_model: CostModel | None = None,
    equal_count: bool = True,
) -> tuple[dict, torch.Tensor, Partition]:
    """Give this rank a forest of equal cost from the global batch.

    Args:
        accelerator (`accelerate.Accelerator`): the trainer's accelerator (`num_processes > 1`).
        batch (`dict`): this rank's generation batch (TRL's `_generate_and_score_completions` output).
        group_ids (`torch.LongTensor` of shape `(rows,)`): global group id of each local row (a prompt's completions
            share one); groups are never split across ranks.
        pad_token_id (`int`): padding id of `prompt_ids`.
        cost_model ([`~trl_dta.balance.CostModel`], *optional*): cost of a forest; the default model if None.
        equal_count (`bool`, *optional*, defaults to `True`): every rank keeps its number of rows (whole groups are
            exchanged), so that every rank runs the same micro-batches; balance then comes from which groups go where.

    Returns:
        `(local_batch, local_group_ids, partition)`: this rank's rows, their group ids, and the whole partition (for
        logging: `partition.imbalance`, `partition.compression_before` / `compression_after`).
    """
    world = accelerator.num_processes
    full = gather_batch(accelerator, {**batch, "_dta_group": group_ids.to(accelerator.device)}, pad_token_id)
    groups = full.pop("_dta_group").cpu()
    tree = PrefixTree.from_sequences(sequences(full))
    result = partition(tree, world, cost_model=cost_model, group_ids=groups.tolist(), keep_groups=True,
                       equal_count=equal_count)
    mine = torch.tensor(sorted(result.parts[accelerator.process_index]), dtype=torch.long)
    return take_rows(full, mine), groups[mine], result
