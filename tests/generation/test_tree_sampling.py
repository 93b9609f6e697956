"""Tree sampling (`trl_dta/generation/tree_sampling.py`): each leaf's distribution and the joint law of siblings against
the exact distribution (enumeration), `min_new_tokens` across branch points, top-p and min-p, fault injections the
tests must reject, the key/value cache reuse, the tree invariants, and the generation config `generate` really uses."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tests.conftest import use_input_dtype_norms
from tests.generation.stats import chi_square_p
from tests.trainers.conftest import EOS, PAD, build_model
from trl_dta.generation import tree_sampling
from trl_dta.generation.tree_sampling import (
    RolloutTree,
    TreeSampler,
    TreeStats,
    check_generation_config,
    effective_generation_config,
    level_generation_config,
    sample_trees,
)

VOCAB = 10  # a model over 10 tokens: every outcome of a short completion can be enumerated
ALPHA = 1e-3  # significance level of the chi-square tests
PROMPT = [5, 6, 7, 3]


def _generation_config(**overrides) -> GenerationConfig:
    kwargs = dict(do_sample=True, pad_token_id=PAD, eos_token_id=[EOS], temperature=0.9, top_k=6,
                  repetition_penalty=1.3, disable_compile=True)
    kwargs.update(overrides)
    return GenerationConfig(**kwargs)


def _next_probs(model, prompt: list[int], seqs: list[tuple], config) -> torch.Tensor:
    """`(len(seqs), VOCAB)` float64: the distribution `generate` samples completion token `len(seq)` from, after the
    completion `seq`, written out in `generate`'s processor order (sequence bias, repetition penalty, `min_new_tokens`
    counted from the completion's start, temperature, top-k, top-p, min-p) with one full forward per prefix (no
    cache). Single-token sequence biases only."""
    ids = torch.tensor([prompt + list(seq) for seq in seqs])  # (N, P + depth): one forward per depth
    with torch.no_grad():
        logits = model(ids).logits[:, -1].double()
    for tokens, bias in config.sequence_bias or []:
        assert len(tokens) == 1
        logits[:, tokens[0]] += bias
    if config.repetition_penalty not in (None, 1.0):
        logits = RepetitionPenaltyLogitsProcessor(config.repetition_penalty)(ids, logits)
    depth = len(seqs[0])
    if config.min_new_tokens and depth < config.min_new_tokens:
        logits[:, EOS] = -math.inf
    warpers = [TemperatureLogitsWarper(config.temperature)] if config.temperature not in (None, 1.0) else []
    if config.top_k:
        warpers.append(TopKLogitsWarper(config.top_k))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(config.top_p))
    if config.min_p is not None:
        warpers.append(MinPLogitsWarper(config.min_p))
    for warper in warpers:
        logits = warper(ids, logits)
    return torch.softmax(logits, dim=-1)


def _exact_distribution(model, prompt: list[int], n_tokens: int, config) -> dict[tuple[int, ...], float]:
    """Every completion of at most `n_tokens` tokens (ending at EOS or at the limit) with its probability."""
    dist: dict[tuple[int, ...], float] = {}
    frontier = {(): 1.0}
    for _ in range(n_tokens):
        seqs = list(frontier)
        probs = _next_probs(model, prompt, seqs, config).tolist()
        nxt = {}
        for seq, row in zip(seqs, probs):
            for t, q in enumerate(row):
                q *= frontier[seq]
                if q == 0.0:
                    continue
                if t == EOS or len(seq) + 1 == n_tokens:
                    dist[seq + (t,)] = dist.get(seq + (t,), 0.0) + q
                else:
                    nxt[seq + (t,)] = q
        frontier = nxt
    return dist


def _exact_sibling_distribution(model, prompt: list[int], config) -> dict[tuple, float]:
    """`branching=[2, 2]` with segments of one token and two tokens in all: the joint law of a first-level node's two
    leaves, `P(a, b1, b2) = p(a) p(b1 | a) p(b2 | a)` (an `a = <eos>` node's two rows are `(<eos>,)` both)."""
    first = _next_probs(model, prompt, [()], config)[0].tolist()
    alive = [(a,) for a, q in enumerate(first) if q > 0 and a != EOS]
    second = dict(zip(alive, _next_probs(model, prompt, alive, config).tolist()))
    joint = {((EOS,), (EOS,)): first[EOS]} if first[EOS] > 0 else {}
    for (a,), row in second.items():
        for b1, q1 in enumerate(row):
            for b2, q2 in enumerate(row):
                if q1 * q2 > 0:
                    joint[((a, b1), (a, b2))] = first[a] * q1 * q2
    return joint


def _leaf_p(trees, j: int, expected: dict) -> float:
    return chi_square_p(Counter(tuple(tree.leaves[j]) for tree in trees), expected, len(trees))


def _sibling_p(trees, expected: dict) -> float:
    """The joint test over every first-level node of `[2, 2]` trees (rows 2k, 2k + 1 are one node's leaves)."""
    pairs = Counter((tuple(t.leaves[k]), tuple(t.leaves[k + 1])) for t in trees for k in range(0, len(t.leaves), 2))
    return chi_square_p(pairs, expected, sum(pairs.values()))


def assert_tree_laws(trees, model, prompt: list[int], config, wrong) -> None:
    """`[2, 2]` trees of one-token segments sampled after `prompt` with `config`: leaves 0 and 3 follow the exact
    marginal, the siblings of every first-level node the exact joint law, and the leaves scored against the
    neighbouring setting `wrong` are rejected (the test has power: a small p, or outcomes `wrong` makes impossible)."""
    expected = _exact_distribution(model, prompt, 2, config)
    for j in (0, 3):
        p = _leaf_p(trees, j, expected)
        assert p > ALPHA, f"leaf {j}: chi-square p = {p:.2e}"
    p = _sibling_p(trees, _exact_sibling_distribution(model, prompt, config))
    assert p > ALPHA, f"siblings: chi-square p = {p:.2e}"
    try:
        rejected = _leaf_p(trees, 0, _exact_distribution(model, prompt, 2, wrong)) < ALPHA
    except AssertionError as impossible:  # `chi_square_p`: an outcome sampled that has probability 0 there
        rejected = "impossible outcomes" in str(impossible)
    assert rejected, "the leaves pass against the neighbouring setting too: the test has no power"


@pytest.fixture(scope="module")
def small_model():
    return build_model(VOCAB, seed=3).eval()


def _sample(model, n_trees, branching, segment, max_new, config, seed, chunk: int = 250):
    """`n_trees` trees of `PROMPT`, sampled `chunk` prompts per call (as a trainer's batch of prompts)."""
    torch.manual_seed(seed)
    trees = []
    for start in range(0, n_trees, chunk):
        trees += sample_trees(model, [PROMPT] * min(chunk, n_trees - start), branching, segment, max_new, config,
                              [EOS], PAD)[0]
    return trees


@pytest.mark.parametrize("branching,segment,max_new,n_trees", [
    ([2, 2], 1, 2, 2000),
    pytest.param([2, 2, 2], 1, 3, 1200, marks=pytest.mark.slow),
    pytest.param([3, 2], 2, 3, 1200, marks=pytest.mark.slow),
])
def test_leaves_have_the_policy_marginal(small_model, branching, segment, max_new, n_trees):
    """Each leaf position, over many trees, is distributed as one independent sample of the policy (the exact
    distribution by enumeration, repetition penalty and top-k included), tested with a chi-square at ALPHA."""
    config = _generation_config()
    expected = _exact_distribution(small_model, PROMPT, max_new, config)
    trees = _sample(small_model, n_trees, branching, segment, max_new, config, seed=0)
    # The first and the last leaf: the last one has only branched children on its path, the first only first ones.
    for j in (0, math.prod(branching) - 1):
        p = _leaf_p(trees, j, expected)
        assert p > ALPHA, f"leaf {j}: chi-square p = {p:.2e}"
    # The test has power: the same trees scored against a different temperature are rejected.
    assert _leaf_p(trees, 0, _exact_distribution(small_model, PROMPT, max_new, _generation_config(temperature=1.3))) \
        < ALPHA


def test_siblings_have_the_joint_law_of_independent_continuations(small_model):
    """A first-level node and its two children: `(leaf 2k, leaf 2k + 1)` has the law `p(a) p(b1 | a) p(b2 | a)`.
    Fault injection: a sampler whose siblings are copies of the first (every leaf identical) passes the marginal test
    and is rejected by this one."""
    config = _generation_config()
    trees = _sample(small_model, 2000, [2, 2], 1, 2, config, seed=5)
    joint = _exact_sibling_distribution(small_model, PROMPT, config)
    p = _sibling_p(trees, joint)
    assert p > ALPHA, f"siblings: chi-square p = {p:.2e}"
    for tree in trees:  # the fault: each node's second child is a copy of its first
        tree.leaves[1], tree.leaves[3] = list(tree.leaves[0]), list(tree.leaves[2])
    marginal = _exact_distribution(small_model, PROMPT, 2, config)
    assert _leaf_p(trees, 1, marginal) > ALPHA  # the marginal cannot see it
    assert _sibling_p(trees, joint) < ALPHA


def test_min_new_tokens_counts_from_the_completions_start(small_model):
    """`min_new_tokens=2` with segments of one token: <eos> is impossible at completion tokens 0 and 1 and possible at
    2, whichever level samples it (the later level's call gets `min_new_tokens - 1`). Fault injection: levels that
    each apply `min_new_tokens` from their own start (not reduced) are rejected."""
    config = _generation_config(min_new_tokens=2, sequence_bias=[[[EOS], 3.0]], top_k=0)
    expected = _exact_distribution(small_model, PROMPT, 3, config)
    assert sum(q for seq, q in expected.items() if len(seq) == 3 and seq[-1] == EOS) > 0.1  # the bias makes it seen
    trees = _sample(small_model, 800, [2, 2], 1, 3, config, seed=6)
    for j in (0, 3):
        p = _leaf_p(trees, j, expected)
        assert p > ALPHA, f"leaf {j}: chi-square p = {p:.2e}"

    def not_reduced(generation_config, budget, done):
        return level_generation_config(generation_config, budget, 0)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tree_sampling, "level_generation_config", not_reduced)
        faulty = _sample(small_model, 800, [2, 2], 1, 3, config, seed=6)
    assert _leaf_p(faulty, 0, expected) < ALPHA


@pytest.mark.parametrize("overrides,wrong", [
    (dict(top_p=0.7, top_k=0), dict(top_p=0.9, top_k=0)),
    (dict(min_p=0.15, top_k=0), dict(min_p=0.05, top_k=0)),
])
def test_top_p_and_min_p(small_model, overrides, wrong):
    """top-p and min-p: each leaf's marginal and the siblings' joint law; the trees scored against a neighbouring
    threshold are rejected (the test has power)."""
    config = _generation_config(**overrides)
    trees = _sample(small_model, 1500, [2, 2], 1, 2, config, seed=7)
    assert_tree_laws(trees, small_model, PROMPT, config, _generation_config(**wrong))


def test_siblings_share_their_parent_segment(small_model):
    """Leaves of one node agree on the node's tokens; an ended node's rows are copies of it."""
    torch.manual_seed(1)
    trees, _ = sample_trees(small_model, [[5, 6, 7, 3]] * 100, [2, 3], 2, 5, _generation_config(), [EOS], PAD)
    saw_copy = False
    for tree in trees:
        assert len(tree.leaves) == 6
        for node in range(2):
            group = tree.leaves[3 * node: 3 * node + 3]
            assert len({tuple(leaf[:2]) for leaf in group}) == 1
            if EOS in group[0][:2]:
                saw_copy = True
                assert all(leaf == group[0] for leaf in group)
        assert all(len(leaf) <= 5 for leaf in tree.leaves)
        assert tree.generated_tokens <= tree.independent_tokens
    assert saw_copy


def test_sampler_samples_as_sample_trees_and_counts_its_metrics(small_model):
    """`TreeSampler` (the settings as plain values) draws what `sample_trees` draws on the same random stream, and its
    metrics, by hand on a tree of 4 leaves: nodes a=[3, 4] (children [5] and [6, 7]) and b=[8, 2] (ended at the branch
    point: two copies). Sampled: 2 + 1 + 2 + 2 = 7 tokens; independently 3 + 4 + 2 + 2 = 11; 3 distinct leaves; 2 of 4
    leaves ended early."""
    config = _generation_config()
    sampler = TreeSampler((2, 2), 2, 5, config, (EOS,), PAD)
    torch.manual_seed(3)
    trees, stats = sampler(small_model, [PROMPT] * 4)
    torch.manual_seed(3)
    ref_trees, ref_stats = sample_trees(small_model, [PROMPT] * 4, [2, 2], 2, 5,
                                        effective_generation_config(small_model, config), [EOS], PAD)
    assert trees == ref_trees and stats == ref_stats

    tree = RolloutTree(leaves=[[3, 4, 5], [3, 4, 6, 7], [8, 2], [8, 2]], nodes=[[0, 1], [0, 2], [3], [3]],
                       starts=[0, 2], generated_tokens=7)
    metrics = sampler.metrics([tree, tree], TreeStats(forward_calls=3, forward_tokens=20, peak_kv_bytes=3 * 2**19))
    assert metrics == {
        "dta/generated_tokens": 14.0, "dta/generated_tokens_independent": 22.0,
        "dta/generation_compression": 22 / 14, "dta/generation_forward_tokens": 20.0,
        "dta/generation_peak_kv_mb": 1.5, "dta/tree_distinct_leaves": 3.0, "dta/tree_early_end_fraction": 0.5,
    }


@pytest.mark.parametrize("branching,segment,max_new", [
    ([1, 4], 2, 5), ([4, 1], 1, 3), ([2, 3], 2, 3), ([3, 1, 2], 1, 4), ([2, 2, 2], 2, 7), ([6], None, 4),
])
@pytest.mark.parametrize("min_new_tokens", [None, 3])
def test_tree_invariants(small_model, branching, segment, max_new, min_new_tokens):
    """Over branchings with levels of one child, one-level trees and frequent EOS (a +3 bias): every tree has
    `prod(branching)` leaves of at most `max_new` tokens, rows below a node share its tokens, an ended node's rows are
    copies, `generated_tokens` counts each node once, and `min_new_tokens` holds across branch points."""
    config = _generation_config(sequence_bias=[[[EOS], 3.0]], min_new_tokens=min_new_tokens)
    prompts = [[5, 6, 7, 3, 4], [9], [3, 3, 5]] * 4
    torch.manual_seed(7)
    trees, stats = sample_trees(small_model, prompts, branching, segment, max_new, config, [EOS], PAD)
    g, starts = math.prod(branching), [level * (segment or 0) for level in range(len(branching))]
    for tree in trees:
        assert len(tree.leaves) == len(tree.nodes) == g and tree.starts == starts
        nodes = {}
        for leaf, path in zip(tree.leaves, tree.nodes):
            assert 1 <= len(leaf) <= max_new
            if min_new_tokens:
                assert len(leaf) >= min(min_new_tokens, max_new)
            if EOS in leaf:
                assert leaf.index(EOS) == len(leaf) - 1
            else:
                assert len(leaf) == max_new  # only the budget stops a completion without EOS
            for level, node in enumerate(path):
                end = len(leaf) if level == len(path) - 1 else starts[level + 1]
                nodes.setdefault(node, set()).add(tuple(leaf[starts[level]:end]))
            if len(path) < len(branching):  # ended before the last level: an EOS inside its last segment
                assert leaf[-1] == EOS and len(leaf) <= starts[len(path)]
        assert all(len(segments) == 1 for segments in nodes.values())  # a node's rows agree on its segment
        assert tree.generated_tokens == sum(len(next(iter(v))) for v in nodes.values())
    lower, upper = _forwarded_bounds(prompts, trees)
    assert lower <= stats.forward_tokens <= upper


def _forwarded_bounds(prompts: list[list[int]], trees) -> tuple[int, int]:
    """Bounds on the token positions a tree sampler forwards when it forwards nothing twice. At least: every position
    some leaf needs logits after (its prompt and its completion but the last token), each distinct one once (the trie
    of those sequences). At most: each distinct prompt once, then each node's tokens but its last while its level
    samples, and the last token of each node with children once when the next level branches (the generation cache
    also lets rows with the same tokens share one row: identical siblings, the same prompt in several trees)."""
    from trl_dta.tree import PrefixTree

    needed = [torch.tensor(p + leaf[:-1]) for p, tree in zip(prompts, trees) for leaf in tree.leaves]
    lower = PrefixTree.from_sequences(needed).n_tree_tokens
    upper = sum(map(len, dict.fromkeys(map(tuple, prompts))))
    for tree in trees:
        segments, inner = {}, set()
        for leaf, path in zip(tree.leaves, tree.nodes):
            for level, node in enumerate(path):
                end = len(leaf) if level == len(path) - 1 else tree.starts[level + 1]
                segments[node] = end - tree.starts[level]
                if level < len(path) - 1:
                    inner.add(node)
        upper += sum(n - 1 for n in segments.values()) + len(inner)
    return lower, upper


def test_cache_reuse_gives_the_full_sequence_logits_and_no_refill():
    """float64 model: every sampled token's logits equal the model's on the whole sequence alone, unpadded (prompts of
    different lengths, sampled together); the prompts and every node's segment are forwarded once (`_forwarded_bounds`).
    `generate` hands its logits over rounded to float32; the float64 computation differs from the reference by about
    1e-15 relative (its attention in parts merged by log-sum-exp), far below float32's half ulp (2**-24 relative), so
    each logit is the float32 rounding of the reference or, where the reference sits within 1e-15 of a rounding
    midpoint, its neighbour: within one float32 ulp, `2**-23 |ref|`. Norms in the input dtype: stock RMSNorm computes
    in float32. Peak key/value memory: the prompts once, not once per leaf."""
    model = use_input_dtype_norms(build_model(VOCAB, seed=4).double().eval())
    prompts = [[5, 6, 7, 3, 4, 8], [9, 4], [3, 3, 5, 6]]
    torch.manual_seed(2)
    branching, segment, max_new = [2, 3, 2], 2, 7
    trees, stats = sample_trees(model, prompts, branching, segment, max_new, _generation_config(), [EOS], PAD,
                                return_logits=True)
    n_tokens = 0
    for prompt, tree, leaf_logits in zip(prompts, trees, stats.logits):
        for leaf, logits in zip(tree.leaves, leaf_logits):
            assert logits.shape == (len(leaf), VOCAB) and logits.dtype == torch.float32
            with torch.no_grad():
                ref = model(torch.tensor([prompt + leaf])).logits[0, len(prompt) - 1: -1]
            err = (logits.double() - ref).abs()
            assert (err <= 2 ** -23 * ref.abs()).all(), err.max()
            n_tokens += len(leaf)
    assert n_tokens > sum(map(len, prompts)) * 4  # long enough leaves were checked
    lower, upper = _forwarded_bounds(prompts, trees)
    assert lower <= stats.forward_tokens <= upper


def test_the_models_generation_config_is_checked(small_model):
    """What `generate` really uses is the trainer's config over the model's own `generation_config`: a checkpoint
    whose generation config sets `forced_eos_token_id` (or beams) is refused, though the trainer's config alone
    passes."""
    config = _generation_config()
    model = build_model(VOCAB, seed=3).eval()
    check_generation_config(config, model)
    model.generation_config.forced_eos_token_id = EOS
    check_generation_config(config)  # the trainer's config alone cannot see it
    with pytest.raises(ValueError, match="forced_eos_token_id=2.*model's own generation config"):
        check_generation_config(config, model)
    model.generation_config.forced_eos_token_id = None
    model.generation_config.num_beams = 3
    with pytest.raises(ValueError, match="`num_beams` must be 1"):
        check_generation_config(config, model)
    model.generation_config.num_beams = 1
    model.generation_config.max_length = 4096  # inert: every level's `max_new_tokens` overrides it
    check_generation_config(config, model)


def test_levels_reduce_the_models_min_new_tokens():
    """A checkpoint's `min_new_tokens` reaches every level through the merged config and is reduced per level: with
    `min_new_tokens=2` from the model and segments of one token, leaves of 3 tokens ending at <eos> occur (sampled by
    the second level from one token in); given the trainer's config alone, every level's call would refill 2 from the
    model and forbid them."""
    model = build_model(VOCAB, seed=3).eval()
    model.generation_config.min_new_tokens = 2
    config = _generation_config(sequence_bias=[[[EOS], 3.0]], top_k=0)
    merged = effective_generation_config(model, config)
    assert merged.min_new_tokens == 2 and config.min_new_tokens is None

    def ends(generation_config):
        torch.manual_seed(8)
        trees, _ = sample_trees(model, [PROMPT] * 300, [2, 2], 1, 3, generation_config, [EOS], PAD)
        leaves = [leaf for tree in trees for leaf in tree.leaves]
        assert all(len(leaf) >= 2 for leaf in leaves)
        return sum(len(leaf) == 3 and leaf[-1] == EOS for leaf in leaves)

    assert ends(merged) > 20
    with pytest.warns(UserWarning, match="min_new_tokens"):  # the first level's call: 2 from the model, budget 1
        assert ends(config) == 0


def test_the_prompts_cache_is_held_once():
    """Generation memory: the prompt's keys/values are held once for the whole tree (a node of the generation
    cache the children continue, never copied per child), so the peak is about twice the prompt (the moment it moves
    from the rows' buffer into its node) plus the leaves' own segments, while independent sampling holds `G` copies:
    `G * (P + R)` key/value rows."""
    model = build_model(VOCAB, seed=3, max_position_embeddings=2048).eval()
    prompt, branching, segment, max_new = [3 + (7 * k) % 7 for k in range(1500)], [2, 2, 2], 4, 12
    config = _generation_config(suppress_tokens=[EOS])  # no early end: every leaf reaches the last level
    torch.manual_seed(9)
    trees, stats = sample_trees(model, [prompt], branching, segment, max_new, config, [EOS], PAD)
    c = model.config
    row = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4  # bytes
    g = math.prod(branching)
    independent = g * (len(prompt) + max_new) * row
    assert len(prompt) * row <= stats.peak_kv_bytes <= independent / 3, (stats.peak_kv_bytes, independent)
    assert all(len(leaf) == max_new for leaf in trees[0].leaves)
    print(f"peak KV {stats.peak_kv_bytes / row:.0f} rows vs independent {independent / row:.0f}")
