"""A launch that says several processes but trains as one: refused before anything trains.

Two launches go wrong without an error of their own (transformers only logs a warning):

- the environment names several processes (`WORLD_SIZE` or `LOCAL_WORLD_SIZE` > 1, set by `torchrun` and
  `accelerate launch --multi_gpu`) but the training arguments set up one: each process would train its own copy;
- `torch.distributed` is initialised but `TrainingArguments.parallel_mode` is not `DISTRIBUTED` (on a CPU machine, the
  multi-process launcher without `use_cpu=True` in the training config): the processes train unsynchronised copies.

On a CPU machine, two processes train together with
`accelerate launch --config_file recipes/configs/accelerate_multi_cpu.yaml your_script.py ... --use_cpu true`.
(`accelerate launch --cpu --num_processes 2` starts a single process, which is a correct one-process run.)
"""

from __future__ import annotations

import os

import torch
from transformers.training_args import ParallelMode

FIX = ("On a CPU machine: `accelerate launch --config_file recipes/configs/accelerate_multi_cpu.yaml your_script.py "
       "... --use_cpu true` (`use_cpu=True` in the training config makes the processes one gloo group); on GPUs, "
       "launch with `accelerate launch` or `torchrun` on a machine whose devices the processes can see; or run a "
       "single process with `python your_script.py`.")


def _env_processes() -> int:
    counts = [os.environ.get(name, "1") for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE")]
    return max(int(count) if count.strip().isdigit() else 1 for count in counts)


def check_launch(args) -> None:
    """Refuses a run whose processes would train unsynchronised copies (see the module docstring).

    Args:
        args (`transformers.TrainingArguments`): the trainer's arguments (their `world_size` and `parallel_mode` are
            what the `Trainer` will use).

    Raises:
        `RuntimeError`: naming what the launch set up and the fix.
    """
    launched = _env_processes()
    if launched > 1 and args.world_size == 1:
        raise RuntimeError(
            f"The environment says {launched} processes (`WORLD_SIZE`/`LOCAL_WORLD_SIZE`), but the training arguments "
            f"set up one: each process would train its own unsynchronised copy. {FIX}"
        )
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and args.parallel_mode != ParallelMode.DISTRIBUTED:
        raise RuntimeError(
            f"torch.distributed is initialised ({torch.distributed.get_world_size()} processes) but the training "
            f"arguments are not in distributed mode (`parallel_mode={args.parallel_mode.value}`): each process would "
            f"train its own unsynchronised copy. {FIX}"
        )
