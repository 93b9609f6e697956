"""The vLLM implementation of the `Generator` protocol ([`~generation.generator.Generator`]): the policy sampled by a
vLLM engine (TRL's colocated `LLM`, `GRPOConfig(use_vllm=True, vllm_mode="colocate")`), prompts handed over as token
ids.

One `Generator` call is one `LLM.generate` call. A prompt sampled `n` times is `n` requests on the same token ids, which
is what vLLM itself makes of `SamplingParams(n=...)` (its `ParentRequest` fans out `n` child requests on one prompt);
they are submitted as such so that each request's own counters come back (an `n`-sample `RequestOutput` reports one
child's
cache hits only):

```
generator call: prompts [p0, p1], max_new_tokens [4, 7], n=2
LLM.generate([p0, p0, p1, p1], [SamplingParams(max_tokens=4), same, SamplingParams(max_tokens=7), same])
             -> [g0, g1, g2, g3]  (prompt-major, as a `Generator` returns them)
```

Shared prefixes are vLLM's automatic prefix caching: the engine hashes each full block of prompt tokens and serves a
block it already holds instead of forwarding it again, so the `n` requests of a tree node share the node's prompt and
segments, and an agent's next turn (the conversation so far, extended by the environment's reply) finds its earlier
turns cached, while the engine still holds them (it evicts least recently used blocks when full). Counted from vLLM's
own counters ([`VLLMGenerate.stats`]): `cached_tokens` (each request's `num_cached_tokens`: prompt tokens served from
the cache) and `forward_tokens` (prompt tokens vLLM computed, plus each sample's tokens but its last, which is never
forwarded).

Sampling settings are a transformers `GenerationConfig`, as for every generator, mapped onto `SamplingParams`
([`sampling_params`], the table [`SAMPLING_FIELDS`]): temperature, top-k, top-p, min-p, repetition penalty (vLLM's
counts prompt and output tokens, as transformers' does, so it is exact across a tree's branch points),
`min_new_tokens` (`min_tokens`), the stop ids (`stop_token_ids`; a sample is cut after the first, as the transformers
generators cut), `do_sample=False` (greedy: temperature 0). Fields of TRL's vLLM `generation_kwargs` (vLLM's own
`SamplingParams` arguments) are passed on as they are.

Log-probs are the sampled tokens' log-probs of the distribution they were drawn from, after temperature and the
truncations: vLLM's `processed_logprobs` mode, which TRL sets on its colocated engine (and which
[`VLLMGenerate`] requires, since raw log-probs would mean another distribution than the transformers generators').

What vLLM needs on a CPU (its key/value space, eager mode, the policy's dtype, linear weights kept for weight syncs)
is set where the engine is built (`trainers/vllm_cpu.py`), not here: this module only samples an engine it is given.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from transformers import GenerationConfig

from .generator import Generation
from .prefix_cache import CacheStats
from .sampling import _checked


def _stop_ids(value) -> list[int]:
    if value is None:
        return []
    return sorted(set(value if isinstance(value, (list, tuple)) else [value]))


# GenerationConfig field -> (SamplingParams argument, the value transformers' None means, conversion).
SAMPLING_FIELDS: dict[str, tuple[str, Any, Callable[[Any], Any]]] = {
    "temperature": ("temperature", 1.0, float),
    "top_k": ("top_k", 0, int),  # 0: no top-k, in both
    "top_p": ("top_p", 1.0, float),
    "min_p": ("min_p", 0.0, float),
    "repetition_penalty": ("repetition_penalty", 1.0, float),
    "min_new_tokens": ("min_tokens", 0, int),
    "eos_token_id": ("stop_token_ids", [], _stop_ids),
}


# GenerationConfig fields of transformers' own processors, which vLLM's SamplingParams do not have -> the value at which
# they do nothing (besides unset); set otherwise, they are refused rather than dropped.
TRANSFORMERS_ONLY = {name: None for name in (
    "sequence_bias", "bad_words_ids", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "suppress_tokens",
    "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty",
    "stop_strings", "watermarking_config", "top_h")}
TRANSFORMERS_ONLY.update(encoder_repetition_penalty=1.0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
                         guidance_scale=1.0)


def sampling_params(settings: GenerationConfig, max_tokens: int, extra: dict | None = None, seed: int | None = None):
    """vLLM's `SamplingParams` of one request: `settings` mapped through [`SAMPLING_FIELDS`], `max_tokens`, the
    sampled token's log-prob (`logprobs=0`), then `extra` (vLLM's own arguments, e.g. TRL's `generation_kwargs`) over
    them.

    Args:
        settings (`transformers.GenerationConfig`): the sampling settings; `do_sample=False` samples greedily.
        max_tokens (`int`): the request's budget.
        extra (`dict`, *optional*): `SamplingParams` arguments set as they are.
        seed (`int`, *optional*): the request's own random seed (vLLM's per-request generator).

    Returns:
        `vllm.SamplingParams`
    """
    from vllm import SamplingParams

    if getattr(settings, "output_logits", False):
        raise ValueError("vLLM returns no raw logits of the sampled tokens: generate with transformers "
                         "(`use_vllm=False`) where `output_logits=True` is needed.")
    for name, inert in TRANSFORMERS_ONLY.items():
        if getattr(settings, name, None) not in (None, inert):
            raise ValueError(f"`{name}` is a transformers `generate` setting that vLLM's `SamplingParams` do not have: "
                             "pass vLLM's own arguments in `generation_kwargs` (e.g. `logit_bias`, `bad_words`), or "
                             "generate with transformers (`use_vllm=False`).")
    kwargs: dict[str, Any] = {}
    for field, (name, unset, convert) in SAMPLING_FIELDS.items():
        value = getattr(settings, field, None)
        kwargs[name] = unset if value is None else convert(value)
    if settings.do_sample is False:
        kwargs["temperature"] = 0.0
    kwargs["min_tokens"] = min(kwargs["min_tokens"], max_tokens)
    kwargs.update(n=1, max_tokens=max_tokens, logprobs=0, seed=seed)
    kwargs.update(extra or {})
    return SamplingParams(**kwargs)


class VLLMGenerate:
    """A [`~generation.generator.Generator`] over a vLLM engine (see the module docstring).

    Unlike the transformers generators it holds no keys/values itself: the engine's prefix cache does, across
    generators and calls (so one made per rollout costs nothing), and it samples the weights the engine holds (a
    trainer syncs them before a rollout: `trl_dta.trainers.generator`).

    Args:
        llm (`vllm.LLM`): the engine, built with `logprobs_mode="processed_logprobs"` (TRL's colocated engine is).
        generation_config (`transformers.GenerationConfig`): the settings a call without `settings` samples with
            (its stop ids: `eos_token_id`).
        sampling_kwargs (`dict`, *optional*): vLLM `SamplingParams` arguments over every request's (TRL's
            `generation_kwargs` when `use_vllm=True`).
        seed (`int`, *optional*): seeds the requests (`seed + k` for the `k`-th request this generator makes), for
            reproducible samples; `None` draws from the engine's generator, as TRL does.

    Attributes:
        stats ([`~generation.CacheStats`]): `forward_calls` (`generate` calls: vLLM schedules its forwards itself),
            `forward_tokens` (prompt tokens vLLM computed plus every sampled token but each sample's last),
            `cached_tokens` (prompt tokens its prefix cache served), `peak_kv_bytes` 0 (the engine's blocks are
            preallocated).
    """

    def __init__(self, llm, generation_config: GenerationConfig, *, sampling_kwargs: dict | None = None,
                 seed: int | None = None):
        mode = getattr(llm.llm_engine.model_config, "logprobs_mode", None)
        if mode != "processed_logprobs":
            raise ValueError(f"the vLLM engine returns `{mode}`, not the log-probs of the distribution each token was "
                             "drawn from: build it with `LLM(..., logprobs_mode='processed_logprobs')` (TRL's "
                             "colocated engine is).")
        self.llm = llm
        self._config = copy.deepcopy(generation_config)
        self.sampling_kwargs = dict(sampling_kwargs or {})
        self.seed, self._requests = seed, 0
        self.stats = CacheStats(cached_tokens=0)

    @property
    def generation_config(self) -> GenerationConfig:
        """The settings a call without `settings` samples with."""
        return self._config

    def __call__(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], *, n: int = 1,
                 settings: GenerationConfig | None = None) -> list[Generation]:
        """`n` samples per prompt (the [`~generation.generator.Generator`] contract), each with its sampling
        log-probs."""
        rows, budgets = _checked(prompts, max_new_tokens, n)
        config = self._config if settings is None else settings
        stop = set(_stop_ids(config.eos_token_id))
        params = []
        for budget in budgets:
            seed = None if self.seed is None else self.seed + self._requests
            self._requests += 1
            params.append(sampling_params(config, budget, self.sampling_kwargs, seed))
        outputs = self.llm.generate([{"prompt_token_ids": row} for row in rows], sampling_params=params,
                                    use_tqdm=False)
        generations = []
        for row, output in zip(rows, outputs, strict=True):
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            end = next((k + 1 for k, token in enumerate(ids) if token in stop), len(ids))
            logprobs = [entry[token].logprob for entry, token in zip(sample.logprobs[:end], ids[:end], strict=True)]
            generations.append(Generation(ids[:end], logprobs))
            cached = output.num_cached_tokens or 0
            self.stats.cached_tokens += cached
            self.stats.forward_tokens += len(row) - cached + max(end - 1, 0)
        self.stats.forward_calls += 1
        return generations
