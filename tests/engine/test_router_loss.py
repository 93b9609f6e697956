"""The MoE load-balancing loss over a prefix tree (`trl_dta/engine/router_loss.py`) against transformers' own
`load_balancing_loss_func` on each group's padded dense batch: value and parameter gradients, for forests whose groups
share prefixes with each other, under every way the walk can forward a token (kept graphs, block recompute, packed
rows, segments one by one)."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
import transformers

from bounds import chain_bound, max_sharing
from conftest import VOCAB, use_input_dtype_norms
from hybrid_models import HYBRID_FAMILIES, float64_internals
from hybrid_models import MOE as HYBRID_MOE
from moe_models import ATTN_IMPLEMENTATION, MOE_FAMILIES, MOE_WITHOUT_AUX
from reference import compare_grads, grads_of
from trl_dta import DTAEngine
from trl_dta.engine.router_loss import LoadBalancing
from trl_dta.modeling.families import ROUTER_LOSS_FAMILIES
from trl_dta.modeling.routers import router_spec

# Ways the walk forwards tokens with grad: rows of small subtrees; every graph kept, segments one by one; block
# recompute of every segment.
BUDGETS = {
    "default": {},
    "segments": dict(max_pack_tokens=0),
    "recompute": dict(max_pack_tokens=0, max_graph_tokens=0, block_size=3),
    "lockstep": dict(max_batch_tokens=16, lockstep=lambda n: n + 1),  # packed rows, one idle batch (`test_walk.py`)
}


def engine_for(model, budget: str) -> DTAEngine:
    kw = dict(BUDGETS[budget])
    lockstep = kw.pop("lockstep", None)
    engine = DTAEngine(model, **kw)
    engine.lockstep = lockstep
    return engine


# The MoE hybrids (recurrent layers beside attention and MoE layers): no lockstep (`tests/recurrent/`); they run in
# float64 with float64 internals (`hybrid_models.float64_internals`; the experts eager), because their recurrences'
# float32 rounding, amplified in the decay parameters' gradients, is above the float32 bar of the attention families
# (measured up to 1.5e-4, float32 in both paths).
ROUTER_FAMILIES = {**MOE_FAMILIES, **{family: HYBRID_FAMILIES[family] for family in HYBRID_MOE}}
# float64 (the MoE hybrids, float64 internals): float64 rounding through the chain of `tolerances` is below 1e-12.
FLOAT64_TOL = 1e-9


def _precision(family):
    """The dtype a family's exactness test runs in, and the context it runs under."""
    if family in HYBRID_MOE:
        return torch.float64, float64_internals(family)
    return torch.float32, contextlib.nullcontext()


def build(family: str, dtype=torch.float32, seed: int = 0):
    """float64: the experts' eager loop (their grouped matmul has no float64) and RMSNorm in the input dtype."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        ROUTER_FAMILIES[family](VOCAB), attn_implementation=ATTN_IMPLEMENTATION.get(family, "sdpa"),
        experts_implementation="eager" if dtype == torch.float64 else None)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # routers away from uniform, so the counts vary
    model = model.to(dtype).eval()
    return use_input_dtype_norms(model) if dtype == torch.float64 else model


def forest(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Sequences with shared prompts (and a shared system prefix), split into three groups so that a prompt's
    completions land in several groups; a duplicate, a sequence that is a prefix of another, and a lone one."""
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(4)]
    seqs = []
    for _ in range(3):
        prompt = system + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 5))]
        for _ in range(rng.randint(2, 4)):
            seqs.append(prompt + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6))])
    seqs.append(list(seqs[0]))  # a duplicate
    seqs.append(seqs[1][: len(seqs[1]) - 1])  # a prefix of another sequence
    seqs.append([rng.randrange(3, VOCAB) for _ in range(5)])  # shares nothing
    order = list(range(len(seqs)))
    rng.shuffle(order)
    groups = [sorted(order[k::3]) for k in range(3)]
    return seqs, groups


def dense_aux(model, seqs: list[list[int]], group: list[int]) -> torch.Tensor:
    """transformers' `aux_loss` of the group's right-padded batch (with its attention mask), with autograd."""
    width = max(len(seqs[i]) for i in group)
    ids = torch.zeros(len(group), width, dtype=torch.long)
    mask = torch.zeros(len(group), width, dtype=torch.long)
    for row, i in enumerate(group):
        ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
        mask[row, : len(seqs[i])] = 1
    return model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss


def float64_aux(model, seqs: list[list[int]], group: list[int], n_experts: int, top_k: int) -> torch.Tensor:
    """`load_balancing_loss_func` of the group's padded batch, computed here in float64 throughout (transformers'
    accumulates in float32 whatever the model's dtype)."""
    width = max(len(seqs[i]) for i in group)
    ids = torch.zeros(len(group), width, dtype=torch.long)
    mask = torch.zeros(len(group), width, dtype=torch.float64)
    for row, i in enumerate(group):
        ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
        mask[row, : len(seqs[i])] = 1
    logits = model(input_ids=ids, attention_mask=mask.long(), output_router_logits=True).router_logits
    flat = mask.reshape(-1)
    counts = probs = 0.0
    for layer_logits in logits:
        p = torch.softmax(layer_logits.double(), dim=-1)  # (tokens, E)
        top = p.topk(top_k, dim=-1).indices
        counts = counts + torch.zeros(n_experts, dtype=torch.float64).scatter_add(0, top.reshape(-1),
                                                                                  flat.repeat_interleave(top_k))
        probs = probs + (p * flat[:, None]).sum(0)
    rows = flat.sum() * len(logits)
    return n_experts * (counts / rows * probs / rows).sum()


def dense_router_loss(model, seqs, groups, coefs):
    model.zero_grad(set_to_none=True)
    values = [dense_aux(model, seqs, g) for g in groups]
    sum(c * v for c, v in zip(coefs, values)).backward()
    return torch.stack([v.detach() for v in values]), grads_of(model)


def tolerances(model, seqs) -> tuple[float, float]:
    """How far DTA's router loss (value, gradients) may be from transformers' computation of it: float64 models (with
    float64 internals) `FLOAT64_TOL`; float32 `bounds.chain_bound` (the MoE routers take their softmax in float32
    even in a float64 model, so no float64 reference of these models is exact). The longest chain of a value: every
    layer's projections and attention
    (hidden + intermediate + the longest sequence, per layer), the router's logits (hidden) and softmax (experts), the
    mean over all tokens, the sum over experts, and DTA's sum over the sequences that share a token; gradients go
    back along the same chain (2x)."""
    if next(model.parameters()).dtype == torch.float64:
        return FLOAT64_TOL, FLOAT64_TOL
    c = model.config
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or c.n_routed_experts
    inner = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    k = (c.num_hidden_layers * (c.hidden_size + inner + max(map(len, seqs))) + c.hidden_size + 2 * experts
         + sum(map(len, seqs)) + max_sharing(seqs) + 10)
    return chain_bound(k), chain_bound(2 * k)


def zero_loss(i, lp, ent):
    return lp.sum() * 0.0


def _router_cases():
    return [pytest.param(family, budget, id=f"{family}-{budget}") for family in ROUTER_FAMILIES for budget in BUDGETS
            if not (family in HYBRID_MOE and budget == "lockstep")]


def test_every_router_loss_family_is_tested():
    assert set(ROUTER_FAMILIES) == set(ROUTER_LOSS_FAMILIES)


@pytest.mark.parametrize("family,budget", _router_cases())
def test_router_gradient_equals_dense(family, budget):
    """The aux term alone (the policy loss is zero): DTA's gradient vs transformers' function's backward."""
    dtype, context = _precision(family)
    model = build(family, dtype)
    coefs = [0.7, 1.3, 0.2]
    for seed in [list(BUDGETS).index(budget)]:  # another forest per walk mode
        seqs, groups = forest(seed)
        with context:
            want_aux, want = dense_router_loss(model, seqs, groups, coefs)
            model.zero_grad(set_to_none=True)
            out = engine_for(model, budget).forward_backward(
                seqs, zero_loss, router_loss=LoadBalancing(groups, coefs))
        assert out.stats["compression_ratio"] > 1.2
        value_tol, grad_tol = tolerances(model, seqs)
        assert torch.allclose(out.router_aux, want_aux.to(out.router_aux.dtype), rtol=value_tol, atol=0)
        assert torch.allclose(out.loss, (torch.tensor(coefs, dtype=want_aux.dtype) * want_aux).sum(), rtol=value_tol)
        err, where = compare_grads(grads_of(model), want)
        assert err <= grad_tol, f"seed {seed}: router-loss gradients differ by {err:.3g} (at {where})"
        assert any("gate" in n or "router" in n for n in want)  # the routers themselves receive a gradient


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_router_gradient_float64(budget):
    """GPT-OSS, whose routers (and sinks, attention and experts' eager loop) compute in the model's dtype, in float64
    (norms in the input dtype), the aux term alone: DTA's value and gradients equal the float64 load-balancing loss
    within 1e-10 (computed here: transformers' function accumulates in float32 whatever the model's dtype)."""
    coefs = [0.7, 1.3, 0.2]
    seqs, groups = forest(list(BUDGETS).index(budget))
    exact = build("gpt_oss", torch.float64)
    spec = router_spec(exact)
    exact.zero_grad(set_to_none=True)
    want_aux = torch.stack([float64_aux(exact, seqs, g, spec.n_experts, spec.top_k) for g in groups])
    (torch.tensor(coefs, dtype=torch.float64) * want_aux).sum().backward()
    want = grads_of(exact)
    exact.zero_grad(set_to_none=True)
    out = engine_for(exact, budget).forward_backward(seqs, zero_loss, router_loss=LoadBalancing(groups, coefs))
    assert (out.router_aux - want_aux).abs().max() <= 1e-10 * want_aux.abs().max()
    err, where = compare_grads(grads_of(exact), want)
    assert err <= 1e-10, f"router-loss gradients differ by {err:.3g} (at {where})"
    assert any("router" in n for n in want) and any("sinks" in n for n in want)


@pytest.mark.parametrize("family", list(ROUTER_FAMILIES))
def test_router_loss_adds_to_the_policy_loss(family):
    """Policy loss and router loss together, the multiplicities of a forest whose groups overlap in tokens."""
    dtype, context = _precision(family)
    model = build(family, dtype, seed=1)
    seqs, groups = forest(5)
    coefs = [0.5, 0.5, 0.5]

    def loss_fn(i, lp, ent):
        return torch.exp(lp.mean()) * (1 + 0.1 * i) if lp.numel() else lp.sum()

    model.zero_grad(set_to_none=True)
    with context:
        total = sum(c * dense_aux(model, seqs, g) for c, g in zip(coefs, groups))
        for i, s in enumerate(seqs):
            logits = model(torch.tensor([s])).logits[0, :-1]
            lp = logits.log_softmax(-1).gather(-1, torch.tensor(s[1:])[:, None]).squeeze(-1)
            total = total + loss_fn(i, lp, None)
        total.backward()
        want = grads_of(model)
        model.zero_grad(set_to_none=True)
        out = DTAEngine(model).forward_backward(seqs, loss_fn, router_loss=LoadBalancing(groups, coefs))
    value_tol, grad_tol = tolerances(model, seqs)
    assert torch.allclose(out.loss, total.detach(), rtol=value_tol)
    err, where = compare_grads(grads_of(model), want)
    assert err <= grad_tol, f"gradients differ by {err:.3g} (at {where})"


@pytest.mark.parametrize("family", list(ROUTER_FAMILIES))
def test_logprobs_returns_the_router_loss(family):
    """Without grad the walk counts as it goes: each group's value, no extra forward."""
    model = build(family)
    seqs, groups = forest(3)
    with torch.no_grad():
        want = torch.stack([dense_aux(model, seqs, g) for g in groups])
    engine = DTAEngine(model)
    out = engine.logprobs(seqs, router_loss=LoadBalancing(groups, [1.0] * 3))
    assert torch.allclose(out.router_aux, want.to(out.router_aux.dtype), rtol=tolerances(model, seqs)[0], atol=0)
    if family not in HYBRID_MOE:  # a hybrid computes a one-token internal segment once per child
        assert out.stats["forward_tokens"] == out.stats["tree_tokens"]


def test_counting_pass_is_counted():
    model = build("qwen3_moe")
    seqs, groups = forest(0)
    engine = DTAEngine(model)
    plain = engine.forward_backward(seqs, zero_loss).stats["forward_tokens"]
    with_aux = engine.forward_backward(seqs, zero_loss, router_loss=LoadBalancing(groups, [1.0] * 3))
    assert with_aux.stats["forward_tokens"] == plain + with_aux.stats["tree_tokens"]


def test_router_loss_refused_for_other_families():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MOE_WITHOUT_AUX["glm4_moe"](VOCAB)).eval()
    assert model.config.model_type not in ROUTER_LOSS_FAMILIES
    with pytest.raises(NotImplementedError, match="router_aux_loss_coef=0.0"):
        DTAEngine(model).forward_backward([[3, 4, 5]], zero_loss, router_loss=LoadBalancing([[0]], [1.0]))


@pytest.mark.parametrize("request_, error", [
    (LoadBalancing([[0], [1]], [1.0]), "2 groups but 1 coefficients"),
    (LoadBalancing([[0, 7]], [1.0]), r"groups\[0\]` names sequence 7"),
    (LoadBalancing([[0]], [float("nan")]), "must be finite"),
])
def test_bad_router_loss_requests(request_, error):
    model = build("mixtral")
    with pytest.raises(ValueError, match=error):
        DTAEngine(model).forward_backward([[3, 4, 5], [3, 4]], zero_loss, router_loss=request_)
