"""Argument checks shared by every public entry point: one rule per kind of value, one wording per error.

Every public function of the package (`PrefixTree`, `DTAEngine`, `partition`, the trainers' `dta_*` options,
`trl-dta analyze`) validates its arguments with these helpers, so that the same knob obeys the same rule everywhere
(`True` is never an integer, `1.0` is never a token count, `nan` is never a budget) and every error names the argument
and the fix. Nothing here converts silently: a value is either accepted as it is or refused.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from dataclasses import replace

from .refusal import MODEL_CONFIG, Blocker, refuse

logger = logging.getLogger("trl_dta")

_warned: set[str] = set()


def is_main_process() -> bool:
    """Whether this process is the run's main one: global rank 0 of the initialised process group, else `RANK`
    (which `accelerate launch` and `torchrun` set before the group exists), else a single process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0").strip() in ("", "0")


def warn_once(key: str, msg: str, *, every_rank: bool = False) -> None:
    """Log `msg` as a warning the first time `key` is seen in this process, on the main process only (every process
    of a run holds the same configuration, so one copy says it all), or on every rank with `every_rank=True` (for
    what only one rank may see, e.g. an episode that failed there)."""
    if key not in _warned:
        _warned.add(key)
        if every_rank or is_main_process():
            logger.warning(msg)


def is_int(value) -> bool:
    """A true integer: Python/numpy integers and 0-d integer tensors; never `bool`, never a float such as `2.0`."""
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Integral):
        return True
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point() and \
        not value.is_complex() and value.dtype != torch.bool


def check_int(name: str, value, *, minimum: int | None = None, allow_none: bool = False, hint: str = "") -> int | None:
    """`value` as a Python `int`, or a `TypeError`/`ValueError` naming `name`.

    Args:
        name (`str`): the argument's name as the user spells it (e.g. ``"dta_block_size"``).
        value: the value to check.
        minimum (`int`, *optional*): smallest allowed value.
        allow_none (`bool`, *optional*, defaults to `False`): whether `None` is allowed (returned as is).
        hint (`str`, *optional*): what the value means, appended to the message.
    """
    if value is None and allow_none:
        return None
    kind = "None or an integer" if allow_none else "an integer"
    if minimum == 1:
        kind = ("None or a positive integer" if allow_none else "a positive integer")
    elif minimum == 0:
        kind = ("None or a non-negative integer" if allow_none else "a non-negative integer")
    elif minimum is not None:
        kind = f"{kind} >= {minimum}"
    suffix = f" ({hint})" if hint else ""
    if not is_int(value):
        raise TypeError(f"`{name}` must be {kind}{suffix}, got {value!r} of type {type(value).__name__}.")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}` must be {kind}{suffix}, got {value}.")
    return value


def check_float(name: str, value, *, minimum: float | None = None, exclusive: bool = False, hint: str = "") -> float:
    """`value` as a finite Python `float` (ints accepted, `bool` and non-finite numbers refused)."""
    suffix = f" ({hint})" if hint else ""
    bound = ""
    if minimum is not None:
        bound = f" {'>' if exclusive else '>='} {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be a finite number{bound}{suffix}, got {value!r} of type {type(value).__name__}.")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number{bound}{suffix}, got {value}.")
    if minimum is not None and (value <= minimum if exclusive else value < minimum):
        raise ValueError(f"`{name}` must be a finite number{bound}{suffix}, got {value}.")
    return value


def check_bool(name: str, value) -> bool:
    """`value` if it is a `bool` (numpy bools included), else a `TypeError` naming `name`."""
    if isinstance(value, bool):
        return value
    try:
        import numpy as np

        if isinstance(value, np.bool_):
            return bool(value)
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"`{name}` must be True or False, got {value!r} of type {type(value).__name__}.")


def check_choice(name: str, value, choices) -> str:
    """`value` if it is one of `choices` (strings), else a `ValueError` listing them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"`{name}` must be one of {sorted(choices)}, got {value!r}.")
    return value


_LORA_DROPOUT_FIX = "set `lora_dropout=0.0` in the adapter's `LoraConfig`"


def dropout_blockers(model, module_fix: Blocker, *, training_only: bool = True) -> list[Blocker]:
    """What keeps dropout active in `model`: DTA cannot reproduce the dense path's random masks.

    Args:
        model (`torch.nn.Module`): the model (a PEFT model included).
        module_fix (`Blocker`): how the caller's user turns off the dropout modules (its `settings` or `fix`; its
            feature is replaced by the finding).
        training_only (`bool`, *optional*, defaults to `True`): only modules in training mode count (the engine, at
            call time); `False` checks the configured rates whatever the mode (a trainer, at construction, before
            it calls `model.train()`).

    Returns:
        `list[Blocker]`: the first active dropout module (with `module_fix`'s fix; a LoRA adapter's also names
        `lora_dropout=0.0`), and attention dropout set in the config (fix: `attention_dropout=0.0` in the model config,
        which TRL's `disable_dropout` does not reach).
    """
    import torch

    blockers = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0 and (module.training or not training_only):
            blocker = replace(module_fix, feature=f"dropout is active ({name}: p={module.p}) and DTA cannot reproduce "
                                                  "the dense path's random dropout masks")
            if ".lora_dropout." in f".{name}.":  # a PEFT LoRA adapter's: its config sets it too
                blocker = replace(blocker, fix=", or ".join(filter(None, (module_fix.fix, _LORA_DROPOUT_FIX))))
            blockers.append(blocker)
            break
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    rate = getattr(config, "attention_dropout", 0.0) or 0.0
    if rate and (model.training or not training_only):
        blockers.append(Blocker(f"attention dropout is active (attention_dropout={rate}) and DTA cannot reproduce its "
                                "random masks (a rate in the model config: TRL's `disable_dropout` does not reach it)",
                                settings={"attention_dropout": 0.0}, where=MODEL_CONFIG))
    return blockers


def check_no_dropout(model, subject: str, module_fix: Blocker, *, training_only: bool = True) -> None:
    """Refuse a model whose dropout would be active ([`dropout_blockers`]), one message for all of it."""
    refuse(subject, dropout_blockers(model, module_fix, training_only=training_only))


def check_loss_value(loss, i: int, device):
    """`loss_fn`'s value for sequence `i` as a 0-d tensor, or an error: it must be a one-element tensor on `device`
    (where the log-probs it received are)."""
    import torch

    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"`loss_fn` must return a scalar tensor, got {shape} for sequence {i}.")
    if loss.device != device:
        raise ValueError(f"`loss_fn` returned a tensor on {loss.device} for sequence {i}; the log-probs it receives "
                         f"are on {device}: compute the loss on that device.")
    return loss.reshape(())
