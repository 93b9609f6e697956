"""The `dta_*` fields' help text rendered: the configs' docstrings (Hugging Face format) and the docs' Markdown page.

The text lives once, in `config.py`: each field's `metadata["help"]`, what `--help` prints (at most `HELP_MAX`
characters, about five lines of an 80-column terminal), and the rest of it in a `details` mapping by field name (not in
the metadata: `HfArgumentParser` passes every metadata key to `argparse`). The renderers here take the dataclass, its
sections (`(title, field names)` in order) and the details, so that a field without a section, or a help text too long
for the command line, fails loudly instead of going undocumented.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import fields

# The longest `help` text: what `--help` prints in full; the rest goes to the field's details.
HELP_MAX = 240
_TYPE_NAMES = {"bool": "bool", "int": "int", "float": "float", "str": "str", "int | None": "int` or `None",
               "float | None": "float` or `None", "list[int] | None": "list[int]` or `None"}


def _type_name(cls: type, f) -> str:
    """A field's type as the docs show it, from the class's annotations (strings, `from __future__ import
    annotations`): not `f.type`, which `HfArgumentParser` replaces in place when a config is parsed (`list[int] | None`
    becomes `list[int]`)."""
    annotation = next(c.__dict__["__annotations__"][f.name] for c in cls.__mro__
                      if f.name in c.__dict__.get("__annotations__", {}))
    return _TYPE_NAMES[annotation]


def _text(f, details: dict[str, str]) -> str:
    """A field's whole documentation: its `help` text, then its details, if any."""
    return " ".join(filter(None, (f.metadata["help"], details.get(f.name))))


def parameters_doc(cls: type, sections, details: dict[str, str]) -> str:
    """The fields of `cls` in the Hugging Face docstring format, one `> title` block per section."""
    by_name = {f.name: f for f in fields(cls)}
    lines = ["    Parameters:"]
    for title, names in sections:
        lines += [f"        > {title}", ""]
        for name in names:
            f = by_name[name]
            lines.append(f"        {f.name} (`{_type_name(cls, f)}`, *optional*, defaults to `{f.default}`):")
            lines += textwrap.wrap(_text(f, details), width=116, initial_indent=" " * 12, subsequent_indent=" " * 12,
                                   break_on_hyphens=False)  # a break in "row-mean" reads "row- mean"
        lines.append("")
    return "\n".join(lines)


def parameters_markdown(cls: type, sections, details: dict[str, str]) -> str:
    """The fields of `cls` as Markdown: a table of every field with its type, default and first sentence, then each
    field's whole text (help and details) under its section's title."""
    by_name = {f.name: f for f in fields(cls)}
    listed = [name for _, names in sections for name in names]
    missing = sorted(set(by_name) - set(listed))
    if missing:  # a new field must be given a section (and so a place in the docstrings and the docs)
        raise RuntimeError(f"`{cls.__name__}` fields without a section in `_SECTIONS`: {missing}")
    long = sorted(name for name in listed if len(by_name[name].metadata["help"]) > HELP_MAX)
    if long:  # `--help` prints the help text whole
        raise RuntimeError(f"`{cls.__name__}` fields whose help text is over {HELP_MAX} characters: {long}; keep "
                           "what `--help` needs and move the rest to the field's `DETAILS` entry")
    unknown = sorted(set(details) - set(by_name))
    if unknown:
        raise RuntimeError(f"`DETAILS` names fields that `{cls.__name__}` does not have: {unknown}")
    rows = ["| field | type | default | what it does |", "|---|---|---|---|"]
    body = []
    for title, names in sections:
        body += [f"### {title}", ""]
        for name in names:
            f = by_name[name]
            kind, text = _type_name(cls, f), _text(f, details)
            default = f'`"{f.default}"`' if isinstance(f.default, str) else f"`{f.default!r}`"
            first = re.split(r"(?<=\.)(?<!e\.g\.)\s+(?=[A-Z`])", f.metadata["help"], maxsplit=1)[0]
            rows.append(f"| [`{name}`](#{name}) | `{kind}` | {default} | {first} |")
            body += [f"#### `{name}` {{#{name}}}", "", f"`{kind}`, defaults to {default}.", "", text, ""]
    return "\n".join(rows + [""] + body)


def config_docstring(trainer: str, trl_config: str, parameters: str) -> str:
    """The docstring of a DTA config: what it adds to TRL's `trl_config`, then the `parameters` section."""
    return (
        f"""
    Configuration class for [`{trainer}`]: every [`~trl.{trl_config}`] parameter, plus the `dta_*` parameters below.

    Defaults are TRL's, and with DTA's defaults every update equals the TRL trainer's. Note that
    `gradient_checkpointing=True` (TRL's default) bounds DTA's memory through `dta_max_graph_tokens` instead of HF
    checkpointing (see that parameter).

"""
        + parameters
    )
