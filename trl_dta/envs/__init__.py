"""Agentic environments for TRL, by domain: multi-turn tool-use episodes that share a long system prompt (the policy
document), whose G rollouts per task share the task's opening, and whose per-turn training samples are nested prefixes
of each other: the workload DTA exists for.

- `core/`: what every domain shares: the rollout loop (`Session`, `run_sessions`, `play_tasks`, `Episode`,
  `layout_sequences`), chat-template turns (`ChatRenderer`), the bridge to TRL (`episode_columns`, the rollout metrics,
  the reward functions `episode_reward` and `SHAPED_REWARDS`) and the shaped credits;
- `retail/`: the offline stand-in, a tau2-style retail domain (`RetailDomain`, `RetailEnv`, `play_episodes`,
  `build_dataset`, `AgentRolloutFunc`, `RetailToolEnv`), played by the embedded tiny model;
- `tau2/`: tau2-bench's real domains (`trl-dta[tau2]`, imported only from `trl_dta.envs.tau2`).

The names below are the public ones of `core/` and `retail/`; a domain imports `core/` only, never another domain.
"""

from .core import (
    SHAPED_REWARDS,
    Episode,
    Turn,
    arguments_reward,
    episode_reward,
    format_reward,
    layout_sequences,
    outcome_reward,
    tool_reward,
)
from .retail import (
    AgentRolloutFunc,
    Call,
    RetailDomain,
    RetailEnv,
    RetailToolEnv,
    RewardBreakdown,
    Say,
    build_dataset,
    parse_turn,
    play_episodes,
)

__all__ = [
    "SHAPED_REWARDS",
    "AgentRolloutFunc",
    "Call",
    "Episode",
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
    "outcome_reward",
    "parse_turn",
    "play_episodes",
    "tool_reward",
]
