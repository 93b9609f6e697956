"""The dense peer: what TRL's `GRPOTrainer` does with a batch of rollouts.

Rows are cut into micro-batches of `micro_batch_size` rows (TRL's `per_device_train_batch_size`), each right-padded
to its longest row, and run through the model with TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`,
`model(..., labels=..., fused_lm_head=True)`), which returns per-token log-probabilities without materialising the
`(batch, seq_len, vocab)` logits. Each micro-batch's loss is back-propagated before the next one runs (gradient
accumulation), with or without Hugging Face gradient checkpointing (`GRPOConfig.gradient_checkpointing`, on by
default in TRL).

Two deliberate differences from TRL, both in dense's favour: padding is per micro-batch (TRL pads every row to the
longest row of the whole generation batch) and rows keep their order (TRL shuffles them, which mixes long and short
rows in one micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class ProviderOutput:
    """Result of one `forward_backward`.

    Args:
        loss (`float`): `sum_i loss_fn(i, ...)`.
        logps (`list[torch.Tensor]`): detached per-sequence log-probs, each of shape `(len_i - 1,)`.
        stats (`dict`): provider-specific counters (forwards, padded tokens, ...).
    """

    loss: float
    logps: list[torch.Tensor]
    stats: dict


def patch_fused_head(model, temperature: float, entropy: bool) -> None:
    """Give `model` TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`) once: per-token log-probs (and
    entropies with `entropy`) at `temperature` from `model(..., labels=..., fused_lm_head=True)`; a second call with
    other settings is refused (the head is patched in place)."""
    from trl.trainer.utils import add_fused_lm_head

    key = (temperature, entropy)
    if getattr(model, "_bench_fused_head", None) == key:
        return
    if getattr(model, "_bench_fused_head", None) is not None:
        raise ValueError("the model already has a fused LM head with other settings; build a fresh model")
    outputs = ("log_probs", "entropy") if entropy else ("log_probs",)
    add_fused_lm_head(model, temperature=temperature, outputs=outputs)
    model._bench_fused_head = key


class DenseProvider:
    """Padded micro-batches of rows through the model with TRL's fused LM head.

    Args:
        model ([`~transformers.PreTrainedModel`]): a causal LM (patched in place with TRL's fused LM head).
        micro_batch_size (`int`, *optional*, defaults to `1`): rows per forward/backward.
        gradient_checkpointing (`bool`, *optional*, defaults to `False`): enable Hugging Face gradient checkpointing
            (non-reentrant, as TRL configures it).
        temperature (`float`, *optional*, defaults to `1.0`): logits are divided by it.
        entropy (`bool`, *optional*, defaults to `False`): also compute per-token entropies (GRPOTrainer does, for
            its metrics) and pass them to `loss_fn`.
        pad_token_id (`int`, *optional*, defaults to `0`): id written into padding.
    """

    def __init__(
        self,
        model,
        micro_batch_size: int = 1,
        gradient_checkpointing: bool = False,
        temperature: float = 1.0,
        entropy: bool = False,
        pad_token_id: int = 0,
    ):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.model = model
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.entropy = entropy
        self.pad_token_id = pad_token_id
        patch_fused_head(model, temperature, entropy)
        if gradient_checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
            model.config.use_cache = False

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _pad(self, rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = r
            mask[b, : len(r)] = 1
        return ids.to(self.device), mask.to(self.device)

    def forward_backward(self, seqs: Sequence[torch.Tensor], loss_fn: Callable) -> ProviderOutput:
        """Run every sequence, call `loss_fn(i, logps_i, entropy_i)` and back-propagate the sum.

        Args:
            seqs (`list[torch.LongTensor]`): rollouts, each of shape `(len_i,)` with `len_i >= 1`.
            loss_fn (`Callable`): per-sequence loss, as for [`~trl_dta.DTAEngine.forward_backward`].
        """
        seqs = [torch.as_tensor(s, dtype=torch.long) for s in seqs]
        total, logps_out, padded = 0.0, [None] * len(seqs), 0
        for start in range(0, len(seqs), self.micro_batch_size):
            index = list(range(start, min(start + self.micro_batch_size, len(seqs))))
            ids, mask = self._pad([seqs[i] for i in index])
            padded += ids.numel()
            labels = ids.masked_fill(mask == 0, -100)
            out = self.model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            losses = []
            for b, i in enumerate(index):
                n = len(seqs[i]) - 1
                lp = out.log_probs[b, :n]
                ent = out.entropy[b, :n] if self.entropy else None
                losses.append(loss_fn(i, lp, ent))
                logps_out[i] = lp.detach()
            loss = torch.stack(losses).sum()
            loss.backward()
            total += loss.item()
        return ProviderOutput(loss=total, logps=logps_out, stats={"padded_tokens": padded})
