"""Multi-turn rollouts: masks, turn spans and prefixes, limits, the generator contract, the tiny model end to end."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest
import torch

from bounds import chain_bound
from trl_dta import PrefixTree
from trl_dta.demos.tiny import build_model
from trl_dta.envs import layout_sequences, play_episodes
from trl_dta.envs.retail.protocol import render_reply
from trl_dta.generation import Generation, reprefill_generate_fn


class Recorder:
    """Wraps a generator and keeps every (prefix, budget, generation) it saw."""

    def __init__(self, generate):
        self.generate, self.calls = generate, []

    def __call__(self, prefixes, max_new_tokens):
        outputs = self.generate(prefixes, max_new_tokens)
        self.calls += [(list(p), b, o) for p, b, o in zip(prefixes, max_new_tokens, outputs)]
        return outputs


def scripted(domain, tokenizer, scripts):
    """A generator that plays `scripts[task_id]` (turn texts, each followed by eos): the task from the prompt's
    ticket line, the turn index from the number of agent headers."""

    def generate(prefixes, max_new_tokens):
        outputs = []
        for prefix, budget in zip(prefixes, max_new_tokens):
            text = tokenizer.decode(prefix, skip_special_tokens=True)
            task_id = int(re.search(r"\nticket (\d+)\n", text).group(1))
            turn = scripts[task_id][text.count("\nagent: ") - 1]
            ids = (tokenizer(turn, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])[:budget]
            outputs.append(Generation(ids, None))
        return outputs

    return generate


def gold_scripts(domain, task_ids):
    return {i: [a.render() for a in domain.task(i).gold_actions] + [f"say {' '.join(domain.task(i).required_info)}"]
            for i in task_ids}


def check_structure(episodes, recorder, domain, tokenizer, max_tokens, max_turn_tokens):
    """Every invariant the layouts rely on, checked against what the generator actually saw and returned."""
    unmatched = Counter()  # (prefix, turn) pairs the generator produced, each to be found in exactly one episode
    for prefix, budget, output in recorder.calls:
        assert 1 <= budget <= min(max_turn_tokens, max_tokens - len(prefix))
        unmatched[tuple(prefix), tuple(output.ids)] += 1
    for e in episodes:
        n = len(e.ids)
        assert n <= max_tokens and len(e.env_mask) == n and (e.logprobs is None or len(e.logprobs) == n)
        assert e.ids[:e.prompt_length] == tokenizer(domain.prompt(e.task_id))["input_ids"]
        policy = [0] * n
        for k, turn in enumerate(e.turns):
            pair = tuple(e.ids[:turn.start]), tuple(e.ids[turn.start:turn.end])  # the prefix the policy saw, its turn
            assert unmatched[pair] > 0
            unmatched[pair] -= 1
            policy[turn.start:turn.end] = [1] * (turn.end - turn.start)
            # Between two turns: exactly the rendered reply to the first one.
            following = e.turns[k + 1].start if k + 1 < len(e.turns) else n
            role, text = e.messages[2 * k + 1]
            gap = e.ids[turn.end:following]
            assert gap == ([] if k + 1 == len(e.turns) else
                           tokenizer(render_reply(role, text), add_special_tokens=False)["input_ids"])
        assert e.env_mask == policy and e.turns[0].start == e.prompt_length and e.turns[-1].end == n
        if e.logprobs is not None:
            assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.env_mask) if not m)
        assert len(e.messages) == 2 * len(e.turns)
    assert not +unmatched


def test_gold_policy_through_the_rollout(domain, tokenizer):
    task_ids = [0, 1, 2, 5]
    recorder = Recorder(scripted(domain, tokenizer, gold_scripts(domain, task_ids)))
    episodes = play_episodes(domain, task_ids, recorder, tokenizer, num_generations=2, max_tokens=2048)
    assert [e.task_id for e in episodes] == [0, 0, 1, 1, 2, 2, 5, 5]
    assert all(e.reward.reward == 1.0 and e.end_reason == "user_stop" for e in episodes)
    assert all(e.logprobs is None for e in episodes)
    check_structure(episodes, recorder, domain, tokenizer, 2048, 64)
    assert [len(e.turns) for e in episodes[::2]] == [len(domain.task(i).gold_actions) + 1 for i in task_ids]


def test_token_limit(domain, tokenizer):
    recorder = Recorder(scripted(domain, tokenizer, gold_scripts(domain, [3])))
    prompt_length = len(tokenizer(domain.prompt(3))["input_ids"])
    for max_tokens in (prompt_length + 1, prompt_length + 37, prompt_length + 60):
        recorder.calls.clear()
        episode, = play_episodes(domain, [3], recorder, tokenizer, max_tokens=max_tokens, max_turn_tokens=32)
        assert episode.end_reason == "max_tokens" and len(episode.ids) <= max_tokens
        check_structure([episode], recorder, domain, tokenizer, max_tokens, 32)
    with pytest.raises(ValueError, match="raise `max_tokens`"):
        play_episodes(domain, [3], recorder, tokenizer, max_tokens=prompt_length)


def test_turn_limit_and_truncated_turns(domain, tokenizer):
    recorder = Recorder(scripted(domain, tokenizer, {4: ["call get-order order=o1"] * 10}))
    episode, = play_episodes(domain, [4], recorder, tokenizer, max_turns=3, max_turn_tokens=5)
    assert episode.end_reason == "max_turns" and len(episode.turns) == 3
    assert all(t.end - t.start == 5 for t in episode.turns)  # cut at the budget, no eos
    assert episode.messages[1] == ("tool", "error: call needs a tool name.")  # "call " was all it wrote
    check_structure([episode], recorder, domain, tokenizer, 1024, 5)


@pytest.mark.parametrize(
    "outputs,message",
    [
        (lambda p, b: [Generation([], None) for _ in p], "between 1 and max_new_tokens"),
        (lambda p, b: [Generation([5] * (n + 1), None) for n in b], "between 1 and max_new_tokens"),
        (lambda p, b: [], "returned 0 generations for 1 prefixes"),
        (lambda p, b: [Generation([5], [0.0, 0.0]) for _ in p], "different lengths"),
    ],
)
def test_generator_contract(domain, tokenizer, outputs, message):
    with pytest.raises(ValueError, match=message):
        play_episodes(domain, [0], outputs, tokenizer)


def test_layouts(domain, tokenizer):
    task_ids = [0, 1]
    episodes = play_episodes(domain, task_ids, scripted(domain, tokenizer, gold_scripts(domain, task_ids)),
                             tokenizer, num_generations=2, max_tokens=2048)
    assert layout_sequences(episodes, "episode") == [e.ids for e in episodes]
    per_turn = layout_sequences(episodes, "per_turn")
    assert len(per_turn) == sum(len(e.turns) for e in episodes)
    assert per_turn[len(episodes[0].turns) - 1] == episodes[0].ids
    with pytest.raises(ValueError, match="`layout` must be one of"):
        layout_sequences(episodes, "turns")


def test_tiny_model_end_to_end(domain, tokenizer):
    model = build_model(tokenizer)
    settings = dict(num_generations=2, max_turns=3, max_turn_tokens=10, max_tokens=800)
    torch.manual_seed(0)
    recorder = Recorder(reprefill_generate_fn(model, tokenizer))
    episodes = play_episodes(domain, [0, 1], recorder, tokenizer, **settings)
    check_structure(episodes, recorder, domain, tokenizer, 800, 10)
    assert all(0.0 <= e.reward.reward <= 1.0 and e.end_reason in ("max_turns", "user_stop") for e in episodes)

    # The log-probs are the sampling distribution's (temperature 1, no top-k/top-p): a plain forward agrees.
    for e in episodes[:2]:
        with torch.no_grad():
            logits = model(torch.tensor([e.ids])).logits[0].double()  # (n_tokens, vocab)
        logprobs = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(e.ids[1:])[:, None])[:, 0]
        policy = torch.tensor(e.env_mask[1:], dtype=torch.bool)
        sampled = torch.tensor(e.logprobs[1:], dtype=torch.float64)
        # Two float32 computations of the same log-probs (cached decoding, one full forward): each reached through
        # every layer's projections and attention over the context, then the vocabulary's softmax (`chain_bound`),
        # relative to the magnitudes summed there (the logits, log V).
        c = model.config
        k = c.num_hidden_layers * (c.hidden_size + c.intermediate_size + len(e.ids)) + c.hidden_size + c.vocab_size
        bound = chain_bound(k) * (logits.abs().max().item() + math.log(c.vocab_size))
        assert (sampled[policy] - logprobs[policy]).abs().max() <= bound
        assert (sampled[policy] <= 0).all() and (sampled[~policy] == 0).all()

    torch.manual_seed(0)
    again = play_episodes(domain, [0, 1], reprefill_generate_fn(model, tokenizer), tokenizer, **settings)
    assert [e.ids for e in again] == [e.ids for e in episodes]

    # Episodes of different tasks meet in one tree at the system prompt.
    system_length = len(tokenizer(domain.system_prompt)["input_ids"])
    for layout in ("episode", "per_turn"):
        tree = PrefixTree.from_sequences(layout_sequences(episodes, layout))
        roots = [s for s in tree.segments if s.parent == -1]
        assert len(roots) == 1 and roots[0].end >= system_length
