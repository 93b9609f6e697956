"""The TRL bridge of the tau2 domains: the dataset, the rollout function's task lookup, the recipe's workload, the
splits, and the seam's error when tau2 is missing."""

from __future__ import annotations

import sys

import pytest

from trl_dta.envs.tau2 import ScriptedUser, Tau2Domain, Tau2RolloutFunc, build_tau2_dataset, tau2_modules


def test_dataset_rows_are_system_prompt_and_opening(airline):
    ds = build_tau2_dataset(airline, seed=3)
    assert ds.column_names == ["prompt", "task_id"] and len(ds) == 50 and ds["task_id"] == airline.task_ids
    row = ds[7]
    assert row["prompt"][0] == {"role": "system", "content": airline.system_prompt}
    assert row["prompt"][1] == {"role": "user", "content": ScriptedUser(airline.task(row["task_id"]), 3).opening}
    assert airline.policy in airline.system_prompt and "<policy>" in airline.system_prompt
    rollout = Tau2RolloutFunc(airline, seed=3)
    assert [rollout.task_id_of(p) for p in ds["prompt"]] == ds["task_id"]
    with pytest.raises(ValueError, match="build_tau2_dataset"):
        rollout.task_id_of([{"role": "user", "content": "not a task"}])


def test_splits_and_bad_arguments(airline):
    splits = Tau2Domain.splits("airline")
    assert {"train", "test"} <= set(splits)
    train = Tau2Domain("airline", task_split="train")
    assert train.task_ids == [t for t in airline.task_ids if t in set(splits["train"])]
    with pytest.raises(ValueError, match="task splits"):
        Tau2Domain("airline", task_split="nope")
    with pytest.raises(ValueError, match="must be one of"):
        Tau2Domain("banking")
    with pytest.raises(ValueError, match="no task"):
        airline.task("999")


def test_recipe_builds_the_tau2_workload(mock):
    sys.path.insert(0, "recipes")
    try:
        from agent import AgentScriptArguments, build_agent_workload
    finally:
        sys.path.remove("recipes")
    dataset, rollout, reward = build_agent_workload(AgentScriptArguments(agent_domain="mock", agent_num_tasks=3), 0)
    assert isinstance(rollout, Tau2RolloutFunc) and reward.__name__ == "tau2_reward"
    assert dataset["task_id"] == mock.task_ids[:3]
    with pytest.raises(ValueError, match="agent_domain"):
        build_agent_workload(AgentScriptArguments(agent_domain="banking"), 0)


def test_missing_tau2_names_the_extra(monkeypatch):
    tau2_modules()  # loaded once for real; now pretend it is not installed
    tau2_modules.cache_clear()
    monkeypatch.setitem(sys.modules, "tau2", None)
    try:
        with pytest.raises(ImportError, match=r'pip install "trl-dta\[tau2\]"'):
            tau2_modules()
    finally:
        monkeypatch.undo()  # the real tau2 module back
        tau2_modules.cache_clear()
    assert tau2_modules().version.startswith("26.")
