"""`DTAGRPOTrainer` against TRL's `GRPOTrainer`: same seed, data and config, real trainers on a tiny model.

Each test trains both for a few optimizer steps and checks that they generate the same completions, log the same loss
and metrics, and end with the same parameters: in float64 within the float32 steps TRL keeps inside a float64 model
(`conftest.float64_rtol`), in float32 as close to TRL's float64 run as TRL's own float32 run, in TRL's default bf16
within TRL's own bf16 error (`conftest.compare_in_precision`; the bounds are derived, `tests/bounds.py`).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from trl_dta import _checks
from trl_dta.batch import Layout
from trl_dta.trainers import DTAGRPOConfig, DTAGRPOTrainer
from trl_dta.tree import PrefixTree

from .conftest import (
    DTA,
    EOS,
    PRECISIONS,
    Run,
    assert_equivalent,
    assert_params_close,
    compare_in_precision,
    float32_rtol,
    float64_rtol,
    make_args,
    train,
)


def compare(tmp_path, model_dir, tokenizer, dataset, update_rtol=None, ref_cls=GRPOTrainer, dta_cls=DTAGRPOTrainer,
            check_metrics=True, dta_config=DTA, precision="fp64", **config):
    """TRL's trainer and DTA's on the same data, compared in `precision` (`conftest.compare_in_precision`)."""
    return compare_in_precision(precision, ref_cls, GRPOConfig, dta_cls, DTAGRPOConfig, model_dir, tokenizer, dataset,
                                tmp_path, update_rtol=update_rtol, check_metrics=check_metrics, dta_config=dta_config,
                                **config)


LOSSES = [
    ("grpo", "token"),
    ("grpo", "sequence"),
    ("bnpo", "token"),
    ("dr_grpo", "token"),
    ("dapo", "token"),
    ("luspo", "sequence"),
    ("cispo", "token"),
    ("sapo", "token"),
    ("vespo", "token"),
]


# Every loss in float64 (exactness); the default loss (dapo) in float32 too; in TRL's default precision the default
# loss, a sequence-level ratio and a clipped ratio of another form (one run costs three trainings in those two: TRL
# float64 or float32, TRL and DTA in the precision).
BF16_LOSSES = {("dapo", "token"), ("grpo", "sequence"), ("cispo", "token")}
LOSS_CASES = [pytest.param(loss, level, "fp64", id=f"{loss}-{level}-fp64") for loss, level in LOSSES] + [
    pytest.param("dapo", "token", "fp32", id="dapo-token-fp32")] + [
    pytest.param(loss, level, "trl", id=f"{loss}-{level}-trl") for loss, level in LOSSES
    if (loss, level) in BF16_LOSSES]


@pytest.mark.parametrize("loss_type,level,precision", LOSS_CASES)
def test_loss_types_match_trl(tmp_path, model_dir, tokenizer, dataset, loss_type, level, precision):
    # num_iterations=2: the second step reuses the generation with old log-probs (scored by the engine), so the
    # ratios move off 1 and the clipping branches are exercised. Micro-batches of 4 from 2 groups of 4, shuffled by
    # TRL's row shuffle: groups are split across micro-batches. (One generation for both steps also keeps the bf16
    # comparison about precision: a second generation could sample other tokens from the slightly different weights.)
    ref, dta = compare(tmp_path, model_dir, tokenizer, dataset, loss_type=loss_type, importance_sampling_level=level,
                       num_iterations=2, precision=precision)
    if loss_type == "grpo" and level == "token":
        assert max(entry["clip_ratio/region_mean"] for entry in ref.logs) > 0, "clipping never active"
        prompts = [[tuple(row) for row in batch["prompt_ids"].tolist()] for batch in dta.trainer._buffered_inputs]
        assert any(len(set(rows)) > 1 for rows in prompts), "no micro-batch mixes groups"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_beta_with_reference_model(tmp_path, model_dir, tokenizer, dataset, precision):
    # The reference model is reloaded from the model folder and scored through its own engine; in TRL's default
    # precision accelerate prepares it with its bf16 autocast wrapper, which the engine and its probe follow.
    compare(tmp_path, model_dir, tokenizer, dataset, beta=0.2, num_iterations=2, loss_type="grpo", precision=precision)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_sync_ref_model(tmp_path, model_dir, tokenizer, dataset, precision):
    # TRL's callback mixes the policy into the prepared reference model after every step: the reference engine keeps
    # scoring the same (wrapped) module with its new weights.
    _, dta = compare(tmp_path, model_dir, tokenizer, dataset, beta=0.1, num_iterations=2, sync_ref_model=True,
                     ref_model_sync_steps=1, ref_model_mixup_alpha=0.5, steps=3, precision=precision)
    reference = dta.trainer.accelerator.unwrap_model(dta.trainer.ref_model)
    assert any(engine.model is reference for engine in dta.trainer._dta_engines.values()), "no reference engine"


def test_beta_bias_correction_delta(tmp_path, model_dir, tokenizer, dataset):
    compare(tmp_path, model_dir, tokenizer, dataset, beta=0.1, use_bias_correction_kl=True, delta=1.05,
            epsilon_high=0.28, num_iterations=2)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_lora_with_adapter_disabled_reference(tmp_path, model_dir, tokenizer, dataset, precision):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM")
    compare(tmp_path, model_dir, tokenizer, dataset, beta=0.2, num_iterations=2, learning_rate=0.5,
            trainer_kwargs={"peft_config": lora}, precision=precision)


def test_steps_per_generation(tmp_path, model_dir, tokenizer, dataset):
    # One generation feeds 2 optimizer steps of 2 micro-batches of 2 rows: old log-probs are needed and scored by DTA.
    compare(tmp_path, model_dir, tokenizer, dataset, per_device_train_batch_size=2, steps_per_generation=4, steps=3)


# DTA's defaults against TRL over the ways one generation feeds optimizer steps: (steps_per_generation, per-device
# batch, gradient_accumulation_steps) with generation batches of 8 or 12 rows (groups of 4), 3 optimizer steps.
SCHEDULES = {
    "1_step_per_generation_4_micro_batches": dict(steps_per_generation=4, per_device_train_batch_size=2,
                                                  gradient_accumulation_steps=4),
    "2_steps_per_generation": dict(steps_per_generation=4, per_device_train_batch_size=2,
                                   gradient_accumulation_steps=2),
    "3_steps_per_generation": dict(steps_per_generation=3, per_device_train_batch_size=4,
                                   gradient_accumulation_steps=1),
    "4_steps_per_generation": dict(steps_per_generation=4, per_device_train_batch_size=2,
                                   gradient_accumulation_steps=1),
    "window_crosses_generation": dict(steps_per_generation=3, per_device_train_batch_size=4,
                                      gradient_accumulation_steps=2),
    "generation_batch_size": dict(generation_batch_size=8, per_device_train_batch_size=2,
                                  gradient_accumulation_steps=2),
    "window_repeats_micro_batches": dict(steps_per_generation=2, per_device_train_batch_size=4,
                                      gradient_accumulation_steps=4, steps=2),
}


@pytest.mark.parametrize(
    "loss_type,schedule,iterations,precision",
    [
        ("grpo", "2_steps_per_generation", 1, "fp64"),  # issue 9's measured defects with the old default: 0.58,
        ("bnpo", "1_step_per_generation_4_micro_batches", 1, "fp64"),  # 0.14 (with spg=2),
        ("dapo", "3_steps_per_generation", 2, "fp64"),  # 0.97
        ("dapo", "3_steps_per_generation", 2, "fp32"),
        ("dapo", "3_steps_per_generation", 2, "trl"),
        ("dapo", "window_crosses_generation", 2, "fp64"),
        ("bnpo", "window_crosses_generation", 1, "fp64"),
        ("dr_grpo", "4_steps_per_generation", 2, "fp64"),
        ("grpo", "generation_batch_size", 2, "fp64"),
        ("luspo", "window_repeats_micro_batches", 2, "fp64"),
    ],
)
def test_default_settings_match_trl(tmp_path, model_dir, tokenizer, dataset, loss_type, schedule, iterations,
                                    precision):
    config = {"steps": 3, **SCHEDULES[schedule]}
    # One micro-batch of 2 rows per optimizer step often holds two prompts that share nothing: DTA's default sends
    # such a forest to TRL's dense path (`dta_min_compression=1.1`), so this schedule forces DTA to test it.
    dta_config = {"dta_min_compression": 0.0} if schedule == "4_steps_per_generation" else DTA
    _, dta = compare(tmp_path, model_dir, tokenizer, dataset, loss_type=loss_type, num_iterations=iterations,
                     dta_config=dta_config, precision=precision, **config)
    assert not dta.trainer._dta.dta_group_shuffle


def test_one_forest_per_optimizer_step(tmp_path, model_dir, tokenizer, dataset):
    # Window of 2 micro-steps, generations of 3 micro-batches: micro-steps (0 1 | 2 . 3 | 4 5) -> forests {0, 1},
    # {2}, {3} (a new generation at micro-step 3), {4, 5}: four engine calls for three optimizer steps, and a forest's
    # tree is never larger than its micro-batches' trees (strictly smaller where TRL's shuffle split a group).
    forests = []

    class Counted(DTAGRPOTrainer):
        def _dta_run_window(self, model, inputs, num_items_in_batch):
            engine = self._dta_engine(self.accelerator.unwrap_model(model))
            calls = []
            original = engine.forward_backward
            engine.forward_backward = lambda tree, *a, **k: calls.append(tree) or original(tree, *a, **k)
            try:
                super()._dta_run_window(model, inputs, num_items_in_batch)
            finally:
                del engine.forward_backward
            micro_steps = self._dta_state.micro_steps
            steps = sorted(micro_steps)
            parts = [PrefixTree.from_sequences(Layout.from_batch(micro_steps[s].batch).seqs) for s in steps]
            forests.append((steps, calls, parts))

    config = dict(steps_per_generation=3, per_device_train_batch_size=4, gradient_accumulation_steps=2, steps=3,
                  precision="fp64")
    ref = train(GRPOTrainer, GRPOConfig, model_dir, tokenizer, dataset, tmp_path / "trl", **config)
    dta = train(Counted, DTAGRPOConfig, model_dir, tokenizer, dataset, tmp_path / "dta", **config)
    assert_equivalent(ref, dta)
    assert [steps for steps, _, _ in forests] == [[0, 1], [2], [3], [4, 5]]
    assert all(len(calls) == 1 for _, calls, _ in forests), "not one engine call per forest"
    gains = []
    for _, (tree,), parts in forests:
        assert tree.n_sequences == sum(p.n_sequences for p in parts)
        assert tree.n_tree_tokens <= sum(p.n_tree_tokens for p in parts)
        gains.append(sum(p.n_tree_tokens for p in parts) - tree.n_tree_tokens)
    assert max(gains) > 0, "the step forests shared nothing beyond the micro-batches"
    assert [e["dta/micro_batches_per_forest"] for e in dta.logs] == [2.0, 1.0, 2.0]


def test_group_shuffle_warns_where_it_changes_the_updates(tmp_path, model_dir, tokenizer, dataset):
    for config, warned in (
        (dict(steps_per_generation=4, per_device_train_batch_size=2, gradient_accumulation_steps=2), True),
        (dict(steps_per_generation=2, gradient_accumulation_steps=2, loss_type="bnpo"), True),
        (dict(steps_per_generation=2, gradient_accumulation_steps=2, loss_type="dapo"), False),
    ):
        _checks._warned.discard("group_shuffle")
        DTAGRPOTrainer(model=model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                       args=make_args(DTAGRPOConfig, tmp_path, dta_group_shuffle=True, **config),
                       train_dataset=dataset, processing_class=tokenizer)
        assert ("group_shuffle" in _checks._warned) == warned, config


def test_trl_version_outside_the_tested_ones_warns(caplog):
    from trl_dta.trainers.config import TESTED_TRL_VERSIONS, check_trl_version

    _checks._warned.discard("trl_version")
    check_trl_version(TESTED_TRL_VERSIONS[0] + ".3")
    assert "trl_version" not in _checks._warned
    with caplog.at_level("WARNING", logger="trl_dta"):
        check_trl_version("1.99.0")
        check_trl_version("1.99.1")
    assert "trl_version" in _checks._warned
    assert [r.getMessage() for r in caplog.records].count(next(r.getMessage() for r in caplog.records)) == 1
    assert "TRL 1.99.0 is installed" in caplog.text


def test_duplicates_empty_and_truncated_completions(tmp_path, model_dir, tokenizer, dataset):
    # A strong <eos> bias and top-k sampling of 3-token completions: completions that are only <eos>, duplicates in a
    # group, and truncated completions (masked out entirely: their rows score no token).
    ref, _ = compare(tmp_path, model_dir, tokenizer, dataset, loss_type="grpo", max_completion_length=3, top_k=3,
                     generation_kwargs={"sequence_bias": [[[EOS], 4.5]]}, mask_truncated_completions=True, steps=3)
    groups = [ref.completions[i : i + 4] for i in range(0, len(ref.completions), 4)]
    assert [EOS] in ref.completions, "no empty completion"
    assert any(len({tuple(c) for c in g}) < len(g) for g in groups), "no duplicate completions"
    assert any(c[-1] != EOS for c in ref.completions), "no truncated completion"


def test_top_entropy_quantile_and_entropy_bonus(tmp_path, model_dir, tokenizer, dataset):
    # Not a sum over sequences: the exact two-pass path (TRL's loss on the first pass's log-probs, then the surrogate).
    compare(tmp_path, model_dir, tokenizer, dataset, top_entropy_quantile=0.5, entropy_coef=0.05, num_iterations=2)


def test_adaptive_entropy_bonus(tmp_path, model_dir, tokenizer, dataset):
    # One pass with the entropies' gradient; the controller (updated by TRL's own code) switches the bonus on at step 2.
    compare(tmp_path, model_dir, tokenizer, dataset, use_adaptive_entropy=True, entropy_coef=0.1,
            entropy_target=10.0, steps=3)


def test_off_policy_mask(tmp_path, model_dir, tokenizer, dataset):
    # A threshold away from 0: at the first step the policy is the old policy (KL = 0 up to rounding, kept).
    ref, _ = compare(tmp_path, model_dir, tokenizer, dataset, off_policy_mask_threshold=0.002, num_iterations=2,
                     learning_rate=0.2, loss_type="grpo")


class _NoWeightSync:
    """Stands in for the vLLM client, whose only use with a `rollout_func` is pushing weights to the vLLM server."""

    def sync_weights(self):
        pass


@torch.no_grad()
def _sampler_logprobs(model, prompt: list[int], completion: list[int], gen: torch.Generator) -> list[float]:
    """The model's own log-probs of the completion, perturbed like those of a separate inference engine."""
    ids = torch.tensor([prompt + completion])
    logps = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
    exact = logps.gather(-1, ids[0, len(prompt) :, None])[:, 0]
    return (exact + 0.05 * torch.randn(len(completion), generator=gen)).tolist()


def _rollout(prompts, trainer):
    """Deterministic rollouts with an environment mask (tool tokens) and sampling log-probs, as a vLLM rollout gives."""
    tok = trainer.processing_class
    model = trainer.accelerator.unwrap_model(trainer.model)
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
    for k, prompt in enumerate(prompts):
        ids = tok(prompt)["input_ids"]
        gen = torch.Generator().manual_seed(len(prompt) * 31 + k % 4)
        n = int(torch.randint(1, 7, (1,), generator=gen))
        completion = torch.randint(3, len(tok), (n,), generator=gen).tolist()
        if k % 4 == 0:
            completion = completion[:1] + [29, 30] + completion[1:]  # two environment tokens after the first
            mask = [1, 0, 0] + [1] * (len(completion) - 3)
        else:
            mask = [1] * len(completion)
        out["prompt_ids"].append(ids)
        out["completion_ids"].append(completion)
        out["env_mask"].append(mask)
        out["logprobs"].append(_sampler_logprobs(model, ids, completion, gen))
    return out


@pytest.mark.parametrize(
    "loss_type,mode", [("dapo", "token_truncate"), ("grpo", "sequence_mask"), ("vespo", "token_mask")]
)
def test_tool_mask_and_vllm_importance_sampling(tmp_path, model_dir, tokenizer, dataset, loss_type, mode):
    def setup(trainer):
        # The importance-sampling correction is TRL's vLLM path; vLLM itself cannot run here, so the rollouts come
        # from `rollout_func` (with sampling log-probs) and only the weight sync is stood in for.
        trainer.use_vllm = True
        trainer.vllm_importance_sampling_correction = True
        trainer.vllm_importance_sampling_mode = mode
        trainer.vllm_importance_sampling_clip_min = 0.5 if mode.endswith("mask") else None
        trainer.vllm_importance_sampling_clip_max = 2.0
        trainer.vllm_generation = _NoWeightSync()
        trainer._last_loaded_step = -1

    ref, dta = compare(tmp_path, model_dir, tokenizer, dataset, loss_type=loss_type, num_iterations=2,
                       trainer_kwargs={"rollout_func": _rollout}, setup=setup)
    assert "tool_mask" in dta.trainer._buffered_inputs[0]
    assert "importance_sampling_ratio" in dta.trainer._buffered_inputs[0]
    assert "sampling/importance_sampling_ratio/mean" in ref.logs[0]


def test_custom_compute_loss_subclass(tmp_path, model_dir, tokenizer, dataset):
    # A subclass's own objective cannot be decomposed blindly: it takes the exact two-pass path.
    def objective(self, model, inputs):
        loss = GRPOTrainer._compute_loss(self, model, inputs)
        return loss + 0.5 * loss**2

    ref_cls = type("SquaredGRPO", (GRPOTrainer,), {"_compute_loss": objective})
    dta_cls = type("SquaredDTAGRPO", (DTAGRPOTrainer,), {"_compute_loss": objective})
    compare(tmp_path, model_dir, tokenizer, dataset, ref_cls=ref_cls, dta_cls=dta_cls, num_iterations=2)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gradient_checkpointing_maps_to_graph_budget(tmp_path, model_dir, tokenizer, dataset, lora):
    # TRL's default gradient_checkpointing=True: DTA micro-batches run the engine's block recompute instead (blocks of
    # 4 tokens here, so the recompute path runs), with the same results. With PEFT, TRL also makes the embeddings'
    # output require grad (for HF checkpointing); DTA runs under that hook too.
    extra = {}
    if lora:
        extra = dict(learning_rate=0.5, trainer_kwargs={"peft_config": LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")})
    _, dta = compare(tmp_path, model_dir, tokenizer, dataset, gradient_checkpointing=True, num_iterations=2,
                     dta_config={**DTA, "dta_block_size": 4}, **extra)
    assert "gradient_checkpointing" in _checks._warned  # the user is told once
    engine = next(iter(dta.trainer._dta_engines.values()))
    assert engine.max_graph_tokens == 4
    assert engine.last_stats["recomputed_tokens"] > 0
    assert any(entry["dta/forward_tokens"] > entry["dta/tree_tokens"] for entry in dta.logs)


def test_dense_fallback_below_min_compression(tmp_path, model_dir, tokenizer, dataset):
    ref = train(GRPOTrainer, GRPOConfig, model_dir, tokenizer, dataset, tmp_path / "trl", num_iterations=2,
                precision="fp64")
    dta = train(DTAGRPOTrainer, DTAGRPOConfig, model_dir, tokenizer, dataset, tmp_path / "dta", num_iterations=2,
                dta_min_compression=100.0, precision="fp64")
    assert all(entry["dta/dense_fallback"] == 1.0 for entry in dta.logs)
    assert not any("dta/tree_tokens" in entry for entry in dta.logs)
    assert_equivalent(ref, dta)


@pytest.mark.parametrize("batch_size,accumulation", [(4, 2), (2, 4)], ids=["whole_groups", "split_groups"])
def test_group_shuffle_keeps_groups_and_matches_the_step(tmp_path, model_dir, tokenizer, dataset, batch_size,
                                                         accumulation):
    # With the loss normalised by the generation batch's token count (dapo) and one optimizer step per generation,
    # the step's gradient does not depend on how rows are grouped into micro-batches; the group-aware split draws the
    # same random permutation as TRL's shuffle, so generations stay identical too. Groups of 4: with micro-batches of
    # 4 each holds one whole group, with micro-batches of 2 each group is split once (the sizes force it).
    # Float64: the micro-batches differ from TRL's, so float32 rounding would differ in summation order too.
    config = dict(loss_type="dapo", steps=3, precision="fp64", per_device_train_batch_size=batch_size,
                  gradient_accumulation_steps=accumulation)
    ref = train(GRPOTrainer, GRPOConfig, model_dir, tokenizer, dataset, tmp_path / "trl", **config)
    dta = train(DTAGRPOTrainer, DTAGRPOConfig, model_dir, tokenizer, dataset, tmp_path / "dta", **config,
                dta_group_shuffle=True)
    for batch in dta.trainer._buffered_inputs:
        rows = {tuple(r) for r in batch["prompt_ids"].tolist()}
        assert len(rows) == 1, "a micro-batch holds more than one group"
    assert_params_close(ref, dta)
    assert_equivalent(ref, dta, compare_metrics=False)
    # A whole group per micro-batch compresses better than TRL's scattered rows, micro-batch by micro-batch; the
    # step's forest holds the same rows either way.
    scattered = train(DTAGRPOTrainer, DTAGRPOConfig, model_dir, tokenizer, dataset, tmp_path / "scattered", **config,
                      **DTA)
    grouped_ratio = sum(e["dta/compression_ratio_micro_batch"] for e in dta.logs)
    assert grouped_ratio > sum(e["dta/compression_ratio_micro_batch"] for e in scattered.logs)
    assert [e["dta/compression_ratio"] for e in dta.logs] == pytest.approx(
        [e["dta/compression_ratio"] for e in scattered.logs])


def test_resume_from_checkpoint_follows_the_same_trajectory(tmp_path, model_dir, tokenizer, dataset):
    config = dict(steps=4, save_strategy="steps", save_steps=2, num_iterations=1)
    full = train(DTAGRPOTrainer, DTAGRPOConfig, model_dir, tokenizer, dataset, tmp_path / "full", **config)
    resumed_trainer = DTAGRPOTrainer(
        model=model_dir,
        reward_funcs=full.trainer.reward_funcs[0],
        args=make_args(DTAGRPOConfig, tmp_path / "resumed", **config),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    resumed_trainer.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    # The same computation from the same state (weights, optimizer, random streams restored): bit for bit.
    for name, p in resumed_trainer.model.named_parameters():
        assert torch.equal(p, full.final[name]), f"{name} differs after resuming"
    losses = [e["loss"] for e in resumed_trainer.state.log_history if "loss" in e]
    assert losses[-2:] == [e["loss"] for e in full.logs][-2:]


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_evaluation_scores_through_the_engine(tmp_path, model_dir, tokenizer, dataset, precision):
    # Evaluation computes TRL's loss without grad: the log-probs come from `DTAEngine.logprobs`. Each logged value
    # within the float32 steps of a float64 model (`float64_rtol`), or float32 rounding through the model
    # (`float32_rtol`). Not in bf16: four scalar means, whose rounding errors in two computations have no useful
    # ratio; the bf16 precision of `DTAEngine.logprobs` is judged per token in tests/test_precision.py.
    results = []
    for cls, config_cls, extra in ((GRPOTrainer, GRPOConfig, {}), (DTAGRPOTrainer, DTAGRPOConfig, DTA)):
        args = make_args(config_cls, tmp_path / cls.__name__, per_device_eval_batch_size=8, precision=precision,
                         **extra)
        trainer = cls(model=model_dir, reward_funcs=lambda completion_ids, **kw: [len(c) / 4 for c in completion_ids],
                      args=args, train_dataset=dataset, eval_dataset=dataset, processing_class=tokenizer)
        if cls is DTAGRPOTrainer:
            calls = []
            engine = trainer._dta_engine(trainer.accelerator.unwrap_model(trainer.model))
            original = engine.logprobs
            engine.logprobs = lambda *a, **k: calls.append(1) or original(*a, **k)
        results.append((trainer, trainer.evaluate()))
    assert calls, "evaluation did not score through the engine"
    (trainer, ref), (_, dta) = results
    # The evaluation's tokens: 8 prompts x 4 completions, each at most 30 prompt + 6 completion tokens.
    bound = (float64_rtol if precision == "fp64" else float32_rtol)(Run(trainer, [], [], {}, {}), tokens=32 * 36)
    for key in ("eval_loss", "eval_entropy", "eval_reward", "eval_clip_ratio/region_mean"):
        assert dta[key] == pytest.approx(ref[key], rel=bound, abs=bound), key
