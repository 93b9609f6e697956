"""`trl_dta.generation.PrefixCache`: the logits of every forwarded token against the model's own full-sequence forward,
each token forwarded once, shared parts stored once, chunked prefill, and the refusals."""

from __future__ import annotations

import pytest
import torch
import transformers

from bounds import assert_as_precise_as_dense
from tests.conftest import VOCAB, make_model
from trl_dta.generation import PrefixCache
from trl_dta.refusal import DTAUnsupportedError
from trl_dta.tree import PrefixTree


def _full_logits(model, tokens: list[int]) -> torch.Tensor:
    """The oracle: the sequence alone, unpadded, through the model's own attention."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def _rnd(g, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _play(cache: PrefixCache, model, seed: int = 0, check: bool = True) -> tuple[float, list[list[int]]]:
    """A forest with every shape the rollouts make: a shared system prompt longer than the chunks and the sliding
    windows, two identical prompts and a distinct one, rows growing by uneven amounts (1 to 9 tokens: replies of
    different lengths in one forward), a branch into 1, 2 and 3 children, a released row, a branch of a row with
    nothing of its own. Returns the largest logit error against the oracle and every sequence the rows held."""
    g = torch.Generator().manual_seed(seed)
    system = _rnd(g, 23)
    a, b = system + _rnd(g, 4), system + _rnd(g, 9)
    rows = cache.add_prompts([a, a, b])
    err, sequences = 0.0, []
    for step in range(8):
        logits = cache.logits(rows)
        if check:
            for row, row_logits in zip(rows, logits):
                err = max(err, (row_logits - _full_logits(model, cache.tokens(row))).abs().max().item())
        if step == 4:  # everything of the row forwarded
            sequences.append(list(cache.tokens(rows[0])))
            cache.release(rows[:1])
            rows = rows[1:]
        for i, row in enumerate(rows):
            cache.extend(row, _rnd(g, 1 + (3 * i + step) % 9))
        if step == 2:
            rows = [r for kids in cache.branch(rows, [2, 1, 3]) for r in kids]
            for row in rows:  # siblings diverge at once
                cache.extend(row, _rnd(g, 1))
        if step == 5:
            rows = cache.branch(rows[:1], [2])[0] + rows[1:]
            rows = cache.branch(rows[:1], [2])[0] + rows[1:]  # the first child owns nothing yet
            for row in rows[:3]:
                cache.extend(row, _rnd(g, 2))
    cache.logits(rows)
    sequences += [list(cache.tokens(row)) for row in rows]
    return err, sequences


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3"])
def test_logits_equal_the_full_sequence_forward_in_float64(family):
    """Every row's next-token logits, after every step of `_play`, equal the model's own forward of the row's whole
    sequence: float64, the norms computed in float64 (`make_model`), so the only difference is the order of the
    attention's sums (parts merged by log-sum-exp): ~1e-15 for logits of size ~1. Mistral and Gemma 3 have sliding
    windows of 5 (shorter than the shared prompt), Qwen3 has q/k norms, Gemma 3 scaled embeddings and a final
    logit soft-cap."""
    model = make_model(family, torch.float64).eval()
    err, _ = _play(PrefixCache(model, chunk_tokens=5, max_batch_tokens=12), model)
    assert err < 1e-10, f"{family}: max logit error {err:.2e}"


def test_every_token_forwarded_once_and_shared_parts_stored_once():
    """The cache forwards each token of the forest of its rows once (the forest's tree tokens: PrefixTree over every
    sequence its rows held), in forwards no wider than `chunk_tokens`; the shared system prompt lives in one node and
    never in the rows' buffer."""
    model = make_model("qwen2", torch.float64).eval()
    widths = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    cache = PrefixCache(model, chunk_tokens=5, max_batch_tokens=12)
    try:
        _, sequences = _play(cache, model, check=False)
    finally:
        hook.remove()
    tree = PrefixTree.from_sequences([torch.tensor(s) for s in sequences])
    assert cache.stats.forward_tokens == tree.n_tree_tokens == sum(b * w for b, w in widths)
    assert max(w for _, w in widths) <= 5 and max(b * w for b, w in widths) <= 12
    # The system prompt is one node, the rest of the prompt two rows share another below it (a prompt of one row
    # stays that row's own); rows own only what follows.
    assert [(n.length, n.parent) for n in cache.nodes[:2]] == [(23, None), (4, 0)]
    assert all(n.start >= 23 for n in cache.nodes[1:]) and all(r.offset >= 23 for r in cache._rows.values())
    assert sum(n.length for n in cache.nodes) == cache.stats.frozen_tokens


def test_bf16_autocast_within_the_dense_paths_error():
    """Under bf16 autocast over float32 weights (TRL's default precision), the cache's logits are as far from the
    float64 model's as the dense bf16 forward's are, within the derived multiple of the dense path's own error
    (`bounds.forward_slack`, relative L2 over every logit of every step; the parts are computed in bf16 like SDPA's
    inputs and merged in float32)."""
    model32 = make_model("qwen2", torch.float32, exact_norms=False).eval()
    model64 = make_model("qwen2", torch.float64, exact_norms=False).eval()
    cache = PrefixCache(model32, chunk_tokens=5)
    rows = cache.add_prompts([list(range(3, 40)), list(range(3, 35)) + [9, 9, 9, 9]])
    got, dense, exact = [], [], []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for step in range(4):
            logits = cache.logits(rows)
            for row, row_logits in zip(rows, logits):
                exact.append(_full_logits(model64, cache.tokens(row)))
                dense.append(_full_logits(model32, cache.tokens(row)).double())
                got.append(row_logits.double())
            for row in rows:
                cache.extend(row, [5 + step, 7])
    assert_as_precise_as_dense(got, dense, exact, "bf16 logits of the cache")


def test_refusals():
    """Bad arguments and models the cache cannot hold are refused with the argument or the reason named."""
    model = make_model("qwen2", torch.float64).eval()
    with pytest.raises(ValueError, match="chunk_tokens"):
        PrefixCache(model, chunk_tokens=0)
    cache = PrefixCache(model)
    with pytest.raises(ValueError, match="non-empty"):
        cache.add_prompts([[3, 4], []])
    [row] = cache.add_rows([[3, 4]])
    with pytest.raises(ValueError, match="2 counts"):
        cache.branch([row], [1, 2])
    cache.release([row])
    with pytest.raises(ValueError, match="not a live row"):
        cache.logits([row])
    [empty] = cache.add_rows([[]])
    with pytest.raises(ValueError, match="nothing to predict"):
        cache.logits([empty])
    # A model whose layers compute attention in their own code (never the attention interface).
    neo = transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, attention_types=[[["global"], 2]],
        max_position_embeddings=64, bos_token_id=1, eos_token_id=2)).eval()
    cache = PrefixCache(neo)
    with pytest.raises(DTAUnsupportedError, match="generation_cache=False"):
        cache.logits(cache.add_rows([[3, 4, 5]]))
