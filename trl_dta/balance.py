"""Cost model and the partition of a global batch of rollouts across data-parallel ranks.

Every rank runs the prefix tree (forest) of the sequences it gets, so a rank's work is the cost of *its* forest, not
the sum of its sequence lengths. Two things matter: balance (the step takes as long as the slowest rank) and sharing
(a shared prefix whose sequences land on two ranks is computed twice). Sorting the batch lexicographically puts
sequences that share a prefix next to each other, and cutting the sorted batch into contiguous runs loses sharing only
at the cuts:

```
sorted:   s0 s1 s2 | s3 s4 s5 s6 | s7 s8      (k = 3 runs; a cut between s2 and s3 duplicates lcp(s2, s3) tokens)
```

[`partition`] finds the smallest cost limit that admits `k` runs (binary search with a greedy probe, exact), then,
among all cuts that meet that limit, the one that duplicates the least work (a dynamic programme over cut positions).

Cost of a forest (see [`CostModel`]):

```
cost = token_cost * tree_tokens + attention_cost * attention_work + leaf_cost * leaves + fixed_cost
```

with `attention_work` = number of (query, key) pairs of causal attention over the tree = sum over tree tokens of their
depth counted from 1, and `leaves` = segments without children (one forward/backward call each in a depth-first walk).

All quantities of a contiguous run of the sorted batch come from prefix sums over the sorted lengths `L` and the
neighbour LCPs `P` (`PrefixTree.order_lcp`):

```
tree_tokens[l, r)    = L[l] + sum_{j=l+1}^{r-1} (L[j] - P[j])
attention_work[l, r) = tri(L[l]) + sum_{j=l+1}^{r-1} (tri(L[j]) - tri(P[j])),      tri(x) = x (x + 1) / 2
```

and the cost summed over runs equals the single-forest cost plus one duplication term per cut, which is what the
second pass minimises.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from .tree import PrefixTree


# ---------------------------------------------------------------------------------------------------------- cost model


@dataclass
class CostModel:
    """Cost of running one forest (a rank's share of the batch) through the tree engine.

    `cost = token_cost * tree_tokens + attention_cost * attention_work + leaf_cost * leaves + fixed_cost` (the fixed
    term only for a forest with at least one sequence). The defaults count work in units of one token's linear work
    (projections and MLP, about `12 * hidden_size**2` multiply-adds per layer): attention costs about `2 * hidden_size`
    multiply-adds per (query, key) pair per layer, hence `attention_cost = 1 / (6 * hidden_size)`. A leaf costs one
    extra forward/backward call (launch and synchronisation overhead), counted as `leaf_cost` tokens. Fit the
    coefficients to measured step times with [`CostModel.fit`].

    Args:
        token_cost (`float`, *optional*, defaults to `1.0`):
            Cost per tree token (token-linear work: projections, MLP, LM head).
        attention_cost (`float`, *optional*):
            Cost per (query, key) pair of causal attention. Defaults to `1 / (6 * hidden_size)`.
        leaf_cost (`float`, *optional*, defaults to `16.0`):
            Cost per leaf segment of the forest (per forward/backward call of a depth-first walk).
        fixed_cost (`float`, *optional*, defaults to `0.0`):
            Cost of a non-empty forest regardless of its size (per-step overhead).
        hidden_size (`int`, *optional*, defaults to `4096`):
            Model width, used only to derive the default `attention_cost`.
    """

    token_cost: float = field(default=1.0, metadata={"help": "Cost per tree token (token-linear work)."})
    attention_cost: float | None = field(
        default=None,
        metadata={"help": "Cost per (query, key) pair of causal attention. Defaults to 1 / (6 * hidden_size)."},
    )
    leaf_cost: float = field(default=16.0, metadata={"help": "Cost per leaf segment (one forward/backward call)."})
    fixed_cost: float = field(default=0.0, metadata={"help": "Cost of a non-empty forest regardless of its size."})
    hidden_size: int = field(default=4096, metadata={"help": "Model width, used for the default attention_cost."})

    def __post_init__(self):
        if not isinstance(self.hidden_size, int) or self.hidden_size < 1:
            raise ValueError(f"`hidden_size` must be a positive integer, got {self.hidden_size!r}")
        if self.attention_cost is None:
            self.attention_cost = 1.0 / (6.0 * self.hidden_size)
        for name in ("token_cost", "attention_cost", "leaf_cost", "fixed_cost"):
            value = float(getattr(self, name))
            if not np.isfinite(value) or value < 0:
                raise ValueError(
                    f"`{name}` must be a finite non-negative number (costs must grow with the forest), got {value!r}"
                )
            setattr(self, name, value)

    def __call__(self, tree_tokens, attention_work, leaves, sequences=1):
        """Cost from forest statistics; scalars or numpy arrays of the same shape (broadcast)."""
        return (
            self.token_cost * tree_tokens
            + self.attention_cost * attention_work
            + self.leaf_cost * leaves
            + self.fixed_cost * (np.asarray(sequences) > 0)
        )

    def forest_cost(self, seqs_or_tree) -> float:
        """Cost of the forest of a list of sequences or a `PrefixTree`."""
        s = forest_stats(seqs_or_tree)
        return float(self(s.tree_tokens, s.attention_work, s.leaves, s.sequences))

    @classmethod
    def fit(cls, samples, fixed_cost: bool = True, hidden_size: int = 4096) -> CostModel:
        """Fit non-negative coefficients to measured step times by non-negative least squares.

        Args:
            samples (array-like of shape `(n_samples, 4)`):
                Rows `(tree_tokens, attention_work, leaves, seconds)`, e.g. one row per rank and step, with the
                statistics from [`forest_stats`].
            fixed_cost (`bool`, *optional*, defaults to `True`):
                Also fit a per-forest constant (overhead that does not depend on the forest).
            hidden_size (`int`, *optional*, defaults to `4096`):
                Stored in the result only (the fitted `attention_cost` is used, not derived).

        Returns:
            `CostModel` whose costs are in seconds.
        """
        data = np.asarray(samples, dtype=np.float64)
        if data.ndim != 2 or data.shape[1] != 4:
            raise ValueError(
                "`samples` must have shape (n_samples, 4) with rows (tree_tokens, attention_work, leaves, seconds), "
                f"got shape {data.shape}"
            )
        if not np.isfinite(data).all() or (data < 0).any():
            raise ValueError("`samples` must hold finite non-negative numbers")
        columns = [data[:, 0], data[:, 1], data[:, 2]] + ([np.ones(len(data))] if fixed_cost else [])
        if len(data) < len(columns):
            raise ValueError(f"`CostModel.fit` needs at least {len(columns)} samples, got {len(data)}")
        coef = _nnls(np.stack(columns, axis=1), data[:, 3])
        return cls(
            token_cost=coef[0],
            attention_cost=coef[1],
            leaf_cost=coef[2],
            fixed_cost=coef[3] if fixed_cost else 0.0,
            hidden_size=hidden_size,
        )

    def to_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a handful of columns: best unconstrained fit over every support set.

    The NNLS optimum is the least-squares solution restricted to its support, so the feasible (all >= 0) restricted
    solution with the smallest residual is the optimum. Columns are scaled to unit norm first for conditioning.
    """
    n_cols = a.shape[1]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a_s = a / scale
    best, best_res = np.zeros(n_cols), float(np.sum(b**2))
    for size in range(1, n_cols + 1):
        for support in itertools.combinations(range(n_cols), size):
            cols = list(support)
            x, *_ = np.linalg.lstsq(a_s[:, cols], b, rcond=None)
            if (x < 0).any():
                continue
            res = float(np.sum((a_s[:, cols] @ x - b) ** 2))
            if res < best_res:
                best_res, best = res, np.zeros(n_cols)
                best[cols] = x
    return best / scale


# ------------------------------------------------------------------------------------------------- forest statistics


@dataclass(frozen=True)
class ForestStats:
    """Shape of one forest.

    Args:
        sequences (`int`): number of sequences.
        tokens (`int`): sum of the sequence lengths (dense work).
        tree_tokens (`int`): distinct prefixes = tokens of the prefix tree.
        attention_work (`int`): (query, key) pairs of causal attention over the tree (sum of tree-token depths, from 1).
        leaves (`int`): segments without children (= distinct non-empty sequences that are no prefix of another).
    """

    sequences: int
    tokens: int
    tree_tokens: int
    attention_work: int
    leaves: int


def _tri(x):
    return x * (x + 1) // 2


def _as_tree(seqs_or_tree) -> PrefixTree:
    if isinstance(seqs_or_tree, PrefixTree):
        return seqs_or_tree
    return PrefixTree.from_sequences(seqs_or_tree)


class _SortedBatch:
    """The batch in lexicographic order with prefix sums, for O(1) statistics of any contiguous run.

    Positions `p = 0..n-1` index the sorted order (`tree.order[p]` is the sequence at position p).
    """

    def __init__(self, tree: PrefixTree):
        self.tree = tree
        self.order = np.asarray(tree.order, dtype=np.int64)
        self.n = n = len(self.order)
        self.position = np.empty(n, dtype=np.int64)
        self.position[self.order] = np.arange(n)
        lengths = np.asarray(tree.lengths, dtype=np.int64)[self.order] if n else np.zeros(0, dtype=np.int64)
        lcp = np.asarray(tree.order_lcp, dtype=np.int64) if n else np.zeros(0, dtype=np.int64)
        self.lengths, self.lcp = lengths, lcp
        # A sequence is a leaf of the whole forest unless it is a prefix of (or equal to) the next one.
        next_lcp = np.append(lcp[1:], -1)
        self.is_leaf = (lengths > 0) & (next_lcp < lengths)
        zero = np.zeros(1, dtype=np.int64)
        self.cum_tokens = np.concatenate([zero, np.cumsum(lengths)])
        self.cum_new = np.concatenate([zero, np.cumsum(lengths - lcp)])
        self.cum_att = np.concatenate([zero, np.cumsum(_tri(lengths) - _tri(lcp))])
        self.cum_leaf = np.concatenate([zero, np.cumsum(self.is_leaf)])
        # A cut before position p (0 < p < n) turns the previous sequence into a leaf when it is a prefix of s_p.
        self.lcp_ext = np.append(lcp, 0)  # lcp_ext[n] = 0: no sequence after the end
        prev_len = np.concatenate([[0], lengths])  # prev_len[p] = length of position p-1
        self.cut_leaf = (prev_len > 0) & (self.lcp_ext == prev_len)
        self.cut_leaf[0] = False

    def run_stats(self, l, r):
        """Statistics of runs `[l, r)` of sorted positions; `l`, `r` ints or broadcastable int arrays, `l <= r`.

        Returns `(sequences, tokens, tree_tokens, attention_work, leaves)`, zeros for empty runs.
        """
        l, r = np.asarray(l, dtype=np.int64), np.asarray(r, dtype=np.int64)
        nonempty = r > l
        lc = np.minimum(l, max(self.n - 1, 0))
        first_lcp = np.where(nonempty, self.lcp_ext[lc], 0) if self.n else np.zeros_like(l)
        seqs = r - l
        tokens = self.cum_tokens[r] - self.cum_tokens[l]
        tree_tokens = self.cum_new[r] - self.cum_new[l] + first_lcp
        att = self.cum_att[r] - self.cum_att[l] + _tri(first_lcp)
        leaves = self.cum_leaf[r] - self.cum_leaf[l] + (nonempty & self.cut_leaf[r])
        return seqs, tokens, tree_tokens, att, leaves

    def run_cost(self, l, r, model: CostModel):
        seqs, _, tree_tokens, att, leaves = self.run_stats(l, r)
        return model(tree_tokens, att, leaves, seqs)

    def cut_cost(self, p, model: CostModel):
        """Extra cost (duplicated work) of cutting the sorted batch before position `p` (0 < p < n)."""
        lcp = self.lcp_ext[p]
        return model(lcp, _tri(lcp), self.cut_leaf[p], 1)

    def subset_stats(self, indices) -> ForestStats:
        """Statistics of the forest of any subset of sequences (original indices)."""
        pos = np.sort(self.position[np.asarray(indices, dtype=np.int64)]) if len(indices) else np.zeros(0, np.int64)
        if len(pos) and (np.diff(pos) == 0).any():
            raise ValueError("a sequence index appears twice in one part")
        m = len(pos)
        if m == 0:
            return ForestStats(0, 0, 0, 0, 0)
        lengths = self.lengths[pos]
        # LCP of two sorted positions i < j is the minimum neighbour LCP over (i, j].
        lcp = np.zeros(m, dtype=np.int64)
        if m > 1:
            lcp[1:] = np.minimum.reduceat(self.lcp[: pos[-1] + 1], pos[:-1] + 1)
        next_lcp = np.append(lcp[1:], -1)
        return ForestStats(
            sequences=m,
            tokens=int(lengths.sum()),
            tree_tokens=int((lengths - lcp).sum()),
            attention_work=int((_tri(lengths) - _tri(lcp)).sum()),
            leaves=int(((lengths > 0) & (next_lcp < lengths)).sum()),
        )


def forest_stats(seqs_or_tree, indices: Sequence[int] | None = None) -> ForestStats:
    """Statistics of the forest of a batch (a list of sequences or a `PrefixTree`), or of the subset `indices` of it."""
    batch = _SortedBatch(_as_tree(seqs_or_tree))
    return batch.subset_stats(range(batch.n) if indices is None else list(indices))


# ---------------------------------------------------------------------------------------------------------- partition


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


def _summarize(batch: _SortedBatch, parts: list[list[int]], model: CostModel) -> Partition:
    parts = [sorted(p, key=lambda i: batch.position[i]) for p in parts]
    stats = [batch.subset_stats(p) for p in parts]
    costs = [float(model(s.tree_tokens, s.attention_work, s.leaves, s.sequences)) for s in stats]
    return Partition(parts, stats, costs, batch.tree.compression_ratio)


def _check_args(batch: _SortedBatch, k, group_ids) -> np.ndarray | None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"`k` (the number of ranks) must be an integer >= 1, got {k!r}")
    if group_ids is None:
        return None
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()
    group_ids = list(group_ids)
    if len(group_ids) != batch.n:
        raise ValueError(
            f"`group_ids` must give one group id per sequence: got {len(group_ids)} ids for {batch.n} sequences"
        )
    # Dense integer labels in first-appearance order (any hashable ids).
    index: dict = {}
    try:
        return np.array([index.setdefault(g, len(index)) for g in group_ids], dtype=np.int64)
    except TypeError as e:
        raise ValueError(f"`group_ids` must be hashable labels (ints or strings): {e}") from None


def _allowed_cuts(batch: _SortedBatch, labels: np.ndarray | None) -> np.ndarray:
    """Sorted positions where a run may start/end: 0, n, and every position not inside a group's span."""
    n = batch.n
    if labels is None:
        return np.arange(n + 1, dtype=np.int64)
    group_of_pos = labels[batch.order]
    n_groups = int(labels.max()) + 1 if n else 0
    first = np.full(n_groups, n, dtype=np.int64)
    last = np.full(n_groups, -1, dtype=np.int64)
    np.minimum.at(first, group_of_pos, np.arange(n))
    np.maximum.at(last, group_of_pos, np.arange(n))
    # A cut before position p is forbidden when some group has members at positions < p and >= p.
    blocked = np.zeros(n + 2, dtype=np.int64)
    np.add.at(blocked, first + 1, 1)
    np.add.at(blocked, last + 1, -1)
    inside = np.cumsum(blocked)[: n + 1] > 0
    inside[0] = inside[n] = False
    return np.flatnonzero(~inside).astype(np.int64)


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


def partition(
    seqs_or_tree,
    k: int,
    cost_model: CostModel | None = None,
    group_ids: Sequence | torch.Tensor | None = None,
    keep_groups: bool = True,
    equal_count: bool = False,
    slack: float = 0.0,
) -> Partition:
    """Split a global batch into `k` parts (one per rank) with the smallest maximum forest cost.

    The sequences are sorted lexicographically and cut into `k` contiguous runs. The largest run cost is minimised
    exactly over all such cuts (binary search on the cost limit with a greedy probe); among the cuts that reach that
    optimum (or stay within `(1 + slack)` of it) the one that duplicates the least shared work is returned.

    Parts are never empty when there are at least `k` cuttable units (sequences, or groups with `keep_groups`); with
    fewer units every unit gets its own rank and the last ranks get empty parts (a trainer must still step them).

    Args:
        seqs_or_tree (`list` of sequences or `PrefixTree`):
            The global batch: lists of token ids or 1-D integer tensors, or a tree built over them.
        k (`int`):
            Number of parts (ranks), `>= 1`.
        cost_model (`CostModel`, *optional*):
            Cost of a forest; defaults to `CostModel()`.
        group_ids (sequence or `torch.Tensor` of shape `(n,)`, *optional*):
            A group label per sequence (e.g. the prompt index of each GRPO completion). With `keep_groups`, cuts never
            separate two members of a group; groups whose members interleave in sorted order (e.g. two groups with
            the same prompt) then stay together.
        keep_groups (`bool`, *optional*, defaults to `True`):
            Respect `group_ids` (cut only between groups). Without it the cost model alone decides, and a split group
            is charged for its duplicated prefix.
        equal_count (`bool`, *optional*, defaults to `False`):
            Give every part exactly `n / k` sequences (`n` must be divisible by `k`). Without groups the parts are the
            `k` equal-size contiguous runs of the sorted batch (balance then comes from the order alone). With
            `group_ids` and `keep_groups`, all groups must have the same size `G` with `n / k` a multiple of `G`;
            whole groups are assigned by longest-processing-time first with a per-part group count, then improved by
            pairwise swaps (parts are then not contiguous in sorted order; sharing between different groups, such as
            a common system prompt, is kept once per part).
        slack (`float`, *optional*, defaults to `0.0`):
            Accept a maximum cost up to `(1 + slack)` times the optimum in exchange for less duplicated work.

    Returns:
        [`Partition`] with `.parts` (original indices per rank), `.costs`, `.imbalance`, `.compression_before`,
        `.compression_after`.
    """
    model = cost_model if cost_model is not None else CostModel()
    tree = _as_tree(seqs_or_tree)
    batch = _SortedBatch(tree)
    labels = _check_args(batch, k, group_ids)
    if not np.isfinite(slack) or slack < 0:
        raise ValueError(f"`slack` must be a non-negative number, got {slack!r}")
    n = batch.n
    if n == 0:
        return _summarize(batch, [[] for _ in range(k)], model)
    if equal_count:
        return _equal_count_partition(batch, k, model, labels if keep_groups else None)

    cuts = _allowed_cuts(batch, labels if keep_groups else None)
    m = len(cuts) - 1
    if m <= k:
        bounds = list(range(m + 1)) + [m] * (k - m)
    else:
        limit = _min_max_limit(batch, cuts, k, model)
        bounds = _min_duplication_cuts(batch, cuts, k, limit * (1.0 + slack), model)
    order = batch.order.tolist()
    parts = [order[cuts[bounds[i]] : cuts[bounds[i + 1]]] for i in range(k)]
    return _summarize(batch, parts, model)


def _equal_count_partition(batch: _SortedBatch, k: int, model: CostModel, labels: np.ndarray | None) -> Partition:
    n = batch.n
    if n % k:
        raise ValueError(
            f"`equal_count=True` needs the number of sequences ({n}) to be divisible by `k` ({k}); pad the batch or "
            "use `equal_count=False`"
        )
    per_part = n // k
    order = batch.order.tolist()
    if labels is None:
        return _summarize(batch, [order[i * per_part : (i + 1) * per_part] for i in range(k)], model)

    members: dict[int, list[int]] = {}
    for i, g in enumerate(labels.tolist()):
        members.setdefault(g, []).append(i)
    sizes = {len(v) for v in members.values()}
    size = sizes.pop()
    if sizes or per_part % size:
        raise ValueError(
            "`equal_count=True` with `group_ids` and `keep_groups=True` needs groups of one size G with n / k a "
            f"multiple of G; got group sizes {sorted({len(v) for v in members.values()})} and n / k = {per_part}. "
            "Pass `keep_groups=False` to allow splitting groups."
        )
    capacity = per_part // size
    groups = list(members.values())
    load = [0.0] * k
    group_cost = [_subset_cost(batch, g, model) for g in groups]
    assigned: list[list[int]] = [[] for _ in range(k)]
    # Longest processing time first, restricted to parts with room left.
    for gi in sorted(range(len(groups)), key=lambda g: -group_cost[g]):
        rank = min((r for r in range(k) if len(assigned[r]) < capacity), key=lambda r: load[r])
        assigned[rank].append(gi)
        load[rank] += group_cost[gi]
    # Pairwise swaps out of the heaviest part while they lower the larger of the two loads.
    for _ in range(4 * len(groups)):
        heavy = max(range(k), key=lambda r: load[r])
        best = None
        for r in range(k):
            if r == heavy:
                continue
            for x in assigned[heavy]:
                for y in assigned[r]:
                    delta = group_cost[x] - group_cost[y]
                    if delta <= 0:
                        continue
                    new_max = max(load[heavy] - delta, load[r] + delta)
                    if new_max < load[heavy] and (best is None or new_max < best[0]):
                        best = (new_max, r, x, y)
        if best is None:
            break
        _, r, x, y = best
        assigned[heavy][assigned[heavy].index(x)] = y
        assigned[r][assigned[r].index(y)] = x
        delta = group_cost[x] - group_cost[y]
        load[heavy] -= delta
        load[r] += delta
    parts = [[i for gi in assigned[r] for i in groups[gi]] for r in range(k)]
    return _summarize(batch, parts, model)


def _subset_cost(batch: _SortedBatch, indices, model: CostModel) -> float:
    s = batch.subset_stats(indices)
    return float(model(s.tree_tokens, s.attention_work, s.leaves, s.sequences))


# ---------------------------------------------------------------------------------------------------------- baselines


def lpt_partition(
    seqs_or_tree,
    k: int,
    weight: str = "tokens",
    group_ids: Sequence | torch.Tensor | None = None,
    cost_model: CostModel | None = None,
) -> Partition:
    """Baseline: longest-processing-time first (first-fit decreasing onto the least-loaded rank).

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
    if weight not in ("tokens", "tree_tokens"):
        raise ValueError(f"`weight` must be 'tokens' or 'tree_tokens', got {weight!r}")
    model = cost_model if cost_model is not None else CostModel()
    batch = _SortedBatch(_as_tree(seqs_or_tree))
    labels = _check_args(batch, k, group_ids)
    if labels is None:
        items = [[i] for i in range(batch.n)]
    else:
        members: dict[int, list[int]] = {}
        for i, g in enumerate(labels.tolist()):
            members.setdefault(g, []).append(i)
        items = list(members.values())
    key = "tokens" if weight == "tokens" else "tree_tokens"
    weights = [getattr(batch.subset_stats(item), key) for item in items]
    load = [0] * k
    parts: list[list[int]] = [[] for _ in range(k)]
    for it in sorted(range(len(items)), key=lambda i: -weights[i]):
        rank = min(range(k), key=lambda r: load[r])
        parts[rank].extend(items[it])
        load[rank] += weights[it]
    return _summarize(batch, parts, model)
