"""trl-dta: Dynamic Tree Attention for TRL.

RL post-training (GRPO, RLOO) scores many rollouts that share prefixes. trl-dta runs the policy through the prefix tree
of a batch depth-first, so that every shared prefix is computed once in the forward and once in the backward pass,
with results equal to the dense computation.
"""

from .balance import CostModel, ForestStats, Partition, forest_stats, lpt_partition, partition
from .engine import DTAEngine, DTAOutput
from .tree import PrefixTree, Segment

__version__ = "0.1.0"

# The trainers import TRL (slow); they load on first access.
_TRAINERS = ("DTAGRPOConfig", "DTAGRPOTrainer", "DTARLOOConfig", "DTARLOOTrainer")


def __getattr__(name):
    if name in _TRAINERS:
        from . import trainers

        return getattr(trainers, name)
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
    "lpt_partition",
    "partition",
]
