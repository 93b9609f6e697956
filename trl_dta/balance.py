"""Cost model and the partition of a global batch of rollouts across data-parallel ranks.

Every rank runs the prefix tree (forest) of the sequences it gets, so a rank's work is the cost of *its* forest, not
the sum of its sequence lengths. Two things matter: balance (the step takes as long as the slowest rank) and sharing
(a shared prefix whose sequences land on two ranks is computed twice). Sorting the batch lexicographically puts
sequences that share a prefix next to each other, and cutting the sorted batch into contiguous runs loses sharing only
at the cuts:

```
sorted:   s0 s1 s2 | s3 s4 s5 s6 | s7 s8      (k = 3 runs; a cut between s2 and s3 duplicates lcp(s2, s3) tokens)
```

[`partition`] has two strategies and by default keeps the better result:

- *contiguous*: the smallest cost limit that admits `k` runs (binary search with a greedy probe, exact over all
  contiguous cuts), then, among the cuts that meet it, the one that duplicates the least work (a dynamic programme).
- *packed*: whole subtrees (or whole groups) packed onto ranks, largest first onto the rank whose forest grows least,
  then local search. Not tied to the sorted order, so it balances better when each rank gets only a few subtrees, and
  a prefix that every rank needs anyway (a common system prompt) costs nothing extra.

The duplicated work of any split into `k` non-empty parts is at least that of the best contiguous cut for tree tokens
(the parts' first occurrences in sorted order are `k - 1` cuts, and a subtree holding `c` of them meets at least
`c + 1` parts), so the kept compression of the contiguous minimum-duplication cut is an upper bound for any method.

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

import bisect
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
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= self.n):
            raise ValueError(f"sequence indices must lie in [0, {self.n}), got {idx.min()}..{idx.max()}")
        pos = np.sort(self.position[idx])
        if len(pos) and (np.diff(pos) == 0).any():
            raise ValueError("a sequence index appears twice in one part")
        return self.stats_at(pos)

    def stats_at(self, pos: np.ndarray) -> ForestStats:
        """Statistics of the forest of the sequences at sorted positions `pos` (strictly increasing)."""
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


STRATEGIES = ("best", "contiguous", "packed")


def partition(
    seqs_or_tree,
    k: int,
    cost_model: CostModel | None = None,
    group_ids: Sequence | torch.Tensor | None = None,
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
        group_ids (sequence or `torch.Tensor` of shape `(n,)`, *optional*):
            A group label per sequence (e.g. the prompt index of each GRPO completion). With `keep_groups`, a group is
            never split over parts. For `"contiguous"`, groups whose members interleave in sorted order (e.g. two
            groups with the same prompt) then stay in one run.
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
    model = cost_model if cost_model is not None else CostModel()
    tree = _as_tree(seqs_or_tree)
    batch = _SortedBatch(tree)
    labels = _check_args(batch, k, group_ids)
    if not np.isfinite(slack) or slack < 0:
        raise ValueError(f"`slack` must be a non-negative number, got {slack!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"`strategy` must be one of {STRATEGIES}, got {strategy!r}")
    labels = labels if keep_groups else None
    if batch.n == 0:
        return _summarize(batch, [[] for _ in range(k)], model)
    if equal_count:
        return _equal_count_partition(batch, k, model, labels)

    candidates = []
    if strategy in ("best", "contiguous"):
        candidates.append(_contiguous_partition(batch, k, model, labels, slack))
    if strategy in ("best", "packed"):
        if labels is not None:
            atom_sets = [_group_atoms(batch, labels)]
        else:
            total = float(batch.run_cost(0, batch.n, model))
            atom_sets = [_subtree_atoms(batch, model, total / (k * g), k) for g in (1, 2)]
        seen = set()
        for atoms in atom_sets:
            key = tuple(int(a[0]) for a in atoms)
            if key not in seen:
                seen.add(key)
                candidates.append(_summarize(batch, _pack(batch, atoms, k, model), model))
    return _pick(candidates, slack)


def _pick(candidates: list[Partition], slack: float) -> Partition:
    """Least total cost among the candidates within `(1 + slack)` of the smallest maximum cost."""
    best_max = min(c.max_cost for c in candidates)
    ok = [c for c in candidates if c.max_cost <= best_max * (1.0 + slack)]
    return min(ok, key=lambda c: (sum(c.costs), c.max_cost))


def _contiguous_partition(batch, k, model, labels, slack) -> Partition:
    cuts = _allowed_cuts(batch, labels)
    m = len(cuts) - 1
    if m <= k:
        bounds = list(range(m + 1)) + [m] * (k - m)
    else:
        limit = _min_max_limit(batch, cuts, k, model)
        bounds = _min_duplication_cuts(batch, cuts, k, limit * (1.0 + slack), model)
    order = batch.order.tolist()
    parts = [order[cuts[bounds[i]] : cuts[bounds[i + 1]]] for i in range(k)]
    return _summarize(batch, parts, model)


# ------------------------------------------------------------------------------------------------------------- packing


def _group_atoms(batch: _SortedBatch, labels: np.ndarray) -> list[np.ndarray]:
    """One atom per group: its members' sorted positions."""
    pos_labels = labels[batch.order]
    return [np.flatnonzero(pos_labels == g) for g in np.unique(pos_labels)]


def _subtree_atoms(batch: _SortedBatch, model: CostModel, limit: float, k: int) -> list[np.ndarray]:
    """Split the sorted batch into subtrees costing at most `limit` (or single sequences), and into at least `k`.

    A run `[l, r)` of sorted positions is split at its branch point: at every position whose neighbour LCP equals the
    run's smallest one (the children of the run's deepest common node). Runs over `limit` are split, then the costliest
    splittable run while there are fewer than `k` (so that every rank can get one). Returns sorted position ranges.
    """

    def split(l, r):
        inner = batch.lcp[l + 1 : r]
        bounds = [l, *(l + 1 + np.flatnonzero(inner == inner.min())).tolist(), r]
        return list(zip(bounds[:-1], bounds[1:]))

    runs, todo = [], [(0, batch.n)]
    while todo:
        l, r = todo.pop()
        if r - l > 1 and float(batch.run_cost(l, r, model)) > limit:
            todo.extend(split(l, r))
        else:
            runs.append((l, r))
    while len(runs) < k:
        splittable = [run for run in runs if run[1] - run[0] > 1]
        if not splittable:
            break
        big = max(splittable, key=lambda run: float(batch.run_cost(run[0], run[1], model)))
        runs.remove(big)
        runs.extend(split(*big))
    return [np.arange(l, r) for l, r in sorted(runs)]


class _Lcp:
    """LCP of any two sorted positions in O(1): a sparse table of range minima over the neighbour LCPs."""

    def __init__(self, lcp: np.ndarray):
        self.levels = [lcp.tolist()]
        width = 1
        while 2 * width <= len(lcp):
            prev = np.asarray(self.levels[-1])
            self.levels.append(np.minimum(prev[:-width], prev[width:]).tolist())
            width *= 2

    def __call__(self, i: int, j: int) -> int:
        """LCP of positions `i < j` = min of the neighbour LCPs over `(i, j]`."""
        level = (j - i).bit_length() - 1
        row = self.levels[level]
        return min(row[i + 1], row[j - (1 << level) + 1])


class _RankForest:
    """The forest of one rank as disjoint blocks `[l, r)` of sorted positions, with exact incremental statistics.

    `components` = `[sequences, tree_tokens, attention_work, leaves]`. Inserting a block between the rank's nearest
    positions `pl < l` and `pr >= r` changes only the terms at its two ends: its first sequence shares `lcp(pl, l)`
    with `pl`, `pr` now shares `lcp(r - 1, pr)` instead of `lcp(pl, pr)`, and `pl` / the block's last sequence stop
    being leaves when they are prefixes of their new successor.
    """

    def __init__(self, lengths: list[int], lcp: _Lcp, block_stats):
        self.lengths, self.lcp, self.block_stats = lengths, lcp, block_stats
        self.starts: list[int] = []
        self.end: dict[int, int] = {}
        self.components = [0, 0, 0, 0]

    def copy(self) -> _RankForest:
        other = _RankForest(self.lengths, self.lcp, self.block_stats)
        other.starts, other.end, other.components = list(self.starts), dict(self.end), list(self.components)
        return other

    def insert_delta(self, l: int, r: int) -> list[int]:
        seqs, tree_tokens, att, leaves = self.block_stats(l, r)
        i = bisect.bisect_left(self.starts, l)
        pl = self.end[self.starts[i - 1]] - 1 if i > 0 else None
        pr = self.starts[i] if i < len(self.starts) else None
        if pl is not None:
            lam = self.lcp(pl, l)
            tree_tokens -= lam
            att -= _tri(lam)
            len_pl = self.lengths[pl]
            was_leaf = len_pl > 0 and (pr is None or self.lcp(pl, pr) < len_pl)
            leaves += int(len_pl > 0 and lam < len_pl) - int(was_leaf)
        if pr is not None:
            before = self.lcp(pl, pr) if pl is not None else 0
            after = self.lcp(r - 1, pr)
            tree_tokens -= after - before
            att -= _tri(after) - _tri(before)
            len_last = self.lengths[r - 1]
            leaves -= int(len_last > 0 and after >= len_last)  # the block's last sequence is a prefix of pr
        return [seqs, tree_tokens, att, leaves]

    def insert(self, blocks) -> None:
        for l, r in blocks:
            delta = self.insert_delta(l, r)
            bisect.insort(self.starts, l)
            self.end[l] = r
            self.components = [c + d for c, d in zip(self.components, delta)]

    def remove(self, blocks) -> None:
        for l, r in blocks:
            self.starts.remove(l)
            del self.end[l]
            delta = self.insert_delta(l, r)
            self.components = [c - d for c, d in zip(self.components, delta)]

    def positions(self) -> np.ndarray:
        if not self.starts:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(l, self.end[l]) for l in self.starts])


def _blocks(positions: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of consecutive sorted positions, as `[l, r)` blocks."""
    if len(positions) == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(positions)]])
    return [(int(positions[a]), int(positions[b - 1]) + 1) for a, b in zip(starts, ends)]


def _pack(
    batch: _SortedBatch, atoms: list[np.ndarray], k: int, model: CostModel, capacity: int | None = None
) -> list[list[int]]:
    """Pack atoms (arrays of sorted positions) onto `k` ranks; returns original sequence indices per rank.

    Largest atom first, each onto the rank whose exact forest cost after adding it is smallest (the first `k` atoms
    one per rank, so that no rank stays empty); then, while it lowers the most loaded rank, move an atom from it to
    another rank or swap one with another rank's. `capacity` limits the number of atoms per rank (swaps only then).
    Costs are exact throughout ([`_RankForest`] updates a rank's statistics in O(log n) per block).
    """
    lengths = batch.lengths.tolist()
    lcp = _Lcp(batch.lcp)
    block_cache: dict[tuple[int, int], list[int]] = {}

    def block_stats(l, r):
        if (l, r) not in block_cache:
            seqs, _, tree_tokens, att, leaves = batch.run_stats(l, r)
            block_cache[l, r] = [int(seqs), int(tree_tokens), int(att), int(leaves)]
        return block_cache[l, r]

    tc, ac, lc, fc = model.token_cost, model.attention_cost, model.leaf_cost, model.fixed_cost

    def cost(c) -> float:
        return tc * c[1] + ac * c[2] + lc * c[3] + (fc if c[0] > 0 else 0.0)

    atom_blocks = [_blocks(a) for a in atoms]
    atom_cost = []
    for blocks in atom_blocks:
        probe = _RankForest(lengths, lcp, block_stats)
        probe.insert(blocks)
        atom_cost.append(cost(probe.components))

    ranks = [_RankForest(lengths, lcp, block_stats) for _ in range(k)]
    members: list[list[int]] = [[] for _ in range(k)]

    def cost_after(rank: int, out: int | None, into: int | None) -> float:
        """Exact cost of `rank` after removing atom `out` and adding atom `into` (either may be None)."""
        forest = ranks[rank]
        if out is None and into is not None and len(atom_blocks[into]) == 1:
            delta = forest.insert_delta(*atom_blocks[into][0])
            return cost([c + d for c, d in zip(forest.components, delta)])
        forest = forest.copy()
        if out is not None:
            forest.remove(atom_blocks[out])
        if into is not None:
            forest.insert(atom_blocks[into])
        return cost(forest.components)

    def apply(rank: int, out: int | None, into: int | None) -> None:
        if out is not None:
            ranks[rank].remove(atom_blocks[out])
            members[rank].remove(out)
        if into is not None:
            ranks[rank].insert(atom_blocks[into])
            members[rank].append(into)

    for rank_order, a in enumerate(sorted(range(len(atoms)), key=lambda a: -atom_cost[a])):
        if rank_order < k:
            apply(rank_order, None, a)
            continue
        open_ranks = [r for r in range(k) if capacity is None or len(members[r]) < capacity]
        apply(min(open_ranks, key=lambda r: (cost_after(r, None, a), r)), None, a)

    # Local search: each accepted step lowers the heaviest rank and leaves the other below the heaviest's old load, so
    # the sorted load vector decreases lexicographically and the loop ends. Moves are screened by their exact effect,
    # swaps by the difference of the two atoms' own costs; the best few are then checked exactly.
    load = [cost(f.components) for f in ranks]
    for _ in range(8 * len(atoms) + 16):
        heavy = max(range(k), key=load.__getitem__)
        options = []  # (estimated max of the two new loads, other rank, atom leaving heavy, atom entering heavy)
        movable = capacity is None and len(members[heavy]) > 1
        for x in members[heavy]:
            left = cost_after(heavy, x, None) if movable else None
            for r in range(k):
                if r == heavy:
                    continue
                if movable:
                    options.append((max(left, cost_after(r, None, x)), r, x, None))
                for y in members[r]:
                    delta = atom_cost[x] - atom_cost[y]
                    if delta > 0:
                        options.append((max(load[heavy] - delta, load[r] + delta), r, x, y))
        options = sorted(o for o in options if o[0] < load[heavy])[:8]
        best = None
        for _, r, x, y in options:
            new_heavy, new_other = cost_after(heavy, x, y), cost_after(r, y, x)
            if max(new_heavy, new_other) < load[heavy] and (best is None or max(new_heavy, new_other) < best[0]):
                best = (max(new_heavy, new_other), r, x, y, new_heavy, new_other)
        if best is None:
            break
        _, r, x, y, load[heavy], load[r] = best
        apply(heavy, x, y)
        apply(r, y, x)
    order = batch.order
    return [order[f.positions()].tolist() for f in ranks]


def _equal_count_partition(batch: _SortedBatch, k: int, model: CostModel, labels: np.ndarray | None) -> Partition:
    n = batch.n
    if n % k:
        raise ValueError(
            f"`equal_count=True` needs the number of sequences ({n}) to be divisible by `k` ({k}); pad the batch or "
            "use `equal_count=False`"
        )
    per_part = n // k
    order = batch.order.tolist()
    runs = [order[i * per_part : (i + 1) * per_part] for i in range(k)]
    contiguous = _summarize(batch, runs, model)
    if labels is None:
        return contiguous

    atoms = _group_atoms(batch, labels)
    sizes = sorted({len(a) for a in atoms})
    if len(sizes) > 1 or per_part % sizes[0]:
        raise ValueError(
            "`equal_count=True` with `group_ids` and `keep_groups=True` needs groups of one size G with n / k a "
            f"multiple of G; got group sizes {sizes} and n / k = {per_part}. Pass `keep_groups=False` to allow "
            "splitting groups."
        )
    packed = _summarize(batch, _pack(batch, atoms, k, model, capacity=per_part // sizes[0]), model)
    run_of = np.repeat(np.arange(k), per_part)[batch.position]  # part of each sequence in the contiguous runs
    splits_no_group = all(len(set(run_of[labels == g].tolist())) == 1 for g in np.unique(labels))
    return _pick([packed, contiguous] if splits_no_group else [packed], 0.0)


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
