"""Tiny hybrid models (recurrent layers beside attention) for the engine and trainer tests, built offline from configs
with random weights, and the float64 switch their exactness tests need.

transformers' recurrent layers compute parts of themselves in float32 whatever the model's dtype:
`torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule` and Mamba2's `mamba2_chunk_scan` cast their
inputs to float32 (`.to(torch.float32)`, `.float()`), and the gated RMSNorms and the decay/step parameters
(`A_log.float()`, `a.float()`) do too. A float64 model then rounds to float32 inside every recurrent layer, and DTA
(which sums the children's state gradients before back-propagating through a shared prefix once) differs from the
per-sequence oracle at the float32 level, about 1e-7, with the algorithm exact. [`float64_internals`] removes those
casts for a test: inside it, `Tensor.float()` of a float64 tensor called from the model's modeling module stays
float64 and that module's `torch.float32` is float64, so both the oracle and DTA compute the whole model in float64
(as `conftest.py`'s `use_input_dtype_norms` keeps the RMSNorms of the attention families in float64). Tests of the
stock arithmetic run without it, in float32, bounded by the dense path's own float32 error.
"""

from __future__ import annotations

import contextlib
import importlib
import sys

import torch
import transformers

VOCAB = 61

_ATTENTION = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
_GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4)
# Mamba2: 8 heads of 8 (= 2 x hidden), 2 groups, state 8, conv kernel 4, chunks of 8 tokens (the test trees' longer
# segments cross chunk boundaries).
_MAMBA = dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8)
_PATTERN = ["linear_attention", "full_attention", "linear_attention", "full_attention"]

# family -> config factory `(vocab, **overrides) -> config`. Four layers: recurrent, attention, recurrent, attention
# (Nemotron-H: Mamba2, attention, Mamba2, MLP; Falcon-H1: two layers of attention and Mamba2 side by side).
HYBRID_FAMILIES = {
    "qwen3_5_text": lambda vocab, **kw: transformers.Qwen3_5TextConfig(
        vocab_size=vocab, **_ATTENTION, **_GDN, num_hidden_layers=4, layer_types=_PATTERN, **kw),
    "qwen3_next": lambda vocab, **kw: transformers.Qwen3NextConfig(
        vocab_size=vocab, **_ATTENTION, **_GDN, num_hidden_layers=4, layer_types=_PATTERN, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, **kw),
    "nemotron_h": lambda vocab, **kw: transformers.NemotronHConfig(
        vocab_size=vocab, **_ATTENTION, num_hidden_layers=4, hybrid_override_pattern="M*M-", mamba_num_heads=8,
        mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=8, **kw),
    "granitemoehybrid": lambda vocab, **kw: transformers.GraniteMoeHybridConfig(
        vocab_size=vocab, **_ATTENTION, **_MAMBA, num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=16, **kw),
    "bamba": lambda vocab, **kw: transformers.BambaConfig(
        vocab_size=vocab, **_ATTENTION, **_MAMBA, num_hidden_layers=4, attn_layer_indices=[1, 3], **kw),
    "falcon_h1": lambda vocab, **kw: transformers.FalconH1Config(
        vocab_size=vocab, **_ATTENTION, **{**_MAMBA, "mamba_n_heads": 4}, mamba_d_ssm=32, num_hidden_layers=2, **kw),
}

# Gated DeltaNet (Qwen3.5) and Mamba2 (Nemotron-H): the two recurrences, tested on every case; the others on fewer.
PRIMARY = ("qwen3_5_text", "nemotron_h")
# Families with MoE layers: their experts run in transformers' eager implementation in float64 (the grouped matmul
# has no float64 kernel on CPU).
MOE = ("qwen3_next", "granitemoehybrid")


def make_hybrid(family: str, dtype=torch.float64, *, seed: int = 0, vocab: int = VOCAB, **overrides):
    """A tiny hybrid causal LM of `family`, random weights perturbed (norm weights too, so their gradients matter)."""
    config = HYBRID_FAMILIES[family](vocab, **overrides)
    extra = {"experts_implementation": "eager"} if family in MOE and dtype == torch.float64 else {}
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", **extra)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(dtype)


class _Float64Torch:
    """`torch` as a modeling module sees it inside [`float64_internals`]: `float32` (and `float`) mean float64."""

    def __getattr__(self, name):
        return torch.float64 if name in ("float32", "float") else getattr(torch, name)


@contextlib.contextmanager
def float64_internals(model):
    """Run `model` (a float64 hybrid, or the name of a family in `HYBRID_FAMILIES`: every model of it) in float64
    throughout: see the module docstring. Both sides of an exactness test run inside it; it undoes itself on exit."""
    cls = type(model) if not isinstance(model, str) else \
        transformers.AutoModelForCausalLM._model_mapping[type(HYBRID_FAMILIES[model](VOCAB))]
    module = importlib.import_module(cls.__module__)
    original_float, original_torch = torch.Tensor.float, module.torch

    def float_(self, *args, **kwargs):  # only the modeling module's own calls (not TRL's, not the package's)
        if self.dtype == torch.float64 and sys._getframe(1).f_globals is module.__dict__:
            return self
        return original_float(self, *args, **kwargs)

    torch.Tensor.float = float_
    module.torch = _Float64Torch()
    try:
        yield model
    finally:
        torch.Tensor.float = original_float
        module.torch = original_torch


def hybrid_batch(seed: int = 0, vocab: int = VOCAB) -> list[torch.Tensor]:
    """Sequences whose tree has every shape a recurrent state must survive (conv kernel 4, Mamba chunks of 8, Gated
    DeltaNet chunks of 64):

    ```
    [system prompt (7)] ─┬─ (ends: the system prompt alone, twice)
                         ├─ 5-token leaf, 1-token leaf, 66-token leaf (crosses a delta-rule chunk)
                         └─ [1 token] ─┬─ 4-, 3-token leaves, (ends: a sequence)
                                       └─ [2 tokens, shorter than the kernel] ─┬─ 6-token leaf, (ends)
                                                                              └─ [1 token] ── 2-, 3-, 1-token leaves
    plus a one-token sequence, an unrelated 9-token one, an empty one.
    ```
    """
    g = torch.Generator().manual_seed(seed)

    def rnd(n):
        return torch.randint(3, vocab, (n,), generator=g)

    system = rnd(7)
    one = torch.cat([system, rnd(1)])
    short = torch.cat([one, rnd(2)])
    deep = torch.cat([short, rnd(1)])
    return [
        system.clone(),
        torch.cat([system, rnd(5)]),
        torch.cat([system, rnd(1)]),
        torch.cat([system, rnd(66)]),
        torch.cat([one, rnd(4)]),
        torch.cat([one, rnd(3)]),
        one.clone(),
        torch.cat([short, rnd(6)]),
        short.clone(),
        torch.cat([deep, rnd(2)]),
        torch.cat([deep, rnd(3)]),
        torch.cat([deep, rnd(1)]),
        system.clone(),
        rnd(1),
        rnd(9),
        torch.zeros(0, dtype=torch.long),
    ]
