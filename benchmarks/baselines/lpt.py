"""Longest-processing-time-first (LPT) rank balancing: the baseline that `trl_dta.balance.partition` is measured
against in `benchmarks/suites/bench_balance.py`.

LPT is what a dense trainer would do to balance ranks: weigh each item (a sequence, or a whole group) on its own and
deal the items out, heaviest first, each to the rank with the least summed weight so far. It ignores that a rank's real
work is the *union* forest of its items, so its reported costs are those true forest costs, not the summed weights.
"""

from __future__ import annotations

import numbers

from trl_dta.balance import CostModel, Partition
from trl_dta.balance.cost import SortedBatch
from trl_dta.balance.partition import check_group_ids, summarize
from trl_dta.tree import as_tree

__all__ = ["lpt_partition"]


def lpt_partition(seqs_or_tree, k: int, weight: str = "tokens", group_ids=None,
                  cost_model: CostModel | None = None) -> Partition:
    """Longest-processing-time first (first-fit decreasing onto the least-loaded rank).

    Items are whole groups when `group_ids` is given, else single sequences. Items are taken in decreasing weight and
    each goes to the rank with the smallest summed weight so far. The returned costs are the true forest costs of the
    resulting parts under `cost_model`, not the summed weights.

    Args:
        seqs_or_tree (`list` of sequences or `PrefixTree`): the global batch.
        k (`int`): number of ranks.
        weight (`str`, *optional*, defaults to `"tokens"`):
            `"tokens"` (sum of lengths: what a dense trainer balances) or `"tree_tokens"` (the item's own forest).
        group_ids (sequence or `torch.Tensor` of shape `(n,)`, *optional*): a group label per sequence.
        cost_model (`CostModel`, *optional*): for the reported costs; defaults to `CostModel()`.
    """
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"`k` must be a positive integer (the number of ranks), got {k!r} of type {type(k).__name__}.")
    k = int(k)
    if k < 1:
        raise ValueError(f"`k` must be a positive integer (the number of ranks), got {k}.")
    if weight not in ("tokens", "tree_tokens"):
        raise ValueError(f"`weight` must be one of ['tokens', 'tree_tokens'], got {weight!r}.")
    model = cost_model if cost_model is not None else CostModel()
    batch = SortedBatch(as_tree(seqs_or_tree))
    labels = check_group_ids(group_ids, batch.n)
    if labels is None:
        items = [[i] for i in range(batch.n)]
    else:
        members: dict[int, list[int]] = {}
        for i, g in enumerate(labels.tolist()):
            members.setdefault(g, []).append(i)
        items = list(members.values())
    weights = [getattr(batch.subset_stats(item), weight) for item in items]
    load = [0] * k
    parts: list[list[int]] = [[] for _ in range(k)]
    for it in sorted(range(len(items)), key=lambda i: -weights[i]):
        rank = min(range(k), key=lambda r: load[r])
        parts[rank].extend(items[it])
        load[rank] += weights[it]
    return summarize(batch, parts, model)
