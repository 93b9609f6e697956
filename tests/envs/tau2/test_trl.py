"""The TRL bridge of the tau2 domains: the dataset, the rollout function's task lookup, the recipe's workload, the
splits, and the seam's error when tau2 is missing."""

from __future__ import annotations

import sys

import pytest

from trl_dta import DTAGRPOConfig
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


def test_recipe_builds_the_tau2_workload(mock, chat_tokenizer, tmp_path):
    """The recipe's tau2 workload: tau2's reward by default, the shaped rewards opt-in, the episode budget derived from
    the longest prompt and the turns, what it prints; a bad domain is refused in one line."""
    sys.path.insert(0, "recipes")
    try:
        from agent import AgentScriptArguments, build_workload, check_script_args, describe
    finally:
        sys.path.remove("recipes")
    training = DTAGRPOConfig(output_dir=str(tmp_path), max_completion_length=64, use_cpu=True, bf16=False)
    args = AgentScriptArguments(agent_domain="mock", agent_num_tasks=3, agent_max_turns=2, agent_reply_tokens=100)
    workload = build_workload(args, training, chat_tokenizer)
    assert isinstance(workload.rollout, Tau2RolloutFunc) and workload.reward_weights is None
    assert [f.__name__ for f in workload.reward_funcs] == ["tau2_reward"]
    assert workload.dataset["task_id"] == mock.task_ids[:3]
    info = workload.info
    assert info["tools"] == 4 and info["num_tasks"] == 3 and info["max_tokens"] == info["prompt_tokens"][1] + 2 * 164
    assert 2000 < info["system_prompt_tokens"] < info["prompt_tokens"][0]  # the system prompt and every tool schema
    assert "mock (tau2-bench" in describe(info, training, workload.reward_funcs)
    shaped = build_workload(AgentScriptArguments(agent_domain="mock", agent_num_tasks=3, agent_reward="shaped"),
                            training, chat_tokenizer)
    assert [f.__name__ for f in shaped.reward_funcs] == ["format_reward", "tool_reward", "arguments_reward",
                                                         "outcome_reward"]
    assert sum(shaped.reward_weights) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="--agent_domain must be one of standin, airline"):
        check_script_args(AgentScriptArguments(agent_domain="banking"))


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
