"""The support probe judged against the model's own precision (`modeling/support.py`): a stock float64 hybrid, whose
recurrent layers compute in float32 inside the float64 model, passes; a planted wrong model (a position bias DTA's
attention lacks, or bidirectional attention) is still refused in float64 and float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from conftest import make_model
from hybrid_models import make_hybrid
from trl_dta.modeling.support import check_model_support


def _planted_attention(bias_slope: float, causal: bool):
    """An attention function with a flaw DTA does not reproduce: `-bias_slope * (query position - key position)` added
    to every score (ALiBi-like), or no causal mask. Positions are absolute (a cached continuation's queries are the
    last of the keys), so the model is consistent with its own cache."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        n_q, n_k = query.shape[2], key.shape[2]
        q_pos = torch.arange(n_k - n_q, n_k)[:, None]  # (n_q, 1)
        k_pos = torch.arange(n_k)[None]  # (1, n_k)
        bias = (-bias_slope * (q_pos - k_pos)).to(query.dtype)  # (n_q, n_k)
        if causal:
            bias = bias.masked_fill(k_pos > q_pos, float("-inf"))
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None  # (batch, n_q, n_heads, head_dim)

    return attention


PLANTED = {"position-bias": _planted_attention(0.5, causal=True), "bidirectional": _planted_attention(0.0, False)}


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5_text"])
def test_stock_float64_hybrid_passes(family):
    """transformers' Mamba2 and Gated DeltaNet compute in float32 inside a float64 model (no `float64_internals`):
    DTA's gap is the dense path's own, and the probe accepts it."""
    check_model_support(make_hybrid(family, torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("flaw", list(PLANTED))
def test_planted_wrong_model_is_refused(flaw, dtype):
    name = f"dta_test_{flaw}"
    transformers.AttentionInterface.register(name, PLANTED[flaw])
    model = make_model("llama", dtype)
    model.set_attn_implementation(name)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[5, 6, 7]])).logits).all()  # it runs densely
    with pytest.raises(ValueError) as err:
        check_model_support(model)
    message = str(err.value)
    assert "other log-probs than the dense forward" in message and "cached decoding by" in message, message
