"""`trl_dta.trainers.step_forest`: which buffered micro-batches form an optimizer step's forest, and its index maps."""

from __future__ import annotations

import pytest
import torch

from trl_dta.batch import Layout
from trl_dta.trainers.step_forest import Cadence, StepForest, buffered_window


@pytest.mark.parametrize(
    "step,remaining,spg,generate_every,expected",
    [
        (0, 2, 2, 2, [0, 1]),  # one generation, one step
        (0, 2, 4, 4, [0, 1]),  # two steps per generation: the first half
        (2, 2, 4, 4, [2, 3]),
        (2, 2, 3, 3, [2]),  # the window crosses a generation: micro-step 3 generates anew
        (3, 1, 3, 3, [3]),
        (0, 4, 2, 4, [0, 1, 2, 3]),  # num_iterations=2 inside one window: each micro-batch twice
        (4, 4, 2, 2, [4, 5]),  # a window of two generations: one forest per generation
    ],
)
def test_buffered_window(step, remaining, spg, generate_every, expected):
    buffer = [{"k": k} for k in range(spg)]
    steps, batches = buffered_window(buffer[step % spg], buffer, step, remaining, Cadence(spg, generate_every // spg))
    assert steps == expected
    assert all(b is buffer[s % spg] for s, b in zip(steps, batches))


def test_buffered_window_needs_trl_buffer():
    buffer = [{"k": 0}, {"k": 1}]
    assert buffered_window({"k": 0}, buffer, 0, 2, Cadence(2, 1)) == ([0], [{"k": 0}])  # not the buffered object
    assert buffered_window(buffer[0], None, 0, 2, Cadence(2, 1))[0] == [0]


def test_step_forest_maps_sequences_to_micro_batches():
    def layout(rows):
        return Layout([torch.tensor(r) for r in rows], [1] * len(rows), 1)

    forest = StepForest([0, 1], [{}, {}], [layout([[1, 2, 3], [1, 2, 4]]), layout([[1, 2, 5]])])
    assert forest.tree.n_sequences == 3 and forest.tree.n_tree_tokens == 5  # [1 2] shared by both micro-batches
    assert [forest.locate(i) for i in range(3)] == [(0, 0), (0, 1), (1, 0)]
    assert forest.n_scored == [1, 1, 1]
    seen = []
    forest.objective([lambda j, lp, e: seen.append(("a", j)), lambda j, lp, e: seen.append(("b", j))])(2, None, None)
    assert seen == [("b", 0)]
    parts = forest.split([torch.tensor([9.0, 1.0]), torch.tensor([9.0, 2.0]), torch.tensor([9.0, 3.0])], "cpu")
    assert [p.tolist() for p in parts] == [[[1.0], [2.0]], [[3.0]]]
