"""`trl_dta.balance.cost`: forest statistics (whole batch, subsets, contiguous runs, cut costs) against a rebuilt
`PrefixTree`, the cost model's checks, and the exact NNLS fit."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trl_dta.balance import CostModel, ForestStats, forest_stats, partition
from trl_dta.balance.cost import SortedBatch
from trl_dta.tree import PrefixTree

from .references import SETTINGS, batch_st, brute_force, check_is_partition, contiguous_cuts, model_st, reference_stats

SEQS3 = [[1, 2, 3], [1, 2, 4], [5]]


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
    tree = PrefixTree.from_sequences(seqs)
    batch = SortedBatch(tree)
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


def test_forest_stats_example():
    # [a b c d], [a b c e], [a b]: tree = [a b] -> {[c d], [c e]}... segments [a b], [c], [d], [e].
    stats = forest_stats([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2]])
    assert stats == ForestStats(sequences=3, tokens=10, tree_tokens=5, attention_work=1 + 2 + 3 + 4 + 4, leaves=2)


@pytest.mark.parametrize(
    ("indices", "error", "match"),
    [
        ([0, 1.0], TypeError, r"`indices\[1\]` must be an integer"),
        ([True], TypeError, r"`indices\[0\]` must be an integer"),
        (torch.tensor([0.0]), TypeError, r"`indices\[0\]` must be an integer"),
        (5, TypeError, "`indices` must be an iterable"),
        ("01", TypeError, "`indices` must be an iterable"),
        ([0, -1], ValueError, r"`indices` must lie in \[0, 3\)"),
        ([0, 3], ValueError, r"`indices` must lie in \[0, 3\)"),
        ([1, 1], ValueError, "twice"),
    ],
)
def test_forest_stats_bad_indices(indices, error, match):
    with pytest.raises(error, match=match):
        forest_stats(SEQS3, indices)


@pytest.mark.parametrize("indices", [(i for i in [2, 0]), np.array([2, 0]), torch.tensor([2, 0]), range(0, 3, 2)])
def test_forest_stats_index_containers(indices):
    assert forest_stats(SEQS3, indices) == reference_stats([SEQS3[0], SEQS3[2]])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hidden_size": True}, TypeError, "`hidden_size` must be a positive integer"),
        ({"hidden_size": 2048.0}, TypeError, "`hidden_size` must be a positive integer"),
        ({"hidden_size": 0}, ValueError, "`hidden_size` must be a positive integer"),
        ({"token_cost": -1.0}, ValueError, "`token_cost` must be a finite number >= 0"),
        ({"leaf_cost": float("nan")}, ValueError, "`leaf_cost` must be a finite number"),
        ({"fixed_cost": float("inf")}, ValueError, "`fixed_cost` must be a finite number"),
        ({"attention_cost": "1e-4"}, TypeError, "`attention_cost` must be a finite number"),
        ({"fixed_cost": True}, TypeError, "`fixed_cost` must be a finite number"),
    ],
)
def test_cost_model_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        CostModel(**kwargs)




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
    with pytest.raises(ValueError, match="finite"):
        CostModel.fit(np.full((5, 4), np.nan))
    with pytest.raises(TypeError, match="`samples` must be an array-like of numbers"):
        CostModel.fit([[1, 2, 3, "x"]] * 5)
    with pytest.raises(TypeError, match="`fixed_cost` must be True or False"):
        CostModel.fit(np.ones((5, 4)), fixed_cost=1)


def test_fit_model_drives_partition():
    # A fitted model is a plain CostModel: partition uses it like any other.
    model = CostModel.fit(synthetic_samples(np.random.default_rng(2), (2e-6, 3e-10, 1e-3, 0.05)))
    seqs = [[1, 2, 3, i] for i in range(10)]
    result = partition(seqs, 3, cost_model=model, strategy="contiguous")
    check_is_partition(result, 10, 3)
    assert result.max_cost == brute_force(seqs, 3, model)[0]
    assert partition(seqs, 3, cost_model=model).max_cost <= result.max_cost
