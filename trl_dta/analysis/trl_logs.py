"""Reading TRL's own completion logs for `trl-dta analyze`: the `.parquet` files of `GRPOTrainer(log_completions=True)`.

At every logging step TRL (read from TRL 1.16's `GRPOTrainer.log` and `_generate_and_score_completions`) writes the
rows of its latest generation batch to `output_dir/completions/completions_{global_step:05d}.parquet`:

```
step   prompt                                  completion                                    <reward>  advantage
1      "2+3="            or [{role, content}]   "5<eos>" decoded   or [{assistant, content}]  0.5       0.25
```

A source is one such file, the `completions/` folder, or the output folder holding it. The rows become token ids as
TRL made them: a text prompt with `tokenizer(text=prompt)` (special tokens added, e.g. a `<bos>`), a conversational
one with the tokenizer's chat template (`apply_chat_template(..., add_generation_prompt=True)`), the completion's text
with `tokenizer(text, add_special_tokens=False)`. The `step` column gives the batches (one per optimizer step), the
prompt the groups (a prompt's completions, as in GRPO).

What a log cannot give back: TRL decodes completions with `skip_special_tokens=True`, so a completion that ended with
the end-of-sequence token counts one token less here than in training (and any other special token it generated is
lost); text that the tokenizer does not encode back into the same ids (non-canonical BPE merges) counts as encoded;
the tools and `chat_template_kwargs` a prompt was rendered with are not logged (prompts are rendered without them);
completions of tool-calling rollouts (several messages) are refused.
"""

from __future__ import annotations

from pathlib import Path

from .rollout_io import AnalysisError, group_label, load_tokenizer

__all__ = ["is_trl_log", "load_trl_completions", "trl_log_files"]

# The columns every TRL completion log has (the rewards' and user-logged columns vary).
TRL_COLUMNS = ("step", "prompt", "completion")
_PATTERN = "completions_*.parquet"


def trl_log_files(source: str | Path) -> list[Path] | None:
    """The `.parquet` files of `source` in step order: the file itself, or the `completions_*.parquet` files of the
    folder (or of its `completions/` subfolder, TRL's output folder); None when `source` is neither."""
    path = Path(source)
    if path.is_file():
        return [path] if path.suffix == ".parquet" else None
    if path.is_dir():
        for folder in (path, path / "completions"):
            files = sorted(folder.glob(_PATTERN))
            if files:
                return files
    return None


def is_trl_log(source: str | Path) -> bool:
    """Whether `source` is a `.parquet` file or a folder of TRL's completion logs (checked by name, not read)."""
    return trl_log_files(source) is not None


def _read(files: list[Path]) -> list[tuple[dict, str]]:
    """`(row, where)` for every row of `files`, in order; the error of a missing pyarrow names it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise AnalysisError(f"{files[0]}: reading .parquet files (TRL's completion logs) needs pyarrow: pip install "
                            "pyarrow (it comes with `datasets`)") from None
    out = []
    for path in files:
        table = pq.read_table(path)
        missing = [name for name in TRL_COLUMNS if name not in table.column_names]
        if missing:
            raise AnalysisError(f"{path}: not a TRL completion log (the file `log_completions=True` writes): no "
                                f"column {missing}; columns present: {table.column_names}")
        out += [(row, f"{path.name} row {n}") for n, row in enumerate(table.to_pylist())]
    return out


def _text(messages, where: str, name: str) -> str:
    """The text of a logged `completion`: a string, or one assistant message (TRL's conversational completion)."""
    if isinstance(messages, str):
        return messages
    if not isinstance(messages, list) or len(messages) != 1 or not isinstance(messages[0], dict):
        raise AnalysisError(f"{where}, column '{name}': expected text or one message, got {messages!r:.200}; a "
                            "tool-calling completion (several messages) cannot be rebuilt from TRL's log")
    content = messages[0].get("content")
    if not isinstance(content, str):
        raise AnalysisError(f"{where}, column '{name}': the message has no text 'content': {messages[0]!r:.200}")
    return content


def _prompt_ids(prompt, tokenizer, where: str) -> list[int]:
    """The prompt's token ids as TRL's `_tokenize_prompts` makes them (without tools or chat_template_kwargs)."""
    if isinstance(prompt, str):
        return list(tokenizer(text=prompt)["input_ids"])
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m for m in prompt):
        raise AnalysisError(f"{where}, column 'prompt': expected text or a list of {{role, content}} messages, got "
                            f"{prompt!r:.200}")
    if not getattr(tokenizer, "chat_template", None):
        raise AnalysisError(f"{where}: a conversational prompt, and the tokenizer has no chat template; pass the "
                            "tokenizer the trainer used (--tokenizer)")
    messages = [{k: v for k, v in m.items() if v is not None} for m in prompt]  # parquet fills absent keys with None
    rendered = tokenizer.apply_chat_template(conversation=[messages], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)
    return list(rendered["input_ids"][0])


def load_trl_completions(
    source: str | Path, tokenizer: str | None, group_field: str | None = None
) -> tuple[list[list[int]], list, list[int]]:
    """Read TRL's completion logs as token-id sequences, their groups and their optimizer steps.

    Args:
        source (`str` or `Path`): a `.parquet` file, a `completions/` folder, or TRL's output folder holding one.
        tokenizer (`str`): name or folder of the tokenizer the trainer used (its `processing_class`).
        group_field (`str`, *optional*): a column holding each row's group label (default: rows with the same prompt
            form a group).

    Returns:
        `(seqs, groups, steps)`: prompt + completion token ids per row, a group label per row, TRL's `step` per row.

    Raises:
        [`AnalysisError`]: no such log, no tokenizer, pyarrow missing, or a malformed row (naming the file and row).
    """
    files = trl_log_files(source)
    if files is None:
        raise AnalysisError(f"{source}: neither a .parquet file nor a folder of TRL's {_PATTERN} files")
    if tokenizer is None:
        raise AnalysisError(f"{source}: TRL's completion logs hold text: pass --tokenizer with the name or folder of "
                            "the tokenizer the trainer used")
    tok = load_tokenizer(tokenizer)
    seqs, groups, steps, prompts = [], [], [], {}
    for row, where in _read(files):
        step = row["step"]
        if isinstance(step, bool) or not isinstance(step, int):
            raise AnalysisError(f"{where}, column 'step': expected an integer, got {step!r}")
        prompt_ids = _prompt_ids(row["prompt"], tok, where)
        completion = _text(row["completion"], where, "completion")
        seqs.append(prompt_ids + list(tok(text=completion, add_special_tokens=False)["input_ids"]))
        steps.append(step)
        if group_field:
            groups.append(group_label(row, group_field, where))
        else:
            groups.append(prompts.setdefault(tuple(prompt_ids), len(prompts)))
    if not seqs:
        raise AnalysisError(f"{source}: no rows")
    return seqs, groups, steps
