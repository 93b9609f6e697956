"""Goodness-of-fit for sampling tests (imports nothing from the package)."""

from __future__ import annotations

import torch


def chi_square_p(observed: dict, expected: dict, n: int) -> float:
    """p-value of Pearson's chi-square goodness of fit of `observed` counts (outcome -> count, `n` in all) to
    `expected` probabilities (outcome -> p); outcomes with an expected count below 5 are pooled into one bin. An
    outcome with probability 0 that was sampled fails at once."""
    assert set(observed) <= set(expected), f"impossible outcomes sampled: {set(observed) - set(expected)}"
    stat, bins, pooled_obs, pooled_exp = 0.0, 0, 0.0, 0.0
    for outcome, p in expected.items():
        e, o = p * n, observed.get(outcome, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat += (o - e) ** 2 / e
        bins += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        bins += 1
    return float(torch.special.gammaincc(torch.tensor((bins - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
