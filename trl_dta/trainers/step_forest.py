"""One prefix forest per optimizer step: the micro-batches of an accumulation window, run by one engine call.

The HF `Trainer` accumulates the gradients of `gradient_accumulation_steps` micro-batches (a window) before each
optimizer step, and the parameters do not change inside a window. TRL's GRPO/RLOO trainers generate once every
`steps_per_generation * num_iterations` micro-steps and buffer the generation's micro-batches (`_buffered_inputs`,
micro-step `s` trains on `_buffered_inputs[s % steps_per_generation]`). So at the first micro-step of a window, all
the window's micro-batches up to the next generation are already known, and their gradients can be computed at once,
exactly: one forest of all their sequences, where a prompt whose completions TRL's shuffle spread over the window's
micro-batches is computed once again, as is a prefix common to the whole window (a system prompt).

```
window of 4 micro-steps, steps_per_generation = 3:

micro-step       s      s+1     s+2   | s+3 (new generation)
micro-batch      b[0]   b[1]    b[2]  | b'[0]
engine calls     one forest of b[0..2] | one forest of b'[0]
```

Each sequence keeps the objective of its own micro-batch (`losses.py`, built from that micro-batch's inputs, so every
normaliser is TRL's); the later micro-steps of the forest replay the stored log-probs through TRL's `_compute_loss`
for their logged loss and metrics and do no engine work.

Images (vision-language models): the forest's rows are keyed together (`vision.key_images`), so an image shown in
several micro-batches of the window is one set of tree tokens and one pass of the vision tower.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..batch import Layout
from ..tree import PrefixTree
from ..vision import ImageInputs, ImageTable, key_images


@dataclass(frozen=True)
class Cadence:
    """TRL's regeneration rule for GRPO/RLOO: a new generation at every `steps_per_generation * num_iterations`
    micro-steps (or when nothing is buffered yet), and micro-step `s` trains on `buffer[s % steps_per_generation]`.

    Args:
        steps_per_generation (`int`): micro-batches per generation.
        num_iterations (`int`): passes over each generation.
    """

    steps_per_generation: int
    num_iterations: int

    @property
    def generate_every(self) -> int:
        return self.steps_per_generation * self.num_iterations

    def generates(self, step: int, buffer: list | None) -> bool:
        """Whether TRL generates anew at micro-step `step`, given its `_buffered_inputs`."""
        return buffer is None or step % self.generate_every == 0

    def index(self, step: int) -> int:
        """The buffered micro-batch micro-step `step` trains on."""
        return step % self.steps_per_generation


def buffered_window(inputs: dict, buffer: list[dict] | None, step: int, remaining: int,
                    cadence: Cadence) -> tuple[list[int], list[dict]]:
    """The micro-steps of the current window, from this one on, whose micro-batches TRL has already buffered.

    Args:
        inputs (`dict`): this micro-step's micro-batch.
        buffer (`list[dict]`, *optional*): TRL's `_buffered_inputs`.
        step (`int`): this micro-step (TRL's `_step`).
        remaining (`int`): micro-steps left in the window, this one included.
        cadence ([`Cadence`]): TRL's regeneration rule.

    Returns:
        `(steps, batches)`: TRL micro-step indices and their micro-batches, this one first. Only this micro-step when
        `inputs` is not the buffered micro-batch of `step` (a `_prepare_inputs` that does not buffer like TRL's).
    """
    if buffer is None or buffer[cadence.index(step)] is not inputs:
        return [step], [inputs]
    steps = [step]
    for later in range(step + 1, step + remaining):
        if cadence.generates(later, buffer):
            break  # TRL generates anew at this micro-step
        steps.append(later)
    return steps, [inputs] + [buffer[cadence.index(s)] for s in steps[1:]]


@dataclass
class StepForest:
    """The sequences of several micro-batches as one forest, in micro-batch order.

    Args:
        steps (`list[int]`): the micro-steps (TRL's `_step`) the micro-batches belong to.
        batches (`list[dict]`): the micro-batches (TRL batches).
        layouts (`list[Layout]`): their layouts; micro-batch `k`'s row `j` is forest sequence `offsets[k] + j`.
        images (`list[list[ImageInputs | None]]`, *optional*): per micro-batch, each row's images (vision-language
            models); the forest's sequences are then keyed (`vision.key_images`, with `image_keys`).
        image_keys (`dict`, *optional*): `key_images`'s keyword arguments (`VisionSpec.keys`), with `images`.

    Attributes:
        tree (`PrefixTree`): the forest, over the keyed sequences.
        table (`ImageTable`, *optional*): the distinct images of the forest (the engine's `images`), None without.
    """

    steps: list[int]
    batches: list[dict]
    layouts: list[Layout]
    images: list[list[ImageInputs | None]] | None = None
    image_keys: dict | None = None
    offsets: list[int] = field(init=False)
    tree: PrefixTree = field(init=False)
    table: ImageTable | None = field(init=False, default=None)

    def __post_init__(self):
        self.offsets = [0]
        for layout in self.layouts:
            self.offsets.append(self.offsets[-1] + len(layout.seqs))
        seqs = [seq for layout in self.layouts for seq in layout.seqs]
        if self.images is not None:
            seqs, self.table = key_images(seqs, [row for rows in self.images for row in rows], **self.image_keys)
        self._seqs = seqs
        self.tree = PrefixTree.from_sequences(seqs)

    def sequences(self, k: int) -> list[torch.Tensor]:
        """Micro-batch `k`'s sequences as the forest holds them (image tokens keyed)."""
        return self._seqs[self.offsets[k] : self.offsets[k + 1]]

    @property
    def n_scored(self) -> list[int]:
        """Completion tokens of every forest sequence (the log-probs the engine projects through the LM head)."""
        return [n for layout in self.layouts for n in layout.lengths]

    def locate(self, i: int) -> tuple[int, int]:
        """`(k, j)`: forest sequence `i` is row `j` of micro-batch `k`."""
        k = bisect.bisect_right(self.offsets, i) - 1
        return k, i - self.offsets[k]

    def objective(self, terms: list[Callable]) -> Callable:
        """The forest's per-sequence loss `(i, logps_i, entropies_i) -> terms[k](j, logps_i, entropies_i)`."""

        def term(i: int, logps: torch.Tensor, entropies: torch.Tensor | None) -> torch.Tensor:
            k, j = self.locate(i)
            return terms[k](j, logps, entropies)

        return term

    def split(self, values: list[torch.Tensor], device) -> list[torch.Tensor]:
        """Per-sequence engine outputs as each micro-batch's TRL tensor of shape `(B_k, T_k)`."""
        return [layout.gather(values[lo:hi], device)
                for layout, lo, hi in zip(self.layouts, self.offsets, self.offsets[1:])]
