"""The bridge to TRL, any domain: the columns a `rollout_func` returns, the policy it samples with (timed and
counted), and TRL's reward functions over those columns.

TRL 1.16's `GRPOTrainer(rollout_func=...)` calls `rollout_func(prompts, trainer)` with the prompts of this process
(each prompt already repeated `num_generations` times, one completion expected per row) and takes back
`prompt_ids`, `completion_ids` and `logprobs` per row; an `env_mask` (1 = policy token) becomes its `tool_mask`, so
user and tool tokens stay out of the loss; every other key is handed to the reward functions, row by row. A domain's
`rollout_func` (the stand-in's `envs.retail.trl.AgentRolloutFunc`, tau2's `envs.tau2.trl.Tau2RolloutFunc`) plays
its episodes and returns [`episode_columns`]: `prompt_ids` is the episode's prompt and `completion_ids` the rest of
the conversation (the "episode" layout); the extra keys `turn_spans` (`[[start, end], ...]`, positions of the agent
turns in `prompt_ids + completion_ids`) and `end_reason` are for reward functions and logs, beside the domain's
rewards; the trainer cuts an episode into turns from `env_mask` (TRL's `tool_mask`, `trl_dta.trainers.per_turn`),
never from `turn_spans`. Generation uses the trainer's policy as a generator (`trl_dta.trainers.generator`: the model
held as TRL holds it for generation, ZeRO-3 and FSDP parameters gathered as TRL gathers them) and the trainer's
sampling settings (`trainer.generation_config`: temperature, top-p, top-k, ...), with `max_completion_length` as the
budget of each *turn* ([`rollout_meter`]).

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
loop (`environment_factory=`: `RetailToolEnv`, `tau2_tool_env`) generates with TRL's `generate` calls: no cache reuse
there.

An episode ends on an agent turn, so TRL's `mask_truncated_completions=True` drops every episode whose last turn did
not end with the end-of-turn token (one cut by `max_completion_length` or by the episode's `max_tokens`). vLLM's server
mode is refused (its calls are collective over processes, and episodes of different lengths would make them
diverge); colocated engines are each process's own.

TRL's reward functions read a column each: [`episode_reward`] (the stand-in's single shaped reward) and the shaped
rewards [`SHAPED_REWARDS`] (well-formed calls, right tools, right arguments, the outcome; the credits in
`credits.py`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

from .rollout import Episode


def check_vllm_rollouts(trainer, what: str) -> None:
    """`trl_dta.trainers.generator.check_vllm_rollouts` (imported when a rollout runs: envs/ sits above trainers/)."""
    from ...trainers.generator import check_vllm_rollouts as check

    check(trainer, what)


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
        from ...trainers._trl import metrics as trl_metrics  # TRL's private state is read there only

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
    from ...trainers.generator import policy_generator

    with policy_generator(trainer, tokenizer, cache=generation_cache) as generator:
        yield RolloutMeter(generator)


def episode_columns(episodes: Sequence[Episode], **extra: list) -> dict[str, list]:
    """TRL's `rollout_func` output for played episodes, any domain (the episode layout; DTA's `per_turn` cuts it by
    turns): prompt / completion ids, sampling log-probs (zeros where the generator gave none), `env_mask`, the turn
    spans and end reasons, plus the domain's own `extra` columns (its rewards), one value per episode."""
    return {
        "prompt_ids": [e.ids[:e.prompt_length] for e in episodes],
        "completion_ids": [e.ids[e.prompt_length:] for e in episodes],
        "logprobs": [e.logprobs[e.prompt_length:] if e.logprobs is not None else [0.0] * (len(e.ids) - e.prompt_length)
                     for e in episodes],
        "env_mask": [e.env_mask[e.prompt_length:] for e in episodes],
        **extra,
        "turn_spans": [[[t.start, t.end] for t in e.turns] for e in episodes],
        "end_reason": [e.end_reason for e in episodes],
    }


def _column(name: str, completions: list, values: list | None) -> list[float]:
    if values is None or len(values) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {0 if values is None else len(values)} values of "
                         f"`{name}`; use this reward function together with `AgentRolloutFunc` (or `Tau2RolloutFunc`).")
    return [float(v) for v in values]


def episode_reward(completions: list, episode_reward: list[float] | None = None, **kwargs) -> list[float]:
    """TRL reward function: the reward each episode earned (the `episode_reward` key of the stand-in's
    `AgentRolloutFunc`)."""
    return _column("episode_reward", completions, episode_reward)


def format_reward(completions: list, call_format: list[float] | None = None, **kwargs) -> list[float]:
    """Shaped reward: well-formed tool calls (the mean call format of the episode's turns)."""
    return _column("call_format", completions, call_format)


def tool_reward(completions: list, tools: list[float] | None = None, **kwargs) -> list[float]:
    """Shaped reward: the right tools (`credits.tool_credit`: how much of each gold tool's name a call named)."""
    return _column("tools", completions, tools)


def arguments_reward(completions: list, arguments: list[float] | None = None, **kwargs) -> list[float]:
    """Shaped reward: the right arguments (`credits.argument_credit`)."""
    return _column("arguments", completions, arguments)


def outcome_reward(completions: list, success: list | None = None, **kwargs) -> list[float]:
    """The task's outcome: 1 when tau2's criterion holds (database and information), else 0."""
    return _column("success", completions, success)


SHAPED_KEYS = ("call_format", "tools", "arguments")
"""The rollout columns of the shaped credits, besides `success`: a domain's `rollout_func` returns each."""
# TRL's `reward_funcs` and `reward_weights` of the shaped reward: weights sum to 1, so TRL's logged `reward` (their
# weighted sum) is on a 0-1 scale, and each function's mean is logged as `rewards/<name>/mean`.
SHAPED_REWARDS = ([format_reward, tool_reward, arguments_reward, outcome_reward], [0.4, 0.3, 0.2, 0.1])
