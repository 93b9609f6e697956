"""The recipes' end-of-run summaries, read from a trainer's `state.log_history` (one dict per logged step).

Both recipes (`recipes/grpo.py`, `recipes/agent.py`) end with one line `summary: {json}` whose reward trend is the
mean over the first and the last `window` logged steps (at most half of them each, so that the two never overlap).
"""

from __future__ import annotations

import statistics

__all__ = ["mean_of", "reward_trend"]


def mean_of(logs: list[dict], key: str) -> float | None:
    """The mean of `key` over the entries of `logs` that have it; `None` where none has."""
    values = [entry[key] for entry in logs if key in entry]
    return statistics.fmean(values) if values else None


def reward_trend(log_history: list[dict], window: int) -> dict:
    """The reward at the start and the end of a run, in total and per reward function, and the policy's entropy.

    Args:
        log_history (`list[dict]`):
            TRL's `trainer.state.log_history`; the entries with a `reward` are the logged training steps.
        window (`int`):
            How many first and last logged steps to average (capped at half of them, at least 1).

    Returns:
        `dict`: `reward_first`, `reward_last`, `rewards` (name -> `[first, last]` of `rewards/<name>/mean`),
        `entropy` (`[first, last]` of TRL's logged `entropy`: the policy's mean per-token entropy on the sampled
        completions, in nats; `None` where not logged) and `rewards_steps` (the window used).
    """
    logs = [entry for entry in log_history if "reward" in entry]
    k = max(1, min(window, len(logs) // 2))
    names = sorted({key[len("rewards/"):-len("/mean")] for entry in logs for key in entry
                    if key.startswith("rewards/") and key.endswith("/mean")})
    return {
        "reward_first": mean_of(logs[:k], "reward"),
        "reward_last": mean_of(logs[-k:], "reward"),
        "rewards": {name: [mean_of(logs[:k], f"rewards/{name}/mean"), mean_of(logs[-k:], f"rewards/{name}/mean")]
                    for name in names},
        "entropy": [mean_of(logs[:k], "entropy"), mean_of(logs[-k:], "entropy")],
        "rewards_steps": k,
    }
