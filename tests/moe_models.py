"""Tiny Mixture-of-Experts configs for the MoE tests: every family whose load-balancing loss DTA reproduces, with
TRL's router settings left to the family (`router_aux_loss_coef` from the config, `output_router_logits` off: TRL asks
for the router logits itself)."""

from __future__ import annotations

import transformers

# Shared shape: 2 layers of width 32, 4 experts of which 2 route each token, GQA.
_COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)

MOE_FAMILIES = {
    "qwen3_moe": lambda vocab, **kw: transformers.Qwen3MoeConfig(
        vocab_size=vocab, **_COMMON, head_dim=8, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, **kw),
    "mixtral": lambda vocab, **kw: transformers.MixtralConfig(
        vocab_size=vocab, **_COMMON, head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
        **kw),
    # GPT-OSS: attention sinks, sliding and full layers alternating (a window of 4, shorter than the test sequences),
    # YaRN RoPE (its factor 32 over the tiny context, as in the released models' config), biased router and experts.
    "gpt_oss": lambda vocab, **kw: transformers.GptOssConfig(
        vocab_size=vocab, **_COMMON, head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False, "original_max_position_embeddings": 16,
                                           "rope_theta": 150000.0}, **kw),
}

# GPT-OSS has no SDPA attention in transformers (its sinks): its dense reference is its own eager attention.
ATTN_IMPLEMENTATION = {"gpt_oss": "eager"}

# MoE families DTA runs whose TRL default has no router loss (the config declares no `router_aux_loss_coef`).
MOE_WITHOUT_AUX = {
    "glm4_moe": lambda vocab, **kw: transformers.Glm4MoeConfig(
        vocab_size=vocab, **_COMMON, head_dim=8, intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, **kw),
}
