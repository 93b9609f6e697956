"""The embedded default setup: tokenizer, model, dataset and reward (`demos.tiny`), and its GRPO learning signal."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    AutoModelForCausalLM,
    AutoProcessor,
    AutoTokenizer,
    Qwen2ForCausalLM,
)

from trl_dta.demos import tiny


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer()


@pytest.fixture(scope="module")
def dataset():
    return tiny.build_dataset(64, seed=3)


# ----------------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip(tokenizer, dataset):
    texts = [*dataset["prompt"], *dataset["answer"], "q: what is 3 plus 4? the answer is 7.\n", "12*(3-4)=-12"]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
        assert len(ids) == len(text)  # one token per character
        with_bos = tokenizer(text)["input_ids"]
        assert with_bos == [tokenizer.bos_token_id, *ids]
        assert tokenizer.decode(with_bos, skip_special_tokens=True) == text


def test_tokenizer_specials_and_digits(tokenizer):
    specials = [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id]
    assert specials == [0, 1, 2]
    assert len(tokenizer) == len(tiny.SPECIAL_TOKENS) + len(tiny.ALPHABET)
    digit_ids = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    assert len(set(digit_ids)) == 10 and not set(digit_ids) & set(specials)
    ids = tokenizer("7<eos>", add_special_tokens=False)["input_ids"]
    assert ids == [tokenizer.convert_tokens_to_ids("7"), tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "7"


def test_saved_folder_reloads_identically(tmp_path, tokenizer, dataset):
    """`AutoTokenizer` rebuilds any `model_type: qwen2` folder's tokenizer as a `Qwen2Tokenizer`: it must match."""
    path = tiny.build_default_model_dir(tmp_path / "tiny", seed=5)
    model = tiny.build_model(tokenizer, seed=5)
    for loaded in (AutoTokenizer.from_pretrained(path), AutoProcessor.from_pretrained(path, padding_side="left")):
        assert loaded.get_vocab() == tokenizer.get_vocab()
        assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
        for text in [*dataset["prompt"][:8], "a b\n c"]:
            assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(reloaded, Qwen2ForCausalLM)
    assert reloaded.generation_config.eos_token_id == tokenizer.eos_token_id
    state = model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name


# --------------------------------------------------------------------------------------------------------- model


def test_model_builds_seeded_and_leaves_global_rng_alone(tokenizer):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = tiny.build_model(tokenizer, seed=0)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = tiny.build_model(tokenizer, seed=0)
    c = tiny.build_model(tokenizer, seed=1)
    config = a.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen2", 64, 2)
    assert config.num_attention_heads == 4 and config.num_key_value_heads == 2  # grouped-query attention
    assert config.vocab_size == len(tokenizer) and config.tie_word_embeddings
    assert not a.training
    for (name, pa), pb, _pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters(), strict=True))
    ids = torch.tensor([tokenizer("1+2=3\n4+5=")["input_ids"]])
    logits = a(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()


def test_model_options_and_errors(tokenizer):
    model = tiny.build_model(tokenizer, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=1, tie_word_embeddings=False, dtype=torch.float64)
    assert model.config.num_hidden_layers == 3 and model.config.intermediate_size == 96
    assert next(model.parameters()).dtype == torch.float64
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    with pytest.raises(ValueError, match="hidden_size"):
        tiny.build_model(tokenizer, hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny.build_model(tokenizer, num_attention_heads=4, num_key_value_heads=3)


# ------------------------------------------------------------------------------------------------------- dataset


def test_dataset_rows_are_correct_few_shot_problems(tokenizer):
    ds = tiny.build_dataset(50, num_shots=16, max_operand=9, ops=("+", "-", "*"), seed=7)
    assert ds.column_names == ["prompt", "answer"] and len(ds) == 50
    line = re.compile(r"(\d+)([+\-*])(\d+)=(-?\d+)?")
    for row in ds:
        lines = row["prompt"].split("\n")
        assert len(lines) == 17
        for shot in lines[:-1]:
            a, op, b, result = line.fullmatch(shot).groups()
            assert int(result) == tiny._apply(op, int(a), int(b)) and int(a) <= 9 and int(b) <= 9
        a, op, b, result = line.fullmatch(lines[-1]).groups()
        assert result is None and row["answer"] == str(tiny._apply(op, int(a), int(b)))
    lengths = [len(tokenizer(p)["input_ids"]) for p in tiny.build_dataset(200)["prompt"]]
    assert 90 <= min(lengths) and max(lengths) <= 130  # long prompts, 1-3 token answers


def test_dataset_seeded_and_errors():
    assert tiny.build_dataset(20, seed=1)["prompt"] == tiny.build_dataset(20, seed=1)["prompt"]
    assert tiny.build_dataset(20, seed=1)["prompt"] != tiny.build_dataset(20, seed=2)["prompt"]
    assert all(p.count("\n") == 0 for p in tiny.build_dataset(5, num_shots=0)["prompt"])
    with pytest.raises(ValueError, match="ops"):
        tiny.build_dataset(4, ops=("/",))
    with pytest.raises(ValueError, match="num_rows"):
        tiny.build_dataset(0)
    with pytest.raises(ValueError, match="num_shots"):
        tiny.build_dataset(4, num_shots=-1)


# -------------------------------------------------------------------------------------------------------- reward


def test_reward_correct_answer_is_max(dataset):
    answers = dataset["answer"]
    assert tiny.arithmetic_reward(answers, answer=answers) == [1.0] * len(answers)
    assert tiny.arithmetic_reward([a + "\n3+4=7" for a in answers], answer=answers) == [1.0] * len(answers)
    conversational = [[{"role": "assistant", "content": a}] for a in answers]
    assert tiny.arithmetic_reward(conversational, answer=answers) == [1.0] * len(answers)


def test_reward_partial_credit_orders_attempts():
    completions = ["12", "13", "9", "1", "120", "x12", "", "-12"]
    rewards = dict(zip(completions, tiny.arithmetic_reward(completions, answer=["12"] * len(completions))))
    assert rewards["12"] == 1.0
    assert rewards["12"] > rewards["13"] > rewards["9"] > rewards["1"] > rewards["120"] > rewards["x12"] == 0.0
    assert rewards[""] == 0.0 and rewards["-12"] == pytest.approx(0.1)
    assert tiny.score_answer(" 7 ", "7") == 1.0 and tiny.score_answer("-3", "-3") == 1.0
    assert tiny.score_answer("07", "7") == pytest.approx(0.7)  # the right value, not the answer's spelling


def test_reward_errors():
    with pytest.raises(ValueError, match="answer"):
        tiny.arithmetic_reward(["1", "2"], answer=["1"])
    with pytest.raises(TypeError, match="completion"):
        tiny.arithmetic_reward([3], answer=["3"])


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=tiny.ALPHABET, max_size=8), target=st.integers(-81, 81))
def test_reward_bounded_and_max_only_when_correct(text, target):
    score = tiny.score_answer(text, str(target))
    assert 0.0 <= score <= 1.0
    match = re.match(r"\s*(-?\d+)", text)
    assert (score == 1.0) == (match is not None and match.group(1) == str(target))


# ------------------------------------------------------------------------------------------------ learning signal


def test_plain_grpo_learns_the_task(tmp_path):
    """TRL's own GRPOTrainer on the embedded setup: the mean reward of the last steps clearly beats the first."""
    from trl import GRPOConfig, GRPOTrainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok = tiny.build_tokenizer()
        args = GRPOConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=64, num_generations=8, max_completion_length=6,
            learning_rate=5e-3, lr_scheduler_type="constant", max_steps=40, logging_steps=1, report_to="none",
            save_strategy="no", bf16=False, gradient_checkpointing=False, use_cpu=True, seed=0, disable_tqdm=True,
        )
        trainer = GRPOTrainer(model=tiny.build_model(tok), reward_funcs=tiny.arithmetic_reward, args=args,
                              train_dataset=tiny.build_dataset(512), processing_class=tok)
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    assert len(rewards) == 40
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, rewards
