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

So DTA gathers the whole model at points every rank reaches together, the *gathered scopes*:

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
windows (the optimizer step, checkpointing) FSDP2's sharded footprint. A model whose gathered parameters and gradients
do not fit one device needs a schedule that gathers layer by layer inside the walk, which needs the ranks' walks in
lockstep; it is not offered.

The FSDP2 internals used (`FSDPModule._get_fsdp_state`, the state's `_lazy_init` and
`_root_post_backward_final_callback`, a parameter group's `post_forward_mesh_info`, `reshard_after_backward`,
`reduce_grads`, `all_reduce_grads`, `reduce_scatter_unused_params`) are those of torch 2.13's
`torch.distributed.fsdp._fully_shard`; [`check_fsdp2_api`] refuses a torch without them at construction.
"""

from __future__ import annotations

import contextlib

import torch

from .ddp import Local

_FIX = "or set `dta_enabled=False` to train with the TRL trainer's dense path."
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
        raise RuntimeError(
            f"DTA under FSDP2 drives FSDP2's gathering and gradient reduction through torch internals missing here "
            f"({missing}; written against torch 2.13, installed {torch.__version__}). Install torch 2.13, or use DDP "
            f"or DeepSpeed ZeRO-1/2, {_FIX}"
        )


def fsdp_modules(model) -> list:
    """Every FSDP2 module in `model`, root first, or [] when `model` is not sharded (yet: accelerate wraps the policy
    when training starts)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class _Gathered:
    """One gathered scope of a model: its groups' schedule flags, restored when the scope ends."""

    def __init__(self, modules, train: bool):
        self.modules = modules
        self.train = train
        groups = [g for m in modules for g in m._get_fsdp_state()._fsdp_param_groups]
        self.flags = [(g, {name: getattr(g, name) for name in _GROUP_FLAGS}) for g in groups]
        root = modules[0]
        root._get_fsdp_state()._lazy_init()  # the root is the model, whichever module the engine calls first
        root.set_reshard_after_forward(False)
        root.set_reshard_after_backward(False)
        if train:
            root.set_requires_gradient_sync(False)
        for m in modules:
            m.unshard()

    def close(self) -> None:
        """Reduce the scope's gradients (training scopes) and reshard every group."""
        root = self.modules[0]
        if self.train:
            root.set_requires_gradient_sync(True)
            root.set_reduce_scatter_unused_params(True)
            state = root._get_fsdp_state()
            state._state_ctx.is_last_backward = True
            state._root_post_backward_final_callback()  # post-backward of every group: one reduce-scatter each
        for m in self.modules:
            m.reshard()
        for group, flags in self.flags:
            for name, value in flags.items():
                setattr(group, name, value)


class FSDP2(Local):
    """DTA's gathered scopes for a model sharded with FSDP2 (see the module docstring)."""

    name = "fsdp2"

    def __init__(self):
        check_fsdp2_api()
        self._scopes: dict[int, _Gathered] = {}  # id(root module) -> its open scope

    def _open(self, model, train: bool) -> _Gathered | None:
        """Open a gathered scope on `model`; None when it is not sharded or already gathered."""
        modules = fsdp_modules(model)
        if not modules or id(modules[0]) in self._scopes:
            return None
        scope = self._scopes[id(modules[0])] = _Gathered(modules, train)
        return scope

    def _close(self, scope: _Gathered | None) -> None:
        if scope is not None:
            del self._scopes[id(scope.modules[0])]
            scope.close()

    def begin_window(self, model) -> None:
        self._open(model, train=True)

    @contextlib.contextmanager
    def micro_step(self, model):
        """Keep the window's reduction off: the HF Trainer's `no_sync` turns it back on after each micro-step."""
        modules = fsdp_modules(model)
        if modules and id(modules[0]) in self._scopes:
            modules[0].set_requires_gradient_sync(False)
        yield

    def end_window(self, model) -> None:
        modules = fsdp_modules(model)
        if modules:
            self._close(self._scopes.get(id(modules[0])))

    @contextlib.contextmanager
    def scoring(self, model):
        """Around a no-grad scoring call (TRL's `_get_per_token_logps_and_entropies`, DTA or dense path): the model
        gathered for the call unless a window holds it already."""
        scope = self._open(model, train=False) if not torch.is_grad_enabled() else None
        try:
            yield
        finally:
            self._close(scope)

    @contextlib.contextmanager
    def engine_call(self, engine, model, train: bool):
        """An engine call runs inside a gathered scope (the window or a scoring call); a call outside both (a custom
        subclass's) gets one of its own."""
        scope = self._open(model, train)
        try:
            yield
        finally:
            self._close(scope)
