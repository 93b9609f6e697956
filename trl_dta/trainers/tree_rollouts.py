"""Tree rollouts inside a `GRPOTrainer`: the TRL side of `dta_tree_branching`. A prompt's `num_generations`
completions are sampled as one tree by the generation package (`trl_dta/generation/tree_sampling.py`), trained once by
DTA, credited by `dta_tree_advantage` (`tree_advantages.py`). This module reads TRL's state (at construction: the
settings tree rollouts cannot run with, the sampling settings, EOS and pad ids; per generation: the trainer's policy as
a generator, `policy.py`; the rank when scoring), calls the sampler and hands its metrics to the trainer.

Rows. TRL's sampler repeats every prompt `num_generations` times in consecutive rows; `_generate_single_turn` must
return one completion per row in that order. A group's rows receive its leaves in depth-first order (rows within a
group are exchangeable for everything TRL computes). Rewards, the group advantages, the loss and the metrics are TRL's;
with an advantage mode other than `"group"` the scored batch's `advantages` are replaced after TRL's scoring, from TRL's
advantages and the rows TRL could score.

Hooks. TRL's `_generate_and_score_completions` calls `_generate_single_turn` (the trees) and then
`_calculate_rewards` (the scorable rows) before it returns the scored batch. The trainer opens one [`TreeGeneration`]
around that call (its hook state's `generation`, `state.HookState`), the two inner hooks fill it, and the trainer
hands it to [`TreeRollouts.score`] explicitly: nothing of one generation outlives the call. TRL's private state is read
through `_trl.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..generation.tree_sampling import TREE_OFF, RolloutTree, TreeSampler, check_generation_config
from . import _trl
from .generator import check_vllm_rollouts, policy_generator, vllm_generation_config
from .tree_advantages import tree_advantages

# vLLM `SamplingParams` arguments (TRL's `generation_kwargs` with `use_vllm=True`) that act on one position's logits or
# on the whole sequence (prompt and earlier segments included), so that a tree of segment-wise requests samples what
# one request would; every other one is refused (`stop` strings, a fixed `seed`, penalties that count output tokens
# only, structured outputs, ... depend on where a request starts).
VLLM_TREE_SAMPLING = frozenset({"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "min_tokens",
                                "logit_bias", "allowed_token_ids"})


@dataclass
class TreeGeneration:
    """One call of TRL's `_generate_and_score_completions`, as the tree advantages need it.

    Args:
        trees (`list[RolloutTree]`, *optional*): this process's trees in row order, once sampled (None while TRL has
            not generated, or when it generated independently, e.g. evaluation with another `num_generations_eval`).
        scorable (`torch.Tensor` of shape `(N,)`, *optional*): bool over all processes' rows, once TRL has scored
            them: whether some reward function returned a value for the row.
    """

    trees: list[RolloutTree] | None = None
    scorable: torch.Tensor | None = None


class TreeRollouts:
    """Tree rollouts inside a `GRPOTrainer`: what `DTAGRPOTrainer._generate_single_turn` calls.

    Built at construction ([`TreeRollouts.from_trainer`], which refuses what tree rollouts cannot sample, and reads
    TRL's sampling settings once into a [`~trl_dta.generation.tree_sampling.TreeSampler`]), then per generation
    [`generate`] samples the process's prompt groups as trees and logs the sampler's metrics
    ([`~trl_dta.generation.tree_sampling.TreeSampler.metrics`]: generated tokens, tree vs independent, the
    compression, forwarded tokens, peak key/value memory, distinct leaves, early ends) next to TRL's.

    With an advantage mode other than `"group"`, [`score`] replaces TRL's advantages after its scoring (TRL's reward
    computation is observed through [`observe_rewards`] for the rows it could not score).

    Args:
        sampler (`TreeSampler`): the sampling settings (`dta_tree_branching`, `dta_tree_segment_length`,
            `max_completion_length`, TRL's generation config, EOS and pad ids).
        advantage (`str`): `dta_tree_advantage` (`tree_advantages.ADVANTAGES`).
    """

    def __init__(self, sampler: TreeSampler, advantage: str):
        self.sampler = sampler
        self.advantage = advantage

    @classmethod
    def from_trainer(cls, trainer) -> TreeRollouts | None:
        """The trainer's tree rollouts, or None when `dta_tree_branching` is None; refuses what they cannot sample."""
        args = trainer.args
        branching = getattr(args, "dta_tree_branching", None)
        if branching is None:
            return None
        if _trl.is_vlm(trainer):
            raise ValueError(f"Tree rollouts generate text only; a vision-language model's inputs need TRL's "
                             f"generation: {TREE_OFF}")
        if trainer.rollout_func is not None:
            raise ValueError(
                "`rollout_func` generates the completions itself, so `dta_tree_branching` would not apply. Branch "
                f"inside the rollout function (e.g. `trl_dta.envs.AgentRolloutFunc(branching=...)`), {TREE_OFF}"
            )
        if trainer.tools or trainer.environment_factories is not None:
            raise ValueError(
                "TRL's tool loop (`tools=` / `environment_factory=`) continues every row on its own after the first "
                "turn; tree rollouts of tool episodes are not implemented there. Branch multi-turn episodes with "
                f"`trl_dta.envs.AgentRolloutFunc(branching=...)` as `rollout_func`, {TREE_OFF}"
            )
        if trainer.use_vllm:
            check_vllm_rollouts(trainer, "Tree rollouts")
            refused = sorted(set(trainer.vllm_generation.generation_kwargs or {}) - VLLM_TREE_SAMPLING)
            if args.vllm_structured_outputs_regex is not None:
                refused.append("vllm_structured_outputs_regex")
            if refused:
                raise ValueError(
                    f"Tree rollouts through vLLM sample each level from where the previous one stopped, so {refused} "
                    f"(which depend on where a request starts) cannot be used: keep `generation_kwargs` to "
                    f"{sorted(VLLM_TREE_SAMPLING)}, {TREE_OFF}"
                )
            generation_config = vllm_generation_config(trainer)[0]
        else:
            generation_config = trainer.generation_config
            check_generation_config(generation_config, trainer.accelerator.unwrap_model(trainer.model))
        per_process = args.generation_batch_size // trainer.accelerator.num_processes
        if per_process % args.num_generations:
            raise ValueError(
                f"Tree rollouts sample a prompt's {args.num_generations} completions as one tree on one process, but "
                f"each of the {trainer.accelerator.num_processes} processes generates {per_process} rows "
                f"(`generation_batch_size={args.generation_batch_size}`), which splits prompt groups. Make "
                f"`generation_batch_size / num_processes` a multiple of `num_generations`, {TREE_OFF}"
            )
        sampler = TreeSampler(tuple(branching), args.dta_tree_segment_length, trainer.max_completion_length,
                              generation_config, tuple(trainer.eos_token_ids),
                              _trl.tokenizer(trainer).pad_token_id)
        return cls(sampler, args.dta_tree_advantage)

    def applies(self, num_generations: int) -> bool:
        """Whether a generation of `num_generations` rows per prompt is sampled as trees (evaluation with another
        `num_generations_eval` samples independently, as TRL does)."""
        return num_generations == self.sampler.num_leaves

    def generate(self, trainer, prompt_ids: list[list[int]],
                 num_generations: int) -> tuple[list[list[int]], list[list[float]] | None]:
        """TRL's `_generate_single_turn` for tree rollouts: one completion per row, in TRL's row order.

        Args:
            trainer (`DTAGRPOTrainer`): the trainer (its policy as a generator, `generator.policy_generator`; its
                metrics; the generation open in its hook state, which receives the trees).
            prompt_ids (`list[list[int]]`): the process's rows, each prompt repeated `num_generations` times in
                consecutive rows (TRL's `RepeatSampler`).
            num_generations (`int`): rows per prompt, equal to the product of `dta_tree_branching`.

        Returns:
            `(completion_ids, logprobs)`: the rows' completions (EOS included when sampled) and their sampling
            log-probs when the generator gives them (vLLM's, as TRL's vLLM path; `None` with transformers' generate,
            as TRL's transformers path).
        """
        groups = _prompt_groups(prompt_ids, num_generations)
        with policy_generator(trainer) as generator:
            trees, stats = self.sampler.sample(generator, groups)
        if trainer._dta_state.generation is not None:
            trainer._dta_state.generation.trees = trees
        metrics = _trl.metrics(trainer)
        for name, value in self.sampler.metrics(trees, stats).items():
            metrics[name].append(value)
        logprobs = None if any(tree.logprobs is None for tree in trees) else [lp for t in trees for lp in t.logprobs]
        return [leaf for tree in trees for leaf in tree.leaves], logprobs

    def observe_rewards(self, rewards_per_func: torch.Tensor, generation: TreeGeneration | None) -> None:
        """Note which rows of the open `generation` TRL can score: `rewards_per_func` `(N, n_funcs)` is what TRL's
        `_calculate_rewards` returns (all processes' rows), NaN where a reward function returned None; a row is
        unscorable when all of its rewards are NaN (TRL zeroes its advantage)."""
        if generation is not None and generation.trees is not None:
            generation.scorable = ~torch.isnan(rewards_per_func).all(dim=1)

    def score(self, trainer, output: dict, generation: TreeGeneration) -> dict:
        """TRL's scored batch, with the advantages of `dta_tree_advantage` when the batch was sampled as trees
        (`tree_advantages.py`: `(B, T)` for the per-token modes, `(B,)` otherwise); unchanged with `"group"` (TRL's
        own advantages) or for a generation sampled independently (`generation.trees` None)."""
        trees, scorable = generation.trees, generation.scorable
        if self.advantage == "group" or trees is None:
            return output
        rows = output["advantages"].size(0)
        if scorable is not None:  # this process's rows of TRL's global batch, as TRL slices its advantages
            start = trainer.accelerator.process_index * rows
            scorable = scorable[start:start + rows]
        output["advantages"] = tree_advantages(output["advantages"], trees, output["completion_ids"].size(1),
                                               self.advantage, scorable)
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
