"""Contiguous cuts of the sorted batch: the exact minimum-maximum cut, then the one that duplicates the least work.

Sorting the batch lexicographically puts sequences that share a prefix next to each other, and cutting the sorted
batch into contiguous runs loses sharing only at the cuts:

```
sorted:   s0 s1 s2 | s3 s4 s5 s6 | s7 s8      (k = 3 runs; a cut between s2 and s3 duplicates lcp(s2, s3) tokens)
```

Two passes over the allowed cut positions (every position, or only those between whole groups):

1. the smallest cost limit that admits `k` runs: bisection over the limit with a greedy left-to-right probe, which only
   ever moves to run costs that occur, so the result is exact over all contiguous cuts;
2. among the cuts into `k` runs that meet the limit, the one that duplicates the least work: the cost summed over runs
   equals the single-forest cost plus one duplication term per cut (`SortedBatch.cut_cost`), so a dynamic programme
   over the cut positions minimises the summed duplication.

The duplicated work of any split into `k` non-empty parts is at least that of the best contiguous cut for tree tokens
(the parts' first occurrences in sorted order are `k - 1` cuts, and a subtree holding `c` of them meets at least
`c + 1` parts), so the compression kept by the contiguous minimum-duplication cut bounds that of any method.

The two strategies the planner (`partition.py`) calls, [`contiguous_parts`] (the sorted batch, `k`, the cost model,
the labels, the slack) and [`equal_runs`] (the sorted batch, `k`), take what they need as arguments and return parts
(original indices per rank); this module imports only `cost.py`.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .cost import CostModel, SortedBatch


def _greedy_probe(batch, cuts, k, limit, model):
    """Greedy left-to-right runs with cost <= limit over the allowed cuts.

    Returns `(max_run_cost, None)` when at most `k` runs suffice, else `(None, next_limit)` where `next_limit` is the
    smallest limit above `limit` at which any of the first `k` greedy runs could grow (so every limit below it fails).
    """
    m = len(cuts) - 1
    a, runs, realized, grow = 0, 0, 0.0, np.inf
    while a < m:
        if runs == k:
            return None, grow
        costs = batch.run_cost(cuts[a], cuts[a + 1 :], model)  # nondecreasing in the run end
        b = a + int(np.searchsorted(costs, limit, side="right"))
        if b == a:
            return None, min(grow, float(costs[0]))
        realized = max(realized, float(costs[b - a - 1]))
        if b < m:
            grow = min(grow, float(costs[b - a]))
        runs, a = runs + 1, b
    return realized, None


def _min_max_limit(batch, cuts, k, model) -> float:
    """Smallest limit admitting <= k contiguous runs (exact: bisection that only moves to realised run costs)."""
    m = len(cuts) - 1
    single = batch.run_cost(cuts[:-1], cuts[1:], model)
    lo = float(max(single.max(), float(batch.run_cost(0, batch.n, model)) / k))
    hi, _ = _greedy_probe(batch, cuts, k, float(batch.run_cost(0, batch.n, model)), model)
    assert hi is not None and m > 0
    while lo < hi:
        mid = lo + (hi - lo) / 2
        if not lo <= mid < hi:
            mid = lo
        realized, grow = _greedy_probe(batch, cuts, k, mid, model)
        if realized is not None:
            hi = realized
        else:
            lo = max(lo, grow)
    return hi


def _min_duplication_cuts(batch, cuts, k, limit, model) -> list[int]:
    """Among the ways to cut into exactly k non-empty runs of cost <= limit, one that duplicates the least work.

    Dynamic programme over allowed cuts: `f[j][b]` = least duplication of j runs covering cuts `[0, b)`; a run ending at
    b may start at any a in `[start_min[b], b)` (monotone in b), so each layer is a sliding-window minimum.
    Returns the k+1 run boundaries as indices into `cuts`.
    """
    m = len(cuts) - 1
    # start_min[b]: smallest a with cost(cuts[a], cuts[b]) <= limit (two pointers: both ends move right).
    start_min = np.zeros(m + 1, dtype=np.int64)
    a = 0
    for b in range(1, m + 1):
        while a < b and float(batch.run_cost(cuts[a], cuts[b], model)) > limit:
            a += 1
        start_min[b] = a
    dup = np.zeros(m + 1)
    dup[1:m] = batch.cut_cost(cuts[1:m], model)
    inf = np.inf
    f_prev = np.full(m + 1, inf)
    f_prev[0] = 0.0
    back = np.zeros((k + 1, m + 1), dtype=np.int64)
    for j in range(1, k + 1):
        f = np.full(m + 1, inf)
        window: deque[int] = deque()  # candidate starts a, increasing, with increasing f_prev[a] + dup[a]
        nxt = j - 1  # next start to admit
        for b in range(j, m - (k - j) + 1):
            while nxt < b:
                val = f_prev[nxt] + dup[nxt]
                while window and f_prev[window[-1]] + dup[window[-1]] >= val:
                    window.pop()
                window.append(nxt)
                nxt += 1
            while window and window[0] < start_min[b]:
                window.popleft()
            if window and f_prev[window[0]] < inf:
                f[b] = f_prev[window[0]] + dup[window[0]]
                back[j, b] = window[0]
        f_prev = f
    if not np.isfinite(f_prev[m]):
        raise RuntimeError("internal error: no k-run partition within the optimal limit (please report)")
    bounds = [m]
    for j in range(k, 0, -1):
        bounds.append(int(back[j, bounds[-1]]))
    return bounds[::-1]


def contiguous_parts(
    batch: SortedBatch, k: int, model: CostModel, labels: np.ndarray | None, slack: float
) -> list[list[int]]:
    """`k` contiguous runs of the sorted batch (original indices each) with the least maximum cost, then the least
    duplication within `(1 + slack)` of it; runs never split a group of `labels`. Trailing runs are empty when there
    are fewer than `k` separable units."""
    cuts = batch.allowed_cuts(labels)
    m = len(cuts) - 1
    if m <= k:
        bounds = list(range(m + 1)) + [m] * (k - m)
    else:
        limit = _min_max_limit(batch, cuts, k, model)
        bounds = _min_duplication_cuts(batch, cuts, k, limit * (1.0 + slack), model)
    order = batch.order.tolist()
    return [order[cuts[bounds[i]] : cuts[bounds[i + 1]]] for i in range(k)]


def equal_runs(batch: SortedBatch, k: int) -> list[list[int]]:
    """The `k` equal-size contiguous runs of the sorted batch (`batch.n` divisible by `k`)."""
    per_part = batch.n // k
    order = batch.order.tolist()
    return [order[i * per_part : (i + 1) * per_part] for i in range(k)]
