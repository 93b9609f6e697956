"""`DTAGRPOTrainer` (and `DTARLOOTrainer`) against TRL's trainers on a vision-language model with images: the
embedded tiny Qwen2-VL and its shape-counting prompts (`demos.tiny_vlm`: one image per prompt, 36 image tokens of a
74-token prompt), loaded by name from a folder as TRL loads a model, the processor as `processing_class` (TRL's
`_is_vlm`).

- float32 (`bf16=False`), with a reference model (`beta=0.04`, reloaded by TRL from the folder, its log-probs
  through the engine with the images): DTA's update no farther from TRL's float64 update than `update_slack` times
  TRL's own float32 update is (`conftest.assert_as_precise_run`); logged values within float32 rounding.
- TRL's defaults (`bf16=True` autocast over the float32 model, `gradient_checkpointing=True`, GRPO's `beta=0`), with
  `num_iterations=2` (the old policy's log-probs through the engine with the images): the bf16 bar
  (`conftest.assert_bf16_bar`): DTA's bf16 update as close to TRL's float32 update as TRL's bf16 update is, within
  the derived multiple. RLOO too, at its defaults (`beta=0.05`: the reference model's log-probs with the images).

Each equivalence test checks that every micro-batch ran through DTA with its images (no dense fallback), that the
tower ran once per distinct image (`dta/images` = prompts, `dta/image_rows` = rows), and that the vision tower's
weights moved.

`dta_group_shuffle=True` with images: every micro-batch holds one whole group (one image), float64 updates equal TRL's.

At construction (`trainers/model_checks.py`): a vision-language family whose images DTA does not run is refused
(Gemma 3), a supported one builds its engine, and FSDP2's per-layer schedule is refused for it.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from trl_dta import DTAEngine
from trl_dta.demos import tiny_vlm
from trl_dta.parallel.fsdp2 import FSDP2
from trl_dta.refusal import DTAUnsupportedError
from trl_dta.trainers import DTAGRPOConfig, DTAGRPOTrainer, DTARLOOConfig, DTARLOOTrainer
from trl_dta.trainers.model_checks import check_policy, check_schedule
from vision_models import VOCAB, make_vlm

from .conftest import assert_equivalent, assert_params_close, compare_in_precision, train


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


def test_construction_refusals():
    engine = []
    qwen = make_vlm("qwen2_vl", torch.float32)
    check_policy(qwen, is_vlm=True, aux_loss_enabled=False, build_engine=lambda: engine.append(DTAEngine(qwen)))
    assert engine[0].vision is not None and engine[0].vision.model_type == "qwen2_vl"
    with pytest.raises(DTAUnsupportedError, match="(?s)FSDP2's per-layer schedule.*dta_fsdp_schedule='window'"):
        check_schedule(engine[0], FSDP2("layer"))
    gemma = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8),
        vision_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                           image_size=8, patch_size=4), mm_tokens_per_image=4, image_token_id=VOCAB - 3))
    with pytest.raises(DTAUnsupportedError, match="bidirectionally") as refusal:
        check_policy(gemma, is_vlm=True, aux_loss_enabled=False, build_engine=lambda: DTAEngine(gemma))
    assert "dta_enabled=False" in str(refusal.value)


def test_group_shuffle_with_images(tmp_path, vlm_dir, processor, image_dataset):
    """The group-aware split moves each row's images with it (TRL's per-row form of `pixel_values` and
    `image_grid_thw`): micro-batches of one group each, one image each, and the step's update TRL's (dapo's normaliser
    does not depend on the grouping; float64, as the micro-batches' summation orders differ from TRL's)."""
    config = dict(loss_type="dapo", precision="fp64", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  max_completion_length=4)
    ref = train(GRPOTrainer, GRPOConfig, vlm_dir, processor, image_dataset, tmp_path / "trl", **config)
    dta = train(DTAGRPOTrainer, DTAGRPOConfig, vlm_dir, processor, image_dataset, tmp_path / "dta", **config,
                dta_group_shuffle=True)
    for batch in dta.trainer._buffered_inputs:
        assert len({tuple(r) for r in batch["prompt_ids"].tolist()}) == 1, "a micro-batch holds more than one group"
        grids = batch["image_grid_thw"]
        patches = batch["pixel_values"].split(grids.prod(-1).tolist())
        assert all(torch.equal(p, patches[0]) for p in patches), "a micro-batch shows more than one image"
    assert all(entry["dta/images"] == 2.0 for entry in dta.logs)  # the step's two groups, one image each
    assert_params_close(ref, dta)
    assert_equivalent(ref, dta, compare_metrics=False)
