"""trl-dta: Dynamic Tree Attention for TRL.

RL post-training (GRPO, RLOO) scores many rollouts that share prefixes. trl-dta runs the policy through the prefix tree
of a batch depth-first, so that every shared prefix is computed once in the forward and once in the backward pass,
with results equal to the dense computation.
"""

from .balance import CostModel, ForestStats, Partition, forest_stats, partition, partition_for_ranks
from .engine import DTAEngine, DTAOutput
from .tree import PrefixTree, Segment

__version__ = "0.1.0"

# The trainers import TRL (slow); they load on first access.
_TRAINERS = ("DTAGRPOConfig", "DTAGRPOTrainer", "DTARLOOConfig", "DTARLOOTrainer")

# Names that were public once and moved out of the package: where they went. An `ImportError` (not an AttributeError,
# which `from trl_dta import name` would replace with a message that does not say where the name went).
_MOVED = {
    "lpt_partition": "`lpt_partition` moved to `benchmarks/baselines/lpt.py` (`from benchmarks.baselines.lpt import "
    "lpt_partition`): it is a benchmark baseline, not part of the API. Use `trl_dta.partition` to balance ranks.",
}


def __getattr__(name):
    if name in _TRAINERS:
        from . import trainers

        return getattr(trainers, name)
    if name in _MOVED:
        raise ImportError(_MOVED[name], name=name)
    raise AttributeError(f"module 'trl_dta' has no attribute {name!r}")


__all__ = [
    *_TRAINERS,
    "CostModel",
    "DTAEngine",
    "DTAOutput",
    "ForestStats",
    "Partition",
    "PrefixTree",
    "Segment",
    "__version__",
    "forest_stats",
    "partition",
    "partition_for_ranks",
]
