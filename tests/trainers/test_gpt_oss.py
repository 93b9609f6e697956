"""GPT-OSS (attention sinks, sliding and full layers alternating, a biased MoE router) in the DTA trainers with TRL's
router loss on, as TRL's defaults run it: what TRL's own GRPO/RLOO tests run on its tiny GPT-OSS, LoRA against TRL in
the harness's three regimes (float64, float32 against TRL's float64 run, TRL's bf16 autocast), and two processes under
DDP and FSDP2 (the gathered window), in float64 and under bf16 autocast. The full-model comparisons with TRL are
`test_moe.py`'s, which runs every family of `ROUTER_LOSS_FAMILIES`.

GPT-OSS's experts run their grouped matmul by default, which has no float64: every float64 run loads them in their
eager loop (`experts_implementation="eager"`). The measured gaps go to the file named by `DTA_PRECISION_LOG`, if set,
for the record."""

from __future__ import annotations

import json
import os

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from moe_models import MOE_FAMILIES
from trl_dta.trainers import DTAGRPOConfig, DTAGRPOTrainer, DTARLOOConfig, DTARLOOTrainer

from .conftest import EOS, PAD, compare_in_precision
from .test_distributed import run as launch_ddp
from .test_sharded import FSDP2, assert_window_collectives, launch

pytestmark = pytest.mark.slow

TRAINERS = {"grpo": (GRPOTrainer, GRPOConfig, DTAGRPOTrainer, DTAGRPOConfig),
            "rloo": (RLOOTrainer, RLOOConfig, DTARLOOTrainer, DTARLOOConfig)}
# Attention and MLP-free LoRA: GPT-OSS's experts are parameters (no `nn.Linear` to adapt), its attention projections
# are `nn.Linear`.
LORA = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, tokenizer) -> str:
    """The tiny GPT-OSS of `moe_models.py` (window 4 on its sliding layers, 4 experts, 2 routed) saved with the test
    tokenizer, peaked enough that sampling gives repeats and early `<eos>`."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MOE_FAMILIES["gpt_oss"](len(tokenizer), initializer_range=0.2))
    for key, value in dict(pad_token_id=PAD, eos_token_id=EOS).items():
        setattr(model.generation_config, key, value)
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def record(**entry) -> None:
    if os.environ.get("DTA_PRECISION_LOG"):
        with open(os.environ["DTA_PRECISION_LOG"], "a") as f:
            f.write(json.dumps({"family": "gpt_oss", **entry}) + "\n")


@pytest.mark.parametrize("kind", list(TRAINERS))
def test_trl_defaults_train_and_evaluate(tmp_path, gpt_oss_dir, tokenizer, dataset, kind):
    """Every config field at TRL's default (bf16 autocast over the float32 model loaded by name, gradient
    checkpointing, the router loss with GPT-OSS's own coefficient), batch sizes and lengths shrunk for CPU: two steps
    and an evaluation through DTA, the router loss in the logged loss, no micro-batch on TRL's dense path."""
    _, _, dta_cls, dta_config = TRAINERS[kind]
    args = dta_config(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                      per_device_eval_batch_size=4, max_completion_length=8, max_steps=2, logging_steps=1,
                      report_to="none", save_strategy="no", disable_tqdm=True)
    assert args.bf16 and args.gradient_checkpointing and args.router_aux_loss_coef is None  # TRL's defaults
    trainer = dta_cls(model=gpt_oss_dir, reward_funcs=lambda completion_ids, **kw: [len(set(c)) - 0.3 * len(c) for c
                      in completion_ids], args=args, train_dataset=dataset, eval_dataset=dataset,
                      processing_class=tokenizer)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.001  # GPT-OSS's own coefficient
    assert trainer.accelerator.mixed_precision == "bf16"
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(entry["dta/dense_fallback"] == 0.0 for entry in logs)
    assert all(entry["dta/tree_tokens"] < entry["dta/tokens"] for entry in logs), "no prefix was shared"
    assert all(entry["aux_loss"] > 0 for entry in logs)
    results = trainer.evaluate()
    assert all(torch.isfinite(torch.tensor(results[k])) for k in ("eval_loss", "eval_entropy", "eval_aux_loss"))


# float64 runs: the experts in their eager form (the grouped matmul has no float64).
EAGER = {"model_init_kwargs": {"experts_implementation": "eager"}}


@pytest.mark.parametrize(("kind", "precision"), [("grpo", "fp32"), ("rloo", "fp64"), ("grpo", "trl")],
                         ids=["grpo-fp32", "rloo-fp64", "grpo-bf16"])
def test_lora_matches_trl(tmp_path, gpt_oss_dir, tokenizer, dataset, kind, precision):
    """LoRA on the attention projections, TRL's router loss on (GPT-OSS's coefficient), the harness's regimes
    (`conftest.compare_in_precision`): float64 (the exactness question) within `float64_rtol` of TRL's updates;
    float32 (the default grouped experts) as precise as TRL's float32 run against TRL's float64 one; TRL's bf16
    autocast within TRL's own bf16 error. RLOO scores its default reference (`beta=0.05`) with the adapter
    disabled."""
    ref_cls, ref_config, dta_cls, dta_config = TRAINERS[kind]
    extra = {"fp64": EAGER, "fp32": {"reference_config": EAGER}}.get(precision, {})
    ref, dta, gaps = compare_in_precision(precision, ref_cls, ref_config, dta_cls, dta_config, gpt_oss_dir, tokenizer,
                                          dataset, tmp_path, trainer_kwargs={"peft_config": LORA}, return_gaps=True,
                                          **extra)
    if precision == "fp64":
        assert {p.dtype for p in dta.final.values()} == {torch.float64}
    assert dta.trainer.aux_loss_enabled and all("aux_loss" in entry for entry in dta.logs)
    assert all("lora_" in name for name in dta.final)
    record(trainer=kind, precision=precision, peft="lora", **gaps)


# Two processes: (engine, trainer, LoRA, precision). "fp64": the exactness question, the model loaded in float64 (the
# experts' eager loop), every update within `float64_rtol` of TRL's on the same engine; "trl": TRL's bf16 autocast,
# `assert_bf16_runs` (TRL's float32 and bf16 runs and DTA's in one launch, at a tenth of the learning rate).
TWO_PROCESSES = [("ddp", "grpo", 0, "fp64"), ("ddp", "rloo", 1, "trl"), ("fsdp2", "rloo", 1, "fp64"),
                 ("fsdp2", "grpo", 0, "trl")]


@pytest.mark.distributed
@pytest.mark.parametrize(("engine", "kind", "peft", "precision"), TWO_PROCESSES,
                         ids=["-".join(map(str, case)) for case in TWO_PROCESSES])
def test_two_processes(tmp_path, gpt_oss_dir, engine, kind, peft, precision):
    """Two processes, the router loss on, TRL's and DTA's trainers in one launch on one fixed global batch
    (`dist_run.py`): DDP (MULTI_CPU), and FSDP2 (DTensor parameters, asserted) with DTA's gathered window
    (`dta_fsdp_schedule="window"`, the default: one all-gather per group and one reduce-scatter per trainable group
    per step). float64: updates within `float64_rtol` of TRL's on the same engine; TRL's bf16 autocast (under FSDP2
    with its bf16 `MixedPrecisionPolicy`): within TRL's bf16 error."""
    from .test_distributed import BF16_RUNS, assert_bf16_runs, compare

    variants = "trl,dta" if precision == "fp64" else "trl@fp32,trl,dta"
    flags = dict(trainer=kind, peft=peft, steps=2, **(BF16_RUNS if precision == "trl" else {"precision": "fp64"}))
    if engine == "ddp":
        runs = launch_ddp(tmp_path / "run.pt", gpt_oss_dir, 2, variants=variants, **flags)
    else:
        runs = launch(tmp_path, gpt_oss_dir, FSDP2, variants, "fsdp2", **flags)
    assert all(log["aux_loss"] > 0 for run in runs.values() for log in run["logs"])
    # One generation per optimizer step, where `dta_balance` would exchange prompt groups between the ranks; the
    # router loss is non-linear over each micro-batch, so the ranks keep TRL's rows (`regrouping_changes`). Balanced,
    # the updates differed from TRL's by 2e-5 to 6e-5 of the parameters' size in float64.
    assert not any("dta/rank_cost_imbalance" in log for run in runs.values() for log in run["logs"])
    if precision == "trl":
        gaps = assert_bf16_runs(runs)["dta"]
        record(trainer=kind, engine=engine, peft=peft, precision=precision, **gaps)
        return
    assert {p.dtype for run in runs.values() for p in run["params"].values()} == {torch.float64}
    if peft:  # LoRA B starts at zero
        initial = {n: torch.zeros_like(p) for n, p in runs["trl"]["params"].items() if "lora_B" in n}
    else:
        initial = {n: p.detach().double() for n, p in AutoModelForCausalLM.from_pretrained(
            gpt_oss_dir).named_parameters()}
    worst = compare(runs["trl"], runs["dta"], initial, gpt_oss_dir)
    assert all(log["dta/dense_fallback"] == 0.0 for log in runs["dta"]["logs"])
    if engine == "fsdp2":
        assert_window_collectives(runs["dta"], runs["trl"])
    record(trainer=kind, engine=engine, peft=peft, precision=precision, update_error=worst)
