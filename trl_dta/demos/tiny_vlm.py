"""The embedded vision-language setup: a tiny Qwen2-VL with random weights, its processor and a shape-counting task.

Everything is built offline, in code, from fixed seeds, like the text default (`demos.tiny`), so that the VLM recipe
(`recipes/grpo_vlm.py`) and the tests run GRPO on images end to end on a CPU without downloading anything:

- the **processor**: Qwen2-VL's own (`Qwen2VLProcessor`) over the tiny character-level tokenizer with Qwen2-VL's
  chat and vision tokens added, a ChatML template, and transformers' PIL image processor (`Qwen2VLImageProcessorPil`:
  the default one needs torchvision, and PyPI's torchvision does not import beside this torch build). The processor
  takes no video processor (transformers' need torchvision too): [`ImageProcessor`] is Qwen2-VL's without it.
- the **model**: `Qwen2VLForConditionalGeneration` with a 64-wide, 2-layer text model (M-RoPE) and a 2-block vision
  tower on 4x4-pixel patches, merged 2x2 into one token: a 48x48 image is 144 patches, 36 image tokens.
- the **task**: each image shows 1 to `max_count` filled squares of one colour on white; the question is how many.
  The answer is computable from the image alone, and [`count_reward`] scores it like the arithmetic task (a number
  at all, its closeness, the exact count: `tiny.score_answer`).

A prompt is 74 tokens, 36 of them the image's; with 8 completions of at most 4 tokens each, a GRPO group's
prefix tree holds about 6x fewer tokens than TRL's dense rows, and the vision tower runs once per prompt instead of 8
times.

```
<|im_start|>user
<|vision_start|><|image_pad|> x 36<|vision_end|>how many squares?<|im_end|>
<|im_start|>assistant
3<|im_end|>
```
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from datasets import Dataset
from PIL import Image, ImageDraw
from transformers import GenerationConfig, Qwen2Tokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil, Qwen2VLProcessor

from .tiny import ALPHABET, SPECIAL_TOKENS, _byte_level, score_answer

CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_SIZE = 48
PATCH_SIZE = 4
MERGE_SIZE = 2
QUESTION = "how many squares?"
COLOURS = ((220, 40, 40), (40, 160, 40), (40, 60, 220))

# ChatML, with an image content part written as Qwen2-VL's vision tokens (the processor expands `<|image_pad|>` to one
# token per merged patch). Text content is a string or a list of text parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ImageProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor without a video processor (transformers' video processors need torchvision, which does
    not import beside this torch build). Images, text and chat templates work as in `Qwen2VLProcessor`."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def build_processor(image_size: int = IMAGE_SIZE) -> ImageProcessor:
    """The tiny processor (module docstring): the character-level vocabulary of `tiny.build_tokenizer` plus
    `<|im_start|>`, `<|im_end|>` (the end of a turn, the tokenizer's eos) and Qwen2-VL's vision tokens, a ChatML
    template, and the PIL image processor at `PATCH_SIZE`, `MERGE_SIZE`, resizing every image to `image_size` pixels
    square (a multiple of `PATCH_SIZE * MERGE_SIZE`).

    Returns:
        [`ImageProcessor`]: usable as TRL's `processing_class` (a `ProcessorMixin`: TRL then treats the model as a
        vision-language model).
    """
    factor = PATCH_SIZE * MERGE_SIZE
    if image_size % factor:
        raise ValueError(f"image_size must be a multiple of {factor} (patch {PATCH_SIZE} x merge {MERGE_SIZE}), got "
                         f"{image_size}.")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in ALPHABET:
        vocab[_byte_level(char)] = len(vocab)
    extra = [*CHAT_TOKENS, *VISION_TOKENS]
    for token in extra:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], bos_token=None, eos_token="<|im_end|>", pad_token="<pad>",
                               unk_token=None, add_bos_token=False, model_max_length=1024,
                               additional_special_tokens=extra)
    pixels = image_size * image_size
    image_processor = Qwen2VLImageProcessorPil(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2,
                                               min_pixels=pixels, max_pixels=pixels)
    return ImageProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def build_model(processor: ImageProcessor | None = None, *, hidden_size: int = 64, num_hidden_layers: int = 2,
                num_attention_heads: int = 4, num_key_value_heads: int = 2, vision_depth: int = 2,
                vision_width: int = 32, seed: int = 0, dtype: torch.dtype = torch.float32
                ) -> Qwen2VLForConditionalGeneration:
    """A tiny Qwen2-VL with random weights (seeded; the global RNG untouched), in eval mode.

    Args:
        processor ([`ImageProcessor`], *optional*): whose vocabulary and token ids the model takes; defaults to
            [`build_processor`]().
        hidden_size (`int`, *optional*, defaults to `64`), num_hidden_layers (`int`, *optional*, defaults to `2`),
        num_attention_heads (`int`, *optional*, defaults to `4`), num_key_value_heads (`int`, *optional*, defaults
            to `2`): the text model. Its M-RoPE splits each head's rotary frequencies 2:1:1 between time, height and
            width, as Qwen2-VL's `[16, 24, 24]` does roughly.
        vision_depth (`int`, *optional*, defaults to `2`), vision_width (`int`, *optional*, defaults to `32`): the
            vision tower's blocks and width (2 heads); its merger projects to `hidden_size`.
        seed (`int`, *optional*, defaults to `0`), dtype (`torch.dtype`, *optional*, defaults to `torch.float32`).
    """
    processor = processor if processor is not None else build_processor()
    tokenizer = processor.tokenizer
    head_dim = hidden_size // num_attention_heads
    quarter = head_dim // 8  # rotary pairs: head_dim / 2 = 4 quarters, time 2 and height, width 1 each
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=3 * hidden_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2 * quarter, quarter, quarter]},
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         dtype=dtype),
        vision_config=dict(depth=vision_depth, embed_dim=vision_width, hidden_size=hidden_size, num_heads=2,
                           mlp_ratio=2, patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"], dtype=dtype,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config).to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return model.eval()


def build_model_dir(path: str | Path, **model_kwargs) -> Path:
    """Writes the tiny VLM to a folder that `from_pretrained` (and TRL, which reloads the reference model from it when
    `beta > 0` without PEFT) loads by path. The processor is not saved (transformers' `AutoProcessor` cannot rebuild
    [`ImageProcessor`]): pass `build_processor()` as the trainer's `processing_class`.

    Args:
        path (`str` or `Path`): the folder (created if missing).
        **model_kwargs: passed to [`build_model`].
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_model(**model_kwargs).save_pretrained(path)
    return path


def draw_squares(count: int, rng: random.Random, image_size: int = IMAGE_SIZE) -> Image.Image:
    """An RGB image of `count` filled squares of one colour (drawn from `COLOURS`) on white, at distinct random cells
    of a 4x4 grid (so they never touch), each a little smaller than its cell."""
    cells = rng.sample(range(16), count)
    size = image_size // 4
    colour = rng.choice(COLOURS)
    image = Image.new("RGB", (image_size, image_size), "white")
    draw = ImageDraw.Draw(image)
    for cell in cells:
        x, y = (cell % 4) * size, (cell // 4) * size
        margin = rng.randint(1, max(1, size // 4))
        draw.rectangle([x + margin, y + margin, x + size - margin - 1, y + size - margin - 1], fill=colour)
    return image


def build_dataset(num_rows: int = 1024, *, max_count: int = 4, image_size: int = IMAGE_SIZE,
                  seed: int = 0) -> Dataset:
    """The shape-counting dataset: columns `prompt` (a user turn: the image, then the question, as TRL's
    vision-language prompts are written), `image` (a PIL image, [`draw_squares`]) and `answer` (the count, `"1"` ..
    `str(max_count)`).

    Args:
        num_rows (`int`, *optional*, defaults to `1024`): rows.
        max_count (`int`, *optional*, defaults to `4`): most squares in an image (1 to 16).
        image_size (`int`, *optional*, defaults to `IMAGE_SIZE`): pixels per side.
        seed (`int`, *optional*, defaults to `0`): the generator's seed.
    """
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}.")
    if not 1 <= max_count <= 16:
        raise ValueError(f"max_count must be in [1, 16] (a 4x4 grid of cells), got {max_count}.")
    rng = random.Random(seed)
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    rows = []
    for _ in range(num_rows):
        count = rng.randint(1, max_count)
        rows.append({"prompt": prompt, "image": draw_squares(count, rng, image_size), "answer": str(count)})
    return Dataset.from_list(rows)


def count_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """The counting task's reward, in TRL's reward-function signature: each completion's leading integer scored
    against the count by `tiny.score_answer` (0.1 for a number, up to 0.6 for its closeness, 0.3 for the exact count).

    Args:
        completions (`list[list[dict]]` or `list[str]`): the completions (conversational: the assistant's message).
        answer (`list[str]`): the counts (the dataset's `answer` column).
        **kwargs: TRL's other columns and extras, unused.
    """
    if len(completions) != len(answer):
        raise ValueError(f"got {len(completions)} completions but {len(answer)} answers; the dataset needs an "
                         "`answer` column.")
    texts = [c if isinstance(c, str) else str(c[-1].get("content", "")) for c in completions]
    return [score_answer(text, str(a)) for text, a in zip(texts, answer, strict=True)]
