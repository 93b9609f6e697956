"""The per-turn layout on several processes (`accelerate launch`, gloo on CPU), with any number of turn rows per rank.

Each generation's 16 episodes (two tasks per rank, `G` episodes each) expand into a different number of turn rows on
each rank; every micro-batch is padded to the largest rank's count with rows that carry no loss (`per_turn.
per_turn_buffer`). The runs compare, in float64, every parameter's update within 1e-5 of the update (float32 rounding
through ~700-token attention alone reaches a few 1e-4 of the smallest updates), and the logged losses:

- 2 processes with unequal turn-row counts against 1 process on the same 16 episodes, DTA's defaults (so
  `dta_balance=True`, which moves whole prompt groups between ranks), and without balancing: `loss_type` `dapo`
  (TRL's default) and `cispo`, whose normaliser is the generation's token count; `grpo` (a mean over each
  micro-batch's rows, corrected by a per-micro-batch factor) with one micro-batch per generation;
- DTA against TRL's dense path (`dta_enabled=False`) on 2 processes, on the same padded per-turn micro-batches.

This file is also the launched module (`python -m trainers.test_agent_distributed --out run.pt --model_dir DIR
--configs 'loss_type=dapo;loss_type=cispo,balance=0'` with `tests/` and the repository root on the path; plain `python`
for one process): for each configuration in turn it trains two optimizer steps on replayed episodes
(`test_per_turn.ReplayRollout`) and saves rank 0's parameters and logs, and every rank's real and padded rows per
micro-batch, to `<out stem>-<index>.pt`. All the configurations of one process count (`CONFIGS`) share one launch
(process start-up and imports are most of a launch); each one's stderr is told apart by a marker line, and
`warn_once`'s record is cleared before each, so that every configuration logs its own warnings.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
G = 4
TASKS = 8
# Every configuration the tests train, by process count (flags of [`main`]; unset flags at their defaults).
CONFIGS = {
    1: [{"loss_type": "dapo"}, {"loss_type": "cispo"}, {"loss_type": "grpo", "ga": 1}],
    2: [{"loss_type": "dapo", "balance": 0}, {"loss_type": "dapo"}, {"loss_type": "cispo", "balance": 0},
        {"loss_type": "cispo"}, {"loss_type": "grpo", "ga": 1}, {"dta": 0, "balance": 0}],
}
MARKER = "=== test_agent_distributed configuration "


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(out: Path, model_dir: Path, processes: int, configs: list[dict]) -> subprocess.CompletedProcess:
    """One launch of [`main`] on `processes` processes, training each of `configs` (its flags) in turn."""
    module = "trainers.test_agent_distributed"
    run = ["--module", module] if processes > 1 else ["-m", module]
    launcher = ["-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={processes}", "--num_machines=1",
                "--mixed_precision=no", "--dynamo_backend=no", f"--main_process_port={free_port()}"]
    cmd = [sys.executable, *(launcher if processes > 1 else []), *run, f"--out={out}", f"--model_dir={model_dir}",
           f"--processes={processes}",
           "--configs=" + ";".join(",".join(f"{k}={v}" for k, v in c.items()) for c in configs)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def results(proc: subprocess.CompletedProcess, out: Path, processes: int, configs: list[dict]) -> list[dict]:
    """Each configuration's saved run, with the stderr its training wrote (every rank's, from its marker on)."""
    assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    stderr = {i: [] for i in range(len(configs))}
    current = None
    for line in proc.stderr.splitlines(keepends=True):
        if MARKER in line:
            current = int(line.split(MARKER)[1].split()[0])
        elif current is not None:
            stderr[current].append(line)
    runs = []
    for i, config in enumerate(configs):
        run = torch.load(out.with_name(f"{out.stem}-{i}.pt"))
        assert run["processes"] == processes, f"expected {processes} processes, {run['processes']} ran"
        assert {k: run["flags"][k] for k in config} == config, (run["flags"], config)
        run["stderr"] = "".join(stderr[i])
        runs.append(run)
    return runs


def assert_same_training(ref: dict, run: dict, rtol: float = 1e-5) -> float:
    """Every parameter's update within `rtol` of the update, the logged losses within `rtol`; returns the worst
    relative update error."""
    worst = 0.0
    for name, p in ref["params"].items():
        moved = (p - ref["initial"][name]).abs().max().item()
        assert moved > 0, f"{name} did not change: the comparison could not fail"
        assert torch.equal(ref["initial"][name], run["initial"][name])
        err = (run["params"][name] - p).abs().max().item()
        assert err <= rtol * moved, f"{name}: {err:.3g} vs update {moved:.3g}"
        worst = max(worst, err / moved)
    assert len(ref["logs"]) == len(run["logs"]) > 0
    for a, b in zip(run["logs"], ref["logs"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=rtol, abs=1e-6)  # the HF Trainer sums losses in float32
    return worst


def real_rows(run: dict) -> list[list[int]]:
    """Per rank, the real (not padding) turn rows of each micro-batch of the last generation."""
    return [[real for real, _ in rank] for rank in run["rows"]]


def assert_padded_to_equal_counts(run: dict) -> None:
    padded = [[total for _, total in rank] for rank in run["rows"]]
    assert all(counts == padded[0] for counts in padded), padded
    assert [max(col) for col in zip(*real_rows(run))] == padded[0]  # padded to the largest rank's count, no more


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Training runs by (processes, flags): every configuration of `CONFIGS[processes]` trained in one launch, the
    first time one of them is asked for."""
    from trl_dta.demos.tiny import build_default_model_dir

    model_dir = build_default_model_dir(tmp_path_factory.mktemp("model"), hidden_size=32, max_position_embeddings=1024)
    done = {}

    def get(processes: int, **flags) -> dict:
        key = (processes, *sorted(flags.items()))
        if key not in done:
            configs = CONFIGS[processes]
            assert flags in configs, f"{flags} is not in CONFIGS[{processes}]"
            out = tmp_path_factory.mktemp("run") / "run.pt"
            for config, run in zip(configs, results(launch(out, model_dir, processes, configs), out, processes,
                                                    configs)):
                done[(processes, *sorted(config.items()))] = run
        return done[key]

    return get


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_per_turn_two_processes_unequal_rows_equal_one_process(runs, loss_type):
    ref = runs(1, loss_type=loss_type)
    # Without `dta_balance`: each rank trains the turns of its own episodes.
    kept = runs(2, loss_type=loss_type, balance=0)
    rows = real_rows(kept)
    assert sum(rows[0]) != sum(rows[1]), f"equal turn-row counts {rows}: the test would be vacuous"
    assert sum(map(sum, rows)) == sum(map(sum, real_rows(ref)))  # the same turns, all trained
    assert_padded_to_equal_counts(kept)
    assert any(log.get("dta/padding_rows", 0) > 0 for log in kept["logs"])
    assert_same_training(ref, kept)
    # DTA's defaults: `dta_balance` exchanges whole prompt groups by forest cost, then pads.
    balanced = runs(2, loss_type=loss_type)
    assert "ranks keep" not in balanced["stderr"]
    assert_padded_to_equal_counts(balanced)
    first = balanced["logs"][0]
    assert first["dta/rank_cost_imbalance"] <= first["dta/rank_cost_imbalance_before_balance"]
    assert first["dta/tokens"] != kept["logs"][0]["dta/tokens"], "balancing moved no rows: the test would be vacuous"
    assert_same_training(ref, balanced)


@pytest.mark.distributed
@pytest.mark.slow
def test_per_turn_two_processes_row_mean_loss_equals_one_process(runs):
    # `grpo` averages each micro-batch's rows: each rank's loss carries the factor processes x padded rows / all real
    # rows (`per_turn.row_weights`), which makes it the 1-process objective whenever the micro-batches' sizes do
    # not depend on where rows go, e.g. one micro-batch per generation (`gradient_accumulation_steps=1`).
    ref, run = runs(1, loss_type="grpo", ga=1), runs(2, loss_type="grpo", ga=1)
    rows = real_rows(run)
    assert sum(rows[0]) != sum(rows[1]), f"equal turn-row counts {rows}: the test would be vacuous"
    assert_padded_to_equal_counts(run)
    assert "dta/compression_ratio_after_balance" in run["logs"][0] and "ranks keep" not in run["stderr"]
    assert "different numbers of turn rows" not in run["stderr"]  # no warning: the objective is exact
    assert_same_training(ref, run)


@pytest.mark.distributed
@pytest.mark.slow
def test_per_turn_two_processes_dta_equals_dense(runs):
    dense, dta = runs(2, dta=0, balance=0), runs(2, loss_type="dapo", balance=0)
    assert dense["rows"] == dta["rows"] and sum(real_rows(dta)[0]) != sum(real_rows(dta)[1])
    assert_same_training(dense, dta)
    assert all(log["dta/compression_ratio"] > log["dta/compression_ratio_micro_batch"] for log in dta["logs"])


def main() -> None:
    from trl_dta import _checks

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--dta", type=int, default=1)
    parser.add_argument("--balance", type=int, default=1, help="dta_balance (DTA's default: 1)")
    parser.add_argument("--loss_type", default="dapo")
    parser.add_argument("--ga", type=int, default=2, help="gradient_accumulation_steps (= steps_per_generation)")
    parser.add_argument("--configs", default="", help="';'-separated configurations, each 'flag=value,...' (the "
                        "flags above), trained in turn into `<out stem>-<index>.pt`")
    common = parser.parse_args()
    torch.set_num_threads(1)
    if not common.configs:
        train_one(parser.parse_args(), common.out)
    else:
        for i, config in enumerate(common.configs.split(";")):
            argv = [f"--out={common.out}", f"--model_dir={common.model_dir}", f"--processes={common.processes}"]
            flags = parser.parse_args(argv + [f"--{item}" for item in config.split(",") if item])
            print(f"{MARKER}{i} ({config})", file=sys.stderr, flush=True)
            _checks._warned.clear()  # each configuration logs its own once-per-process warnings
            out = Path(common.out).with_name(f"{Path(common.out).stem}-{i}.pt")
            train_one(flags, out, last=i == len(common.configs.split(";")) - 1)


def train_one(flags, out, last: bool = True) -> None:
    from accelerate import PartialState
    from accelerate.utils import DistributedType, gather_object

    from trainers.conftest import make_args
    from trainers.test_per_turn import ReplayRollout
    from trl_dta.demos.tiny import build_tokenizer
    from trl_dta.envs import RetailDomain, build_dataset, episode_reward
    from trl_dta.trainers import DTAGRPOConfig, DTAGRPOTrainer

    domain, tokenizer = RetailDomain(seed=0), build_tokenizer()
    # 16 episodes per generation on any number of processes: 2 tasks x G on each of 2 ranks, or all 4 on one.
    args = make_args(DTAGRPOConfig, Path(out).with_suffix(""), 2, gradient_accumulation_steps=flags.ga,
                     per_device_train_batch_size=16 // (flags.processes * flags.ga),
                     num_generations=G, max_completion_length=64, loss_type=flags.loss_type, num_iterations=2,
                     beta=0.0, dta_enabled=bool(flags.dta), dta_balance=bool(flags.balance),
                     dta_sample_layout="per_turn", model_init_kwargs={"dtype": torch.float64})
    trainer = DTAGRPOTrainer(model=flags.model_dir, reward_funcs=episode_reward, args=args,
                             train_dataset=build_dataset(domain, TASKS), processing_class=tokenizer,
                             rollout_func=ReplayRollout(domain, tokenizer, variants=G))
    state = PartialState()
    assert state.num_processes == flags.processes == trainer.accelerator.num_processes
    if flags.processes > 1:  # the strategy that really ran: accelerate's MULTI_CPU (DDP over gloo)
        assert trainer.accelerator.distributed_type == DistributedType.MULTI_CPU, trainer.accelerator.distributed_type
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    rows = gather_object([[(int((b["completion_mask"].sum(1) > 0).sum()), len(b["prompt_ids"]))
                           for b in trainer._buffered_inputs]])
    if state.is_main_process:
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        torch.save({"params": params, "initial": initial, "rows": rows, "processes": state.num_processes,
                    "flags": vars(flags), "logs": [e for e in trainer.state.log_history if "loss" in e]}, out)
    if not last:
        state.wait_for_everyone()
        return
    if state.num_processes > 1:
        state.wait_for_everyone()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # gloo's destructor can hang at exit (see recipes/grpo.py)


if __name__ == "__main__":
    main()
