"""FSDP2 (`torch.distributed.fsdp.fully_shard`, accelerate's `fsdp_version: 2`) under the DTA engine.

accelerate shards a causal LM into parameter groups: one per decoder layer (transformer-layer auto wrap), the input
embeddings, a tail `[final norm, LM head]` (with LoRA the final norm stays in the root: accelerate's `_find_final_norm`
finds no norm on a `PeftModel`), and the root (what is left). FSDP2 all-gathers a group in its pre-forward hook,
frees it after the forward, gathers it again for the backward and reduce-scatters its gradient after each backward.
Under DTA that schedule fails three ways:

- The engine calls the decoder and the LM head directly, not the model's forward: the root's hook never runs, so
  groups the engine touches outside a sub-module's forward (the LM head, with LoRA the final norm) stay sharded.
- The engine runs many forward and backward calls per optimizer window (a prefix forward, its children, their
  backwards, the prefix backward, ...): `(L+1)(K+1) + L(K+1)` all-gathers and `(L+1)(K+1)` reduce-scatters for a
  prefix with `K` children and `L` layers, where dense training pays about `2L` and `L`.
- Every rank walks its own forest, so the ranks make different numbers of forward and backward calls. Collectives
  issued from inside the walk do not line up across ranks: measured here, FSDP2's own schedule inside the walk
  deadlocks (or pairs one layer's all-gather with another's, silently wrong) as soon as two ranks' trees differ.

DTA offers two schedules (`dta_fsdp_schedule`):

**`"window"` (default): the whole model gathered at points every rank reaches together.**

- the optimizer window (`begin_window` at its first micro-step, `end_window` after its last): every group gathered
  once (`reshard_after_forward=False`, `reshard_after_backward=False`), gradient reduction off
  (`requires_gradient_sync=False`), so that every engine call, TRL's generation and scoring in the window and any
  dense-path micro-step run without collectives and accumulate into the unsharded gradients; at the end FSDP2's own
  post-backward reduce-scatters each group once (`reduce_scatter_unused_params` on, so that a rank whose forest left a
  parameter without gradient still joins its reduction) and every group is resharded. **One all-gather and one
  reduce-scatter per group per optimizer window**, whatever the trees.
- each no-grad scoring call outside a window (evaluation; the reference model, which TRL shards as one root group):
  `scoring` gathers every group around TRL's `_get_per_token_logps_and_entropies`, DTA or dense path alike, and
  reshards after it: one all-gather per group per call, no reduce-scatter.

Memory during a window (`P` parameters, `P_t` trainable, `N` ranks, `b_p` / `b_g` bytes per unsharded parameter /
gradient, `b_s` per element of sharded parameter and optimizer state): `P * b_p + P_t * b_g` gathered on top of the
sharded `P / N * b_s`: the footprint of ZeRO-1/2's replicated parameters and gradients, for the window; between
windows (the optimizer step, checkpointing) FSDP2's sharded footprint.

**`"layer"`: decoder layers gathered one at a time, inside each forward and backward (models too large to hold
gathered).** The groups that are not decoder layers (the root, the input embeddings, the tail with the final norm and
the LM head, which the engine calls directly) are held gathered for the window as above; every decoder layer keeps
FSDP2's own schedule: all-gathered in its pre-forward hook, resharded after the forward (accelerate's
`fsdp_reshard_after_forward: true`), all-gathered again in its pre-backward hook, its gradient reduce-scattered after
every backward (sync stays on for the whole window, whatever `no_sync` the HF Trainer puts around a micro-step) and
accumulated into the sharded gradient. Those collectives pair across ranks only if every rank makes the same forward and
backward calls, so the engine runs in lockstep (the `lockstep` argument `engine_call` yields, `engine/walk.py`): each
engine call packs the rank's forest into batches of root-subtree rows, the ranks agree on the batch count (one
all-reduce of an int), and a rank with fewer runs idle batches; the decision between DTA and TRL's dense path
(`dta_min_compression`, an input DTA does not take) is agreed too, so that ranks never mix the two in one window or
scoring call. With `L` decoder layers, `H` other groups (`H_t` of them trainable) and `b` agreed batches in the window's
engine call(s):

    all-gathers per window     = H + 2 L b      (the engine's forwards and backwards; TRL's generation adds its own)
    reduce-scatters per window = H_t + L b

plus `L b'` all-gathers per no-grad scoring call of `b'` batches. Memory: the held groups' parameters and
gradients, one decoder layer's parameters at a time (two with FSDP2's prefetch), the sharded gradients and states,
and the activations of one batch of rows (at most `dta_max_batch_tokens`, or `dta_max_graph_tokens` in training when
set, padded tokens, except that a root subtree larger than that is a batch of its own). The price against `"window"`:
the collectives above, and siblings are not batched over a stored prefix (two-part attention): each root subtree is
one tree-masked row, its attention over the whole row (on CUDA the `math` part kernel, scores materialised per row,
unless `dta_attn_backend="triton"`, whose interval-mask kernel takes packed rows as they are).

The FSDP2 internals used (`FSDPModule._get_fsdp_state`, the state's `_lazy_init` and
`_root_post_backward_final_callback`, a parameter group's `post_forward_mesh_info`, `reshard_after_backward`,
`reduce_grads`, `all_reduce_grads`, `reduce_scatter_unused_params`) are those of torch 2.13's
`torch.distributed.fsdp._fully_shard`; [`check_fsdp2_api`] refuses a torch without them at construction.
"""

from __future__ import annotations

import contextlib

import torch

from ..refusal import DISTRIBUTED, TRAINER_ALTERNATIVE, Blocker, refuse
from .ddp import Local

_GROUP_FLAGS = ("post_forward_mesh_info", "reshard_after_backward", "reduce_grads", "all_reduce_grads",
                "reduce_scatter_unused_params")


def check_fsdp2_api() -> None:
    """Refuse, at construction, a torch whose FSDP2 lacks the internals the gathered scopes drive."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group, _fsdp_state

    missing = [name for name in ("_lazy_init", "_root_post_backward_final_callback")
               if not hasattr(_fsdp_state.FSDPState, name)]
    missing += [name for name in ("post_backward", "unshard", "reshard", "finalize_backward")
                if not hasattr(_fsdp_param_group.FSDPParamGroup, name)]
    missing += [name for name in ("_get_fsdp_state", "set_reduce_scatter_unused_params", "set_requires_gradient_sync",
                                  "set_reshard_after_forward", "set_reshard_after_backward")
                if not hasattr(FSDPModule, name)]
    if missing:
        refuse(DISTRIBUTED, [Blocker(
            f"DTA under FSDP2 drives FSDP2's gathering and gradient reduction through torch internals missing here "
            f"({missing}; written against torch 2.13, installed {torch.__version__})",
            fix="install torch 2.13, or use DDP or DeepSpeed ZeRO-1/2")], alternative=TRAINER_ALTERNATIVE)


def fsdp_modules(model) -> list:
    """Every FSDP2 module in `model`, root first, or [] when `model` is not sharded (yet: accelerate wraps the policy
    when training starts)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def decoder_layers(model) -> set[int]:
    """`id`s of the FSDP2 modules of `model` that are decoder layers (members of a `ModuleList` of its decoder)."""
    from torch.distributed.fsdp import FSDPModule

    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    if decoder is None:
        return set()
    lists = [c for c in decoder.children() if isinstance(c, torch.nn.ModuleList)]
    return {id(m) for layers in lists for m in layers if isinstance(m, FSDPModule)}


class _Gathered:
    """One scope of a model: its held groups gathered (every group with the `"window"` schedule, all but the decoder
    layers with `"layer"`), their schedule flags restored when the scope ends."""

    def __init__(self, modules, train: bool, per_layer: set[int]):
        self.modules = modules
        self.train = train
        self.held = [m for m in modules if id(m) not in per_layer]
        self.layers = [m for m in modules if id(m) in per_layer]
        groups = [g for m in modules for g in m._get_fsdp_state()._fsdp_param_groups]
        self.flags = [(g, {name: getattr(g, name) for name in _GROUP_FLAGS}) for g in groups]
        modules[0]._get_fsdp_state()._lazy_init()  # the root is the model, whichever module the engine calls first
        for m in self.held:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
        for m in self.layers:
            m.set_reduce_scatter_unused_params(True, recurse=False)  # every rank reduces every trainable parameter
        self.sync_off()
        for m in self.held:
            m.unshard()

    def sync_off(self) -> None:
        """Held groups accumulate unreduced for the scope; decoder layers reduce-scatter after every backward."""
        if self.train:
            for m in self.held:
                m.set_requires_gradient_sync(False, recurse=False)
            for m in self.layers:
                m.set_requires_gradient_sync(True, recurse=False)

    def close(self) -> None:
        """Reduce the held groups' gradients (training scopes) and reshard every group."""
        root = self.modules[0]
        if self.train:
            for m in self.held:
                m.set_requires_gradient_sync(True, recurse=False)
                m.set_reduce_scatter_unused_params(True, recurse=False)
            for m in self.layers:  # reduced after each backward already: nothing left to reduce
                m.set_reduce_scatter_unused_params(False, recurse=False)
            state = root._get_fsdp_state()
            state._state_ctx.is_last_backward = True
            state._root_post_backward_final_callback()  # post-backward of every held group: one reduce-scatter each
        for m in self.modules:
            m.reshard()
        for group, flags in self.flags:
            for name, value in flags.items():
                setattr(group, name, value)


SCHEDULES = ("window", "layer")


class FSDP2(Local):
    """DTA's schedules for a model sharded with FSDP2 (see the module docstring).

    Args:
        schedule (`str`, *optional*, defaults to `"window"`): `"window"` or `"layer"`.
        device (`torch.device`, *optional*): where the ranks' agreement tensors live (the process group's device:
            CPU for gloo, the GPU for NCCL); needed by `"layer"`.
    """

    name = "fsdp2"
    layer_schedule = "FSDP2's per-layer schedule (`dta_fsdp_schedule='layer'`)"
    window_settings = {"dta_fsdp_schedule": "window"}

    def __init__(self, schedule: str = "window", device=None):
        check_fsdp2_api()
        if schedule not in SCHEDULES:
            raise ValueError(f"`dta_fsdp_schedule` must be one of {SCHEDULES}, got {schedule!r}.")
        self.schedule = schedule
        self.lockstep = self.agreed = schedule == "layer"
        self.description = ("FSDP2, decoder layers gathered one at a time" if self.lockstep else
                            "FSDP2, the model gathered per optimizer step")
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._scopes: dict[int, _Gathered] = {}  # id(root module) -> its open scope

    def _per_layer(self, model) -> set[int]:
        return decoder_layers(model) if self.lockstep else set()

    def _open(self, model, train: bool) -> _Gathered | None:
        """Open a scope on `model`; None when it is not sharded or a scope holds it already."""
        modules = fsdp_modules(model)
        if not modules or id(modules[0]) in self._scopes:
            return None
        scope = self._scopes[id(modules[0])] = _Gathered(modules, train, self._per_layer(model))
        return scope

    def _close(self, scope: _Gathered | None) -> None:
        if scope is not None:
            del self._scopes[id(scope.modules[0])]
            scope.close()

    def _reduce(self, value: int, op) -> int:
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=op)
        return int(t.item())

    def agree_max(self, n: int) -> int:
        """The largest `n` over the ranks (the engine's `lockstep`)."""
        import torch.distributed as dist

        return self._reduce(n, dist.ReduceOp.MAX)

    def all_ranks(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (with `"layer"`: an all-reduce, so that every rank takes one path)."""
        import torch.distributed as dist

        return bool(self._reduce(int(bool(flag)), dist.ReduceOp.MIN)) if self.agreed else flag

    def begin_window(self, model) -> None:
        self._open(model, train=True)

    @contextlib.contextmanager
    def micro_step(self, model):
        """Keep the window's reduction schedule: the HF Trainer's `no_sync` turns every group's sync off and back on
        around each micro-step."""
        modules = fsdp_modules(model)
        scope = self._scopes.get(id(modules[0])) if modules else None
        if scope is not None:
            scope.sync_off()
        yield

    def end_window(self, model) -> None:
        modules = fsdp_modules(model)
        if modules:
            self._close(self._scopes.get(id(modules[0])))

    @contextlib.contextmanager
    def scoring(self, model):
        """Around a no-grad scoring call (TRL's `_get_per_token_logps_and_entropies`, DTA or dense path): the model's
        held groups gathered for the call unless a window holds them already."""
        scope = self._open(model, train=False) if not torch.is_grad_enabled() else None
        try:
            yield
        finally:
            self._close(scope)

    @contextlib.contextmanager
    def engine_call(self, model, train: bool):
        """An engine call runs inside a scope (the window or a scoring call); a call outside both (a custom
        subclass's) gets one of its own. Yields the call's `lockstep` argument: with `"layer"` on a model whose
        decoder layers are sharded one by one, `agree_max` (the call runs in lockstep with the other ranks)."""
        scope = self._open(model, train)
        try:
            yield self.agree_max if self._per_layer(model) else None
        finally:
            self._close(scope)
