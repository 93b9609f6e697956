"""Log-probabilities and entropies from the LM head without materialising `[tokens, vocab]` logits.

Only the positions whose next token is scored are projected, in chunks of `chunk_size` rows. With autograd on, each
chunk runs under non-reentrant activation checkpointing: the graph keeps the chunk's hidden states, and the
`(chunk, vocab)` logits are recomputed in the backward (the same trade TRL's fused LM head makes). Any head module
works (a plain `nn.Linear`, tied embeddings, a PEFT-wrapped head).

Logits are post-processed as the model's own forward does (`logit_scale`, `final_logit_softcapping`), then divided
by the temperature. Half-precision logits are upcast to float32 for the softmax statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class HeadSpec:
    """How a model turns final hidden states into logits.

    Args:
        module (`torch.nn.Module`): the output embedding (`model.get_output_embeddings()`).
        logit_scale (`float`): multiplier applied to the head's output (Cohere-style models), 1.0 otherwise.
        softcap (`float`, *optional*): `final_logit_softcapping` (Gemma 2/3): `logits = c * tanh(logits / c)`.
    """

    module: torch.nn.Module
    logit_scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def from_model(cls, model) -> HeadSpec:
        config = model.config.get_text_config()
        scale = getattr(config, "logit_scale", None)
        for unsupported in ("logits_scaling", "lm_head_multiplier", "output_multiplier"):
            if getattr(config, unsupported, None) not in (None, 1, 1.0):
                raise NotImplementedError(
                    f"{type(model).__name__} scales its logits with `{unsupported}`, which DTA does not implement."
                )
        return cls(model.get_output_embeddings(), 1.0 if scale is None else float(scale),
                   getattr(config, "final_logit_softcapping", None))


def _chunk_stats(hidden, targets, spec: HeadSpec, inv_temperature: float, want_entropy: bool):
    logits = spec.module(hidden)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if spec.logit_scale != 1.0:
        logits = logits * spec.logit_scale
    if spec.softcap is not None:
        logits = torch.tanh(logits / spec.softcap) * spec.softcap
    logits = logits * inv_temperature
    lse = torch.logsumexp(logits, dim=-1)
    logps = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not want_entropy:
        return logps, None
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logps, entropy


def head_logprobs(
    spec: HeadSpec,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_size: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next-token log-probs (and entropies) of `targets` given `hidden`.

    Args:
        hidden (`torch.Tensor` of shape `(n, hidden_size)`): final hidden states of the scored positions.
        targets (`torch.LongTensor` of shape `(n,)`): the token each position predicts.
        temperature (`float`): the logits are divided by it.
        entropy (`bool`): also return the entropy of each position's distribution.
        chunk_size (`int`): rows projected at once (memory: `chunk_size * vocab` logits).

    Returns:
        `(logps, entropies)`, each of shape `(n,)` (entropies None unless asked); float32 for half-precision models.
    """
    inv_t = 1.0 / temperature
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in spec.module.parameters()))
    lps, ents = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if grad:
            lp, ent = checkpoint(_chunk_stats, h, t, spec, inv_t, entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(h, t, spec, inv_t, entropy)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        dtype = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
        empty = hidden.new_zeros(0, dtype=dtype)
        return empty, (empty if entropy else None)
    logps = lps[0] if len(lps) == 1 else torch.cat(lps)
    ents_out = None if not entropy else (ents[0] if len(ents) == 1 else torch.cat(ents))
    return logps, ents_out
