"""Two processes (`accelerate launch`, gloo on CPU) train exactly what one process trains on the same global batch.

Each run is `dist_run.py`: real trainers, real generation and scoring, then every rank's rows replaced by its slice
of one fixed global batch (see that file). The reference is TRL's own trainer in one process; the DTA run uses two
processes, exchanges prompt groups between ranks (`dta_balance`), back-propagates through the engine without DDP's
hooks and reduces the gradients once per step.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bounds import assert_as_precise, gradient_slack

from .conftest import (
    BF16_LEARNING_RATE_FACTOR,
    LEARNING_RATE,
    Run,
    assert_bf16_bar,
    float64_rtol_of,
    tokens_per_step_of,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
SCRIPT = Path(__file__).with_name("dist_run.py")
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(out: Path, model_dir: str, processes: int, **flags) -> dict:
    args = [f"--{k}={v}" for k, v in flags.items()]
    args += [f"--out={out}", f"--processes={processes}", f"--model_dir={model_dir}"]
    if processes == 1:
        cmd = [sys.executable, str(SCRIPT), *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={processes}",
               "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", f"--main_process_port={free_port()}",
               str(SCRIPT), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    if "variants" in flags:  # one saved run per variant, `<out stem>-<variant>.pt`
        return {v: torch.load(out.with_name(f"{out.stem}-{v}.pt")) for v in flags["variants"].split(",")}
    return torch.load(out)


def compare(ref: dict, dta: dict, initial: dict, model_dir: str) -> float:
    """Two float64 runs (the exactness question): parameters within `conftest.float64_rtol` (the float32 steps TRL
    keeps in a float64 model) of their size, those with a known initial value also of their update (which must be
    non-zero, so that the comparison can fail); the logged losses within it too. Returns the worst update error."""
    from transformers import AutoConfig

    for run in (ref, dta):
        assert run["precision"]["stored"] == ["float64"], f"not a float64 run: {run['precision']}"
    tokens = max(tokens_per_step_of(ref["logs"]), tokens_per_step_of(dta["logs"]))
    rtol = float64_rtol_of(AutoConfig.from_pretrained(model_dir).get_text_config(), tokens)
    worst = 0.0
    assert set(ref["params"]) == set(dta["params"])
    for name, p in ref["params"].items():
        diff = (dta["params"][name] - p).abs().max().item()
        assert diff <= rtol * p.abs().max().item(), f"{name}: {diff:.3g} vs size {p.abs().max().item():.3g}"
        if name in initial:
            moved = (p - initial[name]).abs().max().item()
            assert moved > 0, f"{name} did not change: the comparison could not fail"
            assert diff <= rtol * moved, f"{name}: {diff:.3g} vs update {moved:.3g} (bound {rtol:.2g})"
            worst = max(worst, diff / moved)
    assert initial.keys() & ref["params"].keys(), "no parameter was checked against its update"
    for r, d in zip(ref["logs"], dta["logs"], strict=True):
        assert d["loss"] == pytest.approx(r["loss"], rel=rtol, abs=rtol)
    return worst


# Rows of `dist_run.py`'s fixed global batch per generation (GROUPS x G): at most that many sequences share a token.
GLOBAL_ROWS = 16


def _update_gap(a: dict, b: dict, initial: dict) -> float:
    """`conftest.update_gap` of two saved runs over the parameters with a known initial value."""
    num = sum(((a["params"][n] - initial[n]).double() - (b["params"][n] - initial[n]).double()).pow(2).sum()
              for n in initial)
    den = sum((b["params"][n] - initial[n]).double().pow(2).sum() for n in initial)
    assert den > 0, "no parameter moved: the comparison would be vacuous"
    return float((num / den).sqrt())


def compare_as_precise(ref: dict, dta: dict, exact: dict, initial: dict) -> float:
    """Two float32 runs (an engine without float64: DeepSpeed) judged against TRL's float64 run on the same fixed
    global batch: DTA's update no farther from it than `bounds.gradient_slack` times TRL's (relative L2 over the
    parameters with a known initial value). Returns the ratio."""
    assert exact["precision"]["stored"] == ["float64"], exact["precision"]
    initial = {n: p.double() for n, p in initial.items()}
    exact = {**exact, "params": {n: p.double() for n, p in exact["params"].items()}}
    slack = gradient_slack(GLOBAL_ROWS, sum(p.numel() for p in initial.values()))
    return assert_as_precise(_update_gap(dta, exact, initial), _update_gap(ref, exact, initial), slack,
                             "parameter updates")


# The bf16 comparisons' launches: TRL's trainer in float32, then TRL's and DTA's under TRL's default precision, all at
# the "trl" regime's learning rate (`conftest.compare_in_precision`).
BF16_RUNS = {"precision": "trl", "learning_rate": LEARNING_RATE * BF16_LEARNING_RATE_FACTOR}


def as_run(saved: dict) -> Run:
    """A launched run as `conftest.Run`, for `assert_bf16_bar`. The rows trained are the fixed global batch in every
    run (`dist_run.with_fixed_batch`), hence no completions to compare. A module DeepSpeed cast to bf16 trains float32
    master weights initialised from the bf16 weights: its update starts from those."""
    initial = saved["initial"]
    if saved["precision"]["stored"] == ["bfloat16"]:
        initial = {n: p.to(torch.bfloat16).float() for n, p in initial.items()}
    rates = {log["learning_rate"] for log in saved["logs"]}
    assert len(rates) == 1, rates
    batch = saved["batch"]  # what the bar reads of a trainer: the learning rate and the rows of a step
    trainer = SimpleNamespace(args=SimpleNamespace(learning_rate=rates.pop(), **{
        k: batch[k] for k in ("per_device_train_batch_size", "gradient_accumulation_steps")}),
        accelerator=SimpleNamespace(num_processes=batch["num_processes"]))
    return Run(trainer, saved["logs"], [], initial, saved["params"], saved["precision"]["mixed_precision"])


def assert_bf16_runs(runs: dict) -> dict[str, dict[str, float]]:
    """Every DTA run of a launch (`dta*`, bf16) against TRL's bf16 (`trl`) and float32 (`trl@fp32`) runs by the bf16
    bar; the launch asserted in each run what precision really ran (`dist_run.assert_precision`). Returns the gaps per
    DTA variant."""
    assert runs["trl@fp32"]["logs"][0]["learning_rate"] == pytest.approx(BF16_RUNS["learning_rate"])
    gaps = {}
    for variant, saved in runs.items():
        if variant.startswith("dta"):
            assert all(log["dta/dense_fallback"] == 0.0 for log in saved["logs"])
            assert any("dta/tree_tokens" in log for log in saved["logs"]), "no micro-batch ran through DTA"
            gaps[variant] = assert_bf16_bar(as_run(runs["trl"]), as_run(runs["trl@fp32"]), as_run(saved))
    assert gaps, "no DTA run in the launch"
    return gaps


def test_bf16_two_processes_within_trls_bf16_error(tmp_path, model_dir):
    """DDP (MULTI_CPU) under TRL's default `bf16=True`: bf16 autocast over the float32 replicas; DTA's update (packed
    rows, and every segment its own engine call) as close to TRL's float32 update as TRL's own bf16 update, the runs in
    one launch."""
    runs = run(tmp_path / "run.pt", model_dir, 2, trainer="grpo", variants="trl@fp32,trl,dta,dta_walk", **BF16_RUNS)
    assert_bf16_runs(runs)


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
@pytest.mark.parametrize("peft", [0, 1], ids=["full", "lora"])
def test_two_processes_equal_one_process(tmp_path, model_dir, trainer, peft):
    ref = run(tmp_path / "ref.pt", model_dir, 1, trainer=trainer, dta=0, peft=peft, precision="fp64")
    dta = run(tmp_path / "dta.pt", model_dir, 2, trainer=trainer, dta=1, peft=peft, precision="fp64")
    if peft:  # LoRA B starts at zero
        initial = {n: torch.zeros_like(p) for n, p in ref["params"].items() if "lora_B" in n}
    else:
        from transformers import AutoModelForCausalLM

        initial = {n: p.detach().double()
                   for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}
    compare(ref, dta, initial, model_dir)
    # The balancer moved rows: groups 0 and 2 share a prompt prefix and now sit on the same rank.
    log = dta["logs"][0]
    assert log["dta/compression_ratio_after_balance"] > log["dta/compression_ratio_before_balance"]
    assert log["dta/rank_cost_imbalance"] >= 1.0


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_default_settings_two_processes_match_trl(tmp_path, model_dir, trainer):
    """Two generations' worth of optimizer steps per generation (steps_per_generation=4, gradient_accumulation_steps=2):
    each step trains on the rows TRL's shuffle gives it, so the reference is TRL's trainer in two processes (the same
    shuffles); DTA's defaults then keep TRL's rows on every rank (no balancing: it would change the steps' rows).
    Both train in one launch, one after the other (`dist_run.py --variants`, as the FSDP2 and ZeRO tests do)."""
    runs = run(tmp_path / "run.pt", model_dir, 2, trainer=trainer, spg=4, ga=2, steps=3, variants="trl,dta",
               precision="fp64")
    ref, dta = runs["trl"], runs["dta"]
    from transformers import AutoModelForCausalLM

    initial = {n: p.detach().double() for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}
    compare(ref, dta, initial, model_dir)
    assert not any("dta/rank_cost_imbalance" in log for log in dta["logs"])
    assert all(log["dta/dense_fallback"] == 0.0 for log in dta["logs"])


def test_fitted_cost_model_keeps_results(tmp_path, model_dir):
    """`dta_cost_model='fit'`: from the fifth step the balancer uses coefficients fitted to all ranks' engine times
    (one sample per rank and optimizer step, gathered, so every rank partitions identically); the trained parameters
    are still TRL's."""
    ref = run(tmp_path / "ref.pt", model_dir, 1, trainer="grpo", dta=0, steps=5, precision="fp64")
    dta = run(tmp_path / "dta.pt", model_dir, 2, trainer="grpo", dta=1, steps=5, cost_model="fit", precision="fp64")
    from transformers import AutoModelForCausalLM

    initial = {n: p.detach().double() for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}
    compare(ref, dta, initial, model_dir)
