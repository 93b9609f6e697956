"""Advantages of tree rollouts: what each segment of a prompt's sampled tree is credited with (`dta_tree_advantage`).

A prompt's `G` completions come from one tree (`tree_rollouts.py`); row `j`'s path is its node per level, and the
tokens of level `l` of row `j` belong to node `n_l(j)`, shared by the `m` rows below that node:

```
root ─┬─ a ─┬─ a1   row 0        level 0: a (m = 2), b (m = 2)
      │     └─ a2   row 1        level 1: a1 .. b2  (m = 1)
      └─ b ─┬─ b1   row 2
            └─ b2   row 3
```

Every mode starts from TRL's advantages `A` (an affine map of the rewards within a group: `(r - mean) / (std + eps)`,
or without the division), so node values and baselines below are in TRL's scale (`scale_rewards` decides it). Rows
TRL cannot score (every reward function returned None: TRL gives them advantage 0) get 0 on every token and enter no
value, mean or count. `V(n)` is the mean `A` of the scorable rows below node `n`, `V(root)` the group's mean, `G'` the
group's scorable rows.

| mode | advantage of row `j`'s level-`l` segment (node `n`, parent `p`) | shape | reference |
|---|---|---|---|
| `group` | `A_j` (TRL's own) | `(B,)` | TRL GRPO |
| `tree` | `V(n) - V(p)` | `(B, T)` | sibling-group advantage, as SPO-tree (arXiv 2505.23564) |
| `unbiased` | `(G' - 1) / G' * (A_j - mean of A over the scorable rows outside n's subtree)` | `(B, T)` | leave-subtree-out |
| `treepo` | `sum_s |s| (A_j - mean_s A) / sum_s |s|` over the root and j's inner ancestors with 2+ rows | `(B,)` | TreePO (arXiv 2508.17445) |
| `treerl` | `(V'(n) - V'(root) + V'(n) - V'(p)) / sqrt(m)`, `V'` over leave-one-out `u_j = A_j - mean_{k != j} A_k` | `(B, T)` | TreeRL (arXiv 2506.11902) |

Expected gradients. Let `g_l` be the true gradient of the expected reward through level `l`'s tokens of one sample
(`E[r grad log pi(segment_l | its prefix)]`); with independent samples, TRL's group mean scales every level by
`(G - 1) / G` (the sample is in its own baseline). With `scale_rewards="none"`, a mode's expected gradient through
level `l`, summed over the group's rows, is `c_l * G * g_l` with (no row ending before the last level, a level-`l`
node with `m` rows below and `m_p` below its parent):

- `group`: `c_l = (G - m) / G`: the node's own value is in the group mean with weight `m / G`, so shared early segments
  learn less (`[2, 2, 2]`: 4/8, 6/8, 7/8; `[4, 2]`: 6/8, 7/8);
- `tree`: `c_l = (b_l - 1) / b_l` with `b_l` children per node (`[2, 2, 2]`: 1/2 everywhere; `[4, 2]`: 3/4, 1/2);
- `unbiased`: `c_l = (G - 1) / G` on every level, TRL's factor for independent samples: a segment's baseline holds
  only rows outside its subtree, which are independent of the segment given its prefix. With `dta_tree_branching=[G]`
  it is TRL's advantage (to rounding). Rows that end early do not change it (each row is one sample of the policy);
- `treepo`: `c_l = sum_{s on the path, above level l} w_s (1 - m / |s|)`, `w_s = |s| / sum |s|` (`[2, 2, 2]`: 4/14,
  8/14, 11/14; `[4, 2]`: 6/10, 8/10);
- `treerl`: `c_l = (2 (G - m) - (m / m_p) (G - m_p)) / ((G - 1) sqrt(m))` (`[2, 2, 2]`: 0.571, 1.010, 1.571;
  `[4, 2]`: 1.212, 1.571): deeper levels weigh more.

`tests/trainers/test_tree_advantages.py` measures each `c_l` by Monte Carlo on a tabular policy. With
`scale_rewards="group"` (TRL's default) the division by the group's standard deviation, which depends on the sample
itself, adds TRL's own bias to every mode. TreePO then whitens over the batch's tokens; here its advantages stay in
TRL's scale. TreeRL's counts are rows (copies of an ended node count, as TRL's group mean counts them).

Per-token modes hand TRL a `(B, T)` advantage: refused with sequence-level importance sampling, VESPO and the
off-policy mask, which would mix or threshold it per token (`arg_checks.check_tree_args`).
"""

from __future__ import annotations

import math

import torch

ADVANTAGES = ("group", "tree", "unbiased", "treepo", "treerl")
PER_TOKEN = ("tree", "unbiased", "treerl")  # one advantage per segment: `(B, T)`


def segment_advantages(values: list[float], paths: list[list[int]], scorable: list[bool],
                       mode: str) -> list[list[float]]:
    """One group's advantages, per row and per level its path reaches (see the module docstring).

    Args:
        values (`list[float]`): TRL's advantages of the group's `G` rows.
        paths (`list[list[int]]`): per row, its node id at each level it reaches (`RolloutTree.nodes`).
        scorable (`list[bool]`): per row, whether TRL could score it.
        mode (`str`): one of [`ADVANTAGES`].

    Returns:
        `list[list[float]]`: `out[j][l]`, row `j`'s level-`l` advantage (`len(paths[j])` values; all equal for the
        sequence-level modes `group` and `treepo`; 0 for unscorable rows).
    """
    if mode not in ADVANTAGES:
        raise ValueError(f"`dta_tree_advantage` must be one of {ADVANTAGES}, got {mode!r}.")
    out = [[0.0] * len(path) for path in paths]
    rows = [j for j, ok in enumerate(scorable) if ok]
    n = len(rows)
    if n == 0:
        return out
    total = sum(values[j] for j in rows)
    count: dict[int, int] = {}  # node -> scorable rows below it
    value_sum: dict[int, float] = {}  # node -> their sum of `values`
    for j in rows:
        for node in paths[j]:
            count[node] = count.get(node, 0) + 1
            value_sum[node] = value_sum.get(node, 0.0) + values[j]
    root = total / n

    def value(node: int) -> float:  # V(node): the mean advantage of the scorable rows below
        return value_sum[node] / count[node]

    for j in rows:
        path = paths[j]
        if mode == "group":
            out[j] = [values[j]] * len(path)
        elif mode == "treepo":  # the root's group and the inner ancestors' subgroups with 2+ rows, by size
            groups = [(n, root)] + [(count[node], value(node)) for node in path[:-1] if count[node] > 1]
            a = sum(size * (values[j] - mean) for size, mean in groups) / sum(size for size, _ in groups)
            out[j] = [a] * len(path)
        elif mode == "unbiased":
            for level, node in enumerate(path):
                outside = n - count[node]
                if outside:  # rows outside the subtree, independent of the segment given its prefix
                    baseline = (total - value_sum[node]) / outside
                    out[j][level] = (n - 1) / n * (values[j] - baseline)
        else:
            parent = root
            for level, node in enumerate(path):
                v = value(node)
                if mode == "tree":
                    out[j][level] = v - parent
                elif n > 1:  # treerl: the leave-one-out values u_k = A_k - mean_{i != k} A_i have node means
                    # V'(node) = n / (n - 1) * (V(node) - V(root)), so V'(root) = 0
                    scale = n / (n - 1) / math.sqrt(count[node])
                    out[j][level] = scale * ((v - root) + (v - parent))
                parent = v
    return out


def tree_advantages(advantages: torch.Tensor, trees, width: int, mode: str = "tree",
                    scorable: torch.Tensor | None = None) -> torch.Tensor:
    """A batch's advantages under `mode`, from TRL's advantages of its rows.

    Args:
        advantages (`torch.Tensor` of shape `(B,)`): TRL's advantages of the rows, `B = len(trees) * G`.
        trees (`list[RolloutTree]`): the trees the rows came from, in row order (`leaves`, `nodes`, `starts`).
        width (`int`): the padded completion width `T`.
        mode (`str`, *optional*, defaults to `"tree"`): one of [`ADVANTAGES`].
        scorable (`torch.Tensor` of shape `(B,)`, *optional*): bool, the rows TRL could score; defaults to all.

    Returns:
        `torch.Tensor`, dtype and device of `advantages`: of shape `(B, T)` for the per-token modes ([`PER_TOKEN`],
        zero past each row's end), `(B,)` for `group` and `treepo`.
    """
    values = advantages.tolist()
    ok = [True] * len(values) if scorable is None else [bool(s) for s in scorable.tolist()]
    per_token = mode in PER_TOKEN
    out = torch.zeros((len(values), width) if per_token else (len(values),), dtype=advantages.dtype)
    row = 0
    for tree in trees:
        g = len(tree.leaves)
        segments = segment_advantages(values[row:row + g], tree.nodes, ok[row:row + g], mode)
        for j, (leaf, path, seg) in enumerate(zip(tree.leaves, tree.nodes, segments)):
            if not per_token:
                out[row + j] = seg[0] if seg else 0.0
                continue
            for level, a in enumerate(seg):
                end = len(leaf) if level == len(path) - 1 else tree.starts[level + 1]
                out[row + j, tree.starts[level]:end] = a
        row += g
    return out.to(advantages.device)
