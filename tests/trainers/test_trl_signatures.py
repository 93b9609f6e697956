"""Every TRL (or transformers) method DTA's trainers override still has the signature our override was written against.

TRL calls its hooks by name, with its own arguments: when a TRL release changes a hook's parameters (as TRL did to the
copied `_generate_and_score_completions` of the trainers it later deleted, and as an open change does to
`_generate_single_turn`), an override that no longer matches fails at run time, or silently drops an argument. The
overrides are found by introspection (any method of a `trl_dta` class in `DTAGRPOTrainer`'s or `DTARLOOTrainer`'s MRO
whose name a TRL or transformers class further down the MRO defines), so a new override is checked without being
listed; each is compared with the installed TRL's method it overrides, and a failure names every drift.

An override matches when it accepts every call TRL's method accepts, the same way: TRL's parameters in TRL's order with
the same names, kinds and defaults (an override may give a default TRL's lacks), TRL's trailing keyword parameters
absorbed by the override's `**kwargs` (`_get_per_token_logps_and_entropies`' multimodal inputs, which TRL passes by
keyword) or, positional ones, by its `*args` (a pass-through `__init__(self, *args, **kwargs)` takes everything), and
any parameter of the override's own with a default. Annotations are not compared.
"""

from __future__ import annotations

import inspect

import pytest
from trl import GRPOTrainer, RLOOTrainer

from trl_dta.trainers import DTAGRPOTrainer, DTARLOOTrainer

P = inspect.Parameter
_POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)


def drift(ours, theirs) -> list[str]:
    """How the override `ours` fails to accept the calls `theirs` accepts (empty: it accepts them all, the same way)."""
    mine, trl = list(inspect.signature(ours).parameters.values()), list(inspect.signature(theirs).parameters.values())
    var_kw = any(p.kind == P.VAR_KEYWORD for p in mine)
    var_pos = any(p.kind == P.VAR_POSITIONAL for p in mine)
    fixed = [p for p in mine if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    problems = []
    for i, t in enumerate(trl):
        if t.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            if not any(p.kind == t.kind for p in mine):
                problems.append(f"TRL takes {'*' if t.kind == P.VAR_POSITIONAL else '**'}{t.name}, the override not")
            continue
        o = fixed[i] if i < len(fixed) else None
        if o is None:
            by_keyword = t.kind == P.KEYWORD_ONLY or (t.kind != P.POSITIONAL_ONLY and t.default is not P.empty)
            absorbed = (var_pos and var_kw) or (var_pos and t.kind in _POSITIONAL) or (var_kw and by_keyword)
            if not absorbed:
                problems.append(f"TRL's parameter `{t}` (position {i}) is missing from the override")
            continue
        if o.name != t.name:
            problems.append(f"position {i}: TRL's `{t.name}`, the override's `{o.name}`")
        elif o.kind != t.kind:
            problems.append(f"`{t.name}`: TRL's is {t.kind.description}, the override's {o.kind.description}")
        elif t.default is not P.empty and o.default != t.default:
            problems.append(f"`{t.name}`: TRL's default {t.default!r}, the override's "
                            f"{'none' if o.default is P.empty else repr(o.default)}")
    for o in fixed[len([t for t in trl if t.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]):]:
        if o.default is P.empty:
            problems.append(f"the override's own parameter `{o.name}` has no default, so TRL's calls cannot fill it")
    return problems


def overrides(trainer: type) -> list[tuple[str, type, type]]:
    """`(name, our class, TRL's or transformers' class)` of every method of ours that overrides one of theirs."""
    mro = trainer.__mro__
    out = []
    for k, cls in enumerate(mro):
        if not cls.__module__.startswith("trl_dta"):
            continue
        for name, value in vars(cls).items():
            if not callable(value) or (name.startswith("__") and name != "__init__") or name.startswith("_dta"):
                continue
            base = next((b for b in mro[k + 1:] if name in vars(b) and b.__module__.split(".")[0] in
                         ("trl", "transformers")), None)
            if base is not None:
                out.append((name, cls, base))
    return out


@pytest.mark.parametrize("trainer,trl_trainer", [(DTAGRPOTrainer, GRPOTrainer), (DTARLOOTrainer, RLOOTrainer)],
                         ids=["grpo", "rloo"])
def test_overrides_match_installed_trl(trainer, trl_trainer):
    found = overrides(trainer)
    names = {name for name, _, _ in found}
    # the hooks the trainers are built on, so that a broken discovery cannot pass by finding nothing
    assert {"_prepare_inputs", "_get_per_token_logps_and_entropies", "training_step", "compute_loss",
            "_generate", "_generate_and_score_completions"} <= names, names
    if trl_trainer is GRPOTrainer:
        assert {"_generate_single_turn", "_calculate_rewards"} <= names, names
    report = [f"{cls.__qualname__}.{name} vs {base.__module__}.{base.__qualname__}.{name}: {problem}"
              for name, cls, base in found for problem in drift(vars(cls)[name], vars(base)[name])]
    assert not report, "TRL's hooks changed under DTA's overrides:\n" + "\n".join(report)


def test_drift_is_named():
    def trl_hook(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False): ...

    def old_override(self, prompt_ids, images, num_generations, has_tool_images=True): ...

    def kwargs_override(self, prompt_ids, images, multimodal_fields, num_generations, **rest): ...

    assert drift(trl_hook, trl_hook) == []
    assert drift(kwargs_override, trl_hook) == []
    assert drift(old_override, trl_hook) == [
        "position 3: TRL's `multimodal_fields`, the override's `num_generations`",
        "position 4: TRL's `num_generations`, the override's `has_tool_images`",
        "TRL's parameter `has_tool_images=False` (position 5) is missing from the override",
    ]

    def required_extra(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False, *,
                       needed): ...

    assert drift(required_extra, trl_hook) == [
        "the override's own parameter `needed` has no default, so TRL's calls cannot fill it"]

    def changed_default(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=True): ...

    assert drift(changed_default, trl_hook) == ["`has_tool_images`: TRL's default False, the override's True"]
