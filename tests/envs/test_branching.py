"""Tree rollouts of multi-turn episodes (`play_episodes(branching=...)`, `RetailEnv.copy`): episodes of a task share
their first turns, then diverge; the copies are faithful; environments without `copy()` are refused."""

from __future__ import annotations

import pytest
import torch

from trl_dta.demos.tiny import build_model
from trl_dta.envs import AgentRolloutFunc, play_episodes
from trl_dta.generation import reprefill_generate_fn

from .test_rollout import Recorder, gold_scripts, scripted


def test_copy_is_independent(domain):
    env = domain.episode(0, max_turns=6)
    env.step(domain.task(0).gold_actions[0].render())
    twin = env.copy()
    before = (list(env.messages), env.db, env.reward().reward)
    for action in domain.task(0).gold_actions[1:]:
        twin.step(action.render())
    twin.step("say " + " ".join(domain.task(0).required_info))
    assert env.messages == before[0] and env.reward().reward == before[2] and not env.done
    assert twin.messages[: len(env.messages)] == env.messages and len(twin.messages) > len(env.messages)
    assert twin.db is not env.db and twin.session is not env.session and twin.user is not env.user


def _replay(domain, tokenizer, episode, max_turns):
    """The episode's agent turns replayed on a fresh environment: its messages and reward."""
    env = domain.episode(episode.task_id, max_turns=max_turns)
    for turn in episode.turns:
        if env.done:
            break
        env.step(tokenizer.decode(episode.ids[turn.start:turn.end], skip_special_tokens=True))
    return env.messages, env.reward().reward


@pytest.mark.parametrize("branching,branch_turns", [([2, 2], 1), pytest.param([2, 3], 2, marks=pytest.mark.slow),
                                                    pytest.param([2, 2, 2], 1, marks=pytest.mark.slow)])
def test_episodes_share_first_turns_then_diverge(domain, tokenizer, branching, branch_turns):
    torch.manual_seed(0)
    model = build_model(tokenizer)
    generate = Recorder(reprefill_generate_fn(model, tokenizer, temperature=1.0, top_k=0, top_p=1.0))
    task_ids, max_turns = [0], 4
    episodes = play_episodes(domain, task_ids, generate, tokenizer, max_turns=max_turns, max_turn_tokens=8,
                             max_tokens=2048, branching=branching, branch_turns=branch_turns)
    g = 1
    for b in branching:
        g *= b
    assert len(episodes) == g * len(task_ids)
    assert len(generate.calls) < sum(len(e.turns) for e in episodes)  # shared turns were sampled once
    for t, task_id in enumerate(task_ids):
        group = episodes[t * g:(t + 1) * g]
        assert all(e.task_id == domain.task(task_id).task_id for e in group)
        for level, _children in enumerate(branching[1:]):
            size = g // (branching[0] * _prod(branching[1:level + 1]))  # rows below one node of this level
            for node in range(0, g, size):
                rows = group[node:node + size]
                shared = min(len(rows[0].turns), branch_turns * (level + 1))
                if shared:
                    end = rows[0].turns[shared - 1].end
                    assert all(r.ids[:end] == rows[0].ids[:end] for r in rows)
        for episode in group:  # every row is a faithful episode: replaying its turns gives its messages and reward
            messages, reward = _replay(domain, tokenizer, episode, max_turns)
            assert messages == episode.messages and reward == episode.reward.reward


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


def test_ended_episodes_stand_for_their_rows(domain, tokenizer):
    """A scripted agent that finishes in one turn (the user hangs up): every row below is that episode."""
    scripts = {0: ["say " + " ".join(domain.task(0).required_info)]}
    episodes = play_episodes(domain, [0], scripted(domain, tokenizer, scripts), tokenizer, branching=[2, 3],
                             max_tokens=2048)
    assert len(episodes) == 6 and all(e.ids == episodes[0].ids and e.end_reason == "user_stop" for e in episodes)
    assert all(e is not episodes[0] for e in episodes[1:])


class _Uncopyable:
    def __init__(self, domain):
        self.domain = domain

    def __getattr__(self, name):
        return getattr(self.domain, name)

    def episode(self, task_id, max_turns=8):
        env = self.domain.episode(task_id, max_turns=max_turns)
        return type("PlainEnv", (), {"done": False, "step": env.step})()


def test_uncopyable_environment_is_refused(domain, tokenizer):
    with pytest.raises(ValueError, match="has no `copy\\(\\)`"):
        AgentRolloutFunc(_Uncopyable(domain), branching=[2, 2])
    with pytest.raises(ValueError, match="has no `copy\\(\\)`"):
        play_episodes(_Uncopyable(domain), [0], scripted(domain, tokenizer, gold_scripts(domain, [0])), tokenizer,
                      branching=[2, 2])
    with pytest.raises(ValueError, match="num_generations=1"):
        play_episodes(domain, [0], scripted(domain, tokenizer, gold_scripts(domain, [0])), tokenizer,
                      num_generations=2, branching=[2, 2])
    with pytest.raises(TypeError, match="branching"):
        AgentRolloutFunc(domain, branching="2 2")
