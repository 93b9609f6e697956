"""What an engine call with images refuses, before any forward: images for a model DTA cannot run them on, images
among the scored tokens, and the lockstep walk (`refusal.py`)."""

from __future__ import annotations

from collections.abc import Sequence

from ..refusal import Blocker, refuse
from ..tree import PrefixTree
from .families import VisionSpec, image_blocker
from .images import ImageInputs, ImageTable, key_images


def _subject(lm) -> str:
    return f"Images with {type(lm).__name__} (model type '{lm.config.model_type}')"


def keyed_batch(lm, spec: VisionSpec | None, seqs, images: Sequence[ImageInputs | None] | ImageTable):
    """`(seqs, table)`: the sequences with their image tokens keyed and the distinct images (`images.key_images`),
    or as given when `images` is already the table of keyed `seqs`; refused for a model whose images DTA cannot run.

    Args:
        lm (`transformers.PreTrainedModel`): the causal LM.
        spec (`VisionSpec`, *optional*): its vision spec (`families.spec_of`).
        seqs (iterable of token ids, or `PrefixTree`): the engine call's sequences.
        images (`list[ImageInputs | None]` or `ImageTable`): one entry per sequence, or the table of keyed `seqs`.
    """
    if spec is None:
        blocker = image_blocker(lm) or Blocker("it has no vision tower (`config.vision_config`)",
                                               fix="call the engine without `images`")
        refuse(_subject(lm), [blocker])
    if isinstance(images, ImageTable):
        return seqs, images
    raw = seqs.seqs if isinstance(seqs, PrefixTree) else list(seqs)
    return key_images(raw, images, **spec.keys())


def check_call(lm, tree: PrefixTree, scored: list[int], table: ImageTable, lockstep: bool) -> None:
    """Refuse an image among the scored tokens (its key is no vocabulary entry to predict: an image in a completion,
    e.g. a tool's response, needs the dense path) and the lockstep walk (the tower runs once per call on the process's
    own images, which does not pair a sharded tower's collectives across processes)."""
    blockers = []
    for i, (seq, n) in enumerate(zip(tree.seqs, scored)):
        if n and int(seq[len(seq) - n:].max()) >= table.key_base:
            blockers.append(Blocker(
                f"`seqs[{i}]` has image tokens among its last {n} tokens, whose log-probs are scored (an image in a "
                "completion, e.g. in a tool's response)",
                fix="keep images in the prompt (the unscored tokens), or run such batches through the dense path"))
            break
    if lockstep:
        blockers.append(Blocker(
            "the lockstep walk pairs the processes' model calls, and the vision tower runs once per call on each "
            "process's own images, which does not pair a sharded tower's collectives",
            fix="leave `lockstep` unset (under FSDP2: the trainers' `dta_fsdp_schedule='window'`)"))
    refuse(_subject(lm), blockers)
