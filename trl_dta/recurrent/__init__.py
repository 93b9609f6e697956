"""Hybrid models: recurrent layers (Gated DeltaNet, Mamba2) walk the prefix tree with their states.

A recurrent token mixer summarises a path in a state that does not grow with it: per layer the last `k - 1` inputs
of its short convolution and the recurrent state (per head a `(d_k, d_v)` delta-rule matrix, or Mamba2's
`(d_head, d_state)` SSM state). A segment therefore needs its parent's final states, not the path's keys/values:

```
           keys/values (attention layers)       states (recurrent layers)
path   p:  K_p, V_p   (grow with the path)      S_p  (fixed size)
child  c:  attends [K_p ; K_c]                  starts from S_p, ends with S_c
```

The walk treats states like keys/values (`engine/walk.py`): pushed on the stack per frame as gradient sinks, handed
to every forward under the frame (siblings broadcast them), their summed gradients injected into the frame's own
graph once at pop. The model's own layer code runs unchanged; [`StateCarrier`] is the `cache=` it reads the path's
states from and writes its new ones to. What packed tree-masked rows cannot express (a recurrence over a tree), the
schedule does not ask for: hybrid models walk segment by segment and batch only leaves (`engine/core.py`).

Modules: `layout.py` (which layer is attention, recurrent or neither), `carrier.py` (the
cache-shaped state carrier).
"""

from .carrier import StateCarrier
from .layout import ATTENTION_LAYER_TYPES, LAYER_MIXERS, POSITION_WISE_LAYER_TYPES, RECURRENT_LAYER_TYPES, LayerLayout

__all__ = ["ATTENTION_LAYER_TYPES", "LAYER_MIXERS", "POSITION_WISE_LAYER_TYPES", "RECURRENT_LAYER_TYPES", "LayerLayout",
           "StateCarrier"]
