"""What DTA knows about each vision-language family, in one table: `VISION_FAMILIES`, keyed by the top-level
`config.model_type` (the text model's own row is in `modeling/families.py`).

A row says how to run the family's vision tower on a batch's distinct images, how its causal LM numbers positions
(Qwen2-VL's M-RoPE: three position ids per token, temporal / height / width, from `get_rope_index`), which module is
the tower (kept out of the DTA attention switch: it runs its own attention on the images), or, for a family DTA
cannot run with images, the [`Blocker`] that says why. A VLM without a row is refused with images; its text-only
calls run as any causal LM's.

| model type              | images through DTA | why not                                                          |
|-------------------------|--------------------|------------------------------------------------------------------|
| `qwen2_vl`, `qwen2_5_vl` | yes (tested)       |                                                                  |
| `qwen3_vl`, `qwen3_vl_moe` | no               | "deepstack": the tower's features are added inside decoder layers |
| `gemma3`                | no                 | image tokens attend to each other bidirectionally                |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..refusal import Blocker


@dataclass(frozen=True)
class VisionFamily:
    """One vision-language family (module docstring).

    Args:
        encode (`Callable[[lm, pixel_values, grid_thw], Tensor]`, *optional*): the tower's output for images
            (`pixel_values` `(n_patches, patch_dim)`, `grid_thw` `(n_images, 3)`): their tokens' embeddings
            `(n_image_tokens, hidden)`, image after image, as the model's forward places them.
        rope_index (`Callable[[lm, ids, types, grid_thw], Tensor]`, *optional*): the position ids `(3, 1, length)`
            of one sequence (`ids` `(1, length)`, `types` `(1, length)` 1 at image tokens, its images' grids in
            order), as the model's forward computes them.
        tower (`Callable[[lm], torch.nn.Module]`, *optional*): the vision tower.
        rule (`Blocker`, *optional*): why DTA cannot run the family's images (the other fields are then unset).
    """

    encode: Callable | None = None
    rope_index: Callable | None = None
    tower: Callable | None = None
    rule: Blocker | None = None


def _qwen_encode(lm, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    out = lm.model.get_image_features(pixel_values, grid_thw, return_dict=True)  # transformers 5.x
    return torch.cat(out.pooler_output, dim=0)


def _qwen_rope_index(lm, ids: torch.Tensor, types: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    return lm.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid_thw)[0]


_QWEN = VisionFamily(encode=_qwen_encode, rope_index=_qwen_rope_index, tower=lambda lm: lm.model.visual)
_DEEPSTACK = Blocker("its vision tower's intermediate features are added to the hidden states of the first decoder "
                     "layers at the image tokens (\"deepstack\"), which DTA's inputs adapter, placing the tower's "
                     "output in the input embeddings only, does not reproduce")

VISION_FAMILIES: dict[str, VisionFamily] = {
    "qwen2_vl": _QWEN,
    "qwen2_5_vl": _QWEN,
    "qwen3_vl": VisionFamily(rule=_DEEPSTACK),
    "qwen3_vl_moe": VisionFamily(rule=_DEEPSTACK),
    "gemma3": VisionFamily(rule=Blocker(
        "its image tokens attend to each other bidirectionally (a block mask over each image from `token_type_ids`); "
        "DTA's attention is causal")),
}


def supported_types() -> list[str]:
    """The model types whose images run through DTA."""
    return sorted(t for t, f in VISION_FAMILIES.items() if f.rule is None)


@dataclass(frozen=True)
class VisionSpec:
    """A vision-language model's family and the ids that key its images (`images.key_images`).

    Args:
        model_type (`str`): the top-level `config.model_type`.
        family (`VisionFamily`): its row.
        image_token_id (`int`): the image placeholder id.
        vocab_size (`int`): the text vocabulary (keys start here).
        merge_size (`int`): patches merged per image token along each side.
    """

    model_type: str
    family: VisionFamily
    image_token_id: int
    vocab_size: int
    merge_size: int

    def keys(self) -> dict:
        """`key_images`'s keyword arguments."""
        return dict(image_token_id=self.image_token_id, vocab_size=self.vocab_size, merge_size=self.merge_size)


def is_vision_language(lm) -> bool:
    """Whether `lm`'s config has a vision tower (`vision_config`)."""
    return getattr(lm.config, "vision_config", None) is not None


def image_blocker(lm) -> Blocker | None:
    """Why DTA cannot run `lm`'s images (None: it can, or `lm` has no vision tower)."""
    if not is_vision_language(lm):
        return None
    family = VISION_FAMILIES.get(lm.config.model_type)
    if family is None:
        return Blocker(f"it is a vision-language model (model type '{lm.config.model_type}') whose image inputs DTA "
                       f"does not know; DTA runs images of {', '.join(supported_types())}")
    return family.rule


def spec_of(lm) -> VisionSpec | None:
    """`lm`'s [`VisionSpec`], or None when it has no vision tower or DTA cannot run its images (`image_blocker`)."""
    if image_blocker(lm) is not None or not is_vision_language(lm):
        return None
    config = lm.config
    return VisionSpec(config.model_type, VISION_FAMILIES[config.model_type], int(config.image_token_id),
                      int(config.get_text_config().vocab_size), int(config.vision_config.spatial_merge_size))
