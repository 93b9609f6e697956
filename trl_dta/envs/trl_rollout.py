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
`prompt_ids + completion_ids`), `end_reason` and `success` are for reward functions and logs; the trainer cuts an
episode into turns from `env_mask` (TRL's `tool_mask`, `trl_dta.trainers.per_turn`), never from `turn_spans`.
Generation uses the trainer's policy as a generator (`trl_dta.trainers.generator`: the model
held as TRL holds it for generation, ZeRO-3 and FSDP parameters gathered as TRL gathers them) and the trainer's sampling
settings (`trainer.generation_config`: temperature, top-p, top-k, ...), with `max_completion_length` as the budget of
each *turn* (64 fits every gold call of the retail domain).

Generation reuses each episode's key/value cache between turns (`generation_cache=True`, the default:
[`~trl_dta.generation.CachedGenerate`]): the system prompt and each task's opening are prefilled once per rollout
and shared by the episodes' caches, and each turn forwards only the environment's reply and the sampled tokens; the
sampled turns are those `model.generate` on the whole prefixes would sample (`generation_cache=False`, the re-prefill
path). With `use_vllm=True` (`vllm_mode="colocate"`) the turns are sampled by TRL's colocated vLLM engine instead
([`~trl_dta.generation.VLLMGenerate`], its weights synced as TRL syncs them): one `generate` call per turn over the
unfinished episodes, each turn's earlier tokens served from vLLM's prefix cache. Logged next to TRL's metrics per
rollout (through `trainers/_trl.py`, the one reader of TRL's private state):
`dta/rollout_tokens` (tokens of the rollout's episodes, each episode once at its final length),
`dta/rollout_forward_tokens` (token positions the policy forwarded while generating, padding included; with vLLM by
its own counters: prompt tokens it computed plus the sampled tokens fed back), `dta/rollout_cached_tokens` (vLLM only:
prompt tokens its prefix cache served),
`dta/rollout_generation_s`, `dta/rollout_env_s` (tools, users) and `dta/rollout_reward_s` (the grader). TRL's own tool
loop (`environment_factory=`, `RetailToolEnv`) generates with TRL's `generate` calls: no cache reuse there.

An episode ends on an agent turn, so TRL's `mask_truncated_completions=True` drops every episode whose last turn did
not end with the end-of-turn token (one cut by `max_completion_length` or by the episode's `max_tokens`). vLLM's server
mode is refused (its calls are collective over processes, and episodes of different lengths would make them
diverge); colocated engines are each process's own.
"""

from __future__ import annotations

import contextlib
import math
import time

from datasets import Dataset

from .._checks import check_bool, check_int
from .chat_turns import ChatTurns
from .env import RetailDomain
from .rollout import check_branching, check_copyable, episode_columns, play_episodes


def check_vllm_rollouts(trainer, what: str) -> None:
    """`trl_dta.trainers.generator.check_vllm_rollouts` (imported when a rollout runs: envs/ sits above trainers/)."""
    from ..trainers.generator import check_vllm_rollouts as check

    check(trainer, what)


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
        generation_cache (`bool`, *optional*, defaults to `True`): keep every episode's keys/values between turns
            (see the module docstring); `False`: `model.generate` on every whole prefix.
        chat (`bool`, *optional*, defaults to `False`): play the protocol in the policy tokenizer's chat template
            ([`~envs.chat_turns.ChatTurns`]: system message, a demonstration episode, chat-message replies), for
            pretrained chat models; `False`: the plain-text protocol of the embedded tiny model.

    Logs the rollout metrics of the module docstring, `dta/generated_tokens` (policy tokens sampled) and
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
                               **{key: [getattr(e.reward, key) for e in episodes] for key in _SHAPED_KEYS})

    def chat_turns(self, tokenizer) -> ChatTurns:
        """The [`~envs.chat_turns.ChatTurns`] of `tokenizer` (made once per tokenizer)."""
        if id(tokenizer) not in self._chats:
            self._chats[id(tokenizer)] = ChatTurns(tokenizer, self.domain)
        return self._chats[id(tokenizer)]


class RolloutMeter:
    """The policy's [`~trl_dta.generation.Generator`] for one rollout, timed and counted (see [`rollout_meter`]).

    Attributes:
        generated (`int`): tokens sampled; generation_s (`float`): seconds in the policy's calls; start (`float`):
        `time.perf_counter()` at the start; stats: the generator's (`forward_tokens`: positions forwarded).
    """

    def __init__(self, generate):
        self.generate = generate
        self.generated, self.generation_s, self.start = 0, 0.0, time.perf_counter()

    @property
    def generation_config(self):
        return self.generate.generation_config

    @property
    def stats(self):
        return self.generate.stats

    def __call__(self, prefixes, max_new_tokens, **kwargs):
        start = time.perf_counter()
        outputs = self.generate(prefixes, max_new_tokens, **kwargs)
        self.generation_s += time.perf_counter() - start
        self.generated += sum(len(g.ids) for g in outputs)
        return outputs

    def log(self, trainer, episodes, reward_s: float):
        """Appends the rollout metrics (module docstring) to the trainer's metrics of its mode; returns them."""
        from ..trainers._trl import metrics as trl_metrics  # TRL's private state is read there only

        metrics = trl_metrics(trainer)
        total = time.perf_counter() - self.start
        metrics["dta/rollout_tokens"].append(float(sum(len(e.ids) for e in episodes)))
        metrics["dta/rollout_forward_tokens"].append(float(self.stats.forward_tokens))
        if self.stats.cached_tokens is not None:  # vLLM's own count of the prompt tokens its prefix cache served
            metrics["dta/rollout_cached_tokens"].append(float(self.stats.cached_tokens))
        metrics["dta/rollout_generation_s"].append(self.generation_s)
        metrics["dta/rollout_reward_s"].append(reward_s)
        metrics["dta/rollout_env_s"].append(max(0.0, total - self.generation_s - reward_s))
        return metrics


@contextlib.contextmanager
def rollout_meter(trainer, tokenizer, generation_cache: bool):
    """The trainer's policy as a generator (`trl_dta.trainers.generator.policy_generator`: unwrapped as TRL does, with
    the trainer's sampling settings; [`~trl_dta.generation.CachedGenerate`] or the re-prefill path), in a
    [`RolloutMeter`]."""
    from ..trainers.generator import policy_generator

    with policy_generator(trainer, tokenizer, cache=generation_cache) as generator:
        yield RolloutMeter(generator)


def _column(name: str, completions: list, values: list | None) -> list[float]:
    if values is None or len(values) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {0 if values is None else len(values)} values of "
                         f"`{name}`; use this reward function together with `AgentRolloutFunc` (or `Tau2RolloutFunc`).")
    return [float(v) for v in values]


def episode_reward(completions: list, episode_reward: list[float] | None = None, **kwargs) -> list[float]:
    """TRL reward function: the reward each episode earned (the `episode_reward` key of [`AgentRolloutFunc`])."""
    return _column("episode_reward", completions, episode_reward)


def format_reward(completions: list, call_format: list[float] | None = None, **kwargs) -> list[float]:
    """Shaped reward: well-formed tool calls (the mean call format of the episode's turns, `envs.reward`)."""
    return _column("call_format", completions, call_format)


def tool_reward(completions: list, tools: list[float] | None = None, **kwargs) -> list[float]:
    """Shaped reward: the right tools (`envs.reward.tool_credit`: how much of each gold tool's name a call named)."""
    return _column("tools", completions, tools)


def arguments_reward(completions: list, arguments: list[float] | None = None, **kwargs) -> list[float]:
    """Shaped reward: the right arguments (`envs.reward.argument_credit`)."""
    return _column("arguments", completions, arguments)


def outcome_reward(completions: list, success: list | None = None, **kwargs) -> list[float]:
    """The task's outcome: 1 when tau2's criterion holds (database and information), else 0."""
    return _column("success", completions, success)


_SHAPED_KEYS = ("call_format", "tools", "arguments")
# TRL's `reward_funcs` and `reward_weights` of the shaped reward: weights sum to 1, so TRL's logged `reward` (their
# weighted sum) is on a 0-1 scale, and each function's mean is logged as `rewards/<name>/mean`.
SHAPED_REWARDS = ([format_reward, tool_reward, arguments_reward, outcome_reward], [0.4, 0.3, 0.2, 0.1])
