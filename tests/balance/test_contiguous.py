"""`trl_dta.balance.contiguous`: the min-max contiguous cut is optimal and, among optimal cuts, duplicates the least
work (against a brute force over every cut), with and without groups."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trl_dta.balance import partition

from .references import (
    SETTINGS,
    batch_st,
    brute_force,
    check_contiguous,
    check_is_partition,
    model_st,
    reference_cost,
    reference_stats,
)


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
