"""Per-layer keys/values of the current root-to-leaf path.

The engine walks the prefix tree depth-first. The stack holds, for every layer, the post-RoPE keys and values of the
tokens on the current path, as a list of *frames* (one per forwarded block of a segment):

```
frame:        f0 (root, 600 tok)   f1 (turn 1, 120 tok)   f2 (turn 2, 80 tok)
keys[l]:      (1, H_kv, 600, D)    (1, H_kv, 120, D)      (1, H_kv, 80, D)     -> prefix(l): (1, H_kv, 800, D)
```

In training the frame tensors are *gradient sinks* (detached copies with `requires_grad=True`, autograd leaf tensors):
every descendant's backward accumulates its gradient into `frame.keys[l].grad`, and when the frame is popped the
engine injects that sum as the incoming gradient of the segment's own graph.

Dtypes (`precision.py`): a frame holds keys and values in the dtype their layer produced them (the model's dtype; under
bf16 autocast over float32 weights, keys float32 after RoPE and values bfloat16). Half-precision sinks are float32, so
the gradients of many descendants are summed in float32. The attention casts the path to its compute dtype (the
autocast dtype, else the model's) at each forward, as SDPA casts the dense path's keys/values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Frame:
    """Keys and values of one forwarded block.

    Args:
        keys (`list[torch.Tensor]`): per layer, shape `(1, n_kv_heads, length, head_dim)` (None for a layer without
            attention).
        values (`list[torch.Tensor]`): per layer, same shape as `keys`.
        length (`int`): tokens in the block.
        states (`list[tuple | None]`, *optional*): hybrid models: per layer, the recurrent layer's
            `(conv state (1, channels, k - 1), recurrent state (1, ...))` after the block, None for other layers
            (`recurrent/carrier.py`). None for attention-only models, and for a block whose states were not kept (a
            padded leaf, which has no children to hand them to).
    """

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    length: int
    states: list[tuple | None] | None = None


class KVStack:
    """The frames of the current path, with the concatenated prefix per layer."""

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.frames: list[Frame] = []

    @property
    def length(self) -> int:
        """Tokens on the path (the position id of the next token)."""
        return sum(f.length for f in self.frames)

    def push(self, frame: Frame) -> None:
        if len(frame.keys) != self.n_layers or len(frame.values) != self.n_layers:
            raise RuntimeError(f"frame has {len(frame.keys)} layers, the stack {self.n_layers}")
        self.frames.append(frame)

    def pop(self) -> Frame:
        return self.frames.pop()

    def states(self, layer: int) -> tuple | None:
        """The path's states of recurrent `layer` (those after its last frame), or None on an empty path."""
        if not self.frames:
            return None
        states = self.frames[-1].states
        if states is None:
            raise RuntimeError(
                "a forward continues a path whose last frame kept no recurrent states (a padded leaf's); this is a "
                "bug in trl_dta."
            )
        return states[layer]

    def prefix(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Keys and values of the whole path for `layer`, each `(1, n_kv_heads, length, head_dim)`, or None if empty.

        A fresh `torch.cat` per call: the result is part of the caller's graph, so each forward owns its own
        concatenation and backward splits the gradient back onto the frames.
        """
        if not self.frames:
            return None, None
        if len(self.frames) == 1:
            return self.frames[0].keys[layer], self.frames[0].values[layer]
        keys = torch.cat([f.keys[layer] for f in self.frames], dim=2)
        values = torch.cat([f.values[layer] for f in self.frames], dim=2)
        return keys, values
