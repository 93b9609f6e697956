"""The `Generator` protocol: what every rollout asks of the policy, whatever samples it.

A [`Generator`] is the policy with its sampling settings, for one rollout: token ids in, sampled token ids and their
sampling log-probs out. Tree rollouts (`tree_sampling.py`, level by level), the multi-turn agent loop
(`envs/core/rollout.py`) and TRL's hooks (`trainers/tree_rollouts.py`, `envs/core/trl.py`) call only this; which
implementation runs is decided in one place (`trainers/generator.py`, from the trainer):

- [`~generation.CachedGenerate`]: transformers' `generate` over a [`~generation.PrefixCache`] (the default);
- [`~generation.reprefill_generate_fn`]: transformers' `generate` on whole prompts, no reuse.

One call is a batch of prompts, each sampled `n` times with at most its own `max_new_tokens`:

```
prompts          max_new_tokens   n=2       returned (prompt-major)
[p0 .........]   4                ->        [g0 = p0's 1st sample, g1 = p0's 2nd, g2 = p1's 1st, g3 = p1's 2nd]
[p1 ....]        7
```

- a tree level: each parent's prompt and segments, `n` = its children, one `max_new_tokens` (the segment), the
  level's `settings` (its `min_new_tokens` reduced by the tokens sampled before it);
- an agent turn: each unfinished episode's conversation, `n=1`, the tokens each has left; a later call's prompts extend
  an earlier call's prompts and samples (the environment's reply appended).

Shared prefixes are found from the token ids, as vLLM's automatic prefix caching finds them (no handle to keep): the
`n` samples of a prompt share it, and a prompt that extends an earlier prompt and sample of the same generator
continues it (its keys/values reused, its new tokens forwarded once). So a generator holds state for one rollout: make
one per rollout (it holds keys/values of the weights it was made with).

Sampling settings are transformers' `GenerationConfig` (TRL's `generation_config`): `temperature`, `top_k`, `top_p`,
`min_p`, `repetition_penalty`, `min_new_tokens`, `eos_token_id` (the stop tokens: a sample ends after the first),
... A call without `settings` samples with the generator's own ([`Generator.generation_config`]); `max_new_tokens` is
always the call's. For vLLM these are `SamplingParams(n=n, max_tokens=max_new_tokens[i], min_tokens=min_new_tokens,
temperature=..., top_p=..., top_k=..., min_p=..., stop_token_ids=eos_token_id, logprobs=0)` per prompt, the prompts
`{"prompt_token_ids": prompt}`.

Log-probs are those of the distribution each token was drawn from, after temperature, top-k, top-p and min-p (vLLM's
`processed_logprobs`, what TRL's importance sampling expects), when the settings ask for them (`output_scores=True`;
a generator's own settings do) or the implementation has them at no cost; otherwise `None`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch
    from transformers import GenerationConfig

    from .prefix_cache import CacheStats


class Generation(NamedTuple):
    """One sample: its token ids and, if the generator has them, their sampling log-probs (same length).

    Args:
        ids (`list[int]`): between 1 and the call's `max_new_tokens` ids, cut after the first stop token.
        logprobs (`list[float]`, *optional*): `(len(ids),)`, each token's log-prob under the processed distribution
            it was drawn from.
        logits (`torch.Tensor`, *optional*): `(len(ids), vocab)` float32, the raw logits each token was drawn from,
            when the settings ask for them (`output_logits=True`; transformers' generators, for tests).
    """

    ids: list[int]
    logprobs: list[float] | None
    logits: torch.Tensor | None = None


class Generator(Protocol):
    """The policy with its sampling settings, for one rollout (see the module docstring):
    `generator(prompts, max_new_tokens, *, n=1, settings=None) -> list[Generation]` samples every prompt `n` times,
    each sample at most its prompt's `max_new_tokens` tokens, with `settings` (a `GenerationConfig`) or the
    generator's own, and returns the `len(prompts) * n` samples prompt-major.

    Attributes:
        generation_config (`transformers.GenerationConfig`): the settings a call without `settings` samples with, as
            they act (the caller's over the model's own `generation_config.json`).
        stats ([`~generation.CacheStats`]): what it computed so far: `forward_calls`, `forward_tokens` (token positions
            the model forwarded), `peak_kv_bytes` (0 where the implementation cannot tell).
    """

    @property
    def generation_config(self) -> GenerationConfig: ...

    @property
    def stats(self) -> CacheStats: ...

    def __call__(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], *, n: int = 1,
                 settings: GenerationConfig | None = None) -> list[Generation]:
        """Samples every prompt `n` times.

        Args:
            prompts (`Sequence[Sequence[int]]`): token ids, unpadded; at least one.
            max_new_tokens (`Sequence[int]`): one budget per prompt (at least 1 each).
            n (`int`, *optional*, defaults to `1`): samples per prompt.
            settings (`transformers.GenerationConfig`, *optional*): this call's sampling settings instead of the
                generator's own (their `max_new_tokens` is ignored).

        Returns:
            `list[Generation]`: `len(prompts) * n` samples, prompt-major (prompt `i`'s at `i * n .. i * n + n - 1`).
        """
        ...
