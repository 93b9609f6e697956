"""TRL's policy objectives, one sequence at a time.

`GRPOTrainer._compute_loss` and `RLOOTrainer._compute_loss` compute a loss over a padded micro-batch. Every
normaliser in them depends only on masks and counts, so the micro-batch loss is a sum of per-sequence terms:

```
loss = sum_i term_i(logps_i, entropies_i)        term_i = (per-token loss of row i * mask_i).sum() / divisor_i
```

The engine calls a term at each leaf of the prefix tree, with that sequence's log-probs (and entropies) as live
tensors, so the backward of `sum_i term_i` is the dense backward of TRL's loss. The classes here hold a micro-batch's
constants (masks, advantages, old/reference log-probs, the normalisers) and compute `term_i` with exactly TRL's
formulas, row by row. Options whose loss is not such a sum (`top_entropy_quantile < 1`, which thresholds entropies
over the whole micro-batch) are not handled here: the trainer mixin falls back to its exact two-pass path.

Shapes below: `B` rows, `T = logits_to_keep` completion columns; a row's `C_i` valid completion tokens sit in its first
`C_i` columns (TRL right-pads completions), so a term only reads columns `[:C_i]`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def _rows(x: torch.Tensor | None, i: int, n: int) -> torch.Tensor | None:
    """Row `i` of a `(B, T)` tensor restricted to its first `n` columns, or of a `(B, 1)` tensor as shape `(1,)`."""
    if x is None:
        return None
    if x.dim() == 1:
        return x[i].reshape(1)
    return x[i, :n] if x.size(1) != 1 else x[i].reshape(1)


# TRL's normaliser of `(per_token_loss * mask).sum()`, per row `(B,)`, by loss type (train mode: divided by the
# gradient accumulation `acc`). Each takes the loss (its float `mask` `(B, T)`, its trainer), the inputs, `B`, `acc`.
def _tokens_per_row(loss, inputs: dict, rows: int, acc: int) -> torch.Tensor:
    return loss.mask.sum(-1).clamp(min=1.0) * rows * acc


def _tokens_per_batch(loss, inputs: dict, rows: int, acc: int) -> torch.Tensor:
    return (loss.mask.sum().clamp(min=1.0) * acc).expand(rows)


def _max_completion_length(loss, inputs: dict, rows: int, acc: int) -> torch.Tensor:
    return torch.full((rows,), float(rows * loss.trainer.max_completion_length * acc), device=loss.mask.device)


def _items_in_batch(loss, inputs: dict, rows: int, acc: int) -> torch.Tensor:
    t = loss.trainer
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / t.accelerator.num_processes
    normalizer = normalizer * acc / t.args.steps_per_generation
    return normalizer.float().expand(rows)


def _rows_only(loss, inputs: dict, rows: int, acc: int) -> torch.Tensor:
    return torch.full((rows,), float(rows * acc), device=loss.mask.device)


_DIVISORS: dict[str, Callable] = {
    "grpo": _tokens_per_row, "sapo": _tokens_per_row, "bnpo": _tokens_per_batch, "dr_grpo": _max_completion_length,
    "cispo": _items_in_batch, "dapo": _items_in_batch, "vespo": _items_in_batch, "luspo": _rows_only,
}


@dataclass
class _Row:
    """One row's tensors, `(C_i,)` each (`coef_1` `(1,)` at the sequence level): what a per-token loss reads."""

    i: int
    logps: torch.Tensor
    log_ratio: torch.Tensor
    coef_1: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor


# TRL's per-token loss `(C_i,)` of a row, by loss type (before the off-policy mask, vLLM's importance sampling and KL).
def _cispo(loss, r: _Row) -> torch.Tensor:
    clamped = torch.clamp(r.coef_1, max=loss.epsilon_high).detach()
    return -clamped * r.adv * r.logps


def _clipped(loss, r: _Row) -> torch.Tensor:
    coef_2 = torch.clamp(r.coef_1, 1 - loss.epsilon_low, 1 + loss.epsilon_high)
    coef_1 = r.coef_1 if loss.delta is None else torch.clamp(r.coef_1, max=loss.delta)
    return -torch.min(coef_1 * r.adv, coef_2 * r.adv)


def _sapo(loss, r: _Row) -> torch.Tensor:
    args = loss.trainer.args
    temperatures = torch.where(r.adv > 0, args.sapo_temperature_pos, args.sapo_temperature_neg)
    soft_coef_1 = torch.sigmoid(temperatures * (r.coef_1 - 1)) * 4 / temperatures
    return -soft_coef_1 * r.adv


def _vespo(loss, r: _Row) -> torch.Tensor:
    args = loss.trainer.args
    ratio = _rows(loss.is_ratio, r.i, r.logps.size(0))
    phi_seq = loss.trainer.get_gamma_weights(
        advantages=r.adv.view(1, -1),
        log_ratio_per_token=r.log_ratio.view(1, -1),
        mask=r.mask.view(1, -1),
        importance_sampling_ratio=None if ratio is None else ratio.view(1, -1),
        k_pos=args.vespo_k_pos,
        lambda_pos=args.vespo_lambda_pos,
        k_neg=args.vespo_k_neg,
        lambda_neg=args.vespo_lambda_neg,
    ).view(-1)
    return -phi_seq * r.adv * r.logps


_PER_TOKEN_LOSSES: dict[str, Callable] = {
    "cispo": _cispo, "grpo": _clipped, "bnpo": _clipped, "dr_grpo": _clipped, "dapo": _clipped, "luspo": _clipped,
    "sapo": _sapo, "vespo": _vespo,
}


class GRPOSequenceLoss:
    """`GRPOTrainer._compute_loss` (train mode) as per-sequence terms, for one micro-batch.

    Args:
        trainer ([`~trl.GRPOTrainer`]): the trainer (its loss settings and static helpers `get_off_policy_mask`,
            `get_gamma_weights` are used, so subclass overrides of those helpers apply).
        inputs (`dict`): the micro-batch as `_prepare_inputs` returns it: `completion_mask` `(B, T)`, `advantages`
            `(B,)` or `(B, T)`, `num_items_in_batch`, and when present `tool_mask`, `old_per_token_logps`,
            `ref_per_token_logps`, `importance_sampling_ratio` `(B, T)` or `(B, 1)`, `sampling_per_token_logps`.
        scale (`float`): factor applied to every term on top of TRL's normalisation (the gradient-accumulation scaling
            the HF `Trainer` applies to the returned loss, 1.0 for GRPO).
        entropy_coef (`float`, *optional*, defaults to `0.0`): the entropy bonus's coefficient TRL applies in this
            accumulation window (`_trl.entropy_coef`: adaptive mode gates it on the last measured
            entropy); 0 without the bonus.
    """

    def __init__(self, trainer, inputs: dict, scale: float, entropy_coef: float = 0.0):
        t, args = trainer, trainer.args
        completion_mask = inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        self.trainer = t
        self.loss_type = t.loss_type
        self.level = t.importance_sampling_level
        if self.level not in ("token", "sequence"):
            raise ValueError(
                f"Unknown importance sampling level: {self.level}. Possible values are 'token' and 'sequence'."
            )
        self.epsilon_low, self.epsilon_high, self.delta = t.epsilon_low, t.epsilon_high, args.delta
        self.beta, self.bias_correction_kl = t.beta, args.use_bias_correction_kl
        self.off_policy_threshold = t.off_policy_mask_threshold
        self.vllm_is = t.use_vllm and t.vllm_importance_sampling_correction

        self.mask = mask.float()
        self.advantages = inputs["advantages"]
        self.old = inputs.get("old_per_token_logps")
        self.ref = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        self.is_ratio = inputs.get("importance_sampling_ratio")
        self.sampling = inputs.get("sampling_per_token_logps")

        if self.loss_type not in _DIVISORS:
            raise ValueError(f"Unknown loss type: {self.loss_type} (DTA reproduces {sorted(_DIVISORS)})")
        self.per_token_loss = _PER_TOKEN_LOSSES[self.loss_type]
        accumulation = t.current_gradient_accumulation_steps
        self.row_scale = scale / _DIVISORS[self.loss_type](self, inputs, mask.size(0), accumulation)

        # Entropy bonus: `- coef * (entropies * mask).sum() / mask.sum().clamp(min=1) / accumulation`.
        coef = entropy_coef
        self.needs_entropy_grad = coef != 0.0
        self.entropy_scale = scale * coef / (self.mask.sum().clamp(min=1.0) * accumulation)

    def __call__(self, i: int, logps: torch.Tensor, entropies: torch.Tensor | None) -> torch.Tensor:
        """Term of row `i`.

        Args:
            i (`int`): row index in the micro-batch.
            logps (`torch.Tensor` of shape `(C_i,)`): the policy's log-probs of the row's valid completion tokens.
            entropies (`torch.Tensor` of shape `(C_i,)`, *optional*): their entropies (needed for the entropy bonus).

        Returns:
            `torch.Tensor`: scalar, row `i`'s share of TRL's micro-batch loss (times `scale`).
        """
        n = logps.size(0)
        if n == 0:
            return logps.sum()  # a zero connected to the graph: the row has no scored token
        mask = self.mask[i, :n]
        adv = _rows(self.advantages, i, n)
        old = logps.detach() if self.old is None else self.old[i, :n]

        if self.off_policy_threshold is not None:
            sampling = old if self.sampling is None else self.sampling[i, :n]
            keep = self.trainer.get_off_policy_mask(
                advantages=adv.view(1, -1),
                per_token_logps=logps.view(1, -1),
                sampling_per_token_logps=sampling.view(1, -1),
                mask=mask.view(1, -1),
                off_policy_threshold=self.off_policy_threshold,
            ).view(-1)

        log_ratio = logps - old
        if self.level == "token":
            log_weights = log_ratio
        else:
            log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        coef_1 = torch.exp(log_weights)

        if self.beta != 0.0:
            ref = self.ref[i, :n]
            per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
            if self.bias_correction_kl:
                per_token_kl = per_token_kl * coef_1

        per_token_loss = self.per_token_loss(self, _Row(i, logps, log_ratio, coef_1, adv, mask))

        if self.off_policy_threshold is not None:
            per_token_loss = per_token_loss * keep
        if self.vllm_is and self.loss_type != "vespo":
            per_token_loss = per_token_loss * _rows(self.is_ratio, i, n)
        if self.beta != 0.0:
            per_token_loss = per_token_loss + self.beta * per_token_kl

        term = (per_token_loss * mask).sum() * self.row_scale[i]
        if self.needs_entropy_grad:
            term = term - self.entropy_scale * (entropies * mask).sum()
        return term


class RLOOSequenceLoss:
    """`RLOOTrainer._compute_loss` (train mode) as per-sequence terms, for one micro-batch.

    RLOO's loss is the row mean of `-min(r_i * A_i, clip(r_i) * A_i)` with `r_i = exp(sum_t logps_it - old_logps_i)`
    (a sequence-level ratio over the completion mask).

    Args:
        trainer ([`~trl.RLOOTrainer`]): the trainer (clipping range).
        inputs (`dict`): the micro-batch: `completion_mask` `(B, T)`, `old_logps` `(B,)`, `advantages` `(B,)`.
        scale (`float`): factor applied to every term (the HF `Trainer`'s `1 / gradient_accumulation_steps`).
        entropy_coef (`float`, *optional*, defaults to `0.0`): RLOO has no entropy bonus; must be 0.
    """

    def __init__(self, trainer, inputs: dict, scale: float, entropy_coef: float = 0.0):
        if entropy_coef:
            raise ValueError(f"RLOO's loss has no entropy bonus, got entropy_coef={entropy_coef}.")
        self.epsilon_low, self.epsilon_high = trainer.epsilon_low, trainer.epsilon_high
        self.completion_mask = inputs["completion_mask"].float()
        self.old_logps = inputs["old_logps"]
        self.advantages = inputs["advantages"]
        self.row_scale = scale / self.completion_mask.size(0)

    needs_entropy_grad = False

    def __call__(self, i: int, logps: torch.Tensor, entropies: torch.Tensor | None) -> torch.Tensor:
        """Term of row `i` from its valid completion log-probs `logps` of shape `(C_i,)`."""
        n = logps.size(0)
        seq_logps = (logps * self.completion_mask[i, :n]).sum()
        coef_1 = torch.exp(seq_logps - self.old_logps[i])
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        advantage = self.advantages[i]
        return -torch.min(coef_1 * advantage, coef_2 * advantage) * self.row_scale
