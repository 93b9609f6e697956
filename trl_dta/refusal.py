"""One refusal for everything DTA cannot run (a model, a training setup, a distributed setting, an engine call): each
blocker named with its fix, in one message.

A model can have several features DTA does not reproduce at once (a MoE router with jitter noise, dropout, a router
loss of an unknown family, ...). Refusing them one at a time makes a user fix, retry and meet the next; so every check
(`modeling`: the rule tables and the probe; `trainers/model_checks.py`: what only a trainer knows) returns
[`Blocker`]s, and one [`DTAUnsupportedError`] lists them all:

```
MixtralForCausalLM (model type 'mixtral') cannot run through DTA:
  1. its MoE router adds random jitter noise in training (`router_jitter_noise=0.1`), ... Fix: set
     `router_jitter_noise=0.0` in the model config (...).
  2. dropout is active (...) ... Fix: set `disable_dropout=True` in the trainer's config.
Train it without DTA: set `dta_enabled=False` ...
```

A fix is either settings (applied as they are written, `name=value` in backticks, in the model config or in the
trainer's config) or a change in words; a blocker without either has no fix inside DTA and keeps the dense path. A named
fix is enough: applying every fix of a message gives a model that runs, or a message that names what is left
(`tests/test_refusal.py` applies them, parsed from the message).

Every "DTA cannot do this, here is the fix" of the package is a [`DTAUnsupportedError`]; an argument that is simply
wrong stays a `ValueError` / `TypeError`, and a broken invariant (a bug, "please report") a `RuntimeError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# A refusal's closing offer: the dense path, as an engine user (the default) or a DTA trainer's user reads it.
DENSE_ALTERNATIVE = "Train it without DTA: set `dta_enabled=False` in the DTA trainer's config (TRL's dense path)"
ENGINE_ALTERNATIVE = (f"{DENSE_ALTERNATIVE}, or, without the trainers, call the model's own forward instead of "
                      "`DTAEngine`.")
TRAINER_ALTERNATIVE = f"{DENSE_ALTERNATIVE}."

# The subject of the refusals of a distributed setting (`parallel/`, `trainers/exchange.py`).
DISTRIBUTED = "This distributed setup"

# Where a blocker's settings go, as the message names it.
MODEL_CONFIG = "model config"
TRAINER_CONFIG = "trainer's config"
_WHERE_HINT = {  # how to set them there, from the settings
    MODEL_CONFIG: lambda settings: (
        f" (`from_pretrained(..., {', '.join(f'{k}={v!r}' for k, v in settings.items())})`; a DTA trainer given the "
        f"model by name: `model_init_kwargs={dict(settings)!r}`)"),
    TRAINER_CONFIG: lambda settings: "",
}


@dataclass(frozen=True)
class Blocker:
    """One feature of a model (or of its training setup) that DTA cannot run, and what removes it.

    Args:
        feature (`str`): what the model does and why DTA cannot reproduce it, as a clause
            (`"its MoE router adds random jitter noise in training (...)"`).
        settings (`Mapping[str, object]`, *optional*): settings that remove the blocker, applied as written (empty when
            no setting does).
        where (`str`, *optional*): where `settings` go: `MODEL_CONFIG` or `TRAINER_CONFIG`.
        fix (`str`, *optional*): a fix that is not a setting (e.g. "use a LoRA-style adapter"), or beside `settings`
            another way (e.g. "set `lora_dropout=0.0` in the `LoraConfig`"); empty: none.
    """

    feature: str
    settings: Mapping[str, object] = field(default_factory=dict)
    where: str = ""
    fix: str = ""

    def __post_init__(self):
        if self.settings and self.where not in _WHERE_HINT:
            raise ValueError(f"a blocker's settings go in one of {sorted(_WHERE_HINT)}, got {self.where!r}")

    @property
    def fixable(self) -> bool:
        """Whether DTA can run the model once the fix is applied (else only the dense path helps)."""
        return bool(self.settings or self.fix)

    def describe(self) -> str:
        """`"<feature>. Fix: set `a=0.0` in the model config (...)."`, or the fix in words, or that none exists."""
        if self.settings:
            names = ", ".join(f"`{name}={value!r}`" for name, value in self.settings.items())
            other = f", or {self.fix}" if self.fix else ""
            fix = f"Fix: set {names} in the {self.where}{_WHERE_HINT[self.where](self.settings)}{other}."
        elif self.fix:
            fix = f"Fix: {self.fix}."
        else:
            fix = "No setting removes it."
        return f"{self.feature}. {fix}"


class DTAUnsupportedError(NotImplementedError, ValueError):
    """DTA refuses a model (or a training setup): every blocker with its fix, then the dense alternative.

    A `NotImplementedError` (DTA does not implement these features) and a `ValueError` (the value passed cannot run
    this way), so that callers catching either see it.

    Args:
        subject (`str`): what is refused, e.g. `"MixtralForCausalLM (model type 'mixtral')"`.
        blockers (`Sequence[Blocker]`): at least one.
        tail (`str`, *optional*): a closing sentence (e.g. the tested families).
        alternative (`str`, *optional*, defaults to `ENGINE_ALTERNATIVE`): the closing offer: `TRAINER_ALTERNATIVE`
            where only a DTA trainer's user meets the refusal, `""` where the fixes are the only way out.
    """

    def __init__(self, subject: str, blockers: Sequence[Blocker], tail: str = "", *,
                 alternative: str = ENGINE_ALTERNATIVE):
        if not blockers:
            raise ValueError("a refusal needs at least one blocker")
        self.subject = subject
        self.blockers = tuple(blockers)
        lines = [f"{subject} cannot run through DTA:"]
        lines += [f"  {i}. {blocker.describe()}" for i, blocker in enumerate(self.blockers, start=1)]
        closing = " ".join(part for part in (alternative, tail) if part)
        lines += [closing] if closing else []
        super().__init__("\n".join(lines))


def refuse(subject: str, blockers: Sequence[Blocker], tail: str = "", *, alternative: str = ENGINE_ALTERNATIVE) -> None:
    """Raise one [`DTAUnsupportedError`] listing `blockers`, if there are any (arguments as the error's)."""
    if blockers:
        raise DTAUnsupportedError(subject, blockers, tail, alternative=alternative)
