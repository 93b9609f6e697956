"""Hybrid models (`trl_dta/recurrent/`) on two processes: DDP (MULTI_CPU) and FSDP2's gathered window, DTA against TRL's
trainer under the same engine on one fixed global batch (`dist_run.py`), one launch per family and engine training
every variant one after the other:

- float64 (the recurrences' float32 casts removed, `dist_run.py --precision fp64`): DTA's parameters within 1e-5 of
  their size and 1e-4 of their update of TRL's (`test_distributed.compare`). Not float32: there the decay parameters'
  updates are a few float32 ulps of the parameters at the tests' learning rates, so the parameters' own rounding is
  about 1e-3 of the update (measured 9e-10 on an update of 4e-7), whatever computes them;
- TRL's default bf16: DTA's update within TRL's own bf16 error (`conftest.assert_bf16_bar`); every run asserts the
  dtypes its optimizer steps ran in (`run_probes.assert_precision`), the FSDP2 runs that their parameters were DTensors;
- FSDP2's per-layer schedule (`dta_fsdp_schedule="layer"`, packed rows in lockstep) refused at construction, naming
  the window schedule.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_models import make_hybrid

from .conftest import build_tokenizer
from .test_distributed import BF16_RUNS, assert_bf16_runs, compare, run
from .test_sharded import FSDP2, launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FAMILIES = ("qwen3_5_text", "nemotron_h")
# accelerate's transformer-based wrap reads the model's `_no_split_modules`, which for `Qwen3_5ForCausalLM` also names
# the multimodal model's `Qwen3_5VisionBlock` (absent from the text model: "Could not find the transformer layer
# class"); the decoder layer class is named instead, as a user of the text model must.
WRAP = {"qwen3_5_text": ["--fsdp_transformer_layer_cls_to_wrap=Qwen3_5DecoderLayer"]}
VARIANTS = "trl@fp64,dta@fp64,trl@fp32,trl,dta"
REFUSED = "dta_layer"  # FSDP2 only (the schedule means nothing elsewhere); first: a launch ends after its last run


@pytest.fixture(scope="module", params=FAMILIES)
def hybrid_dir(request, tmp_path_factory) -> tuple[str, str]:
    tokenizer = build_tokenizer()
    model = make_hybrid(request.param, torch.float32, vocab=len(tokenizer))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return request.param, str(path)


def _initial(model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    return {n: p.detach().double() for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}


def _check(runs: dict, model_dir: str) -> dict:
    if REFUSED in runs:
        refused = runs.pop(REFUSED)
        assert refused["refused"] == "DTAUnsupportedError", refused
        assert "dta_fsdp_schedule='window'" in refused["message"], refused
    worst = compare(runs["trl@fp64"], runs["dta@fp64"], _initial(model_dir), model_dir)
    assert all(log["dta/dense_fallback"] == 0.0 for log in runs["dta@fp64"]["logs"])
    gaps = assert_bf16_runs({k: v for k, v in runs.items() if not k.endswith("@fp64")})
    return {"fp64_update": worst, **gaps["dta"]}


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_two_processes_match_trl(tmp_path, hybrid_dir, engine):
    family, model_dir = hybrid_dir
    if engine == "ddp":
        runs = run(tmp_path / "run.pt", model_dir, 2, trainer="grpo", variants=VARIANTS, **BF16_RUNS)
    else:
        runs = launch(tmp_path, model_dir, FSDP2 + WRAP.get(family, []), f"{REFUSED},{VARIANTS}", "fsdp2",
                      trainer="rloo", refused=REFUSED, steps=3, **BF16_RUNS)
    print(f"{family} {engine}: {_check(runs, model_dir)}")
