"""The retail domain and its episodes: determinism, gold and wrong action sequences, the user, the limits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_dta import PrefixTree
from trl_dta.demos.tiny import ALPHABET, build_tokenizer
from trl_dta.envs import Call, RetailDomain
from trl_dta.envs.core.credits import tool_credit
from trl_dta.envs.retail.database import PENDING
from trl_dta.envs.retail.tasks import KINDS
from trl_dta.envs.retail.user import STOP

TASKS = range(24)


def _play(domain, task_id, turns, **kwargs):
    env = domain.episode(task_id, **kwargs)
    for turn in turns:
        env.step(turn)
    return env


def _gold_turns(task):
    return [action.render() for action in task.gold_actions] + [f"say {' '.join(task.required_info)}."]


def test_deterministic_given_seed(domain):
    again, other = RetailDomain(seed=0), RetailDomain(seed=1)
    assert again.database == domain.database and again.system_prompt == domain.system_prompt
    assert [again.task(i) for i in TASKS] == [domain.task(i) for i in TASKS]
    assert [again.prompt(i) for i in TASKS] == [domain.prompt(i) for i in TASKS]
    assert other.database != domain.database
    assert [other.task(i) for i in TASKS] != [domain.task(i) for i in TASKS]
    turns = ["call get-user user=u1", "say what is your name?", "hello", "say which order?"]
    a, b = _play(domain, 3, turns), _play(again, 3, turns)
    assert a.messages == b.messages and a.reward() == b.reward()


def test_tasks_cover_every_kind(domain):
    assert {domain.task(i).kind for i in TASKS} == set(KINDS)


def test_system_prompt_is_a_shared_prefix(domain):
    prompts = [domain.prompt(i) for i in TASKS]
    assert all(p.startswith(domain.system_prompt) for p in prompts)
    assert domain.task_id_of(prompts[5]) == 5
    tokenizer = build_tokenizer()
    system_ids = tokenizer(domain.system_prompt)["input_ids"]
    tree = PrefixTree.from_sequences([tokenizer(p)["input_ids"] for p in prompts])
    # The system prompt (and "ticket ") is one root segment that every prompt goes through.
    roots = [s for s in tree.segments if s.parent == -1]
    assert len(roots) == 1 and roots[0].end >= len(system_ids)
    assert tree.n_tree_tokens <= tree.n_tokens - (len(prompts) - 1) * len(system_ids)
    long = RetailDomain(seed=0, policy_chars=4000)
    assert len(long.system_prompt) >= 4000 and long.system_prompt.startswith(domain.system_prompt)
    assert long.prompt(2).endswith(domain.prompt(2)[len(domain.system_prompt):])


def test_foreign_prompt_is_refused(domain):
    with pytest.raises(ValueError, match="not made by this RetailDomain"):
        domain.task_id_of("hello\nticket 3\nuser: hi\nagent: ")
    with pytest.raises(ValueError, match="not made by this RetailDomain"):
        RetailDomain(seed=0, policy_chars=900).task_id_of(domain.prompt(3))


def test_everything_the_environment_writes_is_in_the_tiny_alphabet(domain):
    alphabet = set(ALPHABET)
    for i in TASKS:
        env = _play(domain, i, _gold_turns(domain.task(i))[:-1] + ["say what is your name, zip, item, city, reason?"])
        assert set(domain.prompt(i) + "".join(text for _, text in env.messages)) <= alphabet


@pytest.mark.parametrize("task_id", TASKS)
def test_gold_actions_earn_full_reward(domain, task_id):
    task = domain.task(task_id)
    env = _play(domain, task_id, _gold_turns(task))
    assert env.done and env.end_reason == "user_stop" and env.messages[-1] == ("user", f"thanks, that is all. {STOP}")
    reward = env.reward()
    assert reward.reward == 1.0 and reward.success and reward.db_match
    assert (reward.info, reward.actions, reward.protocol) == (1.0, 1.0, 1.0)
    assert env.db == domain.gold_database(task_id)
    assert (env.db != domain.database) == (task.kind != "status")


def _task_of_kind(domain, kind):
    return next(domain.task(i) for i in TASKS if domain.task(i).kind == kind)


def test_partial_credit_without_the_write(domain):
    task = _task_of_kind(domain, "cancel")
    # Reads done, refund said (a guess), no cancellation: db differs, 2 of 3 gold actions, all info, clean turns.
    turns = [a.render() for a in task.gold_actions[:2]] + [f"say refund {task.required_info[0]}."]
    env = _play(domain, task.task_id, turns)
    reward = env.reward()
    assert env.end_reason == "user_stop" and not reward.db_match and not reward.success
    assert reward.reward == pytest.approx(0.5 * (0.2 * 1.0 + 0.5 * 2 / 3 + 0.3 * 1.0), abs=1e-12)


def test_wrong_cancel_reason_breaks_the_database(domain):
    task = _task_of_kind(domain, "cancel")
    wrong = {"mistake": "unneeded", "unneeded": "mistake"}[task.reason]
    turns = [a.render() for a in task.gold_actions[:2]]
    turns += [Call.of("cancel-order", order=task.order_id, reason=wrong).render(), f"say {task.required_info[0]}"]
    reward = _play(domain, task.task_id, turns).reward()
    assert not reward.db_match and reward.info == 1.0
    assert reward.reward == pytest.approx(0.5 * (0.2 + 0.5 * 2 / 3 + 0.3), abs=1e-12)


def test_extra_write_caps_at_half(domain):
    task = _task_of_kind(domain, "status")
    user = domain.database.users[task.user_id]
    pending = next(o for o in user.orders if domain.database.orders[o].status == PENDING)
    turns = [a.render() for a in task.gold_actions]
    turns += [Call.of("cancel-order", order=pending, reason="mistake").render(), f"say {' '.join(task.required_info)}"]
    reward = _play(domain, task.task_id, turns).reward()
    assert (reward.db_match, reward.info, reward.actions, reward.protocol) == (False, 1.0, 1.0, 1.0)
    assert reward.reward == 0.5


def test_garbage_and_half_keywords(domain):
    env = _play(domain, 0, ["xyz", "s", "call get-order"], max_turns=3)
    reward = env.reward()
    assert env.end_reason == "max_turns"
    protocol = (0.0 + 0.5 / 4 + 0.75) / 3
    assert (reward.protocol, reward.actions, reward.info) == (pytest.approx(protocol), 0.0, 0.0)
    assert reward.reward == pytest.approx(0.5 * 0.2 * protocol, abs=1e-12)
    assert env.messages[1] == ("tool", "error: start with say or call.")
    assert env.messages[5] == ("tool", "error: get-order takes order; missing order.")


def test_malformed_turns_and_bad_calls_are_answered(domain):
    turns = ["", "say", "call", "call fly to=mars", "call get-order order=o1", "call get-order o1", "say a\nsay b"]
    env = _play(domain, 1, turns, max_turns=len(turns))
    replies = [text for role, text in env.messages if role != "agent"]
    assert len(replies) == len(turns) and all(r.startswith("error: ") for r in replies)
    assert env.db == domain.database and env.end_reason == "max_turns"


def test_a_call_whose_arguments_do_not_parse_still_names_its_tool(domain):
    """The tool credit reads the tool a malformed call names; the arguments credit gets nothing from it."""
    gold = [(call.tool, call.kwargs) for call in domain.task(1).gold_actions]
    env = _play(domain, 1, ["call get-order o1, thanks", "call get-order\nsay hi"], max_turns=2)
    assert [text for role, text in env.messages if role == "tool"] == ["error: arguments are key=value, got o1,.",
                                                                       "error: one line per turn."]
    named = tool_credit(gold, [("get-order", {})])
    assert named > 0 and env.reward().tools == pytest.approx(named)
    assert env.reward().arguments == 0.0


_WORDS = st.sampled_from(["say", "call", "find-user", "get-order", "cancel-order", "order=o1", "first=ann", "zip=1",
                          "reason=mistake", "item=lamp", "city=rome", "which order", "name", "=", "==", "a=b=c"])
_TURNS = st.one_of(st.text(alphabet=ALPHABET, max_size=40), st.text(max_size=20),
                   st.lists(_WORDS, max_size=6).map(" ".join))


@settings(max_examples=150, deadline=None)
@given(turns=st.lists(_TURNS, min_size=1, max_size=6))
def test_any_text_is_answered(domain, turns):
    env = domain.episode(7, max_turns=len(turns))
    for turn in turns:
        if env.done:
            break
        role, text = env.step(turn)
        assert role in ("user", "tool") and text
    reward = env.reward()
    assert 0.0 <= reward.reward <= 1.0 and env.done


def test_user_answers_from_the_scenario(domain):
    task = _task_of_kind(domain, "return")
    env = domain.episode(task.task_id)
    role, text = env.step("say what is your name and zip?")
    assert (role, text) == ("user", f"i am {task.first} {task.last}. my zip is {task.zip}.")
    assert env.step("say which order id?")[1] == f"i do not know, it has my {task.item}."
    assert env.step("say which item?")[1] == f"the {task.item}."
    cancel = _task_of_kind(domain, "cancel")
    reason = {"mistake": "it was a mistake.", "unneeded": "it is unneeded now."}[cancel.reason]
    assert domain.episode(cancel.task_id).step("say what is the reason and which order?")[1] == \
        f"the order is {cancel.order_id}. {reason}"


def test_user_hangs_up_when_not_helped(domain):
    task = domain.task(0)
    env = _play(domain, 0, ["say hmm", "call get-user user=u1", "say hmm"], max_turns=8)
    assert not env.done and env.messages[-1] == ("user", task.goal)
    env.step("say hmm")
    assert env.done and env.end_reason == "user_stop"
    assert env.messages[-1] == ("user", f"this is not helping, bye. {STOP}")


def test_turn_limit(domain):
    env = _play(domain, 2, ["say hi", "say hi"], max_turns=2)
    assert env.done and env.end_reason == "max_turns"
    with pytest.raises(ValueError, match="the episode has ended"):
        env.step("say hi")


@pytest.mark.parametrize("kwargs,error", [({"seed": -1}, ValueError), ({"num_users": 0}, ValueError),
                                          ({"policy_chars": 1.5}, TypeError), ({"patience": True}, TypeError)])
def test_domain_arguments(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        RetailDomain(**kwargs)
