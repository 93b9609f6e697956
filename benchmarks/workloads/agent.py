"""The agent workload of the trainer benchmark: multi-turn episodes, played once, replayed to the trainer.

Episodes of the offline stand-in retail environment (`trl_dta.envs`) are played by a scripted agent whose `G`
episodes of a task branch at several depths ([`agent_script`]); with a tau2-bench domain, they are gold-action
episodes of the real domain (`tau2.py`, ids relabelled compactly for the benchmark model's vocabulary).
[`ReplayRollout`] hands them to `DTAGRPOTrainer` as TRL's `rollout_func`, so that every optimizer step trains the same
rows; [`agent_forest`] is the step's prefix forest in a sample layout.
"""

from __future__ import annotations

from collections import Counter

from trl_dta.flops import dense_flops, tree_flops

from ..harness.models import model_shape

# tasks per optimizer step, episodes per task (G), policy document in characters (= tokens with the tiny
# character tokenizer), agent turns per episode, tokens per episode
AGENT_SIZES = {
    "quick": {"tasks": 2, "group": 4, "policy_chars": 0, "max_turns": 5, "max_tokens": 2048},
    "full": {"tasks": 4, "group": 8, "policy_chars": 2048, "max_turns": 8, "max_tokens": 4096},
}
# What the scripted agent may ask before acting; the simulated user answers each (`trl_dta.envs.retail.user`).
_QUESTIONS = ("say may i have your name?", "say what is your zip code?", "say which order is it about?",
              "say what is the reason for the call?")


def agent_script(task, variant: int) -> list[str]:
    """Turn texts of the scripted agent's `variant`-th episode of a task: it branches at several depths.

    Bit 0 of `variant` picks the first question, bit 1 the second, bit 2 adds a lookup of a wrong order before the
    task's gold actions; every third variant closes with `say done` instead of the required information (the user
    then repeats the request until it hangs up or the turn limit ends the call), so rewards differ within a group.
    """
    turns = [_QUESTIONS[variant % 2], _QUESTIONS[2 + variant // 2 % 2]]
    if variant // 4 % 2:
        turns.append(f"call get-order order=o9{variant}")
    turns += [action.render() for action in task.gold_actions]
    turns.append("say done" if variant % 3 == 2 else "say " + " ".join(task.required_info))
    return turns


class Tau2Prompts:
    """The task lookup of [`ReplayRollout`] for tau2 workloads: dataset prompts are `"tau2 task <id>"`."""

    @staticmethod
    def task_id_of(prompt: str) -> str:
        return prompt.removeprefix("tau2 task ")


def agent_episodes(sizes: dict, seed: int = 0):
    """The `group` scripted episodes of each of `tasks` tasks, played in the stand-in retail environment
    (`trl_dta.envs`), or, with `sizes["domain"]` a tau2 domain, gold-action episodes of the real domain
    (`tau2.py`, ids relabelled compactly for the benchmark model's vocabulary).

    Returns:
        `tuple[domain, tokenizer, list[Episode]]`: episodes task by task, a task's `group` episodes adjacent.
    """
    if sizes.get("domain", "standin") != "standin":
        from trl_dta.demos.tiny import build_tokenizer
        from trl_dta.envs.tau2 import Tau2Domain

        from . import tau2

        bpe = tau2.bpe_chat_tokenizer()
        domain = Tau2Domain(sizes["domain"])
        episodes = tau2.gold_episodes(domain, tau2.domain_task_ids(domain, sizes["tasks"]), sizes["group"], bpe)
        tokenizer = build_tokenizer()  # pad 0, eos 2: the relabelled episodes' special ids
        vocab = model_shape(sizes.get("shape", "bench-cpu")).vocab_size
        tau2.compact_ids(episodes, vocab, bpe.eos_token_id, new_eos=tokenizer.eos_token_id)
        return Tau2Prompts(), tokenizer, episodes
    from trl_dta.demos.tiny import build_tokenizer
    from trl_dta.envs import RetailDomain, play_episodes
    from trl_dta.generation import Generation

    domain = RetailDomain(seed=seed, policy_chars=sizes["policy_chars"])
    tokenizer = build_tokenizer()
    episodes = []
    for task_id in range(sizes["tasks"]):
        for variant in range(sizes["group"]):
            turns = iter(agent_script(domain.task(task_id), variant))

            def generate(prefixes, max_new_tokens, turns=turns):
                ids = tokenizer(next(turns, "say bye"), add_special_tokens=False)["input_ids"]
                return [Generation((ids + [tokenizer.eos_token_id])[: max_new_tokens[0]], None)]

            episodes += play_episodes(domain, [task_id], generate, tokenizer, max_turns=sizes["max_turns"],
                                      max_turn_tokens=64, max_tokens=sizes["max_tokens"])
    return domain, tokenizer, episodes


class ReplayRollout:
    """TRL's `rollout_func` replaying fixed episodes: the `k`-th copy of a task's prompt in a call gets the task's
    `k`-th episode (TRL repeats each prompt `num_generations` times). Keys as `trl_dta.envs.AgentRolloutFunc`."""

    def __init__(self, domain, episodes):
        self.domain = domain
        self.by_task: dict[int, list] = {}
        for episode in episodes:
            self.by_task.setdefault(episode.task_id, []).append(episode)

    def __call__(self, prompts, trainer):
        seen, episodes = Counter(), []
        for prompt in prompts:
            task_id = self.domain.task_id_of(prompt)
            group = self.by_task[task_id]
            episodes.append(group[seen[task_id] % len(group)])
            seen[task_id] += 1
        return {
            "prompt_ids": [e.ids[: e.prompt_length] for e in episodes],
            "completion_ids": [e.ids[e.prompt_length :] for e in episodes],
            "logprobs": None,
            "env_mask": [e.env_mask[e.prompt_length :] for e in episodes],
            "episode_reward": [e.reward.reward for e in episodes],
        }


def agent_forest(episodes, layout: str, shape: str) -> dict:
    """The step's forest (every row of the generation) in a layout: tokens, tree tokens, compression, ideal ratio."""
    from trl_dta.envs import layout_sequences
    from trl_dta.tree import PrefixTree

    seqs = layout_sequences(episodes, layout)
    tree = PrefixTree.from_sequences(seqs)
    return {
        "n_sequences": len(seqs),
        "n_tokens": tree.n_tokens,
        "n_tree_tokens": tree.n_tree_tokens,
        "compression_ratio": tree.compression_ratio,
        "ideal_ratio": dense_flops(tree.lengths, shape).total / tree_flops(tree, shape).total,
    }
