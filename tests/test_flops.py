"""Analytic FLOP counts: per-token formulas, tree vs dense bookkeeping against brute force, named shapes."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen3Config

from trl_dta.flops import (
    MODEL_SHAPES,
    ModelShape,
    dense_flops,
    get_model_shape,
    ideal_ratio,
    padded_dense_flops,
    tree_flops,
)
from trl_dta.tree import PrefixTree

SHAPE = ModelShape(hidden_size=8, intermediate_size=12, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=2,
                   vocab_size=10)


def test_per_token_formulas():
    # q: 8x8, k,v: 8x4 each, o: 8x8, mlp: 3 x 8x12 -> multiply-adds per layer, x2 FLOPs, x2 layers
    macs_per_layer = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 12
    assert SHAPE.linear_flops_per_token == 2 * 2 * macs_per_layer
    # QK^T and AV: 2 products of head_dim per head per key, 2 FLOPs each, 2 layers
    assert SHAPE.attention_flops_per_key == 2 * 2 * 2 * 4 * 2
    assert SHAPE.lm_head_flops_per_position == 2 * 8 * 10


def test_dense_counts_and_backward_factor():
    fwd = dense_flops([3, 1], SHAPE, training=False)
    assert (fwd.tokens, fwd.attention_keys, fwd.lm_head_positions) == (4, 6 + 1, 2)
    assert fwd.total == fwd.forward == (
        4 * SHAPE.linear_flops_per_token + 7 * SHAPE.attention_flops_per_key + 2 * SHAPE.lm_head_flops_per_position
    )
    assert dense_flops([3, 1], SHAPE).total == 3 * fwd.total
    # sequences or lengths
    assert dense_flops([[5, 6, 7], [1]], SHAPE).total == dense_flops([3, 1], SHAPE).total


def test_padded_dense_counts():
    flops = padded_dense_flops([3, 1, 2], SHAPE, micro_batch_size=2, training=False)
    # micro-batch 1: 2 rows of width 3; micro-batch 2: 1 row of width 2
    assert flops.tokens == 2 * 3 + 2
    assert flops.attention_keys == 2 * 6 + 3
    assert flops.lm_head_positions == 2 * 2 + 1
    full = padded_dense_flops([3, 1, 2], SHAPE, micro_batch_size=2, training=False, causal_skip=False)
    assert full.attention_keys == 2 * 9 + 4
    assert padded_dense_flops([3, 1, 2], SHAPE, 1).total == dense_flops([3, 1, 2], SHAPE).total
    with pytest.raises(ValueError, match="micro_batch_size"):
        padded_dense_flops([3], SHAPE, 0)


def _brute_force_tree_counts(seqs):
    """Distinct prefixes = tree tokens; a prefix of length d+1 attends d+1 keys; it is projected by the LM head iff
    some sequence continues it."""
    prefixes = {tuple(s[: n + 1]) for s in seqs for n in range(len(s))}
    continued = {tuple(s[:n]) for s in seqs for n in range(1, len(s))}
    return len(prefixes), sum(len(p) for p in prefixes), len(prefixes & continued)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=7), min_size=1, max_size=7))
def test_tree_counts_match_brute_force(seqs):
    tree = PrefixTree.from_sequences(seqs)
    flops = tree_flops(tree, SHAPE, training=False)
    assert (flops.tokens, flops.attention_keys, flops.lm_head_positions) == _brute_force_tree_counts(seqs)
    dense = dense_flops(seqs, SHAPE)
    assert tree_flops(tree, SHAPE).total <= dense.total
    if tree.n_tree_tokens:
        assert ideal_ratio(seqs, SHAPE) == pytest.approx(dense.total / tree_flops(tree, SHAPE).total)


def test_ideal_ratio_grpo_and_no_sharing():
    # no sharing: ratio exactly 1
    seqs = [[i] + [5] * 9 for i in range(4)]
    assert ideal_ratio(seqs, SHAPE) == pytest.approx(1.0)
    # GRPO with a negligible attention/LM-head share: ratio close to the compression G (P + R) / (P + G R)
    shape = ModelShape(4096, 11008, 2, 32, 32, 128, 16, name="linear-heavy")
    P, G, R = 100, 8, 10
    prompt = list(range(P))
    seqs = [prompt + [1000 + g] + [7] * (R - 1) for g in range(G)]
    compression = G * (P + R) / (P + G * R)
    assert ideal_ratio(seqs, shape) == pytest.approx(compression, rel=0.02)
    # attention makes deep shared prefixes worth less than their token count
    assert ideal_ratio(seqs, SHAPE) < compression


def test_shapes_from_configs_and_names():
    config = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=100)
    shape = get_model_shape(config)
    assert (shape.hidden_size, shape.intermediate_size, shape.num_layers, shape.num_heads, shape.num_kv_heads,
            shape.head_dim, shape.vocab_size) == (64, 96, 3, 4, 2, 32, 100)
    # head_dim derived from hidden / heads when the config has none
    qwen2 = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=50)
    assert ModelShape.from_config(qwen2).head_dim == 16
    for name in ("qwen3-1.7b", "qwen3-8b", "qwen2-0.5b", "bench-cpu", "bench-cpu-quick"):
        assert get_model_shape(name) is MODEL_SHAPES[name]
    assert get_model_shape("Qwen3-1.7B").num_layers == 28
    with pytest.raises(ValueError, match="unknown model shape"):
        get_model_shape("gpt-9")
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelShape(8, 8, 1, 4, 3, 2, 10)
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape(0, 8, 1, 4, 2, 2, 10)


def test_bench_shape_matches_the_model_it_builds():
    """The benchmark model built from a named shape has the parameter count the shape implies."""
    from benchmarks.harness.models import build_model

    shape = MODEL_SHAPES["bench-cpu-quick"]
    model = build_model(shape)
    assert get_model_shape(model.config).linear_flops_per_token == shape.linear_flops_per_token
    n_linear = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    assert 2 * n_linear == shape.linear_flops_per_token  # 2 FLOPs per weight per token


def test_count_matches_torch_flop_counter():
    """The linear + LM-head forward count equals what torch's FLOP counter sees for the model's matmuls, minus
    attention (counted separately)."""
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.harness.models import build_model

    shape = ModelShape(64, 96, 2, 4, 2, 16, 128, name="tiny")
    model = build_model(shape, attn_implementation="eager")
    L = 12
    ids = torch.randint(0, 128, (1, L))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=ids)
    counts = counter.get_flop_counts()["Global"]
    matmul_like = sum(v for k, v in counts.items() if "mm" in str(k) or "matmul" in str(k))
    # eager attention computes the full L x L scores (masked afterwards): L * L keys per query block
    expected = (
        L * shape.linear_flops_per_token
        + L * L * shape.attention_flops_per_key
        + L * shape.lm_head_flops_per_position
    )
    assert matmul_like == expected


def test_combinations_of_sharing_and_depth():
    # two sequences sharing d tokens of n: tree keys = dense keys - shared keys
    for n, d in itertools.product([4, 6], [0, 2, 3]):
        a = list(range(n))
        b = a[:d] + [100 + t for t in range(n - d)]
        tree = tree_flops([a, b], SHAPE, training=False)
        assert tree.tokens == 2 * n - d
        assert tree.attention_keys == 2 * (n * (n + 1) // 2) - d * (d + 1) // 2


# ---------------------------------------------------------------------------------------------------- peak memory


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h", "bamba"])
def test_hybrid_shape_counts_the_model_forward(family):
    """A hybrid's shape read from its config (`ModelShape.from_config`: attention, recurrent and MLP layers) counts
    the matmul FLOPs of the real forward as torch's `FlopCounterMode` measures them, within 15%: what the formula
    leaves out (the decays' and gates' elementwise work, the chunked scans' padding to whole chunks) is a few percent
    of a layer (measured: 4%, 8% and 10% under)."""
    from torch.utils.flop_counter import FlopCounterMode

    from hybrid_models import make_hybrid

    # No parameter requires grad: with transformers 5.25's hybrid layers, the counter's module tracker registers
    # gradient hooks on a module input that requires grad without a gradient function, which fails under no_grad.
    model = make_hybrid(family, torch.float32).eval().requires_grad_(False)
    shape = ModelShape.from_config(model.config)
    assert shape.recurrent_layers == 2 and shape.recurrent_flops_per_token > 0
    length = 128
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(3, 61, (1, length)), use_cache=False)
    count = dense_flops([length], shape, training=False)
    predicted = count.linear + count.attention + length * shape.lm_head_flops_per_position  # the forward projects all
    assert abs(predicted / counter.get_total_flops() - 1) <= 0.15, (predicted, counter.get_total_flops())


def test_hybrid_attention_grows_only_in_attention_layers():
    """The state of a recurrent layer does not grow with the path: only the attention layers' per-key term does, so a
    deep tree's ideal speed-up on a hybrid is closer to its compression ratio than on the attention-only model of the
    same width."""
    import transformers

    hybrid = ModelShape.from_config(transformers.Qwen3_5TextConfig())
    assert hybrid.to_dict() == {**MODEL_SHAPES["qwen3.5-9b"].to_dict(), "name": hybrid.name}
    dense = ModelShape(**{k: v for k, v in hybrid.to_dict().items()
                          if k in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                                   "head_dim", "vocab_size")})
    assert hybrid.attention_flops_per_key * 4 == dense.attention_flops_per_key  # 8 of 32 layers attend
    seqs = [[0] * 8000 + [1 + k] * 200 for k in range(8)]
    tree = PrefixTree.from_sequences(seqs)
    assert ideal_ratio(tree, dense) < ideal_ratio(tree, hybrid) < tree.compression_ratio
    with pytest.raises(ValueError, match="recurrent_kind"):
        ModelShape(64, 64, 2, 2, 2, 8, 10, recurrent_layers=1)
