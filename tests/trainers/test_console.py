"""The recipes' console (`trl_dta.trainers.console`): short lines instead of metrics dicts, warnings once per run."""

from __future__ import annotations

import logging
import warnings

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from trl_dta.trainers.console import ConsoleCallback, format_line, modern_flags, quiet_console


def _log(step: int, reward: float, ratio: float | None = 6.0) -> dict:
    entry = {"loss": 0.01, "reward": reward, "step_time": 0.2, "completions/mean_length": 5.0}
    if ratio is not None:
        entry["dta/compression_ratio"] = ratio
    return entry


def test_format_line_means_what_was_logged_and_leaves_out_the_rest():
    logs = [_log(9, 0.1, 6.0), _log(10, 0.3, 7.0)]
    assert format_line(10, 100, logs) == "step  10/100  reward 0.200  compression 6.50x  step 0.20 s"
    assert format_line(3, 4, [_log(3, 0.5, None)]) == "step 3/4  reward 0.500  step 0.20 s"  # dta_enabled=False
    assert format_line(7, -1, [{"loss": 1.0}]) == "step 7"  # no max_steps, nothing of the fields logged


def test_lines_come_every_few_steps_and_the_dict_never(tmp_path, capsys):
    args = TrainingArguments(output_dir=str(tmp_path), disable_tqdm=True, use_cpu=True, report_to="none")
    state, control = TrainerState(), TrainerControl()
    state.max_steps, state.is_world_process_zero = 20, True
    console = ConsoleCallback(every=5)
    console.on_train_begin(args, state, control)
    for step in range(1, 21):
        state.global_step = step
        console.on_step_end(args, state, control)
        console.on_log(args, state, control, logs=_log(step, step / 20))
    console.on_log(args, state, control, logs={"eval_reward": 0.75, "eval_loss": 0.5, "epoch": 1.0})
    console.on_log(args, state, control, logs={"train_runtime": 3.0, "train_loss": 0.1})
    console.on_train_end(args, state, control)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[:-1]] == ["1/20", "5/20", "10/20", "15/20", "20/20"]
    assert lines[2] == "step 10/20  reward 0.400  compression 6.00x  step 0.20 s"  # steps 6-10
    assert lines[-1] == "eval  step 20  reward 0.750  loss 0.500"
    assert not any("{" in line or "train_runtime" in line for line in lines)
    state.is_world_process_zero = False  # other processes write nothing
    console.on_log(args, state, control, logs=_log(21, 0.5))
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="every"):
        ConsoleCallback(every=0)


def test_deprecated_flags_are_renamed():
    argv = ["--gradient_checkpointing", "true", "--gradient_checkpointing_kwargs={}", "--max_steps", "3"]
    assert modern_flags(argv) == ["--activation_checkpointing", "true", "--activation_checkpointing_kwargs={}",
                                  "--max_steps", "3"]


def test_replicas_keep_only_errors(monkeypatch, caplog):
    logger = logging.getLogger("trl_dta.test_console")
    caplog.set_level(logging.INFO, logger=logger.name)  # before `quiet_console`: pytest would undo its disable
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        monkeypatch.setenv("RANK", "1")
        try:
            quiet_console()
            warnings.warn("a replica's warning", UserWarning, stacklevel=1)
            logger.warning("a replica's log warning")
            logger.error("a replica's error")
        finally:
            logging.disable(logging.NOTSET)
    assert not seen
    assert [r.getMessage() for r in caplog.records] == ["a replica's error"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        monkeypatch.setenv("RANK", "0")
        quiet_console()
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning,
                      stacklevel=1)
        warnings.warn("the main process's warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["the main process's warning"]
