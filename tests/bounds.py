"""How far a floating-point result may be from another, derived from the computation (issue 21).

Every comparison between DTA and a dense computation in the tests is one of three kinds:

1. **Exactness** (is DTA's arithmetic the dense arithmetic?): run in float64, where rounding is 2**-53 per step and
   ~1e-10 bounds hold on any machine (with RMSNorm in the input dtype: the stock norms round through float32, see
   `conftest.use_input_dtype_norms`).
2. **As precise as the dense path** (float32, bf16): measure DTA and the dense path against a float64 reference of the
   same computation, in relative L2 norm over all values compared (`relative_l2`), and bound DTA's error by a multiple
   of the dense path's own error (`assert_as_precise`, multiples `forward_slack` / `gradient_slack`). A norm over
   many values concentrates (the ratio of two errors of the same distribution over n values varies by about
   1/sqrt(n)); a maximum over elements does not, which is why no relative bound below uses one.
3. **A fixed bound from a derivation**: a float32 sum of n terms (recursive, blocked or pairwise, in any order) is
   within `gamma(n) = n u / (1 - n u)` of the sum of their magnitudes (Higham, "Accuracy and Stability of Numerical
   Algorithms", 2002, section 4.2; `u` is the unit roundoff, `UNIT_ROUNDOFF`); `summation_bound` gives it. Two
   computations of the same sum in different orders are then within twice that of each other.

Nothing here imports the package: the counts are taken from the sequences themselves.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import torch

# Unit roundoff u = 2**-p (p: significand bits including the implicit one): |fl(x) - x| <= u |x|.
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

# DTA's forward (log-probs, entropies) may be `forward_slack(n)` times farther from the float64 reference than the
# dense path's, over n values. Where it comes from: DTA runs the same projections, norms and MLPs on the same tokens
# (other batch shapes pick other blockings of the same dot products: errors of the same distribution, `e_same`), and
# attention over [path; own rows] as two softmax parts merged by their log-sum-exps, `out = e^(lse_a - lse) out_a +
# e^(lse_b - lse) out_b`: two exponentials, two products and a sum, at most 5 roundings per output element more
# than the dense softmax-weighted sum over the L >= 5 keys of a scored position, whose own error is at least that
# (L products and L - 1 additions, u each), so `|e_merge| <= |e_dense|`. Hence `|e_dta| <= |e_same| + |e_merge| <=
# (2 + c) |e_dense|`, where `c` allows for `|e_same| / |e_dense|`, a ratio of two norms of n errors of one
# distribution, to exceed 1: each norm has a relative spread of about 1/sqrt(2n), the ratio 1/sqrt(n), and c = 3 /
# sqrt(n) is three of those. Measured (relative L2, every family, float32 and bf16, this machine's kinds): 0.9x to
# 1.9x.
STRUCTURAL_SLACK = 2.0


def forward_slack(n: int) -> float:
    """`2 + 3 / sqrt(n)`: the multiple of the dense path's forward error DTA's may reach over `n` values (above)."""
    return STRUCTURAL_SLACK + 3.0 / math.sqrt(max(n, 1))


def gradient_slack(m: int, n: int) -> float:
    """The multiple of the dense path's gradient error that DTA's may reach, when at most `m` sequences share a token
    (over `n` gradient values).

    The dense path back-propagates every sequence on its own: a prefix shared by `m` sequences receives `m`
    backward passes whose rounding errors `e_i` are each proportional to the gradient `g_i` it carries
    (`|e_i| ~ c u |g_i|`) and independent of each other, so they add in quadrature: `c u sqrt(sum |g_i|^2)`. DTA
    back-propagates the prefix once, with the summed gradient, and rounds relative to it: `c u |sum g_i| <= c u
    sqrt(m) sqrt(sum |g_i|^2)` (Cauchy-Schwarz), equality when the `g_i` are parallel. So DTA's backward error is at
    most `sqrt(m)` times the dense path's; the part its forward contributes is at most `forward_slack(n)` times
    (`a x + b y <= max(a, b) (x + y)`). Measured (relative L2, shared batches with m = 8): 0.9x to 1.7x."""
    return max(forward_slack(n), math.sqrt(max(m, 1)))


def max_sharing(seqs: Iterable[Sequence[int] | torch.Tensor]) -> int:
    """The largest number of sequences that share a token, i.e. have the same prefix up to and including it (the
    first token of the longest-shared prefix: the most sequences any tree node lies on)."""
    counts: Counter = Counter()
    for s in seqs:
        s = s.tolist() if isinstance(s, torch.Tensor) else list(s)
        if s:
            counts[s[0]] += 1
    return max(counts.values(), default=1)


def summation_bound(n: int, dtype: torch.dtype = torch.float32) -> float:
    """`gamma(n) = n u / (1 - n u)`: the relative error (to the sum of the magnitudes) of any float sum of `n` terms."""
    nu = n * UNIT_ROUNDOFF[dtype]
    assert nu < 1, f"{n} terms: the bound needs n u < 1"
    return nu / (1 - nu)


def chain_bound(k: int, dtype: torch.dtype = torch.float32) -> float:
    """`2 gamma(k)`: how far apart two computations of the same values may be, relative to the largest reference
    magnitude, when each value is reached through at most `k` rounded operations in `dtype` (the terms of every sum
    on its longest dependency chain added up: dot products, softmax sums, merges). Each computation is within
    `gamma(k)` of the exact value relative to the magnitudes it summed (`summation_bound`); taking those magnitudes as
    the result's largest assumes no catastrophic cancellation, which the random test data has, and the worst-case
    `k u` exceeds the typical `sqrt(k) u` by `sqrt(k)`, the room that cancellation by random signs takes."""
    return 2 * summation_bound(k, dtype)


def _flat(values) -> list[torch.Tensor]:
    if isinstance(values, Mapping):
        return [values[k] for k in sorted(values)]
    if isinstance(values, torch.Tensor):
        return [values]
    return list(values)


def relative_l2(got, want) -> float:
    """`||got - want|| / ||want||` over every value together: tensors, lists of tensors (per-sequence log-probs), or
    dicts of tensors (parameter gradients, compared by name; a name missing on one side counts as zeros there)."""
    if isinstance(want, Mapping) or isinstance(got, Mapping):
        names = set(got) | set(want)
        pairs = [(got.get(n), want.get(n)) for n in sorted(names)]
        pairs = [(torch.zeros_like(w) if g is None else g, torch.zeros_like(g) if w is None else w) for g, w in pairs]
    else:
        pairs = list(zip(_flat(got), _flat(want), strict=True))
    num = sum(float((g.double() - w.double()).pow(2).sum()) for g, w in pairs)
    den = sum(float(w.double().pow(2).sum()) for _, w in pairs)
    assert den > 0, "the reference is all zeros: a relative error would be meaningless"
    return math.sqrt(num / den)


# Every relative comparison made in this process: (test id, what, DTA's error, the dense path's, the allowed multiple).
# `tests/conftest.py` writes them to the file `DTA_BOUNDS_REPORT` names, for the record of measured ratios.
RECORD: list[tuple[str, str, float, float, float]] = []
CURRENT_TEST = [""]


def assert_as_precise(dta_err: float, dense_err: float, slack: float, what: str) -> float:
    """DTA's error (against the float64 reference) within `slack` times the dense path's. Returns the ratio."""
    assert dense_err > 0, f"{what}: the dense path equals the float64 reference exactly: the precision did not run"
    ratio = dta_err / dense_err
    RECORD.append((CURRENT_TEST[0], what, dta_err, dense_err, slack))
    assert ratio <= slack, (f"{what}: DTA's error {dta_err:.3g} is {ratio:.2f} x the dense path's {dense_err:.3g}, "
                            f"more than the derived {slack:.2f} x")
    return ratio


def _count(values) -> int:
    return sum(int(t.numel()) for t in _flat(values))


def assert_as_precise_as_dense(dta, dense, exact, what: str, sharing: int | None = None) -> float:
    """`relative_l2(dta, exact) <= slack * relative_l2(dense, exact)`: DTA's result and the dense path's, computed in
    the same precision, each against the float64 `exact` one; the slack is `gradient_slack(sharing, n)` for
    gradients (give `sharing`: the most sequences sharing a token, `max_sharing`), else `forward_slack(n)`, n the
    number of values compared. Returns the ratio."""
    n = _count(exact)
    slack = forward_slack(n) if sharing is None else gradient_slack(sharing, n)
    return assert_as_precise(relative_l2(dta, exact), relative_l2(dense, exact), slack, what)
