"""The stand-in retail domain for TRL: a dataset of task prompts and a `rollout_func` that plays its episodes (the
contract, the generation and the logged metrics: `envs.core.trl`).

```python
domain = RetailDomain()
trainer = GRPOTrainer(model=model, processing_class=tokenizer, train_dataset=build_dataset(domain, 64),
                      rollout_func=AgentRolloutFunc(domain), reward_funcs=episode_reward, args=GRPOConfig(...))
```

Besides the columns of `envs.core.trl.episode_columns`, [`AgentRolloutFunc`] returns `episode_reward` (`float`, the
stand-in's reward), `success` and the shaped credits (`call_format`, `tools`, `arguments`) for the reward functions
of `envs.core.trl` (`episode_reward`, `SHAPED_REWARDS`); `max_completion_length` is the budget of each *turn* (64 fits
every gold call of the retail domain).
"""

from __future__ import annotations

import math

from datasets import Dataset

from ..._checks import check_bool, check_int
from ..core.rollout import check_branching, check_copyable
from ..core.trl import SHAPED_KEYS, check_vllm_rollouts, episode_columns, rollout_meter
from .chat_turns import ChatTurns
from .env import RetailDomain
from .episode import play_episodes


def build_dataset(
    domain: RetailDomain, num_tasks: int, *, first_task: int = 0, conversational: bool = False
) -> Dataset:
    """One row per task, for GRPO with `num_generations` = the episodes per task.

    Args:
        domain ([`~envs.retail.env.RetailDomain`]): the domain.
        num_tasks (`int`): rows, tasks `first_task .. first_task + num_tasks - 1`.
        first_task (`int`, *optional*, defaults to `0`): first task id (e.g. disjoint train and eval sets).
        conversational (`bool`, *optional*, defaults to `False`): `False` gives the text prompt of the offline
            protocol ([`AgentRolloutFunc`]); `True` gives messages (system = policy, user = opening) for hub models
            with tool-calling chat templates and [`~envs.retail.tool_env.RetailToolEnv`].

    Returns:
        [`~datasets.Dataset`]: columns `prompt` and `task_id`.
    """
    num_tasks = check_int("num_tasks", num_tasks, minimum=1)
    first_task = check_int("first_task", first_task, minimum=0)
    task_ids = list(range(first_task, first_task + num_tasks))
    if check_bool("conversational", conversational):
        prompts = [[{"role": "system", "content": domain.system_prompt},
                    {"role": "user", "content": domain.task(i).opening}] for i in task_ids]
    else:
        prompts = [domain.prompt(i) for i in task_ids]
    return Dataset.from_dict({"prompt": prompts, "task_id": task_ids})


class AgentRolloutFunc:
    """TRL's `rollout_func`: plays one episode of the retail domain per prompt with the trainer's model.

    Args:
        domain ([`~envs.retail.env.RetailDomain`]): the domain the dataset was built from.
        max_turns (`int`, *optional*, defaults to `8`): agent turns per episode.
        max_tokens (`int`, *optional*, defaults to `1024`): tokens per episode, prompt included.
        branching (`list[int]`, *optional*): tree rollouts: each prompt group's `num_generations` episodes played as a
            tree that branches at turn boundaries (`play_episodes`), e.g. `[2, 4]`: 2 episodes from the prompt, each
            copied 4 times (environment included) after `branch_turns` turns. The product must equal the trainer's
            `num_generations`; the domain's environments must implement `copy()` (refused at construction otherwise).
        branch_turns (`int`, *optional*, defaults to `1`): agent turns per level before each branch point.
        generation_cache (`bool`, *optional*, defaults to `True`): keep every episode's keys/values between turns
            (`envs.core.trl`); `False`: `model.generate` on every whole prefix.
        chat (`bool`, *optional*, defaults to `False`): play the protocol in the policy tokenizer's chat template
            ([`~envs.retail.chat_turns.ChatTurns`]: system message, a demonstration episode, chat-message replies), for
            pretrained chat models; `False`: the plain-text protocol of the embedded tiny model.

    Logs the rollout metrics of `envs.core.trl`, `dta/generated_tokens` (policy tokens sampled) and
    `dta/generated_tokens_independent` (the policy tokens of the returned episodes: what independent episodes would
    sample) next to TRL's metrics.
    """

    def __init__(self, domain: RetailDomain, *, max_turns: int = 8, max_tokens: int = 1024,
                 branching: list[int] | None = None, branch_turns: int = 1, generation_cache: bool = True,
                 chat: bool = False):
        self.domain = domain
        self.generation_cache = check_bool("generation_cache", generation_cache)
        self.chat = check_bool("chat", chat)
        self._chats: dict[int, ChatTurns] = {}
        self.max_turns = check_int("max_turns", max_turns, minimum=1)
        self.max_tokens = check_int("max_tokens", max_tokens, minimum=2)
        self.branching, self.branch_turns = check_branching(branching, branch_turns)
        if self.branching is not None:
            check_copyable(domain.episode(0, max_turns=self.max_turns))

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        if trainer.use_vllm:
            check_vllm_rollouts(trainer, "AgentRolloutFunc")
        task_ids = [self.domain.task_id_of(prompt) for prompt in prompts]
        tree = {}
        if self.branching is not None:
            group = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
            if math.prod(self.branching) != group:
                raise ValueError(
                    f"AgentRolloutFunc(branching={self.branching}) plays {math.prod(self.branching)} episodes per "
                    f"task, but the trainer expects {group} (`num_generations`): make them equal."
                )
            if len(task_ids) % group or any(task_ids[i] != task_ids[i - i % group] for i in range(len(task_ids))):
                raise ValueError(
                    f"tree rollouts need each task in {group} consecutive rows (TRL's sampler) and whole groups on "
                    "every process (`generation_batch_size / num_processes` a multiple of `num_generations`)."
                )
            task_ids = task_ids[::group]
            tree = dict(branching=self.branching, branch_turns=self.branch_turns)
        timings: dict = {}
        tokenizer = trainer.processing_class
        chat = self.chat_turns(tokenizer) if self.chat else None
        with rollout_meter(trainer, tokenizer, self.generation_cache) as meter:
            episodes = play_episodes(self.domain, task_ids, meter, tokenizer, max_turns=self.max_turns,
                                     max_turn_tokens=trainer.max_completion_length, max_tokens=self.max_tokens,
                                     timings=timings, chat=chat, **tree)
        metrics = meter.log(trainer, episodes, timings.get("reward_s", 0.0))
        # Policy tokens sampled vs the same episodes played independently (tree rollouts share their first turns).
        metrics["dta/generated_tokens"].append(float(meter.generated))
        metrics["dta/generated_tokens_independent"].append(float(sum(sum(e.env_mask) for e in episodes)))
        return episode_columns(episodes, episode_reward=[e.reward.reward for e in episodes],
                               success=[e.reward.success for e in episodes],
                               **{key: [getattr(e.reward, key) for e in episodes] for key in SHAPED_KEYS})

    def chat_turns(self, tokenizer) -> ChatTurns:
        """The [`~envs.retail.chat_turns.ChatTurns`] of `tokenizer` (made once per tokenizer)."""
        if id(tokenizer) not in self._chats:
            self._chats[id(tokenizer)] = ChatTurns(tokenizer, self.domain)
        return self._chats[id(tokenizer)]
