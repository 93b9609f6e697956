"""The benchmark's peers compute what they claim: the packed tree-mask ("sparse") provider and the dense provider give
the per-sequence oracle's log-probs, loss and parameter gradients.

The oracle is the plain model on each sequence alone (unpadded, `position_ids = arange`). In float64 with the norms
computed in the input dtype (stock RMSNorm casts to float32 inside, see `conftest.use_input_dtype_norms`) the sparse
provider's exact LM head matches to ~1e-10; its TRL-kernel head (float32 statistics) and the dense provider (TRL's fused
head) are judged in float32 against the float64 twin of the model, as precise as the float32 oracle (`bounds.py`).
"""

import types

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks.baselines.dense import DenseProvider
from benchmarks.baselines.sparse import SparseProvider, micro_batches, tree_attention_mask, tree_layout
from bounds import assert_as_precise_as_dense, max_sharing
from conftest import float64_twin
from trl_dta.tree import PrefixTree


def _native_dtype_norms(model):
    """Rebind every RMSNorm's forward to compute in the input dtype (no float32 round trip)."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):

            def forward(self, x):
                var = x.pow(2).mean(-1, keepdim=True)
                return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))

            module.forward = types.MethodType(forward, module)
    return model


def _model(dtype, seed=0, vocab=61):
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype)
    # larger weights than the default init, so that a wrong mask or position changes the numbers visibly
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.train()


def _seqs():
    # shared prompt, a sequence that is a prefix of another, a duplicate, a length-1 sequence, an unrelated sequence
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 61, (9,), generator=g)
    a = torch.cat([prompt, torch.randint(3, 61, (7,), generator=g)])
    b = torch.cat([prompt, torch.randint(3, 61, (4,), generator=g)])
    c = torch.cat([b, torch.randint(3, 61, (5,), generator=g)])
    return [a, b, c, a.clone(), prompt[:1].clone(), torch.randint(3, 61, (12,), generator=g), prompt.clone()]


def _loss_fn(n):
    weights = torch.linspace(-1.0, 1.5, n, dtype=torch.float64)

    def loss_fn(i, logps, entropy=None):
        # non-linear in the log-probs, so that per-sequence gradients must be routed correctly
        return weights[i].to(logps.dtype) * logps.sum() + 0.1 * (logps**2).mean() if len(logps) else logps.sum()

    return loss_fn


def _oracle(model, seqs, loss_fn):
    model.zero_grad(set_to_none=True)
    logps, total = [], 0.0
    for i, s in enumerate(seqs):
        logits = model(input_ids=s[None], position_ids=torch.arange(len(s))[None]).logits[0, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, s[1:, None])[:, 0]
        loss = loss_fn(i, lp)
        loss.backward()
        total += loss.item()
        logps.append(lp.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logps, total, grads


def _run(provider, model, seqs, loss_fn):
    model.zero_grad(set_to_none=True)
    out = provider.forward_backward(seqs, loss_fn)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out, grads


def _assert_close(out, grads, ref, rtol):
    ref_logps, ref_loss, ref_grads = ref
    for i, (x, y) in enumerate(zip(out.logps, ref_logps)):
        assert x.shape == y.shape, f"sequence {i}: shape {tuple(x.shape)} != {tuple(y.shape)}"
        torch.testing.assert_close(x.to(y.dtype), y, rtol=rtol, atol=rtol, msg=lambda m: f"logps of sequence {i}: {m}")
    assert abs(out.loss - ref_loss) <= rtol * max(1.0, abs(ref_loss)), (out.loss, ref_loss)
    for name, g in ref_grads.items():
        scale = g.abs().max().clamp(min=1e-12)
        err = (grads[name] - g).abs().max() / scale
        assert err <= rtol, f"gradient of {name}: max error {err:.3e} relative to max |g| {scale:.3e}"


def test_tree_mask_is_ancestor_or_self():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2], [7, 8]]
    tree = PrefixTree.from_sequences(seqs)
    mask = tree_attention_mask(tree)
    token_sets = [set(tree.token_index(i).tolist()) for i in range(len(seqs))]
    expected = torch.zeros_like(mask)
    for i in range(len(seqs)):
        idx = tree.token_index(i)
        for t in range(len(idx)):
            expected[idx[t], idx[: t + 1]] = True
    assert torch.equal(mask, expected)
    assert sorted(tree_layout(tree)["depth"].tolist()) == sorted([0, 1, 2, 3, 3, 4, 0, 1])
    assert all(len(s) for s in token_sets)


@pytest.mark.parametrize("attention", ["mask", "blocks"])
@pytest.mark.parametrize("max_tokens", [None, 20])
def test_sparse_matches_oracle_float64(attention, max_tokens):
    model = _native_dtype_norms(_model(torch.float64))
    seqs = _seqs()
    loss_fn = _loss_fn(len(seqs))
    ref = _oracle(model, seqs, loss_fn)
    provider = SparseProvider(model, attention=attention, block_size=4, max_tokens=max_tokens, lm_head="torch")
    out, grads = _run(provider, model, seqs, loss_fn)
    if max_tokens is not None:
        assert out.stats["micro_batches"] > 1
    _assert_close(out, grads, ref, rtol=1e-10)
    assert model.config._attn_implementation == "sdpa"  # restored after the block-sparse forward


def _assert_as_precise(out, grads, exact, seqs, ref):
    """float32: the provider's log-probs and gradients against the float64 twin's (`exact`), within the derived
    multiple of the float32 oracle's own error (`bounds.assert_as_precise_as_dense`)."""
    exact_logps, _, exact_grads = exact
    assert_as_precise_as_dense(out.logps, ref[0], exact_logps, "log-probs")
    assert_as_precise_as_dense(grads, ref[2], exact_grads, "gradients", sharing=max_sharing(seqs))


def test_sparse_trl_head_matches_oracle_float32():
    model = _model(torch.float32)
    seqs = _seqs()
    loss_fn = _loss_fn(len(seqs))
    ref = _oracle(model, seqs, loss_fn)
    exact = _oracle(_native_dtype_norms(float64_twin(model)), seqs, loss_fn)
    out, grads = _run(SparseProvider(model, attention="blocks", block_size=8, lm_head="trl"), model, seqs, loss_fn)
    _assert_as_precise(out, grads, exact, seqs, ref)


@pytest.mark.parametrize("micro_batch_size,ckpt", [(1, False), (3, False), (3, True), (8, False)])
def test_dense_matches_oracle_float32(micro_batch_size, ckpt):
    model = _model(torch.float32)
    seqs = _seqs()
    loss_fn = _loss_fn(len(seqs))
    ref = _oracle(model, seqs, loss_fn)
    exact = _oracle(_native_dtype_norms(float64_twin(model)), seqs, loss_fn)
    provider = DenseProvider(model, micro_batch_size=micro_batch_size, gradient_checkpointing=ckpt)
    out, grads = _run(provider, model, seqs, loss_fn)
    _assert_as_precise(out, grads, exact, seqs, ref)


def test_micro_batches_respect_budget_and_cover_batch():
    seqs = [torch.arange(10) + k for k in range(6)] + [torch.arange(30)]
    parts = micro_batches(seqs, max_tokens=25)
    assert sorted(i for p in parts for i in p) == list(range(len(seqs)))
    for p in parts:
        tree = PrefixTree.from_sequences([seqs[i] for i in p])
        assert tree.n_tree_tokens <= 25 or len(p) == 1
    assert micro_batches(seqs, None) == [list(range(len(seqs)))]


def test_workloads_have_the_documented_sharing():
    from benchmarks import workloads

    P, G, R = 64, 8, 32
    w = workloads.grpo(P, G, R, n_prompts=2, vocab_size=500)
    tree = w.tree()
    assert tree.compression_ratio == pytest.approx(G * (P + R) / (P + G * R))
    assert tree.n_leaves == 2 * G
    mt = workloads.multi_turn(scale=0.125, vocab_size=500)
    tree = mt.tree()
    # one shared system prompt; per task: task prompt + the shared first turn (one segment), then 2 + 4 + 8 turns
    assert tree.n_segments == 1 + 2 * (1 + 2 + 4 + 8)
    assert 8.5 < tree.compression_ratio < 10
    assert 2.5 < workloads.multi_turn_3x(scale=0.125, vocab_size=500).tree().compression_ratio < 3.5
    assert workloads.no_sharing(4, 16, vocab_size=500).tree().compression_ratio == 1.0
    # seeded: the same call gives the same tokens
    assert all(torch.equal(a, b) for a, b in zip(mt.seqs, workloads.multi_turn(scale=0.125, vocab_size=500).seqs))
    with pytest.raises(ValueError, match="distinct"):
        workloads.multi_turn(turns=2, distinct=(2, 3), group=4)


def test_dense_mb8_is_trls_default_micro_batch():
    from trl import GRPOConfig

    from benchmarks.suites.providers import PROVIDERS, TRL_MICRO_BATCH_SIZE

    assert GRPOConfig.__dataclass_fields__["per_device_train_batch_size"].default == TRL_MICRO_BATCH_SIZE
    provider = PROVIDERS["dense-mb8"](_model(torch.float32), None)
    assert provider.micro_batch_size == TRL_MICRO_BATCH_SIZE


def test_ratios_are_against_the_faster_dense(tmp_path):
    from benchmarks.reporting.results import fill_ratios, read_csv, write_csv

    def row(workload, method, tps, mem):
        return dict(workload=workload, method=method, tokens_per_s=tps, peak_mem_mb=mem, ideal_ratio=4.0)

    rows = [row("a", "dense", 100.0, 50.0), row("a", "dense-mb8", 250.0, 200.0), row("a", "dense+ckpt", 400.0, 10.0),
            row("a", "dta", 500.0, 25.0), row("b", "dense", 100.0, 50.0), row("b", "dta", 300.0, 100.0)]
    fill_ratios(rows)
    dta = rows[3]
    # the fastest plain dense variant (checkpointing is not one), memory against the leaner variant
    assert (dta["dense_ref"], dta["speedup_vs_dense"], dta["fraction_of_ideal"]) == ("dense-mb8", 2.0, 0.5)
    assert (dta["speedup_vs_dense_mb1"], dta["speedup_vs_dense_mb8"], dta["mem_vs_dense"]) == (5.0, 2.0, 0.5)
    assert rows[0]["speedup_vs_dense"] == 0.4 and rows[1]["speedup_vs_dense"] == 1.0
    # a workload where only the one-row variant ran
    assert (rows[5]["dense_ref"], rows[5]["speedup_vs_dense"], rows[5]["speedup_vs_dense_mb8"]) == ("dense", 3.0, None)
    back = read_csv(write_csv(rows, tmp_path / "r.csv"))
    assert back[3]["dense_ref"] == "dense-mb8" and back[3]["speedup_vs_dense_mb1"] == 5.0
