"""Peers that DTA is measured against: the stock dense path, a packed tree-mask ("sparse") path, and LPT rank
balancing (`lpt.py`)."""

from .dense import DenseProvider
from .lpt import lpt_partition
from .sparse import SparseProvider, tree_attention_mask

__all__ = ["DenseProvider", "SparseProvider", "lpt_partition", "tree_attention_mask"]
