"""`DTAGRPOTrainer`: TRL's `GRPOTrainer` with the policy loss computed over one prefix forest per optimizer step."""

from __future__ import annotations

from trl import GRPOTrainer

from . import _trl
from ._mixin import DTATrainerMixin
from .config import DTAGRPOConfig
from .losses import GRPOSequenceLoss
from .phases import StepPhases
from .tree_rollouts import TreeGeneration, TreeRollouts


class DTAGRPOTrainer(DTATrainerMixin, StepPhases, GRPOTrainer):
    """[`~trl.GRPOTrainer`] with Dynamic Tree Attention: every prefix shared within an optimizer step (the prompt of a
    group, shared turns, a common system prompt) is computed once, forward and backward, with TRL's exact loss,
    gradients and metrics.

    Takes exactly the arguments of [`~trl.GRPOTrainer`]; `args` is a [`DTAGRPOConfig`] (a plain `GRPOConfig` uses the
    DTA defaults). Overrides, and only these (see `trl_dta/trainers/_mixin.py`): `_prepare_inputs` (only for the
    opt-in regroupings), `_get_per_token_logps_and_entropies` (no-grad old-policy/reference log-probs over the tree),
    `compute_loss` (the policy loss of an optimizer step's micro-batches through one `DTAEngine.forward_backward`)
    and `training_step` (the accumulation window; one gradient reduction per window with several processes); with
    `dta_tree_branching` also `_generate_single_turn` (each prompt's completions sampled as a tree, shared segments
    generated once: `tree_rollouts.py`), `_calculate_rewards` (to note the rows TRL could score) and
    `_generate_and_score_completions` (the trees and scorable rows of TRL's call handed to the scoring, which for a
    `dta_tree_advantage` other than `"group"` replaces TRL's advantages: `tree_advantages.py`). `_generate` and
    `_generate_and_score_completions` are timed too, for the step's split into generation, scoring and training
    (`phases.py`).

    Every `loss_type` (grpo, bnpo, dr_grpo, dapo, luspo, cispo, sapo, vespo), token- and sequence-level importance
    sampling, `beta > 0` (reference model or adapter-disabled PEFT reference), `num_iterations`,
    `steps_per_generation`, `generation_batch_size`, `gradient_accumulation_steps`, `tool_mask`, the vLLM
    importance-sampling correction, the off-policy mask, the entropy bonus and data parallelism over several processes
    run in one pass over the forest. `top_entropy_quantile < 1` (an entropy threshold over each micro-batch) and a
    subclass's own `_compute_loss` run an exact two-pass path (one extra no-grad forward over the forest).
    MoE models run with TRL's router auxiliary (load-balancing) loss, exactly (`trl_dta/engine/router_loss.py`: one
    extra no-grad forward over the forest). Unsupported, with an error at construction: vision-language inputs, the
    MoE auxiliary loss of families other than `ROUTER_LOSS_FAMILIES`, prompt-learning adapters, active dropout, fp16,
    FSDP1, ZeRO offload and the other distributed settings `trl_dta.parallel` refuses (DDP, FSDP2 and DeepSpeed
    ZeRO-0/1/2/3 run), Liger kernels, LOMO optimizers.

    Example:

    ```python
    >>> from trl_dta import DTAGRPOConfig, DTAGRPOTrainer

    >>> trainer = DTAGRPOTrainer(
    ...     model="path/to/model",
    ...     reward_funcs=my_reward,
    ...     args=DTAGRPOConfig(output_dir="out", num_generations=8),
    ...     train_dataset=dataset,
    ... )
    >>> trainer.train()
    ```
    """

    _dta_trl_class = GRPOTrainer
    _dta_config_class = DTAGRPOConfig
    _dta_loss_class = GRPOSequenceLoss
    _dta_aux_per_micro_step = True  # `loss + router_aux_loss_coef * aux_loss / current_gradient_accumulation_steps`
    _tag_names = _trl.tag_names(GRPOTrainer, "trl-dta")
    _dta_trees: TreeRollouts | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._dta_trees = TreeRollouts.from_trainer(self)  # None unless `dta_tree_branching` is set

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's generation, or with `dta_tree_branching` each prompt's completions sampled as a tree
        (`tree_rollouts.py`)."""
        if self._dta_trees is None or not self._dta_trees.applies(num_generations):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images=has_tool_images)
        return self._dta_trees.generate(self, prompt_ids, num_generations)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's; tree rollouts note which rows it could score (their advantage modes leave those rows out)."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._dta_trees is not None:
            self._dta_trees.observe_rewards(rewards_per_func, self._dta_state.generation)
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        """TRL's, with the advantages of `dta_tree_advantage` (other than `"group"`) after TRL's scoring."""
        if self._dta_trees is None:
            return super()._generate_and_score_completions(inputs)
        # open for the call only: filled by `_generate_single_turn` and `_calculate_rewards`, then scored
        generation = self._dta_state.generation = TreeGeneration()
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._dta_state.generation = None
        return self._dta_trees.score(self, output, generation)

    def _dta_sequence_loss(self, inputs: dict, scale: float):
        if self.top_entropy_quantile < 1.0:
            return None  # the entropy threshold is a quantile over the whole micro-batch
        return super()._dta_sequence_loss(inputs, scale)
