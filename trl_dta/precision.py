"""The precision an engine call computes in: the autocast the dense forward would run under, and where DTA converts.

A model's forward can run under autocast from two places: the caller's context (`with accelerator.autocast():`, as
TRL's `_get_per_token_logps_and_entropies` does) and the model itself, when accelerate has prepared it with mixed
precision (`Accelerator.prepare` wraps `model.forward` in `torch.autocast`; `accelerator.unwrap_model` keeps that
wrapper). The engine calls the decoder (`lm.get_decoder()`) and the LM head directly, which bypasses the wrapper, so
[`Precision.of`] reads both and every engine call enters the one the dense `model(...)` call would run under.

Under bf16 autocast over float32 weights (TRL's default: `bf16=True`, a model loaded by name), the tensors of one
layer have these dtypes, on the dense path and in DTA alike:

```
hidden states, norms, residual stream     float32
q_proj / k_proj / v_proj outputs          bfloat16 (autocast matmul)
q, k after RoPE (float32 cos/sin)         float32
v                                         bfloat16
attention inputs                          bfloat16: SDPA is on autocast's lower-precision list on CPU and CUDA, so it
                                          casts every floating non-float64 input to the autocast dtype; DTA casts
                                          q, k, v and the path's keys/values there, once (`attention_inputs`), and
                                          runs its kernels with autocast off, as SDPA's kernel runs after its cast
attention output                          bfloat16
LM-head logits                            bfloat16 tiles (TRL's fused head: `mm` in the autocast dtype), softmax
                                          statistics and log-probs float32, gradient GEMMs accumulated in float32
```

The kept path keys/values (`kv_stack.py`) stay in the dtype their layer produced them (keys float32, values bfloat16
above); their gradient sinks are float32 for half precision, so the gradients of many descendants sum in float32.
The loss and every backward run with autocast off, as TRL computes the loss outside `accelerator.autocast()` and
`accelerator.backward` runs outside it; a recomputed block's forward runs under the forward's autocast again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

_HALF = (torch.float16, torch.bfloat16)


def _wrapper_autocast(model) -> torch.autocast | None:
    """The `torch.autocast` that wraps `model.forward` (accelerate's mixed-precision wrapper), or None.

    accelerate 1.x sets `model._original_forward` and replaces `model.forward` by
    `convert_outputs_to_fp32(torch.autocast(...)(forward))`; the decorator keeps the autocast instance in its closure
    and every layer exposes the next through `__wrapped__` (functools.wraps).
    """
    if not isinstance(model, torch.nn.Module) or "_original_forward" not in vars(model):
        return None
    fn, seen = vars(model).get("forward"), set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        fn = getattr(fn, "__func__", fn)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, torch.autocast):
                return value
        fn = getattr(fn, "__wrapped__", None)
    return None


@dataclass(frozen=True)
class Precision:
    """The autocast state of the dense forward an engine call reproduces.

    Args:
        device_type (`str`): the model's device type (`"cpu"`, `"cuda"`).
        autocast_dtype (`torch.dtype`, *optional*): the autocast dtype the forward runs under, None without autocast.
        source (`str`, *optional*, defaults to `"none"`): where it comes from: `"context"` (the caller's autocast),
            `"model"` (accelerate's wrapper of the model's forward) or `"none"`.
    """

    device_type: str
    autocast_dtype: torch.dtype | None = None
    source: str = "none"

    @classmethod
    def of(cls, *models, device: torch.device) -> Precision:
        """The precision `model(...)` runs in here: the first of `models` (outermost first, e.g. a PEFT model, then its
        base model) whose forward accelerate wrapped in autocast, else the caller's autocast on `device`."""
        for model in models:
            wrapper = _wrapper_autocast(model)
            if wrapper is not None:
                enabled = wrapper._enabled and wrapper.device == device.type
                return cls(device.type, wrapper.fast_dtype if enabled else None, "model")
        if torch.is_autocast_enabled(device.type):
            return cls(device.type, torch.get_autocast_dtype(device.type), "context")
        return cls(device.type)

    def forward(self) -> contextlib.AbstractContextManager:
        """Context of the model's forward computations (the decoder, the LM head): this autocast, or none."""
        return torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    def outside(self) -> contextlib.AbstractContextManager:
        """Context of the loss and of every backward call: autocast off."""
        return torch.autocast(self.device_type, enabled=False)

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the matmuls of a model with `dtype` weights run in (float64 is never autocast)."""
        return self.autocast_dtype if self.autocast_dtype is not None and dtype != torch.float64 else dtype

    def describe(self, dtype: torch.dtype) -> str:
        """E.g. `"bfloat16 autocast over float32 weights (from the model's accelerate wrapper)"` or `"float32"`."""
        name = str(dtype).removeprefix("torch.")
        if self.autocast_dtype is None or dtype == torch.float64:
            return name
        where = {"model": " (from the model's accelerate wrapper)", "context": " (the caller's autocast)"}[self.source]
        return f"{str(self.autocast_dtype).removeprefix('torch.')} autocast over {name} weights{where}"


def attention_inputs(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """`tensors` in the dtype autocast gives `scaled_dot_product_attention` here: under autocast every floating tensor
    that is not float64 becomes the autocast dtype (SDPA is on the lower-precision list on CPU and CUDA); without
    autocast they are returned as they are. The one place DTA's attention converts its inputs."""
    first = next(t for t in tensors if t is not None)
    device = first.device.type
    if not torch.is_autocast_enabled(device):
        return list(tensors)
    dtype = torch.get_autocast_dtype(device)
    return [t if t is None or t.dtype in (dtype, torch.float64) or not t.is_floating_point() else t.to(dtype)
            for t in tensors]


def head_compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype of the LM head's logit tiles, as TRL's fused head (`trl.kernels.ChunkedLogProbFunction`) chooses it:
    the autocast dtype under autocast, else the hidden states' dtype."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def is_half(dtype: torch.dtype) -> bool:
    """Whether `dtype` is a half-precision float (float16, bfloat16), which DTA computes and sums in float32."""
    return dtype in _HALF


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype that sums and statistics over floats of `dtype` accumulate in: float64 for float64, else float32 (a
    half-precision input is widened, a float32 one kept)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
