"""A solved held-out task shown before the opening (`gold_demonstration`), through the dataset and the episodes."""

from __future__ import annotations

import pytest

from trl_dta.envs.core.chat import ChatRenderer
from trl_dta.envs.tau2 import build_tau2_dataset, gold_demonstration, play_tau2_episodes
from trl_dta.generation import Generation

from .conftest import get_domain


def test_gold_demonstration_shows_the_gold_calls_with_real_answers(chat_tokenizer):
    mock = get_domain("mock")
    demo = gold_demonstration(mock, "update_task_with_initialization_actions")
    assert [m["role"] for m in demo] == ["user", "assistant", "tool", "assistant"]
    call = demo[1]["tool_calls"][0]["function"]
    assert call == {"name": "update_task_status", "arguments": {"task_id": "task_2", "status": "completed"}}
    assert "task_2" in demo[2]["content"] and not demo[2]["content"].startswith("Error")
    with pytest.raises(ValueError, match="no gold actions or has user actions"):
        gold_demonstration(mock, "create_task_1_nl_eval")


def test_episodes_start_after_the_demonstration(chat_tokenizer):
    """The prompt holds the demonstration between the system prompt and the opening (dataset and episodes alike);
    the episode's messages and tau2's trajectory start at the opening, so the grade is the task's own."""
    mock = get_domain("mock")
    demo = gold_demonstration(mock, "update_task_with_initialization_actions")
    renderer = ChatRenderer(chat_tokenizer, mock.tool_schemas)
    (row,) = build_tau2_dataset(mock, ["update_task_1"], demonstration=demo)
    assert len(row["prompt"]) == len(demo) + 2 and [m["content"] for m in row["prompt"][1:-1]] == \
        [m["content"] for m in demo]  # (`datasets` fills absent keys with None: the rendering is compared below)
    gold = '<tool_call>\n{"name": "update_task_status", "arguments": {"task_id": "task_1", "status": "completed"}}' \
           '\n</tool_call>'

    def generate(prefixes, max_new_tokens):
        ids = chat_tokenizer(gold, add_special_tokens=False)["input_ids"] + [chat_tokenizer.eos_token_id]
        return [Generation(ids[:budget], None) for budget in max_new_tokens]

    (episode,) = play_tau2_episodes(mock, ["update_task_1"], generate, renderer, max_turns=1, max_turn_tokens=256,
                                    max_tokens=8192, demonstration=demo)
    assert episode.ids[:episode.prompt_length] == renderer.prompt_ids(row["prompt"])
    assert episode.messages[0]["tool_calls"][0]["function"]["arguments"] == {"task_id": "task_1",
                                                                            "status": "completed"}
    assert episode.shaped == {"call_format": 1.0, "tools": 1.0, "arguments": 1.0}


def test_a_text_turn_earns_the_share_of_tool_call_it_starts_with(chat_tokenizer):
    """SmolLM2 often opens a turn with `<tool_response>`: 6 of `<tool_call>`'s 11 characters, a quarter of that credit
    (a turn with a `<tool_call>` that does not parse earns 0.25); plain text 0."""
    mock = get_domain("mock")
    renderer = ChatRenderer(chat_tokenizer, mock.tool_schemas)
    for text, expected in (("<tool_response>\n{}", 0.25 * 6 / 11), ("Sure, done.", 0.0)):
        def generate(prefixes, max_new_tokens, text=text):
            ids = chat_tokenizer(text, add_special_tokens=False)["input_ids"] + [chat_tokenizer.eos_token_id]
            return [Generation(ids[:budget], None) for budget in max_new_tokens]

        (episode,) = play_tau2_episodes(mock, ["update_task_1"], generate, renderer, max_turns=1,
                                        max_turn_tokens=64, max_tokens=8192)
        assert episode.shaped["call_format"] == pytest.approx(expected)
