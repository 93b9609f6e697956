"""The `dta_*` fields' help text rendered: the configs' docstrings (Hugging Face format) and the docs' Markdown page.

The help text lives once, in each field's `metadata["help"]` (`config.py`); the renderers here take the dataclass and
its sections (`(title, field names)` in order), so that a field without a section fails loudly instead of going
undocumented.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import fields

_TYPE_NAMES = {"bool": "bool", "int": "int", "float": "float", "str": "str", "int | None": "int` or `None",
               "float | None": "float` or `None", "list[int] | None": "list[int]` or `None"}


def _type_name(cls: type, f) -> str:
    """A field's type as the docs show it, from the class's annotations (strings, `from __future__ import
    annotations`): not `f.type`, which `HfArgumentParser` replaces in place when a config is parsed (`list[int] | None`
    becomes `list[int]`)."""
    annotation = next(c.__dict__["__annotations__"][f.name] for c in cls.__mro__
                      if f.name in c.__dict__.get("__annotations__", {}))
    return _TYPE_NAMES[annotation]


def parameters_doc(cls: type, sections) -> str:
    """The fields of `cls` in the Hugging Face docstring format, one `> title` block per section."""
    by_name = {f.name: f for f in fields(cls)}
    lines = ["    Parameters:"]
    for title, names in sections:
        lines += [f"        > {title}", ""]
        for name in names:
            f = by_name[name]
            lines.append(f"        {f.name} (`{_type_name(cls, f)}`, *optional*, defaults to `{f.default}`):")
            lines += textwrap.wrap(f.metadata["help"], width=116, initial_indent=" " * 12, subsequent_indent=" " * 12,
                                   break_on_hyphens=False)  # a break in "row-mean" reads "row- mean"
        lines.append("")
    return "\n".join(lines)


def parameters_markdown(cls: type, sections) -> str:
    """The fields of `cls` as Markdown: a table of every field with its type, default and first sentence, then each
    field's whole help text under its section's title."""
    by_name = {f.name: f for f in fields(cls)}
    listed = [name for _, names in sections for name in names]
    missing = sorted(set(by_name) - set(listed))
    if missing:  # a new field must be given a section (and so a place in the docstrings and the docs)
        raise RuntimeError(f"`{cls.__name__}` fields without a section in `_SECTIONS`: {missing}")
    rows = ["| field | type | default | what it does |", "|---|---|---|---|"]
    body = []
    for title, names in sections:
        body += [f"### {title}", ""]
        for name in names:
            f = by_name[name]
            kind, text = _type_name(cls, f), f.metadata["help"]
            default = f'`"{f.default}"`' if isinstance(f.default, str) else f"`{f.default!r}`"
            first = re.split(r"(?<=\.)\s+(?=[A-Z`])", text, maxsplit=1)[0]
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
