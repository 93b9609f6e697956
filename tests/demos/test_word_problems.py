"""`demos.word_problems`: the generated problems' answers are exact, the prompts are chat turns, and the two rewards
score the docstring's table."""

from __future__ import annotations

import re

import pytest

from trl_dta.demos import word_problems
from trl_dta.demos.word_problems import INSTRUCTION, answer_reward, build_dataset, number_format_reward, questions


@pytest.mark.parametrize("op", sorted(word_problems.PROBLEMS))
def test_answers_are_exact(op):
    rows = build_dataset(64, max_operand=10, ops=[op], num_shots=1, seed=3)
    for prompt, answer in zip(rows["prompt"], rows["answer"], strict=True):
        assert [m["role"] for m in prompt] == ["user", "assistant", "user"]
        assert all(m["content"].endswith(INSTRUCTION) for m in prompt if m["role"] == "user")
        question = prompt[-1]["content"]
        a, b = (int(x) for x in re.findall(r"\d+", question)[:2])
        if op == "which":
            first, second, asked = re.search(r"has \d+ (\w+) and \d+ (\w+)\. How many (\w+)", question).groups()
            assert second != first and asked in (first, second)
            want = a if asked == first else b
        elif op == "ages":
            people = re.findall(r"(\w+) is (\d+)", question)
            asked = re.search(r"How old is (\w+)\?", question).group(1)
            assert len({name for name, _ in people}) == 3
            want = int(dict(people)[asked])
        else:
            want = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert int(answer) == want and int(answer) >= 0
    assert build_dataset(8, seed=3)["prompt"] == build_dataset(8, seed=3)["prompt"]  # seeded


def test_fixed_shots_and_a_heldout_set_without_training_questions(monkeypatch):
    """`fixed_shots`: every row opens with the same solved turns; `exclude`: a held-out set (another seed) asks none
    of the training questions, even where the two seeds' draws collide (a small problem space)."""
    fixed = build_dataset(16, ops=["which"], max_operand=3, num_shots=2, fixed_shots=True, seed=1)
    assert len({str(prompt[:4]) for prompt in fixed["prompt"]}) == 1
    assert len({prompt[-1]["content"] for prompt in fixed["prompt"]}) > 1
    train = build_dataset(2000, ops=["which"], max_operand=2, seed=1)
    assert questions(build_dataset(64, ops=["which"], max_operand=2, seed=2)) & questions(train)  # they collide
    heldout = build_dataset(64, ops=["which"], max_operand=2, seed=2, exclude=questions(train))
    assert len(heldout) == 64 and not questions(heldout) & questions(train)
    monkeypatch.setitem(word_problems.PROBLEMS, "which", lambda rng, top: ("Why?", 1))  # one question in all
    with pytest.raises(ValueError, match="outside `exclude`"):
        build_dataset(1, ops=["which"], exclude={f"Why? {INSTRUCTION}"})


def test_rewards_score_the_table():
    completions = ["12", "12 apples.", "7 + 5 = 12", "9", "Tom has 12 apples."]
    assert answer_reward(completions, ["12"] * 5) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert number_format_reward(completions) == [1.0, 0.0, 0.0, 1.0, 0.0]
    conversational = [[{"role": "assistant", "content": " 12."}]]
    assert answer_reward(conversational, ["12"]) == [1.0] and number_format_reward(conversational) == [1.0]


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="ops must be"):
        build_dataset(4, ops=["/"])
    with pytest.raises(ValueError, match="num_shots"):
        build_dataset(4, num_shots=-1)
    with pytest.raises(ValueError, match="answer"):
        answer_reward(["1", "2"], ["1"])
