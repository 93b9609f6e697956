"""Which layers of a model mix tokens how: softmax attention (the path's keys/values), a recurrent state, or neither.

A hybrid model interleaves attention layers with recurrent token mixers (Gated DeltaNet linear attention, Mamba2).
transformers names each layer's kind in `config.layer_types`; the kinds the engine knows:

| `layer_types` entry                    | attention | recurrent state | families                                       |
|----------------------------------------|-----------|-----------------|------------------------------------------------|
| `full_attention`, `sliding_attention`  | yes       |                 | every softmax-attention family                 |
| `linear_attention`                     |           | yes             | Qwen3.5, Qwen3-Next (Gated DeltaNet); Nemotron-H, Granite 4 hybrid, Bamba (Mamba2) |
| `hybrid`                               | yes       | yes             | Falcon-H1 (attention and Mamba2 side by side)  |
| `mlp`, `moe`                           |           |                 | Nemotron-H's position-wise blocks              |

A model without `layer_types` is all attention. [`RECURRENT_FAMILIES`] lists the model types whose recurrent layers
take their states from the cache object of the forward (`cache.get_conv_state` / `get_recurrent_state` /
`update_conv_state` / `update_recurrent_state`, the seam [`StateCarrier`] fills) and whose equivalence the tests
cover; a recurrent layer of any other family stays refused (`modeling/support.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

# Layer types whose token mixer is softmax attention through transformers' AttentionInterface, and those whose token
# mixer carries a recurrent (convolution + state-space / delta-rule) state.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "hybrid"})
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "hybrid"})

# model_type -> the recurrent token mixer of the family (for messages and the README's table).
RECURRENT_FAMILIES: dict[str, str] = {
    "qwen3_5_text": "Gated DeltaNet",
    "qwen3_next": "Gated DeltaNet",
    "nemotron_h": "Mamba2",
    "granitemoehybrid": "Mamba2",
    "bamba": "Mamba2",
    "falcon_h1": "Mamba2 (beside attention in every layer)",
}


@dataclass(frozen=True)
class LayerLayout:
    """The token mixers of a decoder, by layer index (`module.layer_idx`).

    Args:
        n_layers (`int`): decoder layers (`num_hidden_layers`).
        attention (`tuple[int, ...]`): layers with a softmax attention (they call the DTA attention once per forward).
        recurrent (`tuple[int, ...]`): layers with a recurrent state (they read and write it through the cache).
    """

    n_layers: int
    attention: tuple[int, ...]
    recurrent: tuple[int, ...] = ()

    @property
    def hybrid(self) -> bool:
        """Whether some layer carries a recurrent state (the walk then hands states along the path)."""
        return bool(self.recurrent)

    @classmethod
    def from_config(cls, config) -> LayerLayout:
        """The layout `config.layer_types` describes (all attention without it).

        Args:
            config (`transformers.PretrainedConfig`): the text config of the causal LM.
        """
        n = int(config.num_hidden_layers)
        kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * n)[:n]
        attention = tuple(i for i, kind in enumerate(kinds) if kind in ATTENTION_LAYER_TYPES)
        recurrent = tuple(i for i, kind in enumerate(kinds) if kind in RECURRENT_LAYER_TYPES)
        if not getattr(config, "layer_types", None):
            attention = tuple(range(n))
        return cls(n, attention, recurrent)
