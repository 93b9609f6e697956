"""The shaped rewards (`trl_dta.envs.retail.reward`, `envs.core.trl.SHAPED_REWARDS`): hand-computed credits, the columns
the rollout function hands TRL's reward functions, and the protocol tokenizer."""

from __future__ import annotations

import pytest

from trl_dta.envs import SHAPED_REWARDS, arguments_reward, format_reward, outcome_reward, tool_reward
from trl_dta.envs.core.credits import argument_credit, tool_credit
from trl_dta.envs.retail.protocol import call_format_score, protocol_tokenizer


def test_credits_by_hand():
    gold = [("find-user", {"first": "ann", "last": "lee"}), ("get-order", {"order": "o2"})]
    assert tool_credit(gold, []) == 0.0 and tool_credit([], []) == 1.0
    assert tool_credit(gold, [("find-u", {})]) == pytest.approx((6 / 9 + 0) / 2)
    assert tool_credit(gold, [("find-user", {}), ("get-order", {}), ("get", {})]) == 1.0
    assert argument_credit(gold, [("find-user", {"first": "ann", "last": "lim"})]) == pytest.approx(1 / 3)
    assert argument_credit(gold, [("get-order", {"first": "ann"})]) == 0.0  # the key of another tool's call
    # a gold call without arguments: calling its tool is all there is to pass
    assert argument_credit([("get-user", {})], []) == 0.0
    assert argument_credit([("get-user", {})], [("get-user", {})]) == 1.0
    # a task without gold calls: credit only for calling nothing (tau2 mock has two such tasks)
    assert tool_credit([], [("get-order", {})]) == 0.0 and argument_credit([], [("get-order", {"order": "o1"})]) == 0.0
    assert argument_credit([], []) == 1.0
    assert call_format_score("ca") == pytest.approx(0.5 * 2 / 5) and call_format_score("say hi") == 0.25
    assert call_format_score("call nope x=1") == 0.5 and call_format_score("call get-order") == 0.75
    assert call_format_score("call get-order order=o1") == 1.0


def test_reward_functions_read_the_rollout_columns():
    completions = [[], []]
    assert format_reward(completions, call_format=[0.25, 1]) == [0.25, 1.0]
    assert tool_reward(completions, tools=[0, 0.5]) == [0.0, 0.5]
    assert arguments_reward(completions, arguments=[1, 0]) == [1.0, 0.0]
    assert outcome_reward(completions, success=[True, False]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="AgentRolloutFunc"):
        tool_reward(completions)
    funcs, weights = SHAPED_REWARDS
    assert len(funcs) == len(weights) == 4 and sum(weights) == pytest.approx(1.0)


def test_protocol_tokenizer_keeps_text_and_makes_words_tokens():
    tokenizer = protocol_tokenizer()
    text = "agent: call find-user first=ann\nuser: say it"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids("call ") in ids and tokenizer.convert_tokens_to_ids("find-user") in ids
