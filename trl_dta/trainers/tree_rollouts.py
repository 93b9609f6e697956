"""Tree rollouts inside a `GRPOTrainer`: a prompt's `num_generations` completions sampled as one tree
(`tree_sampling.py`), trained once by DTA, credited by `dta_tree_advantage` (`tree_advantages.py`).

Rows. TRL's sampler repeats every prompt `num_generations` times in consecutive rows; `_generate_single_turn` must
return one completion per row in that order. A group's rows receive its leaves in depth-first order (rows within a
group are exchangeable for everything TRL computes). Rewards, the group advantages, the loss and the metrics are TRL's;
with an advantage mode other than `"group"` the scored batch's `advantages` are replaced after TRL's scoring, from TRL's
advantages and the rows TRL could score.
"""

from __future__ import annotations

import math

import torch

from .tree_advantages import tree_advantages
from .tree_sampling import RolloutTree, check_generation_config, effective_generation_config, sample_trees


class TreeRollouts:
    """Tree rollouts inside a `GRPOTrainer`: what `DTAGRPOTrainer._generate_single_turn` calls.

    Built at construction ([`TreeRollouts.from_trainer`], which refuses what tree rollouts cannot sample), then per
    generation [`generate`] samples the process's prompt groups as trees and logs, next to TRL's metrics:

    - `dta/generated_tokens`: completion tokens sampled (each tree node's segment once);
    - `dta/generated_tokens_independent`: completion tokens of the same leaves sampled independently (TRL's way);
    - `dta/generation_compression`: their ratio;
    - `dta/generation_forward_tokens`: token positions the model forwarded while generating (each distinct prompt
      once, each sampled token at most once);
    - `dta/generation_peak_kv_mb`: the most key/value memory the generation cache held (MiB; the prompts once, not
      once per completion);
    - `dta/tree_distinct_leaves`: distinct completions per prompt group (mean over groups; `num_generations` at most);
    - `dta/tree_early_end_fraction`: the fraction of rows whose completion ended before the last level, so that they
      copy a shorter node (several rows of one group then hold the same completion).

    With an advantage mode other than `"group"`, [`score`] replaces TRL's advantages after its scoring (TRL's reward
    computation is observed through [`observe_rewards`] for the rows it could not score).

    Args:
        branching (`list[int]`): `dta_tree_branching`.
        segment_length (`int`, *optional*): `dta_tree_segment_length`.
        advantage (`str`): `dta_tree_advantage` (`tree_advantages.ADVANTAGES`).
    """

    def __init__(self, branching: list[int], segment_length: int | None, advantage: str):
        self.branching = list(branching)
        self.segment_length = segment_length
        self.advantage = advantage
        self.num_leaves = math.prod(self.branching)
        # The latest generation's trees (in row order) and, once TRL has scored it, its scorable rows `(N,)` over all
        # processes: what `score` needs from `generate` and `_calculate_rewards`, which TRL calls in between.
        self.last_trees: list[RolloutTree] | None = None
        self.last_scorable: torch.Tensor | None = None

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
        check_generation_config(trainer.generation_config, trainer.accelerator.unwrap_model(trainer.model))
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
                effective_generation_config(model, trainer.generation_config),
                trainer.eos_token_ids,
                trainer._tokenizer.pad_token_id,
            )
        self.last_trees, self.last_scorable = trees, None
        metrics = trainer._metrics["train" if trainer.model.training else "eval"]
        generated = sum(t.generated_tokens for t in trees)
        independent = sum(t.independent_tokens for t in trees)
        metrics["dta/generated_tokens"].append(float(generated))
        metrics["dta/generated_tokens_independent"].append(float(independent))
        metrics["dta/generation_compression"].append(independent / max(generated, 1))
        metrics["dta/generation_forward_tokens"].append(float(stats.forward_tokens))
        metrics["dta/generation_peak_kv_mb"].append(stats.peak_kv_bytes / 2**20)
        metrics["dta/tree_distinct_leaves"].append(sum(len({tuple(leaf) for leaf in t.leaves}) for t in trees)
                                                    / max(len(trees), 1))
        early = sum(len(path) < len(self.branching) for t in trees for path in t.nodes)
        metrics["dta/tree_early_end_fraction"].append(early / max(len(trees) * self.num_leaves, 1))
        return [leaf for tree in trees for leaf in tree.leaves], None

    def observe_rewards(self, rewards_per_func: torch.Tensor) -> None:
        """Note which rows of the latest generation TRL can score: `rewards_per_func` `(N, n_funcs)` is what TRL's
        `_calculate_rewards` returns (all processes' rows), NaN where a reward function returned None; a row is
        unscorable when all of its rewards are NaN (TRL zeroes its advantage)."""
        if self.last_trees is not None:
            self.last_scorable = ~torch.isnan(rewards_per_func).all(dim=1)

    def score(self, trainer, output: dict) -> dict:
        """TRL's scored batch, with the advantages of `dta_tree_advantage` when the batch was sampled as trees
        (`tree_advantages.py`: `(B, T)` for the per-token modes, `(B,)` otherwise); unchanged with `"group"` (TRL's
        own advantages) or for a generation sampled independently."""
        trees, scorable = self.last_trees, self.last_scorable
        self.last_trees = self.last_scorable = None
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
