"""tau2-bench results files as conversations for `trl-dta analyze`.

`tau2 run` writes one JSON object (tau2's `Results`): `info` (with `environment_info`: the domain's `policy` and,
when saved, its `tool_defs`), `tasks`, and `simulations`, each with its `task_id`, `trial` and `messages`
(`assistant` / `user` / `tool`, tool calls with a `requestor`). [`tau2_conversations`] turns every simulation into
what the policy saw, as chat messages: tau2's agent system prompt (its instruction and the policy), then the
trajectory, with the user's own tool calls and their results left out (the agent never sees them, as in telecom);
the tool schemas are those of the installed tau2 domain (`tool_defs` in a results file are tau2's signatures, not
the OpenAI schemas the agent was shown).
Simulations come sorted by task and trial, each labelled with its task, so the trials of a task form one group.
"""

from __future__ import annotations

import json
from pathlib import Path

from ._seam import tau2_modules


def is_tau2_results(path: Path) -> bool:
    """Whether `path` is a JSON file holding a tau2 `Results` object (`info`, `tasks`, `simulations`)."""
    if path.suffix != ".json" or not path.is_file():
        return False
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"{"):
        return False
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and {"info", "tasks", "simulations"} <= set(data)


def _chat(message: dict) -> dict | None:
    role = message.get("role")
    if message.get("requestor") == "user" or (role == "user" and message.get("tool_calls")):
        return None if not (role == "user" and message.get("content")) else {"role": "user",
                                                                               "content": message["content"]}
    if role == "assistant":
        out = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            out["tool_calls"] = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in message["tool_calls"]]
        return out
    if role == "tool":
        return {"role": "tool", "content": message.get("content") or ""}
    if role in ("user", "system"):
        return {"role": role, "content": message.get("content") or ""}
    return None


def tau2_conversations(path: str | Path) -> list[tuple[dict, str]]:
    """`(row, where)` per simulation of a tau2 results file: `row` has `messages` (chat messages, system prompt
    first), `tools` (OpenAI schemas) and `task_id`; `where` names the simulation."""
    t = tau2_modules()
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    env_info = data["info"].get("environment_info", {})
    domain = env_info.get("domain_name")
    if domain not in t.registry.get_domains():
        raise ValueError(f"{path.name}: domain {domain!r} is not one of the installed tau2's {t.registry.get_domains()}")
    tools = [tool.openai_schema for tool in t.registry.get_env_constructor(domain)().get_tools()]
    system = t.llm_agent.SYSTEM_PROMPT.format(domain_policy=env_info.get("policy", ""),
                                              agent_instruction=t.llm_agent.AGENT_INSTRUCTION)
    sims = sorted(data["simulations"], key=lambda s: (str(s["task_id"]), s.get("trial") or 0))
    rows = []
    for sim in sims:
        messages = [{"role": "system", "content": system}]
        messages += [m for m in map(_chat, sim["messages"]) if m is not None]
        where = f"{path.name} simulation {sim.get('id')} (task {sim['task_id']}, trial {sim.get('trial')})"
        rows.append(({"messages": messages, "tools": tools, "task_id": str(sim["task_id"])}, where))
    return rows
