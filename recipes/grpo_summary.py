"""The GRPO recipes' end-of-run summary (`recipes/grpo.py`, `recipes/grpo_vlm.py`): from the trainer's logged metrics,
the readable lines ([`summarize`]: steps, wall time, the reward trend, the step's time split, DTA's savings) and the
JSON record ([`summary_record`], the recipes' last line `summary: {...}`)."""

from __future__ import annotations

import statistics

from trl_dta.analysis.run_summary import mean_of as _mean
from trl_dta.analysis.run_summary import reward_trend

DTA_METRICS = ("dta/compression_ratio", "dta/tokens", "dta/tree_tokens", "dta/forward_tokens")
BALANCE_METRICS = (
    "dta/compression_ratio_before_balance",
    "dta/compression_ratio_after_balance",
    "dta/rank_cost_imbalance",
)
# TRL's seconds per optimizer step and the two parts of it before training (`trl_dta/trainers/phases.py`).
PHASE_METRICS = ("step_time", "generation_time", "scoring_time")


def step_split(logs: list[dict]) -> list[str]:
    """The summary's lines on where a step's time went: generation, scoring, training (TRL's `step_time` less the
    first two), and with DTA the engine's share and what the dense path's training would take if its time followed
    the tokens computed (an estimate, said so). Empty when the phases were not logged."""
    timed = [entry for entry in logs if all(key in entry for key in PHASE_METRICS)]
    if not timed:
        return []
    mean = {key: statistics.fmean(entry[key] for entry in timed) for key in PHASE_METRICS}
    generation, scoring = mean["generation_time"], mean["scoring_time"]
    training = mean["step_time"] - generation - scoring
    lines = [
        f"time per step: {mean['step_time']:.3f} s = generation {generation:.3f} s + scoring {scoring:.3f} s "
        f"+ training {training:.3f} s (means over {len(timed)} logged steps)"
    ]
    engine = [entry for entry in timed if "dta/step_time" in entry and "dta/compression_ratio" in entry]
    if engine:
        seconds = statistics.fmean(entry["dta/step_time"] for entry in engine)
        ratio = statistics.fmean(entry["dta/compression_ratio"] for entry in engine)
        lines.append(
            f"DTA: training {training:.3f} s, of which the engine's forward/backward {seconds:.3f} s; TRL's dense path "
            f"computes {ratio:.2f}x the tokens: {training - seconds + seconds * ratio:.3f} s if its time followed the "
            "tokens (an estimate; a small model's dense batch runs faster per token: measure it with "
            "`--dta_enabled false`)"
        )
    return lines


def summarize(log_history: list[dict], steps: int, wall_time: float, window: int, num_processes: int = 1,
              strategy: str = "", heldout: list[float] | None = None) -> str:
    """The end-of-run summary: steps, wall time, reward trend and DTA savings from the trainer's logged metrics.

    Args:
        log_history (`list[dict]`): `trainer.state.log_history` (one entry per logging step, plus the final one).
        steps (`int`): optimizer steps taken.
        wall_time (`float`): seconds of `trainer.train()`.
        window (`int`): number of first and last logged steps whose rewards are compared.
        num_processes (`int`, *optional*, defaults to `1`): processes of the run (the DTA token counts are this
            process's).
        strategy (`str`, *optional*): the distributed engine DTA ran under, in words (`dta_strategy`); shown with
            several processes.
        heldout (`list[float]`, *optional*): the held-out greedy accuracy before and after training
            (`grpo.evaluate_heldout`), when the run scored one.
    """
    logs = [entry for entry in log_history if "reward" in entry]
    lines = ["=" * 24 + " trl-dta GRPO summary " + "=" * 24]
    lines.append(
        f"steps: {steps}    processes: {num_processes}    wall time: {wall_time:.1f} s "
        f"({wall_time / max(steps, 1):.2f} s/step)"
    )
    if strategy and num_processes > 1:
        lines.append(f"distributed: {strategy}")
    if logs:
        trend = reward_trend(log_history, window)
        k, first, last = trend["rewards_steps"], trend["reward_first"], trend["reward_last"]
        lines.append(
            f"reward: mean of first {k} logged steps {first:.3f} -> last {k} logged steps {last:.3f} "
            f"({last - first:+.3f})"
        )
        for name, (first, last) in trend["rewards"].items():
            if None not in (first, last):
                lines.append(f"  {name}: {first:.3f} -> {last:.3f} ({last - first:+.3f})")
        if None not in trend["entropy"]:
            first, last = trend["entropy"]
            lines.append(f"entropy (the policy's, nats per completion token): {first:.3f} -> {last:.3f}")
    else:
        lines.append("reward: no step was logged (set `logging_steps` to at most `max_steps`)")
    if heldout:
        change = f" -> after training {heldout[-1]:.3f} ({heldout[-1] - heldout[0]:+.3f})" if len(heldout) > 1 else ""
        lines.append(f"held-out greedy accuracy: before training {heldout[0]:.3f}{change}")
    lines += step_split(logs)
    dta = [entry for entry in logs if all(key in entry for key in DTA_METRICS)]
    if dta:
        mean = {key: statistics.fmean(entry[key] for entry in dta) for key in DTA_METRICS}
        lines.append(
            f"DTA: compression ratio {mean['dta/compression_ratio']:.2f}x (mean over {len(dta)} logged steps)"
        )
        lines.append(
            f"DTA: tokens per engine forest: dense {mean['dta/tokens']:.0f}, "
            f"prefix tree {mean['dta/tree_tokens']:.0f}, computed {mean['dta/forward_tokens']:.0f} "
            f"({mean['dta/forward_tokens'] / mean['dta/tokens']:.1%} of dense)"
            + (" on process 0" if num_processes > 1 else "")
        )
        balanced = [entry for entry in logs if all(key in entry for key in BALANCE_METRICS)]
        if balanced:
            mean = {key: statistics.fmean(entry[key] for entry in balanced) for key in BALANCE_METRICS}
            lines.append(
                f"DTA: groups balanced over {num_processes} processes: compression "
                f"{mean['dta/compression_ratio_before_balance']:.2f}x with TRL's split -> "
                f"{mean['dta/compression_ratio_after_balance']:.2f}x, rank cost max/mean "
                f"{mean['dta/rank_cost_imbalance']:.2f}"
            )
    else:
        lines.append(
            "DTA: no metrics logged (DTA disabled with `dta_enabled=False`, or every micro-batch took the dense path "
            "because its prefix tree compressed less than `dta_min_compression`)"
        )
    lines.append("=" * 70)
    return "\n".join(lines)


def summary_record(log_history: list[dict], steps: int, wall_time: float, window: int, num_processes: int = 1,
                   use_vllm: bool = False, heldout: list[float] | None = None) -> dict:
    """The summary as one JSON-ready record (the recipe's last line, `summary: {...}`), for scripts and tables.

    Args: as [`summarize`], plus
        use_vllm (`bool`, *optional*, defaults to `False`): the run's `use_vllm` (named in `generation`).

    Returns:
        `dict`: `steps`, `processes`, `wall_s`, `reward_first` / `reward_last` (means over the first and last
        `window` logged steps, at most half of them each), `rewards` (the same per reward function: `[first, last]`),
        `entropy` (`[first, last]`, TRL's logged `entropy`), `rewards_steps`, `heldout_accuracy` (`[before, after]`
        greedy accuracy on the held-out problems, or `None`), `step_s` / `generation_s` / `scoring_s` / `training_s`
        (seconds per step, means over logged steps; training is TRL's `step_time` less generation and scoring),
        `dta_train_s` (the engine's share),
        `compression_ratio`, `tokens`, `tree_tokens`, `forward_tokens` (per engine forest), `generation`
        (`"vllm"` or `"transformers"`). Values a run did not log are `None`.
    """
    logs = [entry for entry in log_history if "reward" in entry]
    timed = [entry for entry in logs if all(key in entry for key in PHASE_METRICS)]
    split = {key: _mean(timed, metric) for key, metric in
             (("step_s", "step_time"), ("generation_s", "generation_time"), ("scoring_s", "scoring_time"))}
    training = None if not timed else split["step_s"] - split["generation_s"] - split["scoring_s"]
    record = {
        "steps": steps,
        "processes": num_processes,
        "wall_s": round(wall_time, 1),
        **reward_trend(log_history, window),
        "heldout_accuracy": heldout,
        **split,
        "training_s": training,
        "dta_train_s": _mean(timed, "dta/step_time"),
    }
    for key in DTA_METRICS:
        record[key.removeprefix("dta/")] = _mean(logs, key)
    record["generation"] = "vllm" if use_vllm else "transformers"
    return record
