"""Which layers of a model mix tokens how: softmax attention (the path's keys/values), a recurrent state, or neither.

A hybrid model interleaves attention layers with recurrent token mixers (Gated DeltaNet linear attention, Mamba2).
transformers names each layer's kind in `config.layer_types`; the kinds the engine knows:

| `layer_types` entry                    | attention | recurrent state | families                                       |
|----------------------------------------|-----------|-----------------|------------------------------------------------|
| `full_attention`, `sliding_attention`  | yes       |                 | every softmax-attention family                 |
| `linear_attention`                     |           | yes             | Qwen3.5, Qwen3-Next (Gated DeltaNet); Nemotron-H, Granite 4 hybrid, Bamba (Mamba2) |
| `hybrid`                               | yes       | yes             | Falcon-H1 (attention and Mamba2 side by side)  |
| `mlp`, `moe`                           |           |                 | Nemotron-H's position-wise blocks              |

A model without `layer_types` is all attention. [`LAYER_MIXERS`] spells the table once; which families' recurrent layers
take their states from the cache object of the forward (`cache.get_conv_state` / `get_recurrent_state` /
`update_conv_state` / `update_recurrent_state`, the seam [`StateCarrier`] fills) is a column of the family table
(`modeling/families.py`, `Family.recurrent`); a recurrent layer of any other family stays refused
(`modeling/support.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

# `layer_types` entry -> the token mixers of its layers: "attention" (softmax attention through transformers'
# AttentionInterface), "recurrent" (a convolution + state-space / delta-rule state, read and written through the cache);
# neither for position-wise MLP/MoE blocks. An entry outside the table is a token mixer DTA does not know.
LAYER_MIXERS: dict[str, frozenset[str]] = {
    "full_attention": frozenset({"attention"}),
    "sliding_attention": frozenset({"attention"}),
    "linear_attention": frozenset({"recurrent"}),
    "hybrid": frozenset({"attention", "recurrent"}),
    "mlp": frozenset(),
    "moe": frozenset(),
}
ATTENTION_LAYER_TYPES = frozenset(kind for kind, mixers in LAYER_MIXERS.items() if "attention" in mixers)
RECURRENT_LAYER_TYPES = frozenset(kind for kind, mixers in LAYER_MIXERS.items() if "recurrent" in mixers)
POSITION_WISE_LAYER_TYPES = frozenset(kind for kind, mixers in LAYER_MIXERS.items() if not mixers)


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
