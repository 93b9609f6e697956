r"""The walk's inputs adapter for a vision-language model: the embeddings and position ids of the tokens it forwards.

The dense forward of a Qwen2-VL row runs the vision tower on the row's images, scatters the output into the
embeddings of the image tokens and numbers the row with M-RoPE (three position ids per token). Over a prefix tree the
same work is done once per distinct image and once per tree token:

```
            dense (G rows of one prompt)              DTA (the prompt's tree)
tower       G x encode(image)                         1 x encode(image)      -> embeddings E (n_image_tokens, hidden)
embeddings  G x [text | E | text]                     tree tokens: text ids looked up, image keys -> rows of E
positions   G x get_rope_index(row)                   (3, n_tree_tokens), each tree token numbered once
backward    G x back-propagation through the tower    1 x, with the gradients of all G rows summed on E
```

[`VisionInputs`] runs the tower when the call begins (with grad when it trains), keeps its output `E` and hands the
walk a gradient sink in its place (a detached copy that requires grad, as the walk's own keys/values: every
backward of the walk adds its part into `sink.grad`); [`VisionInputs.backward`], after the walk, back-propagates the
sum through the tower once. The walk calls the adapter with the ids it forwards (image tokens keyed,
`images.key_images`) and their flat tree-token indices and passes the result to the model instead of `input_ids` and
`position_ids`; the attention's own positions (depths) are untouched, since M-RoPE changes the rotation, not which
keys a query sees.

Precision: the tower runs under the walk's autocast (the dense forward's, `precision.py`); its output is cast to the
input embeddings' dtype, as the model's forward casts it (float32 under bf16 autocast over float32 weights), and the
sink has that dtype; the summed gradient is cast back to the tower's output dtype for its backward, which runs outside
autocast.
"""

from __future__ import annotations

import torch

from ..precision import Precision
from ..tree import PrefixTree
from .families import VisionSpec
from .images import ImageTable


def tree_positions(lm, spec: VisionSpec, tree: PrefixTree, table: ImageTable, device) -> torch.Tensor:
    """The model's position ids of every tree token, `(3, n_tree_tokens)`: each sequence numbered by its family's
    `rope_index` (a token's M-RoPE position depends only on the tokens before it, so sequences sharing a tree token
    agree on it) and scattered to its tree tokens. Sequences ending in the same segment are numbered once."""
    positions = torch.zeros(3, tree.n_tree_tokens, dtype=torch.long, device=device)  # (3, n_tree_tokens)
    seen = set()
    for i, end in enumerate(tree.end_segment):
        if end < 0 or end in seen:
            continue
        seen.add(end)
        keyed = tree.seqs[i]  # (len_i,)
        starts = table.starts(keyed)
        if starts:
            types = (keyed >= table.key_base).long()[None].to(device)  # (1, len_i)
            pos = spec.family.rope_index(lm, keyed[None].to(device), types, table.grid_thw[starts].to(device))[:, 0]
        else:
            pos = torch.arange(len(keyed), device=device).expand(3, -1)  # text only: M-RoPE's three equal ids
        positions[:, tree.token_index(i).to(device)] = pos.to(device)
    return positions


class VisionInputs:
    """The embeddings and position ids of the tokens one walk forwards (module docstring).

    Args:
        lm (`transformers.PreTrainedModel`): the vision-language causal LM (LoRA layers active).
        spec (`VisionSpec`): its family and image ids.
        tree (`PrefixTree`): the walked tree, over keyed sequences (`images.key_images`).
        table (`ImageTable`): the distinct images the keys stand for.
        train (`bool`): the call trains (the tower runs with grad; [`backward`] back-propagates it).
        precision (`Precision`): the autocast of the dense forward.

    Attributes:
        stats (`dict[str, int]`): `images` (distinct images encoded), `image_tokens` (their tokens), `image_rows`
            (images over all sequences: what the dense path encodes).
    """

    def __init__(self, lm, spec: VisionSpec, tree: PrefixTree, table: ImageTable, *, train: bool,
                 precision: Precision):
        self.embed = lm.get_input_embeddings()
        device = self.embed.weight.device
        self.key_base, self.image_token_id = table.key_base, spec.image_token_id
        self.precision = precision
        with torch.set_grad_enabled(train), precision.forward():
            out = spec.family.encode(lm, table.pixel_values.to(device), table.grid_thw.to(device))  # (n_tokens, d)
        self.output = out if out.requires_grad else None  # the tower's graph, back-propagated once
        self.sink = out.detach().to(self.embed.weight.dtype)  # (n_tokens, hidden), the embeddings' dtype
        if self.output is not None:
            self.sink.requires_grad_()
        self.positions = tree_positions(lm, spec, tree, table, device)  # (3, n_tree_tokens)
        self.stats = {"images": table.n_images, "image_tokens": table.n_tokens, "image_rows": table.image_rows}

    def __call__(self, ids: torch.Tensor, nodes: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's inputs for `ids` `(batch, length)` (image tokens keyed) at tree tokens `nodes`
        `(batch, length)` (`-1`: padding): `inputs_embeds` `(batch, length, hidden)` and `position_ids`
        `(3, batch, length)`."""
        image = ids >= self.key_base  # (batch, length)
        embeds = self.embed(torch.where(image, self.image_token_id, ids))  # (batch, length, hidden)
        if bool(image.any()):
            rows = self.sink[(ids - self.key_base).clamp(min=0)]  # (batch, length, hidden)
            embeds = torch.where(image[..., None], rows, embeds)
        return {"inputs_embeds": embeds, "position_ids": self.positions[:, nodes.clamp(min=0)]}

    def backward(self) -> bool:
        """Back-propagate the gradients the walk summed on the image embeddings through the tower, once. Returns
        whether a backward ran (False without grad, or when no image token received a gradient)."""
        if self.output is None or self.sink.grad is None:
            return False
        with self.precision.outside():
            torch.autograd.backward(self.output, self.sink.grad.to(self.output.dtype))
        return True
