"""The peak-memory estimate of a DTA step: per-token sizes, hand-computed walks per attention backend, the issue's
figures, and the replayed walk against the engine's own statistics."""

import doctest

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybrid_models import make_hybrid
from trl_dta import DTAEngine
from trl_dta.engine.schedule import Budgets
from trl_dta.flops import ModelShape, get_model_shape
from trl_dta.memory import _grad_forwards, activation_bytes_per_token, kv_bytes_per_token, peak_memory
from trl_dta.tree import PrefixTree

SHAPE = ModelShape(hidden_size=8, intermediate_size=12, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=2,
                   vocab_size=10)

# SHAPE in fp32: K/V 2 x 2 layers x 2 kv heads x 2 x 4 bytes = 64 bytes per token; activations per layer
# 4 x (4*8 + 8 + 2*4 + 2*8 + 4*12) + 4 x (2*8 + 4) = 528 bytes, x 2 layers, + final norm 4*8 + 4*8 = 1120 bytes.
KV, ACT = 64, 1120


def test_per_token_memory():
    assert kv_bytes_per_token(SHAPE, "fp32") == KV
    assert activation_bytes_per_token(SHAPE, "fp32") == ACT
    # the issue's figure: Qwen3-8B, bf16: 36 layers x 8 kv heads x 128 x 2 (K and V) x 2 bytes
    assert kv_bytes_per_token("qwen3-8b", "bf16") == 147_456
    assert kv_bytes_per_token(get_model_shape("qwen3-8b"), "fp32") == 2 * 147_456
    with pytest.raises(ValueError, match="dtype 'int8'"):
        kv_bytes_per_token(SHAPE, "int8")


def _prompt_with_leaves(prompt: int, leaves: int, leaf_len: int) -> list[list[int]]:
    return [[0] * prompt + [1 + leaf] * leaf_len for leaf in range(leaves)]


def test_peak_memory_kept_prompt_and_one_batch_of_leaves():
    # prompt 10 walked (max_pack_tokens=0) and kept; the 3 leaves of 4 tokens run as one batch of 3 rows
    seqs = _prompt_with_leaves(10, 3, 4)
    m = peak_memory(seqs, SHAPE, "sdpa", "fp32", max_pack_tokens=0)
    assert (m.path_tokens, m.graph_tokens, m.rows, m.row_tokens) == (10, 10, 3, 12)
    assert m.path_kv == 2 * 10 * KV  # keys/values and their gradient sinks
    assert m.path_graph == 10 * ACT
    assert m.batch_activations == 12 * ACT
    assert m.prefix_copies == 3 * 10 * KV
    assert m.total == 1280 + 11200 + 13440 + 1920
    for backend in ("torch", "flash", "triton"):
        two_part = peak_memory(seqs, SHAPE, backend, "fp32", max_pack_tokens=0)
        assert two_part.prefix_copies == 0
        assert two_part.total == m.total - m.prefix_copies
    # a batch budget of 8 tokens: batches of 2 and 1 rows, the copies follow the rows
    m = peak_memory(seqs, SHAPE, "sdpa", "fp32", max_pack_tokens=0, max_batch_tokens=8)
    assert (m.rows, m.row_tokens, m.prefix_copies) == (2, 8, 2 * 10 * KV)
    # packed (the default max_pack_tokens): the whole 22-token tree is one row with no path
    m = peak_memory(seqs, SHAPE, "sdpa", "fp32")
    assert (m.path_tokens, m.rows, m.row_tokens, m.prefix_copies) == (0, 1, 22, 0)


def test_peak_memory_recompute_mode():
    # max_graph_tokens=0: the prompt runs without grad and is re-forwarded in blocks of 4 at pop; each leaf runs
    # alone in blocks (it does not fit the graph budget either), under the whole 10-token path
    seqs = _prompt_with_leaves(10, 3, 4)
    m = peak_memory(seqs, SHAPE, "sdpa", "fp32", max_pack_tokens=0, max_graph_tokens=0, block_size=4)
    assert (m.path_tokens, m.graph_tokens, m.rows, m.row_tokens) == (10, 0, 1, 4)
    assert m.total == 2 * 10 * KV + 4 * ACT + 10 * KV
    # half precision: the stack's gradient sinks are float32, the copies in the compute dtype
    half = peak_memory(seqs, SHAPE, "sdpa", "bf16", max_pack_tokens=0, max_graph_tokens=0, block_size=4)
    assert half.path_kv == 2 * 10 * KV and half.prefix_copies == 10 * KV // 2


def test_peak_memory_issue_figures():
    # a 2K-token prompt with 16 completions on an 8B model in bf16: ~4.8 GB of prompt copies with "sdpa"
    seqs = _prompt_with_leaves(2048, 16, 256)
    sdpa = peak_memory(seqs, "qwen3-8b", "sdpa")
    assert sdpa.rows == 16 and sdpa.path_tokens == 2048
    assert sdpa.prefix_copies == 16 * 2048 * 147_456 == 4_831_838_208
    flash = peak_memory(seqs, "qwen3-8b", "flash")
    assert flash.prefix_copies == 0 and sdpa.total - flash.total == sdpa.prefix_copies
    # an 8K system prompt with 64 leaves in one forward: ~75 GB (77.3e9 bytes) of copies
    seqs = _prompt_with_leaves(8192, 64, 128)
    assert peak_memory(seqs, "qwen3-8b", "sdpa").prefix_copies == 64 * 8192 * 147_456


def test_peak_memory_docstring_example_and_errors():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for test in finder.find(peak_memory, "peak_memory", globs={}):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
    assert runner.summarize(verbose=False).attempted > 0
    with pytest.raises(ValueError, match="attention backend 'auto'"):
        peak_memory([[1, 2]], SHAPE, "auto")
    with pytest.raises(ValueError, match="dtype 'float8'"):
        peak_memory([[1, 2]], SHAPE, "sdpa", "float8")


@pytest.mark.parametrize("hybrid", [False, True], ids=["qwen2", "qwen3_5_text"])
@pytest.mark.parametrize("budgets", [
    dict(max_pack_tokens=0),
    dict(max_pack_tokens=6, max_batch_tokens=12),
    dict(max_pack_tokens=0, max_graph_tokens=0, block_size=3),
    dict(max_pack_tokens=4, max_graph_tokens=9, block_size=4, max_batch_tokens=10),
])
def test_replayed_walk_matches_the_engine(budgets, hybrid):
    """The estimate's replay of the walk sees the forwards with grad that the engine runs: the same peak of graph
    tokens, the same padded tokens (the engine's other forwards are the no-grad passes of the recomputed blocks), and
    with every graph kept the same number of forwards. A hybrid (Gated DeltaNet layers beside attention) replays the
    hybrid schedule: no packed rows, one-token internal segments unshared, no one-token block (a one-token forward
    after a path is padded to two, which the estimate counts as the walk forwards it)."""

    config = Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = make_hybrid("qwen3_5_text", torch.float32, vocab=40) if hybrid else Qwen2ForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 40, (7,), generator=g).tolist()
    seqs = [prompt + [3 + k] + torch.randint(3, 40, (n,), generator=g).tolist() for k, n in enumerate([2, 5, 1, 9])]
    seqs += [seqs[1][:10] + [30, 31, 32], seqs[1][:10] + [33], [20, 21, 22, 23, 24, 25]]
    engine = DTAEngine(model, **budgets)
    out = engine.forward_backward(seqs, lambda i, lp, ent: lp.sum())
    full = dict(block_size=1024, max_batch_tokens=8192, max_graph_tokens=None, max_pack_tokens=None,
                lm_head_chunk_size=1, cost=engine.row_cost()) | budgets
    tree = PrefixTree.from_sequences(seqs)
    if hybrid:
        full["max_pack_tokens"] = 0
        tree = tree.unshared()
    forwards = list(_grad_forwards(tree, Budgets(**full), hybrid=hybrid))
    assert max(graph + tokens for _, graph, _, tokens, _ in forwards) == out.stats["peak_graph_tokens"]
    if not hybrid:
        assert sum(tokens for _, _, _, tokens, _ in forwards) + out.stats["recomputed_tokens"] == \
            out.stats["padded_tokens"]
    if full["max_graph_tokens"] is None:
        assert len(forwards) == out.stats["forwards"]


def test_hybrid_holds_keys_of_attention_layers_and_states_per_frame():
    """Qwen3.5-9B-shaped (`flops.MODEL_SHAPES["qwen3.5-9b"]`: 8 attention, 24 Gated DeltaNet layers): keys/values of
    the 8 attention layers per token, and per frame of the path each recurrent layer's float32 state and conv tail."""
    from trl_dta.flops import MODEL_SHAPES
    from trl_dta.memory import state_bytes_per_frame

    shape = MODEL_SHAPES["qwen3.5-9b"]
    assert kv_bytes_per_token(shape, "bf16") == 2 * 8 * 4 * 256 * 2
    conv = 2 * 16 * 128 + 32 * 128  # q, k, v channels
    assert state_bytes_per_frame(shape, "bf16") == 24 * (4 * 32 * 128 * 128 + 2 * conv * 3)
    assert state_bytes_per_frame(SHAPE) == 0
    seqs = [[0] * 4096 + [1 + leaf] * 512 for leaf in range(16)]
    m = peak_memory(seqs, shape, "torch")
    assert m.path_tokens == 4096 and m.path_kv == 2 * 4096 * kv_bytes_per_token(shape, "fp32") + \
        2 * state_bytes_per_frame(shape, "fp32")  # one frame: the prompt
