"""Tree rollouts (`trl_dta/trainers/tree_rollouts.py`): sampling correctness, key/value cache reuse, the trainer end to
end against TRL, tree advantages, and the configurations refused at construction."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)
from trl import GRPOConfig, GRPOTrainer, TrlParser

from trl_dta import DTAGRPOConfig, DTAGRPOTrainer, DTARLOOConfig
from trl_dta.trainers.tree_rollouts import RolloutTree, _prompt_groups, sample_trees, tree_advantages

from tests.conftest import use_input_dtype_norms

from .conftest import EOS, PAD, assert_equivalent, build_model, make_args, train

VOCAB = 10  # a model over 10 tokens: every outcome of a short completion can be enumerated
ALPHA = 1e-3  # significance level of the chi-square tests


def _generation_config(**overrides) -> GenerationConfig:
    kwargs = dict(do_sample=True, pad_token_id=PAD, eos_token_id=[EOS], temperature=0.9, top_k=6,
                  repetition_penalty=1.3, disable_compile=True)
    kwargs.update(overrides)
    return GenerationConfig(**kwargs)


def _processors(config: GenerationConfig) -> LogitsProcessorList:
    """The processors `generate` applies for `_generation_config()`, in its order (penalty first, then warpers)."""
    return LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(config.repetition_penalty),
        TemperatureLogitsWarper(config.temperature),
        TopKLogitsWarper(config.top_k),
    ])


def _exact_distribution(model, prompt: list[int], n_tokens: int, config) -> dict[tuple[int, ...], float]:
    """Every completion of at most `n_tokens` tokens (ending at EOS or at the limit) with its probability under the
    model and the sampling processors, by enumeration over full-sequence forwards (no cache)."""
    processors = _processors(config)
    dist: dict[tuple[int, ...], float] = {}
    frontier = {(): 1.0}
    for _ in range(n_tokens):
        seqs = list(frontier)
        ids = torch.tensor([prompt + list(seq) for seq in seqs])  # (N, P + depth): one forward per depth
        with torch.no_grad():
            logits = model(ids).logits[:, -1].double()
        probs = torch.softmax(processors(ids, logits), dim=-1).tolist()
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


def _chi_square_p(observed: dict, expected: dict[tuple, float], n: int) -> float:
    """p-value of Pearson's chi-square goodness-of-fit; outcomes with expected count < 5 are pooled into one bin."""
    assert set(observed) <= set(expected), f"impossible outcomes sampled: {set(observed) - set(expected)}"
    stat, bins, pooled_obs, pooled_exp = 0.0, 0, 0.0, 0.0
    for outcome, p in expected.items():
        e, o = p * n, observed.get(outcome, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat += (o - e) ** 2 / e
        bins += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        bins += 1
    return float(torch.special.gammaincc(torch.tensor((bins - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def small_model():
    return build_model(VOCAB, seed=3).eval()


@pytest.mark.parametrize("branching,segment,max_new", [
    ([2, 2], 1, 2),
    pytest.param([2, 2, 2], 1, 3, marks=pytest.mark.slow),
    pytest.param([3, 2], 2, 3, marks=pytest.mark.slow),
])
def test_leaves_have_the_policy_marginal(small_model, branching, segment, max_new):
    """Each leaf position, over many trees, is distributed as one independent sample of the policy (the exact
    distribution by enumeration, repetition penalty and top-k included), tested with a chi-square at ALPHA."""
    prompt = [5, 6, 7, 3]
    config = _generation_config()
    expected = _exact_distribution(small_model, prompt, max_new, config)
    n_trees = 2000
    torch.manual_seed(0)
    trees, _ = sample_trees(small_model, [prompt] * n_trees, branching, segment, max_new, config, [EOS], PAD)
    g = math.prod(branching)
    # The first and the last leaf: the last one has only branched children on its path, the first only first ones.
    for j in (0, g - 1):
        observed: dict = {}
        for tree in trees:
            observed[tuple(tree.leaves[j])] = observed.get(tuple(tree.leaves[j]), 0) + 1
        p = _chi_square_p(observed, expected, n_trees)
        assert p > ALPHA, f"leaf {j}: chi-square p = {p:.2e}"
    # The test has power: the same trees scored against a different temperature are rejected.
    wrong = _exact_distribution(small_model, prompt, max_new, _generation_config(temperature=1.3))
    observed = {}
    for tree in trees:
        observed[tuple(tree.leaves[0])] = observed.get(tuple(tree.leaves[0]), 0) + 1
    assert _chi_square_p(observed, wrong, n_trees) < ALPHA


def test_siblings_share_their_parent_segment(small_model):
    """Leaves of one node agree on the node's tokens; an ended node's rows are copies of it."""
    torch.manual_seed(1)
    trees, _ = sample_trees(small_model, [[5, 6, 7, 3]] * 200, [2, 3], 2, 5, _generation_config(), [EOS], PAD)
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
    assert all(positions == 1 for _, positions in stats.forward_calls[1:])


def test_cache_reuse_gives_the_full_sequence_logits_and_no_refill():
    """float64 model: every sampled token's logits equal the model's on the whole sequence alone, unpadded (prompts of
    different lengths, left-padded together); after the one prefill of the prompts, every forward is one new position
    per row, so no shared segment is forwarded again. `generate` hands its logits over rounded to float32, so they are
    compared with the float32 rounding of the float64 reference: bit for bit (a float64 error above ~1e-15 relative
    would flip roundings). Norms in the input dtype: stock RMSNorm computes in float32."""
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
            assert torch.equal(logits, ref.float()), (logits - ref).abs().max()
            n_tokens += len(leaf)
    assert n_tokens > sum(map(len, prompts)) * 4  # long enough leaves were checked
    assert stats.forward_calls[0] == (len(prompts), max(map(len, prompts)) - 1)  # the prefill, once per prompt
    assert all(positions == 1 for _, positions in stats.forward_calls[1:]), stats.forward_calls
    # Rows per forward never exceed the level's children: the first level forwards 2 rows per prompt.
    assert stats.forward_calls[1][0] == len(prompts) * branching[0]


def test_tree_advantages_hand_computed():
    """Node value = mean advantage of the leaves below; segment advantage = node value - parent value."""
    # branching [2, 2], segments of 2 tokens; the second first-level node ended (its two rows are copies).
    tree = RolloutTree(
        leaves=[[3, 4, 5], [3, 4, 6, 7], [8, EOS], [8, EOS]],
        nodes=[[0, 1], [0, 2], [3], [3]],
        starts=[0, 2],
    )
    adv = torch.tensor([1.0, 3.0, -2.0, -2.0], dtype=torch.float64)
    out = tree_advantages(adv, [tree], width=5)
    root = 0.0
    v0, v3 = 2.0, -2.0
    expected = torch.tensor([
        [v0 - root, v0 - root, 1.0 - v0, 0, 0],
        [v0 - root, v0 - root, 3.0 - v0, 3.0 - v0, 0],
        [v3 - root, v3 - root, 0, 0, 0],
        [v3 - root, v3 - root, 0, 0, 0],
    ], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    # Along each leaf the segment advantages add up to its advantage minus the group mean (one value per segment).
    for j, leaf in enumerate(tree.leaves):
        per_segment = [out[j, s].item() for s in tree.starts[: len(tree.nodes[j])]]
        assert sum(per_segment) == pytest.approx(adv[j].item() - adv.mean().item())


def test_prompt_groups_refuse_rows_that_are_not_whole_groups():
    assert _prompt_groups([[1], [1], [2], [2]], 2) == [[1], [2]]
    with pytest.raises(ValueError, match="multiple of `num_generations`"):
        _prompt_groups([[1], [1], [2]], 2)
    with pytest.raises(ValueError, match="consecutive rows"):
        _prompt_groups([[1], [2], [1], [2]], 2)


# ---------------------------------------------------------------------------------------------------------- trainer

TREE = dict(dta_tree_branching=[2, 2], dta_tree_segment_length=2)


@pytest.mark.parametrize("advantage", ["group", "tree"])
def test_dta_equals_dense_on_the_same_trees(model_dir, tokenizer, dataset, tmp_path, advantage):
    """Tree rollouts through DTA equal TRL's dense path (`dta_enabled=False`) on the same sampled trees: same
    completions, logged metrics and SGD updates."""
    config = dict(TREE, dta_tree_advantage=advantage, max_completion_length=8, precision="fp64")
    ref = train(DTAGRPOTrainer, DTAGRPOConfig, model_dir, tokenizer, dataset, tmp_path / "ref", dta_enabled=False,
                **config)
    dta = train(DTAGRPOTrainer, DTAGRPOConfig, model_dir, tokenizer, dataset, tmp_path / "dta", **config)
    assert any(log["dta/generation_compression"] > 1.0 for log in dta.logs)
    assert all(log["dta/compression_ratio"] > 1.0 for log in dta.logs)
    worst = assert_equivalent(ref, dta)  # float64: within the float32 steps of TRL's head (`float64_rtol`)
    print(f"worst relative errors: {worst}")


def test_one_level_samples_trls_completions(model_dir, tokenizer, dataset, tmp_path):
    """`dta_tree_branching=[num_generations]` (the prompt prefilled once, its rows sampled together) draws the same
    random numbers for the same rows as TRL's `generate`: the same completions and the same training."""
    ref = train(GRPOTrainer, GRPOConfig, model_dir, tokenizer, dataset, tmp_path / "trl", steps=1, precision="fp64")
    tree = train(DTAGRPOTrainer, DTAGRPOConfig, model_dir, tokenizer, dataset, tmp_path / "tree", steps=1,
                 dta_tree_branching=[4], precision="fp64")
    assert tree.logs[0]["dta/generation_compression"] == 1.0
    assert_equivalent(ref, tree)  # DTA's training against TRL's dense one: see the test above


class _ReplayGRPOTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` whose generation returns recorded completions (and restores the random state the recorded
    run had after generating, so that TRL's shuffle draws the same rows)."""

    recorded: list = []

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        completions, prompts, rng = self.recorded.pop(0)
        assert [list(p) for p in prompt_ids] == prompts
        torch.set_rng_state(rng)
        return completions, None


def test_default_advantages_are_trls_on_the_same_leaves(model_dir, tokenizer, dataset, tmp_path):
    """With `dta_tree_advantage='group'` everything after generation is TRL's: TRL's own GRPOTrainer given the same
    leaves logs the same advantages/rewards/loss and makes the same updates as the DTA trainer with tree rollouts."""
    recorded = []

    def record(trainer):
        generate = trainer._dta_trees.generate

        def recording(trainer_, prompt_ids, num_generations):
            completions, logprobs = generate(trainer_, prompt_ids, num_generations)
            recorded.append(([list(c) for c in completions], [list(p) for p in prompt_ids], torch.get_rng_state()))
            return completions, logprobs

        trainer._dta_trees.generate = recording

    config = dict(TREE, max_completion_length=8, precision="fp64")
    dta = train(DTAGRPOTrainer, DTAGRPOConfig, model_dir, tokenizer, dataset, tmp_path / "dta", setup=record, **config)
    _ReplayGRPOTrainer.recorded = list(recorded)
    ref = train(_ReplayGRPOTrainer, GRPOConfig, model_dir, tokenizer, dataset, tmp_path / "trl",
                max_completion_length=8, precision="fp64")
    assert not _ReplayGRPOTrainer.recorded
    worst = assert_equivalent(ref, dta)
    print(f"worst relative errors: {worst}")


# ---------------------------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("overrides,error,match", [
    (dict(dta_tree_branching=[4, 2]), ValueError, "product of the branching factors"),
    (dict(dta_tree_branching=[2, 2]), ValueError, "set `dta_tree_segment_length`"),
    (dict(dta_tree_branching=[2, 2], dta_tree_segment_length=6), ValueError, "segment length below 6"),
    (dict(dta_tree_branching=[2, 2], dta_tree_segment_length=2, use_vllm=True), ValueError, "vLLM"),
    (dict(dta_tree_branching=[2, 2], dta_tree_segment_length=2, cache_implementation="static"), ValueError,
     "cache_implementation"),
    (dict(dta_tree_branching=[2, 2], dta_tree_segment_length=2, use_transformers_continuous_batching=True),
     ValueError, "continuous"),
    (dict(dta_tree_branching="2 2"), TypeError, "list of positive integers"),
    (dict(dta_tree_branching=4), TypeError, "list of positive integers"),
    (dict(dta_tree_branching=[2, True]), TypeError, "dta_tree_branching"),
    (dict(dta_tree_branching=[2.0, 2]), TypeError, "dta_tree_branching"),
    (dict(dta_tree_branching=[4, 0]), ValueError, "positive"),
    (dict(dta_tree_branching=[]), ValueError, "at least one level"),
    (dict(dta_tree_branching=[2, 2], dta_tree_segment_length=0), ValueError, "dta_tree_segment_length"),
    (dict(dta_tree_branching=[2, 2], dta_tree_segment_length=2.5), TypeError, "dta_tree_segment_length"),
    (dict(dta_tree_branching=[2, 2], dta_tree_segment_length=2, dta_tree_advantage="node"), ValueError,
     "dta_tree_advantage"),
    (dict(dta_tree_segment_length=2), ValueError, "set\n?.*`dta_tree_branching`"),
])
def test_bad_configurations_are_refused(tmp_path, overrides, error, match):
    with pytest.raises(error, match=match):
        make_args(DTAGRPOConfig, tmp_path, **overrides)


def test_rloo_refuses_tree_rollouts(tmp_path):
    with pytest.raises(ValueError, match="DTAGRPOTrainer"):
        make_args(DTARLOOConfig, tmp_path, **TREE)


@pytest.mark.parametrize("kwargs,match", [
    (dict(generation_kwargs={"forced_eos_token_id": EOS}), "forced_eos_token_id"),
    (dict(generation_kwargs={"num_beams": 2}), "num_beams"),
    (dict(trainer_kwargs={"rollout_func": lambda prompts, trainer: {}}), "rollout_func"),
])
def test_trainer_refuses_what_trees_cannot_sample(model_dir, tokenizer, dataset, tmp_path, kwargs, match):
    trainer_kwargs = kwargs.pop("trainer_kwargs", {})
    args = make_args(DTAGRPOConfig, tmp_path, **TREE, **kwargs)
    with pytest.raises(ValueError, match=match):
        DTAGRPOTrainer(model=model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                       train_dataset=dataset, processing_class=tokenizer, **trainer_kwargs)


def test_command_line_lists(tmp_path):
    """`--dta_tree_branching 4 2` on TRL's parser gives the list [4, 2]."""
    (args,) = TrlParser((DTAGRPOConfig,)).parse_args_into_dataclasses([
        "--output_dir", str(tmp_path), "--use_cpu", "true", "--num_generations", "8", "--per_device_train_batch_size", "8",
        "--dta_tree_branching", "4", "2", "--dta_tree_segment_length", "16", "--dta_tree_advantage", "tree",
    ])
    assert args.dta_tree_branching == [4, 2] and args.dta_tree_segment_length == 16
    assert args.dta_tree_advantage == "tree"
    (default,) = TrlParser((DTAGRPOConfig,)).parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu",
                                                                          "true"])
    assert default.dta_tree_branching is None and default.dta_tree_segment_length is None


def test_vision_language_models_are_refused(model_dir, tokenizer, dataset, tmp_path):
    """The refusal `TreeRollouts.from_trainer` applies to a trainer whose model TRL identified as vision-language (a
    real trainer with TRL's `_is_vlm` flag set, as no vision model is built offline here)."""
    from trl_dta.trainers.tree_rollouts import TreeRollouts

    args = make_args(DTAGRPOConfig, tmp_path, dta_enabled=False, **TREE)
    trainer = DTAGRPOTrainer(model=model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                             args=args, train_dataset=dataset, processing_class=tokenizer)
    assert isinstance(trainer._dta_trees, TreeRollouts)
    trainer._is_vlm = True
    with pytest.raises(ValueError, match="vision-language"):
        TreeRollouts.from_trainer(trainer)
