"""References for the balance tests: forest statistics from a freshly built `PrefixTree` and a brute force over every
contiguous cut, plus hypothesis strategies. Nothing here comes from `trl_dta.balance` but the `CostModel` formula."""

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from trl_dta.balance import CostModel, ForestStats
from trl_dta.tree import PrefixTree

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Small alphabet and short sequences: many shared prefixes, duplicates, prefixes of other sequences, empty sequences.
seq_st = st.lists(st.integers(0, 2), min_size=0, max_size=6)
batch_st = st.lists(seq_st, min_size=0, max_size=8)
# Cost models with attention and leaf terms large enough to matter at these sizes.
model_st = st.builds(
    CostModel,
    token_cost=st.sampled_from([0.0, 1.0, 2.5]),
    attention_cost=st.sampled_from([0.0, 0.01, 0.3]),
    leaf_cost=st.sampled_from([0.0, 1.0, 4.0]),
    fixed_cost=st.sampled_from([0.0, 3.0]),
)


def reference_stats(seqs) -> ForestStats:
    """Forest statistics from a freshly built PrefixTree (independent of balance.py's prefix sums)."""
    tree = PrefixTree.from_sequences(seqs)
    attention = sum(sum(range(s.start + 1, s.end + 1)) for s in tree.segments)
    return ForestStats(len(seqs), tree.n_tokens, tree.n_tree_tokens, attention, tree.n_leaves)


def reference_cost(seqs, model: CostModel) -> float:
    s = reference_stats(seqs)
    return float(model(s.tree_tokens, s.attention_work, s.leaves, s.sequences))


def contiguous_cuts(n_units, k):
    """All ways to cut `n_units` units into `min(k, n_units)` non-empty contiguous runs (as boundary lists)."""
    runs = min(k, n_units)
    for inner in itertools.combinations(range(1, n_units), runs - 1):
        yield [0, *inner, n_units]


def allowed_positions(order, group_ids):
    """Sorted positions where a cut does not separate two members of a group (brute force)."""
    n = len(order)
    allowed = [0]
    for p in range(1, n):
        left = {group_ids[i] for i in order[:p]}
        right = {group_ids[i] for i in order[p:]}
        if not left & right:
            allowed.append(p)
    return allowed + [n] if n else [0]


def brute_force(seqs, k, model, group_ids=None):
    """(optimal max cost, least total cost among optimal cuts) over contiguous cuts of the sorted batch."""
    tree = PrefixTree.from_sequences(seqs)
    order = tree.order
    positions = allowed_positions(order, group_ids) if group_ids is not None else list(range(len(seqs) + 1))
    best = None
    for bounds in contiguous_cuts(len(positions) - 1, k):
        costs = [
            reference_cost([seqs[i] for i in order[positions[a] : positions[b]]], model)
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
        key = (max(costs), sum(costs))
        best = key if best is None or key < best else best
    return best


def check_is_partition(result, n, k):
    assert len(result.parts) == k
    flat = sorted(i for part in result.parts for i in part)
    assert flat == list(range(n)), "every sequence must be assigned exactly once"


def check_contiguous(result, seqs):
    tree = PrefixTree.from_sequences(seqs)
    position = {i: p for p, i in enumerate(tree.order)}
    starts = []
    for part in result.parts:
        pos = [position[i] for i in part]
        assert pos == list(range(pos[0], pos[0] + len(pos))) if pos else True, "a part must be a run of sorted order"
        if pos:
            starts.append(pos[0])
    assert starts == sorted(starts), "runs must come in sorted order"
