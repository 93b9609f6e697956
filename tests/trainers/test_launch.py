"""A launch that says several processes but trains as one is refused (`trl_dta/trainers/launch.py`)."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainingArguments
from transformers.training_args import ParallelMode

from trl_dta.trainers.launch import check_launch

from .test_sharded import refuse


def test_environment_of_several_processes_with_a_one_process_trainer_is_refused(monkeypatch, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert args.world_size == 1 and args.parallel_mode == ParallelMode.NOT_PARALLEL
    check_launch(args)  # a plain one-process run
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"says 2 processes .*accelerate_multi_cpu.yaml .*--use_cpu true"):
        check_launch(args)
    assert not torch.distributed.is_initialized()


@pytest.mark.distributed
@pytest.mark.slow
def test_multi_process_launch_without_use_cpu_is_refused(tmp_path, model_dir):
    """`accelerate launch --multi_gpu --num_processes 2` on a CPU machine with `use_cpu=False`: each process sets up
    one process (transformers only warns that the process group is initialised); the trainer refuses, naming the
    working CPU launch."""
    results = refuse(tmp_path, model_dir, ["--multi_gpu", "--num_processes=2", "--num_machines=1",
                                           "--mixed_precision=no", "--dynamo_backend=no"], ["no_use_cpu"])
    result = results["no_use_cpu"]
    assert result["raised"] == "RuntimeError", result
    assert "says 2 processes" in result["message"] and "unsynchronised" in result["message"]
    assert "accelerate launch --config_file recipes/configs/accelerate_multi_cpu.yaml" in result["message"]
