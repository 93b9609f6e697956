"""vLLM for the tests (marker `vllm`): one engine per dtype per test session, built with the arguments TRL's colocate
mode passes to `vllm.LLM` plus the CPU settings (`trl_dta/trainers/vllm_cpu.py`), and handed to every trainer built
under [`VLLMEngines.shared`] instead of a new one (TRL syncs the trainer's weights into it before its first
generation, so trainers of one model shape can share it).

The model ([`build_model_dir`]): demos.tiny's Qwen2 shape and character tokenizer, 64 wide with 2 query heads and
1 key/value head, i.e. a head size of 32: vLLM's CPU attention supports 32, 64, 80, 96, 112, 128, ... (the recipe's
default 4 heads of 16 fail at the first step with "Unsupported CPU attention configuration: head_dim=16").
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from trl_dta.demos.tiny import build_default_model_dir
from trl_dta.trainers import vllm_cpu

SKIP_REASON = f"vLLM is not installed: {vllm_cpu.INSTALL}"

# The model's shape: trl_dta.demos.tiny's defaults but head size 32 (2 heads of a 64-wide model).
MODEL = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2)

# TRL 1.16's `VLLMGeneration._init_vllm` arguments (colocate mode, one process, GRPOConfig's defaults).
TRL_ENGINE = dict(tensor_parallel_size=1, gpu_memory_utilization=0.3, distributed_executor_backend="external_launcher",
                  seed=0, max_num_batched_tokens=4096, logprobs_mode="processed_logprobs", max_model_len=1024)


def build_model_dir(path: str | Path, seed: int = 0) -> Path:
    """The tests' vLLM model (see the module docstring) written to `path`."""
    return build_default_model_dir(path, seed=seed, **MODEL)


class VLLMEngines:
    """The session's engines of one model folder, one per generation dtype, built on first use."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = str(model_dir)
        self._engines: dict[torch.dtype, object] = {}

    def get(self, dtype: torch.dtype = torch.float32):
        """The engine generating in `dtype` (`vllm.LLM`, prefix caching on as vLLM's default)."""
        if dtype not in self._engines:
            from trl.trainer.utils import ensure_master_addr_port

            # what TRL sets before building its colocated engine (external launcher, one process)
            for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                os.environ.setdefault(name, value)
            ensure_master_addr_port()
            self._engines[dtype] = vllm_cpu.cpu_engine(self.model_dir, dtype, **TRL_ENGINE)
        return self._engines[dtype]

    @contextlib.contextmanager
    def shared(self, dtype: torch.dtype = torch.float32) -> Iterator[object]:
        """Trainers (TRL's or trl-dta's, `use_vllm=True, vllm_mode="colocate"`) built within take the session's engine
        of `dtype` instead of building one. Yields the engine."""
        from trl_dta.trainers import _trl

        engine = self.get(dtype)
        try:
            with _trl.vllm_engine_builder(lambda previous: lambda **kwargs: engine):
                yield engine
        finally:  # the trainers synced their weights into it: the next test starts from the folder's
            self.restore(dtype)

    def restore(self, dtype: torch.dtype = torch.float32) -> None:
        """Loads the folder's weights back into the engine of `dtype` (after a weight sync) and drops its prefix
        cache, so that what a test samples does not depend on the tests that ran before it."""
        engine = self._engines.get(dtype)
        if engine is None:
            return
        model = engine.llm_engine.model_executor.driver_worker.model_runner.model
        model.load_weights(self._folder_weights)
        engine.reset_prefix_cache()

    @functools.cached_property
    def _folder_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The folder's parameters (float32, read once)."""
        from transformers import AutoModelForCausalLM

        folder = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        return [(name, p.detach()) for name, p in folder.named_parameters()]
