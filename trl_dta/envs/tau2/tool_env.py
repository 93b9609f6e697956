"""A tau2 domain as an environment for TRL's own tool loop (`GRPOTrainer(environment_factory=...)`).

TRL 1.16 makes one environment per rollout, calls `reset(**row)` with the dataset row, turns every public method into
a tool (transformers' `get_json_schema`: the name, the type hints, the Google-style docstring's `Args`), renders the
schemas through the chat template, runs the model's tool calls on the instance and masks the results out of the loss.
[`tau2_tool_env`] builds that class for a domain: one method per tau2 tool, with tau2's name, description, parameters
and required fields, each running the tool on the episode's own database exactly as tau2's orchestrator does:

```python
domain = Tau2Domain("airline")
trainer = GRPOTrainer(model="Qwen/Qwen3-1.7B", train_dataset=build_tau2_dataset(domain),
                      environment_factory=tau2_tool_env(domain), reward_funcs=tau2_tool_reward, ...)
```

Parameter types map from JSON schema to hints: string/integer/number/boolean to `str`/`int`/`float`/`bool`, enums to
`Literal[...]`, arrays to `list[...]`; an array of tau2's pydantic objects (airline's `flights`, `passengers`,
`payment_methods`) becomes `list[dict]`, its fields named in the description, since a type hint cannot carry a nested
schema. TRL's loop has no user turns: the model sees the system prompt and the user's opening, works with the tools
and ends with a text answer. [`tau2_tool_reward`] grades that with tau2's evaluator: it rebuilds the tau2 trajectory
from the completion's assistant messages and the calls the environment ran, so the communicated information is
checked too (which is why the class has no `get_reward`: the environment never sees the model's text). An episode
that ends on a tool call (cut by `max_completion_length` or `max_tool_calling_iterations`) is tau2's `max_steps`: 0.
"""

from __future__ import annotations

import inspect
from typing import Literal

from ._seam import tau2_modules
from .domain import Tau2Domain, call_tool, tau2_assistant_message

_JSON_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "object": dict, "array": list}


def _hint(schema: dict, defs: dict):
    """A type hint whose `get_json_schema` is `schema`'s (objects behind `$ref` / `anyOf` become `dict`)."""
    if "enum" in schema:
        return Literal[tuple(schema["enum"])]
    kind = schema.get("type")
    if kind == "array":
        items = schema.get("items")
        return list[_hint(items, defs)] if items else list
    if kind in _JSON_TYPES:
        return _JSON_TYPES[kind]
    if "anyOf" in schema or "$ref" in schema:
        options = schema.get("anyOf", [schema])
        kinds = {_JSON_TYPES.get(o.get("type")) if "$ref" not in o else dict for o in options}
        return kinds.pop() if len(kinds) == 1 else str
    return str


def _nested_fields(schema: dict, defs: dict) -> str:
    """`"Each item: a (string, required), b (integer)."` for an array of `$defs` objects, else `""`."""
    items = schema.get("items", schema)
    refs = [o["$ref"] for o in items.get("anyOf", [items]) if "$ref" in o]
    if not refs:
        return ""
    target = defs.get(refs[0].rsplit("/", 1)[-1], {})
    required = set(target.get("required", []))
    fields = [f"{name} ({spec.get('type', 'value')}{', required' if name in required else ''})"
              for name, spec in target.get("properties", {}).items()]
    return f" Each item is an object with: {', '.join(fields)}." if fields else ""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _tool_method(schema: dict):
    """A function `(self, **arguments) -> str` whose signature and docstring give back `schema` in TRL."""
    function = schema["function"]
    name = function["name"]
    parameters = function.get("parameters", {})
    defs = parameters.get("$defs", {})
    required = set(parameters.get("required", []))
    params, annotations, docs = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)], {}, []
    for arg, spec in parameters.get("properties", {}).items():
        hint = _hint(spec, defs)
        default = inspect.Parameter.empty if arg in required else spec.get("default")
        params.append(inspect.Parameter(arg, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hint))
        annotations[arg] = hint
        docs.append(f"    {arg}: {_one_line(spec.get('description', arg))}{_nested_fields(spec, defs)}")
    annotations["return"] = str

    def tool(self, **arguments) -> str:
        return self._call(name, arguments)

    tool.__name__ = tool.__qualname__ = name
    tool.__signature__ = inspect.Signature(params, return_annotation=str)
    tool.__annotations__ = annotations
    description = _one_line(function.get("description", name))
    tool.__doc__ = f"{description}\n\nArgs:\n" + "\n".join(docs) if docs else description
    return tool


class Tau2ToolEnv:
    """Base of the classes [`tau2_tool_env`] builds: one tau2 episode behind TRL's environment interface.

    Only the tools are public (TRL exposes every public method); `_trajectory` and `_grade` serve the reward.

    Attributes:
        domain ([`Tau2Domain`]): the class's domain.
        task: the episode's tau2 `Task` (after `reset`).
        env: its tau2 `Environment`, a fresh database per `reset`.
        calls (`list[tuple]`): the `(ToolCall, ToolMessage)` pairs run so far, in order.
    """

    domain: Tau2Domain

    def __init__(self):
        self.task, self.env, self.opening, self.calls = None, None, "", []

    def reset(self, task_id: str, prompt=None, **row) -> None:
        """Starts the episode of the dataset row's task on a fresh database; other columns are ignored."""
        self.task = self.domain.task(task_id)
        self.env = self.domain.new_environment(self.task)
        self.calls = []
        if isinstance(prompt, list) and prompt:
            self.opening = prompt[-1].get("content", "")

    def _call(self, name: str, arguments: dict) -> str:
        if self.env is None:
            raise RuntimeError("call reset(task_id=...) before using the tools.")
        call, result = call_tool(self.env, name, arguments, f"call_{len(self.calls) + 1}")
        self.calls.append((call, result))
        return result.content if result.content is not None else ""

    def _trajectory(self, completion: list[dict] | None = None) -> tuple[list, str]:
        """The episode as tau2 messages and its tau2 termination reason, from TRL's completion (a list of chat
        messages) and the calls run here. Tool calls the environment did not run (an unknown tool, which TRL answers
        itself) are left out, as tau2's trajectory would not hold them."""
        m = tau2_modules().message
        messages = self.domain.initial_messages(self.task) + [m.UserMessage(role="user", content=self.opening)]
        pending = list(self.calls)
        last_is_text = False
        for message in completion or []:
            if message.get("role") != "assistant":
                continue
            names = [c.get("function", c).get("name") for c in message.get("tool_calls") or []]
            ran = []
            for name in names:
                if pending and pending[0][0].name == name:
                    ran.append(pending.pop(0))
            if ran or (message.get("content") or "").strip():
                messages.append(tau2_assistant_message(message, [call for call, _ in ran]))
                messages.extend(result for _, result in ran)
            last_is_text = not names
        return messages, "agent_stop" if last_is_text else "max_steps"

    def _grade(self, completion: list[dict] | None = None):
        """tau2's `RewardInfo` of the episode (see [`tau2_tool_reward`])."""
        messages, end = self._trajectory(completion)
        return self.domain.evaluate(self.task, messages, end)


_CLASSES: dict[int, type] = {}


def tau2_tool_env(domain: Tau2Domain) -> type:
    """The environment class of `domain` for `GRPOTrainer(environment_factory=...)` (built once per domain).

    Its public methods are the domain's agent tools (`domain.tool_schemas`), keyword arguments as in tau2; `reset`
    takes the dataset row of [`~envs.tau2.trl.build_tau2_dataset`].
    """
    if id(domain) not in _CLASSES:
        methods = {s["function"]["name"]: _tool_method(s) for s in domain.tool_schemas}
        clashes = sorted(set(methods) & set(dir(Tau2ToolEnv)))
        if clashes:
            raise ValueError(f"tau2 tools {clashes} of domain {domain.name!r} clash with the environment's own "
                             "methods.")
        name = f"Tau2{domain.name.title().replace('-', '')}Env"
        _CLASSES[id(domain)] = type(name, (Tau2ToolEnv,), {"domain": domain, "__doc__": f"tau2's {domain.name} "
                                    "domain for TRL's tool loop (see `trl_dta.envs.tau2.tool_env`).", **methods})
    return _CLASSES[id(domain)]


def tau2_tool_reward(completions: list, environments: list | None = None, **kwargs) -> list[float]:
    """TRL reward function for [`tau2_tool_env`]: tau2's reward of each rollout (its environment and completion)."""
    if environments is None or len(environments) != len(completions):
        raise ValueError("`tau2_tool_reward` grades rollouts of `environment_factory=tau2_tool_env(domain)`; TRL did "
                         "not pass one environment per completion.")
    return [float(env._grade(completion if isinstance(completion, list) else None).reward)
            for env, completion in zip(environments, completions)]
