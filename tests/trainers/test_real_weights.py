"""`DTAGRPOTrainer` against TRL's `GRPOTrainer` on real weights: SmolLM2-135M-Instruct (`real_weights.cut_smollm2`, the
real embedding / tied head / final norm and the layers that form its massive activation), its real tokenizer and chat
template, the harness's SGD steps (`conftest.compare_in_precision`).

- float64 (the exactness question): both trainers load the model in float64 and sample the same completions; every
  parameter update and every logged value within `float64_rtol` of TRL's (the float32 steps TRL keeps inside a float64
  model).
- TRL's defaults (`bf16=True`: bf16 autocast over the float32 model loaded by name): DTA's update as close to TRL's
  float32 update as TRL's own bf16 update is (`assert_bf16_bar`, the multiple derived in `tests/bounds.py`). The bar
  needs the three runs to train on the same completions, and real weights sample differently under bf16 autocast
  than in float32 (peaked distributions: a shifted probability moves a draw across a token boundary; the random
  models' near-flat ones rarely do), so these runs take their rollouts from [`SampledRollout`]: completions sampled
  once from the float32 model, the same for every run.

`num_iterations=2`: the second step reuses the generation with old log-probs, so the ratios move off 1.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from real_weights import sample_through_eos
from trl_dta.trainers import DTAGRPOConfig, DTAGRPOTrainer

from .conftest import EOS, compare_in_precision

QUESTIONS = ["What is 2 + 3?", "Name a color.", "Say hi.", "What is 9 - 4?", "Count to three.", "Name a fruit.",
             "What is 6 + 1?", "Spell cat."]


class SampledRollout:
    """TRL's `rollout_func`: for each prompt (TRL sends it `num_generations` times in a row), completions sampled from
    the float32 model `folder` holds at temperature 1, at most `max_tokens` each, through the first `<|im_end|>`;
    seeded by the prompt, sampled once and replayed to every run that asks again."""

    def __init__(self, folder: str, max_tokens: int = 6):
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.max_tokens = max_tokens
        self.samples: dict[tuple[int, ...], list[list[int]]] = {}

    def _sample(self, ids: list[int], n: int) -> list[list[int]]:
        with torch.random.fork_rng():
            torch.manual_seed(sum(ids) * 1009 + len(ids))
            return sample_through_eos(self.model, ids, n, self.max_tokens, EOS)

    def __call__(self, prompts: list, trainer) -> dict:
        tokenizer = trainer.processing_class
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": None}
        seen: dict[tuple[int, ...], int] = {}
        for prompt in prompts:
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]
            key = tuple(ids)
            k = seen[key] = seen.get(key, -1) + 1
            if key not in self.samples or k >= len(self.samples[key]):
                self.samples[key] = self._sample(ids, max(k + 1, trainer.num_generations))
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(self.samples[key][k])
        return out


@pytest.fixture(scope="module")
def real_tokenizer(smollm2_cut_dir):
    return AutoTokenizer.from_pretrained(smollm2_cut_dir)


@pytest.fixture(scope="module")
def chat_dataset() -> Dataset:
    """Conversational prompts: TRL renders them through SmolLM2's chat template (its default system turn included,
    about 30 tokens per prompt)."""
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in QUESTIONS]})


@pytest.mark.parametrize("precision", ["fp64", "trl"])
def test_grpo_matches_trl_on_real_weights(tmp_path, smollm2_cut_dir, real_tokenizer, chat_dataset, precision):
    kwargs = {} if precision == "fp64" else {"trainer_kwargs": {"rollout_func": SampledRollout(smollm2_cut_dir)}}
    ref, dta, gaps = compare_in_precision(precision, GRPOTrainer, GRPOConfig, DTAGRPOTrainer, DTAGRPOConfig,
                                          smollm2_cut_dir, real_tokenizer, chat_dataset, tmp_path, num_iterations=2,
                                          return_gaps=True, **kwargs)
    assert all(entry["dta/compression_ratio"] > 1.5 for entry in dta.logs if "dta/compression_ratio" in entry)
    print(f"SmolLM2 real weights, GRPO, {precision}: {gaps}")
