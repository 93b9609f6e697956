"""Advantages of tree rollouts (`trl_dta/trainers/tree_advantages.py`): each mode by hand on a small tree, unscorable
rows, and each mode's expected gradient per level measured by Monte Carlo on a tabular policy."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from trl_dta.generation.tree_sampling import RolloutTree
from trl_dta.trainers.tree_advantages import ADVANTAGES, PER_TOKEN, segment_advantages, tree_advantages

# branching [2, 2], segments of 2 tokens; the second first-level node ended (its two rows are copies).
TREE = RolloutTree(leaves=[[3, 4, 5], [3, 4, 6, 7], [8, 2], [8, 2]], nodes=[[0, 1], [0, 2], [3], [3]], starts=[0, 2])
A = [1.0, 3.0, -2.0, -2.0]  # TRL's advantages of the rows (group mean 0)


def _hand(mode: str) -> list[list[float]]:
    """The module docstring's formulas for `TREE`, written out."""
    v0, v3, root, n = 2.0, -2.0, 0.0, 4
    if mode == "group":
        return [[1.0, 1.0], [3.0, 3.0], [-2.0], [-2.0]]
    if mode == "tree":
        return [[v0 - root, 1.0 - v0], [v0 - root, 3.0 - v0], [v3 - root], [v3 - root]]
    if mode == "unbiased":  # (n - 1) / n * (A_j - mean outside the node's subtree)
        k = (n - 1) / n
        return [[k * (1 - (-2)), k * (1 - (3 - 2 - 2) / 3)], [k * (3 - (-2)), k * (3 - (1 - 2 - 2) / 3)],
                [k * (-2 - 2)], [k * (-2 - 2)]]
    if mode == "treepo":  # root (4 rows) and node 0 (2 rows) for rows 0, 1; the root only for the ended rows
        a0 = (4 * (1 - root) + 2 * (1 - v0)) / 6
        a1 = (4 * (3 - root) + 2 * (3 - v0)) / 6
        return [[a0, a0], [a1, a1], [-2.0], [-2.0]]
    # treerl: leave-one-out u = A_j - mean of the other three
    u = [a - (sum(A) - a) / 3 for a in A]
    w0, w3 = (u[0] + u[1]) / 2, (u[2] + u[3]) / 2
    return [[2 * w0 / math.sqrt(2), (2 * u[0] - w0) / 1], [2 * w0 / math.sqrt(2), (2 * u[1] - w0) / 1],
            [2 * w3 / math.sqrt(2)], [2 * w3 / math.sqrt(2)]]


@pytest.mark.parametrize("mode", ADVANTAGES)
def test_each_mode_by_hand(mode):
    got = segment_advantages(A, TREE.nodes, [True] * 4, mode)
    for row, expected in zip(got, _hand(mode)):
        assert row == pytest.approx(expected, abs=1e-12)
    out = tree_advantages(torch.tensor(A, dtype=torch.float64), [TREE], width=5, mode=mode)
    if mode in PER_TOKEN:  # per token: each segment's advantage on its tokens, zero past the row's end
        assert out.shape == (4, 5)
        for j, (leaf, seg) in enumerate(zip(TREE.leaves, got)):
            spans = [(0, 2), (2, len(leaf))][: len(seg)] if len(seg) > 1 else [(0, len(leaf))]
            for (lo, hi), a in zip(spans, seg):
                assert out[j, lo:hi].tolist() == [a] * (hi - lo)
            assert out[j, len(leaf):].abs().sum() == 0
    else:  # one advantage per completion, as TRL's
        assert out.shape == (4,) and out.tolist() == pytest.approx([s[0] for s in got], abs=1e-12)


def test_tree_segments_sum_to_the_rows_advantage():
    """`tree`: along each row the segment advantages add up to its advantage minus the group mean."""
    for j, seg in enumerate(segment_advantages(A, TREE.nodes, [True] * 4, "tree")):
        assert sum(seg) == pytest.approx(A[j] - sum(A) / 4)


@pytest.mark.parametrize("mode", ADVANTAGES)
def test_unscorable_rows_get_zero_and_stay_out_of_every_value(mode):
    """A row TRL could not score gets 0 on every token, and the other rows' advantages do not depend on its value
    (TRL sets it to 0; any value must give the same)."""
    tree = RolloutTree(leaves=[[3, 4, 5], [3, 4, 6], [8, 9, 1], [8, 9, 5]], nodes=[[0, 1], [0, 2], [3, 4], [3, 5]],
                       starts=[0, 2])
    scorable = [True, False, True, True]
    ref = segment_advantages([1.0, 0.0, -2.0, 0.5], tree.nodes, scorable, mode)
    other = segment_advantages([1.0, 7.0, -2.0, 0.5], tree.nodes, scorable, mode)
    assert ref == other and ref[1] == [0.0, 0.0]
    assert any(a != 0.0 for row in ref for a in row)
    out = tree_advantages(torch.tensor([1.0, 7.0, -2.0, 0.5]), [tree], width=3, mode=mode,
                          scorable=torch.tensor(scorable))
    assert out[1].abs().sum() == 0


def test_unbiased_is_trls_advantage_without_branching():
    """With one level (`dta_tree_branching=[G]`, independent samples) the leave-subtree-out advantage is the
    leave-one-out one scaled by `(G - 1) / G`: TRL's group advantage."""
    g, values = 6, [0.5, -1.25, 2.0, 0.0, -0.75, -0.5]  # group mean 0, as TRL's
    paths = [[k] for k in range(g)]
    got = segment_advantages(values, paths, [True] * g, "unbiased")
    assert [row[0] for row in got] == pytest.approx(values, abs=1e-12)


# ------------------------------------------------------------------------------------ Monte Carlo expected gradient

K = 3  # actions per level of the tabular policy; each level's segment is one action
# `c_l` per mode (module docstring), no row ending before the last level.
EXPECTED = {
    (2, 2, 2): {"group": [4 / 8, 6 / 8, 7 / 8], "tree": [1 / 2] * 3, "unbiased": [7 / 8] * 3,
                "treepo": [4 / 14, 8 / 14, 11 / 14],
                "treerl": [8 / (7 * 2), 10 / (7 * math.sqrt(2)), 11 / 7]},
    (4, 2): {"group": [6 / 8, 7 / 8], "tree": [3 / 4, 1 / 2], "unbiased": [7 / 8] * 2, "treepo": [6 / 10, 8 / 10],
             "treerl": [12 / (7 * math.sqrt(2)), 11 / 7]},
}
Z = 4.5  # a coordinate more than Z Monte Carlo standard errors from its expectation fails


class TabularPolicy:
    """A policy over `L` levels of one action each: `pi(a | prefix)` a softmax of its own logits per prefix, and a
    reward per complete sequence. With `end_action`, that action ends the sequence before the last level (the rows
    below it copy the ended sequence, as `sample_trees` returns them)."""

    def __init__(self, levels: int, seed: int, end_action: int | None = None):
        rng = np.random.default_rng(seed)
        self.levels, self.end = levels, end_action
        logits = [rng.normal(size=(K ** l, K)) for l in range(levels)]
        self.probs = [np.exp(x) / np.exp(x).sum(1, keepdims=True) for x in logits]  # (K**l, K) per level
        self.reward = rng.normal(size=K ** levels)  # by the sequence's state index (an ended one: its state padded)

    def _final(self, state: int, level: int) -> int:
        return state * K ** (self.levels - level)  # an ended sequence's reward index: its prefix padded with 0s

    def gradient(self) -> list[np.ndarray]:
        """The exact gradient of the expected reward w.r.t. each level's logits, `(K**l, K)` per level."""
        grads = [np.zeros_like(p) for p in self.probs]

        def walk(level, state, prob, trail):
            if level == self.levels:
                r = self.reward[state]
            elif trail and trail[-1][1] == self.end and self.end is not None and level < self.levels:
                r = self.reward[self._final(state, level)]
            else:
                for a in range(K):
                    walk(level + 1, state * K + a, prob * self.probs[level][state, a], trail + [(state, a)])
                return
            for lvl, (s, a) in enumerate(trail):
                grads[lvl][s] += prob * r * (np.eye(K)[a] - self.probs[lvl][s])

        walk(0, 0, 1.0, [])
        return grads

    def sample(self, branching: list[int], n_trees: int, rng):
        """`n_trees` trees: per tree and row the node ids, states and actions per level (-1 past an end) and the
        reward."""
        g, levels = math.prod(branching), len(branching)
        states = np.full((n_trees, g, levels), -1)
        actions = np.full((n_trees, g, levels), -1)
        nodes = np.full((n_trees, g, levels), -1)
        state = np.zeros((n_trees, g), dtype=int)
        alive = np.ones((n_trees, g), dtype=bool)
        ended_at = np.full((n_trees, g), levels)
        size = g
        for level, b in enumerate(branching):
            size //= b
            node = np.arange(g) // size  # (g,) node index within the level, rows of one node contiguous
            p = self.probs[level][state]  # (n, g, K)
            draw = (rng.random((n_trees, g // size, 1)) > np.cumsum(p[:, ::size], -1)).sum(-1)  # one per node
            a = np.repeat(draw, size, axis=1)
            a = np.minimum(a, K - 1)
            states[:, :, level] = np.where(alive, state, -1)
            actions[:, :, level] = np.where(alive, a, -1)
            nodes[:, :, level] = np.where(alive, level * g + node, -1)
            state = np.where(alive, state * K + a, state)
            if self.end is not None and level < levels - 1:
                stop = alive & (a == self.end)
                ended_at = np.where(stop, level + 1, ended_at)
                alive &= ~stop
        final = state * K ** (levels - ended_at)
        return nodes, states, actions, self.reward[final]


def _coefficients(policy: TabularPolicy, branching: list[int], n_trees: int, modes, seed: int = 0):
    """Per mode and level: the Monte Carlo mean of the group's gradient estimate `sum_rows A * grad log pi` divided by
    `G`, its standard error per coordinate, and the projection coefficient on the true gradient with its error."""
    rng = np.random.default_rng(seed)
    g, levels = math.prod(branching), len(branching)
    nodes, states, actions, rewards = policy.sample(branching, n_trees, rng)
    values = rewards - rewards.mean(1, keepdims=True)  # TRL's advantages, scale_rewards="none"
    true = policy.gradient()
    results = {}
    for mode in modes:
        seg = np.zeros((n_trees, g, levels))
        for t in range(n_trees):
            paths = [[int(x) for x in row if x >= 0] for row in nodes[t]]
            for j, row in enumerate(segment_advantages(values[t].tolist(), paths, [True] * g, mode)):
                seg[t, j, :len(row)] = row
        per_level = []
        for level in range(levels):
            est = np.zeros((n_trees,) + true[level].shape)  # (n, K**l, K)
            s, a = states[:, :, level], actions[:, :, level]
            live = s >= 0
            t_idx = np.broadcast_to(np.arange(n_trees)[:, None], s.shape)[live]
            grad = np.eye(K)[a[live]] - policy.probs[level][s[live]]  # (rows, K)
            np.add.at(est, (t_idx, s[live]), seg[:, :, level][live][:, None] * grad)
            est = est.reshape(n_trees, -1) / g
            gl = true[level].reshape(-1)
            proj = est @ gl / (gl @ gl)
            per_level.append(dict(mean=est.mean(0), se=est.std(0, ddof=1) / math.sqrt(n_trees), true=gl,
                                  c=proj.mean(), c_se=proj.std(ddof=1) / math.sqrt(n_trees)))
        results[mode] = per_level
    return results


@pytest.mark.parametrize("branching", [(2, 2, 2), (4, 2)])
def test_expected_gradient_per_level(branching):
    """Each mode's expected gradient through level `l` is `c_l * G * g_l` with the module docstring's `c_l`: every
    coordinate of the Monte Carlo mean within Z standard errors of `c_l * g_l`, and the projection coefficient within
    Z errors of `c_l`; the measured coefficients are printed. Power: the `unbiased` prediction rejects `group`'s
    shared segments, and `group`'s rejects `unbiased`."""
    policy = TabularPolicy(len(branching), seed=1)
    results = _coefficients(policy, list(branching), n_trees=6000, modes=ADVANTAGES)
    for mode in ADVANTAGES:
        print(mode, [f"{r['c']:.3f} +- {r['c_se']:.3f}" for r in results[mode]])
    for mode in ADVANTAGES:
        for level, (r, c) in enumerate(zip(results[mode], EXPECTED[branching][mode])):
            z = np.abs(r["mean"] - c * r["true"]) / np.maximum(r["se"], 1e-12)
            assert z.max() < Z, \
                f"{mode} level {level}: a coordinate {z.max():.1f} errors from c_l * g_l (c_l = {c:.3f})"
            assert abs(r["c"] - c) < Z * r["c_se"], \
                f"{mode} level {level}: c = {r['c']:.3f} +- {r['c_se']:.3f}, not {c:.3f}"
    unbiased, group = EXPECTED[branching]["unbiased"][0], EXPECTED[branching]["group"][0]
    assert abs(results["group"][0]["c"] - unbiased) > Z * results["group"][0]["c_se"]
    assert abs(results["unbiased"][0]["c"] - group) > Z * results["unbiased"][0]["c_se"]


def test_unbiased_stays_unbiased_when_rows_end_early():
    """With an action that ends the sequence before the last level (its rows copies of the ended sequence, as
    `sample_trees` returns them), `unbiased` still gives `(G - 1) / G` on every level, while `group` does not."""
    branching = [2, 2, 2]
    policy = TabularPolicy(3, seed=2, end_action=0)
    results = _coefficients(policy, branching, n_trees=6000, modes=("unbiased", "group"))
    print({m: [f"{r['c']:.3f} +- {r['c_se']:.3f}" for r in results[m]] for m in results})
    for level, r in enumerate(results["unbiased"]):
        z = np.abs(r["mean"] - 7 / 8 * r["true"]) / np.maximum(r["se"], 1e-12)
        assert z.max() < Z and abs(r["c"] - 7 / 8) < Z * r["c_se"], (level, r["c"], r["c_se"])
    assert abs(results["group"][0]["c"] - 7 / 8) > Z * results["group"][0]["c_se"]


def test_the_tabular_gradient_is_exact():
    """The toy's exact gradient (enumeration) against a finite difference of the expected reward."""
    policy = TabularPolicy(2, seed=3, end_action=1)

    def expected_reward(probs):
        total = 0.0
        for a0, a1 in itertools.product(range(K), repeat=2):
            if a0 == policy.end:
                total += probs[0][0, a0] * policy.reward[a0 * K] / K  # counted once over the K values of a1
            else:
                total += probs[0][0, a0] * probs[1][a0, a1] * policy.reward[a0 * K + a1]
        return total

    grads = policy.gradient()
    logits = [np.log(p) for p in policy.probs]
    # Central differences in float64: truncation eps**2 / 6 * |f'''| <= 3e-10 (|f'''| <= 6 max|r| <= 18 for an
    # expectation of rewards |r| < 3 under softmaxes) plus rounding 2**-52 * |f| / eps <= 1e-10: within 1e-8.
    assert np.abs(policy.reward).max() < 3
    eps = 1e-5

    def bumped(level, s, a, delta):
        x = [v.copy() for v in logits]
        x[level][s, a] += delta
        return expected_reward([np.exp(v) / np.exp(v).sum(1, keepdims=True) for v in x])

    for level in range(2):
        for s, a in itertools.product(range(K ** level), range(K)):
            fd = (bumped(level, s, a, eps) - bumped(level, s, a, -eps)) / (2 * eps)
            assert abs(fd - grads[level][s, a]) <= 1e-8
