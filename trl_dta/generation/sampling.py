"""The transformers implementations of the `Generator` protocol ([`~generation.generator.Generator`]): the policy
sampled with `model.generate` and TRL's generation settings.

A generator takes a batch of token prefixes (each episode's conversation, or each tree node's prompt and segments), a
token budget per prefix and a number of samples per prefix, and returns the samples. Two implementations, both
`model.generate` with the caller's `GenerationConfig` (a TRL trainer's `generation_config`, merged by transformers with
the model's own, as every `generate` call merges it), so temperature, top-k/p, min-p, repetition penalty, bad words,
`min_new_tokens`, EOS handling and every other logits processor or stopping criterion act as in TRL's own generation:

- [`reprefill_generate_fn`]: plain `model.generate` on the left-padded batch of whole prefixes: every call prefills
  every prefix again, the system prompt and every earlier turn included (O(turns x context) per episode);
- [`CachedGenerate`]: the same `generate` call (transformers prepares the logits processors and stopping criteria),
  whose decoding loop is transformers' `_sample` loop with the model's forward replaced by a [`PrefixCache`]: each
  prefix is matched to the cached row it extends (the episode's previous turn), only its new tokens are forwarded
  (the environment's reply, then each sampled token), the prompts' shared parts (the system prompt, a task's first
  message) are prefilled once and stored once, and episodes that branch (copies of one prefix) continue from their
  parent's row. Forwarded tokens: every episode token once, the shared parts once per rollout.

Both draw `torch.multinomial` over the whole batch's `(batch, vocab)` probabilities at every step, as `generate`
does, so on the same random stream they sample the same tokens (up to the rounding of the logits: float64 models give
identical turns; tested). One difference: when every row of a call has reached its own budget or its end-of-turn
token, the cached loop stops, while `generate` keeps sampling rows past their budget (discarded afterwards) until
`max(budgets)`; the random streams of later calls then differ (never the distribution).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Sequence

import torch
from transformers import GenerationConfig

from .._checks import check_int
from .generator import Generation
from .prefix_cache import CacheStats, PrefixCache


def effective_generation_config(model, generation_config):
    """What `model.generate(generation_config=generation_config)` samples with: the trainer's settings over the
    model's own `generation_config` (its `generation_config.json`), then transformers' global defaults.

    transformers fills every field the passed config leaves unset (`None`) from `model.generation_config`, then from
    the global defaults (`GenerationMixin._prepare_generation_config`, transformers 5.24); this calls that merge, so a
    checkpoint's `forced_eos_token_id`, `min_new_tokens` or `num_beams` is seen where `generate` would apply it. The
    merge of a merged config is itself (only unset fields are filled).

    Args:
        model (`transformers.PreTrainedModel`): the policy (a PEFT model forwards to its base model).
        generation_config (`transformers.GenerationConfig`): the trainer's (TRL's sampling fields and
            `generation_kwargs`).

    Returns:
        `transformers.GenerationConfig`: a new config with every field set (`tree_sampling.level_generation_config`
        unsets `max_length` and `min_length` again, which `generate` derives from `max_new_tokens` / `min_new_tokens`).
    """
    merged, _ = model._prepare_generation_config(copy.deepcopy(generation_config))
    return merged


def _repeat(values: Sequence, n: int) -> list:
    """Each value `n` times in a row: the rows of `n` samples per prompt."""
    return [value for value in values for _ in range(n)]


class _Setup:
    """What both generators share: the generation config with its stop and pad ids, the padded batch, the cut."""

    def __init__(self, tokenizer, generation_config=None, **generation_kwargs):
        if generation_config is None:
            generation_config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        self.base = copy.deepcopy(generation_config)
        self.base.update(**generation_kwargs)
        eos = tokenizer.eos_token_id if self.base.eos_token_id is None else self.base.eos_token_id
        self.stop_ids = sorted(set(eos if isinstance(eos, (list, tuple)) else [eos]))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @classmethod
    def like(cls, other: _Setup, generation_config) -> _Setup:
        """`other`'s stop and pad ids with another generation config."""
        setup = copy.copy(other)
        setup.base = copy.deepcopy(generation_config)
        return setup

    def batch(self, prefixes: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded `(B, width)` ids and attention mask."""
        width = max(map(len, prefixes))
        input_ids = torch.full((len(prefixes), width), self.pad_id, dtype=torch.long, device=device)
        attention_mask = torch.zeros_like(input_ids)
        for row, prefix in enumerate(prefixes):
            input_ids[row, width - len(prefix):] = torch.tensor(prefix, device=device)
            attention_mask[row, width - len(prefix):] = 1
        return input_ids, attention_mask

    def config(self, max_new_tokens: list[int], scores: bool = True) -> GenerationConfig:
        config = copy.deepcopy(self.base)
        config.update(max_new_tokens=max(max_new_tokens), eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                      output_scores=scores, return_dict_in_generate=True)
        return config

    def cut(self, out, width: int, max_new_tokens: list[int]) -> list[Generation]:
        """Each row's sample: cut after its first stop token and at its own budget, with its processed log-probs when
        `out` has the scores, and its raw logits when `out` has them."""
        new_ids = out.sequences[:, width:]  # (B, new_tokens)
        logprobs = logits = None
        if out.scores is not None:
            scores = torch.stack(out.scores, dim=1).float()  # (B, new_tokens, vocab), processed
            logprobs = scores.log_softmax(-1).gather(-1, new_ids.unsqueeze(-1)).squeeze(-1)  # (B, new_tokens)
        if out.logits is not None:
            logits = torch.stack(out.logits, dim=1)  # (B, new_tokens, vocab), raw
        generations = []
        for row, budget in enumerate(max_new_tokens):
            ids = new_ids[row, :budget].tolist()
            end = next((k + 1 for k, token in enumerate(ids) if token in self.stop_ids), len(ids))
            generations.append(Generation(ids[:end], None if logprobs is None else logprobs[row, :end].tolist(),
                                          None if logits is None else logits[row, :end]))
        return generations


def _checked(prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], n: int):
    """The call's rows: each prompt and its budget `n` times (the protocol's arguments checked)."""
    if len(prompts) != len(max_new_tokens) or not prompts:
        raise ValueError(f"got {len(prompts)} prompts and {len(max_new_tokens)} budgets (at least one each).")
    n = check_int("n", n, minimum=1)
    return _repeat([list(p) for p in prompts], n), _repeat(list(max_new_tokens), n)


def reprefill_generate_fn(model, tokenizer, generation_config=None, **generation_kwargs) -> ReprefillGenerate:
    """A [`~generation.generator.Generator`] that calls `model.generate` on the left-padded batch of whole prefixes (no
    reuse): [`ReprefillGenerate`].

    The log-probs are those of the processed distribution each token was drawn from (after temperature, top-k,
    top-p), as vLLM's `processed_logprobs`; they cost `(batch, new_tokens, vocab)` floats of scores while generating.

    Args:
        model ([`~transformers.PreTrainedModel`]): the policy (its mode is left as it is).
        tokenizer: its tokenizer (pad and eos ids).
        generation_config ([`~transformers.GenerationConfig`], *optional*): sampling settings, e.g. a TRL trainer's
            `generation_config`. Defaults to plain sampling: temperature 1, no top-k, no top-p.
        **generation_kwargs: overrides of the generation config (e.g. `temperature=0.7`).
    """
    return ReprefillGenerate(model, _Setup(tokenizer, generation_config, **generation_kwargs))


class ReprefillGenerate:
    """`model.generate` on whole prefixes, as a [`~generation.generator.Generator`] (made by [`reprefill_generate_fn`]).

    Attributes:
        stats ([`CacheStats`]): `forward_tokens`: token positions forwarded (padding included); the rest 0.
    """

    def __init__(self, model, setup: _Setup):
        self.model, self.setup = model, setup
        self.stats = CacheStats()

    @property
    def generation_config(self) -> GenerationConfig:
        """The settings a call without `settings` samples with (the caller's over the model's own)."""
        return effective_generation_config(self.model, self.setup.base)

    def __call__(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], *, n: int = 1,
                 settings: GenerationConfig | None = None) -> list[Generation]:
        """`n` samples per prompt (the [`~generation.generator.Generator`] contract)."""
        rows, budgets = _checked(prompts, max_new_tokens, n)
        setup = self.setup if settings is None else _Setup.like(self.setup, settings)
        scores = settings is None or bool(settings.output_scores)
        input_ids, attention_mask = setup.batch(rows, self.model.device)
        with torch.no_grad(), count_forward_tokens(self.model) as forwarded:
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      generation_config=setup.config(budgets, scores))
        self.stats.forward_tokens += forwarded[0]
        return setup.cut(out, input_ids.shape[1], budgets)


class CachedGenerate:
    """A [`~generation.generator.Generator`] that keeps every episode's keys/values between calls and forwards only new
    tokens.

    Make one per rollout (the cache holds keys/values of the weights it was filled with). A call's prefixes are
    matched to the rows of the previous call: a prefix that extends a row's tokens (its episode's previous prefix and
    turn) continues that row, several prefixes extending one row branch it (tree rollouts of episodes), rows no prefix
    extends are released, and prefixes that extend none start new rows (the first call's prompts: their common prefix
    and each distinct prompt become shared nodes, see [`PrefixCache.add_prompts`]).

    Tree samplers call it level by level: a level's prefixes are its parents' (prompt + sampled segments), each
    sampled `n` times (once per child), so every parent's row branches (`PrefixCache.branch`: its segment, with its last
    sampled token forwarded once, becomes a node the children share, never copied per child) and the prompt and every
    segment are held and forwarded once; `settings=` per call adapts `min_new_tokens` to the level, and
    `output_logits=True` in them returns the raw logits of every sampled token.

    Args:
        model ([`~transformers.PreTrainedModel`]): the policy (its mode is left as it is).
        tokenizer: its tokenizer (pad and eos ids; any object with `eos_token_id` and `pad_token_id`).
        generation_config ([`~transformers.GenerationConfig`], *optional*): as in [`reprefill_generate_fn`].
        chunk_tokens (`int`, *optional*, defaults to `512`): the cache's prefill chunk per row ([`PrefixCache`]).
        max_batch_tokens (`int`, *optional*, defaults to `8192`): the cache's tokens per forward ([`PrefixCache`]).
        **generation_kwargs: overrides of the generation config.

    Attributes:
        cache ([`PrefixCache`]): the cache (`cache.stats.forward_tokens`: tokens forwarded so far).
        stats ([`CacheStats`]): the cache's.
    """

    def __init__(self, model, tokenizer, generation_config=None, *, chunk_tokens: int = 512,
                 max_batch_tokens: int = 8192, **generation_kwargs):
        self.model = model
        self.setup = _Setup(tokenizer, generation_config, **generation_kwargs)
        self.cache = PrefixCache(model, chunk_tokens=chunk_tokens, max_batch_tokens=max_batch_tokens)
        self._rows: list[int] = []  # the previous call's rows, in its order

    @property
    def generation_config(self) -> GenerationConfig:
        """The settings a call without `settings` samples with (the caller's over the model's own)."""
        return effective_generation_config(self.model, self.setup.base)

    @property
    def stats(self) -> CacheStats:
        return self.cache.stats

    def __call__(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], *, n: int = 1,
                 settings: GenerationConfig | None = None) -> list[Generation]:
        """`n` samples per prompt (the [`~generation.generator.Generator`] contract): each cut after its first stop
        token and at its budget, with the processed log-probs of its tokens (with `settings`, if they set
        `output_scores=True`)."""
        rows, budgets = _checked(prompts, max_new_tokens, n)
        setup = self.setup if settings is None else _Setup.like(self.setup, settings)
        out = self.generate(rows, budgets, generation_config=settings)
        return setup.cut(out, max(map(len, rows)), budgets)

    def generate(self, prefixes: list[list[int]], max_new_tokens: list[int], generation_config=None):
        """`model.generate` on the left-padded prefixes, decoded over the cache (what `__call__` cuts).

        Args:
            prefixes (`list[list[int]]`): the prefixes (see the class docstring for how they are matched).
            max_new_tokens (`list[int]`): each prefix's budget; `generate`'s `max_new_tokens` is the largest.
            generation_config ([`~transformers.GenerationConfig`], *optional*): this call's settings instead of the
                generator's (e.g. a tree sampler's `min_new_tokens` per level); stop and pad ids as the generator's.

        Returns:
            transformers' `GenerateDecoderOnlyOutput`: `sequences` `(B, width + steps)` (the padded prefixes, then the
            sampled tokens, pad after a row's stop token), `scores` (processed, one `(B, vocab)` per step; with a
            `generation_config`, only if it sets `output_scores=True`) and, with `output_logits=True` in the config,
            `logits` (raw, float32). A row's tokens past its own budget are not in
            the cache (they are cut by `__call__`).
        """
        if len(prefixes) != len(max_new_tokens) or not prefixes:
            raise ValueError(f"got {len(prefixes)} prefixes and {len(max_new_tokens)} budgets (at least one each).")
        budgets = [check_int("max_new_tokens[]", b, minimum=1) for b in max_new_tokens]
        setup = self.setup if generation_config is None else _Setup.like(self.setup, generation_config)
        # a per-call config keeps the processed scores only when it asks for them: `(B, vocab)` per step
        scores = generation_config is None or bool(generation_config.output_scores)
        rows = self._rows_for(prefixes)
        input_ids, attention_mask = setup.batch(prefixes, self.model.device)

        def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
            return _sample(self.cache, rows, budgets, input_ids, logits_processor, stopping_criteria,
                           generation_config)

        with torch.no_grad():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      generation_config=setup.config(budgets, scores), custom_generate=decode)
        width = input_ids.shape[1]
        for row, prefix in enumerate(prefixes):
            kept = out.sequences[row, width:width + budgets[row]].tolist()
            end = next((k + 1 for k, token in enumerate(kept) if token in setup.stop_ids), len(kept))
            if len(self.cache.tokens(rows[row])) != len(prefix) + end:
                raise RuntimeError("the generation cache lost track of a row; please report this.")
        self._rows = rows
        return out

    def _rows_for(self, prefixes: list[list[int]]) -> list[int | None]:
        """The row each prefix continues (new tokens appended as pending), branching and releasing as needed."""
        previous, matched = self._rows, []
        start = 0
        for prefix in prefixes:
            found = None
            for k in itertools.chain(range(start, len(previous)), range(start)):  # in order, as the episodes
                tokens = self.cache.tokens(previous[k])
                if len(tokens) <= len(prefix) and prefix[:len(tokens)] == tokens:
                    found = k
                    break
            matched.append(found)
            if found is not None:
                start = found
        counts = [matched.count(k) for k in range(len(previous))]
        children = [iter(kids) for kids in self.cache.branch(previous, counts)]
        rows: list[int | None] = [None if k is None else next(children[k]) for k in matched]
        new = [i for i, row in enumerate(rows) if row is None]
        if new:
            for i, row in zip(new, self.cache.add_prompts([prefixes[i] for i in new])):
                rows[i] = row
        for row, prefix in zip(rows, prefixes):
            self.cache.extend(row, prefix[len(self.cache.tokens(row)):])
        return rows


def _sample(cache: PrefixCache, rows: list[int], budgets: list[int], input_ids, logits_processor, stopping_criteria,
            generation_config):
    """transformers' `_sample` loop (5.x) with the forward replaced by the cache: the decoding method handed to
    `generate(custom_generate=...)`, so the processors, stopping criteria and config are the ones `generate` built."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    if generation_config.num_beams != 1 or generation_config.num_return_sequences != 1:
        raise ValueError("the generation cache samples one sequence per prefix: set `num_beams=1` and "
                         "`num_return_sequences=1`, or generate without the cache (`generation_cache=False`).")
    device = input_ids.device
    pad = generation_config._pad_token_tensor
    has_eos = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    batch = input_ids.shape[0]
    unfinished = torch.ones(batch, dtype=torch.long, device=device)
    kept = [0] * batch
    needed = list(range(batch))  # rows whose next token is kept (not finished, within their own budget)
    scores, raw = (), ()
    logits = cache.logits(rows)
    while True:
        next_logits = torch.zeros(batch, logits.shape[-1], dtype=torch.float32, device=device)
        next_logits[needed] = logits.to(device=device, dtype=torch.float32)
        if generation_config.output_logits:
            raw += (next_logits.clone(),)
        next_scores = logits_processor(input_ids, next_logits)
        if generation_config.output_scores:
            scores += (next_scores,)
        if generation_config.do_sample:
            next_tokens = torch.multinomial(torch.softmax(next_scores, dim=-1), num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(next_scores, dim=-1)
        if has_eos:
            next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        unfinished = unfinished & ~stopping_criteria(input_ids, scores)
        for b in needed:
            cache.extend(rows[b], [int(next_tokens[b])])
            kept[b] += 1
        needed = [b for b in needed if unfinished[b] and kept[b] < budgets[b]]
        if not needed or int(unfinished.max()) == 0:
            break
        logits = cache.logits([rows[b] for b in needed])
    return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores if generation_config.output_scores else None,
                                     logits=raw if generation_config.output_logits else None)


@contextlib.contextmanager
def count_forward_tokens(model):
    """Counts the token positions `model`'s decoder forwards inside the block (rows x new positions per call, padding
    included): yields a one-element list holding the running count."""
    count = [0]

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is not None:
            count[0] += int(ids.shape[0]) * int(ids.shape[1])

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    handle = decoder.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield count
    finally:
        handle.remove()
