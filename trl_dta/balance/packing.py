"""Packing whole atoms (groups, or subtrees of the prefix tree) onto ranks, with exact union costs and local search.

Contiguous cuts are tied to the sorted order; when each rank gets only a few atoms, packing balances better:

```
atoms (cost):  A 9   B 7   C 6   D 5   E 3      largest first, each onto the rank whose forest grows least,
rank 0:  A       9                               then moves and swaps out of the most loaded rank while they
rank 1:  B E    10                               lower it
rank 2:  C D    11                               (costs drawn as if the atoms shared no prefix)
```

A rank's cost is the cost of the *union* forest of its atoms, not the sum of their costs: a prefix that a rank already
holds (a common system prompt, the prefix shared by sibling subtrees) is free there. [`RankForest`] keeps a rank's
forest as disjoint blocks of sorted positions and updates its statistics exactly in O(log n) per block, so every
placement and every local-search step is judged by its exact effect.

Atoms are whole groups ([`group_atoms`]) or subtrees of the prefix tree split at their branch points until each costs
at most a given limit ([`subtree_atoms`]). The two strategies the planner (`partition.py`) calls, [`group_packing`] and
[`subtree_packings`], take what they need as arguments (the sorted batch, `k`, the cost model; the labels for the
first) and return parts (original indices per rank); this module imports only `cost.py`.
"""

from __future__ import annotations

import bisect

import numpy as np

from .cost import CostModel, SortedBatch, tri


def group_atoms(batch: SortedBatch, labels: np.ndarray) -> list[np.ndarray]:
    """One atom per group: its members' sorted positions."""
    pos_labels = labels[batch.order]
    return [np.flatnonzero(pos_labels == g) for g in np.unique(pos_labels)]


def subtree_atoms(batch: SortedBatch, model: CostModel, limit: float, k: int) -> list[np.ndarray]:
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


def group_packing(
    batch: SortedBatch, k: int, model: CostModel, labels: np.ndarray, capacity: int | None = None
) -> list[list[int]]:
    """Whole groups packed onto `k` ranks ([`pack`] of [`group_atoms`]); returns original indices per rank.

    Args:
        batch (`SortedBatch`): the batch in sorted order.
        k (`int`): number of ranks.
        model (`CostModel`): the cost of a rank's forest.
        labels (`np.ndarray` of shape `(n,)`): dense group labels `0..G-1` per sequence (original order).
        capacity (`int`, *optional*): at most this many groups per rank (swaps only then).
    """
    return pack(batch, group_atoms(batch, labels), k, model, capacity=capacity)


def subtree_packings(batch: SortedBatch, k: int, model: CostModel) -> list[list[list[int]]]:
    """Subtrees packed onto `k` ranks, one candidate per distinct atom set: subtrees costing at most `1/g` of a rank's
    share, for `g` in 1, 2 (finer atoms measured worse, as the packing then scatters siblings).

    Returns a list of candidates, each the original indices per rank.
    """
    total = float(batch.run_cost(0, batch.n, model))
    lcp = LcpTable(batch.lcp)
    candidates, seen = [], set()
    for g in (1, 2):
        atoms = subtree_atoms(batch, model, total / (k * g), k)
        key = tuple(int(a[0]) for a in atoms)
        if key not in seen:
            seen.add(key)
            candidates.append(pack(batch, atoms, k, model, lcp=lcp))
    return candidates


class LcpTable:
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


class RankForest:
    """The forest of one rank as disjoint blocks `[l, r)` of sorted positions, with exact incremental statistics.

    `components` = `[sequences, tree_tokens, attention_work, leaves]`. Inserting a block between the rank's nearest
    positions `pl < l` and `pr >= r` changes only the terms at its two ends: its first sequence shares `lcp(pl, l)`
    with `pl`, `pr` now shares `lcp(r - 1, pr)` instead of `lcp(pl, pr)`, and `pl` / the block's last sequence stop
    being leaves when they are prefixes of their new successor.
    """

    def __init__(self, lengths: list[int], lcp: LcpTable, block_stats):
        self.lengths, self.lcp, self.block_stats = lengths, lcp, block_stats
        self.starts: list[int] = []
        self.end: dict[int, int] = {}
        self.components = [0, 0, 0, 0]

    def copy(self) -> RankForest:
        other = RankForest(self.lengths, self.lcp, self.block_stats)
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
            att -= tri(lam)
            len_pl = self.lengths[pl]
            was_leaf = len_pl > 0 and (pr is None or self.lcp(pl, pr) < len_pl)
            leaves += int(len_pl > 0 and lam < len_pl) - int(was_leaf)
        if pr is not None:
            before = self.lcp(pl, pr) if pl is not None else 0
            after = self.lcp(r - 1, pr)
            tree_tokens -= after - before
            att -= tri(after) - tri(before)
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


class _Packing:
    """The state of one packing: the atoms' blocks and own costs, each rank's [`RankForest`] and atoms, exact costs.

    Args:
        batch (`SortedBatch`): the batch in sorted order.
        atoms (`list[np.ndarray]`): sorted positions per atom.
        k (`int`): number of ranks.
        model (`CostModel`): the cost of a rank's forest.
        lcp (`LcpTable`): the batch's LCP table.
    """

    def __init__(self, batch: SortedBatch, atoms: list[np.ndarray], k: int, model: CostModel, lcp: LcpTable):
        self.batch, self.k, self.model = batch, k, model
        self.block_cache: dict[tuple[int, int], list[int]] = {}
        lengths = batch.lengths.tolist()
        self.atom_blocks = [_blocks(a) for a in atoms]
        self.atom_cost = []
        for blocks in self.atom_blocks:
            probe = RankForest(lengths, lcp, self.block_stats)
            probe.insert(blocks)
            self.atom_cost.append(self.cost(probe.components))
        self.ranks = [RankForest(lengths, lcp, self.block_stats) for _ in range(k)]
        self.members: list[list[int]] = [[] for _ in range(k)]

    def block_stats(self, l: int, r: int) -> list[int]:
        """`[sequences, tree_tokens, attention_work, leaves]` of the block `[l, r)` on its own (cached)."""
        if (l, r) not in self.block_cache:
            seqs, _, tree_tokens, att, leaves = self.batch.run_stats(l, r)
            self.block_cache[l, r] = [int(seqs), int(tree_tokens), int(att), int(leaves)]
        return self.block_cache[l, r]

    def cost(self, c: list[int]) -> float:
        """The cost model's value of a forest's `components`."""
        m = self.model
        return m.token_cost * c[1] + m.attention_cost * c[2] + m.leaf_cost * c[3] + (m.fixed_cost if c[0] > 0 else 0.0)

    def cost_after(self, rank: int, out: int | None, into: int | None) -> float:
        """Exact cost of `rank` after removing atom `out` and adding atom `into` (either may be None)."""
        forest = self.ranks[rank]
        if out is None and into is not None and len(self.atom_blocks[into]) == 1:
            delta = forest.insert_delta(*self.atom_blocks[into][0])
            return self.cost([c + d for c, d in zip(forest.components, delta)])
        forest = forest.copy()
        if out is not None:
            forest.remove(self.atom_blocks[out])
        if into is not None:
            forest.insert(self.atom_blocks[into])
        return self.cost(forest.components)

    def apply(self, rank: int, out: int | None, into: int | None) -> None:
        """Remove atom `out` from `rank` and add atom `into` (either may be None)."""
        if out is not None:
            self.ranks[rank].remove(self.atom_blocks[out])
            self.members[rank].remove(out)
        if into is not None:
            self.ranks[rank].insert(self.atom_blocks[into])
            self.members[rank].append(into)

    def place_largest_first(self, capacity: int | None) -> None:
        """Largest atom first, each onto the rank whose cost after adding it is smallest (the first `k` atoms one per
        rank, so that no rank stays empty), among the ranks below `capacity` atoms."""
        k = self.k
        for rank_order, a in enumerate(sorted(range(len(self.atom_blocks)), key=lambda a: -self.atom_cost[a])):
            if rank_order < k:
                self.apply(rank_order, None, a)
                continue
            open_ranks = [r for r in range(k) if capacity is None or len(self.members[r]) < capacity]
            self.apply(min(open_ranks, key=lambda r: (self.cost_after(r, None, a), r)), None, a)

    def improve(self, capacity: int | None) -> None:
        """Local search: moves (without `capacity`) and swaps out of the most loaded rank while they lower it.

        Each accepted step lowers the heaviest rank and leaves the other below the heaviest's old load, so the sorted
        load vector decreases lexicographically and the loop ends. Moves are screened by their exact effect, swaps by
        the difference of the two atoms' own costs; the best few are then checked exactly.
        """
        k, members, atom_cost, cost_after = self.k, self.members, self.atom_cost, self.cost_after
        load = [self.cost(f.components) for f in self.ranks]
        for _ in range(8 * len(self.atom_blocks) + 16):
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
            self.apply(heavy, x, y)
            self.apply(r, y, x)

    def parts(self) -> list[list[int]]:
        """Original sequence indices per rank."""
        return [self.batch.order[f.positions()].tolist() for f in self.ranks]


def pack(
    batch: SortedBatch,
    atoms: list[np.ndarray],
    k: int,
    model: CostModel,
    capacity: int | None = None,
    lcp: LcpTable | None = None,
) -> list[list[int]]:
    """Pack atoms (arrays of sorted positions) onto `k` ranks; returns original sequence indices per rank.

    Largest atom first, each onto the rank whose exact forest cost after adding it is smallest (the first `k` atoms
    one per rank, so that no rank stays empty); then, while it lowers the most loaded rank, move an atom from it to
    another rank or swap one with another rank's. `capacity` limits the number of atoms per rank (swaps only then).
    Costs are exact throughout ([`RankForest`] updates a rank's statistics in O(log n) per block). `lcp`: the batch's
    [`LcpTable`], when the caller packs the same batch more than once.
    """
    packing = _Packing(batch, atoms, k, model, LcpTable(batch.lcp) if lcp is None else lcp)
    packing.place_largest_first(capacity)
    packing.improve(capacity)
    return packing.parts()
