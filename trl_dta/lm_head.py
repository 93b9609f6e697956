"""Log-probabilities and entropies from the LM head without materialising `[tokens, vocab]` logits.

Only the positions whose next token is scored are projected, in chunks of rows. The graph keeps only the hidden
states; the `(chunk, vocab)` logits are recomputed in the backward (the same trade TRL's fused LM head makes).

Two paths:
- a plain `nn.Linear` head (tied embeddings included): one `autograd.Function` whose backward turns each recomputed
  logit tile into its gradient in place (`dz = g_lp * (onehot - p) - g_ent * p * (log p + H)`) and applies the two
  GEMMs, with no intermediate autograd graph;
- any other head module (e.g. a PEFT-wrapped head): the same statistics under non-reentrant activation checkpointing.

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


def _tile_logits(h, weight, bias, spec: HeadSpec, inv_t: float):
    """Post-processed logits `(rows, vocab)` of a tile (float32 for half precision) and `d logits / d (h W^T + b)`
    as a scalar or a tensor (soft-capping)."""
    y = h @ weight.t()
    if bias is not None:
        y = y + bias
    if y.dtype in (torch.float16, torch.bfloat16):
        y = y.float()
    scale = spec.logit_scale * inv_t
    if spec.softcap is None:
        return y.mul_(scale), scale
    th = torch.tanh(y.mul_(spec.logit_scale / spec.softcap))
    return th * (spec.softcap * inv_t), (1 - th * th).mul_(scale)


class _LinearLogProbs(torch.autograd.Function):
    """Log-probs and entropies of a linear head, tile by tile; the backward recomputes each tile."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, spec, inv_t, want_entropy, rows):
        lps, ents = [], []
        for start in range(0, hidden.shape[0], rows):
            z, _ = _tile_logits(hidden[start : start + rows], weight, bias, spec, inv_t)
            lse = torch.logsumexp(z, dim=-1)
            lps.append(z.gather(-1, targets[start : start + rows, None]).squeeze(-1) - lse)
            if want_entropy:
                z.sub_(lse[:, None])  # log p
                ents.append(-(z.exp() * z).sum(-1))
        logps = torch.cat(lps)
        entropy = torch.cat(ents) if want_entropy else None
        ctx.save_for_backward(hidden, weight, bias, targets, logps, entropy)
        ctx.spec, ctx.inv_t, ctx.rows = spec, inv_t, rows
        ctx.set_materialize_grads(False)
        return logps, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, logps, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None, None, None
        gh_tiles, gw, gb = [], None, None
        for start in range(0, hidden.shape[0], ctx.rows):
            sl = slice(start, start + ctx.rows)
            h, t = hidden[sl], targets[sl]
            z, dz_dy = _tile_logits(h, weight, bias, ctx.spec, ctx.inv_t)
            lse = z.gather(-1, t[:, None]).squeeze(-1) - logps[sl]
            logp = z.sub_(lse[:, None])
            p = logp.exp()
            if g_ent is not None:  # dH/dz = -p * (log p + H)
                dz = logp.add_(entropy[sl, None]).mul_(p).mul_(-g_ent[sl, None])
                if g_lp is not None:
                    dz.sub_(p.mul_(g_lp[sl, None]))
            else:  # d log p_t / dz = onehot_t - p
                dz = p.mul_(-g_lp[sl, None])
            if g_lp is not None:
                dz.scatter_add_(-1, t[:, None], g_lp[sl, None].to(dz.dtype))
            dy = (dz * dz_dy if isinstance(dz_dy, torch.Tensor) else dz.mul_(dz_dy)).to(weight.dtype)
            if need_h:
                gh_tiles.append(dy @ weight)
            if need_w:
                gw = dy.t() @ h if gw is None else gw.addmm_(dy.t(), h)
            if need_b and bias is not None:
                gb = dy.sum(0) if gb is None else gb.add_(dy.sum(0))
        gh = (gh_tiles[0] if len(gh_tiles) == 1 else torch.cat(gh_tiles)) if need_h else None
        return gh, gw, gb, None, None, None, None, None


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
    if type(spec.module) is torch.nn.Linear and hidden.shape[0]:
        rows = max(1, min(chunk_size, (1 << 24) // spec.module.weight.shape[0]))
        return _LinearLogProbs.apply(hidden, spec.module.weight, spec.module.bias, targets, spec, inv_t, entropy, rows)
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
