"""One refusal naming every blocker (`trl_dta/refusal.py`): models built with each blocker DTA refuses, alone and in
combinations, are refused with one message listing every blocker; applying every fix the message names (parsed from
the message's text, as a user reads it) gives a model that runs, or a message that says what is left and that no
setting removes it. Engine level (`DTAEngine`: construction and a training call) and trainer level
(`DTAGRPOTrainer`, the model given by name, model fixes through `model_init_kwargs`, trainer fixes through the
config, one training step once nothing is left)."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import transformers
from datasets import Dataset
from peft import LoraConfig, PromptTuningConfig

from conftest import VOCAB
from test_models import FALCON_PROBE, SMALL, build
from trainers.conftest import EOS, PAD, build_tokenizer, make_args
from trl_dta import DTAEngine, DTAGRPOConfig, DTAGRPOTrainer
from trl_dta.refusal import DENSE_ALTERNATIVE, DTAUnsupportedError

STATIC_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
DYNAMIC_ROPE = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
LORA = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])

# The fixes in words that a refusal can name, and how a user applies each (a fix not listed here fails the test, so a
# new one needs its application written down).
WORD_FIXES: dict[str, Callable[[dict], None]] = {
    "use a model with static RoPE scaling": lambda fix: fix["model"].update(rope_parameters=STATIC_ROPE),
    "use a LoRA-style adapter instead (e.g. `peft_config=LoraConfig(...)`)": lambda fix: fix.update(peft=LORA),
}
_SETTINGS = re.compile(r"Fix: set ((?:`\w+=[^`]+`(?:, )?)+) in the (model config|trainer's config)")


def parse(message: str) -> list[tuple[str, dict | str | None]]:
    """Each numbered blocker line of a refusal: `("settings", {where: {name: value}})`, `("words", text)` or
    `("none", None)`."""
    lines = re.findall(r"^  \d+\. (.*)$", message, flags=re.M)
    parsed = []
    for line in lines:
        match = _SETTINGS.search(line)
        if match:
            pairs = [p.split("=", 1) for p in re.findall(r"`([^`]+)`", match.group(1))]
            parsed.append(("settings", {match.group(2): {k: ast.literal_eval(v) for k, v in pairs}}))
        elif " Fix: " in line:
            parsed.append(("words", line.split(" Fix: ", 1)[1].removesuffix(".")))
        else:
            assert line.endswith("No setting removes it."), line
            parsed.append(("none", None))
    return parsed


def apply(parsed, fix: dict) -> list[str]:
    """Apply every fix of a parsed refusal to `fix` (`model`: config overrides, `args`: trainer config, `peft`);
    returns the fixes applied, as text."""
    applied = []
    for kind, payload in parsed:
        if kind == "settings":
            for where, settings in payload.items():
                fix["model" if where == "model config" else "args"].update(settings)
                applied += [f"`{k}={v!r}`" for k, v in settings.items()]
        elif kind == "words":
            assert payload in WORD_FIXES, f"the test does not know how to apply the fix {payload!r}"
            WORD_FIXES[payload](fix)
            applied.append(payload)
    return applied


def settle(attempt: Callable[[dict], None]) -> tuple[list[str], list[list]]:
    """Run `attempt(fix)` until it passes or a refusal names no fix; after each refusal apply every fix it names.
    Returns the messages and their parsed blockers; checks that a fix once applied is never asked for again."""
    fix: dict = {"model": {}, "args": {}, "peft": None}
    messages, parsed_all, applied = [], [], []
    for _ in range(4):
        try:
            attempt(fix)
            return messages, parsed_all
        except DTAUnsupportedError as refusal:
            message = str(refusal)
            parsed = parse(message)
            assert len(parsed) == len(refusal.blockers), message
            assert DENSE_ALTERNATIVE in message, message
            for done in applied:  # a named fix is enough: what was fixed is not refused again
                assert done not in message, f"{done} was applied, yet refused again:\n{message}"
            messages.append(message)
            parsed_all.append(parsed)
            if all(kind == "none" for kind, _ in parsed):
                return messages, parsed_all
            applied += apply(parsed, fix)
    pytest.fail(f"still refused after 4 rounds of fixes:\n{messages[-1]}")


@dataclass
class Case:
    """A model with blockers and the refusals it must meet: `messages[k]` a phrase of each blocker the k-th message
    lists, in its order (the next message comes once every fix of the previous one is applied); `refused` whether the
    last one names only what no setting removes (else the model runs after it)."""

    config: Callable[..., object]
    messages: list[list[str]]
    refused: bool = False


def _mixtral(**kw):
    return transformers.MixtralConfig(**{**SMALL, **dict(intermediate_size=24, num_key_value_heads=2, head_dim=8,
                                                         num_local_experts=4, num_experts_per_tok=2), **kw})


def check_messages(case: Case, messages: list[str], parsed: list[list]) -> None:
    assert len(messages) == len(case.messages), messages
    for message, phrases, blockers in zip(messages, case.messages, parsed):
        positions = [message.find(phrase) for phrase in phrases]
        assert all(p >= 0 for p in positions) and positions == sorted(positions), (phrases, message)
        assert len(blockers) == len(phrases), message
    fixable = [[kind != "none" for kind, _ in blockers] for blockers in parsed]
    assert all(any(f) for f in fixable[:-1]), "a refusal before the last one named no fix"
    if case.refused:
        assert not any(fixable[-1]), messages[-1]
    else:
        assert all(fixable[-1]), messages[-1]


JITTER, DYNAMIC, ATTN_DROPOUT = "`router_jitter_noise=0.1`", "rope_type 'dynamic'", "attention_dropout=0.1"
ENGINE_CASES = {
    # Features with a fix, together; attention dropout is refused by the training call, once the model is built.
    "jitter+dynamic-rope+attention-dropout": Case(
        lambda **kw: _mixtral(**{"router_jitter_noise": 0.1, "rope_parameters": DYNAMIC_ROPE, "attention_dropout": 0.1,
                                 **kw}), [[JITTER, DYNAMIC], [ATTN_DROPOUT]]),
    "two-jitter-fields": Case(lambda **kw: transformers.PhimoeConfig(**{
        **SMALL, **dict(intermediate_size=32, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        router_jitter_noise=0.01, input_jitter_noise=0.01), **kw}),
        [["`router_jitter_noise=0.01`, `input_jitter_noise=0.01`"]]),
    # A blocker the probe finds, beside one with a fix: fixing the second leaves the first.
    "own-attention-code+dynamic-rope": Case(lambda **kw: transformers.FalconConfig(**{
        **SMALL, "alibi": False, "rope_parameters": DYNAMIC_ROPE, **kw}),
        [[FALCON_PROBE, DYNAMIC], [FALCON_PROBE]], refused=True),
    # Rules about the attention and the logits: all listed, the probe not run (it would only restate them).
    "chunked+logit-scaling+jitter": Case(
        lambda **kw: _mixtral(**{"router_jitter_noise": 0.1, "attention_chunk_size": 4, "logits_scaling": 2.0, **kw}),
        [["attention_chunk_size=4", "logits_scaling=2.0", JITTER], ["attention_chunk_size=4", "logits_scaling=2.0"]],
        refused=True),
    "alibi": Case(lambda **kw: transformers.FalconConfig(**{**SMALL, "alibi": True, **kw}), [["ALiBi"]], refused=True),
    "state-space": Case(lambda **kw: transformers.MambaConfig(**{"vocab_size": VOCAB, "hidden_size": 32,
                                                                 "num_hidden_layers": 2, **kw}),
                        [["['linear_attention'] layers"]], refused=True),
}


@pytest.mark.parametrize("name", list(ENGINE_CASES))
def test_engine_refusal_names_every_blocker_and_its_fixes_are_enough(name):
    case = ENGINE_CASES[name]

    def attempt(fix):
        assert fix["peft"] is None and not fix["args"], "an engine-level fix went to the trainer"
        model = build(case.config(**fix["model"]), attn=None).train()
        DTAEngine(model).forward_backward([[3, 4, 5, 6], [3, 4, 7]], lambda i, lp, ent: lp.sum())  # in train mode

    messages, parsed = settle(attempt)
    check_messages(case, messages, parsed)


# ------------------------------------------------------------------------------------------------------ trainers


@pytest.fixture(scope="module")
def trainer_setup(tmp_path_factory):
    tokenizer = build_tokenizer()
    return tokenizer, Dataset.from_dict({"prompt": ["a+b=", "c+d=", "say hi", "abc"]}), tmp_path_factory


def _qwen2_moe(vocab, **kw):
    return transformers.Qwen2MoeConfig(**{**SMALL, **dict(vocab_size=vocab, intermediate_size=32,
                                                          moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                                          num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                                          pad_token_id=PAD, eos_token_id=EOS), **kw})


# name -> (the saved model's config, trainer settings, PEFT config, the refusals): trainer arguments first (before the
# model loads), then every blocker of the model in one message.
TRAINER_CASES = {
    "args+jitter+attention-dropout": (
        Case(lambda vocab: _mixtral(vocab_size=vocab, router_jitter_noise=0.1, attention_dropout=0.1,
                                    pad_token_id=PAD, eos_token_id=EOS),
             [["`fp16=True` is not supported", "fuses the optimizer step"], [JITTER, ATTN_DROPOUT]]),
        dict(fp16=True, optim="lomo"), None),
    # TRL's router loss of a family DTA does not reproduce, a fix in words (RoPE) and a prompt-learning adapter.
    "router-loss+dynamic-rope+prompt-tuning": (
        Case(lambda vocab: _qwen2_moe(vocab, rope_parameters=DYNAMIC_ROPE),
             [[DYNAMIC, "load-balancing loss", "prompt-learning adapters"]]),
        {}, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)),
    # Dropout modules (TRL's `disable_dropout`).
    "dropout-modules": (
        Case(lambda vocab: transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                                   resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                                                   pad_token_id=PAD, eos_token_id=EOS),
             [["dropout is active"]]),
        {}, None),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAINER_CASES))
def test_trainer_refusal_names_every_blocker_and_its_fixes_are_enough(trainer_setup, name):
    tokenizer, dataset, tmp = trainer_setup
    case, args, peft = TRAINER_CASES[name]
    torch.manual_seed(0)
    path = tmp.mktemp(name)
    transformers.AutoModelForCausalLM.from_config(case.config(len(tokenizer))).save_pretrained(path)
    tokenizer.save_pretrained(path)
    trained = []

    def attempt(fix):
        settings = {**args, **fix["args"], "model_init_kwargs": dict(fix["model"]) or None}
        config = make_args(DTAGRPOConfig, path / "out", steps=1, **settings)
        trainer = DTAGRPOTrainer(model=str(path), reward_funcs=lambda completions, **kw: [float(len(c)) for c in
                                 completions], args=config, train_dataset=dataset, processing_class=tokenizer,
                                 peft_config=fix["peft"] or peft)
        trainer.train()
        trained.append([e for e in trainer.state.log_history if "loss" in e])

    messages, parsed = settle(attempt)
    check_messages(case, messages, parsed)
    assert trained and trained[0][0]["dta/dense_fallback"] == 0.0, "the fixed model did not train through DTA"


def test_blocker_and_refusal_format():
    """A blocker's fix reads as its settings (one spelling, parsed back by `parse`), words, or none; an empty refusal
    and settings without a place are errors of the caller."""
    from trl_dta.refusal import MODEL_CONFIG, TRAINER_CONFIG, Blocker

    blockers = [Blocker("a", settings={"x": 0.0, "y": "z"}, where=MODEL_CONFIG),
                Blocker("b", settings={"flag": True}, where=TRAINER_CONFIG), Blocker("c", fix="do this"), Blocker("d")]
    message = str(DTAUnsupportedError("M", blockers))
    assert parse(message) == [("settings", {"model config": {"x": 0.0, "y": "z"}}),
                              ("settings", {"trainer's config": {"flag": True}}), ("words", "do this"), ("none", None)]
    assert "`model_init_kwargs={'x': 0.0, 'y': 'z'}`" in message and message.startswith("M cannot run through DTA:")
    assert isinstance(DTAUnsupportedError("M", blockers[:1]), (NotImplementedError, ValueError))
    with pytest.raises(ValueError, match="at least one blocker"):
        DTAUnsupportedError("M", [])
    with pytest.raises(ValueError, match="settings go in one of"):
        Blocker("e", settings={"x": 1})


def test_trainer_refusal_in_the_trainers_words():
    """From a trainer (`trainers/model_checks.check_policy`), a refusal closes with `dta_enabled=False` alone (no
    `DTAEngine` tail), lists the tested families only for an untested family, names `lora_dropout=0.0` for a LoRA
    adapter's dropout, and an engine argument by the `dta_*` field the user set."""
    from peft import get_peft_model

    from trl_dta.refusal import ENGINE_ALTERNATIVE, TRAINER_ALTERNATIVE
    from trl_dta.trainers.model_checks import check_policy

    def refusal(model, build_engine=lambda: None) -> str:
        with pytest.raises(DTAUnsupportedError) as info:
            check_policy(model, is_vlm=False, aux_loss_enabled=False, build_engine=build_engine)
        return str(info.value)

    llama = transformers.LlamaConfig(**SMALL, intermediate_size=48, num_key_value_heads=2)
    message = refusal(get_peft_model(build(llama), LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj"])))
    assert "Fix: set `disable_dropout=True` in the trainer's config, or set `lora_dropout=0.0`" in message, message
    assert message.endswith(TRAINER_ALTERNATIVE) and ENGINE_ALTERNATIVE not in message, message
    assert "Model types tested" not in message, message
    untested = transformers.StableLmConfig(**SMALL, intermediate_size=48, num_key_value_heads=2, hidden_dropout=0.1)
    assert "Model types tested with DTA: " in refusal(build(untested).train())
    with pytest.raises(ValueError, match=r"^`dta_attn_backend`: attention backend 'flash' cannot run on cpu"):
        check_policy(build(llama), is_vlm=False, aux_loss_enabled=False,
                     build_engine=lambda: DTAEngine(build(llama), attn_backend="flash"))
