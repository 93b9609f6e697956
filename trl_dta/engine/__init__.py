"""DTAEngine: a batch of sequences run through its prefix tree, forward and backward, with dense results.

One traversal serves both entry points: [`DTAEngine.logprobs`] (no grad) and [`DTAEngine.forward_backward`]
(training). The tree (`tree.py`) stores each shared prefix once as a *segment*; the engine keeps the keys/values of
the current root-to-segment path on a stack (`kv_stack.py`) and forwards each segment with that path as its attention
prefix (`modeling/attention.py`), positions continuing the path.

Three execution modes, chosen per segment by the schedule (`schedule.py`) from the size budgets:

- **Keep** (push, then pop): forward the segment with grad, score its positions with the LM head
  (`modeling/lm_head.py`), push its keys/values, walk its children, then pop it: the gradients its descendants
  accumulated on its keys/values and log-probs are injected as the incoming gradients of its kept graph
  (`torch.autograd.backward(outputs, grads)`).
- **Block recompute** (token-wise checkpointing): a segment that would exceed `max_graph_tokens` is forwarded without
  grad in blocks of `block_size` tokens; at pop the blocks are re-forwarded with grad, last to first, each block's
  injected gradient including what later blocks sent to it.
- **Packed rows**: a leaf (a segment without children), or a subtree of at most `max_pack_tokens` tokens, runs as
  one row of a batched forward: its tokens at their depths and, for a subtree, a tree mask inside the row
  (`rows.py`); its sequences are visited and the whole batch back-propagated once.

**Sibling batching**: the small children of a segment (the rows) are sorted by size and grouped into forwards of at
most `max_batch_tokens` padded tokens; the path's keys/values are stored once and every row attends to them
(two-part attention, `modeling/attention.py`). A leaf's private suffix is thus forwarded exactly once, with grad.

**Fork logits**: the last position of a segment predicts the first token of each child; the hidden state is shared,
and the log-prob is scored once per scored child. Which positions each segment scores, and how a sequence's log-probs
are reassembled from the segments on its path, is the score plan (`plan.py`). A sequence is *visited* (its `loss_fn`
called) as soon as all the segments of its path are live; its backward stops at the gradient sinks of the path.

Every shared token is therefore forwarded once and back-propagated once (plus one re-forward in recompute mode), and
the parameter gradients are exactly those of the dense per-sequence computation.

**MoE router loss** (`router_loss.py`, `router_loss=LoadBalancing(...)`): the load-balancing loss of groups of
sequences, linear in the router probabilities once a no-grad counting pass has given each group's routing fractions;
every forward of the walk then adds its tokens' router term to what it back-propagates.

**Hybrid models** (`recurrent/`: Gated DeltaNet or Mamba2 layers beside attention): the recurrent layers' states
travel on the stack like keys/values (sinks, summed gradients injected at pop), handed to the model's own layers
through a cache-shaped carrier; the schedule walks every internal segment (no packed subtree rows, no lockstep) and
never continues a path by a lone token.

Modules: `core.py` (public class, argument checks, the model switch), `plan.py` (score plan), `schedule.py` (rows,
blocks or walk), `ops.py` (the walk's op stream, which `memory.py` replays too), `rows.py` (packed rows and their
masks), `walk.py` (execution of the op stream), `router_loss.py` (the MoE load-balancing loss over the tree).
"""

from ..modeling.families import ROUTER_LOSS_FAMILIES, TESTED_MODEL_TYPES
from .core import DTAEngine, DTAOutput
from .router_loss import LoadBalancing
from .walk import LossFn

__all__ = ["ROUTER_LOSS_FAMILIES", "TESTED_MODEL_TYPES", "DTAEngine", "DTAOutput", "LoadBalancing", "LossFn"]
