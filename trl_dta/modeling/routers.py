"""How DTA reads a MoE model's routers: which families' load-balancing loss it reproduces (`families.py`,
`Family.experts`), the router module class and the index of its logits, and the forward hooks that record them.

Router logits are captured with forward hooks on the module class that the model itself records them from
(`_can_record_outputs["router_logits"]`, transformers' `OutputRecorder`), since the engine calls the decoder itself.
The loss over the tree that consumes them is in `engine/router_loss.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..refusal import TRAINER_CONFIG, Blocker, refuse
from .families import family_of, model_types


@dataclass(frozen=True)
class RouterSpec:
    """How to read a model's routers.

    Args:
        router_class (`type`): the module class whose output holds the router logits.
        index (`int`): the position of the logits `(n_tokens, n_experts)` in that module's output tuple.
        n_experts (`int`), top_k (`int`): `E` and the `k` of the loss.
    """

    router_class: type
    index: int
    n_experts: int
    top_k: int


def _recorder(lm):
    """transformers' recorder of the router logits (`_can_record_outputs["router_logits"]`) of a known family, or
    None."""
    recorder = (getattr(type(lm), "_can_record_outputs", None) or {}).get("router_logits")
    known = family_of(lm.config.get_text_config()).experts is not None
    return recorder if known and hasattr(recorder, "target_class") else None


def router_loss_blocker(lm) -> Blocker | None:
    """Why DTA cannot reproduce the load-balancing loss of `lm` (a blocker whose fix is TRL's
    `router_aux_loss_coef=0.0`), or None."""
    if _recorder(lm) is not None:
        return None
    return Blocker("its MoE load-balancing loss, which TRL adds to the loss by default, is not one DTA reproduces "
                   f"(transformers' `load_balancing_loss_func` of the families {model_types('experts')})",
                   settings={"router_aux_loss_coef": 0.0}, where=TRAINER_CONFIG)


def router_spec(lm) -> RouterSpec:
    """The [`RouterSpec`] of a causal LM whose load-balancing loss DTA reproduces, or a refusal naming the fix.

    Args:
        lm (`transformers.PreTrainedModel`): the causal LM (a PEFT model's base model).
    """
    blocker = router_loss_blocker(lm)
    if blocker is not None:
        refuse(f"{type(lm).__name__} (model type '{lm.config.get_text_config().model_type}') with its router loss",
               [blocker])
    config = lm.config.get_text_config()
    recorder = _recorder(lm)
    n_experts = int(getattr(config, family_of(config).experts))
    return RouterSpec(recorder.target_class, recorder.index, n_experts, int(config.num_experts_per_tok))


class RouterCapture:
    """Records the router logits of every forward while active (a context manager).

    Each forward of the decoder appends one `(batch * length, n_experts)` tensor per MoE layer, rows in
    `(row, position)` order (the routers flatten their input); [`RouterCapture.take`] hands them over and clears.
    """

    def __init__(self, lm, spec: RouterSpec):
        self.spec = spec
        self.routers = [m for m in lm.modules() if isinstance(m, spec.router_class)]
        self.logits: list[torch.Tensor] = []
        self._handles: list = []

    def _hook(self, module, args, output):
        self.logits.append(output[self.spec.index] if isinstance(output, (tuple, list)) else output)

    def __enter__(self) -> RouterCapture:
        self._handles = [m.register_forward_hook(self._hook) for m in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.logits = []

    def take(self) -> list[torch.Tensor]:
        logits, self.logits = self.logits, []
        return logits
