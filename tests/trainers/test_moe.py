"""MoE models in the DTA trainers with TRL's router settings: the load-balancing auxiliary loss is on (TRL 1.16 turns
it on for every MoE config that declares `router_aux_loss_coef`), and DTA's updates, logged loss and `aux_loss` equal
TRL's, for GRPO and RLOO and each family of `ROUTER_LOSS_FAMILIES`.

The families' own coefficient (0.001) moves the updates by little, so each case also runs with a coefficient of 1.0,
where the router loss changes TRL's update by far more than the tolerance (checked), so that a wrong router gradient
cannot pass. The comparisons run in float64 (the experts in their eager implementation: the grouped-matmul one has no
float64), within the float32 steps a float64 MoE model keeps (TRL's head, the norms, the routers' softmax:
`conftest.float64_rtol`); one float32 case (GRPO, the families' coefficient, the default grouped experts) is judged
against TRL's float64 run like every float32 case (`conftest.assert_as_precise_run`).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from hybrid_models import MOE as HYBRID_MOE
from moe_models import MOE_FAMILIES
from trl_dta.modeling.families import ROUTER_LOSS_FAMILIES
from trl_dta.trainers import DTAGRPOConfig, DTAGRPOTrainer, DTARLOOConfig, DTARLOOTrainer

from .conftest import DTA, EOS, PAD, Run, assert_equivalent, compare_in_precision, float64_rtol, make_args, train

TRAINERS = {
    "grpo": (GRPOTrainer, GRPOConfig, DTAGRPOTrainer, DTAGRPOConfig),
    "rloo": (RLOOTrainer, RLOOConfig, DTARLOOTrainer, DTARLOOConfig),
}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, tokenizer) -> dict[str, str]:
    """Each MoE family saved to a folder with the tokenizer (loaded by name, as TRL users do)."""
    dirs = {}
    for family, make in MOE_FAMILIES.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make(len(tokenizer), initializer_range=0.2))
        for key, value in dict(pad_token_id=PAD, eos_token_id=EOS).items():
            setattr(model.generation_config, key, value)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs[family] = str(path)
    return dirs


# float64 runs: the experts in their eager form (the grouped matmul has no float64).
EAGER = {"model_init_kwargs": {"experts_implementation": "eager"}}


def run_pair(kind, model_dir, tokenizer, dataset, tmp_path, precision="fp64", **config):
    trl_cls, trl_config, dta_cls, dta_config = TRAINERS[kind]
    config = {**(EAGER if precision == "fp64" else {}), **config}
    ref = train(trl_cls, trl_config, model_dir, tokenizer, dataset, tmp_path / "trl", precision=precision, **config)
    dta = train(dta_cls, dta_config, model_dir, tokenizer, dataset, tmp_path / "dta", precision=precision, **config,
                **DTA)
    return ref, dta


def update_difference(a, b) -> float:
    """`max |update_a - update_b| / max |update_b|` over the trained tensors (0 when nothing moved)."""
    worst = 0.0
    for name, p in b.final.items():
        size = (p - b.initial[name]).abs().max().item()
        if size:
            worst = max(worst, (a.final[name] - p).abs().max().item() / size)
    return worst


def test_every_router_loss_family_is_tested():
    """The attention-only MoE families here; the hybrids' in `test_hybrid.py`."""
    assert set(MOE_FAMILIES) | set(HYBRID_MOE) == set(ROUTER_LOSS_FAMILIES)


@pytest.mark.slow
@pytest.mark.parametrize("coef", [None, 1.0], ids=["family_coef", "coef_1"])
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
@pytest.mark.parametrize("kind", list(TRAINERS))
def test_router_loss_matches_trl(tmp_path, moe_dirs, tokenizer, dataset, kind, family, coef):
    config = {} if coef is None else {"router_aux_loss_coef": coef}
    ref, dta = run_pair(kind, moe_dirs[family], tokenizer, dataset, tmp_path, **config)
    assert ref.trainer.aux_loss_enabled and dta.trainer.aux_loss_enabled
    assert dta.trainer.router_aux_loss_coef == (coef if coef is not None else 0.001)
    assert all(entry["dta/dense_fallback"] == 0.0 for entry in dta.logs if "dta/dense_fallback" in entry)
    assert any("dta/tree_tokens" in entry for entry in dta.logs), "no micro-batch ran through DTA"
    assert all("aux_loss" in entry for entry in dta.logs)  # compared with TRL's by assert_equivalent
    worst = assert_equivalent(ref, dta)
    print(f"{kind} {family} coef={coef}: {worst}")
    if coef is not None and kind == "grpo":  # once per family: the router loss matters at this coefficient
        no_aux = train(TRAINERS[kind][0], TRAINERS[kind][1], moe_dirs[family], tokenizer, dataset,
                       tmp_path / "trl_no_aux", precision="fp64", **{**EAGER, **config, "router_aux_loss_coef": 0.0})
        # Without its router gradient DTA would end at `no_aux`: that must be far outside the tolerance.
        assert update_difference(no_aux, ref) > 10 * float64_rtol(ref), "the router loss does not move the update"


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_router_loss_float32(tmp_path, moe_dirs, tokenizer, dataset, family):
    """float32 with the default (grouped-matmul) experts, judged against TRL's float64 run (eager experts)."""
    trl_cls, trl_config, dta_cls, dta_config = TRAINERS["grpo"]
    compare_in_precision("fp32", trl_cls, trl_config, dta_cls, dta_config, moe_dirs[family], tokenizer, dataset,
                         tmp_path, reference_config=EAGER)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(TRAINERS))
def test_evaluation_with_the_router_loss(tmp_path, moe_dirs, tokenizer, dataset, kind):
    """Evaluation's loss (no grad) includes the router loss; DTA scores it through the engine."""
    trl_cls, trl_config, dta_cls, dta_config = TRAINERS[kind]
    results = []
    for cls, config_cls in ((trl_cls, trl_config), (dta_cls, dta_config)):
        args = make_args(config_cls, tmp_path / cls.__name__, per_device_eval_batch_size=8, precision="fp64", **EAGER)
        trainer = cls(model=moe_dirs["qwen3_moe"], reward_funcs=lambda completion_ids, **kw: [len(c) / 4 for c in
                      completion_ids], args=args, train_dataset=dataset, eval_dataset=dataset.select(range(2)),
                      processing_class=tokenizer)
        if cls is dta_cls:
            calls = []
            engine = trainer._dta_engine(trainer.accelerator.unwrap_model(trainer.model))
            original = engine.logprobs
            engine.logprobs = lambda *a, **k: calls.append(k.get("router_loss")) or original(*a, **k)
        results.append(trainer.evaluate())
    assert any(request is not None for request in calls), "the router loss was not scored through the engine"
    ref, dta = results
    assert ref["eval_aux_loss"] > 0
    # 2 prompts x 4 completions of at most 30 + 6 tokens.
    bound = float64_rtol(Run(trainer, [], [], {}, {}), tokens=8 * 36)
    for key in ("eval_loss", "eval_aux_loss", "eval_entropy", "eval_reward"):
        assert dta[key] == pytest.approx(ref[key], rel=bound, abs=bound), key


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_router_loss_in_the_two_pass_path(tmp_path, moe_dirs, tokenizer, dataset, family):
    """`top_entropy_quantile < 1` (TRL's entropy mask over each micro-batch) takes the two-pass path."""
    ref, dta = run_pair("grpo", moe_dirs[family], tokenizer, dataset, tmp_path, top_entropy_quantile=0.5,
                        router_aux_loss_coef=1.0)
    assert_equivalent(ref, dta)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(TRAINERS))
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_router_loss_bf16_autocast(tmp_path, moe_dirs, tokenizer, dataset, kind, family):
    """TRL's default precision (`bf16=True` autocast over the float32 model loaded by name, the router loss on): DTA's
    update differs from TRL's bf16 update by no more than TRL's bf16 update differs from its float32 update (the
    harness's `assert_bf16_bar`). One optimizer step: the bar needs the bf16 and float32 runs to sample the same
    completions, which a second generation after a bf16 update need not (RLOO, Mixtral)."""
    trl_cls, trl_config, dta_cls, dta_config = TRAINERS[kind]
    compare_in_precision("trl", trl_cls, trl_config, dta_cls, dta_config, moe_dirs[family], tokenizer,
                         dataset, tmp_path, steps=1)
