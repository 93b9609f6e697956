r"""The cache-shaped object a hybrid model's layers see during one DTA forward.

transformers' recurrent token mixers (`Qwen3_5GatedDeltaNet`, `NemotronHMamba2Mixer`, ...) take their states from the
forward's cache and hand their new states back to it:

```
conv_state = cache.get_conv_state(layer)             # None on an empty path: the layer starts from zeros
state      = cache.get_recurrent_state(layer)        # (batch, heads, d_k, d_v) delta-rule / (batch, heads, d_head, d_state) SSM
x          = cache.update_conv_state(x, layer, conv_kernel_size=k)   # [path's last k - 1 inputs ; x]  (batch, channels, k - 1 + L)
...                                                   # causal conv over it, the chunked scan from `state`
cache.update_recurrent_state(final_state, layer)
```

transformers' `DynamicCache` keeps those states in place (`copy_` into a static buffer), so a backward through a
prefix carried in it fails ("modified by an inplace operation"). [`StateCarrier`] keeps nothing in place: it hands
each layer the path's states (the walk's gradient sinks, broadcast to the forward's rows without a copy) and records
the new ones as ordinary tensors with autograd history, which the walk pushes on its stack as the states of the path
that now ends with this forward:

```
path:   [prompt]            -> states S_p (sinks)          children:  c1 = layer(x_c1, S_p) -> S_c1
                                                                       c2 = layer(x_c2, S_p) -> S_c2
backward:  dL/dS_p = dS_p(c1) + dS_p(c2)   (summed on the sink)  ->  injected into the prompt's graph once
```

The attention layers of the same model also call `cache.update(key, value, layer)`: the carrier returns the new
tokens' keys/values unchanged, because the DTA attention (`modeling/attention.py`) adds the path's keys/values itself.

Conv state: the last `k - 1` inputs of the path's convolution, `(1, channels, k - 1)`, zeros standing for tokens before
the first (exactly what the convolution's own zero padding means), so a segment shorter than the kernel hands its
children the tail of `[parent's state ; its inputs]`. Every recorded state belongs to the forward's whole row: the
walk records states only from a forward of one unpadded row (a segment that has children) and discards those of
batched, right-padded leaves (whose padding does enter the state, never an earlier position).

One-token forwards: with a state and one token, transformers' layers take their decoding path, which updates the
states in place (`causal_conv1d_update`, Mamba2's `selective_state_update`) and on CUDA runs inference-only kernels.
The carrier refuses that case; the walk never makes such a forward (a lone token is padded to two, a one-token
segment with children is unshared into its children, `tree.py`). `is_recording_past` answers True so that the conv
update never takes its in-place decoding branch either.
"""

from __future__ import annotations

import torch

from ..refusal import Blocker, refuse
from .layout import LayerLayout

_SUBJECT = "This hybrid model"

# The states of one recurrent layer: (conv state `(1, channels, k - 1)`, recurrent state `(1, ...)` or None).
LayerStates = tuple


class StateCarrier:
    """The `cache=` of one forward of a hybrid model (see the module docstring).

    Not a `transformers.Cache` subclass on purpose: transformers' mask builders and generation code treat a `Cache`
    as something that holds the keys of the past, which this object does not.

    Args:
        layout (`LayerLayout`): which layers are recurrent.
        path_states (`Callable[[int], LayerStates | None]`): the path's states of a layer (None on an empty path), in
            the shapes above with a batch dimension of 1.
        batch (`int`), length (`int`): the forward's rows and tokens per row.
        path_length (`int`): tokens on the path (what `get_seq_length` answers).
    """

    def __init__(self, layout: LayerLayout, path_states, batch: int, length: int, path_length: int):
        self.layout = layout
        self._path = path_states
        self.batch = batch
        self.length = length
        self.path_length = path_length
        self.conv: dict[int, torch.Tensor] = {}  # layer -> new conv state (batch, channels, k - 1)
        self.recurrent: dict[int, torch.Tensor] = {}  # layer -> new recurrent state (batch, ...)
        self.reads: set[int] = set()

    # ------------------------------------------------------------------ what the layers call

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Attention layers: the new tokens' keys/values as they are (the DTA attention holds the path's)."""
        return key_states, value_states

    def is_recording_past(self, layer_idx: int) -> bool:
        """True: keeps the layers off their in-place one-token conv update."""
        return True

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.path_length

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """0: the layers record only their final state (transformers 5.25 asks how many of the last tokens' states
        to keep for speculative decoding, and scans those tokens one at a time)."""
        return 0

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._state(layer_idx, state_idx, 0)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._state(layer_idx, state_idx, 1)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """`[path's last k - 1 inputs ; conv_states]` `(batch, channels, k - 1 + length)`; records the new tail.

        Args:
            conv_states (`torch.Tensor` of shape `(batch, channels, length)`): the forward's convolution inputs.
            conv_kernel_size (`int`): the layer's kernel `k`.
        """
        if conv_kernel_size is None:
            refuse(_SUBJECT, [Blocker(
                f"layer {layer_idx} calls `cache.update_conv_state` without `conv_kernel_size`, so DTA cannot tell how "
                "many of the path's inputs its convolution needs")])
        self._check_state_index(layer_idx, state_idx)
        prev = self.get_conv_state(layer_idx)
        full = conv_states if prev is None else torch.cat([prev.to(conv_states.dtype), conv_states], dim=-1)
        keep = conv_kernel_size - 1
        short = max(keep - full.shape[-1], 0)  # zeros stand for the tokens before the first
        tail = torch.nn.functional.pad(full, (short, 0))[..., full.shape[-1] + short - keep :]
        self.conv[layer_idx] = tail  # (batch, channels, k - 1)
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        self._check_state_index(layer_idx, state_idx)
        self.recurrent[layer_idx] = recurrent_states
        return recurrent_states

    # ------------------------------------------------------------------ what the walk reads

    def states(self) -> list[LayerStates | None]:
        """The new states, `(n_layers,)` entries: `(conv, recurrent)` for each recurrent layer, None elsewhere.

        Raises:
            `DTAUnsupportedError`: a recurrent layer did not hand its states to the carrier (it keeps them
                elsewhere, so DTA cannot carry them along the path), or a layer outside the layout did.
        """
        seen = set(self.conv) | set(self.recurrent)
        expected = set(self.layout.recurrent)
        if seen != expected:
            refuse(_SUBJECT, [Blocker(
                f"the model's recurrent layers {sorted(expected)} (by `config.layer_types`) handed states to the "
                f"forward's cache from layers {sorted(seen)}: DTA carries a layer's states along the tree only through "
                "`cache.update_conv_state` / `update_recurrent_state`")])
        out: list[LayerStates | None] = [None] * self.layout.n_layers
        for layer in self.layout.recurrent:
            out[layer] = (self.conv.get(layer), self.recurrent.get(layer))
        return out

    # ------------------------------------------------------------------ helpers

    def _check_state_index(self, layer_idx: int, state_idx: int) -> None:
        if state_idx != 0:
            refuse(_SUBJECT, [Blocker(
                f"layer {layer_idx} keeps several states in the cache (`state_idx={state_idx}`); DTA carries one conv "
                "and one recurrent state per layer")])

    def _state(self, layer_idx: int, state_idx: int, which: int) -> torch.Tensor | None:
        self._check_state_index(layer_idx, state_idx)
        states = self._path(layer_idx)
        if states is None or states[which] is None:
            return None
        if self.length == 1:
            raise RuntimeError(
                f"a one-token forward with a path state reached layer {layer_idx}: transformers' layers update states "
                "in place on that path; the DTA walk pads such forwards to two tokens. This is a bug in trl_dta."
            )
        self.reads.add(layer_idx)
        state = states[which]
        return state.expand(self.batch, *state.shape[1:])
