"""vLLM's CPU build with the settings of `trl_dta/trainers/vllm_cpu.py`: the engine starts in the policy's dtype,
its log-probs are the policy's, TRL's weight sync loads into it (linear weights kept as parameters), and the trainer's
thread setting survives it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_dta.trainers import vllm_cpu

pytestmark = pytest.mark.vllm


def _sample(engine, prompt: list[int], n: int = 4, tokens: int = 8, seed: int = 0):
    from vllm import SamplingParams

    params = SamplingParams(n=n, max_tokens=tokens, logprobs=0, seed=seed, ignore_eos=True)
    (out,) = engine.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return [(list(o.token_ids), [next(iter(lp.values())).logprob for lp in o.logprobs]) for o in out.outputs]


def _policy_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_cpu_engine_generates_in_the_policy_dtype(vllm_engines):
    engine = vllm_engines.get(torch.float32)
    assert engine.llm_engine.model_config.dtype == torch.float32
    policy = AutoModelForCausalLM.from_pretrained(vllm_engines.model_dir, dtype=torch.float32)
    prompt = [1, 7, 8, 9, 10, 11]
    for completion, logprobs in _sample(engine, prompt):
        gap = (_policy_logprobs(policy, prompt, completion) - torch.tensor(logprobs, dtype=torch.float64)).abs().max()
        assert gap < 1e-4, gap  # float32 against float32 (bf16 generation: ~1e-2)
    torch.set_num_threads(1)  # the trainer's setting still applies after an engine was built
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_weights_sync_into_the_engine(vllm_engines, dtype):
    """TRL's colocated weight sync (`load_weights` on the driver worker's model) changes what the engine samples
    and the weights it holds (with oneDNN, float32 linear layers have no `weight_loader` and the first load fails; on
    a CPU with AMX tiles, bf16 ones packed for the SGL kernel)."""
    engine = vllm_engines.get(dtype)
    model = engine.llm_engine.model_executor.driver_worker.model_runner.model
    policy = AutoModelForCausalLM.from_pretrained(vllm_engines.model_dir, dtype=torch.float32)
    prompt = [1, 12, 13, 14]
    before = _sample(engine, prompt)
    try:
        with torch.no_grad():
            for p in policy.parameters():
                p.mul_(1.5)
        model.load_weights(list(policy.named_parameters()))
        engine.reset_prefix_cache()
        for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"):
            held = dict(model.named_parameters())[name]
            assert torch.equal(held, policy.get_parameter(name).to(held.dtype)), name
        after = _sample(engine, prompt)
        assert [lp for _, lp in after] != [lp for _, lp in before]
        if dtype == torch.float32:  # float32 against float32 (bf16 generation: ~1e-2, no bound to hold it to)
            for completion, logprobs in after:
                gap = (_policy_logprobs(policy, prompt, completion) - torch.tensor(logprobs, dtype=torch.float64))
                assert gap.abs().max() < 1e-4
    finally:  # the session's engine goes back to the folder's weights
        vllm_engines.restore(dtype)


def test_generation_dtype_choice(monkeypatch):
    monkeypatch.delenv(vllm_cpu.DTYPE_VARIABLE, raising=False)
    assert vllm_cpu.generation_dtype(torch.float32) == "float32"
    monkeypatch.setenv(vllm_cpu.DTYPE_VARIABLE, "bfloat16")
    assert vllm_cpu.generation_dtype(torch.float32) == "bfloat16"
    monkeypatch.setenv(vllm_cpu.DTYPE_VARIABLE, "half-ish")
    with pytest.raises(ValueError, match=vllm_cpu.DTYPE_VARIABLE):
        vllm_cpu.generation_dtype(torch.float32)


def test_server_mode_is_refused_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    with pytest.raises(ValueError, match="CUDA"):
        vllm_cpu.check_server_mode("server")
    vllm_cpu.check_server_mode("colocate")


def test_head_size_vllm_cpu_lacks_is_refused_early():
    from trl_dta.demos.tiny import build_model

    vllm_cpu.check_head_size(build_model(hidden_size=64, num_attention_heads=2).config)  # head size 32
    with pytest.raises(ValueError, match="head sizes .* this model's is 16"):
        vllm_cpu.check_head_size(build_model(hidden_size=64, num_attention_heads=4).config)
