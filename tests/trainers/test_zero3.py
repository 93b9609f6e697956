"""DTA under DeepSpeed ZeRO-3 trains what TRL's trainer trains under ZeRO-3 (2 processes, `accelerate launch` with
`recipes/configs/zero3_cpu.yaml`: TRL's `zero3.yaml` with `zero3_init_flag`, for 2 CPU processes).

One launch trains TRL's trainer and DTA's, GRPO and RLOO, full and LoRA, with a reference model where TRL's defaults
have one (GRPO here with `beta=0.04`, RLOO's default 0.05), on `dist_run.py`'s fixed global batch, and DTA under both
ZeRO-3 schedules (`parallel/zero3.py`): the whole model gathered per engine call (no budget) and decoder layers gathered
by DeepSpeed's hooks (`dta_zero3_gather_budget_mb=0`), plus TRL's dense path inside DTA's windows. The model has 4
layers and tied embeddings (the LM head the engine reads directly is the input embedding DeepSpeed releases after its
forward); DeepSpeed's `stage3_param_persistence_threshold` is 0, because every tensor of a tiny model is below its
default (1e5 elements) and would never be partitioned. Every DTA run asserts what ran (`cpu_engines.Zero3Probe`).
"""

from __future__ import annotations

import pytest
import torch

from .conftest import build_model
from .test_distributed import BF16_RUNS, GLOBAL_ROWS, ROOT, _update_gap, assert_bf16_runs, run
from .test_sharded import NO_CLIPPING, launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ZERO3 = [f"--config_file={ROOT / 'recipes' / 'configs' / 'zero3_cpu.yaml'}"]
PERSISTENCE = {"zero_config": '{"stage3_param_persistence_threshold": 0}'}
# setup -> this script's arguments (`dist_run.py`); each trains as TRL's trainer and as DTA's variants
SETUPS = {
    "grpo-full": "beta=0.04",
    "grpo-lora": "peft=1",
    "rloo-full": "trainer=rloo:beta=0.05",
    "rloo-lora": "trainer=rloo:peft=1:beta=0.05",
}
DTA_VARIANTS = {  # DTA's variants per setup: window (default), per-layer (several row batches), dense path
    "grpo-full": ("dta", "dta_zero3_layer_small", "dta_dense"),
    "grpo-lora": ("dta",),
    "rloo-full": ("dta",),
    "rloo-lora": ("dta", "dta_zero3_layer"),
}


@pytest.fixture(scope="module")
def zero3_model_dir(tmp_path_factory, tokenizer) -> str:
    path = tmp_path_factory.mktemp("tiny_qwen2_tied")
    build_model(len(tokenizer), num_hidden_layers=4, tie_word_embeddings=True).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def initial_of(runs: dict, trl: str) -> dict:
    """The trainable parameters before training (LoRA's B: zeros), double."""
    return {n: p.double() for n, p in runs[trl]["initial"].items()}


def assert_steps_as_precise(trl: dict, dta: dict, exact: dict, initial: dict) -> list[float]:
    """Per optimizer step: DTA's update no farther from TRL's float64 update (one process, same fixed batch) than
    `bounds.gradient_slack` times TRL's own float32 update under ZeRO-3 (`test_distributed.compare_as_precise`, for
    every step's parameters). Returns the ratios."""
    from bounds import assert_as_precise, gradient_slack

    assert len(trl["step_params"]) == len(dta["step_params"]) == len(exact["step_params"]) == trl["steps"]
    slack = gradient_slack(GLOBAL_ROWS, sum(p.numel() for p in initial.values()))
    ratios = []
    for k, (t, d, e) in enumerate(zip(trl["step_params"], dta["step_params"], exact["step_params"])):
        t, d, e = ({"params": {n: p.double() for n, p in x.items()}} for x in (t, d, e))
        ratios.append(assert_as_precise(_update_gap(d, e, initial), _update_gap(t, e, initial), slack,
                                        f"parameter updates after step {k + 1}"))
    return ratios


def assert_zero3_ran(run_: dict, schedule: str, idle: bool = False) -> None:
    """DeepSpeed stage 3 partitioned every parameter (none persistent, all released after training) and DTA's engine
    calls ran the schedule: `"window"`: every layer gathered at once, one all-gather per partitioned parameter per
    training call and no reduction inside it; `"layer"`: one decoder layer gathered at a time, in lockstep with the
    other rank (`idle`: a rank ran idle row batches), the layers' gradients reduce-scattered inside the call."""
    z = run_["zero3"]
    assert z["stage"] == 3 and z["schedule"] == schedule, z
    assert z["partitioned"] == z["params"] > 0 and z["persistent"] == 0 and z["gathered_after"] == 0, z
    train = [c for c in z["calls"] if c["train"]]
    assert len(train) == run_["steps"], z["calls"]
    calls = [c for rank in run_["engine_calls"] for c in rank if c["train"]]
    if schedule == "window":
        assert all(c["layers_gathered"] == z["layers"] and c["all_gather"] == z["params"] and c["reduce_scatter"] == 0
                   for c in train), train
        assert not any(c["lockstep"] for c in calls)
    else:
        assert all(c["layers_gathered"] == 1 for c in z["calls"] if c["layers_gathered"]), z["calls"]
        assert all(c["all_gather"] > z["params"] and c["reduce_scatter"] > 0 for c in train), train
        assert all(c["lockstep"] for c in calls)
        for mine, theirs in zip(*run_["engine_calls"]):
            assert mine["forwards"] == theirs["forwards"], (mine, theirs)
        assert (sum(c["idle_batches"] for c in calls) > 0) == idle, calls


def assert_checkpoint(run_: dict, base_dir: str) -> None:
    """`trainer.save_model` under ZeRO-3 (the 16-bit weights gathered: float32 here) loads, without DeepSpeed, into the
    parameters the run trained."""
    from transformers import AutoModelForCausalLM

    lora = any("lora_" in n for n in run_["params"])  # the checkpoint holds the adapter only
    model = AutoModelForCausalLM.from_pretrained(base_dir if lora else run_["checkpoint"])
    if lora:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, run_["checkpoint"])
    loaded = dict(model.named_parameters())
    for name, p in run_["params"].items():
        assert torch.equal(loaded[name].detach(), p), name


def test_zero3_matches_trl_per_step(tmp_path, zero3_model_dir):
    """float32 under ZeRO-3 (DeepSpeed reduces no float64 gradients), judged per step against TRL's float64 run in one
    process; the checkpoints saved under ZeRO-3 load and equal what TRL's and DTA's runs trained."""
    variants = [f"{name}:{SETUPS[setup]}" for setup in SETUPS for name in ("trl", *DTA_VARIANTS[setup])]
    runs = launch(tmp_path, zero3_model_dir, ZERO3, ",".join(variants), "deepspeed", steps=3, per_step=1, save=1,
                  **NO_CLIPPING, **PERSISTENCE)
    exact = run(tmp_path / "exact.pt", zero3_model_dir, 1, variants=",".join(f"trl:{s}" for s in SETUPS.values()),
                dta=0, steps=3, precision="fp64", per_step=1, **NO_CLIPPING)
    for setup, args in SETUPS.items():
        trl = runs[f"trl:{args}"]
        initial = initial_of(runs, f"trl:{args}")
        assert_checkpoint(trl, zero3_model_dir)
        for name in DTA_VARIANTS[setup]:
            dta = runs[f"{name}:{args}"]
            assert_steps_as_precise(trl, dta, exact[f"trl:{args}"], initial)
            assert all(log["dta/dense_fallback"] == float(name == "dta_dense") for log in dta["logs"])
            if name != "dta_dense":
                assert_zero3_ran(dta, "layer" if "layer" in name else "window", idle=name.endswith("_small"))
            assert_checkpoint(dta, zero3_model_dir)


def test_bf16_within_trls_bf16_error_under_zero3(tmp_path, zero3_model_dir):
    """TRL's defaults under ZeRO-3: `bf16=True` (DeepSpeed casts the module to bf16 and steps float32 master weights),
    GRPO's reference model (`beta=0.04`), DeepSpeed's gradient clipping at TRL's `max_grad_norm` (1.0). DTA's update,
    under both schedules, as close to TRL's float32 update as TRL's own bf16 update."""
    runs = launch(tmp_path, zero3_model_dir, ZERO3, "trl@fp32,trl,dta,dta_zero3_layer", "deepspeed", beta=0.04,
                  **BF16_RUNS, **PERSISTENCE)
    assert_bf16_runs(runs)
    assert_zero3_ran(runs["dta"], "window")
    assert_zero3_ran(runs["dta_zero3_layer"], "layer")
