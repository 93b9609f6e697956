"""Offline agentic environments: a tau2-style retail customer-service domain and multi-turn rollouts for TRL.

The workload DTA exists for: multi-turn tool-use episodes that share a long system prompt (the policy document),
whose G rollouts per task share the task's opening, and whose per-turn training samples are nested prefixes of each
other. Everything runs offline with the tiny model of `trl_dta.demos.tiny`:

- `database`: users and orders, six tools that read and change them (`database.TOOLS`);
- `policy`: the policy document, the shared system prompt (its length configurable);
- `tasks`: procedurally generated scenarios with gold actions and required information;
- `user`: the scripted user simulator, ending calls with `(stop)`;
- `protocol`: the plain-text turn protocol (`say ...` / `call tool key=value ...`);
- `reward`: tau2's success criterion with a documented shaped partial credit;
- `env`: `RetailDomain` (database, policy, tasks) and `RetailEnv` (one episode in text);
- `rollout`: `play_episodes` (token ids, env mask, turn spans, reward per episode), `model_generate_fn` and
  `layout_sequences` (the episode and per-turn training sequences);
- `trl_rollout`: `build_dataset`, `AgentRolloutFunc` (TRL's `rollout_func`), `episode_reward` and the shaped
  rewards (`SHAPED_REWARDS`: well-formed turns, right tools, right arguments, outcome);
- `tool_env`: `RetailToolEnv` for TRL's `environment_factory` (hub models with tool-calling templates; not run
  offline).
"""

from .env import RetailDomain, RetailEnv
from .protocol import Call, Say, parse_turn
from .reward import RewardBreakdown
from .rollout import Episode, Generation, Turn, layout_sequences, model_generate_fn, play_episodes
from .tool_env import RetailToolEnv
from .trl_rollout import (
    SHAPED_REWARDS,
    AgentRolloutFunc,
    arguments_reward,
    build_dataset,
    episode_reward,
    format_reward,
    outcome_reward,
    tool_reward,
)

__all__ = [
    "SHAPED_REWARDS",
    "AgentRolloutFunc",
    "Call",
    "Episode",
    "Generation",
    "RetailDomain",
    "RetailEnv",
    "RetailToolEnv",
    "RewardBreakdown",
    "Say",
    "Turn",
    "build_dataset",
    "arguments_reward",
    "episode_reward",
    "format_reward",
    "layout_sequences",
    "model_generate_fn",
    "outcome_reward",
    "parse_turn",
    "play_episodes",
    "tool_reward",
]
