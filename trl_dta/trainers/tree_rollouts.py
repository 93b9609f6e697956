"""Tree rollouts: a prompt's `num_generations` completions sampled as a branching tree, shared segments generated once.

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
`max_completion_length` tokens in all. A node's segment is generated once: the prompt is prefilled once per prompt,
and each level's children start from a copy of their parent's key/value cache (`DynamicCache.batch_select_indices`
with the parent's row repeated), so the only token of a shared part that is forwarded again is the parent's last
sampled token, once per child (`generate` never forwards the token it samples last). Every level is one
`model.generate` call over all of the level's children with TRL's `generation_config` (only `max_new_tokens` and,
when set, `min_new_tokens` are adapted to the level), so the logits processors are TRL's: temperature, top-k, top-p,
min-p and `sequence_bias` act on one position's logits, and `repetition_penalty`, `no_repeat_ngram_size` and
`bad_words_ids` read the whole sequence (prompt and earlier segments are in `input_ids`), so all are exact across a
branch point. Settings that depend on where a `generate` call starts (`forced_eos_token_id`,
`exponential_decay_length_penalty`, `begin_suppress_tokens`, stop strings, ...) are refused ([`check_generation_config`]).

Rows. TRL's sampler repeats every prompt `num_generations` times in consecutive rows; `_generate_single_turn` must
return one completion per row in that order. A group's rows receive its leaves in depth-first order (rows within a
group are exchangeable for everything TRL computes). A node that ends (EOS) before a branch point has no children:
each of the rows below it is that same finished sequence, which is exactly what independent continuation would give
(an ended sequence has the empty continuation), so every row is still one sample of the policy.

Distribution. The product of the segment distributions is the sequence distribution, so each leaf, taken alone, is a
sample from the policy (`tests/trainers/test_tree_rollouts.py` checks the marginals with a chi-square test). Leaves of
one prompt are *correlated*: siblings share their first segments. What that does to TRL's group baseline (the mean
reward of the group's `G` leaves):

- it stays an unbiased estimate of the prompt's value, with a larger variance than from `G` independent samples
  (only `branching[0]` independent first segments);
- it shrinks the gradient of shared segments. With independent samples the mean includes the sample itself, which
  scales every expected gradient by `(G - 1) / G` (TRL's behaviour). A segment shared by the `m` leaves below its node
  has the node's value in the baseline with weight `m / G`, so its expected gradient is scaled by `(G - m) / G`
  (leaves outside the node are independent of the segment given its parent and add no bias): with `[2, 2, 2]`
  (`G = 8`) the first segments learn at 4/8 of their signal, the second at 6/8, the last at 7/8;
- with `scale_rewards="group"` the division by the group's standard deviation uses correlated rewards too.

The optional tree advantage (`dta_tree_advantage="tree"`, [`tree_advantages`]) credits each segment with its node's
value minus its parent's (TreeRL, TreePO): a node is compared with its siblings, and its expected gradient is scaled
by `(b - 1) / b` for a node with `b` siblings (TRL's self-inclusion, per branch point).

Budget. Every leaf has at most `max_completion_length` tokens: the branch points sit after `S, 2S, ...` completion
tokens and the last level continues to `max_completion_length`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch


# GenerationConfig attributes whose effect depends on where a `generate` call starts (its input length, its
# `max_length`, its wall clock), so a tree of segment-wise calls would not sample TRL's distribution; the fix for each.
UNSUPPORTED_GENERATION = {
    "forced_eos_token_id": "it forces <eos> at each call's last position, i.e. at every branch point",
    "exponential_decay_length_penalty": "its decay starts at each call's first new token",
    "begin_suppress_tokens": "it suppresses tokens at each call's first new token",
    "stop_strings": "a stopped row cannot be told apart from a branching one; use an <eos> token",
    "max_time": "it bounds each level's call, not the rollout",
    "max_length": "set `max_completion_length` instead",
    "min_length": "it counts prompt tokens, which differ by prompt; use `min_new_tokens`",
    "guidance_scale": "classifier-free guidance is not a sample of the policy",
    "watermarking_config": "a watermark is not a sample of the policy",
    "assistant_model": "assisted decoding is not supported with tree rollouts",
    "prompt_lookup_num_tokens": "assisted decoding is not supported with tree rollouts",
    "penalty_alpha": "contrastive search is not sampling",
    "cache_implementation": "tree rollouts copy a `DynamicCache` per child; leave `cache_implementation=None`",
}
# Attributes that must have this value: tree rollouts sample, one sequence per row.
REQUIRED_GENERATION = {"do_sample": True, "num_beams": 1, "num_return_sequences": 1}  # (do_sample: TRL sets True)


def check_generation_config(generation_config) -> None:
    """Refuse generation settings that tree rollouts cannot sample exactly; each error names the setting and the fix.

    Args:
        generation_config (`transformers.GenerationConfig`): the trainer's (`GRPOTrainer.generation_config`, built
            from the `GRPOConfig` sampling fields and `generation_kwargs`).
    """
    from transformers import GenerationConfig

    default = GenerationConfig()
    for name, why in UNSUPPORTED_GENERATION.items():
        value = getattr(generation_config, name, None)
        if value is not None and value != getattr(default, name, None):
            raise ValueError(
                f"dta_tree_branching: `{name}={value!r}` cannot be used with tree rollouts ({why}). Remove it from "
                "`generation_kwargs`, or set `dta_tree_branching=None` for TRL's independent sampling."
            )
    for name, required in REQUIRED_GENERATION.items():
        value = getattr(generation_config, name, None)
        if value is not None and value != required:  # None: transformers' default, which is the required value
            raise ValueError(
                f"dta_tree_branching: tree rollouts sample, one sequence per row, so `{name}` must be {required!r} "
                f"(got {value!r}). Remove it from `generation_kwargs`, or set `dta_tree_branching=None`."
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
    """

    leaves: list[list[int]]
    nodes: list[list[int]]
    starts: list[int]
    generated_tokens: int = 0

    @property
    def independent_tokens(self) -> int:
        """Tokens that sampling the same leaves independently would generate."""
        return sum(len(leaf) for leaf in self.leaves)


@dataclass
class TreeStats:
    """What a call of [`sample_trees`] computed, for the metrics and the tests.

    Args:
        forward_calls (`list[tuple[int, int]]`): `(rows, new positions)` of every model forward, in order.
        logits (`list[list[torch.Tensor]]`, *optional*): with `return_logits`, per tree and leaf the raw logits of its
            sampled tokens, `(len(leaf), vocab)` float in the model's dtype.
    """

    forward_calls: list[tuple[int, int]] = field(default_factory=list)
    logits: list[list[torch.Tensor]] | None = None


@dataclass
class _Node:
    tokens: list[int]
    finished: bool
    children: list[_Node] = field(default_factory=list)
    logits: torch.Tensor | None = None  # (len(tokens), vocab)


def _left_pad(rows: list[list[int]], pad_token_id: int, multiple: int | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `(N, P)` ids and their `(N, P)` attention mask, as TRL pads prompts for `generate`."""
    width = max(len(r) for r in rows)
    if multiple:
        width = math.ceil(width / multiple) * multiple
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


def _first_eos(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Per row of `tokens` `(N, s)`, the number of tokens up to and including the first EOS, or `s` when none."""
    is_eos = torch.isin(tokens, eos)
    any_eos = is_eos.any(dim=1)
    first = torch.where(any_eos, is_eos.int().argmax(dim=1) + 1, torch.full_like(any_eos, tokens.size(1), dtype=torch.long))
    return first, any_eos


def level_budgets(n_levels: int, segment_length: int | None, max_new_tokens: int) -> list[int]:
    """New tokens per level: `segment_length` before each branch point, the rest of `max_new_tokens` after the last."""
    if n_levels == 1:
        return [max_new_tokens]
    return [segment_length] * (n_levels - 1) + [max_new_tokens - (n_levels - 1) * segment_length]


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
    pad_to_multiple_of: int | None = None,
    return_logits: bool = False,
) -> tuple[list[RolloutTree], TreeStats]:
    """Sample one tree of completions per prompt (see the module docstring).

    Args:
        model (`transformers.PreTrainedModel`): the (unwrapped) policy, in eval mode.
        prompts (`list[list[int]]`): one prompt's token ids per tree (unpadded).
        branching (`list[int]`): children per level; their product is the number of leaves per tree.
        segment_length (`int`, *optional*): completion tokens per segment before each branch point (unused with one
            level).
        max_new_tokens (`int`): the longest completion (`max_completion_length`).
        generation_config (`transformers.GenerationConfig`): TRL's sampling settings ([`check_generation_config`]).
        eos_token_ids (`list[int]`): tokens that end a completion.
        pad_token_id (`int`): the tokenizer's padding token.
        pad_to_multiple_of (`int`, *optional*): prompt padding, as TRL's.
        return_logits (`bool`, *optional*, defaults to `False`): also return each leaf's raw logits (tests).

    Returns:
        `(trees, stats)`: a [`RolloutTree`] per prompt and the [`TreeStats`] of the call.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    stats = TreeStats()
    hook = model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: stats.forward_calls.append(tuple(_forward_shape(args, kwargs))), with_kwargs=True
    )
    try:
        ids, mask = _left_pad(prompts, pad_token_id, pad_to_multiple_of, device)  # (U, P)
        cache = DynamicCache(config=model.config)
        if ids.size(1) > 1:  # prefill every prompt but its last token, once per prompt
            position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
            model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=position_ids[:, :-1], cache=cache,
                  use_cache=True)
        roots = [_Node([], finished=False) for _ in prompts]
        active = list(roots)  # the nodes whose children the next level samples, one per row of `ids` and `cache`
        eos = torch.tensor(eos_token_ids, device=device)
        for level, (children, budget) in enumerate(zip(branching, level_budgets(len(branching), segment_length,
                                                                                 max_new_tokens))):
            last = level == len(branching) - 1
            rows = torch.arange(len(active), device=device).repeat_interleave(children)  # (n,) parent row per child
            ids, mask = ids[rows], mask[rows]  # (n, T)
            cache.batch_select_indices(rows)  # each child starts from a copy of its parent's cache
            config = copy.deepcopy(generation_config)
            config.max_new_tokens = budget
            done = level * (segment_length or 0)
            if getattr(config, "min_new_tokens", None):
                config.min_new_tokens = max(0, generation_config.min_new_tokens - done) or None
            config.return_dict_in_generate = True
            config.output_logits = return_logits
            out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, generation_config=config)
            new = out.sequences[:, ids.size(1):]  # (n, s), s <= budget
            lengths, ended = _first_eos(new, eos)
            step_logits = torch.stack(out.logits, dim=1) if return_logits else None  # (n, s, vocab)
            nodes = []
            parents = [node for node in active for _ in range(children)]
            for r, parent in enumerate(parents):
                n = int(lengths[r])
                node = _Node(new[r, :n].tolist(), finished=bool(ended[r]) or last or n < budget)
                if step_logits is not None:
                    node.logits = step_logits[r, :n]
                parent.children.append(node)
                nodes.append(node)
            if last:
                break
            keep = [r for r, node in enumerate(nodes) if not node.finished]
            if not keep:
                break
            keep_rows = torch.tensor(keep, device=device)
            ids = out.sequences[keep_rows]
            mask = torch.cat([mask, torch.ones_like(new)], dim=1)[keep_rows]
            cache.batch_select_indices(keep_rows)  # `generate` grew `cache` in place
            active = [nodes[r] for r in keep]
    finally:
        hook.remove()

    trees, all_logits = [], []
    starts = [level * (segment_length or 0) for level in range(len(branching))]
    for root in roots:
        tree = RolloutTree([], [], starts)
        leaf_logits: list[torch.Tensor] = []
        _collect(root.children, branching, 0, [], [], [], tree, leaf_logits, counter=[0])
        trees.append(tree)
        all_logits.append(leaf_logits)
    if return_logits:
        stats.logits = all_logits
    return trees, stats


def _forward_shape(args, kwargs) -> tuple[int, int]:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs["inputs_embeds"]
    return int(ids.size(0)), int(ids.size(1))


def _collect(children: list[_Node], branching: list[int], level: int, tokens: list[int], path: list[int],
             logits: list[torch.Tensor], tree: RolloutTree, leaf_logits: list, counter: list[int]) -> None:
    """Append the leaves below `children` (level `level`) to `tree` in depth-first order."""
    for node in children:
        node_id = counter[0]
        counter[0] += 1
        tree.generated_tokens += len(node.tokens)
        seq, ids = tokens + node.tokens, path + [node_id]
        lg = logits + ([node.logits] if node.logits is not None else [])
        if node.children:
            _collect(node.children, branching, level + 1, seq, ids, lg, tree, leaf_logits, counter)
            continue
        copies = math.prod(branching[level + 1:])  # a node that ended early stands for all the rows below it
        for _ in range(copies):
            tree.leaves.append(list(seq))
            tree.nodes.append(list(ids))
            if lg:
                leaf_logits.append(torch.cat(lg))


def tree_advantages(advantages: torch.Tensor, trees: list[RolloutTree], width: int) -> torch.Tensor:
    """Per-token tree advantages: each segment gets its node's value minus its parent's (TreeRL, TreePO).

    A node's value is the mean of the advantages of the leaves below it (rows that copy an ended node count once per
    row, as TRL's group mean counts them); the root's is the group's mean. TRL's advantages are an affine function of
    the rewards within a group (`(r - mean) / (std + eps)`, or without the division), so these values are the
    node values of the rewards in TRL's scale. Along a leaf the segment advantages add up to its own advantage minus
    the group mean, i.e. to TRL's advantage when the group mean is 0.

    Args:
        advantages (`torch.Tensor` of shape `(B,)`): TRL's advantages of the rows, `B = len(trees) * G`.
        trees (`list[RolloutTree]`): the trees the rows came from, in row order.
        width (`int`): the padded completion width `C`.

    Returns:
        `torch.Tensor` of shape `(B, C)`, dtype and device of `advantages`: zero past each leaf's end.
    """
    out = torch.zeros(advantages.size(0), width, dtype=advantages.dtype, device=advantages.device)
    row = 0
    values = advantages.tolist()
    for tree in trees:
        group = values[row: row + len(tree.leaves)]
        sums: dict[int, list[float]] = {}
        for j, path in enumerate(tree.nodes):
            for node in path:
                sums.setdefault(node, []).append(group[j])
        node_value = {node: sum(v) / len(v) for node, v in sums.items()}
        root = sum(group) / len(group)
        for j, (leaf, path) in enumerate(zip(tree.leaves, tree.nodes)):
            parent = root
            for level, node in enumerate(path):
                start = tree.starts[level]
                end = len(leaf) if level == len(path) - 1 else tree.starts[level + 1]
                out[row + j, start:end] = node_value[node] - parent
                parent = node_value[node]
        row += len(tree.leaves)
    return out


class TreeRollouts:
    """Tree rollouts inside a `GRPOTrainer`: what `DTAGRPOTrainer._generate_single_turn` calls.

    Built at construction ([`TreeRollouts.from_trainer`], which refuses what tree rollouts cannot sample), then per
    generation [`generate`] samples the process's prompt groups as trees and logs, next to TRL's metrics:

    - `dta/generated_tokens`: completion tokens sampled (each tree node's segment once);
    - `dta/generated_tokens_independent`: completion tokens of the same leaves sampled independently (TRL's way);
    - `dta/generation_compression`: their ratio;
    - `dta/generation_forward_tokens`: token positions the model forwarded while generating (prefill included; rows
      of a level that already ended keep being forwarded until the level's call ends, as in `generate`).

    Args:
        branching (`list[int]`): `dta_tree_branching`.
        segment_length (`int`, *optional*): `dta_tree_segment_length`.
        advantage (`str`): `dta_tree_advantage`, `"group"` or `"tree"`.
    """

    def __init__(self, branching: list[int], segment_length: int | None, advantage: str):
        self.branching = list(branching)
        self.segment_length = segment_length
        self.advantage = advantage
        self.num_leaves = math.prod(self.branching)
        self.last_trees: list[RolloutTree] | None = None  # the trees of the latest generation, in row order

    @classmethod
    def from_trainer(cls, trainer) -> TreeRollouts | None:
        """The trainer's tree rollouts, or None when `dta_tree_branching` is None; refuses what they cannot sample."""
        args = trainer.args
        branching = getattr(args, "dta_tree_branching", None)
        if branching is None:
            return None
        off = "or set `dta_tree_branching=None` to sample completions independently as TRL does."
        if trainer._is_vlm:
            raise ValueError(f"Tree rollouts generate text only; a vision-language model's inputs need TRL's "
                             f"generation: {off}")
        if trainer.rollout_func is not None:
            raise ValueError(
                "`rollout_func` generates the completions itself, so `dta_tree_branching` would not apply. Branch "
                f"inside the rollout function (e.g. `trl_dta.envs.AgentRolloutFunc(branching=...)`), {off}"
            )
        if trainer.tools or trainer.environment_factories is not None:
            raise ValueError(
                "TRL's tool loop (`tools=` / `environment_factory=`) continues every row on its own after the first "
                "turn; tree rollouts of tool episodes are not implemented there. Branch multi-turn episodes with "
                f"`trl_dta.envs.AgentRolloutFunc(branching=...)` as `rollout_func`, {off}"
            )
        check_generation_config(trainer.generation_config)
        per_process = args.generation_batch_size // trainer.accelerator.num_processes
        if per_process % args.num_generations:
            raise ValueError(
                f"Tree rollouts sample a prompt's {args.num_generations} completions as one tree on one process, but "
                f"each of the {trainer.accelerator.num_processes} processes generates {per_process} rows "
                f"(`generation_batch_size={args.generation_batch_size}`), which splits prompt groups. Make "
                f"`generation_batch_size / num_processes` a multiple of `num_generations`, {off}"
            )
        return cls(branching, args.dta_tree_segment_length, args.dta_tree_advantage)

    def applies(self, num_generations: int) -> bool:
        """Whether a generation of `num_generations` rows per prompt is sampled as trees (evaluation with another
        `num_generations_eval` samples independently, as TRL does)."""
        return num_generations == self.num_leaves

    def generate(self, trainer, prompt_ids: list[list[int]], num_generations: int) -> tuple[list[list[int]], None]:
        """TRL's `_generate_single_turn` for tree rollouts: one completion per row, in TRL's row order.

        Args:
            trainer (`GRPOTrainer`): the trainer (its model, generation config, tokenizer, metrics).
            prompt_ids (`list[list[int]]`): the process's rows, each prompt repeated `num_generations` times in
                consecutive rows (TRL's `RepeatSampler`).
            num_generations (`int`): rows per prompt, equal to the product of `dta_tree_branching`.

        Returns:
            `(completion_ids, None)`: the rows' completions (EOS included when sampled) and no sampling log-probs
            (as TRL's transformers path).
        """
        from trl.extras.profiling import profiling_context
        from trl.models import unwrap_model_for_generation

        groups = _prompt_groups(prompt_ids, num_generations)
        with (
            profiling_context(trainer, "transformers.generate"),
            unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                generation_kwargs=trainer.generation_kwargs,
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
            ) as model,
            torch.no_grad(),
            trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False),
        ):
            trees, stats = sample_trees(
                model,
                groups,
                self.branching,
                self.segment_length,
                trainer.max_completion_length,
                trainer.generation_config,
                trainer.eos_token_ids,
                trainer._tokenizer.pad_token_id,
                pad_to_multiple_of=trainer.pad_to_multiple_of,
            )
        self.last_trees = trees
        mode = "train" if trainer.model.training else "eval"
        metrics = trainer._metrics[mode]
        generated = sum(t.generated_tokens for t in trees)
        independent = sum(t.independent_tokens for t in trees)
        metrics["dta/generated_tokens"].append(float(generated))
        metrics["dta/generated_tokens_independent"].append(float(independent))
        metrics["dta/generation_compression"].append(independent / max(generated, 1))
        metrics["dta/generation_forward_tokens"].append(float(sum(r * n for r, n in stats.forward_calls)))
        return [leaf for tree in trees for leaf in tree.leaves], None

    def score(self, output: dict) -> dict:
        """TRL's scored batch, with per-token tree advantages when `dta_tree_advantage="tree"` and the batch was
        sampled as trees; otherwise unchanged (TRL's group advantages)."""
        trees, self.last_trees = self.last_trees, None
        if self.advantage == "tree" and trees is not None:
            output["advantages"] = tree_advantages(output["advantages"], trees, output["completion_ids"].size(1))
        return output


def _prompt_groups(prompt_ids: list[list[int]], num_generations: int) -> list[list[int]]:
    """One prompt per group of `num_generations` consecutive identical rows; refuses rows that are not so grouped."""
    rows = [list(p) for p in prompt_ids]
    if len(rows) % num_generations:
        raise ValueError(
            f"Tree rollouts sample each prompt's {num_generations} completions as one tree, so every process must hold "
            f"whole prompt groups, but this process generates {len(rows)} rows. Make the per-process generation batch "
            f"(`generation_batch_size / num_processes`) a multiple of `num_generations`."
        )
    groups = rows[::num_generations]
    for g, prompt in enumerate(groups):
        if any(rows[g * num_generations + k] != prompt for k in range(num_generations)):
            raise ValueError(
                f"Tree rollouts expect each prompt in {num_generations} consecutive rows (TRL's `RepeatSampler`), but "
                f"rows {g * num_generations}..{(g + 1) * num_generations - 1} hold different prompts. A custom sampler "
                "must repeat each prompt `num_generations` times in a row."
            )
    return groups
