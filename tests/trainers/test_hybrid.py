"""Hybrid models (recurrent layers beside attention, `trl_dta/recurrent/`) in the DTA trainers against TRL's, with
TRL's and DTA's defaults (TRL's router loss on for the MoE hybrids), parameter updates under SGD:

- "fp32": both trainers in float64 with the recurrences' float32 casts removed (`hybrid_models.float64_internals`):
  DTA's update equals TRL's within the float32 steps TRL keeps in a float64 model (`conftest.assert_equivalent`,
  `float64_rtol`: TRL's chunked LM head computes log-probs in float32 whatever the model's dtype,
  `trl/kernels/chunked_logprob.py`); and both
  in float32, the stock arithmetic: DTA's update no farther from that float64 update than the derived multiple of
  TRL's float32 update is (`conftest.assert_as_precise_run`, relative L2 over all parameters). A plain 1e-4 bar on
  the float32 updates
  would measure rounding: transformers' delta rule and Mamba2 scan round in float32, and the decay parameters'
  gradients (sums of large terms of both signs) amplify it (measured: TRL's and DTA's float32 updates 1.4e-4 apart on a
  norm weight of Qwen3.5, each within 2e-6 of the float64 update in L2).
- "trl": TRL's default bf16 autocast, within TRL's own bf16 error (`conftest.assert_bf16_bar`).

The two recurrences (Gated DeltaNet: Qwen3.5; Mamba2: Nemotron-H) each run GRPO and RLOO, full and LoRA, float32 and
bf16 in two complementary Latin squares (every trainer with both adapters and both precisions over the two families);
the other families once each.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from hybrid_models import HYBRID_FAMILIES, MOE, float64_internals, make_hybrid
from trl_dta.trainers import DTAGRPOConfig, DTAGRPOTrainer, DTARLOOConfig, DTARLOOTrainer

from .conftest import BOS, EOS, PAD, assert_as_precise_run, assert_equivalent, compare_in_precision, train, update_gap

TRAINERS = {"grpo": (GRPOTrainer, GRPOConfig, DTAGRPOTrainer, DTAGRPOConfig),
            "rloo": (RLOOTrainer, RLOOConfig, DTARLOOTrainer, DTARLOOConfig)}
# LoRA on the attention, MLP and recurrent input projections (PEFT refuses Mamba's `out_proj` and `conv1d`).
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "in_proj", "in_proj_qkv"],
                  task_type="CAUSAL_LM")
# TRL 1.16's own dense path fails on Granite-4 hybrid with its default router loss: its fused forward reads
# `text_config.num_experts` (`trl/trainer/utils.py`, `_fused_forward`), which GraniteMoeHybridConfig names
# `num_local_experts`. The comparison with TRL therefore runs without it; DTA's router loss for the family is tested
# against transformers' function in `tests/engine/test_router_loss.py`.
TRL_CONFIG = {"granitemoehybrid": {"router_aux_loss_coef": 0.0}}

# (family, trainer, adapter, precision); the first of each recurrence is the fast one.
CASES = [
    ("qwen3_5_text", "grpo", "full", "fp32"),
    ("qwen3_5_text", "rloo", "lora", "fp32"),
    ("qwen3_5_text", "grpo", "lora", "trl"),
    ("qwen3_5_text", "rloo", "full", "trl"),
    ("nemotron_h", "rloo", "full", "fp32"),
    ("nemotron_h", "grpo", "lora", "fp32"),
    ("nemotron_h", "rloo", "lora", "trl"),
    ("nemotron_h", "grpo", "full", "trl"),
    ("qwen3_next", "grpo", "full", "fp32"),
    ("granitemoehybrid", "rloo", "full", "fp32"),
    ("bamba", "grpo", "lora", "trl"),
    ("falcon_h1", "rloo", "full", "trl"),
]
FAST = {("qwen3_5_text", "grpo", "full", "fp32"), ("nemotron_h", "rloo", "full", "fp32")}


def _cases():
    return [pytest.param(*case, id="-".join(case), marks=[] if case in FAST else [pytest.mark.slow])
            for case in CASES]


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory, tokenizer):
    """Each hybrid family's tiny model saved to a folder with the test tokenizer (TRL loads it by name in float32 and
    reloads the reference model from it)."""
    dirs = {}
    for family in HYBRID_FAMILIES:
        model = make_hybrid(family, torch.float32, vocab=len(tokenizer))  # pad, bos, eos: 0, 1, 2 as the tokenizer's
        assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (PAD, BOS, EOS)
        with torch.no_grad():  # peaked enough that sampling gives repeats and early <eos>
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        for key, value in dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS).items():
            setattr(model.generation_config, key, value)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs[family] = str(path)
    return dirs


def _float32_against_float64(family, trainer, kwargs, model_dir, tokenizer, dataset, tmp_path, **config):
    """The "fp32" regime (module docstring); returns DTA's run and the measured gaps."""
    ref_cls, ref_config, dta_cls, dta_config = TRAINERS[trainer]
    init = {"dtype": torch.float64, **({"experts_implementation": "eager"} if family in MOE else {})}
    runs = {}
    with float64_internals(family):
        for name, cls, config_cls in (("trl64", ref_cls, ref_config), ("dta64", dta_cls, dta_config)):
            runs[name] = train(cls, config_cls, model_dir, tokenizer, dataset, tmp_path / name, trainer_kwargs=kwargs,
                               model_init_kwargs=init, **config)
    for name, cls, config_cls in (("trl32", ref_cls, ref_config), ("dta32", dta_cls, dta_config)):
        runs[name] = train(cls, config_cls, model_dir, tokenizer, dataset, tmp_path / name, trainer_kwargs=kwargs,
                           **config)
    exact = assert_equivalent(runs["trl64"], runs["dta64"])
    gaps = {"float64": exact["param"], "trl32_vs_64": update_gap(runs["trl32"], runs["trl64"]),
            "dta32_vs_64": update_gap(runs["dta32"], runs["trl64"]),
            "dta32_vs_trl32": update_gap(runs["dta32"], runs["trl32"]),
            "ratio": assert_as_precise_run(runs["trl32"], runs["dta32"], runs["trl64"])}
    for run in runs.values():
        if run.trainer.__class__ is dta_cls:
            assert all(entry["dta/dense_fallback"] == 0.0 for entry in run.logs if "dta/dense_fallback" in entry)
    return runs["dta32"], gaps


@pytest.mark.parametrize("family,trainer,adapter,precision", _cases())
def test_matches_trl(tmp_path, hybrid_dirs, tokenizer, dataset, family, trainer, adapter, precision):
    ref_cls, ref_config, dta_cls, dta_config = TRAINERS[trainer]
    kwargs = {"peft_config": LORA} if adapter == "lora" else {}
    config = TRL_CONFIG.get(family, {})
    if precision == "fp32":
        dta, gaps = _float32_against_float64(family, trainer, kwargs, hybrid_dirs[family], tokenizer, dataset,
                                             tmp_path, **config)
    else:
        _, dta, gaps = compare_in_precision(precision, ref_cls, ref_config, dta_cls, dta_config, hybrid_dirs[family],
                                            tokenizer, dataset, tmp_path, return_gaps=True, trainer_kwargs=kwargs,
                                            **config)
    engine = dta.trainer._dta_engine(dta.trainer.accelerator.unwrap_model(dta.trainer.model))
    assert engine.layout.hybrid
    assert dta.trainer.aux_loss_enabled == (family in MOE and family not in TRL_CONFIG)  # TRL's router loss
    print(f"{family} {trainer} {adapter} {precision}: {gaps}")
