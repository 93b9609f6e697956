"""The per-turn layout (`trainers/layouts.py`): turn spans, the expansion of TRL's episode batch into one row per
assistant turn, the split that keeps every row, and the log-probs of a real model in both layouts.

Episodes come from the real retail environment (`trl_dta.envs`) played by a scripted policy ([`scripted_episodes`]):
G different scripts per task (a prefix of the gold actions, then a message), so that rewards differ within a group.
[`ReplayRollout`] hands them to a trainer as TRL's `rollout_func` (used by `test_agent.py`).
"""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest
import torch
from conftest import use_input_dtype_norms
from trl.trainer.utils import pad

from trl_dta.envs import Generation, RetailDomain, layout_sequences, play_episodes
from trl_dta.tiny import build_model, build_tokenizer
from trl_dta.trainers.layouts import expand_per_turn, per_turn_micro_batches, split_rows, turn_spans

MAX_TURNS = 3
MAX_TURN_TOKENS = 64
MAX_TOKENS = 1024


def _script(domain: RetailDomain, task_id: int, variant: int) -> list[str]:
    """Turn texts of one scripted agent: some gold actions, then a message with or without the required facts."""
    task = domain.task(task_id)
    rng = random.Random(1000 * task_id + variant)
    turns = [action.render() for action in task.gold_actions[:rng.randint(0, len(task.gold_actions))]]
    turns.insert(rng.randint(0, len(turns)), rng.choice(["say hello", "call get-order order=o999", "talk"]))
    turns.append("say " + (" ".join(task.required_info) if rng.random() < 0.5 else "done"))
    return turns


def scripted_episodes(domain: RetailDomain, tokenizer, task_id: int, variants: int):
    """`variants` episodes of a task, each played by its own script in the real environment."""
    episodes = []
    for variant in range(variants):
        turns = iter(_script(domain, task_id, variant))

        def generate(prefixes, max_new_tokens):
            ids = tokenizer(next(turns, "say bye"), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            return [Generation(ids[:max_new_tokens[0]], None)]

        episodes += play_episodes(domain, [task_id], generate, tokenizer, max_turns=MAX_TURNS,
                                  max_turn_tokens=MAX_TURN_TOKENS, max_tokens=MAX_TOKENS)
    return episodes


class ReplayRollout:
    """TRL's `rollout_func` replaying scripted episodes: the `k`-th copy of a task's prompt in a call gets the task's
    `k`-th episode (TRL repeats each prompt `num_generations` times). Same keys as `trl_dta.envs.AgentRolloutFunc`."""

    def __init__(self, domain: RetailDomain, tokenizer, variants: int):
        self.domain, self.tokenizer, self.variants = domain, tokenizer, variants
        self.cache: dict[int, list] = {}
        self.calls: list[list] = []

    def __call__(self, prompts, trainer):
        seen, episodes = Counter(), []
        for prompt in prompts:
            task_id = self.domain.task_id_of(prompt)
            if task_id not in self.cache:
                self.cache[task_id] = scripted_episodes(self.domain, self.tokenizer, task_id, self.variants)
            episodes.append(self.cache[task_id][seen[task_id] % self.variants])
            seen[task_id] += 1
        self.calls.append(episodes)
        return {
            "prompt_ids": [e.ids[:e.prompt_length] for e in episodes],
            "completion_ids": [e.ids[e.prompt_length:] for e in episodes],
            "logprobs": None,
            "env_mask": [e.env_mask[e.prompt_length:] for e in episodes],
            "episode_reward": [e.reward.reward for e in episodes],
        }


@pytest.fixture(scope="module")
def domain():
    return RetailDomain(seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def episodes(domain, tokenizer):
    return [e for task_id in (0, 1) for e in scripted_episodes(domain, tokenizer, task_id, 3)]


def episode_batch(episodes, pad_id: int, with_logps: bool = True) -> dict:
    """TRL's generation batch of these episodes, as `_generate_and_score_completions` pads it."""
    prompts = [torch.tensor(e.ids[:e.prompt_length]) for e in episodes]
    completions = [torch.tensor(e.ids[e.prompt_length:]) for e in episodes]
    batch = {
        "prompt_ids": pad(prompts, padding_value=pad_id, padding_side="left"),
        "prompt_mask": pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left"),
        "completion_ids": pad(completions, padding_value=pad_id, padding_side="right"),
        "completion_mask": pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right"),
        "tool_mask": pad([torch.tensor(e.env_mask[e.prompt_length:]) for e in episodes], padding_value=1,
                         padding_side="right"),
        "advantages": torch.arange(len(episodes), dtype=torch.float32) - 1.5,
    }
    batch["num_items_in_batch"] = (batch["completion_mask"] * batch["tool_mask"]).sum()
    if with_logps:
        generator = torch.Generator().manual_seed(0)
        for key in ("old_per_token_logps", "ref_per_token_logps"):
            batch[key] = -torch.rand(batch["completion_ids"].shape, generator=generator)
    return batch


def sequences(batch: dict) -> list[list[int]]:
    """Each row's real tokens, prompt and completion."""
    return [p[pm.bool()].tolist() + c[cm.bool()].tolist() for p, pm, c, cm in
            zip(batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"])]


# ----------------------------------------------------------------------------------------------------- turn spans


def test_turn_spans():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1],
                         [0, 1, 1, 1, 1, 0, 0, 0],
                         [0, 0, 0, 0, 0, 0, 0, 0]])
    assert turn_spans(mask) == [[(0, 2), (4, 5), (6, 8)], [(1, 5)], []]


def test_turn_spans_are_the_rollout_turns(episodes, tokenizer):
    batch = episode_batch(episodes, tokenizer.pad_token_id)
    spans = turn_spans(batch["completion_mask"] * batch["tool_mask"])
    assert spans == [[(t.start - e.prompt_length, t.end - e.prompt_length) for t in e.turns] for e in episodes]
    assert sum(map(len, spans)) > len(episodes)  # multi-turn


# ------------------------------------------------------------------------------------------------------ expansion


def test_expansion_rows(episodes, tokenizer):
    pad_id = tokenizer.pad_token_id
    batch = episode_batch(episodes, pad_id)
    rows = expand_per_turn(batch, pad_id)
    n = sum(len(e.turns) for e in episodes)
    episode_of = [b for b, e in enumerate(episodes) for _ in e.turns]
    # The rows are the environment's per-turn sequences: the conversation up to and including each turn.
    assert sequences(rows) == layout_sequences(episodes, "per_turn")
    assert rows["prompt_ids"].shape[0] == n and rows["completion_ids"].shape[0] == n
    assert torch.equal(rows["advantages"], batch["advantages"][episode_of])
    assert rows["num_items_in_batch"] is batch["num_items_in_batch"]
    # Every policy token is a completion token of exactly one row: the loss-token count is TRL's.
    loss_mask = rows["completion_mask"] * rows["tool_mask"]
    assert loss_mask.sum() == batch["num_items_in_batch"]
    assert torch.equal(loss_mask, rows["completion_mask"])
    r = 0
    for b, e in enumerate(episodes):
        for turn in e.turns:
            start, end = turn.start - e.prompt_length, turn.end - e.prompt_length
            length = end - start
            assert rows["completion_ids"][r, :length].tolist() == e.ids[turn.start:turn.end]
            assert rows["prompt_mask"][r].sum() == turn.start and rows["prompt_mask"][r, -1] == 1  # left-padded
            assert rows["completion_mask"][r, :length].all() and not rows["completion_mask"][r, length:].any()
            for key in ("old_per_token_logps", "ref_per_token_logps"):
                assert torch.equal(rows[key][r, :length], batch[key][b, start:end])
                assert not rows[key][r, length:].any()
            r += 1
    # Prompt columns: left padding only as wide as the longest turn prefix; completion columns: the longest turn.
    assert rows["prompt_ids"].shape[1] == max(t.start for e in episodes for t in e.turns)
    assert rows["completion_ids"].shape[1] == max(t.end - t.start for e in episodes for t in e.turns)


def test_expansion_per_episode_and_token_values(episodes, tokenizer):
    pad_id = tokenizer.pad_token_id
    batch = episode_batch(episodes[:2], pad_id, with_logps=False)
    width = batch["completion_ids"].shape[1]
    episode_of = [b for b, e in enumerate(episodes[:2]) for _ in e.turns]
    sequence_ratio = torch.tensor([[0.5], [2.0]])
    rows = expand_per_turn({**batch, "importance_sampling_ratio": sequence_ratio}, pad_id)
    assert torch.equal(rows["importance_sampling_ratio"], sequence_ratio[episode_of])
    token_advantages = torch.arange(2 * width, dtype=torch.float32).view(2, width)
    rows = expand_per_turn({**batch, "advantages": token_advantages}, pad_id, pad_to_multiple_of=16)
    assert rows["prompt_ids"].shape[1] % 16 == 0 and rows["advantages"].shape[1] % 16 == 0
    second = episodes[0].turns[1]  # row 1: the first episode's second turn
    start, length = second.start - episodes[0].prompt_length, second.end - second.start
    assert rows["advantages"][1, :length].tolist() == token_advantages[0, start:start + length].tolist()
    with pytest.raises(ValueError, match="importance_sampling_ratio"):
        expand_per_turn({**batch, "importance_sampling_ratio": torch.ones(2, 3)}, pad_id)


def test_masked_episode_gives_no_row(episodes, tokenizer):
    pad_id = tokenizer.pad_token_id
    batch = episode_batch(episodes[:3], pad_id)
    batch["completion_mask"][1] = 0  # as `mask_truncated_completions` leaves a truncated episode
    rows = expand_per_turn(batch, pad_id)
    assert rows["prompt_ids"].shape[0] == len(episodes[0].turns) + len(episodes[2].turns)


def test_expansion_errors(episodes, tokenizer):
    pad_id = tokenizer.pad_token_id
    batch = episode_batch(episodes[:2], pad_id)
    with pytest.raises(ValueError, match="tool_mask.*env_mask.*dta_sample_layout='episode'"):
        expand_per_turn({k: v for k, v in batch.items() if k != "tool_mask"}, pad_id)
    with pytest.raises(ValueError, match="text-only.*pixel_values"):
        expand_per_turn({**batch, "pixel_values": torch.zeros(2, 3)}, pad_id)
    with pytest.raises(ValueError, match="does not know how to cut \\['my_key'\\]"):
        expand_per_turn({**batch, "my_key": torch.zeros(2)}, pad_id)


# ---------------------------------------------------------------------------------------------------------- split


def test_split_keeps_every_row(episodes, tokenizer):
    pad_id = tokenizer.pad_token_id
    rows = expand_per_turn(episode_batch(episodes, pad_id), pad_id)
    n = rows["prompt_ids"].shape[0]
    chunks = split_rows(rows, 4)
    assert [c["prompt_ids"].shape[0] for c in chunks] == [n // 4 + (k < n % 4) for k in range(4)]
    assert sum((sequences(c) for c in chunks), []) == sequences(rows)  # in order, none dropped
    for chunk in chunks:
        assert chunk["num_items_in_batch"] is rows["num_items_in_batch"]
        # Trimmed to the chunk's own rows: some row uses the first prompt column and the last completion column.
        assert chunk["prompt_mask"][:, 0].any() and chunk["completion_mask"][:, -1].any()
        assert chunk["old_per_token_logps"].shape == chunk["completion_ids"].shape == chunk["tool_mask"].shape
    padded = expand_per_turn(episode_batch(episodes, pad_id), pad_id, pad_to_multiple_of=8)
    for chunk in split_rows(padded, 3, pad_to_multiple_of=8):
        assert chunk["prompt_ids"].shape[1] % 8 == 0 and chunk["completion_ids"].shape[1] % 8 == 0
        assert chunk["prompt_ids"].shape[1] < padded["prompt_ids"].shape[1] + 8
    with pytest.raises(ValueError, match=f"{n} rows on this process, fewer than `steps_per_generation={n + 1}`"):
        split_rows(rows, n + 1)


def test_per_turn_micro_batches(episodes, tokenizer):
    pad_id = tokenizer.pad_token_id
    batch = episode_batch(episodes, pad_id)
    torch.manual_seed(3)
    chunks = per_turn_micro_batches(batch, 2, pad_id)
    torch.manual_seed(3)
    permutation = torch.randperm(sum(len(e.turns) for e in episodes))  # the draw of TRL's `shuffle_sequence_dict`
    turns = layout_sequences(episodes, "per_turn")
    assert sum((sequences(c) for c in chunks), []) == [turns[i] for i in permutation.tolist()]


# ---------------------------------------------------------------------------------------- a real model, both layouts


def completion_logps(model, batch: dict) -> torch.Tensor:
    """Per-token log-probs of the completion columns, as TRL's `_get_per_token_logps_and_entropies` computes them,
    with position ids counted from each row's first real token (RoPE's angles are float32 even in a float64 model, so
    rows padded differently would differ by float32 rounding of the angles)."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    width = batch["completion_ids"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids).logits[:, -width - 1:-1]
    return logits.log_softmax(-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


def test_turn_logps_equal_episode_logps(episodes, tokenizer):
    pad_id = tokenizer.pad_token_id
    # float64 with RMSNorm in the input dtype (the stock norm rounds through float32): only float64 rounding is left.
    model = use_input_dtype_norms(build_model(tokenizer, hidden_size=32, dtype=torch.float64))
    episodes = episodes[::2]  # 3 of the 6 episodes keep the float64 forward short
    batch = episode_batch(episodes, pad_id)
    rows = expand_per_turn(batch, pad_id)
    episode_logps, turn_logps = completion_logps(model, batch), completion_logps(model, rows)
    worst, r = 0.0, 0
    for b, e in enumerate(episodes):
        for turn in e.turns:
            start, length = turn.start - e.prompt_length, turn.end - turn.start
            err = (turn_logps[r, :length] - episode_logps[b, start:start + length]).abs().max().item()
            worst, r = max(worst, err), r + 1
    assert worst <= 1e-10, f"turn log-probs differ from the episode's by {worst:.2e}"


def test_replay_rollout_groups(domain, tokenizer):
    rollout = ReplayRollout(domain, tokenizer, variants=4)
    out = rollout([domain.prompt(2)] * 4 + [domain.prompt(5)] * 4, trainer=None)
    assert len(out["prompt_ids"]) == 8 and len(set(map(tuple, out["completion_ids"][:4]))) == 4
    assert len(set(out["episode_reward"][:4])) > 1 and len(set(out["episode_reward"][4:])) > 1  # advantages move
    assert all(re.search(r"\nticket 5\n", tokenizer.decode(p)) for p in out["prompt_ids"][4:])
