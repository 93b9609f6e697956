"""Tree rollouts in the trainer (`trl_dta/trainers/tree_rollouts.py`): DTA against the dense path on the same trees
for every advantage mode, TRL's trainer on the same leaves, the metrics, unscorable rows, and the configurations
refused at construction. The sampler itself: `tests/generation/test_tree_sampling.py`; the advantages:
`test_tree_advantages.py`."""

from __future__ import annotations

import math

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer, TrlParser

from trl_dta import DTAGRPOConfig, DTAGRPOTrainer, DTARLOOConfig
from trl_dta.trainers.tree_advantages import ADVANTAGES, PER_TOKEN
from trl_dta.trainers.tree_rollouts import _prompt_groups

from .conftest import EOS, assert_equivalent, build_model, make_args, reward_from_ids, train


def test_prompt_groups_refuse_rows_that_are_not_whole_groups():
    assert _prompt_groups([[1], [1], [2], [2]], 2) == [[1], [2]]
    with pytest.raises(ValueError, match="multiple of `num_generations`"):
        _prompt_groups([[1], [1], [2]], 2)
    with pytest.raises(ValueError, match="consecutive rows"):
        _prompt_groups([[1], [2], [1], [2]], 2)


# ---------------------------------------------------------------------------------------------------------- trainer

TREE = dict(dta_tree_branching=[2, 2], dta_tree_segment_length=2)


@pytest.mark.parametrize("advantage", ADVANTAGES)
def test_dta_equals_dense_on_the_same_trees(model_dir, tokenizer, dataset, tmp_path, advantage):
    """Tree rollouts through DTA equal TRL's dense path (`dta_enabled=False`) on the same sampled trees, for every
    advantage mode: same completions, logged metrics and SGD updates (two optimizer steps for the default `group`, one
    for each other mode, whose advantages enter the same loss). The tree metrics match the completions."""
    steps = 2 if advantage == "group" else 1
    config = dict(TREE, dta_tree_advantage=advantage, max_completion_length=8, precision="fp64")
    ref = train(DTAGRPOTrainer, DTAGRPOConfig, model_dir, tokenizer, dataset, tmp_path / "ref", steps=steps,
                dta_enabled=False, **config)
    dta = train(DTAGRPOTrainer, DTAGRPOConfig, model_dir, tokenizer, dataset, tmp_path / "dta", steps=steps, **config)
    assert any(log["dta/generation_compression"] > 1.0 for log in dta.logs)
    assert all(log["dta/compression_ratio"] > 1.0 for log in dta.logs)
    worst = assert_equivalent(ref, dta)  # float64: within the float32 steps of TRL's head (`float64_rtol`)
    print(f"worst relative errors: {worst}")
    rows = len(dta.completions) // len(dta.logs)  # one generation per optimizer step
    g, boundary = math.prod(TREE["dta_tree_branching"]), TREE["dta_tree_segment_length"]
    for k, log in enumerate(dta.logs):
        groups = [dta.completions[k * rows + a: k * rows + a + g] for a in range(0, rows, g)]
        distinct = sum(len({tuple(c) for c in group}) for group in groups) / len(groups)
        early = sum(c[-1] == EOS and len(c) <= boundary for group in groups for c in group) / rows
        assert log["dta/tree_distinct_leaves"] == pytest.approx(distinct)
        assert log["dta/tree_early_end_fraction"] == pytest.approx(early)


def test_one_level_samples_trls_completions(model_dir, tokenizer, dataset, tmp_path):
    """`dta_tree_branching=[num_generations]` (the prompt prefilled once, its rows sampled together) draws the same
    random numbers for the same rows as TRL's `generate`: the same completions and the same training."""
    ref = train(GRPOTrainer, GRPOConfig, model_dir, tokenizer, dataset, tmp_path / "trl", steps=1, precision="fp64")
    tree = train(DTAGRPOTrainer, DTAGRPOConfig, model_dir, tokenizer, dataset, tmp_path / "tree", steps=1,
                 dta_tree_branching=[4], precision="fp64")
    assert tree.logs[0]["dta/generation_compression"] == 1.0
    assert_equivalent(ref, tree)  # DTA's training against TRL's dense one: see the test above


class _ReplayGRPOTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` whose generation returns recorded completions (and restores the random state the recorded
    run had after generating, so that TRL's shuffle draws the same rows)."""

    recorded: list = []

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        completions, prompts, rng = self.recorded.pop(0)
        assert [list(p) for p in prompt_ids] == prompts
        torch.set_rng_state(rng)
        return completions, None


def test_default_advantages_are_trls_on_the_same_leaves(model_dir, tokenizer, dataset, tmp_path):
    """With `dta_tree_advantage='group'` everything after generation is TRL's: TRL's own GRPOTrainer given the same
    leaves logs the same advantages/rewards/loss and makes the same updates as the DTA trainer with tree rollouts."""
    recorded = []

    def record(trainer):
        generate = trainer._dta_trees.generate

        def recording(trainer_, prompt_ids, num_generations):
            completions, logprobs = generate(trainer_, prompt_ids, num_generations)
            recorded.append(([list(c) for c in completions], [list(p) for p in prompt_ids], torch.get_rng_state()))
            return completions, logprobs

        trainer._dta_trees.generate = recording

    config = dict(TREE, max_completion_length=8, precision="fp64")
    dta = train(DTAGRPOTrainer, DTAGRPOConfig, model_dir, tokenizer, dataset, tmp_path / "dta", setup=record, **config)
    _ReplayGRPOTrainer.recorded = list(recorded)
    ref = train(_ReplayGRPOTrainer, GRPOConfig, model_dir, tokenizer, dataset, tmp_path / "trl",
                max_completion_length=8, precision="fp64")
    assert not _ReplayGRPOTrainer.recorded
    worst = assert_equivalent(ref, dta)
    print(f"worst relative errors: {worst}")


def test_unscorable_rows_get_no_tree_advantage(model_dir, tokenizer, dataset, tmp_path):
    """A reward function that returns None for some rows (TRL zeroes their advantage and leaves them out of the group
    mean): under every tree mode those rows get zero advantage on every token, and the others' advantages are the
    tree advantages of TRL's over the scorable rows only."""
    from trl_dta.trainers.tree_advantages import tree_advantages

    def reward(completion_ids=None, **kwargs):  # unscorable: completions whose first token is even
        return [None if ids[0] % 2 == 0 else reward_from_ids(ids) for ids in completion_ids]

    for mode in ("unbiased", "treepo"):
        args = make_args(DTAGRPOConfig, tmp_path / mode, steps=1, dta_enabled=False, dta_tree_advantage=mode,
                         max_completion_length=8, **TREE)
        trainer = DTAGRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset,
                                 processing_class=tokenizer)
        seen = []
        score = trainer._dta_trees.score

        def recording(trainer_, output, generation, score=score, seen=seen):
            trees, scorable, trl = generation.trees, generation.scorable, output["advantages"].clone()
            out = score(trainer_, output, generation)
            seen.append((trees, scorable, trl, out["advantages"], out["completion_ids"]))
            return out

        trainer._dta_trees.score = recording
        trainer.train()
        (trees, scorable, trl, advantages, completion_ids), = seen
        assert scorable.tolist() == [int(t) % 2 == 1 for t in completion_ids[:, 0]]
        assert 0 < int(scorable.sum()) < len(scorable), "the test needs both kinds of rows"
        assert advantages[~scorable].abs().sum() == 0
        assert advantages[scorable].abs().sum() > 0
        expected = tree_advantages(trl, trees, completion_ids.size(1), mode, scorable)
        torch.testing.assert_close(advantages, expected, rtol=0, atol=0)
        assert advantages.dim() == (2 if mode in PER_TOKEN else 1)


# ---------------------------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("overrides,error,match", [
    (dict(dta_tree_branching=[4, 2]), ValueError, "product of the branching factors"),
    (dict(dta_tree_branching=[2, 2]), ValueError, "set `dta_tree_segment_length`"),
    (dict(dta_tree_branching=[2, 2], dta_tree_segment_length=6), ValueError, "segment length below 6"),
    (dict(dta_tree_branching=[2, 2], dta_tree_segment_length=2, cache_implementation="static"), ValueError,
     "cache_implementation"),
    (dict(dta_tree_branching=[2, 2], dta_tree_segment_length=2, use_transformers_continuous_batching=True),
     ValueError, "continuous"),
    (dict(dta_tree_branching="2 2"), TypeError, "list of positive integers"),
    (dict(dta_tree_branching=4), TypeError, "list of positive integers"),
    (dict(dta_tree_branching=[2, True]), TypeError, "dta_tree_branching"),
    (dict(dta_tree_branching=[2.0, 2]), TypeError, "dta_tree_branching"),
    (dict(dta_tree_branching=[4, 0]), ValueError, "positive"),
    (dict(dta_tree_branching=[]), ValueError, "at least one level"),
    (dict(dta_tree_branching=[2, 2], dta_tree_segment_length=0), ValueError, "dta_tree_segment_length"),
    (dict(dta_tree_branching=[2, 2], dta_tree_segment_length=2.5), TypeError, "dta_tree_segment_length"),
    (dict(dta_tree_branching=[2, 2], dta_tree_segment_length=2, dta_tree_advantage="node"), ValueError,
     "dta_tree_advantage"),
    (dict(dta_tree_segment_length=2), ValueError, "set\n?.*`dta_tree_branching`"),
    (dict(dta_tree_branching=[1, 4], dta_tree_segment_length=2), ValueError, "one first segment"),
    (dict(dta_tree_branching=[2, 1, 2], dta_tree_segment_length=1, dta_tree_advantage="tree"), ValueError,
     "level of one child"),
    (dict(TREE, dta_tree_advantage="unbiased", importance_sampling_level="sequence"), ValueError,
     "importance_sampling_level='token'"),
    (dict(TREE, dta_tree_advantage="treerl", loss_type="vespo"), ValueError, "loss_type='vespo'"),
    (dict(TREE, dta_tree_advantage="tree", off_policy_mask_threshold=0.5), ValueError, "off_policy_mask_threshold"),
    (dict(TREE, dta_tree_advantage="unbiased", dta_sample_layout="per_turn"), ValueError, "per_turn"),
])
def test_bad_configurations_are_refused(tmp_path, overrides, error, match):
    with pytest.raises(error, match=match):
        make_args(DTAGRPOConfig, tmp_path, **overrides)


def test_per_sequence_modes_allow_sequence_level_objectives(tmp_path):
    """`group` and `treepo` give one advantage per completion, so GSPO, VESPO and the off-policy mask stay TRL's; a
    later level of one child is fine for every mode but `tree` (its segment has a baseline outside it)."""
    for mode in ("group", "treepo"):
        make_args(DTAGRPOConfig, tmp_path, **TREE, dta_tree_advantage=mode, importance_sampling_level="sequence",
                  loss_type="grpo")
        make_args(DTAGRPOConfig, tmp_path, **TREE, dta_tree_advantage=mode, loss_type="vespo",
                  off_policy_mask_threshold=0.5)
    for mode in ("group", "unbiased", "treepo", "treerl"):
        make_args(DTAGRPOConfig, tmp_path, dta_tree_branching=[2, 1, 2], dta_tree_segment_length=1,
                  dta_tree_advantage=mode)


def test_rloo_refuses_tree_rollouts(tmp_path):
    with pytest.raises(ValueError, match="DTAGRPOTrainer"):
        make_args(DTARLOOConfig, tmp_path, **TREE)


def test_a_checkpoints_generation_config_is_refused_where_trees_cannot_sample_it(tokenizer, dataset, tmp_path):
    """The model's `generation_config.json` sets `forced_eos_token_id`, which `generate` applies unless the trainer
    sets it: refused at construction, naming where it comes from (the trainer's own config has none)."""
    path = tmp_path / "forced_eos"
    model = build_model(len(tokenizer))
    model.generation_config.forced_eos_token_id = EOS
    model.save_pretrained(path)
    args = make_args(DTAGRPOConfig, tmp_path, **TREE)
    with pytest.raises(ValueError, match="forced_eos_token_id=2.*generation_config.json"):
        DTAGRPOTrainer(model=str(path), reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                       train_dataset=dataset, processing_class=tokenizer)


@pytest.mark.parametrize("kwargs,match", [
    (dict(generation_kwargs={"forced_eos_token_id": EOS}), "forced_eos_token_id"),
    (dict(generation_kwargs={"num_beams": 2}), "num_beams"),
    (dict(trainer_kwargs={"rollout_func": lambda prompts, trainer: {}}), "rollout_func"),
])
def test_trainer_refuses_what_trees_cannot_sample(model_dir, tokenizer, dataset, tmp_path, kwargs, match):
    trainer_kwargs = kwargs.pop("trainer_kwargs", {})
    args = make_args(DTAGRPOConfig, tmp_path, **TREE, **kwargs)
    with pytest.raises(ValueError, match=match):
        DTAGRPOTrainer(model=model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                       train_dataset=dataset, processing_class=tokenizer, **trainer_kwargs)


def test_command_line_lists(tmp_path):
    """`--dta_tree_branching 4 2` on TRL's parser gives the list [4, 2]."""
    (args,) = TrlParser((DTAGRPOConfig,)).parse_args_into_dataclasses([
        "--output_dir", str(tmp_path), "--use_cpu", "true", "--num_generations", "8",
        "--per_device_train_batch_size", "8", "--dta_tree_branching", "4", "2", "--dta_tree_segment_length", "16",
        "--dta_tree_advantage", "tree",
    ])
    assert args.dta_tree_branching == [4, 2] and args.dta_tree_segment_length == 16
    assert args.dta_tree_advantage == "tree"
    (default,) = TrlParser((DTAGRPOConfig,)).parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu",
                                                                          "true"])
    assert default.dta_tree_branching is None and default.dta_tree_segment_length is None


def test_vision_language_models_are_refused(model_dir, tokenizer, dataset, tmp_path):
    """The refusal `TreeRollouts.from_trainer` applies to a trainer whose model TRL identified as vision-language (a
    real trainer with TRL's `_is_vlm` flag set, as no vision model is built offline here)."""
    from trl_dta.trainers.tree_rollouts import TreeRollouts

    args = make_args(DTAGRPOConfig, tmp_path, dta_enabled=False, **TREE)
    trainer = DTAGRPOTrainer(model=model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                             args=args, train_dataset=dataset, processing_class=tokenizer)
    assert isinstance(trainer._dta_trees, TreeRollouts)
    trainer._is_vlm = True
    with pytest.raises(ValueError, match="vision-language"):
        TreeRollouts.from_trainer(trainer)


# ------------------------------------------------------------------------------------------------------------ vLLM


@pytest.mark.vllm
@pytest.mark.parametrize("advantage", ["group", "tree"])
def test_dta_equals_dense_on_the_same_vllm_trees(vllm_engines, dataset, tmp_path, advantage):
    """Tree rollouts through the trainer's colocated vLLM engine (`use_vllm=True`; the session's float32 engine, TRL
    syncing the weights into it before each step's trees): DTA equals TRL's dense path on the same trees in float64,
    both runs sample the same trees (vLLM's unseeded sampling draws from torch's generator, seeded by each run), the
    trees share their first segments, the sampling log-probs are vLLM's (TRL's importance-sampling ratio is logged)
    and the engine's prefix-cache counter is logged."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_engines.model_dir)
    config = dict(TREE, dta_tree_advantage=advantage, max_completion_length=8, precision="fp64", use_vllm=True,
                  vllm_mode="colocate", generation_kwargs={})
    with vllm_engines.shared(torch.float32) as engine:
        ref = train(DTAGRPOTrainer, DTAGRPOConfig, vllm_engines.model_dir, tokenizer, dataset, tmp_path / "ref",
                    dta_enabled=False, **config)
        dta = train(DTAGRPOTrainer, DTAGRPOConfig, vllm_engines.model_dir, tokenizer, dataset, tmp_path / "dta",
                    **config)
    assert dta.trainer.vllm_generation.llm is engine
    assert dta.completions == ref.completions and len({tuple(c) for c in dta.completions}) > len(dta.completions) // 2
    assert any(log["dta/generation_compression"] > 1.0 for log in dta.logs)
    assert all("dta/generation_cached_tokens" in log and "sampling/importance_sampling_ratio/min" in log
               for log in dta.logs)
    assert all(abs(log["sampling/importance_sampling_ratio/min"] - 1) < 1e-3 for log in dta.logs)  # float32 vLLM
    print(f"worst relative errors: {assert_equivalent(ref, dta)}")


@pytest.mark.vllm
def test_vllm_tree_rollouts_refuse_what_they_cannot_sample(vllm_engines, dataset, tmp_path):
    """Through vLLM, `generation_kwargs` that depend on where a request starts (a fixed `seed`: every child the same)
    are refused at construction, naming the allowed ones."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_engines.model_dir)
    args = make_args(DTAGRPOConfig, tmp_path, **TREE, use_vllm=True, vllm_mode="colocate",
                     generation_kwargs={"seed": 3})
    with vllm_engines.shared(torch.float32), pytest.raises(ValueError, match=r"\['seed'\].*keep `generation_kwargs`"):
        DTAGRPOTrainer(model=vllm_engines.model_dir, reward_funcs=reward_from_ids, args=args, train_dataset=dataset,
                       processing_class=tokenizer)
