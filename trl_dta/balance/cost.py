"""Cost model of a rank's forest, and the forest statistics it reads.

Every rank runs the prefix tree (forest) of the sequences it gets, so a rank's work is the cost of *its* forest, not
the sum of its sequence lengths. The cost of a forest (see [`CostModel`]):

```
cost = token_cost * tree_tokens + attention_cost * attention_work + leaf_cost * leaves + fixed_cost
```

with `attention_work` = number of (query, key) pairs of causal attention over the tree = sum over tree tokens of their
depth counted from 1, and `leaves` = segments without children (one forward/backward call each in a depth-first walk):

```
seqs:  a b c d | a b c e | a b          tree:  [a b] -> [c] -> [d], [e]
tree_tokens    = 5                      (a, b, c, d, e)
attention_work = 1 + 2 + 3 + 4 + 4      (the depth of each tree token)
leaves         = 2                      ([d] and [e]; [a b] ends a sequence but has children)
```

All statistics of a contiguous run of the lexicographically sorted batch come from prefix sums over the sorted lengths
`L` and the neighbour LCPs `P` (`PrefixTree.order_lcp`), which [`SortedBatch`] holds:

```
tree_tokens[l, r)    = L[l] + sum_{j=l+1}^{r-1} (L[j] - P[j])
attention_work[l, r) = tri(L[l]) + sum_{j=l+1}^{r-1} (tri(L[j]) - tri(P[j])),      tri(x) = x (x + 1) / 2
```

The coefficients default to FLOP ratios for a model width and can be fitted to measured step times
([`CostModel.fit`], exact non-negative least squares).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields

import numpy as np

from .._checks import check_bool, check_float, check_int, is_int
from ..tree import PrefixTree, as_tree


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
        self.hidden_size = check_int("hidden_size", self.hidden_size, minimum=1, hint="the model width")
        if self.attention_cost is None:
            self.attention_cost = 1.0 / (6.0 * self.hidden_size)
        for name in ("token_cost", "attention_cost", "leaf_cost", "fixed_cost"):
            value = check_float(name, getattr(self, name), minimum=0.0, hint="costs must grow with the forest")
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
        fixed_cost = check_bool("fixed_cost", fixed_cost)
        try:
            data = np.asarray(samples, dtype=np.float64)
        except (TypeError, ValueError):
            raise TypeError(
                "`samples` must be an array-like of numbers of shape (n_samples, 4), rows (tree_tokens, "
                f"attention_work, leaves, seconds); got {type(samples).__name__}"
            ) from None
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


def tri(x):
    """`x (x + 1) / 2`: the causal attention pairs of `x` tokens (ints or integer arrays)."""
    return x * (x + 1) // 2


class SortedBatch:
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
        self.cum_att = np.concatenate([zero, np.cumsum(tri(lengths) - tri(lcp))])
        self.cum_leaf = np.concatenate([zero, np.cumsum(self.is_leaf)])
        # A cut before position p (0 < p < n) turns the previous sequence into a leaf when it is a prefix of s_p.
        self.lcp_ext = np.append(lcp, 0)  # lcp_ext[n] = 0: no sequence after the end
        prev_len = np.concatenate([[0], lengths])  # prev_len[p] = length of position p-1
        self.cut_leaf = (prev_len > 0) & (self.lcp_ext == prev_len)
        self.cut_leaf[0] = False

    def allowed_cuts(self, labels: np.ndarray | None) -> np.ndarray:
        """Sorted positions where a run may start/end: 0, n, and every position not inside a group's span."""
        n = self.n
        if labels is None:
            return np.arange(n + 1, dtype=np.int64)
        group_of_pos = labels[self.order]
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
        att = self.cum_att[r] - self.cum_att[l] + tri(first_lcp)
        leaves = self.cum_leaf[r] - self.cum_leaf[l] + (nonempty & self.cut_leaf[r])
        return seqs, tokens, tree_tokens, att, leaves

    def run_cost(self, l, r, model: CostModel):
        seqs, _, tree_tokens, att, leaves = self.run_stats(l, r)
        return model(tree_tokens, att, leaves, seqs)

    def cut_cost(self, p, model: CostModel):
        """Extra cost (duplicated work) of cutting the sorted batch before position `p` (0 < p < n)."""
        lcp = self.lcp_ext[p]
        return model(lcp, tri(lcp), self.cut_leaf[p], 1)

    def subset_stats(self, indices, name: str = "indices") -> ForestStats:
        """Statistics of the forest of any subset of sequences (original indices)."""
        idx = list(indices)
        for j, i in enumerate(idx if not set(map(type, idx)) <= {int} else ()):
            if not is_int(i):
                raise TypeError(f"`{name}[{j}]` must be an integer sequence index, got {i!r} of type "
                                f"{type(i).__name__}.")
        idx = np.asarray([int(i) for i in idx], dtype=np.int64)
        if len(idx) and (idx.min() < 0 or idx.max() >= self.n):
            raise ValueError(f"`{name}` must lie in [0, {self.n}), got {idx.min()}..{idx.max()}")
        pos = np.sort(self.position[idx])
        if len(pos) and (np.diff(pos) == 0).any():
            raise ValueError(f"`{name}`: a sequence index appears twice")
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
            attention_work=int((tri(lengths) - tri(lcp)).sum()),
            leaves=int(((lengths > 0) & (next_lcp < lengths)).sum()),
        )


def forest_stats(seqs_or_tree, indices=None) -> ForestStats:
    """Statistics of the forest of a batch, or of the subset `indices` of it.

    Args:
        seqs_or_tree (`list` of sequences or `PrefixTree`): lists of token ids or 1-D integer tensors, or a tree.
        indices (iterable of `int`, *optional*): original indices of the sequences to count (each at most once).
    """
    batch = SortedBatch(as_tree(seqs_or_tree))
    if indices is None:
        return batch.stats_at(np.arange(batch.n))
    if isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__"):
        raise TypeError(f"`indices` must be an iterable of sequence indices, got {type(indices).__name__}.")
    return batch.subset_stats(indices)
