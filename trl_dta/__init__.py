"""trl-dta: Dynamic Tree Attention for TRL.

RL post-training (GRPO, RLOO) scores many rollouts that share prefixes. trl-dta runs the policy through the prefix tree
of a batch depth-first, so that every shared prefix is computed once in the forward and once in the backward pass,
with results equal to the dense computation.
"""

from .engine import DTAEngine, DTAOutput
from .tree import PrefixTree, Segment

__version__ = "0.1.0"

__all__ = ["DTAEngine", "DTAOutput", "PrefixTree", "Segment", "__version__"]
