"""TRL's batch layout: where each row's tokens sit in a padded TRL batch, and how to take rows of one.

TRL's trainers pass batches as dicts of per-row tensors. Token rows are `[left-padded prompt | right-padded
completion]`, which this module reads as unpadded sequences (the engine's input) and maps the engine's per-sequence
log-probs back into TRL's `(B, T)` completion columns:

```
prompt_ids/prompt_mask      completion_ids/completion_mask        row i: P_i prompt tokens, C_i completion tokens
[ . . . p p p ]             [ c c c c . . ]                        sequence i = the P_i + C_i real tokens
          <-P_i->            <--C_i-->                             its log-probs: the last C_i (columns 0 .. C_i - 1)
```

Rows of a generation come in groups of `num_generations` consecutive rows (TRL's `RepeatSampler`), process by
process: [`group_ids`] numbers them globally. Nothing here imports TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# How a multi-turn rollout becomes training rows: "episode" (one row per episode, TRL's) or "per_turn" (one row per
# assistant turn, the conversation up to and including it; `trainers/per_turn.py`). One source for the trainers, the
# environment and the analyzer.
SAMPLE_LAYOUTS = ("episode", "per_turn")

# Inputs of vision-language models TRL's batches carry: DTA keys Qwen2-VL-style images (`vision.SUPPORTED_KEYS`,
# `vision/images.py`); a batch with any other of them is left to TRL's dense path.
VISION_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
    "num_images",
    "num_tiles",
)


def has_vision_inputs(batch: dict) -> bool:
    """Whether a TRL batch carries any vision-language input."""
    return any(batch.get(key) is not None for key in VISION_KEYS)


def num_rows(batch: dict) -> int:
    """Rows of a TRL batch (its `prompt_ids` rows)."""
    return len(batch["prompt_ids"])


@dataclass
class Layout:
    """Where each row's scored completion tokens sit in its unpadded sequence.

    Row `i` has `P_i` prompt and `C_i` completion tokens; the sequence is its `P_i + C_i` real tokens, and its
    completion's log-probs are the last `C_i` of the sequence (the engine's `n_scored`): completion column `j < C_i`
    is the `j`-th of them.

    Args:
        seqs (`list[torch.LongTensor]`): row `i`'s real tokens, shape `(P_i + C_i,)`, on CPU.
        lengths (`list[int]`): `C_i`.
        width (`int`): `T`, the number of completion columns.
    """

    seqs: list[torch.Tensor]
    lengths: list[int]
    width: int

    @classmethod
    def from_padded(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> Layout | None:
        """From `input_ids`/`attention_mask` of shape `(B, P + T)` with `T = logits_to_keep`.

        Returns None for a mask that is not `[0..0 1..1 | 1..1 0..0]` per row, or a row that scores a completion token
        without any prompt token before it: TRL's dense path handles those.
        """
        ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
        width = logits_to_keep
        prompt_width = ids.size(1) - width
        prompt, completion = mask[:, :prompt_width], mask[:, prompt_width:]  # (B, P), (B, T)
        p, c = prompt.sum(1), completion.sum(1)  # (B,), (B,)
        if not torch.equal(prompt, torch.arange(prompt_width) >= (prompt_width - p)[:, None]):
            return None
        if not torch.equal(completion, torch.arange(width) < c[:, None]):
            return None
        if ((p == 0) & (c > 0)).any():
            return None
        p, c = p.tolist(), c.tolist()
        seqs = [ids[i, prompt_width - p[i] : prompt_width + c[i]] for i in range(len(p))]
        return cls(seqs, c, width)

    @classmethod
    def from_batch(cls, batch: dict) -> Layout | None:
        """From a TRL batch's `prompt_ids`/`prompt_mask` `(B, P)` and `completion_ids`/`completion_mask` `(B, T)`."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        return cls.from_padded(input_ids, attention_mask, batch["completion_ids"].size(1))

    def gather(self, values: list[torch.Tensor], device) -> torch.Tensor:
        """TRL's `(B, T)` per-token tensor from per-sequence vectors whose last `C_i` values are row `i`'s (zeros in
        the padding columns)."""
        dtype = values[0].dtype if values else torch.float32
        out = torch.zeros(len(self.seqs), self.width, dtype=dtype, device=device)  # (B, T)
        for i, n in enumerate(self.lengths):
            if n:
                out[i, :n] = values[i][-n:]
        return out


def sequences(batch: dict) -> list[torch.Tensor]:
    """Each row's unpadded prompt + completion tokens (1-D, CPU), for any 0/1 masks (not only TRL's padding sides)."""
    prompt, prompt_mask = batch["prompt_ids"].cpu(), batch["prompt_mask"].cpu().bool()
    completion, completion_mask = batch["completion_ids"].cpu(), batch["completion_mask"].cpu().bool()
    return [torch.cat([p[m], c[n]]) for p, m, c, n in zip(prompt, prompt_mask, completion, completion_mask)]


def take_rows(batch: dict, rows: torch.Tensor) -> dict:
    """Rows `rows` of every per-row entry of a TRL batch, as `trl.trainer.utils.split_tensor_dict` slices them.

    Args:
        batch (`dict`): per-row tensors (first dimension `B`) and lists of length `B`; 0-d tensors (e.g.
            `num_items_in_batch`), None and other values are kept as they are.
        rows (`torch.LongTensor` of shape `(n,)`): row indices, in the order wanted.
    """
    n = num_rows(batch)
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == n:
            out[key] = value[rows.to(value.device)]
        elif isinstance(value, list) and len(value) == n:
            out[key] = [value[i] for i in rows.tolist()]
        else:
            out[key] = value
    return out


def group_ids(process_index: int, rows: int, num_generations: int) -> torch.Tensor:
    """Global prompt-group id of each of a process's `rows` generation rows, shape `(rows,)`.

    TRL's sampler yields each prompt `num_generations` times in a row and hands process `r` the `r`-th slice of
    `rows` rows of the global batch, so global row `r * rows + j` belongs to group `(r * rows + j) // num_generations`
    (a group may straddle two processes).
    """
    return (process_index * rows + torch.arange(rows)) // num_generations
