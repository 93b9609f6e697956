"""The per-turn layout (`trainers/per_turn.py`): turn spans, the expansion of TRL's episode batch into one row per
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
from trl.trainer.utils import pad, shuffle_sequence_dict

from bounds import UNIT_ROUNDOFF
from conftest import use_input_dtype_norms
from trl_dta.demos.tiny import build_model, build_tokenizer
from trl_dta.envs import RetailDomain, layout_sequences, play_episodes
from trl_dta.generation import Generation
from trl_dta.trainers.per_turn import (
    ROW_COUNTS_KEY,
    expand_per_turn,
    pad_rows,
    split_rows,
    split_sizes,
    split_sizes_across,
    turn_spans,
    unpadded_metrics,
)

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


def per_turn_micro_batches(batch: dict, num_chunks: int, pad_token_id: int,
                           pad_to_multiple_of: int | None = None) -> list[dict]:
    """A process's generation batch of episodes -> its `num_chunks` per-turn micro-batches (one process): the episodes
    expanded into turn rows, shuffled with TRL's `shuffle_sequence_dict` (the draw TRL makes for its episode rows) and
    split with `split_rows`. The trainer's version for any number of processes is `per_turn.per_turn_buffer`."""
    rows = shuffle_sequence_dict(expand_per_turn(batch, pad_token_id, pad_to_multiple_of))
    return split_rows(rows, num_chunks, pad_to_multiple_of)


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


# --------------------------------------------------------------------------------------------------- padding rows


def test_split_pads_to_given_counts(episodes, tokenizer):
    pad_id = tokenizer.pad_token_id
    rows = expand_per_turn(episode_batch(episodes[:2], pad_id), pad_id)
    n = rows["prompt_ids"].shape[0]
    sizes = split_sizes(n, 3)
    chunks = split_rows(rows, 3, pad_to=[sizes[0] + 2, sizes[1], sizes[2] + 1], pad_token_id=pad_id)
    assert [len(c["prompt_ids"]) for c in chunks] == [sizes[0] + 2, sizes[1], sizes[2] + 1]
    real = [c["completion_mask"].sum(1) > 0 for c in chunks]
    assert [int(r.sum()) for r in real] == sizes and all(r[:s].all() for r, s in zip(real, sizes))
    assert sum((sequences(c)[:s] for c, s in zip(chunks, sizes)), []) == sequences(rows)
    first_token = rows["prompt_ids"][0, -rows["prompt_mask"][0].sum()].item()
    for chunk, size in zip(chunks, sizes):
        assert all(seq == [first_token] for seq in sequences(chunk)[size:])  # one prompt token, no completion
        assert not chunk["advantages"][size:].any() and chunk["tool_mask"][size:].all()
    # More micro-batches than rows: the empty ones get a padding row each.
    chunks = split_rows(rows, n + 2, pad_to=[1] * (n + 2), pad_token_id=pad_id)
    assert [int(c["completion_mask"].sum(1).gt(0).sum()) for c in chunks] == [1] * n + [0, 0]
    with pytest.raises(ValueError, match="pad_to"):
        split_rows(rows, 3, pad_to=[sizes[0] - 1, sizes[1], sizes[2]])
    # A rank without any turn row (every completion masked): one padding row of `pad_token_id`, widths of 1.
    batch = episode_batch(episodes[:2], pad_id)
    batch["completion_mask"].zero_()
    empty = expand_per_turn(batch, pad_id)
    assert empty["prompt_ids"].shape == (0, 0)
    (chunk,) = split_rows(empty, 1, pad_to=[1], pad_token_id=pad_id)
    assert sequences(chunk) == [[pad_id]] and chunk["completion_ids"].shape == chunk["prompt_ids"].shape == (1, 1)
    assert not chunk["completion_mask"].any() and chunk["old_per_token_logps"].shape == (1, 1)


@pytest.mark.parametrize("counts,num_chunks", [([7, 5], 3), ([22, 23], 2), ([0, 5, 1], 4), ([3], 1), ([9, 9], 2)])
def test_split_sizes_across_ranks_are_one_process_sizes(counts, num_chunks):
    every = split_sizes_across(counts, num_chunks)
    assert [sum(sizes) for sizes in every] == counts
    assert [max(sizes) - min(sizes) for sizes in every] == [int(c % num_chunks > 0) for c in counts]
    assert [sum(column) for column in zip(*every)] == split_sizes(sum(counts), num_chunks)


ROW_MEAN = {"grpo", "sapo", "luspo", "dr_grpo"}  # normalised by the micro-batch's row count


@pytest.mark.parametrize("loss_type,level", [("dapo", "token"), ("cispo", "token"), ("vespo", "token"),
                                             ("bnpo", "token"), ("grpo", "token"), ("grpo", "sequence"),
                                             ("sapo", "token"), ("luspo", "sequence"), ("dr_grpo", "token")])
def test_padding_rows_carry_no_loss(tmp_path, episodes, tokenizer, loss_type, level):
    """TRL's `_compute_loss` on a micro-batch of turn rows and on the same rows plus padding rows: the same loss and
    gradient (row-mean loss types: scaled by real rows / all rows, as documented), and the same token-level metrics."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trainers.conftest import make_args

    pad_id = tokenizer.pad_token_id
    # float64 with RMSNorm in the input dtype (the stock norm rounds through float32, where the batch size's effect on
    # the matmuls' float64 rounding can flip a float32 rounding): only float64 rounding is left.
    model = use_input_dtype_norms(build_model(tokenizer, hidden_size=32, dtype=torch.float64))
    args = make_args(GRPOConfig, tmp_path, 1, loss_type=loss_type, importance_sampling_level=level, beta=0.0)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["abc"]}), processing_class=tokenizer)
    trainer.beta = 0.1  # the KL term reads the batch's reference log-probs (no reference model is needed)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    rows = expand_per_turn(episode_batch(episodes[1:2], pad_id), pad_id)  # 3 turns
    rows = {k: v.double() if v.is_floating_point() else v for k, v in rows.items()}  # advantages, logps: float64
    # Old log-probs near the policy's, so that the ratios sit around 1 and both clipping branches occur.
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([rows["prompt_ids"], rows["completion_ids"]], 1),
            torch.cat([rows["prompt_mask"], rows["completion_mask"]], 1), rows["completion_ids"].size(1))
    noise = 0.3 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(0), dtype=logps.dtype)
    rows["old_per_token_logps"] = (logps + noise) * rows["completion_mask"]
    n, extra = rows["prompt_ids"].shape[0], 3
    padded = pad_rows(rows, extra, int(rows["prompt_ids"][0, -1]), pad_id)

    def run(batch, factor=1.0):
        trainer.model.zero_grad()
        trainer._metrics["train"].clear()
        with unpadded_metrics(trainer._metrics["train"], trainer.importance_sampling_level, batch):
            loss = trainer._compute_loss(trainer.model, batch) * factor
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
        return loss.item(), grads, {k: v[-1] for k, v in trainer._metrics["train"].items()}

    # Row-mean loss types: the padded loss is the loss times real rows / all rows. The factor is applied inside the
    # graph: the tiny model's backward rounds through float32 somewhere, so scaling the gradients afterwards would
    # differ by ~1e-7.
    factor = n / (n + extra) if loss_type in ROW_MEAN else 1.0
    loss, grads, metrics = run(rows, factor)
    padded_loss, padded_grads, padded_metrics = run({**padded, ROW_COUNTS_KEY: (n, n + extra)})
    assert padded_loss == pytest.approx(loss, rel=1e-12)
    assert (padded_grads - grads).abs().max() <= 1e-12 * grads.abs().max()
    assert loss != 0 and grads.abs().max() > 0
    # The per-sequence means (sequence-level ratios, VESPO's weight) are corrected to the real rows by
    # `unpadded_metrics`; a sequence-level minimum over rows can only be lowered by a padding row's 0 (documented).
    # TRL divides those means by a float32 row count (its `.item()` is float32-rounded), which the correction
    # multiplies by all / real rows: they agree to float32 rounding (TRL's rounded mean, the correction's product and
    # quotient, the count's float32 value: 4 roundings, `float32_mean`); the token-level metrics are exact (float64).
    float32_mean = 4 * UNIT_ROUNDOFF[torch.float32]
    corrected = ["vespo/phi_seq_mean"] if loss_type == "vespo" else []
    corrected += ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                  "cispo_clip_ratio"] if level == "sequence" else []
    assert metrics.keys() == padded_metrics.keys() and "entropy" in metrics
    for key, value in metrics.items():
        if not (level == "sequence" and key == "clip_ratio/low_min"):
            rel = float32_mean if key in corrected else 1e-12
            assert padded_metrics[key] == pytest.approx(value, rel=rel, abs=1e-15, nan_ok=True), key
    # Without the correction, those means count the padding rows (the check above can fail).
    trainer._metrics["train"].clear()
    with torch.no_grad():
        trainer._compute_loss(trainer.model, padded)
    for key in [k for k in corrected if metrics.get(k)]:
        assert trainer._metrics["train"][key][-1] != pytest.approx(metrics[key], rel=float32_mean), key
