r"""The MoE load-balancing (router auxiliary) loss over a prefix tree, exactly as transformers computes it densely.

transformers' Mixture-of-Experts causal LMs (Qwen3-MoE, Mixtral, ...: `load_balancing_loss_func`, the Switch
Transformer loss) return, for a padded batch and its attention mask,

```
aux = E * sum_i f_i * P_i        f_i = 1/(L T) sum_{l,t} [i in topk_l(t)]     (routing fraction: counts, no gradient)
                                 P_i = 1/(L T) sum_{l,t} p_{l,t,i}             (mean router probability)
```

with `p_{l,t} = softmax(router logits of token t in MoE layer l)`, `topk` of that softmax, the `L` MoE layers pooled,
and `T` the batch's real tokens (attention mask 1: prompt and completion, padding excluded). TRL adds
`coef * aux` for every micro-batch it forwards. In a prefix tree a token `t` is shared: micro-batch `m` counts it
`mult_m(t)` times (the number of its sequences that contain it). As `f` carries no gradient, once every `f^m` is
known the whole term is *linear* in the router probabilities:

```
sum_m coef_m * aux_m = sum_t sum_l < p_{l,t}, w_t >        w_t = E * sum_m coef_m * mult_m(t) * f^m / (L T_m)
```

so each forward of the walk adds `sum <p, w>` over its own tokens to what it back-propagates, and every token's
router gradient is the dense one (`test_router_loss.py` checks it against transformers' function on the padded
batches). The catch is `f`: it needs every token of the micro-batch, while the walk back-propagates its first leaf
before it has forwarded the last. So the engine first runs a **counting pass**, a no-grad forward over the tree without
the LM head (each tree token once), which records every token's top-k counts and probability sums; from them come the
`f^m`, the weights `w` and the value of each `aux_m` (what TRL logs). Keeping `f` symbolic instead would need one
gradient accumulator per expert and micro-batch; collecting counts during the training walk is too late for the first
backward. The pass costs one forward over the tree tokens (about a third of the forward + backward).

Router logits are captured with forward hooks on the routers (`modeling/routers.py`: the families, the capture).
Precision: the probabilities are `softmax(logits)` in the dtype transformers uses (the same call under the same
autocast), the counts, sums and weights in float32 (float64 for a float64 model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import _checks
from ..modeling.routers import RouterCapture, RouterSpec
from ..precision import acc_dtype
from ..refusal import TRAINER_CONFIG, Blocker, refuse
from ..tree import PrefixTree

# A router loss DTA cannot follow during a call: the subject and the fix of its refusal.
_SUBJECT = "This model's MoE load-balancing loss"
_FIX = {"router_aux_loss_coef": 0.0}


@dataclass
class LoadBalancing:
    """A request for `sum_m coefs[m] * aux_m`, the load-balancing loss of each group of sequences (TRL: each
    micro-batch of the forest) computed as transformers computes it on that group's padded batch.

    Args:
        groups (`list[list[int]]`): the sequences of each group (indices into the engine call's sequences).
        coefs (`list[float]`): the weight of each group's loss in what is back-propagated (TRL's
            `router_aux_loss_coef` times its gradient-accumulation scaling).
    """

    groups: list[list[int]]
    coefs: list[float]

    def check(self, n_sequences: int) -> None:
        """Refuse malformed groups or weights, naming the argument."""
        if len(self.groups) != len(self.coefs):
            raise ValueError(
                f"`router_loss`: {len(self.groups)} groups but {len(self.coefs)} coefficients; pass one per group."
            )
        for m, (group, coef) in enumerate(zip(self.groups, self.coefs)):
            for i in group:
                _checks.check_int(f"router_loss.groups[{m}]", i, minimum=0)
                if i >= n_sequences:
                    raise ValueError(f"`router_loss.groups[{m}]` names sequence {i} of {n_sequences}.")
            if not math.isfinite(float(coef)):
                raise ValueError(f"`router_loss.coefs[{m}]` must be finite, got {coef}.")


@dataclass
class RouterCounts:
    """The counting pass's record: per tree token, summed over the MoE layers, its top-k counts and probabilities.

    Args:
        counts (`torch.Tensor` of shape `(n_tree_tokens, n_experts)`): `sum_l [i in topk_l(t)]`.
        probs (`torch.Tensor` of shape `(n_tree_tokens, n_experts)`): `sum_l p_{l,t,i}`.
        seen (`torch.BoolTensor` of shape `(n_tree_tokens,)`): tokens forwarded so far.
        n_layers (`int`): MoE layers per forward (`L`); 0 before the first forward.
    """

    counts: torch.Tensor
    probs: torch.Tensor
    seen: torch.Tensor
    n_layers: int = 0


@dataclass
class RouterObserver:
    """What the walk calls after every forward of the decoder (`TreeWalk(router=...)`).

    In the counting pass (`weights` None) it records the forward's tokens in `record`; in the training walk it returns
    the forward's linear router term `sum_{l,t} <p_{l,t}, w_t>` (a scalar with autograd history) when grad is on.

    Args:
        capture (`RouterCapture`): the active hooks.
        spec (`RouterSpec`): the model's routers.
        record (`RouterCounts`, *optional*): counting pass: filled here.
        weights (`torch.Tensor` of shape `(n_tree_tokens, n_experts)`, *optional*): training walk: `w_t`.
    """

    capture: RouterCapture
    spec: RouterSpec
    record: RouterCounts | None = None
    weights: torch.Tensor | None = None

    def observe(self, nodes: torch.Tensor) -> torch.Tensor | None:
        """The forward's router term, or None.

        Args:
            nodes (`torch.LongTensor` of shape `(batch, length)`): each input position's flat tree-token index (`-1`
                for row padding), on the model's device.
        """
        logits = self.capture.take()
        if not logits:
            refuse(_SUBJECT, [Blocker(
                f"no {self.spec.router_class.__name__} module ran in a forward of the decoder, so DTA sees no router "
                "logits for the load-balancing loss", settings=_FIX, where=TRAINER_CONFIG)])
        flat = nodes.reshape(-1)
        real = flat >= 0
        idx = flat[real]
        if self.weights is None:
            self._count(logits, idx, real)
            return None
        if not torch.is_grad_enabled():
            return None
        w = self.weights[idx]  # (n_real, n_experts)
        term = None
        for layer_logits in logits:
            p = torch.nn.functional.softmax(layer_logits, dim=-1)[real]  # (n_real, n_experts), as transformers
            t = (p.to(w.dtype) * w).sum()
            term = t if term is None else term + t
        return term

    def _count(self, logits: list[torch.Tensor], idx: torch.Tensor, real: torch.Tensor) -> None:
        rec = self.record
        if rec.n_layers and len(logits) != rec.n_layers:
            refuse(_SUBJECT, [Blocker(
                f"the decoder ran {len(logits)} routers in one forward and {rec.n_layers} in another; the "
                "load-balancing loss needs a fixed set of MoE layers", settings=_FIX, where=TRAINER_CONFIG)])
        rec.n_layers = len(logits)
        dtype = rec.counts.dtype
        counts = torch.zeros(len(idx), self.spec.n_experts, dtype=dtype, device=rec.counts.device)
        probs = torch.zeros_like(counts)
        for layer_logits in logits:
            p = torch.nn.functional.softmax(layer_logits, dim=-1)[real]
            _, top = torch.topk(p, self.spec.top_k, dim=-1)  # (n_real, top_k)
            counts.scatter_add_(1, top, torch.ones(top.shape, dtype=dtype, device=counts.device))
            probs += p.to(dtype)
        # Assignment, not accumulation: a token forwarded twice (recompute) is still counted once.
        rec.counts[idx] = counts
        rec.probs[idx] = probs
        rec.seen[idx] = True


def multiplicities(tree: PrefixTree, groups: Sequence[Sequence[int]], device) -> torch.Tensor:
    """`mult[t, m]`: how many sequences of group `m` contain tree token `t`, shape `(n_tree_tokens, n_groups)`."""
    mult = torch.zeros(tree.n_tree_tokens, len(groups), dtype=torch.float64)
    for m, group in enumerate(groups):
        for i in group:
            mult[tree.token_index(i), m] += 1.0
    return mult.to(device)


@dataclass
class RouterWeights:
    """The counting pass turned into the training walk's weights and the groups' loss values.

    Args:
        weights (`torch.Tensor` of shape `(n_tree_tokens, n_experts)`): `w_t` (see the module docstring).
        aux (`torch.Tensor` of shape `(n_groups,)`): each group's `aux_m` (without its coefficient), detached: what
            the dense model returns as `aux_loss` for that group's padded batch.
    """

    weights: torch.Tensor
    aux: torch.Tensor


def router_weights(record: RouterCounts, tree: PrefixTree, request: LoadBalancing, n_experts: int) -> RouterWeights:
    """`w_t = E sum_m coef_m mult_m(t) f^m / (L T_m)` and `aux_m = E sum_i f^m_i P^m_i` from the counting pass."""
    if not bool(record.seen.all()):
        raise RuntimeError("the counting pass did not forward every tree token; this is a bug in trl_dta.")
    dtype = record.counts.dtype
    mult = multiplicities(tree, request.groups, record.counts.device).to(dtype)  # (n_tree_tokens, M)
    rows = max(record.n_layers, 1) * mult.sum(0).clamp(min=1.0)  # (M,): L * T_m (an empty group has no loss)
    f = mult.T @ record.counts / rows[:, None]  # (M, E)
    p = mult.T @ record.probs / rows[:, None]  # (M, E)
    aux = n_experts * (f * p).sum(-1)  # (M,)
    coefs = torch.tensor([float(c) for c in request.coefs], dtype=dtype, device=mult.device)  # (M,)
    weights = n_experts * (mult * (coefs / rows)[None, :]) @ f  # (n_tree_tokens, E)
    return RouterWeights(weights, aux)


def new_record(tree: PrefixTree, spec: RouterSpec, dtype: torch.dtype, device) -> RouterCounts:
    """An empty [`RouterCounts`] for `tree`, in the accumulation dtype of a model of `dtype`."""
    acc = acc_dtype(dtype)
    shape = (tree.n_tree_tokens, spec.n_experts)
    return RouterCounts(torch.zeros(shape, dtype=acc, device=device), torch.zeros(shape, dtype=acc, device=device),
                        torch.zeros(tree.n_tree_tokens, dtype=torch.bool, device=device))

