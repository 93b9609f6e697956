"""Generation for rollouts: key/value-cache reuse over a forest of sequences, and the rollout loop's model calls.

- `prefix_cache`: [`PrefixCache`], the keys/values of a forest of sequences (shared prefixes stored and forwarded once,
  rows that grow, branching for tree samplers, chunked prefill);
- `attention`: the attention implementation its forwards run (shared nodes, own rows, new tokens, merged by
  log-sum-exp);
- `sampling`: the rollout loop's [`GenerateFn`]s: [`CachedGenerate`] (the cache behind `model.generate`'s own
  processors and stopping criteria) and [`reprefill_generate_fn`] (`model.generate` on whole prefixes), and
  [`count_forward_tokens`];
- `tree_sampling`: a prompt's completions sampled as a branching tree over the cache ([`sample_trees`],
  [`TreeSampler`]: the settings as plain values, and the generation's metrics), and the generation settings it refuses
  ([`check_generation_config`]).
"""

from .prefix_cache import CacheStats, Node, PrefixCache
from .sampling import CachedGenerate, GenerateFn, Generation, count_forward_tokens, reprefill_generate_fn
from .tree_sampling import RolloutTree, TreeSampler, TreeStats, check_generation_config, sample_trees

__all__ = ["CacheStats", "CachedGenerate", "GenerateFn", "Generation", "Node", "PrefixCache", "RolloutTree",
           "TreeSampler", "TreeStats", "check_generation_config", "count_forward_tokens", "reprefill_generate_fn",
           "sample_trees"]
