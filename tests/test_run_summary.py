"""`trl_dta.analysis.run_summary`: the reward trend both recipes' summary lines report."""

import pytest

from trl_dta.analysis.run_summary import mean_of, reward_trend


def test_reward_trend_windows_never_overlap():
    logs = [{"loss": 0.1}] + [{"reward": float(i), "rewards/a/mean": 2.0 * i, "entropy": 1.0 - 0.1 * i}
                              for i in range(5)]
    trend = reward_trend(logs, window=5)  # 5 logged steps: capped at 2 first and 2 last
    assert trend["rewards_steps"] == 2
    assert trend["reward_first"] == pytest.approx(0.5) and trend["reward_last"] == pytest.approx(3.5)
    assert trend["rewards"] == {"a": [pytest.approx(1.0), pytest.approx(7.0)]}
    assert trend["entropy"] == [pytest.approx(0.95), pytest.approx(0.65)]


def test_reward_trend_of_an_empty_log():
    assert reward_trend([], window=5) == {"reward_first": None, "reward_last": None, "rewards": {},
                                          "entropy": [None, None], "rewards_steps": 1}
    assert mean_of([{"x": 1.0}, {}], "y") is None
