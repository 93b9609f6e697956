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

from bounds import assert_as_precise, chain_bound, gradient_slack

SPECIALS = ["<pad>", "<bos>", "<eos>"]
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,:+=?"
PAD, BOS, EOS = 0, 1, 2

# The DTA side of an equivalence test: DTA's defaults (no `dta_*` option set).
DTA: dict = {}

# Logged values that measure time or memory, or that exist only on one side.
UNCOMPARED = {"step_time", "generation_time", "scoring_time", "train_runtime", "train_samples_per_second",
              "train_steps_per_second", "total_flos", "train_loss", "dta/rollout_generation_s", "dta/rollout_env_s",
              "dta/rollout_reward_s"}


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
    mixed_precision: str = "no"  # accelerate's, read right after training (its state is shared between trainers)


# The precision regimes of the equivalence tests (`compare_in_precision`; bounds derived in `tests/bounds.py` and
# below, none tuned to a machine):
# - "fp64", the exactness question: both trainers load the model in float64; every parameter update, every logged
#   value within `float64_rtol` of TRL's (the float32 steps TRL keeps inside a float64 model, bounded).
# - "fp32", what float32 can promise: TRL and DTA in float32 (`bf16=False`), both judged against TRL in float64 on the
#   same completions; DTA's update no farther from it than `gradient_slack` times TRL's float32 update is
#   (`assert_as_precise_run`), its logged values within float32 rounding of TRL's (`float32_rtol`).
# - "trl", TRL's default `bf16=True`: the model given by name loads in float32 and trains and scores under bf16
#   autocast, as a user runs it; DTA is judged by the dense path's own bf16 error (`assert_bf16_bar`).
PRECISIONS = ("fp64", "fp32", "trl")
# The "trl" regime's comparisons (`compare_in_precision`) train all three runs at a tenth of the learning rate.
# At the tests' SGD step (0.05, TRL's default is 1e-6) a
# quarter of the tokens leave the clip range by the second step, and clipping's discontinuity turns bf16 rounding into
# tokens flipping between clipped and not (measured: 24% clipped for TRL bf16, 27% float32, 34% DTA bf16, update gaps
# 0.13 and 0.30); at a tenth none is clipped and the gaps measure rounding (0.035 and 0.011).
BF16_LEARNING_RATE_FACTOR = 0.1
LEARNING_RATE = 0.05  # the tests' SGD step


def make_args(config_cls, output_dir: Path, steps: int = 2, precision: str = "fp32", **config):
    """The tests' config: small batches, SGD (parameter updates proportional to the gradients) on CPU, the model in
    float64 (`precision="fp64"`), float32 (`"fp32"`) or TRL's default bf16 autocast over float32 (`"trl"`)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    defaults = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=6,
        generation_kwargs={"sequence_bias": [[[EOS], 4.0]]},  # <eos> at about 1 in 10 tokens: varied lengths
        max_steps=steps,
        learning_rate=LEARNING_RATE,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        gradient_checkpointing=False,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    if precision in ("fp32", "fp64"):
        defaults["bf16"] = False
    if precision == "fp64":
        defaults["model_init_kwargs"] = {**(config.pop("model_init_kwargs", None) or {}), "dtype": torch.float64}
    defaults.update(config)
    args = config_cls(**defaults)
    if precision == "trl":
        assert args.bf16 and not args.fp16, "TRL's default precision is bf16 autocast"
    return args


def train(trainer_cls, config_cls, model_dir, tokenizer, dataset, output_dir: Path, steps: int = 2,
          trainer_kwargs: dict | None = None, setup=None, precision: str = "fp32", **config) -> Run:
    """Train `steps` optimizer steps; records every generated completion (through the reward function)."""
    completions: list[list[int]] = []

    def reward(completions_text=None, completion_ids=None, **kwargs):
        completions.extend(list(ids) for ids in completion_ids)
        return [reward_from_ids(ids) for ids in completion_ids]

    args = make_args(config_cls, output_dir, steps, precision, **config)
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
    return Run(trainer, logs, completions, initial, final, trainer.accelerator.mixed_precision)


# ------------------------------------------------------------------------------------------------ bounds of a run


def _text_config(run: Run):
    model = run.trainer.model
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return model.config.get_text_config()


def _dtype(run: Run) -> torch.dtype:
    dtypes = {p.dtype for p in run.final.values()}
    assert len(dtypes) == 1, f"trained parameters in several dtypes {dtypes}"
    return dtypes.pop()


def tokens_per_step(run: Run) -> int:
    """An upper bound on the tokens one optimizer step sums over: the most tokens of one generation (TRL's cumulative
    `num_tokens` counts prompts and completions once per generation, which covers one or more steps)."""
    return tokens_per_step_of(run.logs)


def tokens_per_step_of(logs: list[dict]) -> int:
    """`tokens_per_step` from logged entries."""
    seen = [0] + [entry["num_tokens"] for entry in logs if "num_tokens" in entry]
    assert len(seen) > 1, "the run logged no `num_tokens`"
    return int(max(b - a for a, b in zip(seen, seen[1:])) or seen[-1])


def rows_per_step(run: Run) -> int:
    """The sequences of one optimizer step on all processes: an upper bound on the most that share a token."""
    args = run.trainer.args
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * run.trainer.accelerator.num_processes


def float64_rtol_of(config, tokens: int) -> float:
    """`float64_rtol` from a model's text config and the tokens of a step."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    layers = config.num_hidden_layers
    k = config.vocab_size + tokens + 2 * (2 * layers + 1) + (layers * (config.hidden_size + experts) if experts else 0)
    return chain_bound(k + 10, torch.float32)


def float64_rtol(run: Run, tokens: int | None = None) -> float:
    """How far apart two float64 trainings of the same data (TRL's and DTA's) may end, relative to each tensor's
    update and to each logged value: a float64 model still takes float32 steps, TRL's fused LM head (its softmax
    statistics in float32 over the vocabulary, its weight gradient accumulated in float32 over the step's tokens:
    `trl.kernels.ChunkedLogProbFunction`), the stock RMSNorm's float32 upcast (two per layer and the final norm), and
    in MoE models the routers' float32 softmax (their logits over the hidden size, the experts). Float64's own
    rounding is 2**29 times smaller. So `bounds.chain_bound(k)` in float32 with k = vocabulary + tokens per step +
    2 (2 L + 1) + L (hidden + experts) + 10 (`tokens`: the step's tokens, default `tokens_per_step`)."""
    return float64_rtol_of(_text_config(run), tokens_per_step(run) if tokens is None else tokens)


def float32_rtol(run: Run, tokens: int | None = None) -> float:
    """How far apart two float32 computations of the same logged value may be (relative to it, or to the O(1)
    magnitudes it sums: standardised advantages, ratios near 1, entropies up to log V): `bounds.chain_bound(k)` with
    k the longest chain of a value through the model and back: per layer the projections (hidden, intermediate)
    and attention over at most the step's tokens, the head (hidden, vocabulary), twice (forward and backward), plus
    the sums over the step's tokens and over the sequences that share one (`tokens`: default `tokens_per_step`)."""
    c = _text_config(run)
    inner = getattr(c, "moe_intermediate_size", None) or getattr(c, "intermediate_size", None) or 4 * c.hidden_size
    tokens = tokens_per_step(run) if tokens is None else tokens
    k = (2 * (c.num_hidden_layers * (c.hidden_size + inner + tokens + 10) + c.hidden_size + c.vocab_size) + tokens
         + rows_per_step(run) + 10)
    return chain_bound(k, torch.float32)


def _close(a, b, rtol, atol) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return abs(a - b) <= atol + rtol * abs(b)


# ------------------------------------------------------------------------------------------------ comparisons


def assert_same_logs(ref: Run, dta: Run, rtol: float, atol: float, compare_metrics: bool = True,
                     compare_completions: bool = True) -> dict[str, float]:
    """The same completions, and every logged loss/metric of every step within `atol + rtol |TRL's|`. Returns the
    worst relative errors of the loss and of the other metrics."""
    if compare_completions:
        assert dta.completions == ref.completions, "the two trainers generated different completions"
    assert len(dta.logs) == len(ref.logs) > 0
    worst = {"loss": 0.0, "metric": 0.0}
    for step, (r, d) in enumerate(zip(ref.logs, dta.logs)):
        keys = ["loss", "grad_norm"] if not compare_metrics else [k for k in r if k not in UNCOMPARED]
        for key in keys:
            assert key in d, f"step {step}: DTA did not log {key!r}"
            a, b = d[key], r[key]
            assert _close(a, b, rtol, atol), f"step {step}: {key} = {a!r} (DTA) vs {b!r} (TRL), bound {rtol:.2g}"
            if isinstance(a, float) and isinstance(b, float) and not math.isnan(b):
                kind = "loss" if key == "loss" else "metric"
                worst[kind] = max(worst[kind], abs(a - b) / max(abs(b), atol, 1e-30))
    return worst


def assert_same_updates(ref: Run, dta: Run, rtol: float) -> float:
    """The same start, and every trained tensor's update within `rtol` of TRL's: `max |p_dta - p_trl| <= rtol * max
    |p_trl - p_init|` per tensor; at least one tensor moved (so the comparison can fail). Returns the worst."""
    assert ref.final.keys() == dta.final.keys()
    moved, worst = 0, 0.0
    for name, p_ref in ref.final.items():
        assert torch.equal(ref.initial[name], dta.initial[name]), f"{name}: different initial values"
        update = (p_ref - ref.initial[name]).abs().max().item()
        if update == 0:
            continue
        moved += 1
        err = (dta.final[name] - p_ref).abs().max().item() / update
        worst = max(worst, err)
        assert err <= rtol, f"{name}: parameter update differs by {err:.2e} (relative to the update; bound {rtol:.2g})"
    assert moved > 0, "no parameter moved: the comparison would be vacuous"
    return worst


def assert_equivalent(ref: Run, dta: Run, rtol: float | None = None, atol: float | None = None,
                      compare_metrics: bool = True, compare_completions: bool = True,
                      reference: Run | None = None) -> dict[str, float]:
    """DTA's run equals TRL's: the same completions, the same logged values, the same updates.

    float64 runs (the exactness question): logs and every tensor's update within `float64_rtol` (unless `rtol` is
    given: 0.0 for runs that must be bit-identical). float32 runs: logs within `float32_rtol`, and the updates judged
    against `reference`, TRL's float64 run on the same completions (`assert_as_precise_run`). Returns the worst
    relative errors."""
    dtype = _dtype(ref)
    if rtol is None:
        if dtype == torch.float64:
            rtol = float64_rtol(ref)
        elif reference is None:
            raise ValueError("a float32 comparison of updates needs TRL's float64 run on the same completions as "
                             "`reference` (bounds are relative to TRL's own float32 error, `assert_as_precise_run`)")
        else:
            rtol = float32_rtol(ref)
    atol = rtol if atol is None else atol
    worst = assert_same_logs(ref, dta, rtol, atol, compare_metrics, compare_completions)
    if reference is not None and dtype != torch.float64:
        worst["param"] = assert_as_precise_run(ref, dta, reference)
    else:
        worst["param"] = assert_same_updates(ref, dta, rtol)
    return worst


def assert_params_close(ref: Run, dta: Run, rtol: float | None = None) -> float:
    """Every trained parameter within `rtol` (default: `float64_rtol`, float64 runs) of its own size (max over the
    tensor). Returns the worst error."""
    rtol = float64_rtol(ref) if rtol is None else rtol
    worst = 0.0
    for name, p in ref.final.items():
        err = (dta.final[name] - p).abs().max().item() / max(p.abs().max().item(), 1e-30)
        assert err <= rtol, f"{name}: differs by {err:.2e} relative to its size"
        worst = max(worst, err)
    return worst


def update_gap(a: Run, b: Run) -> float:
    """`||u_a - u_b|| / ||u_b||`, the relative difference of two runs' parameter updates `u = final - initial` over
    all trained parameters together."""
    assert a.final.keys() == b.final.keys()
    num = sum(((a.final[n] - a.initial[n]).double() - (b.final[n] - b.initial[n]).double()).pow(2).sum()
              for n in b.final)
    den = sum((b.final[n] - b.initial[n]).double().pow(2).sum() for n in b.final)
    assert den > 0, "no parameter moved: the comparison would be vacuous"
    return float((num / den).sqrt())


def update_slack(run: Run) -> float:
    """`bounds.gradient_slack` for a run's updates: at most `rows_per_step` sequences share a token, over all the
    trained parameters' elements."""
    return gradient_slack(rows_per_step(run), sum(p.numel() for p in run.final.values()))


def assert_as_precise_run(ref: Run, dta: Run, reference: Run) -> float:
    """float32: DTA's update no farther from TRL's float64 update (`reference`, the same completions) than
    `update_slack` times TRL's float32 update is (relative L2 over all parameters, `update_gap`). Both float32 runs
    round their parameters to float32 after every step, an error they share; the rest is their gradients' rounding,
    whose multiple `bounds.gradient_slack` derives. Returns the ratio."""
    assert _dtype(reference) == torch.float64, "the reference run must be float64"
    assert reference.completions == ref.completions == dta.completions, (
        "TRL's float64 run sampled other completions than the float32 runs: the gaps would measure sampling")
    return assert_as_precise(update_gap(dta, reference), update_gap(ref, reference), update_slack(ref),
                             "parameter updates")


# DTA's bf16 update may be `update_slack` times farther from TRL's float32 update than TRL's own bf16 update is: the
# multiple `bounds.gradient_slack` derives for a backward that sums the gradients of the sequences sharing a prefix
# before rounding (DTA's attention parts and summed prefix gradients, see tests/test_precision.py), against the
# dense path's independent roundings.


def assert_bf16_bar(trl_bf16: Run, trl_fp32: Run, dta_bf16: Run) -> dict[str, float]:
    """DTA under TRL's default precision is as accurate as TRL's bf16 path: `gap(DTA bf16, TRL fp32) <=
    update_slack * gap(TRL bf16, TRL fp32)` (`update_gap`). All three generated the same completions (else the gaps
    would measure sampling, not precision), trained at one learning rate, and the bf16 runs really ran under bf16
    autocast. Returns the three gaps (`dta_vs_trl_bf16` too, for the record)."""
    assert trl_bf16.mixed_precision == dta_bf16.mixed_precision == "bf16" and trl_fp32.mixed_precision == "no"
    rates = {run.trainer.args.learning_rate for run in (trl_bf16, trl_fp32, dta_bf16)}
    assert len(rates) == 1, f"the three runs trained at different learning rates {rates}"
    assert trl_bf16.completions == trl_fp32.completions, "bf16 and float32 TRL generated different completions"
    assert dta_bf16.completions == trl_bf16.completions, "DTA and TRL generated different completions in bf16"
    gaps = {"dta_vs_trl_bf16": update_gap(dta_bf16, trl_bf16), "trl_bf16_vs_fp32": update_gap(trl_bf16, trl_fp32),
            "dta_bf16_vs_fp32": update_gap(dta_bf16, trl_fp32)}
    assert gaps["trl_bf16_vs_fp32"] > 0, "TRL's bf16 update equals its float32 one: bf16 did not run"
    assert_as_precise(gaps["dta_bf16_vs_fp32"], gaps["trl_bf16_vs_fp32"], update_slack(trl_bf16),
                      "bf16 parameter updates")
    return gaps


def compare_in_precision(precision: str, ref_cls, ref_config, dta_cls, dta_config_cls, model_dir, tokenizer, dataset,
                         tmp_path: Path, update_rtol: float | None = None, check_metrics: bool = True,
                         dta_config: dict | None = None, return_gaps: bool = False,
                         reference_config: dict | None = None, **config):
    """Train TRL's trainer and DTA's on the same data in `precision` and compare them (`PRECISIONS`): "fp64" as
    `assert_equivalent` (updates within `update_rtol`, default `float64_rtol`); "fp32" against a third run, TRL's in
    float64 (`assert_as_precise_run`); "trl" by `assert_bf16_bar` (a float32 TRL run added, all three at
    `BF16_LEARNING_RATE_FACTOR` times the learning rate). `reference_config` overrides `config` for the float64
    reference of "fp32" (e.g. MoE experts in their float64-capable form). Returns `(TRL, DTA)`, and with
    `return_gaps` the measured differences as a third item."""
    if precision == "trl":
        config["learning_rate"] = config.get("learning_rate", LEARNING_RATE) * BF16_LEARNING_RATE_FACTOR
    ref = train(ref_cls, ref_config, model_dir, tokenizer, dataset, tmp_path / "trl", precision=precision, **config)
    dta = train(dta_cls, dta_config_cls, model_dir, tokenizer, dataset, tmp_path / "dta", precision=precision,
                **config, **(dta_config or {}))
    assert all(entry["dta/dense_fallback"] == 0.0 for entry in dta.logs if "dta/dense_fallback" in entry)
    assert any("dta/tree_tokens" in entry for entry in dta.logs), "no micro-batch ran through DTA"
    if precision == "fp64":
        assert_params_close(ref, dta, update_rtol)
        gaps = assert_equivalent(ref, dta, rtol=update_rtol, compare_metrics=check_metrics)
    elif precision == "fp32":
        exact = train(ref_cls, ref_config, model_dir, tokenizer, dataset, tmp_path / "trl_fp64", precision="fp64",
                      **{**config, **(reference_config or {})})
        gaps = assert_equivalent(ref, dta, compare_metrics=check_metrics, reference=exact)
    else:
        fp32 = train(ref_cls, ref_config, model_dir, tokenizer, dataset, tmp_path / "trl_fp32", precision="fp32",
                     **config)
        gaps = assert_bf16_bar(ref, fp32, dta)
    return (ref, dta, gaps) if return_gaps else (ref, dta)
