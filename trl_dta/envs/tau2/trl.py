"""The bridge to TRL for tau2 domains: a dataset of task prompts, a `rollout_func` that plays whole episodes with the
offline (or an LLM) user, and the reward function.

```python
domain = Tau2Domain("airline")
tokenizer = ...  # a chat model's tokenizer; offline: trl_dta.envs.core.chat.build_chat_tokenizer()
trainer = DTAGRPOTrainer(model=model, processing_class=tokenizer, train_dataset=build_tau2_dataset(domain),
                         rollout_func=Tau2RolloutFunc(domain), reward_funcs=tau2_reward,
                         args=DTAGRPOConfig(dta_sample_layout="per_turn", ...))
```

[`Tau2RolloutFunc`] is the stand-in domain's `AgentRolloutFunc` for tau2: the same TRL contract (`prompt_ids`,
`completion_ids`, `logprobs`, `env_mask` = TRL's `tool_mask`: tool results and user messages are out of the loss)
and the same generation (the trainer's model and sampling settings, `max_completion_length` per *turn*; with
`use_vllm=True`, TRL's colocated vLLM engine, each turn's earlier tokens from its prefix cache), with episodes in the
policy's chat template (`envs.tau2.episode`). The extra keys reach the reward functions:
`tau2_reward` (`float`, tau2's evaluator), `turn_spans`, `end_reason`.

Where the environment's own tool loop is wanted instead (TRL's `tools` machinery), use
`environment_factory=tau2_tool_env(domain)` with [`build_tau2_dataset`] and `tau2_tool_reward` (no user turns there).
"""

from __future__ import annotations

from datasets import Dataset

from ..._checks import check_bool, check_int
from ..core.chat import ChatRenderer
from ..core.trl import SHAPED_KEYS, check_vllm_rollouts, rollout_meter
from ..core.trl import episode_columns as rollout_columns
from .domain import Tau2Domain
from .episode import play_tau2_episodes
from .user import ScriptedUser


def build_tau2_dataset(domain: Tau2Domain, task_ids=None, *, seed: int = 0, demonstration=()) -> Dataset:
    """One row per task: `prompt` (system prompt + the user's first message, as chat messages) and `task_id`.

    Args:
        domain ([`Tau2Domain`]): the domain (its `task_split` chooses the split).
        task_ids (`list[str]`, *optional*): a subset of the domain's task ids, in order; defaults to all.
        seed (`int`, *optional*, defaults to `0`): the scripted users' seed (it fixes each opening).
        demonstration (`list[dict]`, *optional*): chat messages between the system prompt and the opening
            (`envs.tau2.episode.gold_demonstration`), as [`Tau2RolloutFunc`]`(demonstration=...)` plays them.

    Returns:
        [`~datasets.Dataset`]: columns `prompt` and `task_id` (`str`, tau2's id).
    """
    task_ids = list(domain.task_ids if task_ids is None else task_ids)
    prompts = [[{"role": "system", "content": domain.system_prompt}, *demonstration,
                {"role": "user", "content": ScriptedUser(domain.task(t), seed).opening}] for t in task_ids]
    return Dataset.from_dict({"prompt": prompts, "task_id": task_ids})


class Tau2RolloutFunc:
    """TRL's `rollout_func`: plays one tau2 episode per input row with the trainer's model.

    Args:
        domain ([`Tau2Domain`]): the domain the dataset was built from.
        seed (`int`, *optional*, defaults to `0`): the scripted users' seed (as given to [`build_tau2_dataset`]).
        user_factory (*optional*): `user_factory(task) -> user`; defaults to the offline [`ScriptedUser`].
        max_turns (`int`, *optional*, defaults to `16`): policy turns per episode.
        max_tokens (`int`, *optional*, defaults to `32768`): tokens per episode, prompt included.
        generation_cache (`bool`, *optional*, defaults to `True`): keep every episode's keys/values between turns, the
            system prompt and each task's opening prefilled once per rollout (`trl_dta.envs.core.trl`); `False`:
            `model.generate` on every whole prefix. Logs the same rollout metrics as `AgentRolloutFunc`.
        demonstration (`list[dict]`, *optional*): chat messages shown before every opening (a small model's
            example of the tool-call format: `envs.tau2.episode.gold_demonstration`).

    The trainer's dataset rows carry `task_id`; TRL hands `rollout_func` the prompts only, so the task is found from
    the prompt's opening (each task's opening is unique within a domain and seed; a clash raises at construction).
    """

    def __init__(self, domain: Tau2Domain, *, seed: int = 0, user_factory=None, max_turns: int = 16,
                 max_tokens: int = 32768, generation_cache: bool = True, demonstration=()):
        self.domain, self.seed, self.user_factory = domain, seed, user_factory
        self.demonstration = list(demonstration)
        self.generation_cache = check_bool("generation_cache", generation_cache)
        self.max_turns = check_int("max_turns", max_turns, minimum=1)
        self.max_tokens = check_int("max_tokens", max_tokens, minimum=2)
        self._by_opening: dict[str, str] = {}
        for task in domain.tasks:
            opening = ScriptedUser(task, seed).opening
            self._by_opening.setdefault(opening, task.id)
        self._renderers: dict[int, ChatRenderer] = {}

    def task_id_of(self, prompt) -> str:
        opening = prompt[-1]["content"] if isinstance(prompt, list) and prompt else None
        if opening not in self._by_opening:
            raise ValueError("the prompt was not made by `build_tau2_dataset` for this domain and seed (its last "
                             "user message is no task's opening).")
        return self._by_opening[opening]

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        if trainer.use_vllm:
            check_vllm_rollouts(trainer, "Tau2RolloutFunc")
        tokenizer = trainer.processing_class
        if id(tokenizer) not in self._renderers:
            self._renderers[id(tokenizer)] = ChatRenderer(tokenizer, self.domain.tool_schemas)
        renderer = self._renderers[id(tokenizer)]
        task_ids = [self.task_id_of(prompt) for prompt in prompts]
        timings: dict = {}
        with rollout_meter(trainer, renderer.tokenizer, self.generation_cache) as meter:
            episodes = play_tau2_episodes(self.domain, task_ids, meter, renderer, seed=self.seed,
                                          user_factory=self.user_factory, max_turns=self.max_turns,
                                          max_turn_tokens=trainer.max_completion_length, max_tokens=self.max_tokens,
                                          timings=timings, demonstration=self.demonstration)
        meter.log(trainer, episodes, timings.get("reward_s", 0.0))
        return episode_columns(episodes)


def episode_columns(episodes) -> dict[str, list]:
    """TRL's `rollout_func` output for played tau2 episodes: tau2's reward of each (`tau2_reward`, and as `success`
    for `outcome_reward`) and the shaped credits (`call_format`, `tools`, `arguments`:
    `envs.core.trl.SHAPED_REWARDS`)."""
    shaped = {key: [e.shaped[key] for e in episodes] for key in SHAPED_KEYS}
    rewards = [float(e.reward.reward) for e in episodes]
    return rollout_columns(episodes, tau2_reward=rewards, success=rewards, **shaped)


def tau2_reward(completions: list, tau2_reward: list[float], **kwargs) -> list[float]:
    """TRL reward function: tau2's reward of each episode (the `tau2_reward` key of [`Tau2RolloutFunc`])."""
    if len(tau2_reward) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(tau2_reward)} tau2 rewards; use `tau2_reward` "
                         "together with `Tau2RolloutFunc`.")
    return [float(r) for r in tau2_reward]
