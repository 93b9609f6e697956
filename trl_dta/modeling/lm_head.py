"""Log-probabilities and entropies from the LM head without materialising `[tokens, vocab]` logits.

Only the positions whose next token is scored are projected, in chunks of rows. The graph keeps only the hidden
states; the `(chunk, vocab)` logits are recomputed in the backward (the same trade TRL's fused LM head makes).

Two paths:
- a plain `nn.Linear` head (tied embeddings included): one `autograd.Function` whose backward turns each recomputed
  logit tile into its gradient in place (`dz = g_lp * (onehot - p) - g_ent * p * (log p + H)`) and applies the two
  GEMMs, with no intermediate autograd graph;
- any other head module (e.g. a PEFT-wrapped head): the same statistics under non-reentrant activation checkpointing.

Logits are post-processed as the model's own forward does (a per-family factor such as Cohere's `logit_scale` or
Granite's `logits_scaling`, then `final_logit_softcapping`), then divided by the temperature.

Precision, as TRL's fused head (`trl.kernels.ChunkedLogProbFunction`) computes it: the logit tiles are a GEMM in the
*compute dtype* (the autocast dtype under autocast, else the hidden states' dtype; [`precision.head_compute_dtype`]),
a bias added inside the GEMM as `nn.Linear` adds it; the softmax statistics, log-probs and entropies are float32 for
half precision; in the backward the logit gradient is rounded to the compute dtype and both gradient GEMMs accumulate
in float32 before the result takes the dtype of the hidden states and of the weight. Under bf16 autocast over float32
weights that is bf16 logits, float32 log-probs, float32 gradients.

A tile holds at most `MAX_TILE_LOGITS` logits, whatever chunk size is asked for (the comment at `MAX_TILE_LOGITS`
derives the bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..precision import acc_dtype, head_compute_dtype, is_half
from ..refusal import Blocker, refuse
from .families import family_of, model_types

# Config fields that scale the logits in some family. What a field means differs between families, so a family's
# factor is its row's `logit_multiplier` (`families.py`); a family without one whose config sets a field is refused.
_SCALING_FIELDS = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier")


def unknown_logit_scaling(config) -> str | None:
    """The field of a text config that scales the logits in a way the family table does not know for its model type
    (no `logit_multiplier` in its row), or None."""
    if family_of(config).logit_multiplier is not None:
        return None
    return next((f for f in _SCALING_FIELDS if getattr(config, f, None) not in (None, 1, 1.0)), None)

# Tile size. A tile is `(rows, vocab)` logits, materialised in float32 for half-precision models. The forward keeps
# one tile at a time; the backward of the linear head about three (the logits turned into log p in place, p, the
# gradient dz) plus dy in the weight dtype. Capping a tile at 2**24 logits bounds that at 64 MiB per float32 tile
# (about 256 MiB in the backward) whatever the vocabulary, so `chunk_size` is an upper bound on the rows of a tile:
# 2**24 // vocab rows is 110 for Qwen2's 151,936-token vocabulary, 128 for Llama 3's 128,256, 4096 (the default
# chunk) only below 4,096 tokens. The results do not depend on the tile size: every row is computed on its own.
MAX_TILE_LOGITS = 1 << 24


def tile_rows(chunk_size: int, vocab_size: int) -> int:
    """Rows of one LM-head tile: `chunk_size`, capped so that a tile holds at most `MAX_TILE_LOGITS` logits (and at
    least one row)."""
    return max(1, min(chunk_size, MAX_TILE_LOGITS // vocab_size))


@dataclass(frozen=True)
class HeadSpec:
    """How a model turns final hidden states into logits.

    Args:
        module (`torch.nn.Module`): the output embedding (`model.get_output_embeddings()`), weight of shape
            `(vocab, hidden_size)`.
        logit_scale (`float`): factor applied to the head's output: Cohere's `logit_scale`, `1 / logits_scaling` for
            Granite (and MiniCPM3), HyperCLOVAX's `logits_scaling`; 1.0 otherwise.
        softcap (`float`, *optional*): `final_logit_softcapping` (Gemma 2/3): `logits = c * tanh(logits / c)`.
    """

    module: torch.nn.Module
    logit_scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def from_model(cls, model) -> HeadSpec:
        """The head of a transformers causal LM, its logit post-processing read from its config.

        Raises:
            `DTAUnsupportedError`: the config scales the logits in a way this module does not know for its family.
        """
        config = model.config.get_text_config()
        field = unknown_logit_scaling(config)
        if field is not None:
            refuse(f"{type(model).__name__} (model type '{config.model_type}')", [Blocker(
                f"it scales its logits with `{field}`, whose meaning DTA knows only for the model types "
                f"{model_types('logit_multiplier')}")])
        multiplier = family_of(config).logit_multiplier
        scale = 1.0 if multiplier is None else multiplier(config)
        return cls(model.get_output_embeddings(), scale, getattr(config, "final_logit_softcapping", None))


def _log_softmax_(z: torch.Tensor) -> torch.Tensor:
    """`z - logsumexp(z)` over the last dimension, in place, as `torch.log_softmax` rounds it: `(z - max) - log sum
    exp(z - max)`. (Forming `lse = max + log sum` first rounds it at the logits' magnitude, and `z - lse` carries that
    rounding: in float32 about twice the log-probs' and entropies' error of `log_softmax`.)"""
    z.sub_(z.amax(-1, keepdim=True))
    return z.sub_(z.exp().sum(-1, keepdim=True).log_())


def _chunk_stats(hidden, targets, spec: HeadSpec, inv_temperature: float, want_entropy: bool):
    logits = spec.module(hidden)
    if is_half(logits.dtype):
        logits = logits.float()
    if spec.logit_scale != 1.0:
        logits = logits * spec.logit_scale
    if spec.softcap is not None:
        logits = torch.tanh(logits / spec.softcap) * spec.softcap
    logp = torch.log_softmax(logits * inv_temperature, dim=-1)
    logps = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not want_entropy:
        return logps, None
    return logps, -(logp.exp() * logp).sum(-1)


def _addmm_fp32(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`acc + a @ b` accumulated in float32 (or float64) without rounding `a @ b` to a half-precision input dtype
    first; `acc` None starts from zero."""
    out_dtype = acc_dtype(a.dtype)
    if a.dtype == out_dtype:
        return a @ b if acc is None else acc.addmm_(a, b)
    if a.device.type == "cuda":
        acc = torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device) if acc is None else acc
        return torch.addmm(acc, a, b, out_dtype=out_dtype, out=acc)
    return a.to(out_dtype) @ b.to(out_dtype) if acc is None else acc.addmm_(a.to(out_dtype), b.to(out_dtype))


def _tile_logits(h, weight, bias, spec: HeadSpec, inv_t: float):
    """Post-processed logits `(rows, vocab)` of a tile and `d logits / d (h W^T + b)` as a scalar or a tensor
    (soft-capping). `h`, `weight`, `bias` are already in the compute dtype: the GEMM runs there (TRL's tile), the
    post-processing in float32 for half precision."""
    y = F.linear(h, weight, bias)  # the bias added before rounding, as nn.Linear does (TRL's tile adds it after)
    if is_half(y.dtype):
        y = y.float()
    scale = spec.logit_scale * inv_t
    if spec.softcap is None:
        return y.mul_(scale), scale
    th = torch.tanh(y.mul_(spec.logit_scale / spec.softcap))
    return th * (spec.softcap * inv_t), (1 - th * th).mul_(scale)


def _sum_rows(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0, dtype=acc_dtype(x.dtype))


class _LinearLogProbs(torch.autograd.Function):
    """Log-probs and entropies of a linear head, tile by tile; the backward recomputes each tile."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, spec, inv_t, want_entropy, rows):
        compute = head_compute_dtype(hidden)
        w, b = weight.to(compute), None if bias is None else bias.to(compute)  # (vocab, hidden), (vocab,)
        lps, ents = [], []
        for start in range(0, hidden.shape[0], rows):
            z, _ = _tile_logits(hidden[start : start + rows].to(compute), w, b, spec, inv_t)
            logp = _log_softmax_(z)  # (rows, vocab)
            lps.append(logp.gather(-1, targets[start : start + rows, None]).squeeze(-1))
            if want_entropy:
                ents.append(-(logp.exp() * logp).sum(-1))
        logps = torch.cat(lps)
        entropy = torch.cat(ents) if want_entropy else None
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.spec, ctx.inv_t, ctx.rows, ctx.compute = spec, inv_t, rows, compute
        ctx.set_materialize_grads(False)
        return logps, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):  # the dtypes below are explicit
            return _LinearLogProbs._backward(ctx, g_lp, g_ent)

    @staticmethod
    def _backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None, None, None
        gh_tiles, gw, gb = [], None, None
        compute = ctx.compute
        w, b = weight.to(compute), None if bias is None else bias.to(compute)
        for start in range(0, hidden.shape[0], ctx.rows):
            sl = slice(start, start + ctx.rows)
            h, t = hidden[sl].to(compute), targets[sl]
            z, dz_dy = _tile_logits(h, w, b, ctx.spec, ctx.inv_t)
            logp = _log_softmax_(z)  # the forward's log p, rounded the same way
            p = logp.exp()
            if g_ent is not None:  # dH/dz = -p * (log p + H)
                dz = logp.add_(entropy[sl, None]).mul_(p).mul_(-g_ent[sl, None])
                if g_lp is not None:
                    dz.sub_(p.mul_(g_lp[sl, None]))
            else:  # d log p_t / dz = onehot_t - p
                dz = p.mul_(-g_lp[sl, None])
            if g_lp is not None:
                dz.scatter_add_(-1, t[:, None], g_lp[sl, None].to(dz.dtype))
            dy_acc = dz * dz_dy if isinstance(dz_dy, torch.Tensor) else dz.mul_(dz_dy)  # (rows, vocab), softmax dtype
            dy = dy_acc.to(compute)  # the logit gradient in the compute dtype, as TRL's tile holds it
            if need_b and bias is not None:  # summed in float32 before rounding to the bias dtype
                gb = _sum_rows(dy) if gb is None else gb.add_(_sum_rows(dy))
            if need_h:
                gh_tiles.append(_addmm_fp32(None, dy, w).to(hidden.dtype))
            if need_w:
                gw = _addmm_fp32(gw, dy.t(), h)
        gh = (gh_tiles[0] if len(gh_tiles) == 1 else torch.cat(gh_tiles)) if need_h else None
        gw = None if gw is None else gw.to(weight.dtype)
        return gh, gw, None if gb is None else gb.to(bias.dtype), None, None, None, None, None


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
        chunk_size (`int`): rows projected at once, at most [`MAX_TILE_LOGITS`]` // vocab` (see [`tile_rows`]).

    Returns:
        `(logps, entropies)`, each of shape `(n,)` (entropies None unless asked); float32 for half-precision models.
    """
    inv_t = 1.0 / temperature
    rows = tile_rows(chunk_size, spec.module.weight.shape[0])
    if type(spec.module) is torch.nn.Linear and hidden.shape[0]:
        return _LinearLogProbs.apply(hidden, spec.module.weight, spec.module.bias, targets, spec, inv_t, entropy, rows)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in spec.module.parameters()))
    lps, ents = [], []
    for start in range(0, hidden.shape[0], rows):
        h, t = hidden[start : start + rows], targets[start : start + rows]
        if grad:
            lp, ent = checkpoint(_chunk_stats, h, t, spec, inv_t, entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(h, t, spec, inv_t, entropy)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        dtype = acc_dtype(hidden.dtype)
        empty = hidden.new_zeros(0, dtype=dtype)
        return empty, (empty if entropy else None)
    logps = lps[0] if len(lps) == 1 else torch.cat(lps)
    ents_out = None if not entropy else (ents[0] if len(ents) == 1 else torch.cat(ents))
    return logps, ents_out
