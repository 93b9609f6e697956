"""The bridge to TRL: a dataset of task prompts, a `rollout_func` that plays episodes, and the reward function.

TRL 1.16's `GRPOTrainer(rollout_func=...)` calls `rollout_func(prompts, trainer)` with the prompts of this process
(each prompt already repeated `num_generations` times, one completion expected per row) and takes back
`prompt_ids`, `completion_ids` and `logprobs` per row; an `env_mask` (1 = policy token) becomes its `tool_mask`, so
user and tool tokens stay out of the loss; every other key is handed to the reward functions, row by row:

```python
domain = RetailDomain()
trainer = GRPOTrainer(model=model, processing_class=tokenizer, train_dataset=build_dataset(domain, 64),
                      rollout_func=AgentRolloutFunc(domain), reward_funcs=episode_reward, args=GRPOConfig(...))
```

Here `prompt_ids` is the episode's prompt and `completion_ids` the rest of the conversation (the "episode" layout).
The extra keys `episode_reward` (`float`), `turn_spans` (`[[start, end], ...]`, positions of the agent turns in
`prompt_ids + completion_ids`), `end_reason` and `success` carry what a per-turn layout needs to cut an episode into
one sample per turn. Generation uses the trainer's model through TRL's `unwrap_model_for_generation` and the
trainer's sampling settings (`trainer.generation_config`: temperature, top-p, top-k, ...), with
`max_completion_length` as the budget of each *turn* (64 fits every gold call of the retail domain).

An episode ends on an agent turn, so TRL's `mask_truncated_completions=True` drops every episode whose last turn did
not end with the end-of-turn token (one cut by `max_completion_length` or by the episode's `max_tokens`). TRL's vLLM
path is refused: its generation calls are collective over processes, and episodes of different lengths would make
them diverge; it cannot be tested offline either.
"""

from __future__ import annotations

import math

from datasets import Dataset

from .._checks import check_bool, check_int
from .env import RetailDomain
from .rollout import check_branching, check_copyable, episode_columns, model_generate_fn, play_episodes


def build_dataset(
    domain: RetailDomain, num_tasks: int, *, first_task: int = 0, conversational: bool = False
) -> Dataset:
    """One row per task, for GRPO with `num_generations` = the episodes per task.

    Args:
        domain ([`~envs.env.RetailDomain`]): the domain.
        num_tasks (`int`): rows, tasks `first_task .. first_task + num_tasks - 1`.
        first_task (`int`, *optional*, defaults to `0`): first task id (e.g. disjoint train and eval sets).
        conversational (`bool`, *optional*, defaults to `False`): `False` gives the text prompt of the offline
            protocol ([`AgentRolloutFunc`]); `True` gives messages (system = policy, user = opening) for hub models
            with tool-calling chat templates and [`~envs.tool_env.RetailToolEnv`].

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
        domain ([`~envs.env.RetailDomain`]): the domain the dataset was built from.
        max_turns (`int`, *optional*, defaults to `8`): agent turns per episode.
        max_tokens (`int`, *optional*, defaults to `1024`): tokens per episode, prompt included.
        branching (`list[int]`, *optional*): tree rollouts: each prompt group's `num_generations` episodes played as a
            tree that branches at turn boundaries (`play_episodes`), e.g. `[2, 4]`: 2 episodes from the prompt, each
            copied 4 times (environment included) after `branch_turns` turns. The product must equal the trainer's
            `num_generations`; the domain's environments must implement `copy()` (refused at construction otherwise).
        branch_turns (`int`, *optional*, defaults to `1`): agent turns per level before each branch point.

    Logs `dta/generated_tokens` (policy tokens sampled) and `dta/generated_tokens_independent` (the policy tokens of
    the returned episodes: what independent episodes would sample) next to TRL's metrics.
    """

    def __init__(self, domain: RetailDomain, *, max_turns: int = 8, max_tokens: int = 1024,
                 branching: list[int] | None = None, branch_turns: int = 1):
        self.domain = domain
        self.max_turns = check_int("max_turns", max_turns, minimum=1)
        self.max_tokens = check_int("max_tokens", max_tokens, minimum=2)
        self.branching, self.branch_turns = check_branching(branching, branch_turns)
        if self.branching is not None:
            check_copyable(domain.episode(0, max_turns=self.max_turns))

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        from trl.models.utils import unwrap_model_for_generation

        if trainer.use_vllm:
            raise ValueError(
                "AgentRolloutFunc generates with the trainer's model; set `use_vllm=False` (vLLM's collective "
                "generation calls do not fit episodes of different lengths)."
            )
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
        with unwrap_model_for_generation(
            trainer.model_wrapped, trainer.accelerator, gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=trainer.generation_kwargs,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as model:
            sample = model_generate_fn(model, trainer.processing_class, trainer.generation_config)
            generated = [0]

            def generate(prefixes, max_new_tokens):
                outputs = sample(prefixes, max_new_tokens)
                generated[0] += sum(len(g.ids) for g in outputs)
                return outputs

            episodes = play_episodes(self.domain, task_ids, generate, trainer.processing_class,
                                     max_turns=self.max_turns, max_turn_tokens=trainer.max_completion_length,
                                     max_tokens=self.max_tokens, **tree)
        # Policy tokens sampled vs the same episodes played independently (tree rollouts share their first turns).
        metrics = trainer._metrics["train" if trainer.model.training else "eval"]
        metrics["dta/generated_tokens"].append(float(generated[0]))
        metrics["dta/generated_tokens_independent"].append(float(sum(sum(e.env_mask) for e in episodes)))
        return episode_columns(episodes, episode_reward=[e.reward.reward for e in episodes],
                               success=[e.reward.success for e in episodes])


def episode_reward(completions: list, episode_reward: list[float], **kwargs) -> list[float]:
    """TRL reward function: the reward each episode earned (the `episode_reward` key of [`AgentRolloutFunc`])."""
    if len(episode_reward) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(episode_reward)} episode rewards; use "
                         "`episode_reward` together with `AgentRolloutFunc`.")
    return [float(r) for r in episode_reward]
