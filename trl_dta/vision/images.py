r"""A batch's images as tree tokens: every image token keyed by the image it shows, so the prefix tree shares it.

A vision-language processor writes an image into the prompt as a run of placeholder tokens, one per merged patch
(`<|image_pad|>` x `t h w / merge^2` for Qwen2-VL), and the model replaces their embeddings by the vision tower's
output. Two prompts with the same text and different images have the same token ids, so a tree keyed on ids would
share tokens that differ. [`key_images`] therefore renames each image token to a *key* above the vocabulary: token
`k` of distinct image `j` becomes `vocab_size + offsets[j] + k`. The keys of equal images (same grid, same pixel
values, compared element by element where they live) are equal, those of different images are not, and the prefix
tree of the keyed sequences shares exactly what the model computes identically:

```
ids      <s> <v> P P P P </v> how many ? | 3 <e>        P = <|image_pad|>, one per merged patch
keyed    <s> <v> 61 62 63 64 </v> how many ? | 3 <e>   image 0 (4 tokens): keys vocab + 0 .. vocab + 3
another  <s> <v> 65 66 67 68 </v> how many ? | 1 <e>   image 1, other pixels: other keys, no sharing past <v>
```

The [`ImageTable`] lists the distinct images once (their patches and grids, the vision tower's input) with the key
range of each; `vision/inputs.py` runs the tower once per distinct image and maps keys back to its embeddings.

[`row_images`] reads a TRL batch's vision inputs (TRL 1.16's layout: `pixel_values` of all rows' images concatenated,
`image_grid_thw` one row per image, `num_images` per row) into one [`ImageInputs`] per row. Nothing here imports TRL
or transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..batch import VISION_KEYS

# The vision inputs of TRL's batches that the keyed path reads (Qwen2-VL-style: patches, grids and image counts;
# `mm_token_type_ids` marks the placeholders the ids already show). A batch with any other vision key (tiles, image
# sizes, bidirectional token types) is left to TRL's dense path.
SUPPORTED_KEYS = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")


@dataclass(frozen=True)
class ImageInputs:
    """One sequence's images, as the processor gives them, in the order their placeholder runs appear.

    Args:
        pixel_values (`torch.Tensor` of shape `(n_patches, patch_dim)`): the images' patches, concatenated.
        grid_thw (`torch.LongTensor` of shape `(n_images, 3)`): each image's patch grid (temporal, height, width);
            image `j` holds `grid_thw[j].prod()` patches and `grid_thw[j].prod() / merge_size**2` tokens.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor

    def __post_init__(self):
        if self.grid_thw.ndim != 2 or self.grid_thw.shape[-1] != 3:
            raise ValueError(f"`grid_thw` must have shape (n_images, 3), got {tuple(self.grid_thw.shape)}.")
        patches = int(self.grid_thw.prod(-1).sum())
        if self.pixel_values.ndim != 2 or self.pixel_values.shape[0] != patches:
            raise ValueError(f"`pixel_values` must have shape (n_patches, patch_dim) with n_patches = "
                             f"grid_thw.prod(-1).sum() = {patches}, got {tuple(self.pixel_values.shape)}.")

    def split(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each image's `(pixel_values (patches_j, patch_dim), grid_thw (3,))`."""
        sizes = self.grid_thw.prod(-1).tolist()
        return list(zip(self.pixel_values.split(sizes), self.grid_thw))


@dataclass
class ImageTable:
    """The distinct images of a batch and the keys of their tokens.

    Args:
        pixel_values (`torch.Tensor` of shape `(n_patches, patch_dim)`): the distinct images' patches, concatenated
            (the vision tower's input).
        grid_thw (`torch.LongTensor` of shape `(n_images, 3)`): their grids.
        offsets (`list[int]`): `(n_images + 1,)` image `j`'s tokens are keys `key_base + offsets[j] ..
            key_base + offsets[j + 1] - 1`, in the order the tower outputs them.
        key_base (`int`): the first key, the vocabulary size (ids below it are text tokens).
        image_rows (`int`): images over all sequences (a repeated image counted each time): what the dense path runs
            the tower on.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    offsets: list[int]
    key_base: int
    image_rows: int = 0

    @property
    def n_images(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_tokens(self) -> int:
        """Image tokens of the distinct images (the keys `key_base .. key_base + n_tokens - 1`)."""
        return self.offsets[-1]

    def starts(self, keyed: torch.Tensor) -> list[int]:
        """The distinct images whose token runs begin in `keyed` `(length,)`, in order (a sequence's images)."""
        first = {self.key_base + o: j for j, o in enumerate(self.offsets[:-1])}
        return [first[k] for k in keyed.tolist() if k in first]


def _fingerprint(pixels: torch.Tensor, grid: torch.Tensor) -> tuple:
    """A cheap key of one image, computed where its patches live (two reductions, no copy to the host): equal images
    have equal fingerprints; images with equal fingerprints are compared element by element ([`key_images`])."""
    return (tuple(grid.tolist()), pixels.dtype, float(pixels.sum()), float(pixels.abs().sum()))


def key_images(seqs: Sequence[torch.Tensor], images: Sequence[ImageInputs | None], *, image_token_id: int,
               vocab_size: int, merge_size: int) -> tuple[list[torch.Tensor], ImageTable]:
    """Rename every image token of `seqs` to its image's key (module docstring).

    Args:
        seqs (`Sequence[torch.LongTensor]`): token ids `(len_i,)`, the images' placeholders expanded as the
            processor writes them (`image_token_id` repeated once per image token).
        images (`Sequence[ImageInputs | None]`): one per sequence, its images in order (None: no image).
        image_token_id (`int`): the placeholder id (`config.image_token_id`).
        vocab_size (`int`): the text vocabulary; keys start here.
        merge_size (`int`): patches merged per token along each side (`vision_config.spatial_merge_size`).

    Returns:
        `(keyed, table)`: the keyed sequences (new tensors, CPU) and the distinct images.

    Raises:
        `ValueError`: a sequence whose placeholder count differs from its images' tokens (the model refuses it too).
    """
    if len(images) != len(seqs):
        raise ValueError(f"`images` has {len(images)} entries for {len(seqs)} sequences; pass one per sequence "
                         "(None for a sequence without images).")
    index: dict[tuple, list[int]] = {}  # fingerprint -> the distinct images with it
    pixels, grids, offsets = [], [], [0]
    keyed, rows = [], 0
    for i, (seq, inputs) in enumerate(zip(seqs, images)):
        seq = torch.as_tensor(seq).cpu()
        slots = (seq == image_token_id).nonzero().flatten()  # (n_image_tokens_i,)
        keys = []
        for pv, grid in ([] if inputs is None else inputs.split()):
            same = index.setdefault(_fingerprint(pv, grid), [])
            j = next((j for j in same if torch.equal(pixels[j], pv)), None)
            if j is None:
                j = len(grids)
                same.append(j)
                pixels.append(pv)
                grids.append(grid)
                offsets.append(offsets[-1] + int(grid.prod()) // merge_size**2)
            keys.append(torch.arange(offsets[j], offsets[j + 1]))
            rows += 1
        keys = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.long)
        if len(keys) != len(slots):
            raise ValueError(f"`seqs[{i}]` holds {len(slots)} image tokens (id {image_token_id}) but its images have "
                             f"{len(keys)} (grid_thw.prod() / {merge_size}**2 each); pass the processor's ids with "
                             "the images they were made for.")
        seq = seq.clone()
        seq[slots] = vocab_size + keys
        keyed.append(seq)
    if pixels:
        table = ImageTable(torch.cat(pixels), torch.stack(grids), offsets, vocab_size, rows)
    else:
        table = ImageTable(torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long), offsets, vocab_size, rows)
    return keyed, table


def row_images(batch: dict) -> list[ImageInputs | None] | None:
    """Each row's [`ImageInputs`] of a TRL batch (TRL 1.16: `pixel_values` `(patches, dim)` and `image_grid_thw`
    `(images, 3)` over all rows, or one tensor per row after TRL's `split_pixel_values_by_grid`; `num_images` per
    row); an empty list without vision inputs; None when the batch carries a vision input the keyed path does not
    read (`SUPPORTED_KEYS`), which TRL's dense path then runs."""
    present = [key for key in VISION_KEYS if batch.get(key) is not None]
    if not present:
        return []
    needed = ("pixel_values", "image_grid_thw", "num_images")
    if any(key not in SUPPORTED_KEYS for key in present) or any(batch.get(key) is None for key in needed):
        return None
    pixel_values, grid = batch["pixel_values"], batch["image_grid_thw"]
    if isinstance(pixel_values, list):  # one tensor per row
        pixel_values = torch.cat(pixel_values)
    if isinstance(grid, list):
        grid = torch.cat(grid)
    grid_rows = grid.cpu().split(list(batch["num_images"]))
    patch_rows = pixel_values.split([int(g.prod(-1).sum()) for g in grid_rows])
    return [ImageInputs(pv, g) if len(g) else None for pv, g in zip(patch_rows, grid_rows)]


def batch_images(seqs: Sequence[torch.Tensor], scored: Sequence[int], batch: dict,
                 keys: dict | None) -> list[ImageInputs | None] | None:
    """Each row's images of a TRL batch (None for a row without), for its unpadded rows `seqs`; None when TRL's dense
    path must run the batch: a vision input the keyed path does not read ([`row_images`]), images for a model whose
    images DTA does not run (`keys` None), or an image token among a row's scored tokens (an image in a completion: a
    tool's response).

    Args:
        seqs (`Sequence[torch.LongTensor]`): the batch's rows, unpadded (`batch.Layout`), `(len_i,)`.
        scored (`Sequence[int]`): each row's scored (completion) tokens, its last `scored[i]`.
        batch (`dict`): the TRL batch (or the vision keyword arguments of TRL's log-prob call).
        keys (`dict`, *optional*): `key_images`'s keyword arguments (`VisionSpec.keys`).
    """
    rows = row_images(batch)
    if rows is None or (rows and keys is None):
        return None
    if not rows:
        return [None] * len(seqs)
    image = keys["image_token_id"]
    if any(n and bool((seq[len(seq) - n:] == image).any()) for seq, n in zip(seqs, scored)):
        return None
    return rows


def keyed_rows(seqs: Sequence[torch.Tensor], scored: Sequence[int], batch: dict,
               keys: dict | None) -> tuple[list[torch.Tensor], ImageTable | None] | None:
    """[`batch_images`]' rows keyed ([`key_images`]) with the table of their distinct images (None for a text-only
    batch), or None where [`batch_images`] is."""
    rows = batch_images(seqs, scored, batch, keys)
    if rows is None:
        return None
    if all(row is None for row in rows):
        return list(seqs), None
    return key_images(seqs, rows, **keys)
