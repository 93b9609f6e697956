"""`DTAEngine` on real weights and real rollouts: SmolLM2-135M-Instruct (`real_weights.cut_smollm2`: the real embedding,
tied head and final norm, the layers where its massive activation forms and the last two), on a shared chat prompt,
completions sampled from the full model, and a second turn on two of them.

Judged as the random-weight tests are (`tests/test_precision.py`, bounds derived in `tests/bounds.py`): DTA's
log-probs, entropies and parameter gradients against a float64 copy of the same weights (RMSNorm in float64), within
the derived multiple of the dense path's own error at the same precision, in float32 and under TRL's default bf16
autocast. Real weights bring what random ones lack: hidden states up to 2.5e4 and logits over [-37, 33] on a
49,152-token vocabulary; the ratios measured here sit beside the random-weight ones in `bounds.RECORD`.
"""

from __future__ import annotations

import pytest
import torch

from conftest import float64_twin
from real_weights import cut_smollm2, sample_through_eos
from reference import compare_grads, compare_lists, dense_forward_backward, grads_of
from test_precision import BF16, OFF, _assert_as_precise, loss_fn
from trl_dta import DTAEngine

SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = "Mia has 15 stickers. She gives away 8. How many stickers does she have left?"
SECOND_TURN = "Are you sure? Check it again."


@pytest.fixture(scope="module")
def rollouts(smollm2_dir) -> list[torch.Tensor]:
    """8 sequences, ~330 tokens: a shared chat prompt (system + user, 41 tokens), 4 completions sampled from the full
    float32 model (temperature 1, up to 16 tokens), and on two of them a second user turn and 2 sampled replies each
    (up to 10 tokens). Sharing: the prompt by all 8, each continued completion by 3 (itself and its 2 replies)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    eos = tokenizer.eos_token_id

    def sample(prefix: torch.Tensor, n: int, tokens: int) -> list[torch.Tensor]:
        return [torch.tensor(row) for row in sample_through_eos(model, prefix.tolist(), n, tokens, eos)]

    def chat(messages: list[dict]) -> torch.Tensor:
        return torch.tensor(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"])

    torch.manual_seed(0)
    prompt = chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    completions = sample(prompt, 4, 16)
    seqs = [torch.cat([prompt, c]) for c in completions]
    turn = torch.tensor(tokenizer(f"\n<|im_start|>user\n{SECOND_TURN}<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
    for first in seqs[:2]:
        context = torch.cat([first if first[-1] == eos else torch.cat([first, torch.tensor([eos])]), turn])
        seqs += [torch.cat([context, reply]) for reply in sample(context, 2, 10)]
    return seqs


@pytest.fixture(scope="module")
def models(smollm2_dir):
    """The cut model in float32."""
    return cut_smollm2(smollm2_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def exact(models):
    """The same weights in float64 (RMSNorm in float64 too: `float64_twin`)."""
    return float64_twin(models)


@pytest.fixture(scope="module")
def oracle(exact, rollouts):
    """Each sequence run alone, unpadded, in float64: log-probs, entropies, every parameter's gradient."""
    exact.zero_grad(set_to_none=True)
    _, lp64, ent64 = dense_forward_backward(exact, rollouts, loss_fn)
    return lp64, ent64, grads_of(exact)


def test_rollouts_share_a_chat_prompt_and_a_second_turn(rollouts, smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    shared = min(int((s[: len(rollouts[0])] == rollouts[0][: len(s)]).cumprod(0).sum()) for s in rollouts)
    assert len(rollouts) == 8 and shared >= 30  # the system prompt and the question
    assert all(SECOND_TURN in tokenizer.decode(s) for s in rollouts[4:])


@pytest.mark.parametrize("autocast", [OFF, BF16], ids=["float32", "bf16_autocast"])
def test_engine_as_precise_as_dense_on_real_weights(models, rollouts, oracle, autocast):
    """Log-probs, entropies and every parameter gradient (the 49,152 x 576 tied embedding included) within the
    derived multiple of the dense path's error against the float64 oracle (`test_precision._assert_as_precise`)."""
    name = "float32" if autocast is OFF else "bf16 autocast"
    _assert_as_precise(models, rollouts, oracle, autocast, "auto", f"SmolLM2 real weights, {name}")


def test_engine_exact_in_float64_on_real_weights(exact, rollouts, oracle):
    """The exactness question on real weights: DTA in float64 equals the float64 oracle to 1e-10 (log-probs,
    entropies, every gradient), the massive activation and the 49,152-token head included."""
    lp64, ent64, grads64 = oracle
    exact.zero_grad(set_to_none=True)
    out = DTAEngine(exact).forward_backward(rollouts, loss_fn, entropy=True)
    assert out.stats["tree_tokens"] < sum(len(s) for s in rollouts)  # the prompt and the first turns were shared
    errors = compare_lists(out.logps, lp64)[0], compare_lists(out.entropies, ent64)[0]
    worst, name = compare_grads(grads_of(exact), grads64)
    print(f"SmolLM2 real weights, float64: log-probs {errors[0]:.1e}, entropies {errors[1]:.1e}, gradients {worst:.1e}")
    assert max(errors) <= 1e-10, f"log-probs / entropies: relative errors {errors}"
    assert worst <= 1e-10, f"gradient of {name}: relative error {worst:.2e}"
