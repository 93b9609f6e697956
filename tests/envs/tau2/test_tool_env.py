"""`tau2_tool_env`: the domain's tools as the public methods TRL's tool loop calls, with tau2's schemas."""

from __future__ import annotations

import json
import re

import pytest
from transformers.utils import get_json_schema

from trl_dta.envs.tau2 import tau2_tool_env
from trl_dta.envs.tau2.domain import call_tool

from .conftest import get_domain

DOMAINS = ("airline", "retail")
_SIMPLE = {"string", "integer", "number", "boolean"}


def _methods(env_cls):
    import inspect

    return {name: fn for name, fn in inspect.getmembers(env_cls, predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")}


@pytest.mark.parametrize("name", DOMAINS)
def test_trl_derives_tau2_schemas(name):
    domain = get_domain(name)
    env = tau2_tool_env(domain)()
    methods = _methods(type(env))
    assert sorted(methods) == sorted(s["function"]["name"] for s in domain.tool_schemas)
    for schema in domain.tool_schemas:
        want = schema["function"]
        got = get_json_schema(getattr(env, want["name"]))["function"]  # what TRL renders for a bound method
        assert got["name"] == want["name"] and got["description"] == " ".join(want["description"].split())
        got_p, want_p = got["parameters"], want["parameters"]
        assert list(got_p["properties"]) == list(want_p["properties"]), want["name"]
        assert sorted(got_p.get("required", [])) == sorted(want_p.get("required", [])), want["name"]
        for arg, spec in want_p["properties"].items():
            mine = got_p["properties"][arg]
            assert mine["description"].startswith(" ".join(spec["description"].split())), (want["name"], arg)
            if "enum" in spec:
                assert mine["enum"] == spec["enum"]
            elif spec.get("type") in _SIMPLE:
                assert mine["type"] == spec["type"], (want["name"], arg)
            elif spec.get("type") == "array":
                assert mine["type"] == "array"
                if spec["items"].get("type") in _SIMPLE:
                    assert mine["items"] == {"type": spec["items"]["type"]}
                else:  # tau2's pydantic objects: `list[dict]`, fields named in the description
                    assert mine["items"] == {"type": "object"} and "Each item is an object with" in mine["description"]


@pytest.mark.parametrize("name", DOMAINS)
def test_schemas_render_through_trl_chat_template(name, chat_tokenizer):
    domain = get_domain(name)
    env = tau2_tool_env(domain)()
    tools = list(_methods(type(env)).keys())
    text = chat_tokenizer.apply_chat_template(
        [{"role": "system", "content": domain.system_prompt}, {"role": "user", "content": "hi"}],
        tools=[getattr(env, t) for t in tools], add_generation_prompt=True, tokenize=False)
    block = re.search(r"<tools>\n(.*)\n</tools>", text, re.S).group(1)
    rendered = [json.loads(line) for line in block.splitlines()]
    assert [r["function"]["name"] for r in rendered] == tools
    for r in rendered:
        want = next(s["function"] for s in domain.tool_schemas if s["function"]["name"] == r["function"]["name"])
        assert set(r["function"]["parameters"]["properties"]) == set(want["parameters"]["properties"])
    assert domain.policy in text and text.endswith("<|im_start|>assistant\n")


def _arguments(domain, tool: str, schema: dict) -> dict:
    """Arguments for `tool`: the first gold action that uses it, else a placeholder per required parameter."""
    for task in domain.tasks:
        for action in task.evaluation_criteria.actions or []:
            if action.name == tool:
                return dict(action.arguments)
    params = schema["parameters"]
    placeholder = {"string": "2 + 2" if tool == "calculate" else "unknown", "integer": 1, "number": 1.0,
                   "boolean": True, "array": []}
    return {arg: placeholder.get(params["properties"][arg].get("type"), "unknown")
            for arg in params.get("required", [])}


@pytest.mark.parametrize("name", DOMAINS)
def test_every_tool_callable_through_the_environment(name):
    domain = get_domain(name)
    env = tau2_tool_env(domain)()
    task = domain.tasks[0]
    for schema in domain.tool_schemas:
        tool = schema["function"]["name"]
        arguments = _arguments(domain, tool, schema["function"])
        env.reset(task_id=task.id, prompt=[{"role": "user", "content": "hi"}])
        got = getattr(env, tool)(**arguments)
        _, want = call_tool(domain.new_environment(task), tool, arguments, "x")  # tau2's orchestrator path
        assert got == want.content, tool
        assert env.calls[-1][0].name == tool and env.calls[-1][0].arguments == arguments


def test_reset_starts_a_fresh_database(airline):
    env = tau2_tool_env(airline)()
    task = next(t for t in airline.tasks if any(a.name == "cancel_reservation" for a in t.evaluation_criteria.actions))
    action = next(a for a in task.evaluation_criteria.actions if a.name == "cancel_reservation")
    env.reset(task_id=task.id)
    first = env.cancel_reservation(**action.arguments)
    env.reset(task_id=task.id)
    assert env.calls == [] and env.cancel_reservation(**action.arguments) == first  # not "already cancelled"
