"""Peers that DTA is measured against: the stock dense path and a packed tree-mask ("sparse") path."""

from .dense import DenseProvider
from .sparse import SparseProvider, tree_attention_mask


__all__ = ["DenseProvider", "SparseProvider", "tree_attention_mask"]
