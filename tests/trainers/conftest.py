"""Shared harness of the trainer tests: a tiny tokenizer and model built offline, and a runner that trains a TRL
trainer and its DTA counterpart on the same data and compares what they log, generate and learn."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIALS = ["<pad>", "<bos>", "<eos>"]
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,:+=?"
PAD, BOS, EOS = 0, 1, 2

# The DTA side of an equivalence test: DTA's defaults (no `dta_*` option set).
DTA: dict = {}

# Logged values that measure time or memory, or that exist only on one side.
UNCOMPARED = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos",
              "train_loss"}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per character of `ALPHABET`, plus `<pad>`, `<bos>`, `<eos>`."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(ALPHABET))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", padding_side="left"
    )


def build_model(vocab_size: int, seed: int = 0, **overrides) -> Qwen2ForCausalLM:
    """A float32 Qwen2 with 2 layers of width 32 and grouped-query attention, random weights."""
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        initializer_range=0.2,  # peaked enough that sampling gives repeats and early <eos>
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**kwargs)).float()
    model.generation_config.pad_token_id = PAD
    model.generation_config.bos_token_id = BOS
    model.generation_config.eos_token_id = EOS
    return model


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer) -> str:
    """The tiny model saved to a folder: TRL reloads the reference model from `name_or_path` when `beta > 0`."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    build_model(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def dataset() -> Dataset:
    """Prompts of 9 to 30 tokens."""
    prompts = [
        "what is 2+3? answer:",
        "say hello to the world.",
        "count: 1, 2, 3, 4, 5, 6, 7",
        "abc",
        "the quick brown fox jumps over",
        "q: 9+9=? a:",
        "zebra yak xylophone",
        "one two three",
    ]
    return Dataset.from_dict({"prompt": prompts})


def reward_from_ids(ids: list[int]) -> float:
    """A deterministic reward with spread: digits and length score, a repeated token costs."""
    return float(sum(1 for t in ids if 29 <= t < 39)) + 0.3 * len(ids) - 0.5 * (len(ids) - len(set(ids)))


@dataclass
class Run:
    """What one training run produced."""

    trainer: object
    logs: list[dict]
    completions: list[list[int]]
    initial: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor] = field(default_factory=dict)


def make_args(config_cls, output_dir: Path, steps: int = 2, **config):
    """The tests' config: small batches, SGD (parameter updates proportional to the gradients), float32 on CPU."""
    defaults = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=6,
        generation_kwargs={"sequence_bias": [[[EOS], 4.0]]},  # <eos> at about 1 in 10 tokens: varied lengths
        max_steps=steps,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    defaults.update(config)
    return config_cls(**defaults)


def train(trainer_cls, config_cls, model_dir, tokenizer, dataset, output_dir: Path, steps: int = 2,
          trainer_kwargs: dict | None = None, setup=None, **config) -> Run:
    """Train `steps` optimizer steps; records every generated completion (through the reward function)."""
    completions: list[list[int]] = []

    def reward(completions_text=None, completion_ids=None, **kwargs):
        completions.extend(list(ids) for ids in completion_ids)
        return [reward_from_ids(ids) for ids in completion_ids]

    args = make_args(config_cls, output_dir, steps, **config)
    trainer = trainer_cls(
        model=model_dir,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        **(trainer_kwargs or {}),
    )
    if setup is not None:
        setup(trainer)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    final = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return Run(trainer, logs, completions, initial, final)


def assert_params_close(ref: Run, dta: Run, rtol: float = 1e-5) -> float:
    """Every trained parameter within `rtol` of its own size (max over the tensor). Returns the worst error."""
    worst = 0.0
    for name, p in ref.final.items():
        err = (dta.final[name] - p).abs().max().item() / max(p.abs().max().item(), 1e-30)
        assert err <= rtol, f"{name}: differs by {err:.2e} relative to its size"
        worst = max(worst, err)
    return worst


def _close(a, b, rtol, atol) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return abs(a - b) <= atol + rtol * abs(b)


def assert_equivalent(ref: Run, dta: Run, rtol: float = 1e-5, atol: float = 1e-6, compare_metrics: bool = True,
                      compare_completions: bool = True) -> dict[str, float]:
    """DTA's run equals TRL's: same completions, same logged loss/metrics, same parameters after training.

    Parameters are compared on their update: `max |p_dta - p_trl| <= rtol * max |p_trl - p_init|` per tensor, and every
    trained tensor must have moved (so the comparison can fail). Returns the worst relative errors.
    """
    if compare_completions:
        assert dta.completions == ref.completions, "the two trainers generated different completions"
    assert len(dta.logs) == len(ref.logs) > 0
    worst = {"loss": 0.0, "metric": 0.0, "param": 0.0}
    for step, (r, d) in enumerate(zip(ref.logs, dta.logs)):
        keys = ["loss", "grad_norm"] if not compare_metrics else [k for k in r if k not in UNCOMPARED]
        for key in keys:
            assert key in d, f"step {step}: DTA did not log {key!r}"
            a, b = d[key], r[key]
            assert _close(a, b, rtol, atol), f"step {step}: {key} = {a!r} (DTA) vs {b!r} (TRL)"
            if isinstance(a, float) and isinstance(b, float) and not math.isnan(b):
                kind = "loss" if key == "loss" else "metric"
                worst[kind] = max(worst[kind], abs(a - b) / max(abs(b), atol, 1e-30))
    assert ref.final.keys() == dta.final.keys()
    moved = 0
    for name, p_ref in ref.final.items():
        update = (p_ref - ref.initial[name]).abs().max().item()
        assert torch.equal(ref.initial[name], dta.initial[name]), f"{name}: different initial values"
        if update == 0:
            continue
        moved += 1
        err = (dta.final[name] - p_ref).abs().max().item() / update
        worst["param"] = max(worst["param"], err)
        assert err <= rtol, f"{name}: parameter update differs by {err:.2e} (relative to the update)"
    assert moved > 0, "no parameter moved: the comparison would be vacuous"
    return worst
