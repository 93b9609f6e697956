"""`DTARLOOTrainer`: TRL's `RLOOTrainer` with the policy loss computed over the prefix tree of each micro-batch."""

from __future__ import annotations

from dataclasses import dataclass

from trl import RLOOConfig, RLOOTrainer
from trl.trainer.utils import get_config_model_id

from ._mixin import DTAArguments, DTATrainerMixin, dta_parameters_doc
from .losses import RLOOSequenceLoss


@dataclass
class DTARLOOConfig(DTAArguments, RLOOConfig):
    def __post_init__(self):
        super().__post_init__()
        self.validate_dta()


DTARLOOConfig.__doc__ = (
    """
    Configuration class for [`DTARLOOTrainer`]: every [`~trl.RLOOConfig`] parameter, plus the `dta_*` parameters below.

    Defaults are TRL's. Note that `gradient_checkpointing=True` (TRL's default) bounds DTA's memory through
    `dta_max_graph_tokens` instead of HF checkpointing (see that parameter).

"""
    + dta_parameters_doc()
)


class DTARLOOTrainer(DTATrainerMixin, RLOOTrainer):
    """[`~trl.RLOOTrainer`] with Dynamic Tree Attention: every shared prefix of a micro-batch is computed once,
    forward and backward, with TRL's exact loss, gradients and metrics.

    Takes exactly the arguments of [`~trl.RLOOTrainer`]; `args` is a [`DTARLOOConfig`] (a plain `RLOOConfig` uses the
    DTA defaults). Overrides, and only these (see `trl_dta/trainers/_mixin.py`): `_prepare_inputs` (group-aware
    micro-batches), `_get_per_token_logps_and_entropies` (no-grad old-policy/reference log-probs over the tree) and
    `compute_loss` (the policy loss through `DTAEngine.forward_backward`). A subclass's own `_compute_loss` runs an
    exact two-pass path. Unsupported, with an error at construction: vision-language inputs, the MoE auxiliary loss,
    prompt-learning adapters, active dropout, fp16, DeepSpeed/FSDP, several processes, Liger kernels, LOMO optimizers.
    """

    _dta_trl_class = RLOOTrainer
    _dta_loss_class = RLOOSequenceLoss
    _tag_names = [*RLOOTrainer._tag_names, "trl-dta"]

    def __init__(self, model, reward_funcs, args: RLOOConfig | None = None, *extra, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = DTARLOOConfig(f"{name.split('/')[-1]}-RLOO")
        self._dta_pre_init(args)
        super().__init__(model, reward_funcs, args, *extra, **kwargs)
        self._dta_post_init()
