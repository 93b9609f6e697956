"""A cut of the real SmolLM2-135M-Instruct for the real-weight equivalence tests (`tests/engine/test_real_weights.py`,
`tests/trainers/test_real_weights.py`): real weights at about half the layers' cost."""

from __future__ import annotations

import torch
import transformers

# The layers of SmolLM2-135M-Instruct (30) a cut model keeps (`cut_smollm2`): the first twelve, where the residual
# stream's outlier features form, and the last two, which shape the logits. Measured on a chat prompt (largest
# magnitude of the hidden state): the full model goes 1.1 (embedding) -> 39 -> 290 -> 769 (layer 2) -> ... -> 2.5e4
# after layer 11 (a massive activation, kept to layer 28) -> 1.0e4 after layer 28, logits in [-31, 39]; the cut model
# follows it to 2.5e4 after layer 11, then 1.05e4, logits in [-37, 33]. Cuts without layers 3-10 never reach the
# massive activation (at most 1.4e3): those are not the real model's numerics.
SMOLLM2_LAYERS = (*range(12), 28, 29)


def cut_smollm2(folder, layers=SMOLLM2_LAYERS, dtype=torch.float32):
    """The real SmolLM2 with only `layers` of its decoder layers (renumbered 0..k-1), everything else real: the token
    embedding, the final norm and the head tied to the embedding (49,152 x 576). It keeps what real weights do to the
    numerics (the massive activation of layers 0-11, a real logit range over the real vocabulary, see `SMOLLM2_LAYERS`)
    at half the layers' cost; the forward and backward of every layer are the same code whatever the depth."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    keep = torch.nn.ModuleList(model.model.layers[i] for i in layers)
    for new, layer in enumerate(keep):
        layer.self_attn.layer_idx = new
    model.model.layers = keep
    model.config.num_hidden_layers = len(layers)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in layers]
    return model


@torch.no_grad()
def sample_through_eos(model, prefix: list[int], n: int, max_new_tokens: int, eos: int) -> list[list[int]]:
    """`n` completions of `prefix` sampled from `model` at temperature 1 (no top-k / top-p), each cut after its first
    `eos` (SmolLM2's `<|im_end|>`), from torch's global generator (the caller seeds it)."""
    out = model.generate(torch.tensor([prefix]), attention_mask=torch.ones(1, len(prefix), dtype=torch.long),
                         do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                         num_return_sequences=n, pad_token_id=eos)
    return [row[: row.index(eos) + 1] if eos in row else row for row in out[:, len(prefix):].tolist()]
