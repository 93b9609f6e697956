"""Cost model and the partition of a global batch of rollouts across data-parallel ranks.

Every rank runs the prefix tree (forest) of the sequences it gets, so a rank's work is the cost of *its* forest, not
the sum of its sequence lengths. Two things matter: balance (the step takes as long as the slowest rank) and sharing
(a shared prefix whose sequences land on two ranks is computed twice):

```
sorted batch:  s0 s1 s2 | s3 s4 s5 s6 | s7 s8     rank costs:  cost(forest(s0..s2)), cost(forest(s3..s6)), ...
               rank 0     rank 1        rank 2    duplicated:  lcp(s2, s3) and lcp(s6, s7) tokens, at the cuts
```

The modules, bottom up (one planner calling self-contained strategies; a strategy imports only `cost`):

- `cost`: the primitives: [`CostModel`] (`token_cost * tree_tokens + attention_cost * attention_work + leaf_cost *
  leaves + fixed_cost`, fitted by exact NNLS), [`ForestStats`] / [`forest_stats`], and the sorted batch whose prefix
  sums give the statistics of any contiguous run in O(1);
- `contiguous` (strategy): the published recipe: sort, binary-search the smallest admissible maximum cost, then the
  cuts that duplicate the least work; and the equal-size runs of the sorted batch;
- `packing` (strategy): whole groups or subtrees packed onto ranks with exact union costs and local search;
- `partition` (the planner): the public [`partition`] (argument checks once, the sorted batch once, the candidates of
  the strategies asked for, the pick) and [`partition_for_ranks`], the one call the trainers make (equal count per
  rank, whole groups), which `trl-dta analyze` uses to predict balance.
"""

from .cost import CostModel, ForestStats, forest_stats
from .partition import STRATEGIES, Partition, partition, partition_for_ranks

__all__ = ["STRATEGIES", "CostModel", "ForestStats", "Partition", "forest_stats", "partition", "partition_for_ranks"]
