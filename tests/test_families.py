"""The family table (`trl_dta/modeling/families.py`): a family is one row. A model type registered here (a Llama
subclass under a new `model_type`) runs with the untested-family warning without a row, and through `DTAEngine`
without it once the table alone gains a tested row; the table's columns are what the modules read."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from conftest import FAMILIES as CONFTEST_FAMILIES
from conftest import shared_batch, use_input_dtype_norms
from reference import dense_logps, max_rel_err
from trl_dta import DTAEngine, _checks
from trl_dta.modeling import families
from trl_dta.modeling.families import FAMILIES, Family

MODEL_TYPE = "dta_test_llama"


class DTATestLlamaConfig(transformers.LlamaConfig):
    model_type = MODEL_TYPE


class DTATestLlamaForCausalLM(transformers.LlamaForCausalLM):
    config_class = DTATestLlamaConfig


transformers.AutoConfig.register(MODEL_TYPE, DTATestLlamaConfig, exist_ok=True)
transformers.AutoModelForCausalLM.register(DTATestLlamaConfig, DTATestLlamaForCausalLM, exist_ok=True)


def _model():
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(MODEL_TYPE, **CONFTEST_FAMILIES["llama"][1])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.float64)
    return use_input_dtype_norms(model.eval())


def _untested_warnings(caplog, monkeypatch, model) -> tuple[DTAEngine, list[str]]:
    monkeypatch.setattr(_checks, "_warned", set())
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        engine = DTAEngine(model, attn_backend="torch")
    return engine, [r.getMessage() for r in caplog.records if f"model type '{MODEL_TYPE}'" in r.getMessage()]


def test_a_family_is_one_row(caplog, monkeypatch):
    model = _model()
    assert model.config.model_type == MODEL_TYPE and MODEL_TYPE not in FAMILIES
    _, warned = _untested_warnings(caplog, monkeypatch, model)
    assert len(warned) == 1 and "not among the tested families" in warned[0], warned

    monkeypatch.setitem(FAMILIES, MODEL_TYPE, Family(tested=True))
    engine, warned = _untested_warnings(caplog, monkeypatch, model)
    assert warned == [] and MODEL_TYPE in families.model_types("tested")
    seqs = [s for s in shared_batch() if len(s) > 1][:4]
    out = engine.logprobs(seqs, entropy=True)
    with torch.no_grad():
        for seq, lp, ent in zip(seqs, out.logps, out.entropies):
            want_lp, want_ent = dense_logps(model, seq)
            assert max_rel_err(lp, want_lp) < 1e-10 and max_rel_err(ent, want_ent) < 1e-10


def test_a_rows_rule_refuses_its_configurations(monkeypatch):
    """The `rule` column alone refuses a configuration (a `Blocker`, named in the refusal)."""
    monkeypatch.setitem(FAMILIES, MODEL_TYPE, Family(tested=True, rule=lambda config: families._ALIBI))
    with pytest.raises(ValueError, match="ALiBi"):
        DTAEngine(_model(), attn_backend="torch")


def test_the_tables_columns():
    """The snapshots are the table's columns; every hybrid has FLOP fields, every MoE row an expert count field."""
    assert families.TESTED_MODEL_TYPES == {t for t, f in FAMILIES.items() if f.tested}
    assert families.RECURRENT_FAMILIES == {t: f.recurrent for t, f in FAMILIES.items() if f.recurrent}
    assert families.ROUTER_LOSS_FAMILIES == {t: f.experts for t, f in FAMILIES.items() if f.experts}
    assert all(f.flops is not None for f in FAMILIES.values() if f.recurrent)
    assert {"bloom", "mpt", "falcon"} <= {t for t, f in FAMILIES.items() if f.rule is not None}
