"""DTA under FSDP2 and DeepSpeed ZeRO trains exactly what TRL's trainer trains under the same engine (2 processes).

Each launch is `dist_run.py` under `accelerate launch` with the engine's flags, `cpu_engines.py` making FSDP2 and
DeepSpeed real on CPU (every run asserts that they ran: DTensor parameters, a DeepSpeed engine); one launch trains
TRL's trainer and DTA's, one after the other, on the same fixed global batch, and the parameters after several SGD
steps are compared to the update. Under FSDP2 the runs also count the optimizer steps' collectives: DTA's gathered
window costs one all-gather per FSDP group and one reduce-scatter per trainable group per step, whatever the trees.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from .test_distributed import (
    BF16_RUNS,
    ROOT,
    SCRIPT,
    assert_bf16_runs,
    compare,
    compare_as_precise,
    free_port,
    run,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FSDP2 = ["--use_fsdp", "--fsdp_version=2", "--fsdp_auto_wrap_policy=TRANSFORMER_BASED_WRAP",
         "--fsdp_state_dict_type=FULL_STATE_DICT", "--fsdp_reshard_after_forward=true"]


def zero(stage: int) -> list[str]:
    """accelerate's DeepSpeed flags. No `--gradient_clipping`: DeepSpeed's `"auto"`, which transformers fills with
    the trainer's `max_grad_norm` (a differing explicit value is refused), as in the recipes' configs."""
    return ["--use_deepspeed", f"--zero_stage={stage}"]


NO_CLIPPING = {"max_grad_norm": 0.0}  # the updates proportional to the gradients (TRL's default 1.0 rescales them)


def launch(tmp_path, model_dir: str, engine: list[str], variants: str, expect: str, **flags) -> dict:
    """One `accelerate launch` of `dist_run.py` on 2 processes; returns each variant's saved run."""
    out = tmp_path / "run.pt"
    args = [f"--{k}={v}" for k, v in flags.items()]
    args += [f"--out={out}", "--processes=2", f"--model_dir={model_dir}", f"--variants={variants}",
             f"--expect={expect}"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *engine, "--num_processes=2", "--num_machines=1",
           "--mixed_precision=no", "--dynamo_backend=no", f"--main_process_port={free_port()}", str(SCRIPT), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {v: torch.load(tmp_path / f"run-{v}.pt") for v in variants.split(",")}


def initial_values(model_dir: str, runs: dict, peft: int) -> dict:
    ref = runs["trl"]
    if peft:  # LoRA B starts at zero
        return {n: torch.zeros_like(p) for n, p in ref["params"].items() if "lora_B" in n}
    from transformers import AutoModelForCausalLM

    return {n: p.detach().double() for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}


def assert_window_collectives(run: dict, trl: dict) -> None:
    """The `"window"` schedule: one all-gather per group and one reduce-scatter per trainable group per step."""
    counts, steps = run["collectives"], run["steps"]
    assert counts["all_gather"] == counts["groups"] * steps, counts
    assert counts["reduce_scatter"] == counts["trainable_groups"] * steps, counts
    assert counts["all_gather"] < trl["collectives"]["all_gather"]


def assert_layer_collectives(run: dict) -> int:
    """The `"layer"` schedule: the policy's engine calls ran in lockstep and made the same number of forwards on both
    ranks (a reference model, one FSDP group, is gathered whole for its calls: no lockstep), and the step's
    collectives are the held groups' one each plus every decoder layer's per batch forward and backward
    (`parallel/fsdp2.py`). Returns the idle batches the ranks ran."""
    calls = run["engine_calls"]  # per rank, every engine call's stats, in order
    assert len(calls) == 2 and len(calls[0]) == len(calls[1]) > 0
    assert all(c["lockstep"] for rank in calls for c in rank if c["train"])
    for mine, theirs in zip(*calls):
        assert (mine["train"], mine["lockstep"]) == (theirs["train"], theirs["lockstep"]), (mine, theirs)
        if mine["lockstep"]:
            assert mine["forwards"] == theirs["forwards"], (mine, theirs)
    batches = sum(c["forwards"] for c in calls[0] if c["train"])
    counts, steps = run["collectives"], run["steps"]
    held, held_trainable = counts["groups"] - counts["layer_groups"], \
        counts["trainable_groups"] - counts["trainable_layer_groups"]
    assert counts["layer_groups"] > 0 and batches >= steps
    assert counts["all_gather"] == held * steps + 2 * counts["layer_groups"] * batches, (counts, batches)
    assert counts["reduce_scatter"] == held_trainable * steps + counts["trainable_layer_groups"] * batches, \
        (counts, batches)
    return sum(c["idle_batches"] for rank in calls for c in rank if c["lockstep"])


def assert_dense_agreed(runs: dict) -> None:
    """`dta_layer_split`: the ranks' forests compress on either side of `dta_min_compression` (measured by another
    variant's training calls), and both ranks took TRL's dense path: rank 0, whose forest alone would run DTA, too."""
    split = runs["dta_layer_split"]["settings"]["dta_min_compression"]
    ratios = [{c["compression_ratio"] for c in rank if c["train"]} for rank in runs["dta_layer_small"]["engine_calls"]]
    assert all(len(r) == 1 for r in ratios), ratios
    (rank0,), (rank1,) = ratios
    assert rank1 < split < rank0, (rank0, split, rank1)
    run = runs["dta_layer_split"]
    assert not any(c["train"] for rank in run["engine_calls"] for c in rank)
    assert all(log["dta/dense_fallback"] == 1.0 for log in run["logs"])  # rank 0's logs


# `dta_walk`: every segment its own engine call; `dta_layer*`: FSDP2's per-layer schedule (`_small`: several batches
# per step, unequal across ranks, so that the lockstep runs idle batches). `beta`: a reference model scored under
# FSDP2 (TRL shards it as one group): GRPO's KL term in the loss (with the fixed batch's reference log-probs), RLOO's
# default in its rewards (replaced by the fixed advantages: the scoring runs, its values do not reach the loss).
@pytest.mark.parametrize(("trainer", "peft", "beta", "variants"), [
    ("grpo", 0, 0.04, "trl,dta,dta_walk,dta_layer_small,dta_layer_split"),
    ("grpo", 1, 0.0, "trl,dta"),
    ("rloo", 0, 0.0, "trl,dta"),
    ("rloo", 1, 0.05, "trl,dta,dta_layer_small"),
], ids=["grpo-full-beta", "grpo-lora", "rloo-full", "rloo-lora-beta"])
def test_fsdp2_matches_trl_under_fsdp2(tmp_path, model_dir, trainer, peft, beta, variants):
    runs = launch(tmp_path, model_dir, FSDP2, variants, "fsdp2", trainer=trainer, peft=peft, beta=beta, steps=3,
                  precision="fp64")
    initial = initial_values(model_dir, runs, peft)
    for variant in variants.split(",")[1:]:
        run = runs[variant]
        compare(runs["trl"], run, initial, model_dir)
        if variant == "dta_layer_split":
            assert_dense_agreed(runs)
            continue
        assert all(log["dta/dense_fallback"] == 0.0 for log in run["logs"])
        if variant.startswith("dta_layer"):
            idle = assert_layer_collectives(run)
            if variant.endswith("_small"):
                assert idle > 0, "the ranks' forests needed equal batch counts: the lockstep was not exercised"
            assert all("dta/idle_batches" in log for log in run["logs"])
        else:
            assert_window_collectives(run, runs["trl"])
    if "dta_walk" in runs:  # every segment its own engine call: many more forward/backward calls, same collectives
        assert runs["dta_walk"]["collectives"] == runs["dta"]["collectives"]


@pytest.mark.parametrize(("stage", "trainer", "peft", "clip", "variants"),
                         [(2, "grpo", 0, False, "trl,dta,dta_dense"), (2, "rloo", 1, False, "trl,dta"),
                          (1, "grpo", 1, False, "trl,dta"), (0, "rloo", 0, False, "trl,dta,dta_dense"),
                          (2, "grpo", 0, True, "trl,dta")],
                         ids=["zero2-grpo-full", "zero2-rloo-lora", "zero1-grpo-lora", "zero0-rloo-full",
                              "zero2-grpo-full-clipped"])
def test_zero_matches_trl_under_zero(tmp_path, model_dir, stage, trainer, peft, clip, variants):
    """DeepSpeed reduces no float64 gradients: float32 under ZeRO, judged against TRL's float64 run on the same fixed
    global batch in one process (`compare_as_precise`). `clip`: DeepSpeed clips to TRL's default `max_grad_norm`
    (1.0), and every step's gradient norm is above it, so every update was rescaled. `dta_dense`: every window on
    TRL's dense path inside DTA's window (DeepSpeed's backward of each micro-step's loss, one reduction at its end)."""
    clipping = {} if clip else NO_CLIPPING
    runs = launch(tmp_path, model_dir, zero(stage), variants, "deepspeed", trainer=trainer, peft=peft, steps=3,
                  **clipping)
    exact = run(tmp_path / "exact.pt", model_dir, 1, trainer=trainer, dta=0, peft=peft, steps=3, precision="fp64",
                **clipping)
    if clip:  # the gradient norm (before clipping) above max_grad_norm at every step: every update was clipped
        assert all(log["grad_norm"] > 1.0 for log in exact["logs"] + runs["trl"]["logs"]), exact["logs"]
    for variant in variants.split(",")[1:]:
        compare_as_precise(runs["trl"], runs[variant], exact, initial_values(model_dir, runs, peft))
        assert all(log["dta/dense_fallback"] == float(variant == "dta_dense") for log in runs[variant]["logs"])


@pytest.mark.parametrize(("engine", "trainer", "peft", "variants"), [
    ("fsdp2", "grpo", 0, "trl@fp32,trl,dta,dta_walk,dta_layer"),
    ("fsdp2", "grpo", 1, "trl@fp32,trl,dta"),
    ("deepspeed", "grpo", 0, "trl@fp32,trl,dta"),
    ("deepspeed", "rloo", 1, "trl@fp32,trl,dta"),
], ids=["fsdp2-grpo-full", "fsdp2-grpo-lora", "zero2-grpo-full", "zero2-rloo-lora"])
def test_bf16_within_trls_bf16_error_under_the_engine(tmp_path, model_dir, engine, trainer, peft, variants):
    """TRL's default `bf16=True` under FSDP2 and ZeRO-2, as accelerate maps it: FSDP2 runs bf16 autocast and gathers
    its float32 shards as bf16 parameters (a `MixedPrecisionPolicy` with bf16 param and reduce dtypes); DeepSpeed casts
    the module to bf16 (no autocast) and steps float32 master weights. DTA's update is as close to TRL's float32 update
    (same engine) as TRL's own bf16 update; each run asserted the dtypes its optimizer steps ran in."""
    flags = {"fsdp2": FSDP2, "deepspeed": zero(2)}[engine]
    clipping = NO_CLIPPING if engine == "deepspeed" else {}
    runs = launch(tmp_path, model_dir, flags, variants, engine, trainer=trainer, peft=peft, **BF16_RUNS, **clipping)
    assert_bf16_runs(runs)


REFUSE_SCRIPT = SCRIPT.with_name("refuse_run.py")
# case -> (accelerate's distributed type the trainer saw, what the error names: the setting and the alternative)
REFUSED = {
    "args_fsdp1": ("FSDP", ["FSDP version 1", "fsdp_version: 2"]),
    "env_fsdp_offload": ("FSDP", ["CPU offload", "DeepSpeed ZeRO without offload"]),
    "code_plugin": ("FSDP", ["activation checkpointing", "dta_max_graph_tokens"]),
    "args_zero3_offload": ("DEEPSPEED", ["ZeRO offload (offload_param)", "offload devices to 'none'"]),
    "launch": ("DEEPSPEED", ["ZeRO offload (offload_optimizer)", "offload devices to 'none'"]),
}
# ZeRO-3 from an accelerate config file, its optimizer states offloaded (ZeRO-3 itself runs: `test_zero3.py`)
ZERO3_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 3
  gradient_clipping: 0.0
  zero3_init_flag: false
  offload_optimizer_device: cpu
mixed_precision: 'no'
num_machines: 1
num_processes: 2
"""


def refuse(tmp_path, model_dir: str, launch_args: list[str], cases: list[str]) -> dict:
    import json

    out = tmp_path / "refused.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch_args, f"--main_process_port={free_port()}",
           str(REFUSE_SCRIPT), f"--out={out}", f"--model_dir={model_dir}", f"--cases={','.join(cases)}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0 and out.exists(), \
        f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def test_unsupported_settings_refused_at_construction_from_every_source(tmp_path, model_dir):
    """FSDP1 from `TrainingArguments.fsdp` (naming FSDP2), FSDP2 offload from `ACCELERATE_*` variables, FSDP activation
    checkpointing from a plugin passed in code, ZeRO-3 offload from `TrainingArguments.deepspeed` and from an accelerate
    config file: each refused by the trainer's constructor, from the state accelerate set up, with the error naming the
    alternative."""
    cases = ["args_fsdp1", "env_fsdp_offload", "code_plugin", "args_zero3_offload"]
    results = refuse(tmp_path, model_dir, ["--multi_gpu", "--num_processes=2", "--num_machines=1",
                                           "--mixed_precision=no", "--dynamo_backend=no"], cases)
    config = tmp_path / "zero3.yaml"
    config.write_text(ZERO3_CONFIG)
    results.update(refuse(tmp_path, model_dir, [f"--config_file={config}"], ["launch"]))
    for case, (kind, words) in REFUSED.items():
        result = results[case]
        assert result["raised"] == "DTAUnsupportedError", (case, result)
        assert result["distributed_type"] == f"DistributedType.{kind}", (case, result)
        assert all(word in result["message"] for word in words), (case, result["message"])
