"""What every environment shares, domain-free: the multi-turn rollout loop, chat-template turns, the bridge to TRL
and the shaped credits.

- `rollout`: [`Session`] (one episode as token ids in, token ids out), [`run_sessions`] (the loop, episodes in
  lockstep, tree rollouts included), [`play_tasks`] (the episode set-up every domain shares: sessions per task, the
  loop, the grading), [`Episode`], [`Turn`] and [`layout_sequences`] (the episode and per-turn training sequences);
- `chat`: [`ChatRenderer`] (a conversation in the policy's chat template, a generated turn read back as a message)
  and [`build_chat_tokenizer`] (the offline byte-level tokenizer with one of TRL's chat templates);
- `trl`: [`episode_columns`] (TRL's `rollout_func` output), [`rollout_meter`] (the trainer's policy as a generator,
  timed and counted) and TRL's reward functions over the columns ([`episode_reward`], [`SHAPED_REWARDS`]);
- `credits`: [`tool_credit`] and [`argument_credit`], the shaped credits of `(tool, arguments)` calls.
"""

from .chat import ChatRenderer, build_chat_tokenizer, ensure_tool_template
from .credits import argument_credit, tool_credit
from .rollout import CopyableEnv, Episode, Session, Turn, layout_sequences, play_tasks, run_sessions
from .trl import (
    SHAPED_REWARDS,
    RolloutMeter,
    arguments_reward,
    episode_columns,
    episode_reward,
    format_reward,
    outcome_reward,
    rollout_meter,
    tool_reward,
)

__all__ = [
    "SHAPED_REWARDS",
    "ChatRenderer",
    "CopyableEnv",
    "Episode",
    "RolloutMeter",
    "Session",
    "Turn",
    "argument_credit",
    "arguments_reward",
    "build_chat_tokenizer",
    "ensure_tool_template",
    "episode_columns",
    "episode_reward",
    "format_reward",
    "layout_sequences",
    "outcome_reward",
    "play_tasks",
    "rollout_meter",
    "run_sessions",
    "tool_credit",
    "tool_reward",
]
