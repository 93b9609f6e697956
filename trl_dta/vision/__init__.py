"""Vision-language models: a GRPO batch's images in the prefix tree's shared part, the vision tower run once per
distinct image per call.

The G completions of a prompt share its image tokens (hundreds to thousands per image, the largest prefix a GRPO
batch has). Keyed by the image they show (`images.py`), they become ordinary tree tokens: shared where the images are
equal, forwarded once in the prefix. The walk asks an inputs adapter (`inputs.py`) for the embeddings and position ids
of the tokens it forwards; the adapter runs the tower once per distinct image, hands its output to the walk through a
gradient sink, numbers every tree token with the model's position scheme (Qwen2-VL's M-RoPE) and back-propagates the
summed gradients through the tower once at the end. `families.py` is the table of families and why some are refused.

Modules: `images.py` (image keys, the distinct-image table, TRL's batch layout; torch only), `families.py` (one row per
vision-language family), `checks.py` (an engine call's refusals), `inputs.py` (the walk's inputs adapter).
"""

from .checks import check_call, keyed_batch
from .families import VISION_FAMILIES, VisionFamily, VisionSpec, image_blocker, is_vision_language, spec_of
from .images import SUPPORTED_KEYS, ImageInputs, ImageTable, batch_images, key_images, keyed_rows, row_images
from .inputs import VisionInputs, tree_positions

__all__ = ["SUPPORTED_KEYS", "VISION_FAMILIES", "ImageInputs", "ImageTable", "VisionFamily", "VisionInputs",
           "VisionSpec", "batch_images", "check_call", "image_blocker", "is_vision_language", "key_images",
           "keyed_batch", "keyed_rows", "row_images", "spec_of", "tree_positions"]
