"""What a DTA trainer refuses at construction, in one message (`refusal.py`): the model's own blockers (the engine's
rules and probe, `modeling`) and those only a trainer knows: TRL's MoE router loss for a family DTA does not reproduce,
dropout rates before TRL calls `model.train()`, prompt-learning adapters, vision-language models whose images DTA
does not run (`vision.VISION_FAMILIES`).

Trainer-argument blockers (`arg_checks.check_trainer_args`: fp16, Liger, fused optimizers) are refused earlier, before
the TRL trainer loads the model, in one message of their own: they need no model, and TRL's construction would not get
far with some of them.
"""

from __future__ import annotations

from collections.abc import Callable

from accelerate.utils import is_peft_model

from .._checks import dropout_blockers
from ..modeling.families import TESTED_MODEL_TYPES
from ..modeling.routers import router_loss_blocker
from ..modeling.support import refusal_subject, refusal_tail
from ..refusal import TRAINER_ALTERNATIVE, TRAINER_CONFIG, Blocker, DTAUnsupportedError, refuse
from ..vision import image_blocker

_DISABLE_DROPOUT = Blocker("", settings={"disable_dropout": True}, where=TRAINER_CONFIG)
# The engine's arguments a trainer sets from its config: an engine error about one names the field the user set.
_ENGINE_FIELDS = {"attn_backend": "dta_attn_backend"}
_PROMPT_LEARNING = Blocker("its prompt-learning adapters (prompt/prefix/p-tuning) add virtual tokens in the PEFT "
                           "model's forward, which DTA does not run",
                           fix="use a LoRA-style adapter instead (e.g. `peft_config=LoraConfig(...)`)")


def check_policy(model, *, is_vlm: bool, aux_loss_enabled: bool, build_engine: Callable[[], object]) -> None:
    """Build the policy's engine, or refuse with every blocker of the model and of the trainer's use of it.

    Args:
        model (`transformers.PreTrainedModel` or `peft.PeftModel`): the unwrapped policy.
        is_vlm (`bool`): TRL's `_is_vlm` (a processor as processing class: the model's images must run through DTA).
        aux_loss_enabled (`bool`): TRL's `aux_loss_enabled` (the MoE router loss is on).
        build_engine (`Callable[[], DTAEngine]`): builds the policy's engine (whose construction checks the model).

    Raises:
        `DTAUnsupportedError`: one message listing every blocker with its fix, in the trainer's words (the dense
            alternative is `dta_enabled=False`; the tested families are listed only for an untested one).
        `ValueError`: an engine argument the trainer set is wrong here, named by its `dta_*` field.
    """
    lm = model.get_base_model() if is_peft_model(model) else model
    blockers: list[Blocker] = []
    image = image_blocker(lm) if is_vlm else None  # a vision-language family whose images DTA does not run
    blockers += [image] if image is not None else []
    try:
        build_engine()
    except DTAUnsupportedError as refusal:
        blockers += refusal.blockers
    except ValueError as error:  # "`attn_backend`: ..." -> "`dta_attn_backend`: ..."
        name, colon, reason = str(error).partition(": ")
        if not colon or name.strip("`") not in _ENGINE_FIELDS:
            raise
        raise ValueError(f"`{_ENGINE_FIELDS[name.strip('`')]}`: {reason}") from None
    if aux_loss_enabled:  # TRL's MoE load-balancing loss: exact over the tree for the families DTA knows
        router = router_loss_blocker(lm)
        blockers += [router] if router is not None else []
    if is_peft_model(model) and any(c.is_prompt_learning for c in model.peft_config.values()):
        blockers.append(_PROMPT_LEARNING)
    blockers += dropout_blockers(model, _DISABLE_DROPOUT, training_only=False)
    untested = lm.config.get_text_config().model_type not in TESTED_MODEL_TYPES
    refuse(refusal_subject(lm), blockers, refusal_tail() if untested else "", alternative=TRAINER_ALTERNATIVE)


def check_schedule(engine, strategy) -> None:
    """Refuse a per-layer schedule (`strategy.lockstep`: FSDP2's, ZeRO-3's) for a hybrid model's engine and for a
    vision-language model's, at construction rather than at the first engine call (`DTAEngine` refuses a lockstep
    call on recurrent layers, and one with images)."""
    if not strategy.lockstep:
        return
    blockers = []
    if engine.layout.hybrid:
        blockers.append(Blocker(
            "the per-layer schedule runs packed subtree rows in lockstep across the ranks, which the recurrent "
            "layers of this hybrid model cannot run exactly (a recurrence cannot follow a tree mask)",
            settings=strategy.window_settings, where=TRAINER_CONFIG))
    if engine.vision is not None:
        blockers.append(Blocker(
            "the per-layer schedule pairs the ranks' model calls, and the vision tower runs once per step on each "
            "rank's own images, which does not pair a sharded tower's collectives",
            settings=strategy.window_settings, where=TRAINER_CONFIG))
    lm = engine.model.get_base_model() if is_peft_model(engine.model) else engine.model
    refuse(f"{refusal_subject(lm)} under {strategy.layer_schedule}", blockers, alternative=TRAINER_ALTERNATIVE)
