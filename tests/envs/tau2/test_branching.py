"""Tree rollouts of tau2 episodes (`play_tau2_episodes(branching=...)`, `Tau2Session.copy`): as the stand-in's
(`tests/envs/test_branching.py`): the copies are faithful and independent, episodes of a task share their first turns
and then diverge, every row replays to its own messages and reward, ended episodes stand for their rows."""

from __future__ import annotations

import pytest
import torch

from trl_dta.demos.tiny import build_model
from trl_dta.envs.tau2 import Tau2Session, play_tau2_episodes
from trl_dta.generation import reprefill_generate_fn

from .conftest import renderer_for, turn_ids


def _writes(domain, task) -> list[str]:
    kit = domain.new_environment(task).tools
    return [a.name for a in task.evaluation_criteria.actions or []
            if a.requestor == "assistant" and kit.tool_type(a.name).value == "write"]


def test_copy_is_independent(retail, chat_tokenizer):
    """Copied after a read, the twin plays the gold writes; the original's conversation, trajectory, database and
    reward do not move, and the twin's database ends where a fresh episode playing the same turns ends."""
    task = next(t for t in retail.tasks if _writes(retail, t) and len(retail.gold_turns(t)) >= 3)
    renderer = renderer_for(retail, chat_tokenizer)
    gold = retail.gold_turns(task)
    session = Tau2Session(retail, task.id, renderer)
    session.step(turn_ids(chat_tokenizer, gold[0]))
    twin = session.copy()
    before = (list(session.chat), len(session.trajectory), session.env.tools.db.get_hash(), session.reward().reward,
              list(session.user._facts))
    for message in gold[1:]:
        if twin.done:
            break
        twin.step(turn_ids(chat_tokenizer, message))
    after = (list(session.chat), len(session.trajectory), session.env.tools.db.get_hash(), session.reward().reward,
             list(session.user._facts))
    assert after == before and not session.done
    assert twin.env is not session.env and twin.env.tools.db is not session.env.tools.db
    assert twin.user is not session.user and twin.chat[:len(session.chat)] == session.chat
    assert twin.env.tools.db.get_hash() != session.env.tools.db.get_hash()  # the gold writes changed the twin only
    fresh = Tau2Session(retail, task.id, renderer)
    for message in gold[:len(twin.chat)]:
        if fresh.done:
            break
        fresh.step(turn_ids(chat_tokenizer, message))
    assert fresh.env.tools.db.get_hash() == twin.env.tools.db.get_hash() and fresh.chat == twin.chat
    assert fresh.reward().reward == twin.reward().reward


def _replay(domain, renderer, episode, max_turns):
    """The episode's policy turns replayed on a fresh session: its messages and reward."""
    session = Tau2Session(domain, episode.task_id, renderer, max_turns=max_turns)
    for turn in episode.turns:
        if session.done:
            break
        session.step(episode.ids[turn.start:turn.end])
    return session.chat[2:], session.reward().reward


@pytest.mark.parametrize("branching,branch_turns", [([2, 2], 1), pytest.param([2, 3], 2, marks=pytest.mark.slow)])
def test_episodes_share_first_turns_then_diverge(mock, chat_tokenizer, branching, branch_turns):
    torch.manual_seed(0)
    model = build_model(chat_tokenizer, hidden_size=32, max_position_embeddings=8192)
    renderer = renderer_for(mock, chat_tokenizer)
    generate = reprefill_generate_fn(model, chat_tokenizer, temperature=1.0, top_k=0, top_p=1.0)
    calls = []

    def counting(prefixes, budgets):
        calls.append(len(prefixes))
        return generate(prefixes, budgets)

    task_ids, max_turns = [mock.tasks[0].id, mock.tasks[1].id], 4
    episodes = play_tau2_episodes(mock, task_ids, counting, renderer, max_turns=max_turns, max_turn_tokens=6,
                                  branching=branching, branch_turns=branch_turns)
    g = 1
    for b in branching:
        g *= b
    assert len(episodes) == g * len(task_ids)
    assert sum(calls) < sum(len(e.turns) for e in episodes)  # shared turns were sampled once
    for t, task_id in enumerate(task_ids):
        group = episodes[t * g:(t + 1) * g]
        assert all(e.task_id == task_id for e in group)
        size = g // branching[0]  # rows below one first-level node
        for node in range(0, g, size):
            rows = group[node:node + size]
            shared = min(len(rows[0].turns), branch_turns)
            end = rows[0].turns[shared - 1].end
            assert all(r.ids[:end] == rows[0].ids[:end] for r in rows)
        assert len({tuple(e.ids) for e in group}) > 1  # the copies diverged
        for episode in group:  # every row is a faithful episode
            messages, reward = _replay(mock, renderer, episode, max_turns)
            assert messages == episode.messages and reward == episode.reward.reward


def test_ended_episodes_stand_for_their_rows(mock, chat_tokenizer):
    """An episode that ends before the branch point (one allowed turn) stands for every row below it; `branching`
    with `num_generations` other than 1 is refused."""
    renderer = renderer_for(mock, chat_tokenizer)
    task = mock.tasks[0]

    def one_turn(prefixes, budgets):
        from trl_dta.generation import Generation

        return [Generation(turn_ids(chat_tokenizer, "Hello, how can I help?")[:b], None) for b in budgets]

    episodes = play_tau2_episodes(mock, [task.id], one_turn, renderer, max_turns=1, branching=[2, 3])
    assert len(episodes) == 6 and episodes[0].end_reason in ("max_turns", "user_stop")
    assert all(e.end_reason == episodes[0].end_reason and len(e.turns) == 1 for e in episodes)
    assert all(e.ids == episodes[0].ids for e in episodes) and all(e is not episodes[0] for e in episodes[1:])
    with pytest.raises(ValueError, match="num_generations=1"):
        play_tau2_episodes(mock, [task.id], one_turn, renderer, num_generations=2, branching=[2, 2])
