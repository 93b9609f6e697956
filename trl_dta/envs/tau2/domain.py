"""A tau2-bench domain: its tasks, the agent's system prompt and tools, a fresh database per episode, and tau2's grader.

[`Tau2Domain`] wraps what tau2 registers for a domain (`airline`, `retail`, `telecom`, `mock`):

```
registry.get_env_constructor(name)()   -> Environment: policy, agent tools (+ user tools in telecom), database
registry.get_tasks_loader(name)(split) -> Task: user_scenario, initial_state, evaluation_criteria
evaluate_simulation(run, task, ...)    -> RewardInfo: DB hash vs. the gold actions' DB, env assertions, gold
                                          actions, communicated info, (NL assertions: an LLM judge)
```

The agent's system prompt is tau2's own (`tau2.agent.llm_agent.SYSTEM_PROMPT`: the agent instruction and the domain
policy); the tool schemas are the tools' `openai_schema`, shown by the chat template. An episode's conversation is
kept as tau2 messages (assistant, user, tool), the trajectory tau2's evaluator replays: it rebuilds the database from
the trajectory's tool calls and compares it with the database the task's gold actions produce, and multiplies the
checks of the task's `reward_basis`. Natural-language assertions need an LLM judge: with `nl_assertions=False` (the
default, offline) a task whose basis holds `NL_ASSERTION` is graded on the rest of its basis, with one warning naming
what is skipped. (In tau2 26.3 no airline, retail or telecom task has `NL_ASSERTION` in its basis.) Some of tau2's
env assertions raise instead of failing when the state they query is missing (mock's `assert_task_status` on a task
the agent never created): such an episode scores 0, with one warning.

Cost. tau2's environment constructors parse the domain's database file on every call (airline 0.28 s, retail 0.17 s
on a quiet CPU), and tau2's evaluator builds two environments per episode (the episode's replay and the gold
actions'), on top of the episode's own. [`CopyingConstructor`] loads each database once per process and copies it
for every environment (a pydantic `model_validate` of a kept `model_dump`: airline 0.07 s); it is registered in
tau2's registry as `<domain>@trl_dta` (an added name, tau2's own entries untouched), which episodes and tau2's
`evaluate_simulation` use, so the grading code is tau2's. What remains per episode is what tau2's evaluator needs: the
two replays and their database hashes (`benchmarks/RESULTS.md`).
"""

from __future__ import annotations

import copy
import inspect
import json
from datetime import datetime, timezone

from ..._checks import check_bool, check_int, warn_once
from ._seam import tau2_modules

DOMAINS = ("airline", "retail", "telecom", "mock")
GREETING = "Hi! How can I help you today?"  # tau2's first agent message (orchestrator.DEFAULT_FIRST_AGENT_MESSAGE)
# tau2's termination reasons that its evaluator grades; every other one scores 0.
GRADED_ENDS = ("user_stop", "agent_stop")


class CopyingConstructor:
    """tau2's environment constructor of a domain with its database(s) loaded once and copied per environment.

    Args:
        constructor: tau2's `get_environment` of the domain (`db=`, and for telecom `user_db=`, `solo_mode=`).
    """

    def __init__(self, constructor):
        self.constructor = constructor
        env = constructor()
        self._db = type(env.tools.db), env.tools.db.model_dump()
        user = getattr(env, "user_tools", None)
        takes_user_db = "user_db" in inspect.signature(constructor).parameters
        self._user_db = (type(user.db), user.db.model_dump()) if takes_user_db and user is not None else None

    def __call__(self, solo_mode: bool = False, **kwargs):
        kwargs["db"] = self._db[0].model_validate(self._db[1])
        if self._user_db is not None:
            kwargs["user_db"] = self._user_db[0].model_validate(self._user_db[1])
        return self.constructor(solo_mode=solo_mode, **kwargs)


def copying_domain(name: str) -> str:
    """The name under which tau2's registry holds `name`'s [`CopyingConstructor`] (registered on first use)."""
    registry = tau2_modules().registry
    fast = f"{name}@trl_dta"
    if fast not in registry.get_domains():
        registry.register_domain(CopyingConstructor(registry.get_env_constructor(name)), fast)
    return fast


class Tau2Domain:
    """One tau2-bench domain, loaded once and shared by all of its episodes.

    Args:
        name (`str`): one of `DOMAINS`.
        task_split (`str`, *optional*): a split of the domain's tasks (`Tau2Domain.splits(name)`: airline, retail and
            telecom have `base`, `train` and `test`); defaults to all of tau2's default task set.
        nl_assertions (`bool`, *optional*, defaults to `False`): grade natural-language assertions with tau2's LLM
            judge (litellm; needs an endpoint and tau2's judge configuration). Off: skipped, with one warning.
        policy_chars (`int`, *optional*): cut the domain policy to its first `policy_chars` characters (for tests
            that are not about the prompt). Defaults to the whole policy.
    """

    def __init__(self, name: str, task_split: str | None = None, nl_assertions: bool = False,
                 policy_chars: int | None = None):
        if name not in DOMAINS:
            raise ValueError(f"`name` must be one of {DOMAINS}, got {name!r}.")
        t = tau2_modules()
        self.name = name
        self.nl_assertions = check_bool("nl_assertions", nl_assertions)
        self.registered = copying_domain(name)  # what episodes and tau2's evaluator construct from
        self.env_constructor = t.registry.get_env_constructor(self.registered)
        loader = t.registry.get_tasks_loader(name)
        if task_split is not None and task_split not in self.splits(name):
            raise ValueError(f"domain {name!r} has task splits {sorted(self.splits(name))}, got "
                             f"`task_split={task_split!r}`.")
        self.tasks = loader(task_split) if task_split is not None else loader()
        self._by_id = {task.id: task for task in self.tasks}
        self.environment = self.env_constructor()  # the template: policy and tool schemas
        policy = self.environment.get_policy()
        if policy_chars is not None:
            policy = policy[:check_int("policy_chars", policy_chars, minimum=1)]
        self.policy = policy
        self.system_prompt = t.llm_agent.SYSTEM_PROMPT.format(domain_policy=policy,
                                                              agent_instruction=t.llm_agent.AGENT_INSTRUCTION)
        self.tool_schemas = [tool.openai_schema for tool in self.environment.get_tools()]

    @staticmethod
    def splits(name: str) -> dict[str, list[str]]:
        """The task splits tau2 defines for domain `name` (`{}` when it has none)."""
        loader = tau2_modules().registry.get_task_splits_loader(name)
        return loader() if loader is not None else {}

    @property
    def task_ids(self) -> list[str]:
        return [task.id for task in self.tasks]

    def task(self, task_id: str):
        """tau2's `Task` with id `task_id`."""
        if task_id not in self._by_id:
            raise ValueError(f"domain {self.name!r} has no task {task_id!r}; its tasks are {self.task_ids[:5]}...")
        return self._by_id[task_id]

    def new_environment(self, task):
        """A fresh tau2 `Environment` (its own database) in the task's initial state."""
        env = self.env_constructor()
        state = task.initial_state
        if state is not None:
            env.set_state(initialization_data=state.initialization_data,
                          initialization_actions=state.initialization_actions,
                          message_history=state.message_history or [])
        return env

    @staticmethod
    def copy_environment(env):
        """An independent tau2 `Environment` in `env`'s current state, for tree rollouts that branch an episode.

        A tau2 environment's state is its toolkits' databases (`env.tools.db`, and `env.user_tools.db` where the user
        has tools, as in telecom); the rest (policy, tool definitions) is shared. Each database is rebuilt from its
        dump (`model_validate(model_dump())`: the same `get_hash()`, about 6x faster than `copy.deepcopy` on airline's).
        """
        twin = copy.copy(env)
        for kit in ("tools", "user_tools"):
            toolkit = getattr(env, kit, None)
            if toolkit is not None and getattr(toolkit, "db", None) is not None:
                toolkit = copy.copy(toolkit)
                toolkit.db = type(toolkit.db).model_validate(toolkit.db.model_dump())
                setattr(twin, kit, toolkit)
        return twin

    def initial_messages(self, task) -> list:
        """The task's message history from its initial state (tau2 messages, usually none)."""
        return list(task.initial_state.message_history or []) if task.initial_state is not None else []

    def evaluate(self, task, messages: list, termination_reason: str):
        """tau2's `evaluate_simulation` over one episode.

        Args:
            task: tau2's `Task`.
            messages (`list`): the episode's tau2 messages (assistant, user, tool), the initial history included.
            termination_reason (`str`): a tau2 `TerminationReason` value; only `GRADED_ENDS` can score above 0.

        Returns:
            tau2's `RewardInfo` (`.reward` in `[0, 1]`, `.reward_breakdown`, the checks).
        """
        t = tau2_modules()
        criteria = task.evaluation_criteria
        nl = t.tasks.RewardType.NL_ASSERTION
        if not self.nl_assertions and criteria is not None and nl in criteria.reward_basis:
            warn_once(f"tau2-nl-{self.name}", f"tau2 domain {self.name!r}: natural-language assertions are not graded "
                      "(`nl_assertions=False`, they need an LLM judge); tasks with NL_ASSERTION in their reward basis "
                      "are graded on the rest of it.")
            basis = [b for b in criteria.reward_basis if b != nl]
            task = task.model_copy(update={"evaluation_criteria": criteria.model_copy(
                update={"reward_basis": basis})})
        now = datetime.now(timezone.utc).isoformat()
        run = t.simulation.SimulationRun(id=f"{task.id}", task_id=task.id, start_time=now, end_time=now, duration=0.0,
                                         termination_reason=termination_reason, messages=list(messages))
        kind = t.evaluator.EvaluationType
        try:
            return t.evaluator.evaluate_simulation(
                simulation=run, task=task, domain=self.registered, solo_mode=False,
                evaluation_type=kind.ALL_WITH_NL_ASSERTIONS if self.nl_assertions else kind.ALL)
        except Exception as error:  # noqa: BLE001 - tau2's checks raise on states they cannot read (see above)
            warn_once(f"tau2-eval-{self.name}", f"tau2 domain {self.name!r}: the evaluator raised on an episode "
                      f"({type(error).__name__}: {error}); such episodes score 0.", every_rank=True)
            return t.simulation.RewardInfo(reward=0.0, info={"error": f"{type(error).__name__}: {error}"})

    def gold_turns(self, task) -> list[dict]:
        """The task's gold solution as assistant chat messages: one tool call per gold action of the agent, a text
        message asking the user wherever the gold sequence has the user's own actions (the scripted user does them
        when asked, `envs.tau2.user`), then one message saying every piece of `communicate_info`."""
        criteria = task.evaluation_criteria
        turns, asked = [], False
        for a in criteria.actions or []:
            if a.requestor == "user":
                if not asked:
                    turns.append({"role": "assistant", "content": "Please do the next steps on your phone now."})
                asked = True
                continue
            asked = False
            turns.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": a.name, "arguments": dict(a.arguments)}}]})
        info = list(criteria.communicate_info or [])
        turns.append({"role": "assistant", "content": "Done. " + " ".join(f"{item}." for item in info)})
        return turns


# ------------------------------------------------------------------------------------- chat <-> tau2 messages


def call_tool(env, name: str, arguments, call_id: str):
    """Runs one agent tool call on a tau2 environment the way tau2's orchestrator does (`Environment.get_response`).

    Returns `(ToolCall, ToolMessage)`. An unknown tool or bad arguments give tau2's own error text (`"Error: ..."`,
    `error=True`); arguments that are not a JSON object give an error message of the same form. Nothing raises.
    """
    m = tau2_modules().message
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            arguments = {"__invalid_json__": f"{error}"}
    if not isinstance(arguments, dict):
        arguments = {"__invalid_arguments__": repr(arguments)}
    call = m.ToolCall(id=call_id, name=str(name), arguments=arguments, requestor="assistant")
    return call, env.get_response(call)


def tau2_assistant_message(message: dict, tool_calls: list | None = None):
    """A tau2 `AssistantMessage` from a chat message (its text, and the tau2 `ToolCall`s already run)."""
    m = tau2_modules().message
    content = message.get("content") or None
    return m.AssistantMessage(role="assistant", content=content, tool_calls=tool_calls or None)


def chat_tool_message(name: str, result) -> dict:
    """A tool result as a chat message for the template."""
    return {"role": "tool", "name": name, "content": result.content if result.content is not None else ""}
