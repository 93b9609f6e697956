"""The embedded default setup: a tiny tokenizer, a tiny Qwen2-shaped model and a verifiable arithmetic task.

Everything here is built offline, in code, from fixed seeds, so that the recipe (`recipes/grpo.py`), the tests and the
benchmarks can run GRPO end to end on a laptop CPU without downloading anything.

The task is few-shot addition. Every prompt holds `num_shots` solved examples followed by the question:

```
<bos>3+4=7
1+8=9
...
6+5=11
2+7=
```

and the completion should start with the answer (`9`, ideally followed by `<eos>`). Prompts are long (about 110
tokens with 16 shots) and completions short (a few tokens), the shape where GRPO's shared prompts compress well: with
`G` completions of `R` tokens per `P`-token prompt the prefix tree holds `P + G * R` tokens instead of `G * (P + R)`,
about 6x for `P=110, R=6, G=8`. The few-shot examples are drawn per row, so groups share their prompt but not with
each other.

[`arithmetic_reward`] gives partial credit (a number at all, closeness of the number, the exact answer), so that a
randomly initialised model sees a reward signal from its first steps. What a 64-wide, 2-layer model learns in the
recipe's 100 steps (measured, seeds 0-2): to answer with a number, then with a single digit near the typical answer;
the mean reward rises from about 0.07 to about 0.5, the value of the best constant guess. Learning to add did not
happen within 1000 steps (nor within 600 steps of a 128-wide, 4-layer model). As the policy sharpens, more
completions coincide and the batch compresses further (about 6x at the start).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from datasets import Dataset
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Tokenizer,
)

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
ALPHABET = "0123456789+-*/=()?.,:!' \nabcdefghijklmnopqrstuvwxyz"
SUPPORTED_OPS = ("+", "-", "*")


def _byte_level(char: str) -> str:
    # GPT-2/Qwen2 byte-to-unicode map for ASCII: printable characters stand for themselves, bytes 0-32 become
    # chr(256 + byte) ("\n" -> "Ċ", " " -> "Ġ").
    byte = ord(char)
    if byte > 126:
        raise ValueError(f"the tiny alphabet is ASCII only, got {char!r}")
    return char if byte >= 33 else chr(256 + byte)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Builds the tiny character-level tokenizer of the default setup.

    The vocabulary holds the special tokens `<pad>`, `<bos>`, `<eos>` (ids 0-2) and one token per character of
    `ALPHABET` (digits, arithmetic symbols, punctuation, space, newline, lowercase letters): about 50 tokens, so that
    a randomly initialised model already puts a fair share of its probability on digits. Numbers are spelled digit by
    digit and `decode(encode(text)) == text` for any text over the alphabet; other characters are dropped (Qwen2's
    byte-level BPE has no unknown token). Encoding with `add_special_tokens=True` (the default, and what TRL's
    `GRPOTrainer` does for plain-text prompts) prepends `<bos>`; the model is expected to end an answer with `<eos>`.

    The tokenizer is Qwen2's byte-level BPE pipeline (`tokenizers` library: NFC normaliser, Qwen2's split regex,
    byte-level pre-tokenizer and decoder) over this small vocabulary with no merges. It has to be: `AutoTokenizer`
    rebuilds the tokenizer of any folder whose `config.json` says `model_type: qwen2` as a `Qwen2Tokenizer` from the
    saved vocabulary and merges, so any other pipeline (say a word-level one) would come back changed after
    `save_pretrained` and reload. This one comes back identical.

    Returns:
        [`~transformers.PreTrainedTokenizerFast`]: the tokenizer (a `Qwen2Tokenizer`, which is a
        `PreTrainedTokenizerFast`), usable as TRL's `processing_class`.
    """
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in ALPHABET:
        vocab[_byte_level(char)] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        add_bos_token=True,
        model_max_length=1024,
    )


def build_model(
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Qwen2ForCausalLM:
    """Builds a tiny Qwen2-shaped causal LM with random weights.

    The architecture is Qwen2's (RMSNorm, RoPE, SwiGLU MLP, grouped-query attention with biased q/k/v projections,
    tied embeddings like Qwen2.5-0.5B), only small. Initialisation is seeded and leaves the global torch RNG untouched.

    Args:
        tokenizer ([`~transformers.PreTrainedTokenizerFast`], *optional*):
            Tokenizer whose vocabulary size and special token ids the model takes. Defaults to [`build_tokenizer`]().
        hidden_size (`int`, *optional*, defaults to `64`):
            Model width.
        num_hidden_layers (`int`, *optional*, defaults to `2`):
            Number of decoder layers.
        num_attention_heads (`int`, *optional*, defaults to `4`):
            Number of query heads; `hidden_size` must be divisible by it.
        num_key_value_heads (`int`, *optional*, defaults to `2`):
            Number of key/value heads (GQA); `num_attention_heads` must be divisible by it.
        intermediate_size (`int`, *optional*):
            MLP width. Defaults to `3 * hidden_size`.
        tie_word_embeddings (`bool`, *optional*, defaults to `True`):
            Whether the LM head shares the input embedding matrix.
        max_position_embeddings (`int`, *optional*, defaults to `1024`):
            Longest sequence the model is configured for.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the weight initialisation.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Parameter dtype.

    Returns:
        [`~transformers.Qwen2ForCausalLM`]: the model, in eval mode as `from_pretrained` would return it.
    """
    if hidden_size % num_attention_heads != 0:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_attention_heads ({num_attention_heads}); "
            "change one of them."
        )
    if num_attention_heads % num_key_value_heads != 0:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be divisible by num_key_value_heads "
            f"({num_key_value_heads}); change one of them."
        )
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size if intermediate_size is not None else 3 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=dtype,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model.eval()


def build_default_model_dir(path: str | Path, **model_kwargs) -> Path:
    """Writes the tiny model and its tokenizer to a folder that `from_pretrained` (and TRL) can load by path.

    TRL reloads the reference model from the policy's `name_or_path` when `beta > 0` without PEFT, so a model that
    only lives in memory cannot serve there; a saved folder can.

    Args:
        path (`str` or `Path`):
            Folder to write (created if missing; files of an earlier call are overwritten).
        **model_kwargs:
            Passed to [`build_model`] (e.g. `hidden_size`, `seed`).

    Returns:
        `Path`: the folder, holding `config.json`, the weights, `generation_config.json` and the tokenizer files.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _apply(op: str, a: int, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def build_dataset(
    num_rows: int = 2048,
    *,
    num_shots: int = 16,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    seed: int = 0,
) -> Dataset:
    """Generates the few-shot arithmetic dataset.

    Each row is a question `a<op>b=` with operands drawn uniformly from `[0, max_operand]`, preceded by `num_shots`
    solved examples (`a<op>b=c`, one per line) drawn independently for that row.

    Args:
        num_rows (`int`, *optional*, defaults to `2048`):
            Number of rows.
        num_shots (`int`, *optional*, defaults to `16`):
            Solved examples before the question; they make prompts long (about `6 * num_shots` tokens for
            single-digit addition) relative to completions.
        max_operand (`int`, *optional*, defaults to `9`):
            Largest operand.
        ops (`Sequence[str]`, *optional*, defaults to `("+",)`):
            Operators to draw from, a subset of `("+", "-", "*")`.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the generator.

    Returns:
        [`~datasets.Dataset`]: columns `prompt` (`str`, plain text, ends with `=`) and `answer` (`str`, the result
        in decimal, e.g. `"11"` or `"-3"`).
    """
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}.")
    if num_shots < 0:
        raise ValueError(f"num_shots must be >= 0, got {num_shots}.")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}.")
    if not ops or any(op not in SUPPORTED_OPS for op in ops):
        raise ValueError(f"ops must be a non-empty subset of {SUPPORTED_OPS}, got {tuple(ops)}.")
    rng = random.Random(seed)

    def problem() -> tuple[str, int]:
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(tuple(ops))
        return f"{a}{op}{b}=", _apply(op, a, b)

    prompts, answers = [], []
    for _ in range(num_rows):
        shots = "".join(f"{q}{r}\n" for q, r in (problem() for _ in range(num_shots)))
        question, result = problem()
        prompts.append(shots + question)
        answers.append(str(result))
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


_NUMBER = re.compile(r"\s*(-?\d+)")


def _completion_text(completion) -> str:
    # Plain-text datasets give strings; conversational ones give a list of messages ending with the assistant's.
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"expected a completion as a string or a list of messages, got {type(completion).__name__}")


def score_answer(text: str, answer: str) -> float:
    """Partial-credit score of one completion against the expected answer, in `[0, 1]`.

    The completion's answer is its leading integer (leading whitespace allowed), as a few-shot evaluation reads the
    number before the next line; whatever follows it is ignored. The score adds:

    - `0.1` if the completion starts with an integer `n`;
    - `0.6 * max(0, 1 - |n - answer| / max(|answer|, 10))` (closeness);
    - `0.3` if `n` is spelled exactly as the answer.

    It is `1.0` exactly when the leading integer is the answer. Every step toward it earns something: answering with
    a number at all, then with a short one (a long digit run is far from a one- or two-digit answer), then with a
    closer one. There is deliberately no credit for the completion's format beyond the number: a format bonus that a
    constant string can collect (say "all digits") is the optimum a tiny policy collapses to.

    Args:
        text (`str`): the completion, decoded without special tokens.
        answer (`str`): the expected answer, an integer in decimal.

    Returns:
        `float`: the score.
    """
    target = int(answer)
    match = _NUMBER.match(text)
    if match is None:
        return 0.0
    number = match.group(1)
    score = 0.1
    if len(number.lstrip("-")) <= 18:  # longer digit runs are far off anyway; keep the arithmetic cheap
        score += 0.6 * max(0.0, 1.0 - abs(int(number) - target) / max(abs(target), 10))
    if number == answer.strip():
        score += 0.3
    return score


def arithmetic_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """Reward function for the arithmetic task, in TRL's reward-function signature.

    TRL's `GRPOTrainer` calls it with the decoded completions and every dataset column as a keyword argument (here
    `answer`). Each completion is scored by [`score_answer`].

    Args:
        completions (`list[str]` or `list[list[dict]]`):
            Completions, plain text or conversational (the last message's `content` is scored).
        answer (`list[str]`):
            Expected answers, one per completion (the dataset's `answer` column).
        **kwargs:
            Other dataset columns and TRL's extras (`prompts`, `completion_ids`, `trainer_state`, ...), unused.

    Returns:
        `list[float]`: one reward in `[0, 1]` per completion; `1.0` means correct.
    """
    if len(completions) != len(answer):
        raise ValueError(
            f"got {len(completions)} completions but {len(answer)} answers; the dataset needs an `answer` column."
        )
    return [score_answer(_completion_text(c), str(a)) for c, a in zip(completions, answer, strict=True)]
