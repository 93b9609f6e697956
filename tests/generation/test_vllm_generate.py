"""The vLLM generator (`trl_dta/generation/vllm_generate.py`) on the session's vLLM engine (marker `vllm`): greedy
turns equal transformers' `generate`, the sampled tokens' log-probs are the processed distribution's (transformers'
processors on the policy's own logits), tree sampling through it has each leaf's marginal and the siblings' joint law
(the chi-square tests of `test_tree_sampling.py`, exact distributions by enumeration with the transformers model),
`min_new_tokens` across branch points, top-p and min-p, and vLLM's prefix-cache counters."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from tests.generation.test_tree_sampling import (
    ALPHA,
    _exact_distribution,
    _generation_config,
    _leaf_p,
    assert_tree_laws,
)
from tests.trainers.conftest import EOS
from trl_dta.generation import VLLMGenerate
from trl_dta.generation.tree_sampling import sample_tree_levels

pytestmark = pytest.mark.vllm

PROMPT = [1, 4, 5, 13, 10, 17]  # "12+7=" in the tiny character tokenizer
PROMPTS = [PROMPT, [1, 9, 12, 10, 4, 4, 17], [1, 30, 31, 32, 33, 34, 35, 36, 37, 17]]


@pytest.fixture(scope="module")
def policy(vllm_model_dir):
    return AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(vllm_engines, policy):
    """The session's float32 engine holding `policy`'s weights (a trainer test may have synced others into it), loaded
    as TRL's colocate mode syncs them."""
    engine = vllm_engines.get(torch.float32)
    model = engine.llm_engine.model_executor.driver_worker.model_runner.model
    model.load_weights(list(policy.state_dict().items()))
    engine.reset_prefix_cache()
    return engine


def test_greedy_turns_equal_transformers(engine, policy):
    """`do_sample=False`: the same tokens as transformers' greedy `generate`, cut after the first stop token, each
    prompt's own budget."""
    generator = VLLMGenerate(engine, GenerationConfig(do_sample=False, eos_token_id=[EOS]))
    budgets = [12, 5, 9]
    samples = generator(PROMPTS, budgets, n=2)
    assert len(samples) == 6 and samples[0] == samples[1]
    for prompt, budget, sample in zip(PROMPTS, budgets, samples[::2], strict=True):
        with torch.no_grad():
            out = policy.generate(torch.tensor([prompt]), max_new_tokens=budget, do_sample=False,
                                  eos_token_id=EOS, pad_token_id=0)
        expected = out[0, len(prompt):].tolist()
        assert sample.ids == expected[:expected.index(EOS) + 1 if EOS in expected else budget]
        assert len(sample.logprobs) == len(sample.ids)


def test_logprobs_are_the_processed_distributions(engine, policy):
    """Each sampled token's log-prob is its log-prob under the distribution it was drawn from: the policy's logits
    after temperature, top-k and top-p (transformers' warpers on a full forward of the prompt and sample)."""
    settings = GenerationConfig(do_sample=True, temperature=0.7, top_k=8, top_p=0.9, eos_token_id=[EOS])
    generator = VLLMGenerate(engine, settings, seed=11)
    warpers = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(8), TopPLogitsWarper(0.9)]
    worst = 0.0
    samples = generator(PROMPTS, [10] * 3, n=2)
    for row, sample in enumerate(samples):
        prompt = PROMPTS[row // 2]
        ids = torch.tensor([prompt + sample.ids])
        with torch.no_grad():
            logits = policy(ids).logits[0, len(prompt) - 1:-1]  # (len(sample), vocab)
        for k, token in enumerate(sample.ids):
            scores = logits[k:k + 1].clone()
            for warper in warpers:
                scores = warper(ids[:, :len(prompt) + k], scores)
            expected = scores.log_softmax(-1)[0, token].item()
            worst = max(worst, abs(expected - sample.logprobs[k]))
    assert worst < 1e-4, worst


@pytest.mark.parametrize("overrides,wrong", [
    (dict(), dict(temperature=0.5)),
    (dict(top_p=0.5, top_k=0, temperature=0.3), dict(top_p=0.7, top_k=0, temperature=0.3)),
    (dict(min_p=0.15, top_k=0, temperature=0.3), dict(min_p=0.05, top_k=0, temperature=0.3)),
])
def test_tree_leaves_and_siblings_have_the_policys_laws(engine, policy, overrides, wrong):
    """`branching=[2, 2]`, one-token segments, through vLLM: a leaf's marginal and a first-level node's two leaves'
    joint law `p(a) p(b1 | a) p(b2 | a)` against the exact ones (temperature, top-k, repetition penalty, top-p,
    min-p), and the leaves scored against a neighbouring setting are rejected (the test has power: a small p, or
    outcomes the neighbouring setting makes impossible). The tiny model's distributions are nearly flat: top-p and
    min-p run at temperature 0.3, where 1,200 trees give dozens of chi-square bins (at 0.9 every one of top-p 0.7's
    ~1,200 outcomes would expect fewer than 5 counts)."""
    config = _generation_config(**overrides)
    trees = _vllm_trees(engine, 1200, [2, 2], 1, 2, config, seed=0)
    assert_tree_laws(trees, policy, PROMPT, config, _generation_config(**wrong))
    assert all(tree.logprobs is not None for tree in trees)


def test_min_new_tokens_counts_from_the_completions_start(engine, policy):
    """`min_new_tokens=2` with one-token segments through vLLM (`min_tokens` per request, reduced per level): <eos> is
    impossible at completion tokens 0 and 1 and possible at 2 (a +1 logit bias on <eos>, vLLM's `logit_bias`; top-k 3,
    so that every one of the 27 outcomes expects 5 counts or more)."""
    same = dict(min_new_tokens=2, top_k=3, repetition_penalty=1.0, temperature=1.0)
    expected = _exact_distribution(policy, PROMPT, 3, _generation_config(sequence_bias=[[[EOS], 1.0]], **same))
    assert sum(q for seq, q in expected.items() if len(seq) == 3 and seq[-1] == EOS) > 0.1
    settings = _generation_config(**same)  # the bias as vLLM's own argument
    trees = _vllm_trees(engine, 800, [2, 2], 1, 3, settings, seed=6, logit_bias={EOS: 1.0})
    for j in (0, 3):
        p = _leaf_p(trees, j, expected)
        assert p > ALPHA, f"leaf {j}: chi-square p = {p:.2e}"
    assert all(EOS not in leaf[:2] for tree in trees for leaf in tree.leaves)


def test_prefix_cache_counters(engine):
    """vLLM's own counters: a prompt's second request finds its full blocks cached, a continuation (the prompt, its
    sample and new tokens, as an agent's next turn) finds the earlier turn's blocks; forwarded tokens are the rest."""
    engine.reset_prefix_cache()
    block = engine.llm_engine.vllm_config.cache_config.block_size
    long = (PROMPTS[2] * (2 * block // len(PROMPTS[2]) + 1))[:2 * block + 5]
    generator = VLLMGenerate(engine, GenerationConfig(do_sample=False, eos_token_id=[EOS]))
    first = generator([long], [4])
    assert generator.stats.cached_tokens == 0
    assert generator.stats.forward_tokens == len(long) + len(first[0].ids) - 1
    turn = long + first[0].ids + [4, 5, 6]
    generator([turn], [4])
    assert generator.stats.cached_tokens == 2 * block
    assert generator.stats.forward_calls == 2


def _vllm_trees(engine, n_trees, branching, segment, max_new, config, seed, **sampling_kwargs):
    """`n_trees` trees of `PROMPT` through a seeded `VLLMGenerate`, 500 prompts per call."""
    generator = VLLMGenerate(engine, config, sampling_kwargs=sampling_kwargs, seed=seed * 1_000_003)
    trees = []
    for start in range(0, n_trees, 500):
        trees += sample_tree_levels(generator, [PROMPT] * min(500, n_trees - start), branching, segment, max_new,
                                    config, [EOS])[0]
    return trees
