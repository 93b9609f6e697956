"""Model families: every decoder-only family either runs through DTA with the dense per-sequence results, or is
refused by `check_model_support` before any forward, with the reason and the dense alternative."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version

from conftest import FAMILIES, VOCAB, float64_twin, make_model, shared_batch, use_input_dtype_norms
from moe_models import MOE_FAMILIES, MOE_WITHOUT_AUX
from reference import grads_of
from test_engine import TOL, check
from trl_dta.kernels import available_backends
from trl_dta.modeling.families import TESTED_MODEL_TYPES
from trl_dta.modeling.support import DENSE_ALTERNATIVE, check_model_support

SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

# Families beyond the conftest ones, as tiny configs. Granite, Cohere and MiniCPM3 (`logits_scaling` = hidden_size /
# dim_model_base = 4) get non-trivial multipliers, so that their embedding/residual/attention/logit scalings are all
# exercised.
SUPPORTED = {
    "granite": lambda: transformers.GraniteConfig(**SMALL, intermediate_size=48, num_key_value_heads=2,
                                                  logits_scaling=3.0, embedding_multiplier=2.0,
                                                  residual_multiplier=0.5, attention_multiplier=0.3),
    "olmo": lambda: transformers.OlmoConfig(**SMALL, intermediate_size=48, num_key_value_heads=2),
    "cohere": lambda: transformers.CohereConfig(**SMALL, intermediate_size=48, num_key_value_heads=2, logit_scale=0.5),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**SMALL, intermediate_size=48, rotary_pct=0.5, attention_dropout=0.0,
                                                   hidden_dropout=0.0),
    "minicpm3": lambda: transformers.MiniCPM3Config(**SMALL, intermediate_size=48, num_key_value_heads=4,
                                                    q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=4,
                                                    qk_rope_head_dim=4, v_head_dim=8, dim_model_base=8, scale_emb=2.0),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True),
    **{family: (lambda make=make: make(VOCAB)) for family, make in {**MOE_FAMILIES, **MOE_WITHOUT_AUX}.items()},
}

# Cohere's RoPE rotates q/k in float32 even in a float64 model, and the MoE routers take their softmax in float32:
# float32 tests only (see conftest's FLOAT32_ONLY). GPT-OSS's router, attention (sinks included) and experts' eager
# loop compute in the model's dtype (`build` picks the eager loop in float64: the grouped matmul has none).
FLOAT32_ONLY = {"cohere", *(set(MOE_FAMILIES) - {"gpt_oss"}), *MOE_WITHOUT_AUX}

# What the probe finds first in Falcon's stock code, by transformers release: 5.25 reaches its attention without the
# forward's keyword arguments; 5.24 failed before any layer reached it.
FALCON_PROBE = ("without the keyword arguments" if Version(transformers.__version__) >= Version("5.25")
                else "before any layer reaches")
# Families that run densely but not through DTA, and a phrase of the reason each must be refused with.
REFUSED = {
    "stablelm": (lambda: transformers.StableLmConfig(**SMALL, intermediate_size=48, num_key_value_heads=2),
                 "without the keyword arguments"),
    "falcon": (lambda: transformers.FalconConfig(**SMALL, alibi=False), FALCON_PROBE),
    "falcon-new-arch": (lambda: transformers.FalconConfig(**SMALL, alibi=False, new_decoder_architecture=True,
                                                          num_kv_heads=2), FALCON_PROBE),
    "falcon-alibi": (lambda: transformers.FalconConfig(**SMALL, alibi=True), "ALiBi"),
    "mpt": (lambda: transformers.MptConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=VOCAB, max_seq_len=256),
            "ALiBi"),
    "bloom": (lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4), "ALiBi"),
    "gpt_neo": (lambda: transformers.GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                                                  attention_types=[[["global", "local"], 1]],
                                                  max_position_embeddings=256), "never call"),
    "bert-bidirectional": (lambda: transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                           num_attention_heads=4, intermediate_size=48),
                           "other log-probs than the dense forward"),
    "mamba": (lambda: transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2),
              "linear_attention"),
    # Hybrids outside `families.RECURRENT_FAMILIES`: Jamba's Mamba (v1) layers, MiniMax's lightning attention (a
    # cache seam of its own, `get_linear_cache`).
    "jamba": (lambda: transformers.JambaConfig(**SMALL, intermediate_size=48, num_key_value_heads=2,
                                               attn_layer_period=2, attn_layer_offset=1, num_experts=1,
                                               mamba_d_state=8, mamba_dt_rank=4),
              "linear_attention"),
    "minimax": (lambda: transformers.MiniMaxConfig(**SMALL, intermediate_size=48, num_key_value_heads=2, head_dim=8,
                                                   num_local_experts=2, num_experts_per_tok=1,
                                                   layer_types=["linear_attention", "full_attention"]),
                "linear_attention"),
    "mixtral-jitter": (lambda: MOE_FAMILIES["mixtral"](VOCAB, router_jitter_noise=0.1), "router_jitter_noise=0.1"),
}


def build(config, dtype=torch.float32, seed=0, attn="sdpa"):
    """A tiny model with random weights (perturbed, so that norm weights matter), in eval mode; `attn=None` lets
    transformers pick the attention (MPT has no SDPA), and a family without SDPA (GPT-OSS) runs its eager attention.
    MoE experts run their eager loop in float64 (the grouped matmul has no float64)."""
    torch.manual_seed(seed)
    if attn == "sdpa" and not transformers.AutoModelForCausalLM._model_mapping[type(config)]._supports_sdpa:
        attn = "eager"
    experts = "eager" if dtype == torch.float64 else None
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                                          experts_implementation=experts).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _input_dtype_layer_norms(model):
    """OLMo's parameter-free layer norms computed in the input dtype (the stock one casts to float32, see conftest)."""
    for m in model.modules():
        if type(m).__name__ == "OlmoLayerNorm":
            m.forward = lambda x, m=m: F.layer_norm(x, m.normalized_shape, None, None, eps=1e-5)
    return model


def loss_fn(i, lp, ent):
    """Non-linear in each sequence's log-probs and entropies (prefix gradients must be accumulated exactly)."""
    if lp.numel() == 0:
        return lp.sum()
    return torch.exp(lp.mean()) * (1 + 0.1 * i) + 0.05 * torch.tanh(ent).sum()


def assert_equals_oracle(model, tol=TOL[torch.float64]):
    """`test_engine.check` on a shared batch: float64 within `tol`; float32 as precise as the dense float32 path,
    both against a float64 twin (OLMo's layer norms and RMSNorm in float64; Cohere's RoPE and the MoE routers keep
    their float32 steps there, an order below the float32 computations' errors)."""
    check(model, shared_batch(8), tol, loss_fn=loss_fn,
          twin=lambda m: use_input_dtype_norms(_input_dtype_layer_norms(float64_twin(m))))
    assert len(grads_of(model)) == len(list(model.parameters()))


ORACLE_CASES = [pytest.param(f, torch.float32, id=f"{f}-float32") for f in SUPPORTED] + [
    pytest.param(f, torch.float64, id=f"{f}-float64") for f in SUPPORTED if f not in FLOAT32_ONLY]


@pytest.mark.parametrize("family, dtype", ORACLE_CASES)
def test_supported_family_equals_oracle(family, dtype):
    model = build(SUPPORTED[family](), dtype)
    if dtype == torch.float64:
        use_input_dtype_norms(_input_dtype_layer_norms(model))
    assert model.config.model_type in TESTED_MODEL_TYPES
    check_model_support(model)
    assert_equals_oracle(model)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_conftest_families_pass_the_check(family):
    model = make_model(family, torch.float32)
    assert model.config.model_type in TESTED_MODEL_TYPES
    check_model_support(model)


@pytest.mark.parametrize("family", list(REFUSED))
def test_unsupported_family_is_refused_before_any_forward(family):
    make_config, reason = REFUSED[family]
    model = build(make_config(), attn=None)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.isfinite(model(input_ids=ids).logits).all()  # it runs densely
    with pytest.raises(NotImplementedError) as err:
        check_model_support(model)
    message = str(err.value)
    assert reason in message, message
    assert f"model type '{model.config.model_type}'" in message and DENSE_ALTERNATIVE in message, message
    assert "dta_enabled=False" in message
    assert model.config._attn_implementation != "dta_probe"


def test_granite_logits_scaling_head_matches_dense_logits():
    """Granite divides its logits by `logits_scaling`; the DTA head applies the same factor."""
    from trl_dta.modeling.lm_head import HeadSpec, head_logprobs

    model = build(SUPPORTED["granite"](), torch.float64)
    ids = torch.tensor([[5, 9, 17, 33, 40, 2]])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        hidden = model.model(input_ids=ids).last_hidden_state[0]
    log_p = out.logits[0].log_softmax(-1)
    targets = torch.tensor([9, 17, 33, 40, 2, 3])
    lp, ent = head_logprobs(HeadSpec.from_model(model), hidden, targets, entropy=True)
    assert (lp - log_p.gather(-1, targets[:, None]).squeeze(-1)).abs().max() <= 1e-12
    assert (ent + (log_p.exp() * log_p).sum(-1)).abs().max() <= 1e-12
    assert HeadSpec.from_model(model).logit_scale == pytest.approx(1 / 3)


def test_unknown_logit_scaling_is_refused():
    """`logits_scaling` means a division in Granite and a multiplication in HyperCLOVAX: an unlisted family that sets
    it is refused rather than guessed."""
    config = transformers.LlamaConfig(**SMALL, intermediate_size=48, num_key_value_heads=2)
    config.logits_scaling = 2.0
    with pytest.raises(NotImplementedError, match="logits_scaling"):
        check_model_support(build(config))


def test_probe_leaves_the_model_as_it_was_and_is_cheap():
    """Training mode, gradient checkpointing, attention implementation, parameters and gradients are untouched; the
    probe runs three forwards of at most four tokens."""
    model = make_model("qwen2", torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model.model.layers[0].eval()  # a mixed state must come back exactly
    modes = [m.training for m in model.modules()]
    attn = {id(m.config): m.config._attn_implementation for m in model.modules() if hasattr(m, "config")}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    lengths = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: lengths.append(args[0].shape[1]))
    check_model_support(model)
    hook.remove()
    assert lengths == [4, 1, 3]
    assert [m.training for m in model.modules()] == modes
    assert {id(m.config): m.config._attn_implementation for m in model.modules() if hasattr(m, "config")} == attn
    assert model.is_activation_checkpointing
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())


def test_peft_model_passes():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(make_model("llama", torch.float32),
                                peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"]))
    check_model_support(model.get_base_model())


def test_hybrid_with_moe_and_mlp_layers_runs():
    """A state-space + attention + MoE + MLP hybrid (Nemotron-H) passes: its Mamba2 layers walk the tree with their
    states (`tests/recurrent/`), the position-wise MLP/MoE layers run as they are."""
    config = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        layers_block_type=["mamba", "moe", "attention", "mlp"], mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8,
        n_groups=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16, intermediate_size=32, use_mamba_kernels=False)
    assert {"moe", "mlp"} <= set(config.layer_types)
    check_model_support(build(config, attn=None))


def test_hybrid_refusal_names_only_the_layers_dta_cannot_run():
    """A hybrid outside the recurrent families (Jamba) is refused for its state-space layers alone: the message names
    them and the families that run, not the attention layers."""
    with pytest.raises(NotImplementedError) as err:
        check_model_support(build(REFUSED["jamba"][0]()))
    message = str(err.value)
    assert "['linear_attention'] layers" in message and "state-space" in message, message
    assert "'full_attention'] layers" not in message and "nemotron_h" in message, message
    assert "'moe'" not in message and "'mlp'" not in message, message


def branching_batch(seed: int = 0) -> list[torch.Tensor]:
    """Deep branching with single-token segments and a GRPO-like sibling group, longer than GPT-OSS's window of 4: a
    6-token root with three levels of two children each (one child of every node a single token), a sequence that
    ends at an internal segment, and 6 ragged siblings (1 to 11 tokens) of a 9-token prompt."""
    g = torch.Generator().manual_seed(seed)

    def rnd(n):
        return torch.randint(3, VOCAB, (n,), generator=g)

    seqs, level = [], [rnd(6)]
    for lengths in ((1, 5), (1, 3), (1, 2)):
        level = [torch.cat([node, rnd(n)]) for node in level for n in lengths]
    seqs += level + [level[3][:-2]]  # 8 leaves at depth 3, and one that stops inside a segment
    prompt = rnd(9)
    seqs += [torch.cat([prompt, rnd(n)]) for n in (1, 3, 11, 2, 7, 1)]
    return seqs


GPT_OSS_WALKS = {
    "walk": dict(max_pack_tokens=0),  # every segment pushed and popped, siblings batched
    "packed": dict(max_pack_tokens=1024),  # subtrees as tree-masked rows
    "one-by-one": dict(max_pack_tokens=0, max_batch_tokens=1),  # no sibling batching
    "recompute": dict(max_pack_tokens=0, max_graph_tokens=0, block_size=3),  # blocks shorter than the window
}
# Every walk on the default backend; the reference and Triton backends on packed rows (each kernel path: causal rows,
# tree-masked rows, path parts cut by the window); float32 on the default.
GPT_OSS_CASES = [pytest.param("torch", walk, torch.float64, id=f"torch-{walk}-float64") for walk in GPT_OSS_WALKS] + [
    pytest.param("sdpa", "walk", torch.float64, id="sdpa-walk-float64"),
    pytest.param("triton", "packed", torch.float64, id="triton-packed-float64"),
    pytest.param("torch", "packed", torch.float32, id="torch-packed-float32"),
]


@pytest.mark.parametrize("backend, walk, dtype", GPT_OSS_CASES)
def test_gpt_oss_trees_equal_oracle(backend, walk, dtype):
    """GPT-OSS (attention sinks, sliding and full layers alternating, MoE) through every walk mode and attention
    backend, against the per-sequence oracle (its own eager attention): log-probs, entropies and every parameter
    gradient, the sinks' included (`test_engine.check`). float64 with the experts' eager loop and norms in the input
    dtype (1e-10); float32 stock, as precise as the dense float32 path against the float64 twin."""
    if backend == "triton" and "triton" not in available_backends("cpu"):
        pytest.skip("triton is not installed")
    model = build(MOE_FAMILIES["gpt_oss"](VOCAB), dtype)
    if dtype == torch.float64:
        use_input_dtype_norms(model)
    assert model.config.layer_types == ["sliding_attention", "full_attention"] and model.config.sliding_window == 4
    out = check(model, branching_batch(1), loss_fn=loss_fn, attn_backend=backend, **GPT_OSS_WALKS[walk])
    assert out.stats["compression_ratio"] > 1.5
    grads = grads_of(model)
    assert all(grads[f"model.layers.{i}.self_attn.sinks"].abs().max() > 0 for i in range(2))
