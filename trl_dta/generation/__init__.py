"""Generation for rollouts: the protocol every rollout samples the policy through, key/value-cache reuse over a forest
of sequences, and tree sampling.

- `generator`: [`Generator`], the protocol (prompt token ids, a budget per prompt, `n` samples each, sampling settings
  -> [`Generation`]s: token ids and their sampling log-probs; shared prefixes found from the token ids);
- `prefix_cache`: [`PrefixCache`], the keys/values of a forest of sequences (shared prefixes stored and forwarded once,
  rows that grow, branching for tree samplers, chunked prefill);
- `attention`: the attention implementation its forwards run (shared nodes, own rows, new tokens, merged by
  log-sum-exp);
- `sampling`: the transformers [`Generator`]s: [`CachedGenerate`] (the cache behind `model.generate`'s own processors
  and stopping criteria) and [`reprefill_generate_fn`] (`model.generate` on whole prefixes), and
  [`count_forward_tokens`];
- `vllm_generate`: [`VLLMGenerate`], the vLLM [`Generator`] (a vLLM engine's `generate` on token ids, its prefix
  cache, its own counters);
- `tree_sampling`: a prompt's completions sampled as a branching tree, one [`Generator`] call per level
  ([`sample_trees`], [`TreeSampler`]: the settings as plain values, and the generation's metrics), and the generation
  settings it refuses ([`check_generation_config`]).
"""

from .generator import Generation, Generator
from .prefix_cache import CacheStats, Node, PrefixCache
from .sampling import CachedGenerate, ReprefillGenerate, count_forward_tokens, reprefill_generate_fn
from .tree_sampling import RolloutTree, TreeSampler, TreeStats, check_generation_config, sample_trees
from .vllm_generate import VLLMGenerate

__all__ = ["CacheStats", "CachedGenerate", "Generation", "Generator", "Node", "PrefixCache", "ReprefillGenerate",
           "RolloutTree", "TreeSampler", "TreeStats", "check_generation_config", "count_forward_tokens",
           "reprefill_generate_fn", "sample_trees", "VLLMGenerate"]
