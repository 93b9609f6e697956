"""A console a person can follow: a progress bar, a short line every few steps, warnings once per run.

The Trainer's own progress callback writes the whole metrics dict (about 1 KB for GRPO with DTA) at every logging
step. [`ConsoleCallback`] keeps the progress bar and writes one short line per `every` optimizer steps instead, with
the means over the steps since the previous line:

```
step  10/100  reward 0.213  compression 6.31x  step 0.17 s
```

Nothing is taken from the logs: every logged value still reaches `report_to` (TensorBoard, W&B, ...) and
`trainer.state.log_history`, which the recipes' summaries read. [`quiet_console`] makes warnings appear once per run:
every process but the main one logs errors only (under `accelerate launch` each process would otherwise repeat each
warning). The recipes (`recipes/grpo.py`, `recipes/agent.py`) use both; for your own script:

```python
from trl_dta.trainers.console import quiet_console, use_console

quiet_console()                      # first, before the config is parsed
trainer = DTAGRPOTrainer(...)
use_console(trainer)                 # replaces the Trainer's progress callback
trainer.train()
```

[`RunArguments`] are the options both recipes share for a run on a console (the console line's interval, the
summary's window, CPU threads): a script argument dataclass inherits them.
"""

from __future__ import annotations

import logging
import statistics
import warnings
from dataclasses import dataclass, field

from transformers import PrinterCallback, ProgressCallback

from .._checks import check_int, is_main_process

# The line's fields: (logged key, label, format). A field whose key was not logged since the last line is left out
# (e.g. compression with `dta_enabled=False`).
FIELDS = (
    ("reward", "reward", "{:.3f}"),
    ("dta/compression_ratio", "compression", "{:.2f}x"),
    ("step_time", "step", "{:.2f} s"),
)

# Warnings that neither trl_dta nor the recipes trigger and that say nothing to do about them, hidden by
# `quiet_console` by their exact text: TRL 1.16 reads transformers 5.24's deprecated `is_gradient_checkpointing` in
# `trl.models.utils.unwrap_model_for_generation` (and PEFT in `PeftModel.__init__`), at every generation; DeepSpeed
# 0.19 gathers and reduce-scatters ZeRO-3's partitions through torch 2.13's deprecated collective names.
FOREIGN_WARNINGS = (r"`is_gradient_checkpointing` is deprecated",
                    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")


# transformers 5 renamed these `TrainingArguments` fields; the old names still work but warn, and a config file that
# sets the new name silently wins over a command-line flag with the old one. `modern_flags` renames the flags.
RENAMED_FLAGS = {
    "--gradient_checkpointing": "--activation_checkpointing",
    "--gradient_checkpointing_kwargs": "--activation_checkpointing_kwargs",
}


def modern_flags(argv: list[str]) -> list[str]:
    """`argv` with transformers' deprecated flag names ([`RENAMED_FLAGS`]) replaced by the current ones
    (`--gradient_checkpointing true` -> `--activation_checkpointing true`, `=value` forms included), so that a
    recipe's command line and its config file name the same field."""
    out = []
    for arg in argv:
        name, sign, value = arg.partition("=")
        out.append(RENAMED_FLAGS.get(name, name) + sign + value if name in RENAMED_FLAGS else arg)
    return out


def format_line(step: int, max_steps: int, logs: list[dict]) -> str:
    """One console line: the step and the mean of each of [`FIELDS`] over `logs` (the logging steps since the last
    line), e.g. `step  10/100  reward 0.213  compression 6.31x  step 0.17 s`."""
    width = len(str(max_steps)) if max_steps > 0 else 0
    parts = [f"step {step:>{width}}/{max_steps}" if max_steps > 0 else f"step {step}"]
    for key, label, fmt in FIELDS:
        values = [entry[key] for entry in logs if isinstance(entry.get(key), (int, float))]
        if values:
            parts.append(f"{label} {fmt.format(statistics.fmean(values))}")
    return "  ".join(parts)


class ConsoleCallback(ProgressCallback):
    """The Trainer's progress bar, with one short line per `every` optimizer steps instead of every logged dict.

    Each line holds the means of [`FIELDS`] (reward, DTA's compression ratio, TRL's step time) over the logging steps
    since the previous line: at the first logged step, then at every multiple of `every` and at the last step.
    Evaluation results get a line of their own (`eval` and the evaluated reward and loss); the end-of-training entry
    (`train_runtime`, ...) none: the recipes
    print a summary. With `disable_tqdm=True` there is no bar and the lines are printed. Only the world's main process
    writes.

    Args:
        every (`int`, *optional*):
            Optimizer steps between two lines. Defaults to a tenth of `max_steps` (at least 1), so that a run prints
            about ten lines whatever its length.
    """

    def __init__(self, every: int | None = None):
        super().__init__()
        self.every = check_int("every", every, minimum=1, allow_none=True, hint="optimizer steps between lines")
        self._pending: list[dict] = []
        self._last_line_step: int | None = None
        self._no_bar = False

    def on_train_begin(self, args, state, control, **kwargs):
        self._no_bar = bool(args.disable_tqdm)
        if not self._no_bar:
            super().on_train_begin(args, state, control, **kwargs)
        self.current_step = 0
        self._pending, self._last_line_step = [], None

    def on_step_end(self, args, state, control, **kwargs):
        if not self._no_bar:
            super().on_step_end(args, state, control, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        if not self._no_bar:
            super().on_train_end(args, state, control, **kwargs)

    def _write(self, line: str) -> None:
        if self.training_bar is not None:
            self.training_bar.write(line)
        else:
            print(line, flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "train_runtime" in logs:
            return
        if any(key.startswith("eval_") for key in logs):
            shown = {key: logs[key] for key in ("eval_reward", "eval_loss") if isinstance(logs.get(key), (int, float))}
            self._write(f"eval  step {state.global_step}  " + "  ".join(f"{k[5:]} {v:.3f}" for k, v in shown.items()))
            return
        self._pending.append(logs)
        every = self.every or max(1, state.max_steps // 10)
        if self._last_line_step is None or state.global_step % every == 0 or state.global_step == state.max_steps:
            self._write(format_line(state.global_step, state.max_steps, self._pending))
            self._pending, self._last_line_step = [], state.global_step


def use_console(trainer, every: int | None = None) -> ConsoleCallback:
    """Replaces the trainer's progress callback (`ProgressCallback`, or `PrinterCallback` with `disable_tqdm=True`)
    by a [`ConsoleCallback`] and returns it. Logging to `report_to` is unchanged.

    Args:
        trainer (`transformers.Trainer`): the trainer (any, DTA's or TRL's).
        every (`int`, *optional*): optimizer steps between two lines (see [`ConsoleCallback`]).
    """
    for callback in (ProgressCallback, PrinterCallback):
        trainer.remove_callback(callback)
    console = ConsoleCallback(every)
    trainer.add_callback(console)
    return console


def quiet_console() -> None:
    """Warnings once per run: call it at the start of a script, before the config is parsed.

    On every process but the main one (`RANK` > 0 under `accelerate launch` or `torchrun`), Python warnings are
    ignored and log records below `ERROR` are dropped, so each warning appears once, from the main process; errors
    still appear on every process. On every process, the warnings in [`FOREIGN_WARNINGS`] (raised inside TRL and
    PEFT, nothing a user can act on) are hidden by their exact text. `trl_dta`'s own one-time warnings already come
    from the main process only (`trl_dta._checks.warn_once`).
    """
    for message in FOREIGN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    if not is_main_process():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)


@dataclass
class RunArguments:
    """
    Run options of the recipes (`recipes/grpo.py`, `recipes/agent.py`), for a script arguments dataclass to inherit.

    Args:
        summary_window (`int`, *optional*, defaults to `5`):
            Number of first and last logged steps whose mean rewards the summary compares.
        console_steps (`int`, *optional*):
            Optimizer steps between two console lines (reward, compression, step time). Defaults to a tenth of
            `max_steps`. Every step's metrics still reach `report_to` and the summary.
        torch_num_threads (`int`, *optional*):
            Intra-op CPU threads of each process (`torch.set_num_threads`). Defaults to torch's choice.
    """

    summary_window: int = field(
        default=5,
        metadata={"help": "Number of first and last logged steps whose mean rewards the summary compares."},
    )
    console_steps: int | None = field(
        default=None,
        metadata={
            "help": "Optimizer steps between two console lines (reward, compression, step time). Defaults to a tenth "
            "of `max_steps`. Every step's metrics still reach `report_to` and the summary."
        },
    )
    torch_num_threads: int | None = field(
        default=None,
        metadata={
            "help": "Intra-op CPU threads of each process (`torch.set_num_threads`). Defaults to torch's choice."
        },
    )

    def check_run_args(self) -> None:
        """Refuses a bad run option with an error naming it."""
        check_int("--summary_window", self.summary_window, minimum=1)
        check_int("--console_steps", self.console_steps, minimum=1, allow_none=True)
        check_int("--torch_num_threads", self.torch_num_threads, minimum=1, allow_none=True)

    def set_threads(self) -> None:
        """`torch.set_num_threads(torch_num_threads)` when it is given."""
        if self.torch_num_threads is not None:
            import torch

            torch.set_num_threads(self.torch_num_threads)
