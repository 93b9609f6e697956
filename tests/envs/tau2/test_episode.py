"""tau2 episodes in the chat template, graded by tau2's evaluator: gold replay, wrong actions, bad calls."""

from __future__ import annotations

import os

import pytest

from trl_dta.envs.tau2 import ScriptedUser, Tau2Session, play_tau2_episodes

from .conftest import ScriptedPolicy, get_domain, renderer_for


def play(domain, task, tokenizer, turns, **kwargs):
    """One episode of `task` whose policy plays `turns` (chat messages or text), then asks for more."""
    renderer = renderer_for(domain, tokenizer)
    prompt = tuple(Tau2Session(domain, task.id, renderer).prompt_ids)
    policy = ScriptedPolicy(tokenizer, {prompt: list(turns)})
    kwargs = {"max_turns": 64, "max_turn_tokens": 16384, "max_tokens": 10**6, **kwargs}
    return play_tau2_episodes(domain, [task.id], policy, renderer, **kwargs)[0]


def _offline_checkable(task) -> bool:
    # Every airline and retail task of tau2 26.3 is graded on DB and COMMUNICATE, both offline.
    return {b.value for b in task.evaluation_criteria.reward_basis} <= {"DB", "COMMUNICATE", "ACTION",
                                                                         "ENV_ASSERTION"}


# Every `REPLAY_STRIDE`-th task of a domain is replayed, plus the tasks `replay_sample` adds so that every kind of gold
# episode is in: each tool a gold action calls (so each tool's argument types go through the chat template, the parser
# and tau2's DB check), a task without actions, one without `communicate_info`, and the longest. All 164 tasks take
# about 4 times as long and add episodes of the kinds already replayed; `DTA_TAU2_REPLAY_STRIDE=1` replays them all
# (all 164 reached reward 1 when the sample was introduced).
REPLAY_STRIDE = int(os.environ.get("DTA_TAU2_REPLAY_STRIDE", "4"))


def replay_sample(tasks: list) -> list:
    """The replayed tasks, in the domain's order: every `REPLAY_STRIDE`-th, and the first task of each kind above."""
    def tools(task):
        return {a.name for a in (task.evaluation_criteria.actions or []) if a.requestor == "assistant"}

    def n_actions(task):
        return len(task.evaluation_criteria.actions or [])

    chosen = {i for i in range(0, len(tasks), REPLAY_STRIDE)}
    kinds = [lambda t, tool=tool: tool in tools(t) for tool in sorted(set().union(*map(tools, tasks)))]
    kinds += [lambda t: n_actions(t) == 0, lambda t: not t.evaluation_criteria.communicate_info,
              lambda t: n_actions(t) == max(map(n_actions, tasks))]
    for kind in kinds:
        if not any(kind(tasks[i]) for i in chosen):
            chosen.add(next((i for i, t in enumerate(tasks) if kind(t)), 0))
    sample = [tasks[i] for i in sorted(chosen)]
    assert set().union(*map(tools, sample)) == set().union(*map(tools, tasks)), "a tool is never replayed"
    return sample


@pytest.mark.slow
@pytest.mark.parametrize("name", ["airline", "retail", "telecom"])
def test_gold_replay_reaches_reward_one(name, chat_tokenizer):
    """Gold replay scores 1 from tau2's evaluator; in telecom the scripted user does the user's own gold actions
    (the phone's) when the gold replay asks for them."""
    domain = get_domain(name)
    tasks = [t for t in domain.tasks if _offline_checkable(t)]
    assert len(tasks) == len(domain.tasks) == {"airline": 50, "retail": 114, "telecom": 114}[name]
    sample = replay_sample(tasks)
    assert len(sample) >= len(tasks) / REPLAY_STRIDE
    failed = {}
    for task in sample:
        episode = play(domain, task, chat_tokenizer, domain.gold_turns(task))
        if episode.end_reason != "user_stop" or episode.reward.reward != 1.0:
            failed[task.id] = (episode.end_reason, episode.reward.reward_breakdown)
    assert not failed, f"{len(failed)} gold replays below 1: {dict(list(failed.items())[:5])}"


def _write_task(domain):
    return next(t for t in domain.tasks if any(a.name.startswith(("cancel", "modify", "update", "return", "book"))
                                             for a in t.evaluation_criteria.actions))


def test_wrong_write_action_gets_zero(airline, retail, chat_tokenizer):
    for domain in (airline, retail):
        task = _write_task(domain)
        gold = domain.gold_turns(task)
        assert play(domain, task, chat_tokenizer, gold).reward.reward == 1.0
        # The same episode with the last write action's first argument value swapped for another task's.
        wrong = [dict(m) for m in gold]
        k = max(i for i, m in enumerate(wrong) if m.get("tool_calls") and
                m["tool_calls"][0]["function"]["name"].startswith(("cancel", "modify", "update", "return", "book")))
        without = wrong[:k] + wrong[k + 1:]
        episode = play(domain, task, chat_tokenizer, without)
        assert episode.end_reason == "user_stop" and episode.reward.reward == 0.0
        assert episode.reward.db_check.db_match is False


def test_unknown_tool_and_malformed_call_answered_with_errors(airline, chat_tokenizer):
    task = _write_task(airline)
    gold = airline.gold_turns(task)
    unknown = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "refund_everything", "arguments": {"user_id": "x"}}}]}
    bad_args = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_user_details", "arguments": {"wrong_argument": "x"}}}]}
    malformed = '<tool_call>\n{"name": "get_user_details", "arguments": {"user_id": \n</tool_call>'
    episode = play(airline, task, chat_tokenizer, [unknown, bad_args, malformed] + gold)
    tool_answers = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert tool_answers[0] == "Error: Tool 'refund_everything' not found."  # tau2's own message
    assert tool_answers[1].startswith("Error: ") and "wrong_argument" in tool_answers[1]
    assert tool_answers[2].startswith("Error: the tool call could not be parsed")
    # The episode went on: the gold actions after the errors still solve the task.
    assert episode.end_reason == "user_stop" and episode.reward.reward == 1.0
    assert len(episode.turns) > 3 + len(gold)


def test_episode_tokens_masks_and_limits(mock, chat_tokenizer):
    task = mock.tasks[0]
    episode = play(mock, task, chat_tokenizer, mock.gold_turns(task))
    ids, mask = episode.ids, episode.env_mask
    assert len(ids) == len(mask) and mask[:episode.prompt_length] == [0] * episode.prompt_length
    for turn in episode.turns:  # every policy turn is in the loss and ends with the template's end of turn
        assert mask[turn.start:turn.end] == [1] * (turn.end - turn.start)
        assert ids[turn.end - 1] == chat_tokenizer.eos_token_id
    assert sum(mask) == sum(t.end - t.start for t in episode.turns)  # tool results and user messages are masked
    text = chat_tokenizer.decode(ids)
    assert "<tool_response>" in text and ScriptedUser(task).opening in text
    cut = play(mock, task, chat_tokenizer, mock.gold_turns(task), max_turns=1)
    assert cut.end_reason == "max_turns" and cut.reward.reward == 0.0 and len(cut.turns) == 1


def test_scripted_user_is_deterministic_and_stops(airline):
    task = airline.tasks[3]
    a, b = ScriptedUser(task, seed=1), ScriptedUser(task, seed=1)
    assert a.opening == b.opening
    assert task.user_scenario.instructions.reason_for_call.split(".")[0].replace("You", "I")[:20] in a.opening
    replies = [a.reply("What is your user id?") for _ in range(12)]
    assert replies == [b.reply("What is your user id?") for _ in range(12)]
    assert replies[-1][1] and "###STOP###" in replies[-1][0]
    assert ScriptedUser(task).reply("Shall I proceed with the booking?") == ("Yes, please go ahead.", False)
    openings = {ScriptedUser(task, seed=s).opening for s in range(8)}
    assert len(openings) >= 1


def test_copied_databases_grade_as_tau2s_own(mock, retail, chat_tokenizer):
    """Environments built from the copied database (`CopyingConstructor`) hold tau2's database (same hash), do not
    share state (a write in one leaves the next pristine), and tau2's evaluator grades an episode with them exactly
    as with tau2's own constructor (gold: 1, gold without its write: 0, reward breakdowns equal)."""
    from datetime import datetime, timezone

    from trl_dta.envs.tau2 import tau2_modules

    t = tau2_modules()
    for domain in (mock, retail):
        stock = t.registry.get_env_constructor(domain.name)()
        fresh = domain.env_constructor()
        assert fresh.get_db_hash() == stock.get_db_hash()
        task = next(t for t in domain.tasks if any(a.name.startswith(("create", "update", "cancel", "modify", "return"))
                                                   for a in t.evaluation_criteria.actions or []))
        episode = play(domain, task, chat_tokenizer, domain.gold_turns(task))
        assert episode.reward.reward == 1.0
        assert domain.env_constructor().get_db_hash() == stock.get_db_hash()  # the episode's writes stayed its own
        for turns in (domain.gold_turns(task), domain.gold_turns(task)[1:]):
            session = Tau2Session(domain, task.id, renderer_for(domain, chat_tokenizer))
            policy = ScriptedPolicy(chat_tokenizer, {tuple(session.prompt_ids): list(turns)})
            while not session.done:
                session.step(policy([session.prompt_ids], [10**5])[0].ids)
            now = datetime.now(timezone.utc).isoformat()
            run = t.simulation.SimulationRun(id="x", task_id=task.id, start_time=now, end_time=now, duration=0.0,
                                             termination_reason="user_stop", messages=list(session.trajectory))
            ours = session.reward()
            theirs = t.evaluator.evaluate_simulation(simulation=run, task=task, domain=domain.name, solo_mode=False,
                                                     evaluation_type=t.evaluator.EvaluationType.ALL)
            assert (ours.reward, ours.reward_breakdown, ours.db_check) == (theirs.reward, theirs.reward_breakdown,
                                                                          theirs.db_check)
