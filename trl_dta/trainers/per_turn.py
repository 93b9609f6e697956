"""Per-turn rows (`dta_sample_layout="per_turn"`): expand TRL's episodes into one row per assistant turn, split them
into micro-batches that keep every row, pad the ranks' micro-batches to equal counts, and weigh their losses.

A multi-turn rollout gives TRL one row per episode, the policy's turns alternating with user and tool tokens that
`tool_mask` masks out of the loss. The trainer reads the turns from that mask, TRL's own contract (a `rollout_func`'s
`env_mask`, or TRL's `tools=` loop), not from a rollout column: turn `t` is a maximal run of ones of
`completion_mask * tool_mask`, columns `[s_t, e_t)` of the completion; its row's prompt is the conversation the policy
saw when it wrote the turn, its completion is the turn:

```
episode row      prompt [ . . p p p ]  completion [ a a u u u a a a t t a . . ]      a: policy, u/t: user/tool
                                                    s0  e0    s1    e1  s2 e2
per-turn rows    [ . . . . . . . . . p p p ]                       [ a a . ]           turn 0
                 [ . . . . p p p a a u u u ]                       [ a a a ]           turn 1
                 [ p p p a a u u u a a a t t ]                     [ a . . ]           turn 2
```

The turns of an episode are nested prefixes of each other, so a turn's log-probs are the episode row's, column for
column. Every row carries its episode's advantage; per-token tensors are cut like the completion, per-episode ones
repeated; `num_items_in_batch` is kept. An episode without policy tokens gives no row. What each `loss_type`'s
objective becomes: `docs/agents.md`. The same micro-batches serve `dta_enabled=True` and `False`.

A generation's flow ([`per_turn_buffer`]): [`expand_per_turn`]; with `dta_balance` on several processes, whole prompt
groups of turn rows exchanged between ranks (`micro_batches.balance_turn_rows`) where `micro_batches.per_turn_changes`
allows it; TRL's `shuffle_sequence_dict`; [`split_rows`] into `steps_per_generation` micro-batches of the sizes one
process would cut ([`split_sizes_across`]; TRL's `split_tensor_dict` would drop `rows % steps_per_generation` rows),
micro-batch `k` of every rank padded to the largest rank's count of it with [`pad_rows`] (rows without loss tokens);
the row-mean loss types' factor [`row_weights`] (read by [`row_weight`]); [`unpadded_metrics`] for TRL's metrics:

```
rank 0 turn rows: 7 -> micro-batches of 4, 3          padded to 4, 3    (the largest rank's counts)
rank 1 turn rows: 5 -> micro-batches of 2, 3          padded to 4, 3    ("+": a row without loss tokens)
                       (all ranks: 6, 6, as 1 process) rank 0: [r r r r] [r r r]    rank 1: [r r + +] [r r r]
```
"""

from __future__ import annotations

import contextlib
import math

import torch
from accelerate.utils import gather_object
from trl.trainer.utils import shuffle_sequence_dict

from .._checks import check_int, warn_once
from ..balance import CostModel
from ..batch import VISION_KEYS, num_rows
from .micro_batches import ROW_NORMALISED, RowSettings, balance_turn_rows, per_turn_changes

# Keys of TRL's generation batch whose columns are the completion's (B, C): cut per turn.
PER_TOKEN_KEYS = ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps")
# Keys that are per episode, (B,) or (B, 1), or per token, (B, C) (a subclass's token-level advantages, a vLLM
# token-level importance ratio): repeated per turn, or cut per turn.
PER_EPISODE_OR_TOKEN_KEYS = ("advantages", "importance_sampling_ratio")
# 0-d tensors kept as they are.
SCALAR_KEYS = ("num_items_in_batch",)
# Keys rebuilt for the turn rows.
TOKEN_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask")

_HOW_TO_GET_TOOL_MASK = (
    "`dta_sample_layout='per_turn'` needs multi-turn rollouts whose batch carries a `tool_mask` (a `rollout_func` that "
    "returns an `env_mask`, e.g. `trl_dta.envs.AgentRolloutFunc`, or TRL's `tools=`/`environment_factory=`); use "
    "`dta_sample_layout='episode'` for single-turn batches."
)


def turn_spans(loss_mask: torch.Tensor) -> list[list[tuple[int, int]]]:
    """The assistant turns of each row: maximal runs of ones of the loss mask.

    Args:
        loss_mask (`torch.Tensor` of shape `(B, C)`): `completion_mask * tool_mask`, 0/1.

    Returns:
        `list[list[tuple[int, int]]]`: per row, the turns `(start, end)` in completion columns, in order.
    """
    mask = (loss_mask != 0).to(torch.int8)
    edges = torch.nn.functional.pad(mask, (1, 1)).diff(dim=1)  # (B, C + 1): +1 where a run starts, -1 after it ends
    starts, ends = (edges == 1).nonzero().tolist(), (edges == -1).nonzero().tolist()  # row-major, one pair per run
    spans: list[list[tuple[int, int]]] = [[] for _ in range(mask.size(0))]
    for (row, start), (_, end) in zip(starts, ends):
        spans[row].append((start, end))
    return spans


def _padded_width(width: int, multiple: int | None) -> int:
    return width if not multiple else math.ceil(width / multiple) * multiple


def expand_per_turn(batch: dict, pad_token_id: int, pad_to_multiple_of: int | None = None) -> dict:
    """One row per assistant turn from TRL's generation batch of episodes (see the module docstring).

    Args:
        batch (`dict`): the output of `GRPOTrainer._generate_and_score_completions`: `prompt_ids`/`prompt_mask`
            `(B, P)` left-padded, `completion_ids`/`completion_mask`/`tool_mask` `(B, C)` right-padded, `advantages`
            `(B,)`, `num_items_in_batch` (0-d), and optionally the keys of [`PER_TOKEN_KEYS`] `(B, C)` and
            `importance_sampling_ratio` `(B, C)` or `(B, 1)`.
        pad_token_id (`int`): the padding id of the new `prompt_ids` and `completion_ids`.
        pad_to_multiple_of (`int`, *optional*): pad both widths to a multiple of it, as TRL's `pad_to_multiple_of`.

    Returns:
        `dict`: the same keys, `R` rows (one per turn, episode by episode, turn by turn): `prompt_ids`/`prompt_mask`
        `(R, P')` left-padded, `completion_ids` `(R, C')` right-padded, `completion_mask` ones on the turn,
        `tool_mask` ones, per-token tensors `(R, C')` (zero-padded), per-episode tensors repeated, 0-d ones kept.
    """
    if batch.get("tool_mask") is None:
        raise ValueError(f"the generation batch has no `tool_mask`. {_HOW_TO_GET_TOOL_MASK}")
    vision = [key for key in VISION_KEYS if batch.get(key) is not None]
    if vision:
        raise ValueError(f"`dta_sample_layout='per_turn'` supports text-only batches; this one carries {vision}. "
                         "Use `dta_sample_layout='episode'`.")
    known = {*TOKEN_KEYS, *PER_TOKEN_KEYS, *PER_EPISODE_OR_TOKEN_KEYS, *SCALAR_KEYS}
    unknown = sorted(key for key, value in batch.items() if key not in known and value is not None)
    if unknown:
        raise ValueError(f"`dta_sample_layout='per_turn'` does not know how to cut {unknown} into turns; it handles "
                         f"{sorted(known)}. Use `dta_sample_layout='episode'` with this trainer.")
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]  # (B, P)
    completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]  # (B, C)
    n_episodes, width = completion_ids.shape
    spans = turn_spans(completion_mask * batch["tool_mask"])
    episode = torch.tensor([b for b, turns in enumerate(spans) for _ in turns], dtype=torch.long)  # (R,)
    turns = [turn for row in spans for turn in row]
    prompts = [torch.cat([prompt_ids[b][prompt_mask[b].bool()], completion_ids[b, :start]])
               for b, row in enumerate(spans) for start, _ in row]
    prompt_width = _padded_width(max((len(p) for p in prompts), default=0), pad_to_multiple_of)
    turn_width = _padded_width(max((end - start for start, end in turns), default=0), pad_to_multiple_of)
    rows, device = len(turns), completion_ids.device

    out = {
        "prompt_ids": torch.full((rows, prompt_width), pad_token_id, dtype=prompt_ids.dtype, device=device),
        "prompt_mask": torch.zeros((rows, prompt_width), dtype=prompt_mask.dtype, device=device),
        "completion_ids": torch.full((rows, turn_width), pad_token_id, dtype=completion_ids.dtype, device=device),
        "completion_mask": torch.zeros((rows, turn_width), dtype=completion_mask.dtype, device=device),
        "tool_mask": torch.ones((rows, turn_width), dtype=batch["tool_mask"].dtype, device=device),
    }
    per_token = {key: batch[key] for key in PER_TOKEN_KEYS if batch.get(key) is not None}
    for key in PER_EPISODE_OR_TOKEN_KEYS:
        value = batch.get(key)
        if value is None:
            continue
        if value.dim() == 1 or (value.dim() == 2 and value.size(1) == 1):
            out[key] = value[episode.to(value.device)]  # the episode's value on each of its turns
        elif value.dim() == 2 and value.size(1) == width:
            per_token[key] = value
        else:
            raise ValueError(f"`{key}` has shape {tuple(value.shape)}; expected ({n_episodes},), ({n_episodes}, 1) "
                             f"or ({n_episodes}, {width}).")
    for key, value in per_token.items():
        out[key] = value.new_zeros((rows, turn_width))
    for r, (b, (start, end), prompt) in enumerate(zip(episode.tolist(), turns, prompts)):
        out["prompt_ids"][r, prompt_width - len(prompt):] = prompt
        out["prompt_mask"][r, prompt_width - len(prompt):] = 1
        out["completion_ids"][r, :end - start] = completion_ids[b, start:end]
        out["completion_mask"][r, :end - start] = 1
        for key, value in per_token.items():
            out[key][r, :end - start] = value[b, start:end]
    for key in SCALAR_KEYS:
        if batch.get(key) is not None:
            out[key] = batch[key]
    return out


def _trim(batch: dict, pad_to_multiple_of: int | None) -> dict:
    """Drop the prompt columns no row uses (left) and the completion columns no row uses (right)."""
    width = batch["completion_ids"].size(1)
    prompt_width = min(_padded_width(int(batch["prompt_mask"].sum(1).max()), pad_to_multiple_of),
                       batch["prompt_ids"].size(1))
    turn_width = min(_padded_width(max(int(batch["completion_mask"].sum(1).max()), 1), pad_to_multiple_of), width)
    out = {}
    for key, value in batch.items():
        if key in ("prompt_ids", "prompt_mask"):
            out[key] = value[:, value.size(1) - prompt_width:]
        elif isinstance(value, torch.Tensor) and value.dim() == 2 and value.size(1) == width:
            out[key] = value[:, :turn_width]  # completion columns; a (rows, 1) value when width == 1 is kept whole
        else:
            out[key] = value
    return out


# Key of a per-turn micro-batch whose value (a float) multiplies its loss: the row-count correction of the row-mean
# loss types on several processes ([`per_turn_buffer`]). Absent: 1.
ROW_WEIGHT_KEY = "dta_row_weight"
# Key of a padded per-turn micro-batch whose value `(real, total)` counts its real rows and all its rows on all ranks,
# for the metrics TRL averages over rows ([`unpadded_metrics`]). Absent: no padding row anywhere.
ROW_COUNTS_KEY = "dta_row_counts"


def row_weight(inputs: dict) -> float:
    """The factor of a micro-batch's loss ([`row_weights`], under [`ROW_WEIGHT_KEY`]); 1 for any other batch."""
    return inputs.get(ROW_WEIGHT_KEY, 1.0)


def split_sizes(rows: int, num_chunks: int) -> list[int]:
    """Rows of each of `num_chunks` contiguous micro-batches: `rows // num_chunks`, the first `rows % num_chunks` one
    more."""
    base, extra = divmod(rows, num_chunks)
    return [base + (k < extra) for k in range(num_chunks)]


def split_sizes_across(counts: list[int], num_chunks: int) -> list[list[int]]:
    """Per rank, the rows of each of its `num_chunks` micro-batches, such that micro-batch `k` of all ranks together
    holds `split_sizes(sum(counts), num_chunks)[k]` rows: the sizes one process would cut.

    Rank `r` gives `counts[r] // num_chunks` rows to every micro-batch, and one more to `counts[r] % num_chunks` of
    them, taken cyclically after those of the ranks before it:

    ```
    counts 7, 5, num_chunks 3:   rank 0: 3 2 2   (extra at 0)     rank 1: 1 2 2   (extras at 1, 2)   all: 4 4 4
    ```

    Args:
        counts (`list[int]`): rows of each rank.
        num_chunks (`int`): micro-batches per rank.
    """
    num_chunks = check_int("num_chunks", num_chunks, minimum=1)
    out, offset = [], 0
    for count in counts:
        base, extra = divmod(count, num_chunks)
        sizes = [base] * num_chunks
        for i in range(extra):
            sizes[(offset + i) % num_chunks] += 1
        offset = (offset + extra) % num_chunks
        out.append(sizes)
    return out


def pad_rows(batch: dict, rows: int, token_id: int, pad_token_id: int) -> dict:
    """Append `rows` rows that carry no loss to a batch of per-turn rows (see the module docstring).

    A padding row is a one-token prompt (`token_id`, e.g. the first token of the batch's prompts, so that it adds no
    node to the rank's prefix tree) and a completion without any token (`completion_mask` zero, `completion_ids`
    `pad_token_id`, `tool_mask` one): TRL's loss mask `completion_mask * tool_mask` is zero on it, so every loss term
    of it is zero whatever the loss type. Its other per-row values are zeros (advantages, old/reference/sampling
    log-probs), and ones for `importance_sampling_ratio` (neutral).

    Args:
        batch (`dict`): per-turn rows: `prompt_ids`/`prompt_mask` `(R, P)`, `completion_ids`/`completion_mask`/
            `tool_mask` `(R, C)`, per-row tensors `(R, ...)`, 0-d tensors.
        rows (`int`): padding rows to append.
        token_id (`int`): the padding rows' prompt token.
        pad_token_id (`int`): the padding id of `prompt_ids` and `completion_ids`.

    Returns:
        `dict`: `R + rows` rows, widths at least 1; 0-d tensors kept.
    """
    rows = check_int("rows", rows, minimum=0)
    n = num_rows(batch)
    if rows == 0 and batch["prompt_ids"].size(1) > 0 and batch["completion_ids"].size(1) > 0:
        return batch
    width = batch["completion_ids"].size(1)
    out = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            out[key] = value
            continue
        if value.size(0) != n:
            raise ValueError(f"`{key}` has {value.size(0)} rows, the batch {n}.")
        if value.dim() == 2 and value.size(1) == 0:  # an empty batch's zero-width columns: make room for one
            fill = pad_token_id if key in ("prompt_ids", "completion_ids") else int(key == "tool_mask")
            value = value.new_full((n, 1), fill)
        filler = value.new_zeros((rows, *value.shape[1:]))
        if key in ("prompt_ids", "completion_ids"):
            filler.fill_(pad_token_id)
        if key == "prompt_ids":
            filler[:, -1] = token_id
        elif key == "prompt_mask":
            filler[:, -1] = 1
        elif key == "tool_mask" or key == "importance_sampling_ratio":
            filler.fill_(1)
        out[key] = torch.cat([value, filler])
    if out["completion_ids"].size(1) != max(width, 1):
        raise ValueError("per-turn rows have completion tensors of different widths.")
    return out


def split_rows(batch: dict, num_chunks: int, pad_to_multiple_of: int | None = None, *,
               sizes: list[int] | None = None, pad_to: list[int] | None = None, pad_token_id: int = 0) -> list[dict]:
    """Cut a batch of per-turn rows into `num_chunks` micro-batches, keeping every row.

    Unlike TRL's `split_tensor_dict`, which cuts `rows // num_chunks` rows per chunk and drops the rest, chunk `k` gets
    rows `[sum(sizes[:k]), sum(sizes[:k + 1]))`, by default with `sizes` = [`split_sizes`]. With `pad_to`, chunk `k`
    is filled up to `pad_to[k]` rows with [`pad_rows`] (rows without loss tokens). Each chunk is trimmed to the widths
    its own rows need.

    Args:
        batch (`dict`): per-turn rows (the output of [`expand_per_turn`], shuffled or not).
        num_chunks (`int`): micro-batches, TRL's `steps_per_generation`.
        pad_to_multiple_of (`int`, *optional*): keep both widths multiples of it.
        sizes (`list[int]`, *optional*): real rows of each chunk, summing to the batch's rows (the trainer passes
            [`split_sizes_across`]'s); [`split_sizes`] if None.
        pad_to (`list[int]`, *optional*): rows of each chunk after padding, each at least 1 and at least `sizes[k]`
            (the trainer passes the largest rank's sizes). Without it, every chunk must get a row.
        pad_token_id (`int`, *optional*, defaults to 0): the padding rows' padding id.

    Returns:
        `list[dict]`: `num_chunks` micro-batches; 0-d tensors (`num_items_in_batch`) are shared.
    """
    num_chunks = check_int("num_chunks", num_chunks, minimum=1)
    rows = num_rows(batch)
    if sizes is None:
        sizes = split_sizes(rows, num_chunks)
    elif len(sizes) != num_chunks or sum(sizes) != rows or min(sizes) < 0:
        raise ValueError(f"`sizes={sizes}` must give {num_chunks} chunk sizes summing to the batch's {rows} rows.")
    if pad_to is None and min(sizes) == 0:
        raise ValueError(
            f"the per-turn layout has {rows} rows on this process, fewer than `steps_per_generation={num_chunks}` "
            "micro-batches; every process needs at least one row per micro-batch. Lower `steps_per_generation` (or "
            "`gradient_accumulation_steps`), raise `per_device_train_batch_size`, or check the rollouts (an episode "
            "whose completion is masked, e.g. by `mask_truncated_completions`, gives no row)."
        )
    if pad_to is not None and (len(pad_to) != num_chunks or any(t < max(s, 1) for t, s in zip(pad_to, sizes))):
        raise ValueError(f"`pad_to={pad_to}` must give {num_chunks} chunk sizes of at least {sizes} (and 1).")
    token_id = int(batch["prompt_ids"][0][batch["prompt_mask"][0].bool()][0]) if rows else pad_token_id
    chunks, start = [], 0
    for k, size in enumerate(sizes):
        chunk = {key: value[start:start + size] if isinstance(value, torch.Tensor) and value.dim() > 0 else value
                 for key, value in batch.items()}
        if pad_to is not None:
            chunk = pad_rows(chunk, pad_to[k] - size, token_id, pad_token_id)
        chunks.append(_trim(chunk, pad_to_multiple_of))
        start += size
    return chunks


def episode_of_rows(batch: dict) -> torch.Tensor:
    """The episode (row of TRL's generation batch) of each row [`expand_per_turn`] makes from `batch`, shape `(R,)`."""
    spans = turn_spans(batch["completion_mask"] * batch["tool_mask"])
    return torch.tensor([b for b, turns in enumerate(spans) for _ in turns], dtype=torch.long)


def _row_counts(accelerator, rows: dict) -> list[int]:
    """Turn rows of every rank."""
    n = num_rows(rows)
    return gather_object([n]) if accelerator.num_processes > 1 else [n]


def row_weights(settings: RowSettings, processes: int, real: list[int], padded: list[int]) -> list[float]:
    """The factor of each micro-batch's loss that makes a row-mean loss type the one-process objective.

    With `loss_type` `grpo`, `sapo`, `luspo` or `dr_grpo`, TRL divides a rank's micro-batch `k` by its row count,
    `padded[k]` (padding rows included), and DDP averages the ranks: a row weighs `1 / (processes * padded[k])`. One
    process would weigh it `1 / real[k]`, `real[k]` being the real rows of micro-batch `k` on all ranks. The factor is
    `processes * padded[k] / real[k]` (1 for the other loss types, with the entropy bonus, and for a micro-batch
    without real rows).
    """
    if settings.loss_type not in ROW_NORMALISED or settings.entropy_bonus:
        return [1.0] * len(padded)
    return [processes * p / r if r else 1.0 for p, r in zip(padded, real)]


def per_turn_buffer(accelerator, settings: RowSettings, episodes: dict, metrics: dict[str, list], balance: bool,
                    cost_model: CostModel | None = None) -> list[dict]:
    """A generation's `steps_per_generation` per-turn micro-batches on this rank, any number of processes.

    The module docstring's flow: expand, balance (when `balance` and `micro_batches.per_turn_changes` allow it),
    shuffle, split, pad, weigh. Logs `dta/padding_rows` (padding rows of all ranks per generation).

    Args:
        accelerator (`accelerate.Accelerator`): the processes.
        settings ([`RowSettings`]): the trainer's settings.
        episodes (`dict`): this rank's generation batch of episodes.
        metrics (`dict[str, list]`): the training metrics (`dta/padding_rows`, the balance's).
        balance (`bool`): `dta_balance` requested (DTA on, several processes).
        cost_model ([`~trl_dta.balance.CostModel`], *optional*): cost of a forest, for `balance`.
    """
    spg = settings.steps_per_generation
    pad_id, multiple = settings.pad_token_id, settings.pad_to_multiple_of
    rows = expand_per_turn(episodes, pad_id, multiple)
    counts = _row_counts(accelerator, rows)
    reason = per_turn_changes(settings, sum(counts))
    if balance and reason:
        warn_once("balance_exact_per_turn", "dta_balance: ranks keep their turn rows, because exchanging rows between "
                  f"them would change the updates here: {reason}.")
    elif balance:
        rows = balance_turn_rows(accelerator, settings, num_rows(episodes), episode_of_rows(episodes), rows,
                                 cost_model, metrics)
        counts = _row_counts(accelerator, rows)
    rows = shuffle_sequence_dict(rows)
    every = split_sizes_across(counts, spg)  # (processes, spg)
    pad_to = [max(*column, 1) for column in zip(*every)]
    real = [sum(column) for column in zip(*every)]
    metrics["dta/padding_rows"].append(float(sum(pad_to) * len(every) - sum(real)))
    if reason and len(set(counts)) > 1:
        warn_once(
            "per_turn_unequal",
            f"dta_sample_layout='per_turn': the processes hold different numbers of turn rows ({counts}); each "
            "micro-batch is padded to the largest rank's count with rows without loss tokens, which leaves the "
            f"objective the one-process objective only where it does not depend on the rows' ranks. Here it does: "
            f"{reason}. See the README's per-turn table.",
        )
    chunks = split_rows(rows, spg, multiple, sizes=every[accelerator.process_index], pad_to=pad_to,
                        pad_token_id=pad_id)
    weights = row_weights(settings, accelerator.num_processes, real, pad_to)
    for chunk, weight, padded, total in zip(chunks, weights, pad_to, real):
        if weight != 1.0:
            chunk[ROW_WEIGHT_KEY] = weight
        if padded * len(every) != total:
            chunk[ROW_COUNTS_KEY] = (total, padded * len(every))
    return chunks


def per_turn_eval_rows(accelerator, settings: RowSettings, episodes: dict) -> dict:
    """The turn rows of an evaluation batch, padded to the largest rank's count (TRL's metric gathers need it), with
    their [`row_weights`] factor."""
    pad_id, multiple = settings.pad_token_id, settings.pad_to_multiple_of
    rows = expand_per_turn(episodes, pad_id, multiple)
    counts = _row_counts(accelerator, rows)
    most = max(*counts, 1)
    if most > num_rows(rows):
        token = int(rows["prompt_ids"][0][rows["prompt_mask"][0].bool()][0]) if num_rows(rows) else pad_id
        rows = pad_rows(rows, most - num_rows(rows), token, pad_id)
    (weight,) = row_weights(settings, accelerator.num_processes, [sum(counts)], [most])
    if weight != 1.0:
        rows[ROW_WEIGHT_KEY] = weight
    if most * len(counts) != sum(counts):
        rows[ROW_COUNTS_KEY] = (sum(counts), most * len(counts))
    return rows


# TRL's metrics that average one value per sequence over the rows of all ranks (its `global_masked_mean` of a
# `(B, 1)` tensor: with `importance_sampling_level="sequence"`, and VESPO's weight always), with a padding row's
# value (no clipping: zero advantage; VESPO's weight of a ratio of 1 is 1).
_PER_SEQUENCE_METRICS = {"clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 0.0,
                         "cispo_clip_ratio": 0.0}
_ALWAYS_PER_SEQUENCE_METRICS = {"vespo/phi_seq_mean": 1.0}


@contextlib.contextmanager
def unpadded_metrics(metrics: dict[str, list], importance_sampling_level: str, inputs: dict):
    """Around TRL's `_compute_loss` on a padded per-turn micro-batch: the per-sequence means it logs are corrected to
    the real rows, `(mean * total - padding * padding_value) / real`, from the micro-batch's `ROW_COUNTS_KEY`.

    TRL's token-level metrics need no correction (a padding row has no token); `clip_ratio/low_min` with
    sequence-level importance sampling is a minimum over rows, which a padding row's 0 can lower (documented).
    """
    counts = inputs.get(ROW_COUNTS_KEY)
    if counts is None:
        yield
        return
    real, total = counts
    fixes = dict(_ALWAYS_PER_SEQUENCE_METRICS)
    if importance_sampling_level == "sequence":
        fixes.update(_PER_SEQUENCE_METRICS)
    before = {key: len(metrics.get(key, ())) for key in fixes}
    yield
    for key, pad_value in fixes.items():
        values = metrics.get(key, [])
        for i in range(before[key], len(values)):
            values[i] = (values[i] * total - (total - real) * pad_value) / real if real else float("nan")
