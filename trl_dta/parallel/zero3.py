"""DeepSpeed ZeRO-3 under the DTA engine: the partitioned parameters gathered for the walk, the optimizer window's
gradients reduced once (`zero.Zero`'s window, DeepSpeed's `coalesce_grad_reduction`). Written against DeepSpeed 0.19.8:
its `zero.GatheredParameters`, `utils.safe_set_local_grad`, `comm.coalesced_collectives.reduce_scatter_coalesced`, and
the module hooks and coordinator of `runtime/zero/parameter_offload.py` ([`check_zero3_api`] refuses another).

ZeRO-3 gathers a module's parameters in hooks around its forward and backward, driven by a *trace*: the coordinator
records the order of module calls in a forward and backward, checks at the next root forward that every rank recorded
the same order (a collective), then prefetches by it, invalidating it when a module arrives out of order. DTA's walk
calls the decoder and its layers many times per step, in an order that depends on each rank's trees, and reads the LM
head's weight without calling the module: left as it is, the walk's calls would issue all-gathers that pair across ranks
only by chance, the recorded orders would differ, and the LM head would stay partitioned. Two schedules, chosen by a
memory budget (`dta_zero3_gather_budget_mb`, [`gathered_megabytes`]):

- `"window"` (the model's parameters and trainable gradients fit, `P b_p + P_t b_g`; or no budget): each engine call
  (the window's forest, each no-grad scoring call) runs with DeepSpeed's module hooks removed and every partitioned
  parameter gathered by one `GatheredParameters` (as TRL's `unwrap_model_for_generation` does for generation); at the
  call's end they are partitioned and the hooks registered again, which invalidates the trace (DeepSpeed re-records it
  at the next dense forward). No collective inside the walk, any order on any rank. The gradients stay local and whole
  on `.grad` until the window's reduction pass.
- `"layer"` (they do not fit): the engine calls run in lockstep over packed rows (the walk's `lockstep`, as under
  FSDP2's per-layer schedule), so DeepSpeed's own hooks gather and release each module in the forward and again in the
  backward, the same collectives on every rank. Each call starts with the trace invalidated (no prefetch by a stale
  order, nothing recorded from the walk); the LM head's parameters are gathered for the call and pinned (a marker in
  `ds_active_sub_modules`, which DeepSpeed's release checks; in some models they are the input embeddings too). The
  decoder layers' gradients are reduce-scattered during each backward ([`_LayerGradients`]) and handed to DeepSpeed
  after its reduction pass of the window (which reduces the rest: the LM head, the embeddings, the final norm).

The ranks agree on DTA or TRL's dense path for every window and scoring call (`agreed`; one integer all-reduce): both
schedules' engine calls gather, and the dense path's module hooks and the coordinator's check are collectives. Before
DeepSpeed wraps the model (the trainer's construction; `zero3_init_flag` partitions it at load), `gathered` gathers it
whole for an engine's construction probe. Memory and collective counts: `docs/distributed.md`.
"""

from __future__ import annotations

import contextlib

import torch

from ..refusal import DISTRIBUTED, TRAINER_ALTERNATIVE, Blocker, refuse
from .zero import _EXTRA, Zero, _deepspeed, check_deepspeed_api, refuse_offload

SCHEDULES = ("window", "layer")
_PIN = -1  # a pseudo module id in `ds_active_sub_modules` (DeepSpeed's ids are >= 0): the parameter stays gathered


def check_zero3_api() -> None:
    """Refuse, at construction, a DeepSpeed without the public and internal names the gathering scopes use."""
    deepspeed = _deepspeed()
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    missing = [name for name in ("GatheredParameters",) if not hasattr(deepspeed.zero, name)]
    missing += [name for name in ("safe_set_local_grad",) if not hasattr(deepspeed.utils, name)]
    missing += [name for name in ("_register_deepspeed_module", "get_param_coordinator", "release_backward_leftovers")
                if not hasattr(DeepSpeedZeRoOffload, name)]
    missing += [name for name in ("_invalidate_trace", "is_invalid_trace")
                if not hasattr(PartitionedParameterCoordinator, name)]
    if missing:
        refuse(DISTRIBUTED, [Blocker(
            f"DTA under DeepSpeed ZeRO-3 drives DeepSpeed names missing here ({missing}; written against DeepSpeed "
            f"0.19.8, installed {deepspeed.__version__})", fix=f"install DeepSpeed 0.19.8 (`{_EXTRA}`), or use ZeRO-2 "
            "or FSDP2")], alternative=TRAINER_ALTERNATIVE)


def gathered_megabytes(model, bits16: bool) -> float:
    """The memory of `model`'s parameters and trainable gradients gathered whole (`P b_p + P_t b_g`), in MiB: the
    `"window"` schedule's footprint during an engine call. `bits16`: DeepSpeed casts the module to bf16/fp16."""
    total = 0
    for p in model.parameters():
        numel = getattr(p, "ds_numel", p.numel())
        size = 2 if bits16 else p.element_size()
        total += numel * size * (2 if p.requires_grad else 1)
    return total / 2**20


def _engine_of(model, accelerator):
    """The DeepSpeed engine that partitions `model`: the policy's, or TRL's reference model (an engine of its own);
    None before DeepSpeed wraps it."""
    if hasattr(model, "zero_optimization_stage") and hasattr(model, "module"):
        return model
    wrapper = accelerator.deepspeed_engine_wrapped
    if wrapper is not None and accelerator.unwrap_model(model) is wrapper.engine.module:
        return wrapper.engine
    return None


def _offload_of(engine):
    """The `DeepSpeedZeRoOffload` of a ZeRO-3 engine (module hooks, coordinator): the training optimizer's, or an
    inference engine's optimizer slot itself (TRL's reference model)."""
    if engine is None or engine.optimizer is None:
        return None
    return getattr(engine.optimizer, "parameter_offload", engine.optimizer)


def _causal_lm(module):
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def _partitioned(params) -> list:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def _fill_missing_grads(params) -> None:
    """Zeros for gathered trainable parameters without a gradient, so that every rank reduces every one of them."""
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


class _Whole:
    """The `"window"` scope: `module` gathered whole, DeepSpeed's module hooks removed (`offload`: None when DeepSpeed
    has not wrapped it yet)."""

    def __init__(self, module, offload, train: bool):
        self.offload = offload
        self.params = list(module.parameters()) if train else []
        self.context = _deepspeed().zero.GatheredParameters(_partitioned(module.parameters()))
        self.context.__enter__()
        if offload is not None:  # as TRL's `remove_hooks` for generation
            for p in module.parameters():
                p.ds_active_sub_modules.clear()
            for hook in offload.forward_hooks + offload.backward_hooks:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []

    def close(self) -> None:
        _fill_missing_grads(self.params)
        self.context.__exit__(None, None, None)
        if self.offload is not None:  # invalidates the trace: DeepSpeed re-records it at the next dense forward
            self.offload._register_deepspeed_module(self.offload.module)


class _ByLayer:
    """The `"layer"` scope: DeepSpeed's hooks gather each module when it runs; the trace invalidated, the LM head
    gathered and pinned, and in training the decoder layers' gradients reduced after each backward (`grads`)."""

    def __init__(self, module, offload, grads: _LayerGradients | None, train: bool):
        self.offload = offload
        coordinator = offload.get_param_coordinator()
        if not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()
        lm = _causal_lm(module)
        self.held = [p for p in lm.get_output_embeddings().parameters() if hasattr(p, "ds_id")]
        for p in self.held:
            p.ds_active_sub_modules.add(_PIN)
        self.fetched = _partitioned(self.held)
        if self.fetched:
            self.fetched[0].all_gather(param_list=self.fetched)
        self.train = train
        self.handles = grads.attach(lm) if grads is not None else []

    def close(self) -> None:
        if self.train:
            _fill_missing_grads(self.held)
        for handle in self.handles:
            handle.remove()
        for p in self.held:
            p.ds_active_sub_modules.discard(_PIN)
        released = [p for p in self.fetched if not p.ds_active_sub_modules]
        if released:
            released[0].partition(param_list=released)
        self.offload.release_backward_leftovers()  # modules whose inputs needed no gradient (LoRA's first layer)


class _LayerGradients:
    """The decoder layers' gradients of one optimizer window under the `"layer"` schedule: reduce-scattered as they
    arrive (DeepSpeed's `reduce_scatter_coalesced`, its partition layout: rank `r` holds elements `[r c, (r + 1) c)` of
    the flattened parameter, `c = ceil(numel / N)`, averaged over the ranks as its own reduction does), summed in
    float32 partitions, and handed to DeepSpeed once its reduction pass has run (`hand_over`)."""

    def __init__(self, bucket_elements: int):
        self.bucket_elements = max(1, int(bucket_elements))
        self.partitions: dict[torch.nn.Parameter, torch.Tensor] = {}  # param -> (partition_numel,) float32
        self.bucket: list[torch.nn.Parameter] = []
        self.queued = False

    def attach(self, lm) -> list:
        """Hooks on every trainable parameter of `lm`'s decoder layers; returns their handles."""
        decoder = lm.get_decoder()
        layers = [m for c in decoder.children() if isinstance(c, torch.nn.ModuleList) for m in c]
        params = [p for layer in layers for p in layer.parameters() if p.requires_grad and hasattr(p, "ds_id")]
        return [p.register_post_accumulate_grad_hook(self._arrived) for p in params]

    def _arrived(self, param) -> None:
        if not self.queued:  # flush what is left when this backward ends
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
            self.queued = True
        self.bucket.append(param)
        if sum(p.grad.numel() for p in self.bucket) >= self.bucket_elements:
            self._reduce()

    def _flush(self) -> None:
        self.queued = False
        self._reduce()

    def _reduce(self) -> None:
        from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced

        bucket, self.bucket = self.bucket, []
        if not bucket:
            return
        parts = reduce_scatter_coalesced([p.grad.float() for p in bucket], bucket[0].ds_process_group)
        for p, part in zip(bucket, parts):
            total = self.partitions.get(p)
            if total is None:
                total = self.partitions[p] = torch.zeros(p.partition_numel(), dtype=torch.float32,
                                                         device=part.device)
            total[: part.numel()] += part
            p.grad = None

    def hand_over(self) -> None:
        """Write the summed partitions as DeepSpeed's reduced gradients (after its reduction pass of the step)."""
        from deepspeed.utils import safe_set_local_grad

        if self.bucket:
            raise RuntimeError("gradients left unreduced at the end of the optimizer window.")
        for p, total in self.partitions.items():
            if p.grad is not None:
                raise RuntimeError(f"parameter {p.ds_id} has a local gradient and a reduced one in one window.")
            safe_set_local_grad(p, total)
        self.partitions.clear()


class Zero3(Zero):
    """DTA's schedules for a model partitioned by DeepSpeed ZeRO-3 (see the module docstring); the optimizer window's
    single reduction is [`Zero`]'s.

    Args:
        accelerator (`accelerate.Accelerator`): the trainer's.
        schedule (`str`, *optional*, defaults to `"window"`): `"window"` or `"layer"`.
    """

    agreed = True  # every rank takes the same path (DTA or dense): the model's calls are collectives
    layer_schedule = ("ZeRO-3's per-layer schedule (the model's gathered parameters and gradients exceed "
                      "`dta_zero3_gather_budget_mb`)")
    window_settings = {"dta_zero3_gather_budget_mb": None}

    def __init__(self, accelerator, schedule: str = "window"):
        if schedule not in SCHEDULES:
            raise ValueError(f"the ZeRO-3 schedule must be one of {SCHEDULES}, got {schedule!r}.")
        super().__init__(accelerator, 3)
        self.schedule = schedule
        self.lockstep = schedule == "layer"
        self.description = ("DeepSpeed ZeRO-3, decoder layers gathered one at a time" if self.lockstep else
                            "DeepSpeed ZeRO-3, the model gathered per engine call")
        self._grads: _LayerGradients | None = None  # the open window's decoder-layer gradients (`"layer"`)
        self._scopes: dict[int, object] = {}  # id(module) -> its open gathering scope

    @classmethod
    def from_accelerator(cls, accelerator, model, budget_mb: float | None) -> Zero3:
        """The strategy for accelerate's DeepSpeed plugin at stage 3: `"window"` when `model`'s gathered parameters
        and gradients fit `budget_mb` (None: no budget), else `"layer"`; refuses offload at construction."""
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        refuse_offload(config)
        check_deepspeed_api()
        check_zero3_api()
        bits16 = any((config.get(key) or {}).get("enabled") in (True, "auto") for key in ("bf16", "fp16"))
        fits = budget_mb is None or gathered_megabytes(model, bits16) <= budget_mb
        return cls(accelerator, "window" if fits else "layer")

    def _reduce_int(self, value: int, op) -> int:
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.accelerator.device)
        dist.all_reduce(t, op=op)
        return int(t.item())

    def all_ranks(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (an all-reduce: every rank takes one path)."""
        import torch.distributed as dist

        return bool(self._reduce_int(int(bool(flag)), dist.ReduceOp.MIN))

    def agree_max(self, n: int) -> int:
        """The largest `n` over the ranks (the engine's `lockstep`)."""
        import torch.distributed as dist

        return self._reduce_int(n, dist.ReduceOp.MAX)

    # ------------------------------------------------------------------ the optimizer window

    def begin_window(self, model) -> None:
        opened = self._window is None
        super().begin_window(model)
        if opened and self._window is not None and self.lockstep:
            self._grads = _LayerGradients(self._window[0].engine.optimizer.reduce_bucket_size)

    @staticmethod
    def _fill_missing_grads(engine) -> None:
        pass  # the gathering scopes fill them while the parameters are whole

    def _reduced(self) -> None:
        grads, self._grads = self._grads, None
        if grads is not None:
            grads.hand_over()

    # ------------------------------------------------------------------ gathering

    @contextlib.contextmanager
    def _scope(self, model, by_layer: bool, train: bool):
        engine = _engine_of(model, self.accelerator)
        module = engine.module if engine is not None else self.accelerator.unwrap_model(model)
        if id(module) in self._scopes:  # a DTA scoring call inside its `scoring` scope
            yield
            return
        offload = _offload_of(engine)
        if by_layer and offload is not None:
            scope = _ByLayer(module, offload, self._grads if train else None, train)
        else:
            scope = _Whole(module, offload, train)
        self._scopes[id(module)] = scope
        try:
            yield
        finally:
            del self._scopes[id(module)]
            scope.close()

    @contextlib.contextmanager
    def gathered(self, model):
        """`model` gathered whole (an engine's construction probe)."""
        with self._scope(model, by_layer=False, train=False):
            yield

    @contextlib.contextmanager
    def scoring(self, model):
        """`"window"`: a no-grad scoring call runs on the gathered model, DTA or dense path alike; `"layer"`:
        DeepSpeed's hooks gather the dense path, `engine_call` the DTA path."""
        if torch.is_grad_enabled() or self.lockstep:
            yield
            return
        with self._scope(model, by_layer=False, train=False):
            yield

    @contextlib.contextmanager
    def engine_call(self, model, train: bool):
        """Each engine call runs in a scope (`scoring`'s, or its own); yields the call's `lockstep` argument
        (`agree_max` with `"layer"` on a model DeepSpeed wraps)."""
        by_layer = self.lockstep and _engine_of(model, self.accelerator) is not None
        with self._scope(model, by_layer=by_layer, train=train):
            yield self.agree_max if by_layer else None
