"""The per-turn layout in two processes (`accelerate launch`, gloo on CPU): DTA (its own gradient all-reduce) trains
exactly what TRL's dense path (DDP) trains on the same per-turn micro-batches: float64, every parameter's update within
1e-5 (float32 rounding through ~700-token attention alone reaches a few 1e-4 of the smallest updates).

This file is also the launched module (`python -m trainers.test_agent_distributed --out run.pt --model_dir DIR --dta 1`
with `tests/` and the repository root on the path): it trains two optimizer steps on replayed episodes
(`test_layouts.ReplayRollout`) and saves rank 0's parameters, logs and each rank's row counts.
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(out: Path, model_dir: Path, dta: int, tasks: int = 1) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2",
           "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", f"--main_process_port={free_port()}",
           "--module", "trainers.test_agent_distributed", f"--out={out}", f"--model_dir={model_dir}", f"--dta={dta}",
           f"--tasks={tasks}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def result(proc: subprocess.CompletedProcess, out: Path) -> dict:
    assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out)


@pytest.mark.distributed
@pytest.mark.slow
def test_per_turn_two_processes_dta_equals_dense(tmp_path):
    from trl_dta.tiny import build_default_model_dir

    model_dir = build_default_model_dir(tmp_path / "model", hidden_size=32, max_position_embeddings=1024)
    dense = result(launch(tmp_path / "dense.pt", model_dir, dta=0), tmp_path / "dense.pt")
    dta = result(launch(tmp_path / "dta.pt", model_dir, dta=1), tmp_path / "dta.pt")
    assert dense["processes"] == dta["processes"] == 2
    assert dense["rows"] == dta["rows"] and dense["rows"][0] == dense["rows"][1]
    for name, p in dense["params"].items():
        moved = (p - dense["initial"][name]).abs().max().item()
        assert moved > 0, f"{name} did not change: the comparison could not fail"
        err = (dta["params"][name] - p).abs().max().item()
        assert err <= 1e-5 * moved, f"{name}: {err:.3g} vs update {moved:.3g}"
    for d, r in zip(dta["logs"], dense["logs"], strict=True):
        assert d["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-6)
    assert all(log["dta/compression_ratio"] > log["dta/compression_ratio_micro_batch"] for log in dta["logs"])


@pytest.mark.distributed
@pytest.mark.slow
def test_per_turn_unequal_rows_across_processes_is_an_error(tmp_path):
    from trl_dta.tiny import build_default_model_dir

    model_dir = build_default_model_dir(tmp_path / "model", hidden_size=32, max_position_embeddings=1024)
    proc = launch(tmp_path / "run.pt", model_dir, dta=1, tasks=2)  # each rank replays other tasks' episodes
    assert proc.returncode != 0 and "different numbers of turn rows per micro-batch" in proc.stderr, proc.stderr[-3000:]


def main() -> None:
    from accelerate import PartialState
    from accelerate.utils import gather_object
    from datasets import Dataset
    from trainers.conftest import make_args
    from trainers.test_layouts import ReplayRollout

    from trl_dta.envs import RetailDomain, episode_reward
    from trl_dta.tiny import build_tokenizer
    from trl_dta.trainers import DTAGRPOConfig, DTAGRPOTrainer

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--dta", type=int, required=True)
    parser.add_argument("--tasks", type=int, default=1)
    flags = parser.parse_args()
    torch.set_num_threads(1)
    domain, tokenizer = RetailDomain(seed=0), build_tokenizer()
    # With one task, both ranks replay its G episodes, so they hold equal numbers of turn rows, which TRL's metric
    # gathers need (see `DTATrainerMixin._dta_prepare_per_turn`).
    task_ids = [i % flags.tasks for i in range(8)]
    tasks = Dataset.from_dict({"prompt": [domain.prompt(i) for i in task_ids], "task_id": task_ids})
    args = make_args(DTAGRPOConfig, Path(flags.out).with_suffix(""), 2, per_device_train_batch_size=4,
                     num_generations=G, max_completion_length=64, loss_type="grpo", num_iterations=2, beta=0.0,
                     dta_enabled=bool(flags.dta), dta_sample_layout="per_turn",
                     model_init_kwargs={"dtype": torch.float64})
    trainer = DTAGRPOTrainer(model=flags.model_dir, reward_funcs=episode_reward, args=args,
                             train_dataset=tasks, processing_class=tokenizer,
                             rollout_func=ReplayRollout(domain, tokenizer, variants=G))
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    rows = gather_object([sum(len(batch["prompt_ids"]) for batch in trainer._buffered_inputs)])
    if PartialState().is_main_process:
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        torch.save({"params": params, "initial": initial,
                    "logs": [e for e in trainer.state.log_history if "loss" in e], "rows": rows,
                    "processes": PartialState().num_processes}, flags.out)
    PartialState().wait_for_everyone()
    sys.stdout.flush()
    os._exit(0)  # gloo's destructor can hang at exit (see recipes/grpo.py)


if __name__ == "__main__":
    main()
