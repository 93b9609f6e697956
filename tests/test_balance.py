"""Tests for trl_dta.balance: forest statistics, the exact min-max partition, group and equal-count modes, the cost fit.

The reference for every cost is a `PrefixTree` built from scratch over the part's sequences; the reference for the
partition is a brute force over every way to cut the sorted batch into contiguous runs.
"""

import itertools
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_dta.balance import CostModel, ForestStats, forest_stats, lpt_partition, partition
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


# ------------------------------------------------------------------------------------------------- forest statistics


@SETTINGS
@given(seqs=batch_st, data=st.data())
def test_forest_stats_match_prefix_tree(seqs, data):
    subset = data.draw(st.lists(st.sampled_from(range(len(seqs))), unique=True) if seqs else st.just([]))
    expected = reference_stats([seqs[i] for i in subset])
    assert forest_stats(seqs, subset) == expected
    assert forest_stats(PrefixTree.from_sequences(seqs)) == reference_stats(seqs)


@SETTINGS
@given(seqs=batch_st, model=model_st)
def test_run_statistics_and_cut_costs(seqs, model):
    # Every contiguous run of the sorted batch: O(1) prefix-sum statistics equal the rebuilt tree's; and the costs of
    # the runs of any cut add up to the whole forest's cost plus one duplication term per cut.
    from trl_dta.balance import _SortedBatch

    tree = PrefixTree.from_sequences(seqs)
    batch = _SortedBatch(tree)
    n = len(seqs)
    for l in range(n + 1):
        for r in range(l, n + 1):
            run = [seqs[i] for i in tree.order[l:r]]
            ref = reference_stats(run)
            got = tuple(int(x) for x in batch.run_stats(l, r))
            assert got == (ref.sequences, ref.tokens, ref.tree_tokens, ref.attention_work, ref.leaves), (l, r)
    for bounds in itertools.chain.from_iterable(contiguous_cuts(n, k) for k in range(1, n + 1)):
        runs = sum(float(batch.run_cost(a, b, model)) for a, b in zip(bounds[:-1], bounds[1:]))
        cuts = sum(float(batch.cut_cost(p, model)) for p in bounds[1:-1])
        assert runs == pytest.approx(float(batch.run_cost(0, n, model)) + cuts, rel=1e-12, abs=1e-12)


@SETTINGS
@given(seqs=batch_st, data=st.data())
def test_rank_forest_incremental_statistics(seqs, data):
    # The packer's O(log n) block insert/remove keeps a rank's statistics equal to a rebuilt tree's.
    from trl_dta.balance import _Lcp, _RankForest, _SortedBatch

    tree = PrefixTree.from_sequences(seqs)
    batch = _SortedBatch(tree)
    n = len(seqs)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, n), max_size=6)) + [0, n]))
    blocks = [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]

    def block_stats(l, r):
        return [int(x) for i, x in enumerate(batch.run_stats(l, r)) if i != 1]

    forest = _RankForest(batch.lengths.tolist(), _Lcp(batch.lcp), block_stats)
    held = set()
    for step in data.draw(st.lists(st.sampled_from(range(len(blocks))), max_size=10) if blocks else st.just([])):
        if step in held:
            forest.remove([blocks[step]])
            held.discard(step)
        else:
            forest.insert([blocks[step]])
            held.add(step)
        ref = reference_stats([seqs[i] for p in sorted(forest.positions().tolist()) for i in [tree.order[p]]])
        assert forest.components == [ref.sequences, ref.tree_tokens, ref.attention_work, ref.leaves]


def test_forest_stats_bad_indices():
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        forest_stats([[1], [2]], [0, -1])
    with pytest.raises(ValueError, match="twice"):
        forest_stats([[1], [2]], [1, 1])


def test_forest_stats_example():
    # [a b c d], [a b c e], [a b]: tree = [a b] -> {[c d], [c e]}... segments [a b], [c], [d], [e].
    stats = forest_stats([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2]])
    assert stats == ForestStats(sequences=3, tokens=10, tree_tokens=5, attention_work=1 + 2 + 3 + 4 + 4, leaves=2)


# ---------------------------------------------------------------------------------------------------------- partition


@SETTINGS
@given(seqs=batch_st, k=st.integers(1, 5), model=model_st)
def test_partition_is_optimal_contiguous_cut(seqs, k, model):
    result = partition(seqs, k, cost_model=model, strategy="contiguous")
    n = len(seqs)
    check_is_partition(result, n, k)
    check_contiguous(result, seqs)
    # Non-empty parts whenever there are enough sequences; the empty ones come last.
    assert [len(p) > 0 for p in result.parts] == [True] * min(n, k) + [False] * (k - min(n, k))
    for part, cost, stats in zip(result.parts, result.costs, result.stats):
        assert stats == reference_stats([seqs[i] for i in part])
        assert cost == reference_cost([seqs[i] for i in part], model)
    if n:
        best_max, best_sum = brute_force(seqs, k, model)
        assert result.max_cost == best_max
        # Among the optimal cuts, the least duplicated work (up to float summation order).
        assert sum(result.costs) == pytest.approx(best_sum, rel=1e-12, abs=1e-12)


@SETTINGS
@given(seqs=batch_st, k=st.integers(1, 5), model=model_st, data=st.data())
def test_partition_respects_groups(seqs, k, model, data):
    n = len(seqs)
    group_ids = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    result = partition(seqs, k, cost_model=model, group_ids=group_ids, strategy="contiguous")
    check_is_partition(result, n, k)
    check_contiguous(result, seqs)
    owner = {}
    for rank, part in enumerate(result.parts):
        for i in part:
            assert owner.setdefault(group_ids[i], rank) == rank, "a group was split across parts"
    if n:
        best_max, best_sum = brute_force(seqs, k, model, group_ids)
        assert result.max_cost == best_max
        assert sum(result.costs) == pytest.approx(best_sum, rel=1e-12, abs=1e-12)


@SETTINGS
@given(seqs=batch_st, k=st.integers(1, 5), model=model_st, data=st.data())
def test_best_and_packed_strategies(seqs, k, model, data):
    n = len(seqs)
    group_ids = data.draw(st.none() | st.lists(st.integers(0, 3), min_size=n, max_size=n))
    contiguous = partition(seqs, k, cost_model=model, group_ids=group_ids, strategy="contiguous")
    packed = partition(seqs, k, cost_model=model, group_ids=group_ids, strategy="packed")
    best = partition(seqs, k, cost_model=model, group_ids=group_ids)
    for result in (packed, best):
        check_is_partition(result, n, k)
        for part, cost, stats in zip(result.parts, result.costs, result.stats):
            assert stats == reference_stats([seqs[i] for i in part])
            assert cost == reference_cost([seqs[i] for i in part], model)
        if group_ids is None:
            assert sum(len(p) > 0 for p in result.parts) == min(n, k), "no empty part while sequences are left"
        else:
            owner = {}
            for rank, part in enumerate(result.parts):
                for i in part:
                    assert owner.setdefault(group_ids[i], rank) == rank, "a group was split across parts"
            assert sum(len(p) > 0 for p in packed.parts) == min(len(set(group_ids)), k)
    assert best.max_cost <= min(contiguous.max_cost, packed.max_cost)


def test_packed_beats_contiguous_on_few_groups_per_rank():
    # Group sizes in sorted order alternate big/small so badly that contiguous runs cannot balance 2 groups per rank.
    rng = random.Random(5)
    seqs, groups = [], []
    for g, plen in enumerate([400, 390, 380, 370, 40, 30, 20, 10]):
        prompt = [g] + [rng.randrange(100) for _ in range(plen)]
        for _ in range(4):
            seqs.append(prompt + [rng.randrange(100) for _ in range(20)])
            groups.append(g)
    contiguous = partition(seqs, 4, group_ids=groups, strategy="contiguous")
    best = partition(seqs, 4, group_ids=groups)
    assert best.max_cost < 0.8 * contiguous.max_cost
    assert best.imbalance < 1.05


def test_grpo_groups_are_not_split():
    rng = random.Random(0)
    seqs, groups = [], []
    for g in range(6):
        prompt = [rng.randrange(50) for _ in range(rng.randrange(5, 20))]
        for _ in range(4):
            seqs.append(prompt + [rng.randrange(50) for _ in range(rng.randrange(1, 10))])
            groups.append(g)
    result = partition(seqs, 3, group_ids=groups)
    check_is_partition(result, len(seqs), 3)
    for part in result.parts:
        assert part and all(sum(groups[j] == groups[i] for j in part) == 4 for i in part), "a group was split"
    free = partition(seqs, 3, group_ids=groups, keep_groups=False)
    assert free.max_cost <= result.max_cost


def test_slack_trades_balance_for_sharing():
    rng = random.Random(1)
    prompt = [rng.randrange(100) for _ in range(40)]
    seqs = [prompt + [rng.randrange(100) for _ in range(rng.randrange(1, 30))] for _ in range(20)]
    tight = partition(seqs, 4)
    loose = partition(seqs, 4, slack=10.0)
    assert loose.max_cost <= 11.0 * tight.max_cost
    assert sum(loose.costs) <= sum(tight.costs)
    assert loose.compression_kept >= tight.compression_kept


def test_k1_is_one_forest():
    seqs = [[1, 2, 3], [1, 2], [4]]
    result = partition(seqs, 1)
    assert result.parts == [[1, 0, 2]]
    assert result.compression_after == result.compression_before
    assert result.compression_kept == 1.0
    assert result.imbalance == 1.0


def test_more_ranks_than_sequences():
    seqs = [[3, 1], [1, 2], [1]]
    result = partition(seqs, 5, strategy="contiguous")
    assert result.parts == [[2], [1], [0], [], []]
    assert result.costs[3:] == [0.0, 0.0]
    for strategy in ("best", "packed"):
        result = partition(seqs, 5, strategy=strategy)
        assert sorted(len(p) for p in result.parts) == [0, 0, 1, 1, 1]


def test_empty_batch():
    result = partition([], 3)
    assert result.parts == [[], [], []]
    assert result.costs == [0.0, 0.0, 0.0]
    assert result.imbalance == 1.0
    assert result.compression_kept == 1.0


def test_accepts_tensors_and_tree():
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4]), torch.tensor([5])]
    a = partition(seqs, 2)
    b = partition(PrefixTree.from_sequences(seqs), 2)
    assert a.parts == b.parts and a.costs == b.costs


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"k": 0}, "`k`"),
        ({"k": 2.0}, "`k`"),
        ({"k": True}, "`k`"),
        ({"k": 2, "group_ids": [0, 1]}, "one group id per sequence"),
        ({"k": 2, "slack": -0.1}, "`slack`"),
        ({"k": 2, "equal_count": True}, "divisible"),
        ({"k": 2, "strategy": "greedy"}, "`strategy`"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        partition([[1], [2], [3]], **kwargs)


# ------------------------------------------------------------------------------------------------------- equal count


@SETTINGS
@given(seqs=batch_st, k=st.integers(1, 4))
def test_equal_count_contiguous(seqs, k):
    seqs = seqs[: len(seqs) - len(seqs) % k]
    result = partition(seqs, k, equal_count=True)
    check_is_partition(result, len(seqs), k)
    check_contiguous(result, seqs)
    assert {len(p) for p in result.parts} <= {len(seqs) // k}


@SETTINGS
@given(
    prompt_lens=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    group_size=st.integers(1, 4),
    k=st.integers(1, 4),
    data=st.data(),
)
def test_equal_count_whole_groups(prompt_lens, group_size, k, data):
    n_groups = len(prompt_lens) - len(prompt_lens) % k
    if n_groups == 0:
        return
    seqs, groups = [], []
    for g, plen in enumerate(prompt_lens[:n_groups]):
        prompt = [g + 10] + [0] * (plen - 1)
        for _ in range(group_size):
            seqs.append(prompt + data.draw(st.lists(st.integers(0, 3), max_size=8)))
            groups.append(g)
    result = partition(seqs, k, group_ids=groups, equal_count=True)
    check_is_partition(result, len(seqs), k)
    assert {len(p) for p in result.parts} == {len(seqs) // k}
    for part in result.parts:
        for g in {groups[i] for i in part}:
            assert sum(groups[i] == g for i in part) == group_size, "a group was split"
    for part, cost in zip(result.parts, result.costs):
        assert cost == reference_cost([seqs[i] for i in part], CostModel())


def test_equal_count_groups_balance_better_than_order():
    rng = random.Random(3)
    seqs, groups = [], []
    for g in range(16):
        prompt = [g] + [rng.randrange(100) for _ in range(rng.randrange(10, 200))]
        for _ in range(4):
            seqs.append(prompt + [rng.randrange(100) for _ in range(rng.randrange(5, 60))])
            groups.append(g)
    by_groups = partition(seqs, 4, group_ids=groups, equal_count=True)
    by_order = partition(seqs, 4, equal_count=True)
    assert by_groups.max_cost < by_order.max_cost


def test_equal_count_groups_errors():
    seqs = [[1], [1, 2], [3], [4], [5], [6]]
    with pytest.raises(ValueError, match="groups of one size"):
        partition(seqs, 2, group_ids=[0, 0, 1, 2, 2, 2], equal_count=True)
    with pytest.raises(ValueError, match="multiple of G"):
        partition(seqs, 3, group_ids=[0, 0, 0, 1, 1, 1], equal_count=True)
    # Splitting allowed: contiguous equal-count runs.
    result = partition(seqs, 3, group_ids=[0, 0, 0, 1, 1, 1], equal_count=True, keep_groups=False)
    assert [len(p) for p in result.parts] == [2, 2, 2]


# ---------------------------------------------------------------------------------------------------------- baselines


@SETTINGS
@given(seqs=batch_st, k=st.integers(1, 4), weight=st.sampled_from(["tokens", "tree_tokens"]), data=st.data())
def test_lpt_baseline_assigns_every_sequence_once(seqs, k, weight, data):
    n = len(seqs)
    group_ids = data.draw(st.none() | st.lists(st.integers(0, 3), min_size=n, max_size=n))
    result = lpt_partition(seqs, k, weight=weight, group_ids=group_ids)
    check_is_partition(result, n, k)
    if group_ids is not None:
        for part in result.parts:
            for g in {group_ids[i] for i in part}:
                assert sum(group_ids[i] == g for i in part) == group_ids.count(g)
    for part, cost in zip(result.parts, result.costs):
        assert cost == reference_cost([seqs[i] for i in part], CostModel())


def test_lpt_bad_weight():
    with pytest.raises(ValueError, match="`weight`"):
        lpt_partition([[1]], 1, weight="flops")


# ---------------------------------------------------------------------------------------------------------- cost model


def test_cost_model_defaults_and_errors():
    model = CostModel(hidden_size=1024)
    assert model.attention_cost == pytest.approx(1 / 6144)
    assert model(10, 6144, 0) == pytest.approx(11.0)
    with pytest.raises(ValueError, match="`leaf_cost`"):
        CostModel(leaf_cost=-1.0)
    with pytest.raises(ValueError, match="`hidden_size`"):
        CostModel(hidden_size=0)


def synthetic_samples(rng, coef, n=40, noise=0.0):
    rows = []
    for _ in range(n):
        tree_tokens = rng.uniform(1e3, 1e5)
        attention = tree_tokens * rng.uniform(200, 8000)
        leaves = rng.uniform(1, 500)
        seconds = coef[0] * tree_tokens + coef[1] * attention + coef[2] * leaves + coef[3]
        rows.append((tree_tokens, attention, leaves, seconds * (1 + noise * rng.normal())))
    return np.array(rows)


@pytest.mark.parametrize(
    "coef", [(2e-6, 3e-10, 1e-3, 0.05), (1e-6, 0.0, 5e-4, 0.0), (3e-6, 1e-9, 0.0, 0.2), (1e-6, 1e-10, 2e-3, 0.0)]
)
def test_fit_recovers_coefficients(coef):
    model = CostModel.fit(synthetic_samples(np.random.default_rng(0), coef))
    got = (model.token_cost, model.attention_cost, model.leaf_cost, model.fixed_cost)
    scale = (1e-6, 1e-10, 1e-4, 1e-2)  # typical magnitude of each coefficient, for the zero ones
    for g, c, s in zip(got, coef, scale):
        assert g == pytest.approx(c, rel=1e-6, abs=1e-9 * s)


def test_fit_is_nonnegative_least_squares():
    # Noisy data whose unconstrained fit has a negative leaf coefficient: the result must satisfy the NNLS optimality
    # (KKT) conditions: zero gradient on the positive coefficients, non-negative gradient on the zero ones.
    rng = np.random.default_rng(1)
    samples = synthetic_samples(rng, (2e-6, 2e-10, 0.0, 0.01), n=30, noise=0.2)
    samples[:, 3] -= 5e-5 * samples[:, 2]  # pushes the leaf coefficient below zero
    a = np.column_stack([samples[:, :3], np.ones(len(samples))])
    unconstrained, *_ = np.linalg.lstsq(a / np.linalg.norm(a, axis=0), samples[:, 3], rcond=None)
    assert unconstrained[2] < 0, "the test data must make the unconstrained fit negative"
    model = CostModel.fit(samples)
    x = np.array([model.token_cost, model.attention_cost, model.leaf_cost, model.fixed_cost])
    assert (x >= 0).all() and model.leaf_cost == 0.0
    a_scaled = a / np.linalg.norm(a, axis=0)
    grad = a_scaled.T @ (a @ x - samples[:, 3])
    assert np.all(grad[x == 0] >= -1e-9 * np.abs(samples[:, 3]).sum())
    assert np.allclose(grad[x > 0], 0.0, atol=1e-9 * np.abs(samples[:, 3]).sum())


def test_fit_errors():
    with pytest.raises(ValueError, match=r"shape \(n_samples, 4\)"):
        CostModel.fit(np.ones((5, 3)))
    with pytest.raises(ValueError, match="at least 4 samples"):
        CostModel.fit(np.ones((3, 4)))
    with pytest.raises(ValueError, match="non-negative"):
        CostModel.fit(-np.ones((5, 4)))


def test_fit_model_drives_partition():
    # A fitted model is a plain CostModel: partition uses it like any other.
    model = CostModel.fit(synthetic_samples(np.random.default_rng(2), (2e-6, 3e-10, 1e-3, 0.05)))
    seqs = [[1, 2, 3, i] for i in range(10)]
    result = partition(seqs, 3, cost_model=model, strategy="contiguous")
    check_is_partition(result, 10, 3)
    assert result.max_cost == brute_force(seqs, 3, model)[0]
    assert partition(seqs, 3, cost_model=model).max_cost <= result.max_cost
