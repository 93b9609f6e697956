"""Tiny vision-language models (Qwen2-VL, Qwen2.5-VL) for the engine and trainer tests, built offline from configs with
random weights, a batch of prompts with images, and the float64 switch their exactness tests need.

transformers' vision towers rotate their queries and keys in float32 whatever the model's dtype
(`apply_rotary_pos_emb_vision` casts q, k, cos and sin with `.float()`), so a float64 model rounds to float32 inside
every vision attention, and DTA (which sums the gradients of all the rows that show an image before back-propagating
the tower once) differs from the per-sequence oracle at that level (measured 2.6e-9 relative on the first vision
block's weights), with the algorithm exact. [`exact_vision_rope`] rotates in the input dtype for a test, as
`conftest.use_input_dtype_norms` keeps the RMSNorms (the text model's and Qwen2.5-VL's tower's) in float64.
"""

from __future__ import annotations

import contextlib

import torch
import transformers
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
from transformers.models.qwen2_vl import modeling_qwen2_vl

from trl_dta.vision import ImageInputs

VOCAB = 61
IMAGE, VIDEO, VISION_START, VISION_END = VOCAB - 3, VOCAB - 2, VOCAB - 5, VOCAB - 4
PATCH_DIM = 3 * 1 * 2 * 2  # channels x temporal patch x patch x patch

_TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
_IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END)
# family -> (config class, model class, vision config): 2x2 patches of 3 channels, merged 2x2 into one token; the
# Qwen2.5-VL tower with a window of 4 pixels (one merged token) in its first block and full attention in its second.
VLM_FAMILIES = {
    "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration,
                 dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2,
                      spatial_merge_size=2, temporal_patch_size=1)),
    "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration,
                   dict(depth=2, hidden_size=16, out_hidden_size=32, intermediate_size=24, num_heads=2, patch_size=2,
                        spatial_merge_size=2, temporal_patch_size=1, window_size=4, fullatt_block_indexes=[1])),
}


def make_vlm(family: str, dtype=torch.float64, seed: int = 0, **text_overrides):
    """A tiny vision-language model of `family` with random weights (perturbed, so norm weights matter too)."""
    config_cls, model_cls, vision = VLM_FAMILIES[family]
    config = config_cls(text_config={**_TEXT, **text_overrides}, vision_config=dict(vision), **_IDS)
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(dtype)


def _rotate_in_input_dtype(q, k, cos, sin):
    """`apply_rotary_pos_emb_vision` without its float32 round trip."""
    cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
    rotate = modeling_qwen2_vl.rotate_half
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


@contextlib.contextmanager
def exact_vision_rope():
    """Within the block, the Qwen2-VL and Qwen2.5-VL towers rotate q and k in their own dtype (module docstring)."""
    modules = (modeling_qwen2_vl, modeling_qwen2_5_vl)
    saved = [m.apply_rotary_pos_emb_vision for m in modules]
    try:
        for m in modules:
            m.apply_rotary_pos_emb_vision = _rotate_in_input_dtype
        yield
    finally:
        for m, fn in zip(modules, saved):
            m.apply_rotary_pos_emb_vision = fn


def image(height: int, width: int, generator: torch.Generator, dtype=torch.float64) -> ImageInputs:
    """One random image of `height x width` patches (`height * width / 4` tokens)."""
    pixels = torch.randn(height * width, PATCH_DIM, generator=generator, dtype=dtype)
    return ImageInputs(pixels, torch.tensor([[1, height, width]]))


def both(a: ImageInputs, b: ImageInputs) -> ImageInputs:
    """Two images in one prompt."""
    return ImageInputs(torch.cat([a.pixel_values, b.pixel_values]), torch.cat([a.grid_thw, b.grid_thw]))


def placeholder(inputs: ImageInputs, j: int = 0) -> list[int]:
    """The processor's ids of image `j`: `<vision_start>`, one `<image_pad>` per token, `<vision_end>`."""
    return [VISION_START] + [IMAGE] * (int(inputs.grid_thw[j].prod()) // 4) + [VISION_END]


def image_batch(seed: int = 0, dtype=torch.float64) -> tuple[list[torch.Tensor], list[ImageInputs | None]]:
    """A GRPO-shaped batch with images: three groups of three completions (prompts with image A, with image B of
    another size after the same text, and A again in a group of its own), a text-only sequence, and a prompt with two
    images; completions of 2-4 tokens. Returns the sequences and each one's images."""
    g = torch.Generator().manual_seed(seed)
    a, b = image(4, 4, g, dtype), image(4, 6, g, dtype)
    seqs, images = [], []
    for inputs in (a, b, a):
        prompt = [1, 5, 6] + placeholder(inputs) + [7, 8, 9]
        for k in range(3):
            seqs.append(torch.tensor(prompt + torch.randint(3, 50, (2 + k,), generator=g).tolist()))
            images.append(inputs)
    seqs.append(torch.tensor([1, 5, 6, 7, 8]))
    images.append(None)
    two = both(a, b)
    seqs.append(torch.tensor([1, 5] + placeholder(two, 0) + [6] + placeholder(two, 1) + [9, 10, 11]))
    images.append(two)
    return seqs, images


def dense_inputs(seq: torch.Tensor, inputs: ImageInputs | None) -> dict:
    """The stock model's image arguments for one unpadded sequence (its oracle forward)."""
    if inputs is None:
        return {}
    return dict(pixel_values=inputs.pixel_values, image_grid_thw=inputs.grid_thw,
                mm_token_type_ids=(seq == IMAGE).long()[None])
