"""`trl_dta.balance.partition`: the public entry points: argument checks (every argument, every wrong kind), input
containers that give the exact result, empty batches, the equal-count path and `partition_for_ranks`."""

import random

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trl_dta.balance import CostModel, forest_stats, partition, partition_for_ranks
from trl_dta.tree import PrefixTree

from .references import SETTINGS, batch_st, check_contiguous, check_is_partition, reference_cost

SEQS3 = [[1, 2, 3], [1, 2, 4], [5]]


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


SEQS3 = [[1, 2, 3], [1, 2, 4], [5]]


@pytest.mark.parametrize(
    ("seqs", "error", "match"),
    [
        (torch.tensor([[1, 2], [3, 4]]), TypeError, "from_padded"),
        (np.array([[1, 2], [3, 4]]), TypeError, "from_padded"),
        ("abc", TypeError, "`seqs` must be an ordered iterable"),
        (5, TypeError, "`seqs` must be an ordered iterable"),
        ({1: [1]}, TypeError, "`seqs` must be an ordered iterable"),
        ({(1,), (2,)}, TypeError, "`seqs` must be an ordered iterable"),
        ([[1, 2.0]], TypeError, r"`seqs\[0\]\[1\]` must be an integer token id"),
        ([[1], [1, True]], TypeError, r"`seqs\[1\]\[1\]` must be an integer token id"),
        ([[None]], TypeError, r"`seqs\[0\]\[0\]`"),
        ([torch.tensor([1.0, 2.0])], TypeError, r"`seqs\[0\]` must hold integer token ids.*\.long\(\)"),
        ([torch.tensor([True])], TypeError, r"`seqs\[0\]` must hold integer token ids"),
        ([torch.tensor([[1, 2]])], ValueError, r"`seqs\[0\]` must be a 1-D tensor"),
        ([np.array([1.0, 2.0])], TypeError, r"`seqs\[0\]` must hold integer token ids"),
        (["ab"], TypeError, r"`seqs\[0\]` must be a list of token ids"),
        ([3], TypeError, r"`seqs\[0\]` must be a list of token ids"),
        ([[1], [-1]], ValueError, r"`seqs\[1\]` has a negative token id"),
    ],
)
def test_bad_sequences(seqs, error, match):
    with pytest.raises(error, match=match):
        partition(seqs, 2)
    with pytest.raises(error, match=match):
        forest_stats(seqs)


@pytest.mark.parametrize(
    "seqs",
    [
        iter(SEQS3),
        (tuple(s) for s in SEQS3),
        [np.array(s, dtype=np.int32) for s in SEQS3],
        [torch.tensor(s, dtype=torch.int32) for s in SEQS3],
        [[np.int64(t) for t in s] for s in SEQS3],
        [range(1, 4), (1, 2, 4), [5]],
        PrefixTree.from_sequences(SEQS3),
    ],
    ids=["iterator", "generator", "numpy", "int32-tensors", "numpy-ints", "range-tuple", "tree"],
)
def test_sequence_containers_give_the_exact_result(seqs):
    expected = partition(SEQS3, 2)
    got = partition(seqs, 2)
    assert (got.parts, got.costs, got.stats) == (expected.parts, expected.costs, expected.stats)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"k": 0}, ValueError, "`k` must be a positive integer"),
        ({"k": -1}, ValueError, "`k` must be a positive integer"),
        ({"k": 2.0}, TypeError, "`k` must be a positive integer"),
        ({"k": True}, TypeError, "`k` must be a positive integer"),
        ({"k": "2"}, TypeError, "`k` must be a positive integer"),
        ({"k": None}, TypeError, "`k` must be a positive integer"),
        ({"k": float("nan")}, TypeError, "`k` must be a positive integer"),
        ({"k": torch.tensor(2.0)}, TypeError, "`k` must be a positive integer"),
        ({"k": 2, "cost_model": "default"}, TypeError, "`cost_model` must be a `CostModel`"),
        ({"k": 2, "cost_model": {"token_cost": 1.0}}, TypeError, "`cost_model` must be a `CostModel`"),
        ({"k": 2, "group_ids": [0, 1]}, ValueError, "one group id per sequence: got 2 ids for 3"),
        ({"k": 2, "group_ids": [0, 1, 2, 3]}, ValueError, "one group id per sequence"),
        ({"k": 2, "group_ids": [[0], [1], [2]]}, TypeError, r"`group_ids\[0\]` must be an integer or a string"),
        ({"k": 2, "group_ids": [0.0, 1.0, 2.0]}, TypeError, r"`group_ids\[0\]` must be an integer or a string"),
        ({"k": 2, "group_ids": [True, False, True]}, TypeError, r"`group_ids\[0\]`"),
        ({"k": 2, "group_ids": [None, 1, 2]}, TypeError, r"`group_ids\[0\]`"),
        ({"k": 2, "group_ids": torch.tensor([0.0, 1.0, 2.0])}, TypeError, "`group_ids` must be 1-D with integer"),
        ({"k": 2, "group_ids": torch.tensor([[0, 1, 2]])}, TypeError, "`group_ids` must be 1-D with integer"),
        ({"k": 2, "group_ids": np.array([0.5, 1.0, 2.0])}, TypeError, "`group_ids` must be 1-D with integer"),
        ({"k": 2, "group_ids": "abc"}, TypeError, "`group_ids` must be a sequence of group labels"),
        ({"k": 2, "group_ids": {0, 1, 2}}, TypeError, "`group_ids` must be a sequence of group labels"),
        ({"k": 2, "group_ids": 3}, TypeError, "`group_ids` must be a sequence of group labels"),
        ({"k": 2, "keep_groups": 1}, TypeError, "`keep_groups` must be True or False"),
        ({"k": 2, "equal_count": None}, TypeError, "`equal_count` must be True or False"),
        ({"k": 2, "equal_count": True}, ValueError, "divisible"),
        ({"k": 2, "strategy": "greedy"}, ValueError, "`strategy` must be one of"),
        ({"k": 2, "strategy": None}, ValueError, "`strategy` must be one of"),
        ({"k": 2, "slack": -0.1}, ValueError, "`slack` must be a finite number >= 0"),
        ({"k": 2, "slack": float("nan")}, ValueError, "`slack` must be a finite number"),
        ({"k": 2, "slack": float("inf")}, ValueError, "`slack` must be a finite number"),
        ({"k": 2, "slack": "0.1"}, TypeError, "`slack` must be a finite number"),
        ({"k": 2, "slack": True}, TypeError, "`slack` must be a finite number"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        partition(SEQS3, **kwargs)


@pytest.mark.parametrize(
    "group_ids",
    [
        torch.tensor([0, 0, 1]),
        np.array([0, 0, 1]),
        [np.int64(0), np.int64(0), np.int64(1)],
        (g for g in [0, 0, 1]),
        ["a", "a", "b"],
        np.array(["a", "a", "b"]),
        [7, 7, -3],
    ],
    ids=["tensor", "numpy", "numpy-ints", "generator", "strings", "numpy-strings", "any-ints"],
)
def test_group_id_containers_give_the_exact_result(group_ids):
    expected = partition(SEQS3, 2, group_ids=[0, 0, 1])
    got = partition(SEQS3, 2, group_ids=group_ids)
    assert (got.parts, got.costs) == (expected.parts, expected.costs)


def test_numpy_and_tensor_scalars_as_k():
    expected = partition(SEQS3, 2).parts
    assert partition(SEQS3, np.int64(2)).parts == expected
    assert partition(SEQS3, torch.tensor(2)).parts == expected
    assert partition(SEQS3, 2, slack=np.float32(0.0)).parts == expected


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


@SETTINGS
@given(prompt_lens=st.lists(st.integers(1, 10), min_size=1, max_size=6), group_size=st.integers(1, 3),
       k=st.integers(1, 3), grouped=st.booleans(), data=st.data())
def test_partition_for_ranks_is_the_trainers_split(prompt_lens, group_size, k, grouped, data):
    # Equal count per rank, whole groups, exact costs: the call the trainers make, under the model width's costs.
    n_groups = len(prompt_lens) - len(prompt_lens) % k
    seqs, groups = [], []
    for g, plen in enumerate(prompt_lens[:n_groups]):
        for _ in range(group_size):
            seqs.append([g + 10] + [0] * (plen - 1) + data.draw(st.lists(st.integers(0, 3), max_size=6)))
            groups.append(g)
    model = CostModel(hidden_size=64)
    group_ids = groups if grouped else None
    result = partition_for_ranks(seqs, k, group_ids=group_ids, cost_model=model)
    expected = partition(seqs, k, cost_model=model, group_ids=group_ids, keep_groups=True, equal_count=True)
    assert (result.parts, result.costs) == (expected.parts, expected.costs)
    check_is_partition(result, len(seqs), k)
    assert {len(p) for p in result.parts} <= {len(seqs) // k}
    for part, cost in zip(result.parts, result.costs):
        assert cost == reference_cost([seqs[i] for i in part], model)
        if grouped:
            assert all(sum(groups[j] == groups[i] for j in part) == group_size for i in part), "a group was split"


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((SEQS3 + [[6]], 3), {}, ValueError, r"number of sequences \(4\) to be divisible by `k` \(3\)"),
        ((SEQS3 + [[6]], 2), {"group_ids": [0, 0, 0, 1]}, ValueError, "groups of one size G"),
        ((SEQS3 + [[6]], 2), {"group_ids": [0, 0, 0, 0]}, ValueError, "multiple of G"),
        ((SEQS3 + [[6]], 0), {}, ValueError, "`k` must be a positive integer"),
        ((SEQS3 + [[6]], 2), {"cost_model": 4096}, TypeError, "`cost_model` must be a `CostModel`"),
        ((SEQS3 + [[6]], 2, [0, 0, 1, 1]), {}, TypeError, "positional"),
    ],
)
def test_partition_for_ranks_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        partition_for_ranks(*args, **kwargs)
