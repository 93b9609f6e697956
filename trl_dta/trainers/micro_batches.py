"""Which rows a micro-batch and a rank train on: TRL's split by default, two opt-in regroupings, and when they are
exact.

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

Per-turn rows (`dta_sample_layout="per_turn"`, `per_turn.py`): each rank expands its episodes into turn rows, so
ranks hold different numbers of rows; micro-batch `k` of every rank is padded to the largest rank's
count with rows that carry no loss. With `dta_balance`, whole prompt groups of turn rows (a task's `num_generations`
episodes, all their turns) move between ranks first, chosen on the exact cost of each rank's per-turn forest. Which
rank holds which row changes nothing in the objective when its normaliser is global (`num_items_in_batch`: `dapo`,
`cispo`, `vespo`) and every optimizer step spans whole generations. The row-mean loss types (`grpo`, `sapo`,
`luspo`, `dr_grpo`) count the padding rows; each micro-batch's loss carries the factor `per_turn.row_weights` that
undoes this, and the ranks' micro-batches together get the sizes one process would cut, so they too are exact when those
sizes are equal. [`per_turn_changes`] names what breaks this (then `dta_balance` leaves the rows where they are, and
a warning says so when the counts differ):

```
rank 0 turn rows: 7 -> micro-batches of 4, 3          padded to 4, 3    (the largest rank's counts)
rank 1 turn rows: 5 -> micro-batches of 2, 3          padded to 4, 3    ("+": a row without loss tokens)
                       (all ranks: 6, 6, as 1 process) rank 0: [r r r r] [r r r]    rank 1: [r r + +] [r r r]
```
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate.utils import gather_object
from trl.trainer.utils import split_tensor_dict

from .._checks import warn_once
from ..balance import CostModel, forest_stats, partition
from ..batch import Layout, group_ids, has_vision_inputs, num_rows, sequences, take_rows
from .exchange import redistribute

# Loss types whose normaliser counts the rows of a rank's micro-batch (padding rows included), and the one that
# counts its loss tokens (padding rows add none, but the count is the rank's own).
ROW_NORMALISED = {"grpo": "averages the rows of each micro-batch", "sapo": "averages the rows of each micro-batch",
                   "luspo": "averages the rows of each micro-batch",
                   "dr_grpo": "divides by the rows of each micro-batch times max_completion_length"}


@dataclass(frozen=True)
class RowSettings:
    """The trainer's settings the regroupings depend on, read once (`DTATrainerMixin._dta_rows`).

    Args:
        steps_per_generation (`int`), gradient_accumulation_steps (`int`), num_generations (`int`): TRL's.
        loss_type (`str`, *optional*): TRL's `loss_type` (None for RLOO).
        entropy_bonus (`bool`): TRL's entropy bonus is on.
        top_entropy_quantile (`float`): TRL's entropy mask (1.0: off).
        aux_loss (`bool`): TRL's MoE router loss is on.
        importance_sampling_level (`str`): `"token"` or `"sequence"`.
        pad_token_id (`int`): the tokenizer's pad id (0 without one).
        pad_to_multiple_of (`int`, *optional*): TRL's padding multiple.
    """

    steps_per_generation: int
    gradient_accumulation_steps: int
    num_generations: int
    loss_type: str | None = None
    entropy_bonus: bool = False
    top_entropy_quantile: float = 1.0
    aux_loss: bool = False
    importance_sampling_level: str = "token"
    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None


def regrouping_changes(settings: RowSettings, across_ranks: bool) -> str | None:
    """Why moving rows between micro-batches (or ranks, `across_ranks=True`) changes the updates, or None if it does
    not.

    Args:
        settings ([`RowSettings`]): the trainer's settings.
        across_ranks (`bool`): rows move between ranks (`dta_balance`), not only between a rank's micro-batches.
    """
    spg, accumulation = settings.steps_per_generation, settings.gradient_accumulation_steps
    reasons = []
    if accumulation % spg and (across_ranks or spg > 1):
        reasons.append(
            f"one generation feeds several optimizer steps (gradient_accumulation_steps={accumulation} is not a "
            f"multiple of steps_per_generation={spg}), so each step would train on other rows than TRL's"
        )
    if not across_ranks and spg == 1:
        return None  # one micro-batch per generation: the same rows, only in another order
    if settings.loss_type == "bnpo":
        reasons.append("loss_type='bnpo' divides by the micro-batch's token count")
    if settings.entropy_bonus:
        reasons.append("the entropy bonus divides by the micro-batch's token count")
    if settings.top_entropy_quantile < 1.0:
        reasons.append("top_entropy_quantile < 1 thresholds entropies over the micro-batch")
    if settings.aux_loss:
        reasons.append("the MoE load-balancing loss (router_aux_loss_coef) multiplies routing fractions and mean "
                       "router probabilities over each micro-batch's tokens")
    return "; ".join(reasons) or None


def regrouping_exact(settings: RowSettings, across_ranks: bool) -> bool:
    """Whether moving rows leaves TRL's updates ([`regrouping_changes`]); when it does not, a one-time warning says
    why: `dta_balance` (`across_ranks`) then keeps TRL's rows, `dta_group_shuffle` goes on as the user asked."""
    reason = regrouping_changes(settings, across_ranks)
    if reason and across_ranks:
        warn_once("balance_exact", "dta_balance: ranks keep TRL's rows, because exchanging rows between them would "
                  f"change the updates here: {reason}.")
    elif reason:
        warn_once("group_shuffle", f"dta_group_shuffle=True changes the updates relative to TRL's trainer here: "
                  f"{reason}. Set `dta_group_shuffle=False` (the default) for TRL's updates; DTA still shares prefixes "
                  "across an optimizer step's micro-batches.")
    return reason is None


def refit_cost_model(cost_model: CostModel, samples: list[tuple[float, float, float, float]]) -> CostModel:
    """The balancer's cost model refitted to the engine times `samples` of all ranks (identically on every rank), or
    `cost_model` while fewer than 8 samples exist (`dta_cost_model="fit"`)."""
    samples = [row for rows in gather_object([samples]) for row in rows]
    return CostModel.fit(samples, hidden_size=cost_model.hidden_size) if len(samples) >= 8 else cost_model


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
    layout = Layout.from_batch(batch)  # images: the rows' ids cost them (a group's rows show one image, whole groups)
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


def balance_ranks(accelerator, settings: RowSettings, batch: dict, cost_model: CostModel,
                  metrics: dict[str, list]) -> tuple[dict, torch.Tensor]:
    """Exchange whole prompt groups between ranks so that each trains on a forest of equal cost (`dta_balance`).

    Returns this rank's new generation batch and the global group id of each of its rows; the batch is left as it is
    (with a one-time warning) when its rows do not hold whole groups, and for vision inputs. Logs the compression
    before and after, and the ranks' cost imbalance, into `metrics`.
    """
    size = settings.num_generations
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
    local, local_groups, result = redistribute(accelerator, batch, groups, pad_token_id=settings.pad_token_id,
                                               cost_model=cost_model)
    metrics["dta/compression_ratio_before_balance"].append(
        sum(s.tokens for s in before) / max(sum(s.tree_tokens for s in before), 1)
    )
    metrics["dta/compression_ratio_after_balance"].append(result.compression_after)
    metrics["dta/rank_cost_imbalance"].append(result.imbalance)
    return local, local_groups


def per_turn_changes(settings: RowSettings, total_rows: int | None = None) -> str | None:
    """Why the per-turn objective on several processes depends on which rank holds which turn rows, or None if it does
    not (then it is the one-process per-turn objective, and `dta_balance` may move rows).

    Args:
        settings ([`RowSettings`]): the trainer's settings.
        total_rows (`int`, *optional*): the generation's turn rows on all ranks, when known.
    """
    spg, accumulation = settings.steps_per_generation, settings.gradient_accumulation_steps
    entropy_bonus = settings.entropy_bonus
    reasons = []
    if accumulation % spg:
        reasons.append(
            f"one generation feeds several optimizer steps (gradient_accumulation_steps={accumulation} is not a "
            f"multiple of steps_per_generation={spg}), so each step trains on the rows its micro-batches happen to hold"
        )
    loss_type = settings.loss_type
    if loss_type in ROW_NORMALISED and not entropy_bonus and spg > 1 and (total_rows is None or total_rows % spg):
        rows = "an unknown number of" if total_rows is None else f"{total_rows}"
        reasons.append(f"loss_type='{loss_type}' weighs a row by 1 / (rows of its micro-batch), and {rows} turn rows "
                       f"do not split into {spg} equal micro-batches, so a row's weight depends on where it goes")
    if loss_type in ROW_NORMALISED and entropy_bonus:
        reasons.append(f"loss_type='{loss_type}' {ROW_NORMALISED[loss_type]}, and a rank's micro-batch is padded to "
                       "the largest rank's row count (not corrected with the entropy bonus, which is a token mean)")
    if loss_type == "bnpo":
        reasons.append("loss_type='bnpo' divides by the loss tokens of each rank's own micro-batch")
    if entropy_bonus:
        reasons.append("the entropy bonus divides by the loss tokens of each rank's own micro-batch")
    if settings.top_entropy_quantile < 1.0 and spg > 1:
        reasons.append("top_entropy_quantile < 1 thresholds entropies over each micro-batch of all ranks")
    return "; ".join(reasons) or None


def balance_turn_rows(accelerator, settings: RowSettings, n_episodes: int, episode: torch.Tensor, rows: dict,
                      cost_model: CostModel, metrics: dict[str, list]) -> dict:
    """Exchange whole prompt groups of turn rows between ranks so that each rank's per-turn forest costs the same.

    A group is a task's `num_generations` episodes with all their turns: their system prompt and shared turns stay in
    one rank's forest. The partition is [`~trl_dta.balance.partition`] over the global forest of turn rows, groups kept
    whole, any number of rows per rank (the micro-batches are padded afterwards).

    Args:
        accelerator (`accelerate.Accelerator`): the processes.
        settings ([`RowSettings`]): the trainer's settings.
        n_episodes (`int`): episodes of this rank's generation batch (TRL's `_generate_and_score_completions`).
        episode (`torch.LongTensor` of shape `(R,)`): the episode of each turn row (`per_turn.episode_of_rows`).
        rows (`dict`): its turn rows (`per_turn.expand_per_turn` of the episodes).
        cost_model ([`~trl_dta.balance.CostModel`]): cost of a forest.
        metrics (`dict[str, list]`): where the balance's metrics are logged.

    Returns:
        `dict`: this rank's turn rows after the exchange (unchanged, with a one-time warning, when the episodes do not
        hold whole groups).
    """
    size = settings.num_generations
    n = n_episodes
    if n % size:
        warn_once(
            "balance_groups_per_turn",
            f"dta_balance: each process holds {n} episodes of a generation batch, not a multiple of num_generations="
            f"{size}, so prompt groups straddle processes and cannot be exchanged whole; ranks keep their turn rows. "
            "Make `per_device_train_batch_size * steps_per_generation` a multiple of `num_generations`.",
        )
        return rows
    groups = group_ids(accelerator.process_index, n, size)[episode]  # (R,)
    seqs = sequences(rows)
    before = gather_object([(forest_stats(seqs), cost_model.forest_cost(seqs) if seqs else 0.0)])
    local, _, result = redistribute(accelerator, rows, groups, pad_token_id=settings.pad_token_id,
                                    cost_model=cost_model, equal_count=False)
    costs = [cost for _, cost in before]
    metrics["dta/compression_ratio_before_balance"].append(
        sum(s.tokens for s, _ in before) / max(sum(s.tree_tokens for s, _ in before), 1)
    )
    metrics["dta/compression_ratio_after_balance"].append(result.compression_after)
    metrics["dta/rank_cost_imbalance_before_balance"].append(max(costs) / (sum(costs) / len(costs) or 1.0))
    metrics["dta/rank_cost_imbalance"].append(result.imbalance)
    return local
