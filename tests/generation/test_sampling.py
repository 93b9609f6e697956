"""`trl_dta.generation.CachedGenerate`: the rollouts it plays equal the re-prefill path's on the same random stream, its
samples have the policy's distribution (siblings included), it forwards each token once, and what it refuses."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from bounds import UNIT_ROUNDOFF
from tests.trainers.conftest import EOS, PAD, build_model
from trl_dta.demos import tiny
from trl_dta.envs import play_episodes
from trl_dta.generation import CachedGenerate, count_forward_tokens, reprefill_generate_fn

from .stats import chi_square_p

ALPHA = 1e-3  # significance level of the chi-square tests
VOCAB = 10  # every outcome of a short continuation can be enumerated


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer()


# TRL's sampling settings, each processor family present: a history-dependent penalty, warpers, a length rule.
TRL_LIKE = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.95, repetition_penalty=1.1, min_new_tokens=2)


@pytest.mark.parametrize("branching", [None, [2, 2]])
def test_episodes_equal_the_reprefill_paths_on_the_same_random_stream(domain, tokenizer, branching):
    """The stand-in domain's episodes (4 tasks, 2 episodes each or trees of 2 x 2 branching after the first turn)
    played by the cache and by `model.generate` on whole prefixes from the same seed: the same token ids, masks and
    turns, and log-probs equal to float32 rounding (both are log-softmaxes of the same float32-cast processed scores;
    the float64 logits they come from differ by ~1e-15, below float32's resolution, so the casts agree), while the
    cache forwards a fraction of the tokens."""
    model = tiny.build_model(tokenizer, dtype=torch.float64, max_position_embeddings=2048, seed=1).eval()
    config = GenerationConfig(**TRL_LIKE)
    settings = dict(max_turns=3, max_turn_tokens=12, max_tokens=2048, branching=branching,
                    num_generations=1 if branching else 2)
    runs = {}
    for name, generate in (("reprefill", reprefill_generate_fn(model, tokenizer, config)),
                           ("cached", CachedGenerate(model, tokenizer, config, chunk_tokens=64))):
        torch.manual_seed(0)
        with count_forward_tokens(model) as forwarded:
            runs[name] = (play_episodes(domain, [0, 1, 2, 3], generate, tokenizer, **settings), forwarded[0])
    (reprefill, reprefill_tokens), (cached, cached_tokens) = runs["reprefill"], runs["cached"]
    assert len(cached) == len(reprefill) == (16 if branching else 8)
    for a, b in zip(reprefill, cached):
        assert (a.ids, a.env_mask, a.turns, a.end_reason) == (b.ids, b.env_mask, b.turns, b.end_reason)
        # one float32 ulp of the larger magnitude: the casts of two float64 values 1e-15 apart
        assert all(abs(x - y) <= 2 * UNIT_ROUNDOFF[torch.float32] * max(abs(x), abs(y)) for x, y in
                   zip(a.logprobs, b.logprobs))
    assert sum(len(e.turns) for e in cached) > 8  # the episodes got past their first turn
    assert cached_tokens * 5 < reprefill_tokens, (cached_tokens, reprefill_tokens)


def test_forwards_every_episode_token_once_and_the_system_prompt_once(domain, tokenizer):
    """Forwarded tokens of a rollout = the distinct prefixes of its episodes (the system prompt once, each task's
    opening once for its episodes, each episode's own tokens once), minus each episode's last token (nothing is
    generated after it)."""
    from trl_dta.tree import PrefixTree

    model = tiny.build_model(tokenizer, max_position_embeddings=2048).eval()
    generate = CachedGenerate(model, tokenizer, chunk_tokens=64)
    episodes = play_episodes(domain, [0, 1, 2], generate, tokenizer, num_generations=3, max_turns=3,
                             max_turn_tokens=12, max_tokens=2048)
    tree = PrefixTree.from_sequences([torch.tensor(e.ids[:-1]) for e in episodes])
    assert generate.cache.stats.forward_tokens == tree.n_tree_tokens
    system = len(tokenizer(domain.system_prompt)["input_ids"])
    assert generate.cache.nodes[0].length >= system  # one node holds the shared system prompt


def _exact_joint(model, prompt: list[int], config) -> dict[tuple[int, int, int], float]:
    """P(a, b1, b2) = p(a) p(b1 | a + [3]) p(b2 | a + [3]) by full-sequence forwards: one first token `a`, then two
    siblings that continue `a + [3]` (a reply token) independently, under the processors of `config`."""
    processors = LogitsProcessorList([TemperatureLogitsWarper(config.temperature), TopKLogitsWarper(config.top_k)])

    def probs(prefixes):
        ids = torch.tensor(prefixes)
        with torch.no_grad():
            logits = model(ids).logits[:, -1].float()
        return torch.softmax(processors(ids, logits), dim=-1).double()

    first = probs([prompt])[0]
    second = probs([prompt + [a, 3] for a in range(VOCAB)])  # (VOCAB, VOCAB)
    return {(a, b1, b2): float(first[a] * second[a, b1] * second[a, b2])
            for a in range(VOCAB) for b1 in range(VOCAB) for b2 in range(VOCAB)
            if first[a] * second[a, b1] * second[a, b2] > 0}


def test_samples_and_siblings_have_the_policy_distribution():
    """4000 rows of one prompt sample a first token (one shared prompt node); each row then continues twice (its
    row branched: the siblings share it). The joint (a, b1, b2) is the policy's p(a) p(b1|a) p(b2|a): chi-square at
    ALPHA against the enumeration. The test can fail: the same samples with the siblings made equal (b2 := b1), or
    scored against another temperature, are rejected."""
    model = build_model(VOCAB, seed=3).eval()
    config = GenerationConfig(do_sample=True, temperature=0.9, top_k=6, pad_token_id=PAD, eos_token_id=[EOS])

    class _Tok:
        eos_token_id, pad_token_id = EOS, PAD

    prompt, n = [5, 6, 7, 3], 4000
    generate = CachedGenerate(model, _Tok(), config)
    torch.manual_seed(0)
    first = generate([prompt] * n, [1] * n)
    second = generate([prompt + g.ids + [3] for g in first for _ in range(2)], [1] * (2 * n))
    assert generate.cache.nodes[0].length == len(prompt)  # the prompt: one node under all 4000 rows
    observed: dict = {}
    for i, g in enumerate(first):
        outcome = (g.ids[0], second[2 * i].ids[0], second[2 * i + 1].ids[0])
        observed[outcome] = observed.get(outcome, 0) + 1
    expected = _exact_joint(model, prompt, config)
    assert chi_square_p(observed, expected, n) > ALPHA
    equal: dict = {}
    for (a, b1, _), count in observed.items():
        equal[(a, b1, b1)] = equal.get((a, b1, b1), 0) + count
    assert chi_square_p(equal, expected, n) < ALPHA
    hotter = _exact_joint(model, prompt, GenerationConfig(temperature=1.3, top_k=6))
    assert chi_square_p(observed, hotter, n) < ALPHA


def test_beams_are_refused(tokenizer):
    model = tiny.build_model(tokenizer).eval()
    generate = CachedGenerate(model, tokenizer, GenerationConfig(do_sample=True, num_beams=2))
    with pytest.raises(ValueError, match="num_beams=1"):
        generate([[5, 6, 7]], [3])


def test_tree_sampling_level_by_level(tokenizer):
    """The tree samplers' use (`CachedGenerate.generate` per level, parents' prefixes repeated per child, a config
    per level): the raw logits of every sampled token equal the model's full-sequence forward (float64 logits cast
    to float32, as `generate` casts them: equal to float32 rounding), the prompt is one node, each branched parent's
    segment another, and no token is forwarded twice: the prompts' distinct prefixes once, every sampled token once
    (a parent's last token once, when it branches), but a leaf's last token never."""
    from trl_dta.tree import PrefixTree

    model = tiny.build_model(tokenizer, dtype=torch.float64, max_position_embeddings=512, seed=2).eval()
    generate = CachedGenerate(model, tokenizer, GenerationConfig(do_sample=True, top_k=0, temperature=1.0))
    prompts = [list(range(5, 30)), list(range(5, 22))]
    level = GenerationConfig(do_sample=True, top_k=0, temperature=1.0, output_logits=True, return_dict_in_generate=True,
                             min_new_tokens=3)
    torch.manual_seed(0)
    prefixes, sampled = [p for p in prompts for _ in range(2)], 0
    for depth, (children, budget) in enumerate([(2, 4), (3, 5)]):
        if depth:
            prefixes = [p for p in prefixes for _ in range(children)]
        out = generate.generate(prefixes, [budget] * len(prefixes), generation_config=level)
        width = out.sequences.shape[1] - len(out.logits)
        for row, prefix in enumerate(prefixes):
            for step, token in enumerate(out.sequences[row, width:].tolist()[:budget]):
                full = model(torch.tensor([prefix + out.sequences[row, width:width + step].tolist()])).logits[0, -1]
                # one float32 ulp (rtol), or the float64 logits' own exactness bound near zero (atol)
                torch.testing.assert_close(out.logits[step][row], full.float(), rtol=2 * UNIT_ROUNDOFF[torch.float32],
                                           atol=1e-10)
                if token == tokenizer.eos_token_id:
                    break
        kept = [generate.cache.tokens(row)[len(prefix):] for row, prefix in zip(generate._rows, prefixes)]
        sampled += sum(map(len, kept))
        prefixes = [list(prefix) + turn for prefix, turn in zip(prefixes, kept)]
    prompt_tokens = PrefixTree.from_sequences([torch.tensor(p) for p in prompts]).n_tree_tokens
    assert generate.cache.stats.forward_tokens == prompt_tokens + sampled - len(prefixes)
    assert sum(node.parent is None for node in generate.cache.nodes) == 1  # the prompts' common prefix, once
