"""The LPT rank-balancing baseline of `benchmarks/suites/bench_balance.py` (`benchmarks/baselines/lpt.py`), and the
pointer left where it used to be public (`trl_dta.lpt_partition`)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

import trl_dta
from benchmarks.baselines.lpt import lpt_partition
from trl_dta.balance import CostModel

from .references import SETTINGS, batch_st, check_is_partition, reference_cost


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


def test_lpt_bad_arguments():
    with pytest.raises(ValueError, match="`weight`"):
        lpt_partition([[1]], 1, weight="flops")
    with pytest.raises(TypeError, match="`k`"):
        lpt_partition([[1]], True)


def test_lpt_is_no_longer_public():
    assert "lpt_partition" not in trl_dta.__all__
    with pytest.raises(ImportError, match=r"moved to `benchmarks/baselines/lpt.py`.*benchmark baseline"):
        from trl_dta import lpt_partition as _  # noqa: F401
    with pytest.raises(ImportError, match="benchmarks/baselines/lpt.py"):
        trl_dta.lpt_partition  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        trl_dta.not_a_name  # noqa: B018
