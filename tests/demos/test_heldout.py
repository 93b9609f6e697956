"""`demos.heldout`: greedy completions of a batch (the prompts' shared prefix forwarded once) equal transformers'
greedy `generate` on each prompt alone, and the reward sees them as TRL hands completions to it."""

from __future__ import annotations

import pytest
import torch

from trl_dta.demos import word_problems
from trl_dta.demos.heldout import greedy_completions, heldout_scores


@pytest.fixture(scope="module")
def chat_model(smollm2_dir):
    """SmolLM2-135M-Instruct (the session's converted folder): a real chat model, whose greedy answers differ from
    prompt to prompt (a random tiny model's are the same for every prompt, which would hide rows in the wrong order)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


def _alone(model, tokenizer, messages, max_new_tokens: int) -> str:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_greedy_completions_equal_generate_alone(chat_model):
    model, tokenizer = chat_model
    rows = word_problems.build_dataset(4, ops=["which"], fixed_shots=True, seed=2)
    texts = greedy_completions(model, tokenizer, rows["prompt"], max_new_tokens=3, batch_size=3)  # 2 batches
    assert texts == [_alone(model, tokenizer, prompt, 3) for prompt in rows["prompt"]]
    assert len(set(texts)) > 1, texts

    def same_text(completions, expected, **kwargs):  # a reward that reads a column and TRL's completion format
        return [float(c == [{"role": "assistant", "content": e}]) for c, e in zip(completions, expected, strict=True)]

    scores, seen = heldout_scores(model, tokenizer, rows.add_column("expected", texts), same_text, max_new_tokens=3)
    assert scores == [1.0] * 4 and seen == texts
    with pytest.raises(ValueError, match="empty"):
        heldout_scores(model, tokenizer, rows.select([]), same_text, max_new_tokens=3)
