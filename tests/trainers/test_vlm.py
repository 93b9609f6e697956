"""`DTAGRPOTrainer` (and `DTARLOOTrainer`) against TRL's trainers on a vision-language model with images: the embedded tiny Qwen2-VL and
its shape-counting prompts (`trl_dta.tiny_vlm`: one image per prompt, 36 image tokens of a ~50-token prompt), loaded
by name from a folder as TRL loads a model, the processor as `processing_class` (TRL's `_is_vlm`).

- float32 (`bf16=False`), with a reference model (`beta=0.04`, reloaded by TRL from the folder, its log-probs
  through the engine with the images): DTA's update no farther from TRL's float64 update than `update_slack` times
  TRL's own float32 update is (`conftest.assert_as_precise_run`); logged values within float32 rounding.
- TRL's defaults (`bf16=True` autocast over the float32 model, `gradient_checkpointing=True`, GRPO's `beta=0`), with
  `num_iterations=2` (the old policy's log-probs through the engine with the images): the bf16 bar
  (`conftest.assert_bf16_bar`): DTA's bf16 update as close to TRL's float32 update as TRL's bf16 update is, within
  the derived multiple. RLOO too, at its defaults (`beta=0.05`: the reference model's log-probs with the images).

Each checks that every micro-batch ran through DTA with its images (no dense fallback), that the tower ran once per
distinct image (`dta/images` = prompts, `dta/image_rows` = rows), and that the vision tower's weights moved.
"""

from __future__ import annotations

import pytest
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from trl_dta import tiny_vlm
from trl_dta.trainers import DTAGRPOConfig, DTAGRPOTrainer, DTARLOOConfig, DTARLOOTrainer

from .conftest import compare_in_precision


@pytest.fixture(scope="module")
def processor():
    return tiny_vlm.build_processor()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> str:
    return str(tiny_vlm.build_model_dir(tmp_path_factory.mktemp("tiny_vlm")))


@pytest.fixture(scope="module")
def image_dataset():
    return tiny_vlm.build_dataset(16, seed=1)


TRAINERS = {"grpo": (GRPOTrainer, GRPOConfig, DTAGRPOTrainer, DTAGRPOConfig),
            "rloo": (RLOOTrainer, RLOOConfig, DTARLOOTrainer, DTARLOOConfig)}


@pytest.mark.parametrize("trainer,precision", [("grpo", "fp32"), ("grpo", "trl"), ("rloo", "trl")])
def test_images_match_trl(tmp_path, vlm_dir, processor, image_dataset, trainer, precision):
    end_of_turn = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = dict(generation_kwargs={"sequence_bias": [[[end_of_turn], 4.0]]}, max_completion_length=4)
    if precision == "trl":  # TRL's default checkpointing (the harness turns it off); one generation for both steps
        config.update(gradient_checkpointing=True, num_iterations=2)
    else:
        config.update(beta=0.04)
    ref, dta = compare_in_precision(precision, *TRAINERS[trainer], vlm_dir, processor, image_dataset, tmp_path,
                                    **config)
    rows = dta.trainer.args.per_device_train_batch_size * dta.trainer.args.gradient_accumulation_steps
    prompts = rows // dta.trainer.args.num_generations
    for entry in dta.logs:
        assert entry["dta/images"] == prompts and entry["dta/image_rows"] == rows
        assert entry["dta/compression_ratio"] > 2.0  # the image tokens are the shared prefix
    moved = [n for n in dta.final if ".visual." in n and not dta.final[n].equal(dta.initial[n])]
    assert moved, "the vision tower did not train"
