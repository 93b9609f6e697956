"""Sampling a prompt's completions as a branching tree, shared segments generated once (`dta_tree_branching`).

With `dta_tree_branching=[4, 2]` and `dta_tree_segment_length=S`, each prompt's 8 completions are sampled as

```
prompt ─┬─ a (S tokens) ─┬─ a1 (to the end)        leaf 0
        │                └─ a2                      leaf 1
        ├─ b (S tokens) ─┬─ b1                      leaf 2
        │                └─ b2                      leaf 3
        ├─ c <eos>                                  leaves 4, 5 (c finished: both rows are c)
        └─ d (S tokens) ─┬─ ...                     leaves 6, 7
```

level 0 samples 4 first segments of `S` tokens from the prompt, level 1 samples 2 continuations of each, up to
`max_completion_length` tokens in all. A node's segment is generated once and its keys/values are held once: the
levels run on one generation cache (`trl_dta.generation.CachedGenerate` over a `PrefixCache`), in which the prompt is
prefilled once and stored once as a node, and when a level branches, each parent's segment (its last sampled token
forwarded once) becomes a node its children continue, never copied per child:

```
cache nodes:  prompt (P) ─┬─ a (S) ─┬─ row a1 (own tokens)     every node held once, read by the rows below it
                          │         └─ row a2
                          └─ b (S) ─┬─ row b1
                                    └─ row b2
```

so a group's generation memory is the prompt plus the tree's segments plus the live rows' own tokens, not `G` copies
of the prompt (`TreeStats.peak_kv_bytes`; `benchmarks/suites/bench_tree_memory.py`: a 4,096-token prompt with 8 leaves
peaks at 0.24 of independent sampling's key/value memory: twice the prompt, at the moment the prompt moves from the
rows' buffer into its node). No token of a shared part is forwarded twice.

Every level is one call of the `Generator` protocol ([`~generation.generator.Generator`]: each active node's prompt and
segments, `n` = its children); with transformers' generate (`CachedGenerate`) that is one `model.generate` call over all
of the level's children (decoded over the cache: transformers builds the logits processors and stopping criteria,
`CachedGenerate` runs its sampling loop) with the settings `generate`
would use for TRL's own sampling ([`effective_generation_config`]: the trainer's `generation_config` over the model's
`generation_config.json`), only `max_new_tokens` and, when set, `min_new_tokens` adapted to the level
([`level_generation_config`]). So the logits processors are TRL's: temperature, top-k, top-p, min-p and
`sequence_bias` act on one position's logits, and `repetition_penalty`, `no_repeat_ngram_size` and `bad_words_ids`
read the whole sequence (prompt and earlier segments are in `input_ids`), so all are exact across a branch point.
Settings that depend on where a `generate` call starts (`forced_eos_token_id`, `exponential_decay_length_penalty`,
`begin_suppress_tokens`, stop strings, ...) are refused, from either source ([`check_generation_config`]).

Distribution. The product of the segment distributions is the sequence distribution, so each leaf, taken alone, is a
sample from the policy: the same distribution as TRL's completions (not the same numbers: attention over cached
nodes, merged by log-sum-exp, gives logits that differ from one full prefill in the last bits).
`tests/generation/test_tree_sampling.py` checks each leaf's marginal and the joint law of a node and its children
(`P(a, b1, b2) = p(a) p(b1 | a) p(b2 | a)`) with chi-square tests. A node that ends (EOS) before a branch
point has no children: each of the rows below it is that same finished sequence, which is exactly what independent
continuation would give (an ended sequence has the empty continuation), so every row is still one sample of the
policy. Leaves of one prompt are correlated: what that does to the advantages is `tree_advantages.py`'s subject.

Budget. Every leaf has at most `max_completion_length` tokens: the branch points sit after `S, 2S, ...` completion
tokens and the last level continues to `max_completion_length`.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from transformers import GenerationConfig

from .generator import Generator
from .sampling import CachedGenerate, effective_generation_config

# GenerationConfig attributes whose effect depends on where a `generate` call starts (its input length, its
# `max_length`, its wall clock), or that do not sample the policy, so a tree of segment-wise calls would not sample
# TRL's distribution; why, for each.
UNSUPPORTED_GENERATION = {
    "forced_eos_token_id": "it forces <eos> at each call's last position, i.e. at every branch point",
    "exponential_decay_length_penalty": "its decay starts at each call's first new token",
    "begin_suppress_tokens": "it suppresses tokens at each call's first new token",
    "stop_strings": "a stopped row cannot be told apart from a branching one; use an <eos> token",
    "max_time": "it bounds each level's call, not the rollout",
    "max_length": "set `max_completion_length` instead",
    "min_length": "it counts prompt tokens, which differ by prompt; use `min_new_tokens`",
    "token_healing": "it rewrites the last tokens of each call's input",
    "guidance_scale": "classifier-free guidance is not a sample of the policy",
    "watermarking_config": "a watermark is not a sample of the policy",
    "dola_layers": "DoLa decoding is not a sample of the policy",
    "assistant_model": "assisted decoding is not supported with tree rollouts",
    "prompt_lookup_num_tokens": "assisted decoding is not supported with tree rollouts",
    "use_mtp": "assisted decoding is not supported with tree rollouts",
    "speculation_type": "assisted decoding is not supported with tree rollouts",
    "penalty_alpha": "contrastive search is not sampling",
    "cache_implementation": "tree rollouts sample over their own generation cache; leave `cache_implementation=None`",
}
# How every tree-rollout refusal ends: the setting that turns tree rollouts off.
TREE_OFF = "or set `dta_tree_branching=None` to sample completions independently as TRL does."
# Attributes that must have this value: tree rollouts sample, one sequence per row.
REQUIRED_GENERATION = {"do_sample": True, "num_beams": 1, "num_return_sequences": 1}
# `generate` overrides these in every call (`max_new_tokens` wins over `max_length`), so a checkpoint's value is inert.
_INERT_FROM_MODEL = ("max_length",)


def check_generation_config(generation_config, model=None) -> None:
    """Refuse generation settings that tree rollouts cannot sample exactly; each error names the setting and the fix.

    Args:
        generation_config (`transformers.GenerationConfig`): the trainer's (`GRPOTrainer.generation_config`, built
            from the `GRPOConfig` sampling fields and `generation_kwargs`).
        model (`transformers.PreTrainedModel`, *optional*): the policy; with it, also what `generate` will really use
            ([`effective_generation_config`]), so settings that come from the model's `generation_config.json` go
            through the same refusals.
    """
    sources = [(generation_config, None, "Remove it from `generation_kwargs`")]
    if model is not None:
        sources.append((effective_generation_config(model, generation_config),
                        model.generation_config._get_default_generation_params(),
                        ("It comes from the model's own generation config (its `generation_config.json`), which "
                         "`generate` reads for every field the trainer leaves unset: remove it there (e.g. "
                         "`model.generation_config.{name} = None` before building the trainer)")))
    for config, defaults, fix in sources:
        for name, why in UNSUPPORTED_GENERATION.items():
            if defaults is not None and name in _INERT_FROM_MODEL:
                continue
            value = getattr(config, name, None)
            default = None if defaults is None else defaults.get(name)
            if value is not None and value != default:
                raise ValueError(f"dta_tree_branching: `{name}={value!r}` cannot be used with tree rollouts ({why}). "
                                 f"{fix.format(name=name)}, {TREE_OFF}")
        for name, required in REQUIRED_GENERATION.items():
            value = getattr(config, name, None)
            if value is not None and value != required:  # None: transformers' default, which is the required value
                raise ValueError(
                    f"dta_tree_branching: tree rollouts sample, one sequence per row, so `{name}` must be "
                    f"{required!r} (got {value!r}). "
                    f"{fix.format(name=name)} or set `generation_kwargs={{{name!r}: {required!r}}}`, {TREE_OFF}"
                )


@dataclass
class RolloutTree:
    """One prompt's sampled tree, as the rows TRL receives.

    Args:
        leaves (`list[list[int]]`): the `G` completions in depth-first order, each at most `max_completion_length`
            tokens (EOS included when sampled).
        nodes (`list[list[int]]`): `nodes[j][l]`: the id (unique within the tree) of leaf `j`'s node at level `l`,
            for the levels its path reaches (a leaf whose node ended at level `l` has `l + 1` entries).
        starts (`list[int]`): completion position where level `l`'s segment starts (`0, S, 2S, ...`).
        generated_tokens (`int`): tokens sampled for this tree (each node's segment once).
        logprobs (`list[list[float]]`, *optional*): per leaf, its tokens' sampling log-probs, when the generator gave
            them (`None` from transformers' generate with TRL's settings, as TRL's own transformers path).
    """

    leaves: list[list[int]]
    nodes: list[list[int]]
    starts: list[int]
    generated_tokens: int = 0
    logprobs: list[list[float]] | None = None

    @property
    def independent_tokens(self) -> int:
        """Tokens that sampling the same leaves independently would generate."""
        return sum(len(leaf) for leaf in self.leaves)


@dataclass
class TreeStats:
    """What a call of [`sample_trees`] computed, for the metrics, the tests and the benchmarks.

    Args:
        forward_calls (`int`): model forwards.
        forward_tokens (`int`): token positions the model forwarded (each prompt and each node's segment once, a
            node's last token once when it branches, a leaf's last token never).
        peak_kv_bytes (`int`): the most key/value memory the generation cache held after a forward or a freeze (its
            shared nodes and its rows' buffer: `PrefixCache.kv_bytes`).
        cached_tokens (`int`, *optional*): prompt tokens the engine's own prefix cache served (vLLM's counter,
            `VLLMGenerate`); `None` for the transformers generators, whose reuse is what `forward_tokens` omits.
        logits (`list[list[torch.Tensor]]`, *optional*): with `return_logits`, per tree and leaf the raw logits of its
            sampled tokens, `(len(leaf), vocab)` float32.
    """

    forward_calls: int = 0
    forward_tokens: int = 0
    peak_kv_bytes: int = 0
    cached_tokens: int | None = None
    logits: list[list[torch.Tensor]] | None = None


@dataclass
class _Node:
    tokens: list[int]
    finished: bool
    children: list[_Node] = field(default_factory=list)
    logits: torch.Tensor | None = None  # (len(tokens), vocab)
    logprobs: list[float] | None = None  # (len(tokens),)


def level_budgets(n_levels: int, segment_length: int | None, max_new_tokens: int) -> list[int]:
    """New tokens per level: `segment_length` before each branch point, the rest of `max_new_tokens` after the last."""
    if n_levels == 1:
        return [max_new_tokens]
    return [segment_length] * (n_levels - 1) + [max_new_tokens - (n_levels - 1) * segment_length]


def level_generation_config(generation_config, budget: int, done: int):
    """One level's `generate` settings: the rollout's ([`effective_generation_config`]), with `max_new_tokens` set to
    the level's budget and `min_new_tokens` reduced by the `done` completion tokens sampled before the level (0 once it
    is met: `None` would let `generate` fill it from the model's own generation config again)."""
    config = copy.deepcopy(generation_config)
    config.max_new_tokens = budget
    config.max_length = config.min_length = None  # `generate` derives them from `max/min_new_tokens` in every call
    if getattr(config, "min_new_tokens", None):
        config.min_new_tokens = min(budget, max(0, generation_config.min_new_tokens - done))
    return config


@torch.no_grad()
def sample_trees(
    model,
    prompts: list[list[int]],
    branching: list[int],
    segment_length: int | None,
    max_new_tokens: int,
    generation_config,
    eos_token_ids: list[int],
    pad_token_id: int,
    return_logits: bool = False,
) -> tuple[list[RolloutTree], TreeStats]:
    """Sample one tree of completions per prompt with `model` (see the module docstring): [`sample_tree_levels`] over
    a [`~generation.CachedGenerate`] of `model`.

    Args:
        model (`transformers.PreTrainedModel`): the (unwrapped) policy, in eval mode.
        prompts (`list[list[int]]`): one prompt's token ids per tree (unpadded).
        branching (`list[int]`): children per level; their product is the number of leaves per tree.
        segment_length (`int`, *optional*): completion tokens per segment before each branch point (unused with one
            level).
        max_new_tokens (`int`): the longest completion (`max_completion_length`).
        generation_config (`transformers.GenerationConfig`): the sampling settings as `generate` uses them
            ([`effective_generation_config`], checked by [`check_generation_config`]).
        eos_token_ids (`list[int]`): tokens that end a completion.
        pad_token_id (`int`): the tokenizer's padding token.
        return_logits (`bool`, *optional*, defaults to `False`): also return each leaf's raw logits (tests).

    Returns:
        `(trees, stats)`: a [`RolloutTree`] per prompt and the [`TreeStats`] of the call.
    """
    ids = SimpleNamespace(eos_token_id=list(eos_token_ids), pad_token_id=pad_token_id)
    generator = CachedGenerate(model, ids, generation_config)
    return sample_tree_levels(generator, prompts, branching, segment_length, max_new_tokens, generation_config,
                              eos_token_ids, return_logits)


def sample_tree_levels(
    generator: Generator,
    prompts: list[list[int]],
    branching: list[int],
    segment_length: int | None,
    max_new_tokens: int,
    generation_config,
    eos_token_ids: list[int],
    return_logits: bool = False,
) -> tuple[list[RolloutTree], TreeStats]:
    """Sample one tree of completions per prompt, one `generator` call per level (see the module docstring).

    Level `l` is one call: every active node's prompt and segments, `n = branching[l]`, the level's budget, and the
    settings `generation_config` with `min_new_tokens` reduced by the completion tokens sampled before the level
    ([`level_generation_config`]). A sample ends its node when it ends with one of `eos_token_ids`, falls short of
    the budget or is at the last level.

    Args:
        generator ([`~generation.generator.Generator`]): the policy, for this call only (its shared prefixes are the
            tree's).
        generation_config (`transformers.GenerationConfig`): the settings each level's call adapts (a trainer's:
            `generator.generation_config`).
        return_logits (`bool`, *optional*, defaults to `False`): also return each leaf's raw logits (transformers'
            generators; tests).
        prompts, branching, segment_length, max_new_tokens, eos_token_ids: as in [`sample_trees`].

    Returns:
        `(trees, stats)`: a [`RolloutTree`] per prompt and the [`TreeStats`] of the call; each tree's `logprobs` when
        the generator gave every sample's log-probs.
    """
    stats, eos = TreeStats(), set(eos_token_ids)
    roots = [_Node([], finished=False) for _ in prompts]
    active = list(roots)  # the nodes whose children the next level samples
    prefixes = [list(p) for p in prompts]  # each active node's prompt and segments
    for level, (children, budget) in enumerate(zip(branching, level_budgets(len(branching), segment_length,
                                                                             max_new_tokens))):
        last = level == len(branching) - 1
        config = level_generation_config(generation_config, budget, level * (segment_length or 0))
        config.output_logits = return_logits
        samples = generator(prefixes, [budget] * len(prefixes), n=children, settings=config)  # prompt-major
        nodes = []
        parents = [node for node in active for _ in range(children)]
        for parent, sample in zip(parents, samples, strict=True):
            ended = bool(sample.ids) and sample.ids[-1] in eos
            node = _Node(list(sample.ids), finished=ended or last or len(sample.ids) < budget,
                         logits=sample.logits, logprobs=sample.logprobs)
            parent.children.append(node)
            nodes.append(node)
        keep = [r for r, node in enumerate(nodes) if not node.finished]
        if last or not keep:
            break
        active = [nodes[r] for r in keep]
        prefixes = [prefixes[r // children] + nodes[r].tokens for r in keep]
    generated = generator.stats
    stats.forward_calls, stats.forward_tokens, stats.peak_kv_bytes = (generated.forward_calls,
                                                                      generated.forward_tokens,
                                                                      generated.peak_kv_bytes)
    stats.cached_tokens = getattr(generated, "cached_tokens", None)

    trees, all_logits = [], []
    starts = [level * (segment_length or 0) for level in range(len(branching))]
    for root in roots:
        tree = RolloutTree([], [], starts)
        leaf_logits: list[torch.Tensor] = []
        _collect(root.children, branching, 0, [], [], tree, leaf_logits, itertools.count())
        trees.append(tree)
        all_logits.append(leaf_logits)
    if return_logits:
        stats.logits = all_logits
    return trees, stats


@dataclass(frozen=True)
class TreeSampler:
    """The settings of a rollout's tree sampling, as plain values: what [`sample_trees`] needs besides the model and
    the prompts (the trainer hook reads them from TRL's state once, at construction). [`sample`] samples through any
    [`~generation.generator.Generator`] (the trainer's policy, `trainers/generator.py`), with the generator's sampling
    settings; calling the sampler with a model samples through a [`~generation.CachedGenerate`] of it with these.

    Args:
        branching (`tuple[int, ...]`): children per level (`dta_tree_branching`).
        segment_length (`int`, *optional*): completion tokens per segment before each branch point
            (`dta_tree_segment_length`).
        max_new_tokens (`int`): the longest completion (`max_completion_length`).
        generation_config (`transformers.GenerationConfig`): the caller's sampling settings (TRL's
            `generation_config`), merged with the model's own at every call with a model
            ([`effective_generation_config`]).
        eos_token_ids (`tuple[int, ...]`): tokens that end a completion.
        pad_token_id (`int`): the tokenizer's padding token.
    """

    branching: tuple[int, ...]
    segment_length: int | None
    max_new_tokens: int
    generation_config: GenerationConfig
    eos_token_ids: tuple[int, ...]
    pad_token_id: int

    @property
    def num_leaves(self) -> int:
        """Completions per tree: the product of the branching factors."""
        return math.prod(self.branching)

    def __call__(self, model, prompts: list[list[int]]) -> tuple[list[RolloutTree], TreeStats]:
        """[`sample_trees`] of `prompts` (one tree per prompt) with these settings and `model`'s generation config
        under the caller's; `model` is the unwrapped policy, called under `torch.no_grad()`."""
        ids = SimpleNamespace(eos_token_id=list(self.eos_token_ids), pad_token_id=self.pad_token_id)
        return self.sample(CachedGenerate(model, ids, effective_generation_config(model, self.generation_config)),
                           prompts)

    @torch.no_grad()
    def sample(self, generator: Generator, prompts: list[list[int]]) -> tuple[list[RolloutTree], TreeStats]:
        """[`sample_tree_levels`] of `prompts` (one tree per prompt) with these settings over `generator` (a fresh
        one: the policy as the trainer holds it for generation), each level adapting `generator.generation_config`."""
        return sample_tree_levels(generator, prompts, list(self.branching), self.segment_length, self.max_new_tokens,
                                  generator.generation_config, list(self.eos_token_ids))

    def metrics(self, trees: list[RolloutTree], stats: TreeStats) -> dict[str, float]:
        """What one generation of `trees` cost and gave (the trainer logs these next to TRL's metrics):

        - `dta/generated_tokens`: completion tokens sampled (each tree node's segment once);
        - `dta/generated_tokens_independent`: completion tokens of the same leaves sampled independently;
        - `dta/generation_compression`: their ratio;
        - `dta/generation_forward_tokens`: token positions the model forwarded while generating (each distinct prompt
          once, each sampled token at most once);
        - `dta/generation_peak_kv_mb`: the most key/value memory the generation cache held (MiB);
        - `dta/generation_cached_tokens` (vLLM only): prompt tokens its prefix cache served, by its own counter;
        - `dta/tree_distinct_leaves`: distinct completions per tree (mean over trees; `num_leaves` at most);
        - `dta/tree_early_end_fraction`: the fraction of leaves whose completion ended before the last level, so that
          they copy a shorter node.
        """
        generated = sum(t.generated_tokens for t in trees)
        independent = sum(t.independent_tokens for t in trees)
        early = sum(len(path) < len(self.branching) for t in trees for path in t.nodes)
        cached = {} if stats.cached_tokens is None else {"dta/generation_cached_tokens": float(stats.cached_tokens)}
        return {
            **cached,
            "dta/generated_tokens": float(generated),
            "dta/generated_tokens_independent": float(independent),
            "dta/generation_compression": independent / max(generated, 1),
            "dta/generation_forward_tokens": float(stats.forward_tokens),
            "dta/generation_peak_kv_mb": stats.peak_kv_bytes / 2**20,
            "dta/tree_distinct_leaves": sum(len({tuple(leaf) for leaf in t.leaves}) for t in trees)
            / max(len(trees), 1),
            "dta/tree_early_end_fraction": early / max(len(trees) * self.num_leaves, 1),
        }


def _collect(children: list[_Node], branching: list[int], level: int, above: list[_Node], ids: list[int],
             tree: RolloutTree, leaf_logits: list, node_ids: Iterator[int]) -> None:
    """Append the leaves below `children` (level `level`; `above`: their ancestors, `ids` theirs) to `tree` in
    depth-first order, with their log-probs when every node has them; `node_ids` numbers the nodes in pre-order across
    the recursion."""
    for node in children:
        path, path_ids = above + [node], ids + [next(node_ids)]
        tree.generated_tokens += len(node.tokens)
        if node.children:
            _collect(node.children, branching, level + 1, path, path_ids, tree, leaf_logits, node_ids)
            continue
        seq = [token for n in path for token in n.tokens]
        logprobs = None if any(n.logprobs is None for n in path) else [lp for n in path for lp in n.logprobs]
        logits = [n.logits for n in path if n.logits is not None]
        if tree.leaves and (tree.logprobs is None) != (logprobs is None):
            raise RuntimeError("the generator gave log-probs for some samples only; please report this.")
        if logprobs is not None and tree.logprobs is None:
            tree.logprobs = []
        copies = math.prod(branching[level + 1:])  # a node that ended early stands for all the rows below it
        for _ in range(copies):
            tree.leaves.append(list(seq))
            tree.nodes.append(list(path_ids))
            if logprobs is not None:
                tree.logprobs.append(list(logprobs))
            if logits:
                leaf_logits.append(torch.cat(logits))
