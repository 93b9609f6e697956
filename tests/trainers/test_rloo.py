"""`DTARLOOTrainer` against TRL's `RLOOTrainer`: same seed, data and config, real trainers on a tiny model.

RLOO always scores the old policy at generation (a no-grad call, through `DTAEngine.logprobs`) and uses a
sequence-level ratio; `beta > 0` puts the reference KL into the reward (reference scored by the engine too).
"""

from __future__ import annotations

import pytest
from peft import LoraConfig
from trl import RLOOConfig, RLOOTrainer

from trl_dta.trainers import DTARLOOConfig, DTARLOOTrainer

from .conftest import DTA, PRECISIONS, compare_in_precision, train


def compare(tmp_path, model_dir, tokenizer, dataset, update_rtol=None, dta_config=DTA, check_metrics=True,
            precision="fp64", **config):
    """TRL's trainer and DTA's on the same data, compared in `precision` (`conftest.compare_in_precision`)."""
    return compare_in_precision(precision, RLOOTrainer, RLOOConfig, DTARLOOTrainer, DTARLOOConfig, model_dir, tokenizer,
                                dataset, tmp_path, update_rtol=update_rtol, check_metrics=check_metrics,
                                dta_config=dta_config, **config)


# In TRL's default precision: RLOO's defaults (beta 0.05, a reference model prepared by accelerate), and a larger
# beta; num_iterations=2 keeps one generation for both steps (see test_grpo.LOSS_CASES).
BF16_CONFIGS = {
    "trl_defaults": {"num_iterations": 2},
    "beta": {"beta": 0.2, "num_iterations": 2},
}


@pytest.mark.parametrize("name", list(BF16_CONFIGS))
def test_matches_trl_in_trl_default_precision(tmp_path, model_dir, tokenizer, dataset, name):
    ref, dta = compare(tmp_path, model_dir, tokenizer, dataset, precision="trl", **BF16_CONFIGS[name])
    assert ref.trainer.ref_model is not None and dta.trainer.ref_model is not None


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"num_iterations": 2, "learning_rate": 0.3},
        {"beta": 0.2, "num_iterations": 2},
        {"steps_per_generation": 4, "per_device_train_batch_size": 2, "steps": 3},
        {"steps_per_generation": 3, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "steps": 3},
        {"steps_per_generation": 4, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4,
         "num_iterations": 2},
        {"num_iterations": 2, "precision": "fp32"},
    ],
    ids=["default", "num_iterations", "beta", "steps_per_generation", "window_crosses_generation",
         "one_step_per_generation_4_micro_batches", "float32"],
)
def test_matches_trl(tmp_path, model_dir, tokenizer, dataset, config):
    """float64 (exactness) over the configurations; the float32 case against TRL's float64 run."""
    compare(tmp_path, model_dir, tokenizer, dataset, **config)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_lora_with_adapter_disabled_reference(tmp_path, model_dir, tokenizer, dataset, precision):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM")
    # bf16: a tenth of the float32 run's rate before the regime's own factor. At 0.05 the second step's sequence-level
    # ratios cross the clip bound and bf16 rounding flips whole sequences (measured: DTA to TRL bf16 0.245, TRL bf16
    # to float32 0.031); at 0.005 0.023 and 0.031.
    compare(tmp_path, model_dir, tokenizer, dataset, beta=0.2, num_iterations=2,
            learning_rate=0.05 if precision == "trl" else 0.5, trainer_kwargs={"peft_config": lora},
            precision=precision)


def test_group_shuffle_keeps_groups_and_matches_the_step(tmp_path, model_dir, tokenizer, dataset):
    # RLOO's loss is a row mean; with TRL's row count per micro-batch and one optimizer step per generation the
    # step's gradient does not depend on which rows share a micro-batch.
    _, dta = compare(tmp_path, model_dir, tokenizer, dataset, steps=3, check_metrics=False,
                     dta_config={"dta_group_shuffle": True})
    for batch in dta.trainer._buffered_inputs:
        assert len({tuple(r) for r in batch["prompt_ids"].tolist()}) == 1, "a micro-batch holds more than one group"


def test_construction_error(tmp_path, model_dir, tokenizer, dataset):
    with pytest.raises(ValueError, match="`fp16=True` is not supported with DTA"):
        train(DTARLOOTrainer, DTARLOOConfig, model_dir, tokenizer, dataset, tmp_path, fp16=True)
