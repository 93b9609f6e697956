"""`DTAGRPOTrainer`'s construction and config: the settings and models it refuses (with the message that names the
fix), the `dta_*` fields' validation and documentation, `dta_enabled=False` as TRL's trainer, and a plain `GRPOConfig`
or the argument parser giving DTA's defaults. The trainings against TRL's are in `test_grpo.py`.
"""

from __future__ import annotations

import re

import pytest
import torch
from peft import PromptTuningConfig
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM
from trl import GRPOConfig, GRPOTrainer

from trl_dta.trainers import DTAGRPOConfig, DTAGRPOTrainer

from .conftest import assert_equivalent, build_model, train

# ------------------------------------------------------------------ construction errors


def _make(tmp_path, tokenizer, dataset, model, peft_config=None, **config):
    args = DTAGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                         per_device_train_batch_size=4, num_generations=4, **config)
    return DTAGRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config)


@pytest.mark.parametrize(
    "case,message",
    [
        ("fp16", "`fp16=True` is not supported with DTA"),
        ("liger", "`use_liger_kernel=True` is not supported with DTA"),
        ("lomo", "fuses the optimizer step into `backward`"),
        ("attention_dropout", "attention dropout is active (attention_dropout=0.1)"),
        ("moe_router_jitter", "`router_jitter_noise=0.1`"),
        ("moe_aux_loss_other_family", "set `router_aux_loss_coef=0.0`"),
        ("prompt_tuning", "prompt-learning adapters"),
        ("dynamic_rope", "rope_type 'dynamic'"),
    ],
)
def test_construction_errors(tmp_path, model_dir, tokenizer, dataset, case, message):
    model, peft_config, config = model_dir, None, {}
    if case == "fp16":
        config = {"fp16": True}
    elif case == "liger":
        config = {"use_liger_kernel": True}
    elif case == "lomo":
        config = {"optim": "lomo"}
    elif case == "attention_dropout":
        model = build_model(len(tokenizer), attention_dropout=0.1)
    elif case == "moe_router_jitter":  # random routing noise in training: no run reproduces another
        torch.manual_seed(0)
        model = MixtralForCausalLM(MixtralConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
            router_jitter_noise=0.1,
        ))
    elif case == "moe_aux_loss_other_family":  # a router loss outside `ROUTER_LOSS_FAMILIES`
        torch.manual_seed(0)
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            num_experts=2, num_experts_per_tok=1,
        ))
    elif case == "prompt_tuning":
        peft_config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    elif case == "dynamic_rope":
        model = build_model(len(tokenizer), rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                             "rope_theta": 10000.0})
    with pytest.raises((ValueError, NotImplementedError), match=re.escape(message)):
        _make(tmp_path, tokenizer, dataset, model, peft_config=peft_config, **config)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("dta_block_size", 0, "`dta_block_size` must be a positive integer"),
        ("dta_max_batch_tokens", -1, "`dta_max_batch_tokens` must be a positive integer"),
        ("dta_max_graph_tokens", -5, "`dta_max_graph_tokens` must be None or a non-negative integer"),
        ("dta_min_compression", float("nan"), "`dta_min_compression` must be a finite number"),
        ("dta_min_compression", float("inf"), "`dta_min_compression` must be a finite number"),
        ("dta_min_compression", -0.5, "`dta_min_compression` must be a finite number >= 0.0"),
        ("dta_max_pack_tokens", -1, "`dta_max_pack_tokens` must be None or a non-negative integer"),
        ("dta_cost_model", "linear", "`dta_cost_model` must be one of ['default', 'fit']"),
        ("dta_block_size", True, "`dta_block_size` must be a positive integer"),
        ("dta_max_batch_tokens", 2.0, "`dta_max_batch_tokens` must be a positive integer"),
        ("dta_max_graph_tokens", 64.0, "`dta_max_graph_tokens` must be None or a non-negative integer"),
        ("dta_min_compression", True, "`dta_min_compression` must be a finite number"),
        ("dta_min_compression", "1.1", "`dta_min_compression` must be a finite number"),
        ("dta_enabled", 1, "`dta_enabled` must be True or False"),
        ("dta_group_shuffle", "yes", "`dta_group_shuffle` must be True or False"),
        ("dta_balance", None, "`dta_balance` must be True or False"),
        ("dta_cost_model", None, "`dta_cost_model` must be one of"),
        ("dta_attn_backend", "fast", "`dta_attn_backend` must be one of"),
        ("dta_attn_backend", None, "`dta_attn_backend` must be one of"),
        ("dta_sample_layout", "turns", "`dta_sample_layout` must be one of"),
        ("dta_fsdp_schedule", "per_layer", "`dta_fsdp_schedule` must be one of ['layer', 'window']"),
    ],
)
def test_config_validation(tmp_path, field, value, message):
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        DTAGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **{field: value})


def test_config_documents_every_field():
    from dataclasses import fields

    from trl_dta.trainers.config import DTAArguments

    doc = " ".join(DTAGRPOConfig.__doc__.split())
    for f in fields(DTAArguments):
        assert f.name in {g.name for g in fields(DTAGRPOConfig)}
        assert " ".join(f.metadata["help"].split()) in doc, f"{f.name}: help text missing from the docstring"
    assert re.search(r"dta_enabled \(`bool`, \*optional\*, defaults to `True`\)", doc)


def test_disabled_is_trl(tmp_path, model_dir, tokenizer, dataset):
    ref = train(GRPOTrainer, GRPOConfig, model_dir, tokenizer, dataset, tmp_path / "trl")
    dta = train(DTAGRPOTrainer, DTAGRPOConfig, model_dir, tokenizer, dataset, tmp_path / "dta", dta_enabled=False)
    assert not any(k.startswith("dta/") for entry in dta.logs for k in entry)
    assert_equivalent(ref, dta, rtol=0.0, atol=0.0)


def test_plain_trl_config_and_argument_parser(tmp_path, model_dir, tokenizer, dataset):
    from transformers import HfArgumentParser

    # A plain GRPOConfig gets the DTA defaults.
    run = train(DTAGRPOTrainer, GRPOConfig, model_dir, tokenizer, dataset, tmp_path, steps=1)
    assert run.trainer._dta.dta_enabled and not run.trainer._dta.dta_group_shuffle
    assert "dta/dense_fallback" in run.logs[0]
    (args,) = HfArgumentParser(DTAGRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--dta_max_graph_tokens", "64", "--dta_enabled", "false"]
    )
    assert args.dta_max_graph_tokens == 64 and args.dta_enabled is False
