"""`DTARLOOTrainer`: TRL's `RLOOTrainer` with the policy loss computed over one prefix forest per optimizer step."""

from __future__ import annotations

from trl import RLOOTrainer

from . import _trl
from ._mixin import DTATrainerMixin
from .config import DTARLOOConfig
from .losses import RLOOSequenceLoss
from .phases import StepPhases


class DTARLOOTrainer(DTATrainerMixin, StepPhases, RLOOTrainer):
    """[`~trl.RLOOTrainer`] with Dynamic Tree Attention: every prefix shared within an optimizer step is computed
    once, forward and backward, with TRL's exact loss, gradients and metrics.

    Takes exactly the arguments of [`~trl.RLOOTrainer`]; `args` is a [`DTARLOOConfig`] (a plain `RLOOConfig` uses the
    DTA defaults). Overrides the same hooks as [`DTAGRPOTrainer`] (see `trl_dta/trainers/_mixin.py`). Every RLOO
    setting (`num_iterations`, `steps_per_generation`, `beta > 0`, PEFT, several processes) runs in one pass over the
    forest; a subclass's own `_compute_loss` runs an exact two-pass path; MoE models run with TRL's router auxiliary
    loss, exactly. Unsupported, with an error at construction: vision-language inputs, the MoE auxiliary loss of
    families other than `ROUTER_LOSS_FAMILIES`, prompt-learning adapters, active dropout, fp16, FSDP1, ZeRO offload and
    the other distributed settings `trl_dta.parallel` refuses (DDP, FSDP2 and DeepSpeed ZeRO-0/1/2/3 run), Liger
    kernels, LOMO optimizers.
    """

    _dta_trl_class = RLOOTrainer
    _dta_config_class = DTARLOOConfig
    _dta_loss_class = RLOOSequenceLoss
    _tag_names = _trl.tag_names(RLOOTrainer, "trl-dta")
