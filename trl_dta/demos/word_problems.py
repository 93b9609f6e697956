"""Arithmetic word problems with exact answers, as chat prompts: the real task for a real (instruct) model.

Generated locally from a seed, with no network: each row is one short story problem ("Tom has 7 apples. Tom gets 5
more. How many apples does Tom have now?") asked in a user turn with the instruction "Answer with just the number.",
after `num_shots` solved examples as earlier user / assistant turns (the assistant answering "5"). The trainer
renders it through the model's chat template. Two rewards score a completion:

```
completion            "12"    "12 apples."    "7 + 5 = 12"    "9"    "Tom has 12 apples."
answer_reward          1.0        1.0             0.0          0.0          1.0
number_format_reward   1.0        0.0             0.0          1.0          0.0
```

`answer_reward` asks for the right number *first* (a model that writes the sum out first gets nothing),
`number_format_reward` for nothing but a number. Which kinds a 135M model can learn was measured before training
(SmolLM2-135M-Instruct, one solved example, greedy / sampled accuracy: `python -m benchmarks.suites.task_probe`,
`benchmarks/RESULTS.md`, "A real model"): sums 5% / 3%, products 7% / 4%, the next number of a sequence 5% / 1%,
counting a list 0% / 9% are out of reach; reading one of two stated quantities (`which`, 55% / 34%, chance 50%) or
one of three ages (`ages`, 23% / 16%, chance 33%) is in range, and GRPO teaches both within 24 steps of 64
completions (held-out greedy accuracy, `which`: 48% -> 92%; `ages`, ages up to 60: 41% -> 97%).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Collection, Sequence

from datasets import Dataset

INSTRUCTION = "Answer with just the number."

_NAMES = ("Tom", "Mia", "Sam", "Lily", "Ben", "Emma", "Noah", "Ava", "Leo", "Zoe")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "coins", "cards", "shells", "balloons")


def _add(rng: random.Random, top: int) -> tuple[str, int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(1, top), rng.randint(1, top)
    return f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?", a + b


def _sub(rng: random.Random, top: int) -> tuple[str, int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a = rng.randint(2, top)
    b = rng.randint(1, a - 1)
    return f"{name} has {a} {item}. {name} gives away {b}. How many {item} does {name} have left?", a - b


def _which(rng: random.Random, top: int) -> tuple[str, int]:
    name = rng.choice(_NAMES)
    first, second = rng.sample(_ITEMS, 2)
    a, b = rng.sample(range(1, top + 1), 2)
    asked, answer = rng.choice(((first, a), (second, b)))
    return f"{name} has {a} {first} and {b} {second}. How many {asked} does {name} have?", answer


def _ages(rng: random.Random, top: int) -> tuple[str, int]:
    people = rng.sample(_NAMES, 3)
    ages = rng.sample(range(1, max(top, 3) + 1), 3)
    asked = rng.randrange(3)
    return (f"{people[0]} is {ages[0]}, {people[1]} is {ages[1]} and {people[2]} is {ages[2]} years old. "
            f"How old is {people[asked]}?", ages[asked])


def _mul(rng: random.Random, top: int) -> tuple[str, int]:
    item = rng.choice(_ITEMS)
    a, b = rng.randint(2, min(top, 10)), rng.randint(2, min(top, 10))
    return f"There are {a} bags with {b} {item} in each bag. How many {item} are there in all?", a * b


PROBLEMS: dict[str, Callable[[random.Random, int], tuple[str, int]]] = {
    "which": _which, "ages": _ages, "+": _add, "-": _sub, "*": _mul}
"""Problem generators by kind: `(rng, largest operand) -> (question, exact answer)`. `which` asks for one of two
quantities stated in the question, `ages` for one of three people's ages (reading, no arithmetic: what a 135M model
learns by GRPO, see the module docstring), the others for a sum, a difference, a product."""


def build_dataset(num_rows: int = 2048, *, max_operand: int = 10, ops: Sequence[str] = ("+", "-"),
                  num_shots: int = 1, fixed_shots: bool = False, seed: int = 0,
                  exclude: Collection[str] = ()) -> Dataset:
    """Generates the word-problem dataset (conversational prompts, exact integer answers).

    Args:
        num_rows (`int`, *optional*, defaults to `2048`):
            Number of rows.
        max_operand (`int`, *optional*, defaults to `10`):
            Largest number in a question (a product's factors are at most `min(max_operand, 10)`).
        ops (`Sequence[str]`, *optional*, defaults to `("+", "-")`):
            Problem kinds to draw from, keys of [`PROBLEMS`]: `which` (one of two stated quantities), `ages` (one of
            three stated ages, at most `max_operand`), `+` (gets more), `-` (gives away, never below zero), `*` (bags
            of items).
        num_shots (`int`, *optional*, defaults to `1`):
            Solved examples before the question, each a user turn and the assistant's bare answer (drawn per row,
            or once with `fixed_shots`).
            One is enough to make a weak instruct model answer with a bare number now and then, which gives GRPO a
            learning signal from the first step; without it SmolLM2-135M-Instruct almost never does.
        fixed_shots (`bool`, *optional*, defaults to `False`):
            Show the same solved examples before every question (drawn once, from a generator of their own seeded
            by `seed`) instead of drawing them per row. The prompts then share a prefix (system prompt and examples),
            which DTA trains once per micro-batch and generation forwards once per step.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the generator.
        exclude (`Collection[str]`, *optional*):
            Questions (the last user turn's text, see [`questions`]) never to ask: a held-out set passes the training
            set's, so that no held-out question was trained on. Drawn again until it differs.

    Returns:
        [`~datasets.Dataset`]: columns `prompt` (`list[dict]`: `num_shots` solved user / assistant turns, then the
        question and [`INSTRUCTION`] as a user turn, for the model's chat template) and `answer` (`str`, the exact
        result in decimal).
    """
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}.")
    if max_operand < 2:
        raise ValueError(f"max_operand must be >= 2, got {max_operand}.")
    if not ops or any(op not in PROBLEMS for op in ops):
        raise ValueError(f"ops must be a non-empty subset of {tuple(PROBLEMS)}, got {tuple(ops)}.")
    if num_shots < 0:
        raise ValueError(f"num_shots must be >= 0, got {num_shots}.")
    rng = random.Random(seed)
    excluded = frozenset(exclude)
    shots = _solved(random.Random(f"shots-{seed}"), ops, max_operand, num_shots) if fixed_shots else None
    prompts, answers, draws = [], [], 0
    while len(prompts) < num_rows:
        draws += 1
        if draws > 100 * num_rows:
            raise ValueError(f"could not draw {num_rows} questions outside `exclude` ({len(excluded)} questions) in "
                             f"{draws - 1} draws: ask for fewer rows, or widen the problems (`max_operand`, `ops`).")
        messages = _solved(rng, ops, max_operand, num_shots + 1) if shots is None else \
            shots + _solved(rng, ops, max_operand, 1)
        if messages[-2]["content"] in excluded:
            continue
        prompts.append(messages[:-1])
        answers.append(messages[-1]["content"])
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


def _solved(rng: random.Random, ops: Sequence[str], max_operand: int, count: int) -> list[dict]:
    """`count` problems drawn from `ops`, each a user turn and the assistant's exact answer."""
    messages = []
    for _ in range(count):
        question, answer = PROBLEMS[rng.choice(tuple(ops))](rng, max_operand)
        messages += [{"role": "user", "content": f"{question} {INSTRUCTION}"},
                     {"role": "assistant", "content": str(answer)}]
    return messages


def questions(dataset: Dataset) -> set[str]:
    """The questions a word-problem dataset asks (each row's last user turn), for `build_dataset(exclude=...)`."""
    return {prompt[-1]["content"] for prompt in dataset["prompt"]}


_FIRST_NUMBER = re.compile(r"-?\d+")
_BARE_NUMBER = re.compile(r"\s*-?\d+\.?\s*")


def _text(completion) -> str:
    # TRL hands conversational completions as a list of messages; the assistant's reply is the last one.
    return completion[-1]["content"] if isinstance(completion, list) else completion


def answer_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """1.0 when the completion's first number is the exact answer, else 0.0 (TRL's reward-function signature).

    Args:
        completions (`list[str]` or `list[list[dict]]`): completions, plain or conversational.
        answer (`list[str]`): the dataset's `answer` column, one per completion.
        **kwargs: other columns and TRL's extras, unused.
    """
    if len(completions) != len(answer):
        raise ValueError(f"got {len(completions)} completions but {len(answer)} answers; the dataset needs an "
                         "`answer` column.")
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        found = _FIRST_NUMBER.search(_text(completion))
        scores.append(float(found is not None and int(found.group()) == int(expected)))
    return scores


def number_format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 when the completion is nothing but one integer (a trailing period allowed), else 0.0.

    Args:
        completions (`list[str]` or `list[list[dict]]`): completions, plain or conversational.
        **kwargs: dataset columns and TRL's extras, unused.
    """
    return [float(_BARE_NUMBER.fullmatch(_text(completion)) is not None) for completion in completions]
