"""The planner: [`partition`] (every strategy) and [`partition_for_ranks`] (the trainers' split).

```
validate (k, cost model, flags, strategy, slack; sequences; group ids; equal-count feasibility)
   |
SortedBatch (cost.py, built once)
   |
candidate parts, each from one self-contained strategy (arguments in, parts out; none calls back here):
   contiguous cuts               contiguous.contiguous_parts     "contiguous", "best"
   whole groups / subtrees       packing.group_packing,          "packed", "best"
   packed by exact union cost    packing.subtree_packings
   equal count                   contiguous.equal_runs, packing.group_packing with a capacity
   |
summarize each candidate (exact forest statistics and costs), pick: the least total cost among those whose maximum
cost is within (1 + slack) of the smallest --> Partition
```

Every argument is checked here, before any partitioning work, with `trl_dta._checks` (one rule per kind of value);
the sequences are checked by `PrefixTree.from_sequences`. The strategies import only `cost.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._checks import check_bool, check_choice, check_float, check_int, is_int
from ..tree import as_tree
from .contiguous import contiguous_parts, equal_runs
from .cost import CostModel, ForestStats, SortedBatch
from .packing import group_packing, subtree_packings


@dataclass
class Partition:
    """The assignment of a batch's sequences to `k` ranks.

    Args:
        parts (`list[list[int]]`): for each rank, the original indices of its sequences (in lexicographic order).
        stats (`list[ForestStats]`): each part's forest statistics.
        costs (`list[float]`): each part's forest cost under the cost model used.
        compression_before (`float`): `tokens / tree_tokens` of the whole batch as one forest.
    """

    parts: list[list[int]]
    stats: list[ForestStats]
    costs: list[float]
    compression_before: float

    @property
    def k(self) -> int:
        return len(self.parts)

    @property
    def max_cost(self) -> float:
        return max(self.costs, default=0.0)

    @property
    def mean_cost(self) -> float:
        return float(np.mean(self.costs)) if self.costs else 0.0

    @property
    def imbalance(self) -> float:
        """`max_cost / mean_cost` (1.0 is perfect balance; 1.0 as well when every part is free)."""
        mean = self.mean_cost
        return self.max_cost / mean if mean > 0 else 1.0

    @property
    def compression_after(self) -> float:
        """Sum of the parts' tokens over the sum of their tree tokens."""
        tree_tokens = sum(s.tree_tokens for s in self.stats)
        return sum(s.tokens for s in self.stats) / tree_tokens if tree_tokens else 1.0

    @property
    def compression_kept(self) -> float:
        """`compression_after / compression_before`: the fraction of the single-forest saving that survives."""
        return self.compression_after / self.compression_before

    def assignment(self) -> list[int]:
        """For each sequence (original index), the rank it goes to."""
        out = [0] * sum(len(p) for p in self.parts)
        for rank, part in enumerate(self.parts):
            for i in part:
                out[i] = rank
        return out


def summarize(batch: SortedBatch, parts: list[list[int]], model: CostModel) -> Partition:
    """The `Partition` of the given parts (original indices), each sorted and scored exactly under `model`."""
    parts = [sorted(p, key=lambda i: batch.position[i]) for p in parts]
    stats = [batch.stats_at(np.sort(batch.position[np.asarray(p, dtype=np.int64)])) for p in parts]
    costs = [float(model(s.tree_tokens, s.attention_work, s.leaves, s.sequences)) for s in stats]
    return Partition(parts, stats, costs, batch.tree.compression_ratio)


def _pick(candidates: list[Partition], slack: float) -> Partition:
    """Least total cost among the candidates within `(1 + slack)` of the smallest maximum cost."""
    best_max = min(c.max_cost for c in candidates)
    ok = [c for c in candidates if c.max_cost <= best_max * (1.0 + slack)]
    return min(ok, key=lambda c: (sum(c.costs), c.max_cost))


def _group_label(value, where: str):
    """A group label as a hashable key: an integer (any integer type, as `int`) or a string."""
    if is_int(value):
        return int(value)
    if isinstance(value, str):
        return value
    raise TypeError(f"`{where}` must be an integer or a string group label, got {value!r} of type "
                    f"{type(value).__name__}.")


def _label_dtype(array) -> bool:
    """Whether a tensor's or array's dtype can hold group labels: integers (not bool), or strings / objects for numpy
    (checked one by one afterwards)."""
    if isinstance(array, np.ndarray):
        return array.dtype.kind in "iuUO"
    return not (array.is_floating_point() or array.is_complex() or array.dtype == torch.bool)


def check_group_ids(group_ids, n: int, name: str = "group_ids") -> np.ndarray | None:
    """Dense integer labels `(n,)` in first-appearance order from `group_ids`, or `None`; errors name `name` and
    the fix."""
    if group_ids is None:
        return None
    if isinstance(group_ids, (torch.Tensor, np.ndarray)):
        if group_ids.ndim != 1 or not _label_dtype(group_ids):
            raise TypeError(f"`{name}` must be 1-D with integer or string labels, got {group_ids.dtype} of shape "
                            f"{tuple(group_ids.shape)}.")
        group_ids = group_ids.tolist()
    elif isinstance(group_ids, (str, bytes, dict, set, frozenset)) or not hasattr(group_ids, "__iter__"):
        raise TypeError(f"`{name}` must be a sequence of group labels (one per sequence), got "
                        f"{type(group_ids).__name__}.")
    group_ids = list(group_ids)
    if len(group_ids) != n:
        raise ValueError(
            f"`{name}` must give one group id per sequence: got {len(group_ids)} ids for {n} sequences"
        )
    index: dict = {}
    if all(type(g) is int for g in group_ids):  # the usual case (tensors' `tolist()`): nothing to check one by one
        return np.array([index.setdefault(g, len(index)) for g in group_ids], dtype=np.int64)
    return np.array([index.setdefault(_group_label(g, f"{name}[{i}]"), len(index))
                     for i, g in enumerate(group_ids)], dtype=np.int64)


def _check_cost_model(cost_model) -> CostModel:
    if cost_model is None:
        return CostModel()
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"`cost_model` must be a `CostModel` or None, got {type(cost_model).__name__}; build one with "
                        "`CostModel(hidden_size=...)` or `CostModel.fit(samples)`.")
    return cost_model


def partition(
    seqs_or_tree,
    k: int,
    cost_model: CostModel | None = None,
    group_ids=None,
    keep_groups: bool = True,
    equal_count: bool = False,
    strategy: str = "best",
    slack: float = 0.0,
) -> Partition:
    """Split a global batch into `k` parts (one per rank) with the smallest maximum forest cost.

    Two strategies, and `"best"` runs both and keeps the better result:

    - `"contiguous"`: sort the sequences lexicographically and cut them into `k` contiguous runs. The largest run cost
      is minimised *exactly* over all such cuts (binary search on the cost limit with a greedy probe); among the cuts
      that reach that optimum (or stay within `(1 + slack)` of it) the one that duplicates the least shared work is
      returned. Sharing is lost only at the `k - 1` cuts.
    - `"packed"`: cut the batch into *atoms* (whole groups with `group_ids` and `keep_groups`; otherwise subtrees of
      the prefix tree, split at their branch points until each costs at most `1/g` of a rank's share, for `g` in
      1, 2; finer atoms measured worse, as the packing then scatters siblings) and pack the atoms onto ranks: largest
      first onto the rank whose forest grows the least (exact union costs, so a prefix that a rank already holds,
      such as a common system prompt, is free), then moves and swaps out of the most loaded rank while they lower
      it. Heuristic, but not bound to the sorted order, which balances better when each rank gets few atoms.
    - `"best"` (default): the candidate with the least total cost among those whose maximum cost is within
      `(1 + slack)` of the smallest maximum found. Never worse than `"contiguous"` in maximum cost.

    Parts are never empty when there are at least `k` units that may be separated (sequences, or groups with
    `keep_groups`); with fewer, every unit gets its own rank and the remaining ranks get empty parts (a trainer must
    still step them).

    Args:
        seqs_or_tree (`list` of sequences or `PrefixTree`):
            The global batch: lists of token ids or 1-D integer tensors, or a tree built over them.
        k (`int`):
            Number of parts (ranks), `>= 1`.
        cost_model (`CostModel`, *optional*):
            Cost of a forest; defaults to `CostModel()`.
        group_ids (sequence, `torch.Tensor` or `np.ndarray` of shape `(n,)`, *optional*):
            A group label per sequence, an integer or a string (e.g. the prompt index of each GRPO completion). With
            `keep_groups`, a group is never split over parts. For `"contiguous"`, groups whose members interleave in
            sorted order (e.g. two groups with the same prompt) then stay in one run.
        keep_groups (`bool`, *optional*, defaults to `True`):
            Respect `group_ids`. Without it the cost model alone decides, and a split group is charged for its
            duplicated prefix.
        equal_count (`bool`, *optional*, defaults to `False`):
            Give every part exactly `n / k` sequences (`n` must be divisible by `k`), for trainers where every rank must
            run the same number of rows. Without groups the parts are the `k` equal-size contiguous runs of the sorted
            batch (balance then comes from the order alone). With `group_ids` and `keep_groups`, all groups must have
            one size `G` with `n / k` a multiple of `G`; whole groups are packed with `n / (k G)` groups per part
            (and swaps only), and the contiguous runs are kept instead when they split no group and balance better.
        strategy (`str`, *optional*, defaults to `"best"`):
            `"best"`, `"contiguous"` or `"packed"` (see above). Ignored with `equal_count`.
        slack (`float`, *optional*, defaults to `0.0`):
            Accept a maximum cost up to `(1 + slack)` times the smallest one found in exchange for less duplicated
            work (the contiguous cut then minimises duplication under that limit).

    Returns:
        [`Partition`] with `.parts` (original indices per rank, each in sorted order), `.costs`, `.imbalance`,
        `.compression_before`, `.compression_after`.
    """
    k = check_int("k", k, minimum=1, hint="the number of ranks")
    model = _check_cost_model(cost_model)
    keep_groups = check_bool("keep_groups", keep_groups)
    equal_count = check_bool("equal_count", equal_count)
    strategy = check_choice("strategy", strategy, STRATEGIES)
    slack = check_float("slack", slack, minimum=0.0, hint="the accepted excess of the maximum cost, e.g. 0.05")
    tree = as_tree(seqs_or_tree)
    n = len(tree.order)
    labels = check_group_ids(group_ids, n)
    labels = labels if keep_groups else None
    group_size = _check_equal_count(n, k, labels) if n and equal_count else None
    batch = SortedBatch(tree)
    if n == 0:
        return summarize(batch, [[] for _ in range(k)], model)

    if equal_count:
        candidates = _equal_count_candidates(batch, k, model, labels, group_size)
        slack = 0.0
    else:
        candidates = [parts for run in _STRATEGIES[strategy] for parts in run(batch, k, model, labels, slack)]
    return _pick([summarize(batch, parts, model) for parts in candidates], slack)


def _contiguous(batch: SortedBatch, k: int, model: CostModel, labels: np.ndarray | None, slack: float):
    """`"contiguous"`: the one min-max contiguous cut with the least duplication within `(1 + slack)`."""
    return [contiguous_parts(batch, k, model, labels, slack)]


def _packed(batch: SortedBatch, k: int, model: CostModel, labels: np.ndarray | None, slack: float):
    """`"packed"`: whole groups packed (with labels), else the subtree packings."""
    return [group_packing(batch, k, model, labels)] if labels is not None else subtree_packings(batch, k, model)


# Each strategy name -> the functions whose candidate parts the planner compares (`"best"`: all of them).
_STRATEGIES = {"best": (_contiguous, _packed), "contiguous": (_contiguous,), "packed": (_packed,)}
STRATEGIES = tuple(_STRATEGIES)


def _equal_count_candidates(
    batch: SortedBatch, k: int, model: CostModel, labels: np.ndarray | None, group_size: int
) -> list[list[list[int]]]:
    """`n / k` sequences per part: the equal runs of the sorted batch; with labels, whole groups packed
    `n / (k G)` per part, and the runs as well when they split no group."""
    runs = equal_runs(batch, k)
    if labels is None:
        return [runs]
    packed = group_packing(batch, k, model, labels, capacity=batch.n // k // group_size)
    per_part = batch.n // k
    splits_none = np.isin(np.arange(per_part, batch.n, per_part), batch.allowed_cuts(labels)).all()
    return [packed, runs] if splits_none else [packed]


def _check_equal_count(n: int, k: int, labels: np.ndarray | None) -> int:
    """The group size `G` that `equal_count=True` deals out `n / (k G)` per part (1 without groups); errors name the
    fix."""
    if n % k:
        raise ValueError(
            f"`equal_count=True` needs the number of sequences ({n}) to be divisible by `k` ({k}); pad the batch or "
            "use `equal_count=False`"
        )
    if labels is None:
        return 1
    sizes = sorted(set(np.bincount(labels).tolist()))
    if len(sizes) > 1 or (n // k) % sizes[0]:
        raise ValueError(
            "`equal_count=True` with `group_ids` and `keep_groups=True` needs groups of one size G with n / k a "
            f"multiple of G; got group sizes {sizes} and n / k = {n // k}. Pass `keep_groups=False` to allow "
            "splitting groups."
        )
    return sizes[0]


def partition_for_ranks(seqs_or_tree, k: int, *, group_ids=None, cost_model: CostModel | None = None) -> Partition:
    """The split of a global batch over `k` data-parallel ranks that the DTA trainers make.

    Every rank must run the same number of rows (TRL's micro-batches have one size on every rank), and a prompt's
    completions stay on one rank (their shared prompt is computed once), so this is
    `partition(..., group_ids=group_ids, keep_groups=True, equal_count=True)`: `n / k` sequences per rank, whole
    groups packed `n / (k G)` per rank by exact forest cost (or the `k` equal runs of the sorted batch when they split
    no group and balance better; without `group_ids`, those runs). `trl-dta analyze --num-processes` predicts
    balance with exactly this call, so its prediction is what training does.

    Args:
        seqs_or_tree (`list` of sequences or `PrefixTree`):
            The global batch (all ranks' rows): lists of token ids or 1-D integer tensors, or a tree built over them.
        k (`int`):
            Number of ranks, `>= 1`; must divide the number of sequences.
        group_ids (sequence, `torch.Tensor` or `np.ndarray` of shape `(n,)`, *optional*):
            A group label per sequence (integers or strings; in the trainers the prompt index). All groups must have
            one size `G` with `n / k` a multiple of `G`.
        cost_model (`CostModel`, *optional*):
            Cost of a forest; the trainers pass `CostModel(hidden_size=model.config.hidden_size)` (or its refit).
            Defaults to `CostModel()`.

    Returns:
        [`Partition`]: `.parts[rank]` holds the original indices of that rank's `n / k` sequences.

    Raises:
        `ValueError`: when `k` does not divide `n`, or the groups cannot be dealt out whole (sizes differ, or `n / k`
            is not a multiple of `G`).
    """
    return partition(seqs_or_tree, k, cost_model=cost_model, group_ids=group_ids, keep_groups=True, equal_count=True)
