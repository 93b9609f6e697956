"""Which rows a micro-batch and a rank train on: TRL's split by default, two opt-in regroupings, and when they are exact.

After a generation, TRL shuffles the rows of each process's generation batch (`shuffle_sequence_dict`) and cuts them
into `steps_per_generation` micro-batches (`split_tensor_dict`); the HF `Trainer` runs `gradient_accumulation_steps`
of them per optimizer step. DTA keeps that by default, and shares prefixes across a step's micro-batches anyway (the
step's forest, see `step_forest.py`). Two regroupings move rows, and are applied only as documented in the config:

- `dta_group_shuffle` ([`split_by_groups`]): the same random draw, then micro-batches of TRL's size that keep each
  prompt's completions together, balanced by tree cost.
- `dta_balance` ([`balance_ranks`]): whole prompt groups exchanged between ranks so that every rank's forest costs the
  same.

Moving rows changes nothing in an update only if every optimizer step still sees the same rows, and the loss of a
micro-batch is a sum over its rows with constants independent of which other rows share it. [`regrouping_changes`]
names the settings that break this.
"""

from __future__ import annotations

import torch
from accelerate.utils import gather_object
from trl.trainer.utils import split_tensor_dict

from .._checks import warn_once
from ..balance import CostModel, forest_stats, partition
from ..batch import Layout, group_ids, has_vision_inputs, num_rows, take_rows
from ..distributed import redistribute


def regrouping_changes(trainer, across_ranks: bool) -> str | None:
    """Why moving rows between micro-batches (or ranks, `across_ranks=True`) changes the updates, or None if it does
    not.

    Args:
        trainer (`GRPOTrainer` or `RLOOTrainer`): the trainer (its `args`, loss settings and entropy controls).
        across_ranks (`bool`): rows move between ranks (`dta_balance`), not only between a rank's micro-batches.
    """
    args = trainer.args
    spg, accumulation = args.steps_per_generation, args.gradient_accumulation_steps
    reasons = []
    if accumulation % spg and (across_ranks or spg > 1):
        reasons.append(
            f"one generation feeds several optimizer steps (gradient_accumulation_steps={accumulation} is not a "
            f"multiple of steps_per_generation={spg}), so each step would train on other rows than TRL's"
        )
    if not across_ranks and spg == 1:
        return None  # one micro-batch per generation: the same rows, only in another order
    if getattr(trainer, "loss_type", None) == "bnpo":
        reasons.append("loss_type='bnpo' divides by the micro-batch's token count")
    if getattr(trainer, "_entropy_bonus_enabled", False):
        reasons.append("the entropy bonus divides by the micro-batch's token count")
    if getattr(trainer, "top_entropy_quantile", 1.0) < 1.0:
        reasons.append("top_entropy_quantile < 1 thresholds entropies over the micro-batch")
    return "; ".join(reasons) or None


def split_by_groups(batch: dict, k: int, groups: torch.Tensor, cost_model: CostModel) -> list[dict]:
    """Cut a generation batch into `k` micro-batches of TRL's size, prompt groups kept together (`dta_group_shuffle`).

    The rows are first permuted with `torch.randperm(n)`, the draw TRL's `shuffle_sequence_dict` makes (so the random
    stream, hence later generations, stay TRL's). When all groups have one size that divides the micro-batch size,
    whole groups are assigned by cost; otherwise the lexicographically sorted batch is cut into equal runs (a group is
    split only where the sizes force it). The micro-batches come in the order of their first row in the permutation.

    Args:
        batch (`dict`): one process's generation batch (`n` rows).
        k (`int`): micro-batches (`steps_per_generation`).
        groups (`torch.LongTensor` of shape `(n,)`): the rows' global group ids.
        cost_model ([`~trl_dta.balance.CostModel`]): cost of a micro-batch's tree.
    """
    n = num_rows(batch)
    permutation = torch.randperm(n)  # (n,)
    layout = None if has_vision_inputs(batch) else Layout.from_batch(batch)
    if layout is None:
        return split_tensor_dict(take_rows(batch, permutation), k)
    labels = groups[permutation].tolist()
    sizes = {labels.count(g) for g in set(labels)}
    keep = len(sizes) == 1 and (n // k) % sizes.pop() == 0
    parts = partition(
        [layout.seqs[j] for j in permutation.tolist()],
        k,
        cost_model=cost_model,
        group_ids=labels if keep else None,
        keep_groups=keep,
        equal_count=True,
    ).parts
    parts.sort(key=min)
    return [take_rows(batch, permutation[torch.tensor(part, dtype=torch.long)]) for part in parts]


def balance_ranks(trainer, batch: dict, cost_model: CostModel) -> tuple[dict, torch.Tensor]:
    """Exchange whole prompt groups between ranks so that each trains on a forest of equal cost (`dta_balance`).

    Returns this rank's new generation batch and the global group id of each of its rows; the batch is left as it is
    (with a one-time warning) when its rows do not hold whole groups, and for vision inputs.
    """
    accelerator, size = trainer.accelerator, trainer.num_generations
    n = num_rows(batch)
    groups = group_ids(accelerator.process_index, n, size)
    if has_vision_inputs(batch):
        return batch, groups
    if n % size:
        warn_once(
            "balance_groups",
            f"dta_balance: each process holds {n} rows of a generation batch, not a multiple of num_generations="
            f"{size}, so prompt groups straddle processes and cannot be exchanged whole; ranks keep TRL's rows. "
            "Make `per_device_train_batch_size * steps_per_generation` a multiple of `num_generations`.",
        )
        return batch, groups
    before = gather_object([forest_stats(Layout.from_batch(batch).seqs)])
    pad = trainer._tokenizer.pad_token_id or 0
    local, local_groups, result = redistribute(accelerator, batch, groups, pad_token_id=pad, cost_model=cost_model)
    metrics = trainer._metrics["train"]
    metrics["dta/compression_ratio_before_balance"].append(
        sum(s.tokens for s in before) / max(sum(s.tree_tokens for s in before), 1)
    )
    metrics["dta/compression_ratio_after_balance"].append(result.compression_after)
    metrics["dta/rank_cost_imbalance"].append(result.imbalance)
    return local, local_groups
