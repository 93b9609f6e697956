"""Construct `DTAGRPOTrainer` under distributed settings DTA does not support, one source of the setting per case, and
record what construction raised (launched on 2 processes by `test_sharded.py` and `test_launch.py`; `cpu_engines.py`
makes accelerate keep FSDP and DeepSpeed on CPU, so that the trainer sees what a GPU run would set up).

    accelerate launch --multi_gpu --num_processes 2 tests/trainers/refuse_run.py --out r.json --model_dir M \\
        --cases args_fsdp1,env_fsdp_offload,code_plugin,args_zero3_offload
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/: `bounds`, which the trainers' conftest imports
from conftest import build_tokenizer, make_args  # noqa: E402
from cpu_engines import enable_cpu_engines  # noqa: E402

ZERO3_OFFLOAD = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
                 "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "gradient_clipping": 0.0}


def case_settings(name: str) -> dict:
    """The config fields of a case; cases that set the environment or an accelerator do it here too."""
    if name == "args_fsdp1":  # TrainingArguments.fsdp / fsdp_config
        return dict(fsdp="full_shard", fsdp_config={"version": 1, "cpu_ram_efficient_loading": False,
                                                    "sync_module_states": False})  # both need a GPU
    if name == "args_zero3_offload":  # TrainingArguments.deepspeed
        return dict(deepspeed=ZERO3_OFFLOAD)
    if name == "env_fsdp_offload":  # ACCELERATE_* environment variables (what `accelerate launch` sets)
        os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", FSDP_OFFLOAD_PARAMS="true")
        return {}
    if name == "code_plugin":  # a plugin passed in code, on an accelerator the trainer then uses
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin

        Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=True))
        return dict(accelerator_config={"use_configured_state": True})
    if name == "launch":  # whatever `accelerate launch --config_file` set up
        return {}
    if name == "no_use_cpu":  # the multi-process launcher on a CPU machine without `use_cpu=True`: one process each
        return dict(use_cpu=False)
    raise ValueError(name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    enable_cpu_engines()
    from accelerate.state import AcceleratorState
    from datasets import Dataset

    from trl_dta import DTAGRPOConfig, DTAGRPOTrainer

    results = {}
    dataset = Dataset.from_dict({"prompt": ["a+b=", "c+d="] * 4})
    saved_env = dict(os.environ)
    for name in args.cases.split(","):
        AcceleratorState._reset_state(reset_partial_state=False)
        try:
            settings = case_settings(name)
            config = make_args(DTAGRPOConfig, Path(args.out).parent / f"refuse-{name}", 1, **settings)
            trainer = DTAGRPOTrainer(model=args.model_dir,
                                     reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
                                     train_dataset=dataset, processing_class=build_tokenizer())
            results[name] = {"raised": None, "distributed_type": str(trainer.accelerator.distributed_type)}
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            results[name] = {"raised": type(exc).__name__, "message": str(exc),
                             "distributed_type": str(AcceleratorState._shared_state.get("distributed_type"))}
        os.environ.clear()
        os.environ.update(saved_env)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
    sys.stdout.flush()
    os._exit(0)  # see dist_run.py: the gloo group's destructor can deadlock at exit


if __name__ == "__main__":
    main()
