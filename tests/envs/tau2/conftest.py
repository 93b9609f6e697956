"""Shared fixtures of the tau2-bench tests: the real domains, loaded once per session (tau2 and litellm import in
about 5 s, an airline environment in about 0.5 s), and the offline chat tokenizer. Skipped, with the install line, when
tau2 is not installed (CI installs `trl-dta[tau2]`)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tau2", reason='tau2-bench is not installed: pip install "trl-dta[tau2]"')

from trl_dta.envs.core.chat import ChatRenderer, build_chat_tokenizer  # noqa: E402
from trl_dta.envs.tau2 import Tau2Domain  # noqa: E402
from trl_dta.generation import Generation  # noqa: E402

_DOMAINS: dict[str, Tau2Domain] = {}


def get_domain(name: str) -> Tau2Domain:
    if name not in _DOMAINS:
        _DOMAINS[name] = Tau2Domain(name)
    return _DOMAINS[name]


@pytest.fixture(scope="session")
def chat_tokenizer():
    return build_chat_tokenizer("qwen2_5")


@pytest.fixture(scope="session")
def airline():
    return get_domain("airline")


@pytest.fixture(scope="session")
def retail():
    return get_domain("retail")


@pytest.fixture(scope="session")
def mock():
    return get_domain("mock")


def turn_text(message: dict) -> str:
    """An assistant chat message as Qwen2.5's template writes a turn (tool calls in `<tool_call>` blocks)."""
    if message.get("tool_calls"):
        return "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                        "arguments": c["function"]["arguments"]}) + "\n</tool_call>"
                         for c in message["tool_calls"])
    return message["content"]


def turn_ids(tokenizer, message: dict | str) -> list[int]:
    text = message if isinstance(message, str) else turn_text(message)
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


class ScriptedPolicy:
    """A generator (`trl_dta.generation.Generator`, as the agent loop calls it) that plays fixed turns (one script per
    prefix, found by the prompt it starts with), then `filler` text turns; it stands in for a model where generation is
    not what is tested."""

    def __init__(self, tokenizer, scripts: dict[tuple, list], filler: str = "Is there anything else?"):
        self.tokenizer, self.scripts, self.filler = tokenizer, scripts, filler
        self.played: dict[int, int] = {}

    def __call__(self, prefixes, budgets):
        out = []
        for prefix, budget in zip(prefixes, budgets):
            key = next(k for k in self.scripts if tuple(prefix[:len(k)]) == k)
            turns = self.scripts[key]
            n = self.played.get(id(turns), 0)
            self.played[id(turns)] = n + 1
            ids = turn_ids(self.tokenizer, turns[n] if n < len(turns) else self.filler)[:budget]
            out.append(Generation(ids, None))
        return out


def renderer_for(domain: Tau2Domain, tokenizer) -> ChatRenderer:
    return ChatRenderer(tokenizer, domain.tool_schemas)
