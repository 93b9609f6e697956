"""The offline stand-in: a tau2-style retail customer-service domain, played by the embedded tiny model
(`trl_dta.demos.tiny`) or a pretrained chat model, no extra dependency.

- `database`: users and orders, six tools that read and change them (`database.TOOLS`);
- `policy_document`: the policy document, the shared system prompt (its length configurable);
- `tasks`: procedurally generated scenarios with gold actions and required information;
- `user`: the scripted user simulator, ending calls with `(stop)`;
- `protocol`: the plain-text turn protocol (`say ...` / `call tool key=value ...`);
- `reward`: tau2's success criterion with a documented shaped partial credit;
- `env`: [`RetailDomain`] (database, policy, tasks) and [`RetailEnv`] (one episode in text);
- `chat_turns`: the protocol in a chat model's template ([`ChatTurns`]);
- `episode`: [`play_episodes`], the domain's episodes on the shared loop (`envs.core.rollout`);
- `trl`: [`build_dataset`] and [`AgentRolloutFunc`] (TRL's `rollout_func`);
- `tool_env`: [`RetailToolEnv`] for TRL's `environment_factory` (hub models with tool-calling templates; not run
  offline).
"""

from .chat_turns import ChatTurns
from .env import RetailDomain, RetailEnv
from .episode import play_episodes
from .protocol import Call, Say, parse_turn
from .reward import RewardBreakdown
from .tool_env import RetailToolEnv
from .trl import AgentRolloutFunc, build_dataset

__all__ = ["AgentRolloutFunc", "Call", "ChatTurns", "RetailDomain", "RetailEnv", "RetailToolEnv", "RewardBreakdown",
           "Say", "build_dataset", "parse_turn", "play_episodes"]
