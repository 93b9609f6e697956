"""The one switch of a model's attention implementation for the length of a call.

transformers reads `config._attn_implementation` at every attention call, so routing a model's attention through a
registered function (`"dta"` for the engine, `"dta_probe"` for the support probe, `"dta_generate"` for the prefix
cache) is a matter of setting it on every config of the model (sub-models have their own) and restoring each on exit.
A vision-language model's vision tower keeps its own (`keep`): it runs its attention on the images, not through DTA.
The engine also suspends HF gradient checkpointing for its calls: a checkpointed decoder layer would re-run its
forward in the backward without the path's keys/values.
"""

from __future__ import annotations

import contextlib

import torch

from .. import _checks


def _configs(module) -> dict:
    """The configs of `module` and its sub-modules that carry an attention implementation, by id."""
    return {id(m.config): m.config for m in module.modules()
            if hasattr(getattr(m, "config", None), "_attn_implementation")}


@contextlib.contextmanager
def attention_implementation(lm, name: str, *, suspend_checkpointing: bool = False, warn: bool = True,
                             keep: torch.nn.Module | None = None):
    """Route the attention of `lm` and every sub-model through the implementation registered as `name`, restoring
    each config's implementation (and each module's checkpointing flag) on exit.

    Args:
        lm (`torch.nn.Module`): the model (its modules' configs are switched too).
        name (`str`): a name registered with transformers' `AttentionInterface`.
        suspend_checkpointing (`bool`, *optional*, defaults to `False`): also turn off HF gradient checkpointing
            (`module.gradient_checkpointing`) for the duration (engine calls).
        warn (`bool`, *optional*, defaults to `True`): warn once when checkpointing is suspended (`False` for an
            engine with a memory budget, `max_graph_tokens`: a DTA trainer sets one, and its own warning names it).
        keep (`torch.nn.Module`, *optional*): a sub-module whose configs keep their implementation (a vision tower;
            transformers sets a composite config's sub-configs with it, so they are set back).
    """
    configs = _configs(lm)
    configs[id(lm.config)] = lm.config
    saved = {k: c._attn_implementation for k, c in configs.items()}
    kept = list(_configs(keep).values()) if keep is not None else []
    kept_saved = [c._attn_implementation for c in kept]
    checkpointed = [m for m in lm.modules() if getattr(m, "gradient_checkpointing", False) is True] \
        if suspend_checkpointing else []
    if checkpointed and warn:
        _checks.warn_once(
            "engine:gradient_checkpointing",
            "DTAEngine: HF gradient checkpointing is suspended during engine calls (it drops the key/value prefix); "
            "set `max_graph_tokens` to bound memory with the engine's own recompute instead.",
        )
    try:
        for c in configs.values():
            c._attn_implementation = name
        for c, implementation in zip(kept, kept_saved):
            c._attn_implementation = implementation
        for m in checkpointed:
            m.gradient_checkpointing = False
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]
        for c, implementation in zip(kept, kept_saved):
            c._attn_implementation = implementation
        for m in checkpointed:
            m.gradient_checkpointing = True
