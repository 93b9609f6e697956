"""Held-out accuracy: a policy's greedy answers to prompts it never trained on, scored by an exact reward.

A GRPO run's training reward is measured on the completions it samples while it learns (temperature 1, the prompts of
the step): it rises when the model learns the task, but also when it only learns the answer format, or when its
samples merely agree more. Whether the model got better at the task is asked separately, the way a user would ask it:
greedy decoding on prompts from the same generator that the run never saw, before and after training, scored by the
same reward function:

```
held-out prompts  --greedy, max_new_tokens-->  completions  --reward_func(completions, **columns)-->  0/1 each
accuracy = mean over the prompts
```

Prompts are rendered as TRL renders them (`apply_chat_template(..., add_generation_prompt=True)` for conversational
rows, the text itself otherwise) and completions reach the reward as TRL hands them (decoded without special tokens;
`[{"role": "assistant", "content": text}]` for conversational rows). Generation runs through
[`~trl_dta.generation.CachedGenerate`], so the prompts' common prefix (system prompt, shared example turns) is
forwarded once per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import GenerationConfig

from .._checks import check_int
from ..generation import CachedGenerate

__all__ = ["greedy_completions", "heldout_scores"]


def _render(tokenizer, prompts: Sequence) -> list[list[int]]:
    """Token ids of each prompt, as TRL's `_tokenize_prompts` makes them (conversational or plain text)."""
    if prompts and isinstance(prompts[0], list):
        return [list(ids) for ids in tokenizer.apply_chat_template(
            conversation=list(prompts), add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]]
    return [list(ids) for ids in tokenizer(text=list(prompts))["input_ids"]]


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: Sequence, *, max_new_tokens: int,
                       batch_size: int = 64) -> list[str]:
    """The model's greedy completion of each prompt, decoded without special tokens.

    Args:
        model ([`~transformers.PreTrainedModel`] or a PEFT model): the policy (its train/eval mode is left as it is;
            generation runs without gradients).
        tokenizer: its tokenizer (with a chat template for conversational prompts).
        prompts (`Sequence`): chat messages (`list[dict]`) or strings, one per row.
        max_new_tokens (`int`): the longest completion (the training run's `max_completion_length`).
        batch_size (`int`, *optional*, defaults to `64`): prompts per generation call (one key/value cache each).

    Returns:
        `list[str]`: one completion per prompt, in order.
    """
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    ids = _render(tokenizer, prompts)
    texts = []
    for start in range(0, len(ids), batch_size):
        batch = ids[start:start + batch_size]
        generate = CachedGenerate(model, tokenizer, GenerationConfig(do_sample=False))
        samples = generate(batch, [max_new_tokens] * len(batch))
        texts += [tokenizer.decode(sample.ids, skip_special_tokens=True) for sample in samples]
    return texts


def heldout_scores(model, tokenizer, dataset, reward_func: Callable, *, max_new_tokens: int,
                   batch_size: int = 64) -> tuple[list[float], list[str]]:
    """`reward_func` of the model's greedy completion of each of `dataset`'s prompts.

    Args:
        model, tokenizer: as in [`greedy_completions`].
        dataset ([`~datasets.Dataset`]): a `prompt` column and the columns `reward_func` reads (e.g. `answer`).
        reward_func (`Callable`): a TRL reward function, `reward_func(completions=..., prompts=..., **columns)` ->
            one float per completion. With an exact 0/1 reward (`word_problems.answer_reward`) the scores' mean is the
            greedy accuracy.
        max_new_tokens, batch_size: as in [`greedy_completions`].

    Returns:
        `tuple[list[float], list[str]]`: one score and one completion text per row, in order.
    """
    if len(dataset) == 0:
        raise ValueError("the held-out dataset is empty; give it at least one row.")
    prompts = list(dataset["prompt"])
    texts = greedy_completions(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    conversational = isinstance(prompts[0], list)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    columns = {name: list(dataset[name]) for name in dataset.column_names if name != "prompt"}
    scores = reward_func(completions=completions, prompts=prompts, **columns)
    return [float(score) for score in scores], texts
