"""`DTAGRPOTrainer`: TRL's `GRPOTrainer` with the policy loss computed over the prefix tree of each micro-batch."""

from __future__ import annotations

from dataclasses import dataclass

from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import get_config_model_id

from ._mixin import DTAArguments, DTATrainerMixin, dta_parameters_doc
from .losses import GRPOSequenceLoss


@dataclass
class DTAGRPOConfig(DTAArguments, GRPOConfig):
    def __post_init__(self):
        super().__post_init__()
        self.validate_dta()


DTAGRPOConfig.__doc__ = (
    """
    Configuration class for [`DTAGRPOTrainer`]: every [`~trl.GRPOConfig`] parameter, plus the `dta_*` parameters below.

    Defaults are TRL's. Note that `gradient_checkpointing=True` (TRL's default) bounds DTA's memory through
    `dta_max_graph_tokens` instead of HF checkpointing (see that parameter).

"""
    + dta_parameters_doc()
)


class DTAGRPOTrainer(DTATrainerMixin, GRPOTrainer):
    """[`~trl.GRPOTrainer`] with Dynamic Tree Attention: every shared prefix of a micro-batch (the prompt of a group,
    shared turns) is computed once, forward and backward, with TRL's exact loss, gradients and metrics.

    Takes exactly the arguments of [`~trl.GRPOTrainer`]; `args` is a [`DTAGRPOConfig`] (a plain `GRPOConfig` uses the
    DTA defaults). Overrides, and only these (see `trl_dta/trainers/_mixin.py`): `_prepare_inputs` (group-aware
    micro-batches), `_get_per_token_logps_and_entropies` (no-grad old-policy/reference log-probs over the tree) and
    `compute_loss` (the policy loss through `DTAEngine.forward_backward`).

    Every `loss_type` (grpo, bnpo, dr_grpo, dapo, luspo, cispo, sapo, vespo), token- and sequence-level importance
    sampling, `beta > 0` (reference model or adapter-disabled PEFT reference), `num_iterations`,
    `steps_per_generation`, `tool_mask`, the vLLM importance-sampling correction, the off-policy mask and the entropy
    bonus run in one pass over the tree. `top_entropy_quantile < 1` (an entropy threshold over the whole micro-batch)
    and a subclass's own `_compute_loss` run an exact two-pass path (one extra no-grad forward over the tree).
    Unsupported, with an error at construction: vision-language inputs, the MoE auxiliary loss, prompt-learning
    adapters, active dropout, fp16, DeepSpeed/FSDP, several processes, Liger kernels, LOMO optimizers.

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
    _dta_loss_class = GRPOSequenceLoss
    _tag_names = [*GRPOTrainer._tag_names, "trl-dta"]

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *extra, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = DTAGRPOConfig(f"{name.split('/')[-1]}-GRPO")
        self._dta_pre_init(args)
        super().__init__(model, reward_funcs, args, *extra, **kwargs)
        self._dta_post_init()

    def _dta_sequence_loss(self, inputs: dict, scale: float):
        if self.top_entropy_quantile < 1.0:
            return None  # the entropy threshold is a quantile over the whole micro-batch
        return super()._dta_sequence_loss(inputs, scale)
