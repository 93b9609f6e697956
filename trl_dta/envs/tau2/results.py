"""tau2-bench results files as conversations for `trl-dta analyze`, read by tau2's own data model.

`tau2 run` writes one JSON object, tau2's `Results` (`tau2.data_model.simulation.Results`): `info` (with
`environment_info`: the domain's name and `policy`), `tasks`, and `simulations`, each with its `task_id`, `trial`
and `messages` (`assistant` / `user` / `tool`, tool calls with a `requestor`). The file is parsed and validated by
that model (tau2's own validation: a role tau2 does not know, tool-call arguments that are not an object, a missing
field are refused with the field named), so what is analyzed is what tau2 itself would load.

[`tau2_conversations`] turns every simulation into what the policy saw, as chat messages: tau2's agent system prompt
(its instruction and the policy), then the trajectory, with the user's own tool calls and their results left out
(the agent never sees them, as in telecom); the tool schemas are those of the installed tau2 domain (`tool_defs` in a
results file are tau2's signatures, not the OpenAI schemas the agent was shown). tau2's orchestrator opens every
simulation with a fixed agent message ("Hi! How can I help you today?", `orchestrator.DEFAULT_FIRST_AGENT_MESSAGE`),
which the policy did not generate: it stays in the conversation as context, marked `"train": False`, so it is neither
a per-turn row nor trained. Simulations come sorted by task and trial, each labelled with its task, so the trials of a
task form one group.
"""

from __future__ import annotations

import json
from collections import Counter
from functools import lru_cache
from pathlib import Path

from ._seam import INSTALL, TAU2_VERSION
from .domain import GREETING

FORMAT = "tau2 results (the JSON `tau2 run` writes; tau2.data_model.simulation.Results)"
_KEYS = (b'"simulations"', b'"tasks"', b'"info"')


def is_tau2_results(path: Path) -> bool:
    """Whether `path` looks like a tau2 results file: a `.json` file holding one JSON object whose first 4 KB name one
    of `Results`' fields. Only a sniff: the file is validated when read ([`read_results`])."""
    if path.suffix != ".json" or not path.is_file():
        return False
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"{") and any(key in head for key in _KEYS)


@lru_cache(maxsize=4)
def _read(path: str, mtime: float):
    try:
        from ._seam import tau2_modules

        t = tau2_modules()
    except ImportError:
        raise ValueError(f"{Path(path).name} is a {FORMAT}; reading it needs tau2-bench {TAU2_VERSION}: "
                         f"{INSTALL}") from None
    from pydantic import ValidationError

    name = Path(path).name
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: not UTF-8 text ({e.reason} at byte {e.start}), so not {FORMAT}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}; a truncated "
                         f"file?), so not {FORMAT}") from None
    try:
        return t.simulation.Results.model_validate(data)
    except ValidationError as e:
        raise ValueError(f"{name}: tau2 rejects it as {FORMAT}: {_explain(e.errors(), data)}") from None


def _explain(errors: list[dict], data) -> str:
    """tau2's first validation error as `field <path>: <why>`. A message is validated against each of tau2's message
    classes (`SystemMessage`, `AssistantMessage`, ...): the error reported is the one of the class its role names, or
    the role itself when it names none."""
    first = errors[0]
    loc = list(first["loc"])
    member = next((i for i, part in enumerate(loc) if isinstance(part, str) and part.endswith("Message")), None)
    if member is not None:
        prefix = loc[:member]
        node = data
        for part in prefix:
            node = node[part]
        role = node.get("role") if isinstance(node, dict) else None
        name = f"{str(role).capitalize()}Message"
        match = [err for err in errors if list(err["loc"][:member]) == prefix and err["loc"][member] == name]
        if not match:
            roles = sorted({str(err["loc"][member]).removesuffix("Message").lower() for err in errors
                            if list(err["loc"][:member]) == prefix})
            return (f"field {'.'.join(map(str, prefix))}.role: {role!r} is not one of tau2's message roles "
                    f"({', '.join(roles)})")
        first, loc = match[0], [*prefix, *match[0]["loc"][member + 1:]]
    where = ".".join(str(part) for part in loc) or "(the top level)"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 and member is None else ""
    return f"field {where}: {first['msg']}{more}"


def read_results(path: str | Path):
    """The file as tau2's validated `Results` (cached per path and modification time); a `ValueError` naming the
    file, the format and the field when tau2 rejects it, or the extra to install without tau2."""
    path = Path(path)
    return _read(str(path.resolve()), path.stat().st_mtime)


def simulation_rewards(path: str | Path) -> dict[str, float | None]:
    """tau2's reward of each simulation as the file stores it (`SimulationRun.reward_info.reward`, what tau2's
    evaluator gave when `tau2 run` graded it), by simulation id; `None` for a simulation stored without one."""
    return {str(sim.id): None if sim.reward_info is None else float(sim.reward_info.reward)
            for sim in read_results(path).simulations}


def describe(path: str | Path) -> str:
    """What was read, for the analyzer's first line: domain, tasks, simulations, trials per task, and tau2's stored
    rewards ([`simulation_rewards`]: their mean and how many are 1)."""
    results = read_results(path)
    domain = results.info.environment_info.domain_name
    trials = Counter(str(sim.task_id) for sim in results.simulations)
    sizes = ", ".join(f"{n} of {k} trials" if n > 1 else f"1 of {k} trials" for k, n in
                      sorted(Counter(trials.values()).items()))
    graded = [r for r in simulation_rewards(path).values() if r is not None]
    rewards = (f"; tau2's rewards: mean {sum(graded) / len(graded):.3f} over {len(graded)} graded simulations, "
               f"{sum(r == 1.0 for r in graded)} of them 1" if graded else "; no simulation holds tau2's reward")
    return (f"tau2 results: domain {domain}, {len(results.tasks)} tasks, {len(results.simulations)} simulations; "
            f"groups (the trials of a task): {len(trials)} ({sizes}); tau2's first agent message is context, not a "
            f"policy turn{rewards}")


def _chat(message: dict, first: bool) -> dict | None:
    role = message.get("role")
    if message.get("requestor") == "user" or (role == "user" and message.get("tool_calls")):
        return None if not (role == "user" and message.get("content")) else {"role": "user",
                                                                               "content": message["content"]}
    if role == "assistant":
        out = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            out["tool_calls"] = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in message["tool_calls"]]
        elif first and out["content"] == GREETING:
            out["train"] = False  # tau2's orchestrator wrote it, not the policy
        return out
    if role == "tool":
        return {"role": "tool", "content": message.get("content") or ""}
    return {"role": role, "content": message.get("content") or ""}  # user, system


def tau2_conversations(path: str | Path) -> list[tuple[dict, str]]:
    """`(row, where)` per simulation of a tau2 results file: `row` has `messages` (chat messages, system prompt
    first), `tools` (OpenAI schemas) and `task_id`; `where` names the simulation."""
    from ._seam import tau2_modules

    path = Path(path)
    results = read_results(path)
    t = tau2_modules()
    env_info = results.info.environment_info
    domain = env_info.domain_name
    if domain not in t.registry.get_domains():
        raise ValueError(f"{path.name}: domain {domain!r} is not one of the installed tau2's "
                         f"{t.registry.get_domains()}")
    tools = [tool.openai_schema for tool in t.registry.get_env_constructor(domain)().get_tools()]
    system = t.llm_agent.SYSTEM_PROMPT.format(domain_policy=env_info.policy or "",
                                              agent_instruction=t.llm_agent.AGENT_INSTRUCTION)
    rows = []
    for sim in sorted(results.simulations, key=lambda s: (str(s.task_id), s.trial or 0)):
        messages = [{"role": "system", "content": system}]
        dumped = [m.model_dump(mode="json") for m in sim.messages]
        messages += [m for m in (_chat(d, k == 0) for k, d in enumerate(dumped)) if m is not None]
        where = f"{path.name} simulation {sim.id} (task {sim.task_id}, trial {sim.trial})"
        rows.append(({"messages": messages, "tools": tools, "task_id": str(sim.task_id)}, where))
    return rows
