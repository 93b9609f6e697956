"""`lm_head.head_logprobs` against `log_softmax` of the full logits: log-probs, entropies and every gradient, for the
fused linear autograd function and the checkpointed path of other head modules, over tile boundaries, vocabulary
sizes, dtypes and the families' logit post-processing."""

from __future__ import annotations

import pytest
import torch

from bounds import assert_as_precise_as_dense, chain_bound
from conftest import make_model
from reference import max_rel_err
from trl_dta.modeling.lm_head import MAX_TILE_LOGITS, HeadSpec, head_logprobs, tile_rows

TOL = {torch.float64: 1e-10}
HIDDEN = 16
CHUNK = 4


def float32_bound(vocab: int, rows: int) -> float:
    """The head and `log_softmax` of the full logits in float32, within `bounds.chain_bound` of each other: the longest
    chain is a logit (HIDDEN products and sums, the bias), the softmax sum over `vocab`, then in the backward the
    logit gradient against `vocab` weights and the weight gradient over `rows`, plus 10 single roundings (max, exp,
    log, subtractions, products)."""
    return chain_bound(HIDDEN + 1 + 2 * vocab + rows + 10)


def reference(spec: HeadSpec, hidden, targets, temperature=1.0):
    """Full logits, post-processed as the model does, then `log_softmax`: `(n,)` log-probs and entropies."""
    logits = spec.module(hidden)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logits = logits * spec.logit_scale
    if spec.softcap is not None:
        logits = spec.softcap * torch.tanh(logits / spec.softcap)
    log_p = (logits / temperature).log_softmax(-1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def make_head(kind: str, vocab: int, dtype, bias: bool = True, seed: int = 0) -> torch.nn.Module:
    """`linear`: a plain `nn.Linear` (the fused autograd function); `weight_norm`: a parametrized Linear, which is
    not of type `nn.Linear` and takes the checkpointed path."""
    torch.manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, vocab, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.normal_(0, 0.5)
        if bias:
            head.bias.normal_(0, 0.5)
    if kind == "weight_norm":
        head = torch.nn.utils.parametrizations.weight_norm(head)
    return head


def run(fn, spec, hidden, targets, g_lp, g_ent, **kw):
    """`fn`'s log-probs and entropies, and the gradients of `sum(g_lp * lp) + sum(g_ent * ent)` w.r.t. the hidden
    states and the head's parameters (a None upstream gradient leaves that output out of the loss)."""
    hidden = hidden.detach().requires_grad_()
    spec.module.zero_grad(set_to_none=True)
    lp, ent = fn(spec, hidden, targets, **kw)
    loss = 0
    if g_lp is not None:
        loss = loss + (g_lp * lp).sum()
    if g_ent is not None:
        loss = loss + (g_ent * ent).sum()
    loss.backward()
    grads = {"hidden": hidden.grad, **{n: p.grad for n, p in spec.module.named_parameters()}}
    return lp.detach(), None if ent is None else ent.detach(), grads


def inputs(rows: int, vocab: int, dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    g_lp = torch.randn(rows, generator=g, dtype=torch.float64)
    g_ent = torch.randn(rows, generator=g, dtype=torch.float64)
    return hidden, targets, g_lp, g_ent


def assert_close(got, want, tol):
    lp, ent, grads = got
    want_lp, want_ent, want_grads = want
    assert max_rel_err(lp, want_lp) <= tol, f"log-probs: {max_rel_err(lp, want_lp):.3g}"
    if want_ent is not None:
        assert max_rel_err(ent, want_ent) <= tol, f"entropies: {max_rel_err(ent, want_ent):.3g}"
    assert set(grads) == set(want_grads)
    for name, g in grads.items():
        err = max_rel_err(g, want_grads[name])
        worst = (g - want_grads[name]).abs().flatten().argmax().item()
        assert err <= tol, f"gradient of {name}: {err:.3g} (worst element {worst})"


# ---------------------------------------------------------------------------------------------- shapes and dtypes


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("vocab", [7, 61, 300])
@pytest.mark.parametrize("rows", [1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 2 * CHUNK + 1])
@pytest.mark.parametrize("kind", ["linear", "weight_norm"])
def test_matches_log_softmax(kind, rows, vocab, dtype):
    """Rows below, at and past the tile size; log-probs, entropies and gradients of hidden, weight and bias."""
    spec = HeadSpec(make_head(kind, vocab, dtype))
    hidden, targets, g_lp, g_ent = inputs(rows, vocab, dtype)
    g_lp, g_ent = g_lp.to(dtype), g_ent.to(dtype)
    got = run(head_logprobs, spec, hidden, targets, g_lp, g_ent, entropy=True, chunk_size=CHUNK)
    tol = TOL[dtype] if dtype == torch.float64 else float32_bound(vocab, rows)
    assert_close(got, run(reference, spec, hidden, targets, g_lp, g_ent), tol)


@pytest.mark.parametrize("upstream", ["logps", "entropies", "logps-without-entropy"])
@pytest.mark.parametrize("kind", ["linear", "weight_norm"])
def test_gradient_from_one_output(kind, upstream):
    """Only one output carries a gradient (the backward's `g_lp is None` / `g_ent is None` branches)."""
    spec = HeadSpec(make_head(kind, 61, torch.float64))
    hidden, targets, g_lp, g_ent = inputs(2 * CHUNK + 1, 61, torch.float64)
    g_lp, g_ent = (g_lp, None) if upstream != "entropies" else (None, g_ent)
    entropy = upstream != "logps-without-entropy"
    got = run(head_logprobs, spec, hidden, targets, g_lp, g_ent, entropy=entropy, chunk_size=CHUNK)
    want = run(reference, spec, hidden, targets, g_lp, g_ent)
    assert (got[1] is None) == (not entropy)
    assert_close(got, want if entropy else (want[0], None, want[2]), TOL[torch.float64])


@pytest.mark.parametrize("frozen", ["head", "hidden"])
def test_frozen_inputs_get_no_gradient(frozen):
    """A frozen head (LoRA elsewhere) or constant hidden states: the other side's gradient is still exact."""
    spec = HeadSpec(make_head("linear", 61, torch.float64))
    hidden, targets, g_lp, _ = inputs(2 * CHUNK + 1, 61, torch.float64)
    want = run(reference, spec, hidden, targets, g_lp, None)
    spec.module.zero_grad(set_to_none=True)
    if frozen == "head":
        spec.module.requires_grad_(False)
        h = hidden.clone().requires_grad_()
        lp, _ = head_logprobs(spec, h, targets, chunk_size=CHUNK)
        (g_lp * lp).sum().backward()
        assert max_rel_err(h.grad, want[2]["hidden"]) <= TOL[torch.float64]
        assert spec.module.weight.grad is None
    else:
        lp, _ = head_logprobs(spec, hidden, targets, chunk_size=CHUNK)
        (g_lp * lp).sum().backward()
        assert max_rel_err(spec.module.weight.grad, want[2]["weight"]) <= TOL[torch.float64]


def test_empty_and_no_grad():
    spec = HeadSpec(make_head("linear", 61, torch.bfloat16))
    lp, ent = head_logprobs(spec, torch.zeros(0, HIDDEN, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.long),
                            entropy=True)
    assert lp.shape == ent.shape == (0,) and lp.dtype == torch.float32
    hidden, targets, _, _ = inputs(5, 61, torch.float64)
    spec = HeadSpec(make_head("weight_norm", 61, torch.float64))
    with torch.no_grad():
        lp, ent = head_logprobs(spec, hidden, targets, entropy=True, chunk_size=2)
    want_lp, want_ent = reference(spec, hidden, targets)
    assert not lp.requires_grad
    assert max_rel_err(lp, want_lp.detach()) <= 1e-12 and max_rel_err(ent, want_ent.detach()) <= 1e-12


@pytest.mark.parametrize("kind, chunk", [("linear", CHUNK), ("weight_norm", 64)])
def test_bf16_no_worse_than_plain_bf16(kind, chunk):
    """Judged against float64 on the same (bf16-representable) inputs: the head's error must not exceed that of the
    plain bf16 path (bf16 logits, upcast, `log_softmax`, autograd). Both compute the softmax statistics from the same
    bf16 logits in float32, with the same formula, so the log-probs and entropies may differ by float32 rounding
    (`float32_bound`), three orders below bf16's; the gradients (the head's logit gradient rounded to bf16 and
    accumulated in float32, autograd's in bf16) are judged in relative L2 against the dense bf16 path's
    (`bounds.assert_as_precise_as_dense`).

    The linear head runs in several tiles (its bias gradient is summed over tiles in float32). The checkpointed path
    runs in one chunk: autograd sums each chunk's parameter gradients in the parameter dtype, so a half-precision
    head of another type rounds its gradient once per chunk (2.6x the plain error on this case with three chunks)."""
    vocab, rows = 300, 2 * CHUNK + 3
    spec16 = HeadSpec(make_head(kind, vocab, torch.bfloat16), softcap=5.0)
    spec64 = HeadSpec(make_head(kind, vocab, torch.bfloat16).double(), softcap=5.0)
    hidden, targets, g_lp, g_ent = inputs(rows, vocab, torch.bfloat16)
    exact = run(reference, spec64, hidden.double(), targets, g_lp, g_ent)
    plain = run(reference, spec16, hidden, targets, g_lp.float(), g_ent.float())
    ours = run(head_logprobs, spec16, hidden, targets, g_lp.float(), g_ent.float(), entropy=True, chunk_size=chunk)
    for i, what in ((0, "log-probs"), (1, "entropies")):
        e_plain, e_ours = max_rel_err(plain[i], exact[i]), max_rel_err(ours[i], exact[i])
        bound = float32_bound(vocab, rows)
        assert e_ours <= e_plain + bound, f"{what}: head {e_ours:.3g} > plain bf16 {e_plain:.3g} + {bound:.3g}"
    for name in exact[2]:
        assert_as_precise_as_dense(ours[2][name], plain[2][name], exact[2][name], f"gradient of {name}")


# ---------------------------------------------------------------------------------------------- post-processing


@pytest.mark.parametrize("post", [dict(temperature=0.7), dict(logit_scale=0.25), dict(softcap=3.0),
                                  dict(logit_scale=2.0, softcap=3.0, temperature=1.3)],
                         ids=["temperature", "logit_scale", "softcap", "all"])
@pytest.mark.parametrize("kind", ["linear", "weight_norm"])
def test_post_processing(kind, post):
    temperature = post.pop("temperature", 1.0)
    spec = HeadSpec(make_head(kind, 61, torch.float64), **post)
    hidden, targets, g_lp, g_ent = inputs(2 * CHUNK + 1, 61, torch.float64)
    got = run(head_logprobs, spec, hidden, targets, g_lp, g_ent, entropy=True, chunk_size=CHUNK,
              temperature=temperature)
    assert_close(got, run(reference, spec, hidden, targets, g_lp, g_ent, temperature=temperature), 1e-10)


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "llama"], ids=["tied", "softcap", "plain"])
def test_from_model_matches_the_models_own_logits(family):
    """`HeadSpec.from_model` + `head_logprobs` on the backbone's hidden states against the model's own logits, with
    every parameter's gradient (tied embeddings: the shared weight gets both contributions)."""
    model = make_model(family, torch.float64)
    ids = torch.tensor([[5, 9, 17, 33, 40, 21, 7, 12, 3, 30]])
    targets = ids[0, 1:]
    g = torch.Generator().manual_seed(0)
    g_lp, g_ent = torch.randn(9, generator=g, dtype=torch.float64), torch.randn(9, generator=g, dtype=torch.float64)

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    log_p = (model(input_ids=ids).logits[0, :-1] / 0.8).log_softmax(-1)
    want_lp, want_ent = log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)
    want = grads((g_lp * want_lp).sum() + (g_ent * want_ent).sum())
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0, :-1]
    lp, ent = head_logprobs(HeadSpec.from_model(model), hidden, targets, temperature=0.8, entropy=True, chunk_size=4)
    assert max_rel_err(lp, want_lp) <= 1e-10 and max_rel_err(ent, want_ent) <= 1e-10
    got = grads((g_lp * lp).sum() + (g_ent * ent).sum())
    assert set(got) == set(want)
    for name in want:
        assert max_rel_err(got[name], want[name]) <= 1e-10, name
    if family == "qwen3":
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


# ---------------------------------------------------------------------------------------------- tile cap


def test_tile_rows_cap():
    assert tile_rows(4096, 151_936) == 110 == MAX_TILE_LOGITS // 151_936
    assert tile_rows(4096, 128_256) == 130
    assert tile_rows(4096, 61) == 4096 and tile_rows(3, 61) == 3
    assert tile_rows(4096, MAX_TILE_LOGITS * 2) == 1


def test_cap_does_not_change_results():
    """A 2**17-token vocabulary caps a tile at 128 rows: 130 rows run as two tiles whatever the chunk size asked for,
    with the same results as smaller explicit chunks and as the full `log_softmax`."""
    vocab, rows = 1 << 17, 130
    assert tile_rows(4096, vocab) == 128
    spec = HeadSpec(make_head("linear", vocab, torch.float64, bias=False))
    hidden, targets, g_lp, g_ent = inputs(rows, vocab, torch.float64)
    capped = run(head_logprobs, spec, hidden, targets, g_lp, g_ent, entropy=True, chunk_size=4096)
    small = run(head_logprobs, spec, hidden, targets, g_lp, g_ent, entropy=True, chunk_size=48)
    assert_close(capped, small, 1e-12)
    assert_close(capped, run(reference, spec, hidden, targets, g_lp, g_ent), TOL[torch.float64])
