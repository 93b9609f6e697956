"""The rollout batches the benchmarks measure (token ids, or episodes for the trainer's agent runs).

- `batches.py`: seeded batches with the prefix-sharing shapes of RL post-training (GRPO groups, multi-turn agent
  trees, per-turn rows, no sharing) and the tau2 airline per-turn rows read from `data/` ([`Workload`]);
- `tau2.py`: tau2-bench's real domains played by gold-action scripts (needs `trl-dta[tau2]`), and the token file
  (`data/tau2-airline.json.gz`) that lets a machine without tau2 build the airline rows;
- `agent.py`: the trainer benchmark's agent episodes (the stand-in retail domain's scripted agent, or tau2's gold
  episodes) and their replay through TRL's `rollout_func`.

`from benchmarks import workloads` gives the builders of `batches.py` (`workloads.grpo(...)`).
"""

from .batches import (
    FIRST_ID,
    GRPO_GRID,
    SUITES,
    Workload,
    by_name,
    grpo,
    multi_turn,
    multi_turn_3x,
    no_sharing,
    per_turn,
    suite,
    tau2_airline,
)

__all__ = ["FIRST_ID", "GRPO_GRID", "SUITES", "Workload", "by_name", "grpo", "multi_turn", "multi_turn_3x",
           "no_sharing", "per_turn", "suite", "tau2_airline"]
