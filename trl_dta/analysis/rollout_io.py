"""Reading rollouts for `trl-dta analyze`: token-id sequences, or conversations and their training layouts (TRL's
`.parquet` completion logs: `trl_logs.py`).

A source is a JSONL file (one JSON object per line), a folder written by `datasets.Dataset.save_to_disk`, or a dataset
name. Its rows are either **sequences** (token ids, a prompt + completion pair of ids, or text with a tokenizer) or
**conversations**, which become one or more training rows depending on the layout:

```
{"messages": [{"role": "system", "content": "..."}, {"role": "user", ...}, {"role": "assistant", ...}, ...]}
{"turns": [[ids], [ids], ...], "roles": ["system", "user", "assistant", ...]}       or "assistant_mask": [0, 0, 1, ...]
```

A tau2-bench results file (the JSON object `tau2 run` writes, validated by tau2's own `Results` model) is read as
conversations too, one per simulation, with tau2's system prompt and tool schemas, grouped by task
(`trl_dta.envs.tau2.results`; needs `trl-dta[tau2]`). A message with `"train": false` (tau2's fixed first agent
message) is context: its tokens are not assistant tokens, so it is neither trained nor a per-turn row.

`messages` are rendered with the tokenizer's chat template. Message `k` covers the tokens between the renderings of
`messages[:k]` and `messages[:k + 1]`, so every rendering of a shorter conversation must be a prefix of the whole one
(a template that rewrites earlier turns, e.g. drops their reasoning, is refused: give `turns` instead). A conversation
is then what TRL's multi-turn rollouts give: one token sequence and a loss mask that is 1 on the assistant's tokens.
The layouts are those of `trl_dta.trainers.per_turn` (`dta_sample_layout`):

```
tokens      s s s u u a a a u u t t a a a a         s: system, u: user, t: tool, a: assistant
episode     [ s s s u u a a a u u t t a a a a ]     one row per conversation
per_turn    [ s s s u u a a a ]                     one row per assistant turn (a maximal run of assistant tokens):
            [ s s s u u a a a u u t t a a a a ]     the conversation up to and including the turn
```
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from .._checks import check_choice
from ..batch import SAMPLE_LAYOUTS

__all__ = ["AnalysisError", "group_label", "is_conversation_source", "is_tau2_source", "layout_rows",
           "load_conversations", "load_sequences", "load_tokenizer"]

ASSISTANT = "assistant"
CONVERSATION_FIELDS = ("messages", "turns")


class AnalysisError(ValueError):
    """Malformed input for `trl-dta analyze` (the message names the row and the field)."""


# ------------------------------------------------------------------------------------------------------ rows


def _jsonl_rows(path: Path) -> Iterator[tuple[dict, str]]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise AnalysisError(f"{path.name} line {n}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                yield json.loads(line), f"{path.name} line {n}"
            except json.JSONDecodeError as e:
                raise AnalysisError(f"{path.name} line {n}: invalid JSON ({e.msg} at column {e.colno})") from None


def _dataset_rows(source: str, split: str | None) -> Iterator[tuple[dict, str]]:
    import datasets

    path = Path(source)
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
    else:
        ds = datasets.load_dataset(source, split=split)
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            if len(ds) != 1:
                raise AnalysisError(f"{source} has splits {list(ds)}; choose one with --split")
            split = next(iter(ds))
        if split not in ds:
            raise AnalysisError(f"{source} has no split '{split}'; splits: {list(ds)}")
        ds = ds[split]
    for n, row in enumerate(ds):
        yield row, f"{source} row {n}"


def _rows(source: str, split: str | None) -> Iterator[tuple[dict, str]]:
    """`(record, where)` for every row of `source`; `where` names the file and line (or the dataset row)."""
    path = Path(source)
    if is_tau2_source(source):
        from ..envs.tau2.results import tau2_conversations

        return iter(tau2_conversations(path))
    if path.is_file():
        return _jsonl_rows(path)
    if path.is_dir() or not path.suffix:
        return _dataset_rows(source, split)
    raise AnalysisError(f"{source}: no such file")


def _records(source: str, split: str | None) -> Iterator[tuple[dict, str]]:
    for row, where in _rows(source, split):
        if not isinstance(row, dict):
            raise AnalysisError(f"{where}: expected a JSON object, got {type(row).__name__}")
        yield row, where


def is_tau2_source(source: str) -> bool:
    """Whether `source` is a tau2-bench results file (the JSON `tau2 run` writes; read with `trl-dta[tau2]`)."""
    from ..envs.tau2.results import is_tau2_results

    return is_tau2_results(Path(source))


def is_conversation_source(source: str, split: str | None = None) -> bool:
    """Whether the first row of `source` is a conversation (has a `messages` or a `turns` field)."""
    first = next(_records(source, split), None)
    return first is not None and any(name in first[0] for name in CONVERSATION_FIELDS)


def _ids(value, where: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise AnalysisError(f"{where}: expected a list of token ids, got {type(value).__name__}")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise AnalysisError(f"{where}: token ids must be non-negative integers, found {t!r}")
    return list(value)


def _field(row: dict, name: str, where: str):
    if name not in row:
        raise AnalysisError(f"{where}: missing field '{name}' (fields present: {sorted(row)})")
    return row[name]


def group_label(row: dict, group_field: str, where: str):
    if group_field not in row:
        raise AnalysisError(f"{where}: missing group field '{group_field}'")
    value = row[group_field]
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise AnalysisError(f"{where}, group field '{group_field}': a group label must be an integer or a string, got "
                            f"{value!r}")
    return value


# A local tokenizer for the offline case: the byte-level one with TRL's Qwen2.5 chat template that the tau2 adapter
# uses.
LOCAL_TOKENIZER_HINT = ("python -c \"from trl_dta.envs.core.chat import build_chat_tokenizer; "
                        "build_chat_tokenizer().save_pretrained('chat-tokenizer')\" && ... --tokenizer chat-tokenizer")


def _hub_reachable(timeout: float = 3.0) -> bool:
    import os
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def load_tokenizer(name: str | None):
    """A local directory, a name in the Hugging Face cache, or (online) a hub name; offline, a hub name that is not
    cached fails at once with a local alternative (instead of transformers' retries)."""
    if name is None:
        return None
    from transformers import AutoTokenizer

    if Path(name).exists():
        if not Path(name).is_dir():
            raise AnalysisError(f"--tokenizer {name}: a file; give the folder a tokenizer was saved to "
                                "(`save_pretrained`) or a hub name")
        return AutoTokenizer.from_pretrained(name)
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        pass
    if not _hub_reachable():
        raise AnalysisError(f"--tokenizer {name!r} is not a local folder, not in the Hugging Face cache, and the hub "
                            f"cannot be reached (offline); save a tokenizer to a folder and pass it, e.g. "
                            f"{LOCAL_TOKENIZER_HINT}")
    return AutoTokenizer.from_pretrained(name)


# ------------------------------------------------------------------------------------------------------ sequences

# Fields read when none is named, in order of preference: one field, or a prompt + completion pair.
_ID_FIELDS = (("input_ids",), ("prompt_ids", "completion_ids"))
_TEXT_FIELDS = (("text",), ("prompt", "completion"))


def _fields(row: dict, pair: tuple, single: str | None, defaults: tuple) -> list[str] | None:
    """The fields to read: the named pair, else the named single field, else the first default present in `row`."""
    if pair[0] is not None:
        return list(pair)
    if single is not None:
        return [single]
    return next((list(names) for names in defaults if all(n in row for n in names)), None)


class _SequenceParser:
    """Turns one record into a list of token ids according to the command-line options, and the row's prompt (a
    tuple of ids or a string) when it is read as a prompt + completion pair, else None."""

    def __init__(self, field: str | None, prompt_field: str | None, completion_field: str | None,
                 text_field: str | None, tokenizer):
        self.field, self.prompt_field, self.completion_field = field, prompt_field, completion_field
        self.text_field, self.tokenizer = text_field, tokenizer
        if (prompt_field is None) != (completion_field is None):
            raise AnalysisError("--prompt-field and --completion-field go together; give both or neither")

    def __call__(self, row: dict, where: str) -> tuple[list[int], tuple | str | None]:
        if any(name in row for name in CONVERSATION_FIELDS):
            raise AnalysisError(f"{where}: a conversation (field 'messages' or 'turns') among sequences: a source "
                                "holds one kind, decided by its first row (and read as sequences when --field, "
                                "--prompt-field or --text-field is given); split the file")
        if self.tokenizer is not None:
            return self._text(row, where)
        fields = _fields(row, (self.prompt_field, self.completion_field), self.field, _ID_FIELDS)
        if fields is None:
            text = [k for k in ("text", "prompt", "completion") if k in row]
            hint = f"; it has text fields {text}: pass --tokenizer NAME_OR_PATH" if text else ""
            raise AnalysisError(
                f"{where}: no token ids: expected field 'input_ids' (or --field NAME, or prompt_ids + "
                f"completion_ids); fields present: {sorted(row)}{hint}"
            )
        parts = [_ids(_field(row, f, where), f"{where}, field '{f}'") for f in fields]
        return [t for part in parts for t in part], tuple(parts[0]) if len(parts) == 2 else None

    def _text(self, row: dict, where: str) -> tuple[list[int], str | None]:
        fields = _fields(row, (None, None), self.text_field, _TEXT_FIELDS)
        if fields is None:
            raise AnalysisError(
                f"{where}: no text: expected field 'text' (or --text-field NAME, or prompt + completion); "
                f"fields present: {sorted(row)}"
            )
        parts = [_field(row, f, where) for f in fields]
        for f, part in zip(fields, parts):
            if not isinstance(part, str):
                raise AnalysisError(f"{where}, field '{f}': expected a string, got {type(part).__name__}")
        ids = list(self.tokenizer("".join(parts), add_special_tokens=False)["input_ids"])
        return ids, parts[0] if len(parts) == 2 else None


def load_sequences(
    source: str,
    field: str | None = None,
    prompt_field: str | None = None,
    completion_field: str | None = None,
    text_field: str | None = None,
    tokenizer: str | None = None,
    split: str | None = None,
    group_field: str | None = None,
) -> tuple[list[list[int]], list | None]:
    """Read rollouts as token-id lists, and their group labels.

    Args:
        source (`str`): a `.jsonl`/`.json` file (one JSON object per line), a folder written by
            `datasets.Dataset.save_to_disk`, or a dataset name for `datasets.load_dataset`.
        field (`str`, *optional*): the token-id field (default: `input_ids`, else `prompt_ids` + `completion_ids`).
        prompt_field, completion_field (`str`, *optional*): two token-id fields to concatenate.
        text_field (`str`, *optional*): the text field when `tokenizer` is given (default: `text`, else
            `prompt` + `completion`).
        tokenizer (`str`, *optional*): name or path for `transformers.AutoTokenizer` (text input).
        split (`str`, *optional*): dataset split.
        group_field (`str`, *optional*): a per-row group label (an integer or a string, e.g. the prompt index), kept
            together across ranks.

    Returns:
        `(seqs, groups)`: the token-id lists, and a group label per row: the `group_field` values; else, when rows are
        read as prompt + completion, the index of each row's prompt (rows with the same prompt form a group, as a
        prompt's completions do in GRPO); else `None`.

    Raises:
        [`AnalysisError`]: on malformed input, naming the line (or row) and the field.
    """
    if tokenizer is None and text_field is not None:
        raise AnalysisError("--text-field needs --tokenizer NAME_OR_PATH to turn text into token ids")
    parse = _SequenceParser(field, prompt_field, completion_field, text_field, load_tokenizer(tokenizer))
    seqs, labels, prompts = [], [], {}
    for row, where in _records(source, split):
        ids, prompt = parse(row, where)
        seqs.append(ids)
        if group_field:
            labels.append(group_label(row, group_field, where))
        elif prompt is not None:
            labels.append(prompts.setdefault(prompt, len(prompts)))
    if not seqs:
        raise AnalysisError(f"{source}: no rows")
    return seqs, labels if len(labels) == len(seqs) else None


# ------------------------------------------------------------------------------------------------------ conversations


def layout_rows(ids: list[int], assistant_mask: list[bool], layout: str) -> list[list[int]]:
    """The training rows of one conversation in `layout` (see the module docstring).

    Args:
        ids (`list[int]`): the conversation's tokens, `(length,)`.
        assistant_mask (`list[bool]`): `(length,)`, true on the assistant's tokens (TRL's `completion_mask *
            tool_mask` over the completion, false over the prompt).
        layout (`str`): `"episode"` (the whole conversation) or `"per_turn"` (`ids[:end]` for the `end` of every
            maximal run of assistant tokens, as `trl_dta.trainers.per_turn.turn_spans` cuts them).

    Returns:
        `list[list[int]]`: the rows (none for `"per_turn"` when no token is the assistant's).
    """
    check_choice("layout", layout, SAMPLE_LAYOUTS)
    if len(ids) != len(assistant_mask):
        raise ValueError(f"`assistant_mask` has {len(assistant_mask)} entries for {len(ids)} tokens; give one per "
                         "token")
    if layout == "episode":
        return [list(ids)]
    ends = [i + 1 for i, on in enumerate(assistant_mask) if on and (i + 1 == len(ids) or not assistant_mask[i + 1])]
    return [list(ids[:end]) for end in ends]


def _id_turns(row: dict, where: str) -> tuple[list[list[int]], list[bool]]:
    """`turns` (token ids per turn) and whether each is the assistant's (`roles` or `assistant_mask`)."""
    turns = _field(row, "turns", where)
    if not isinstance(turns, list) or not turns:
        raise AnalysisError(f"{where}, field 'turns': expected a non-empty list of token-id lists, one per turn")
    turns = [_ids(turn, f"{where}, field 'turns', turn {t}") for t, turn in enumerate(turns)]
    given = [name for name in ("roles", "assistant_mask") if name in row]
    if len(given) != 1:
        raise AnalysisError(f"{where}: 'turns' needs exactly one of 'roles' (a role per turn) or 'assistant_mask' (1 "
                            f"on the assistant's turns, 0 elsewhere); found {given or 'neither'}")
    name, values = given[0], row[given[0]]
    if not isinstance(values, list) or len(values) != len(turns):
        raise AnalysisError(f"{where}, field '{name}': expected a list with one entry per turn ({len(turns)}), got "
                            f"{values!r}")
    allowed = (str,) if name == "roles" else (int,)
    for value in values:
        if not isinstance(value, allowed) or (name == "assistant_mask" and value not in (0, 1)):
            kind = "a role string" if name == "roles" else "0 or 1 (or false/true)"
            raise AnalysisError(f"{where}, field '{name}': every entry must be {kind}, found {value!r}")
    return turns, [value == ASSISTANT if name == "roles" else bool(value) for value in values]


def _check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise AnalysisError(f"{where}, field 'messages': expected a non-empty list of {{role, content}} objects")
    for k, message in enumerate(messages):
        at = f"{where}, message {k}"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise AnalysisError(f"{at}: expected an object with a string 'role', got {message!r}")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise AnalysisError(f"{at} ({message['role']}): 'content' must be a string (or null beside 'tool_calls'), "
                                f"got {type(content).__name__}; conversations are read as text")
    return messages


def _message_turns(messages: list[dict], tokenizer, where: str, tools: list | None = None
                   ) -> tuple[list[list[int]], list[bool]]:
    """Render `messages` (with the tool schemas `tools`, if any) with the chat template; message `k` gets the tokens
    that `messages[:k + 1]` adds."""
    from jinja2 import TemplateError

    def render(prefix: list[dict]) -> list[int]:
        try:
            text = tokenizer.apply_chat_template(prefix, tools=tools, tokenize=False)
        except TemplateError as e:
            raise AnalysisError(f"{where}: the chat template failed on messages[:{len(prefix)}]: {e}") from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    ids = render(messages)
    turns, start = [], 0
    for k in range(len(messages)):
        prefix = ids if k == len(messages) - 1 else render(messages[:k + 1])
        end = len(prefix)
        if end < start or prefix != ids[:end]:
            raise AnalysisError(
                f"{where}: the chat template renders messages[:{k + 1}] differently from the start of the whole "
                "conversation (it rewrites earlier turns, e.g. drops their reasoning), so the turns are not nested "
                "prefixes; give token ids per turn ('turns' with 'roles') as the policy saw them"
            )
        turns.append(ids[start:end])
        start = end
    return turns, [message["role"] == ASSISTANT and message.get("train", True) is not False for message in messages]


def load_conversations(
    source: str,
    tokenizer: str | None = None,
    split: str | None = None,
    group_field: str | None = None,
) -> tuple[list[tuple[list[int], list[bool]]], list | None]:
    """Read conversations (`messages` with a chat template, or `turns` of token ids) as tokens and assistant masks.

    Args:
        source (`str`): as for [`load_sequences`].
        tokenizer (`str`, *optional*): name or path for `transformers.AutoTokenizer`, whose chat template renders
            `messages` (not needed for `turns`).
        split (`str`, *optional*): dataset split.
        group_field (`str`, *optional*): a per-conversation group label (e.g. the task), kept together across ranks.

    Returns:
        `(conversations, groups)`: per conversation `(ids, assistant_mask)`, both `(length,)`; the group labels or
        `None`.

    Raises:
        [`AnalysisError`]: on a malformed conversation, naming the line (or row), the message or turn, and the fix.
    """
    tok = load_tokenizer(tokenizer)
    conversations, labels = [], []
    for row, where in _records(source, split):
        if "messages" in row:
            if tok is None:
                raise AnalysisError(f"{where}: 'messages' are text: pass --tokenizer NAME_OR_PATH (its chat template "
                                    "renders them), or give token ids per turn ('turns' with 'roles')")
            if not getattr(tok, "chat_template", None):
                raise AnalysisError(f"{where}: tokenizer {tokenizer!r} has no chat template to render 'messages'; use "
                                    "a chat model's tokenizer, or give token ids per turn ('turns' with 'roles')")
            turns, assistant = _message_turns(_check_messages(row["messages"], where), tok, where, row.get("tools"))
        elif "turns" in row:
            turns, assistant = _id_turns(row, where)
        else:
            raise AnalysisError(f"{where}: not a conversation: expected field 'messages' or 'turns' (as the first row "
                                f"has); fields present: {sorted(row)}")
        mask = [on for turn, on in zip(turns, assistant) for _ in turn]
        if not any(mask):
            roles = sorted({m.get("role") for m in row["messages"]}) if "messages" in row else None
            raise AnalysisError(f"{where}: no assistant tokens (the per-turn layout trains on them); the assistant's "
                                f"role must be '{ASSISTANT}'" + (f", roles found: {roles}" if roles else ""))
        conversations.append(([t for turn in turns for t in turn], mask))
        if group_field:
            labels.append(group_label(row, group_field, where))
    if not conversations:
        raise AnalysisError(f"{source}: no rows")
    return conversations, labels or None
