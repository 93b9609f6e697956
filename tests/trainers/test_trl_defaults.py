"""DTA's trainers with TRL's defaults, for every tested family: what a new user runs first.

- Smoke matrix: every config field at TRL's default (`bf16=True` autocast over the float32 model loaded by name,
  `gradient_checkpointing=True`, `beta` at the trainer's default, the default loss), only `use_cpu`, the batch sizes
  and the lengths shrunk for CPU (plus the step count and logging, which do not change what is computed): two
  training steps and an evaluation, DTA on, no error, no micro-batch on TRL's dense path.
- The bf16 bar per family, GRPO and RLOO (`conftest.assert_bf16_bar`): DTA's update is as close to TRL's bf16 update
  as TRL's bf16 update is to its float32 one.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from conftest import FAMILIES as MODEL_FAMILIES
from trl_dta.trainers import DTAGRPOConfig, DTAGRPOTrainer, DTARLOOConfig, DTARLOOTrainer

from .conftest import BOS, EOS, PAD, compare_in_precision

FAMILIES = ("qwen2", "qwen3", "llama", "gemma2", "mistral", "phi3")
TRAINERS = {"grpo": (GRPOTrainer, GRPOConfig, DTAGRPOTrainer, DTAGRPOConfig),
            "rloo": (RLOOTrainer, RLOOConfig, DTARLOOTrainer, DTARLOOConfig)}


def _cases():
    """family x trainer; all but Qwen2 with GRPO marked slow."""
    return [pytest.param(f, t, id=f"{f}-{t}", marks=[] if (f, t) == ("qwen2", "grpo") else [pytest.mark.slow])
            for f in FAMILIES for t in TRAINERS]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tokenizer):
    """Each family's tiny model (the root conftest's config, the test tokenizer's vocabulary) saved to a folder, so
    that the trainers load it by name in float32 as TRL does (and reload the reference model from it)."""
    dirs = {}
    for family in FAMILIES:
        config_cls, kwargs = MODEL_FAMILIES[family]
        config = config_cls(**{**kwargs, "vocab_size": len(tokenizer), "pad_token_id": PAD, "bos_token_id": BOS,
                               "eos_token_id": EOS})
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # peaked enough that sampling gives repeats and early <eos>
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs[family] = str(path)
    return dirs


def reward(completion_ids, **kwargs):
    return [float(len(set(c))) - 0.3 * len(c) for c in completion_ids]


@pytest.mark.parametrize("family,trainer", _cases())
def test_trl_defaults_train_and_evaluate(tmp_path, family_dirs, tokenizer, dataset, family, trainer):
    _, _, dta_cls, dta_config = TRAINERS[trainer]
    args = dta_config(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                      per_device_eval_batch_size=4, max_completion_length=8, max_steps=2, logging_steps=1,
                      report_to="none", save_strategy="no", disable_tqdm=True)
    assert args.bf16 and args.gradient_checkpointing and not args.dta_group_shuffle  # TRL's and DTA's defaults
    run = dta_cls(model=family_dirs[family], reward_funcs=reward, args=args, train_dataset=dataset,
                  eval_dataset=dataset, processing_class=tokenizer)
    assert run.accelerator.mixed_precision == "bf16"
    run.train()
    logs = [entry for entry in run.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(entry["dta/dense_fallback"] == 0.0 for entry in logs)
    assert all(entry["dta/tree_tokens"] < entry["dta/tokens"] for entry in logs), "no prefix was shared"
    if args.beta:
        assert run.ref_model is not None  # RLOO's default beta: the reference model, prepared by accelerate
    results = run.evaluate()
    assert all(torch.isfinite(torch.tensor(results[k])) for k in ("eval_loss", "eval_entropy"))


@pytest.mark.parametrize("family,trainer", _cases())
def test_bf16_bar_per_family(tmp_path, family_dirs, tokenizer, dataset, family, trainer):
    """The trainer harness's bf16 regime on each family (num_iterations=2: one generation for both steps). The gaps
    go to the file named by `DTA_PRECISION_LOG`, if set, for the record."""
    ref_cls, ref_config, dta_cls, dta_config = TRAINERS[trainer]
    ref, dta, gaps = compare_in_precision("trl", ref_cls, ref_config, dta_cls, dta_config, family_dirs[family],
                                          tokenizer, dataset, tmp_path, num_iterations=2, return_gaps=True)
    if os.environ.get("DTA_PRECISION_LOG"):
        with open(os.environ["DTA_PRECISION_LOG"], "a") as f:
            f.write(json.dumps({"family": family, "trainer": trainer, **gaps}) + "\n")
