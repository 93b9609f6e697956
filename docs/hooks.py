"""MkDocs hooks: the parts of the docs that are generated from the code at build time, so that they cannot drift.

A page holds each generated part between two marker lines, committed with the page so that it reads on GitHub too
(`<!-- generated: NAME -->` ... `<!-- end generated: NAME -->`); the build replaces what lies between them with a
fresh copy ([`regenerate`]), and `python tools/gen_docs.py` rewrites the committed copies (`--check`, run by CI and
`tests/test_docs.py`, fails when one is stale). The parts:

- `dta-parameters` (`config.md`): every `dta_*` field of `trl_dta.trainers.config.DTAArguments`
  with its type, default and help text (`dta_parameters_markdown`, the same source as the configs' docstrings).
- `analyze-help` (`analyzer.md`): `trl-dta analyze --help`, from the command's own parser.
- `refusals` (`troubleshooting.md`): every error `trl_dta` raises (`raise SomeError(message)`)
  and every blocker it can name in its one refusal type (`Blocker(feature, settings=..., fix=...)`, raised together
  as a `DTAUnsupportedError` by `refuse(...)` or `raise DTAUnsupportedError(...)`), read from the source with `ast`,
  grouped by what the user was doing ([`GROUPS`]), each with the function that raises it. A module that raises and
  belongs to no group fails the build.

`mkdocs.yml` names this file under `hooks:`; `tests/test_docs.py` checks the generators without building the site.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trl_dta"

# (title, what the user was doing, module paths or folders under the repository root). Every module of `trl_dta` that
# raises an error belongs to exactly one group (the one whose path names it most closely: a module before its folder).
GROUPS = (
    ("Configuring a trainer", "building `DTAGRPOConfig` / `DTARLOOConfig` (a `dta_*` value, tree-rollout settings, a "
     "TRL setting DTA cannot honour), or any public function given a bad argument",
     ("trl_dta/trainers/config.py", "trl_dta/_checks.py")),
    ("Building or running a trainer", "constructing `DTAGRPOTrainer` / `DTARLOOTrainer` and training: layouts, "
     "losses, micro-batches, tree rollouts in the trainer",
     ("trl_dta/trainers/",)),
    ("A model DTA cannot reproduce", "giving the engine or a trainer a model: the family rules, the four-token probe, "
     "the attention's own checks, the hybrids' recurrent layers",
     ("trl_dta/modeling/support.py", "trl_dta/modeling/families.py", "trl_dta/refusal.py",
      "trl_dta/modeling/attention.py", "trl_dta/recurrent/")),
    ("Images (vision-language models)", "giving the engine or a trainer a vision-language model and its images: the "
     "families whose images DTA runs, images among the scored tokens, keys that do not match the images",
     ("trl_dta/vision/",)),
    ("Several processes", "`accelerate launch`, DDP, FSDP2, DeepSpeed: the distributed settings DTA refuses",
     ("trl_dta/parallel/", "trl_dta/trainers/exchange.py", "trl_dta/trainers/launch.py")),
    ("Calling the engine", "`DTAEngine`, `PrefixTree` and the kernels directly",
     ("trl_dta/engine/", "trl_dta/tree.py", "trl_dta/kernels/", "trl_dta/kv_stack.py", "trl_dta/modeling/lm_head.py",
      "trl_dta/modeling/routers.py", "trl_dta/modeling/switch.py",
      "trl_dta/precision.py", "trl_dta/batch.py")),
    ("Generating with the prefix cache", "`trl_dta.generation` (agent rollouts, tree rollouts)",
     ("trl_dta/generation/",)),
    ("Generating with vLLM", "`use_vllm=True` under the DTA trainers: vLLM's CPU build, server mode (docs/vllm.md)",
     ("trl_dta/trainers/vllm_cpu.py", "trl_dta/trainers/vllm_engine.py")),
    ("Agents and tau2", "`trl_dta.envs` (the stand-in, rollout functions, chat templates) and `trl_dta.envs.tau2`",
     ("trl_dta/envs/",)),
    ("Balancing ranks yourself", "`partition`, `partition_for_ranks`, `CostModel`", ("trl_dta/balance/",)),
    ("The analyzer", "`trl-dta analyze` and what it calls (reading rollouts, FLOP and memory estimates)",
     ("trl_dta/cli.py", "trl_dta/analysis/", "trl_dta/flops.py", "trl_dta/memory.py")),
    ("The recipes' models and tasks, and the package", "`trl_dta.demos.tiny` (the tiny model and task), "
     "`trl_dta.demos.tiny_vlm` (the tiny vision-language model and its counting task), `trl_dta.demos.pretrained` "
     "(the real model from its wheel), `trl_dta.demos.word_problems`, `trl_dta.demos.heldout` (the held-out accuracy), "
     "`import trl_dta`",
     ("trl_dta/demos/", "trl_dta/__init__.py")),
)

# Raised but not refusals: the environments' answers to the policy (a bad tool call or turn is answered with an error
# message and the episode goes on), and broken invariants (a bug, reported with "please report" or "a bug").
NOT_REFUSALS = ("ToolError", "ProtocolError")
# A model's blockers go to the model group wherever they are found, except those of these modules (trainer arguments,
# distributed settings, the generation cache), which stay in their module's group.
_OWN_GROUP_BLOCKERS = ("trl_dta/trainers/config.py", "trl_dta/parallel/", "trl_dta/trainers/exchange.py",
                       "trl_dta/generation/")
_BUG = re.compile(r"internal error|this is a bug|please report", re.I)


# ------------------------------------------------------------------------------------------------ dta_* parameters


def dta_parameters() -> str:
    from trl_dta.trainers.config import dta_parameters_markdown

    return dta_parameters_markdown()


# ------------------------------------------------------------------------------------------------------- analyzer


def analyze_help() -> str:
    """`trl-dta analyze --help` at a width of 100 columns, as a code block."""
    from trl_dta.cli import _parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        parser = _parser()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        text = sub.choices["analyze"].format_help()
    finally:
        if saved is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = saved
    return "```text\n" + text.rstrip() + "\n```\n"


# ------------------------------------------------------------------------------------------------------- refusals


def _strings(body: list[ast.stmt], into: dict[str, ast.expr]) -> dict[str, ast.expr]:
    """Names assigned once, at this level, to a string expression (constant, f-string, sum, another name) or a dict
    literal: what a message embeds."""
    counts: dict[str, int] = {}
    for node in body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            counts[name] = counts.get(name, 0) + 1
            if isinstance(node.value, (ast.Constant, ast.JoinedStr, ast.BinOp, ast.Dict, ast.Name)):
                into[name] = node.value
    for name, count in counts.items():
        if count > 1:
            into.pop(name, None)
    return into


def _string_table(loop: ast.For, names: dict[str, ast.expr]):
    """`((key, value), [(k, v_expr), ...])` for `for key, value in TABLE.items():` over a dict literal of string keys
    assigned in scope (the loop then raises one message per entry), else None."""
    it, target = loop.iter, loop.target
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "items"
            and isinstance(it.func.value, ast.Name) and isinstance(target, ast.Tuple) and len(target.elts) == 2
            and all(isinstance(e, ast.Name) for e in target.elts)):
        return None
    table = names.get(it.func.value.id)
    if not isinstance(table, ast.Dict) or not all(isinstance(k, ast.Constant) for k in table.keys):
        return None
    return (target.elts[0].id, target.elts[1].id), [(k.value, v) for k, v in zip(table.keys, table.values)]


def _render(node: ast.expr, names: dict[str, ast.expr], depth: int = 0) -> str:
    """The message an expression builds, with what is only known at run time shown as `⟨expression⟩`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else _render(v.value, names, depth) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _render(node.left, names, depth) + _render(node.right, names, depth)
    if isinstance(node, ast.Name) and node.id in names and depth < 3:
        return _render(names[node.id], names, depth + 1)
    return f"⟨{ast.unparse(node)}⟩"


def _blocker(call: ast.Call, names: dict[str, ast.expr]) -> str | None:
    """The text `Blocker.describe` gives a `Blocker(feature, settings={...}, where=..., fix=...)` (or a
    `replace(blocker, feature=...)`) written in the source, else None (not a blocker, or one without a feature of its
    own: a template whose feature is filled in where it is used)."""
    func = ast.unparse(call.func)
    kwargs = {k.arg: k.value for k in call.keywords if k.arg}
    if func == "Blocker" and call.args:
        feature = call.args[0]
    elif func == "replace" and "feature" in kwargs:
        feature = kwargs["feature"]
    else:
        return None
    text = _render(feature, names)
    if not text.strip() or _passed_on(text):
        return None  # a template, or a blocker that passes on a finding listed where it is raised
    settings, fix = kwargs.get("settings"), kwargs.get("fix")
    if isinstance(settings, ast.Name) and isinstance(names.get(settings.id), ast.Dict):  # a shared fix, e.g. `_FIX`
        settings = names[settings.id]
    where = {"MODEL_CONFIG": "model config", "TRAINER_CONFIG": "trainer's config"}.get(
        ast.unparse(kwargs.get("where", ast.Constant(""))), "config")
    other = f", or {_render(fix, names)}" if fix is not None else ""  # beside settings: another way
    if isinstance(settings, ast.Dict) and settings.keys:
        pairs = ", ".join(f"`{_render(k, names)}={ast.unparse(v)}`" for k, v in zip(settings.keys, settings.values))
        return f"{text}. Fix: set {pairs} in the {where}{other}."
    if settings is not None:  # built at run time, e.g. `{name: 0.0 for name in noisy}`
        return f"{text}. Fix: set ⟨{ast.unparse(settings)}⟩ in the {where}{other}."
    if fix is not None:
        return f"{text}. Fix: {_render(fix, names)}."
    if func == "replace":  # a template's fix: the templates are listed by `_template_fixes`
        return f"{text}. {_TEMPLATE_FIX}"
    return f"{text}. No setting removes it."


_TEMPLATE_FIX = "Fix: the one its caller names"


def _template_fixes(package: Path = PACKAGE) -> str:
    """The fixes of the module-level blocker templates (`NAME = Blocker("", settings=..., fix=...)`: a fix whose
    feature is filled in with `replace` where it is found), each with the module that passes it."""
    out = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and ast.unparse(node.value.func) == "Blocker" and node.value.args
                    and isinstance(node.value.args[0], ast.Constant) and node.value.args[0].value == ""):
                call = ast.Call(node.value.func, [ast.Constant("x")], node.value.keywords)
                fix = _blocker(call, {}).split(". ", 1)[1].removeprefix("Fix: ").rstrip(".")
                module = path.relative_to(package.parent).with_suffix("").as_posix().replace("/", ".")
                out.append(f"{fix} (`{module}`)")
    return "; ".join(out)


def _imported_strings(trees: dict[tuple[str, ...], ast.Module]) -> dict[tuple[str, ...], dict[str, ast.expr]]:
    """Each module's string names (`_strings` of its top level) plus those it imports from the package's modules by
    `from .x import NAME` (a shared refusal sentence, e.g. `refusal.DENSE_ALTERNATIVE`); one level of re-import."""
    own = {key: _strings(tree.body, {}) for key, tree in trees.items()}
    out = {}
    for key, tree in trees.items():
        names = dict(own[key])
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.level:
                source = key[: len(key) - node.level] + tuple((node.module or "").split(".") if node.module else ())
                for alias in node.names:
                    value = own.get(source, own.get(source + ("__init__",), {})).get(alias.name)
                    if value is not None and (alias.asname or alias.name) not in names:
                        names[alias.asname or alias.name] = value
        out[key] = names
    return out


# Exceptions raised inside a check and refused as a blocker (the support probe's findings).
_BLOCKER_FINDINGS = frozenset({"_ProbeFailure"})


def _passed_on(text: str) -> bool:
    """A message that is one run-time value (`⟨str(failure)⟩`): a finding passed on, listed where it is made."""
    return text.startswith("⟨") and text.endswith("⟩") and text.count("⟨") == 1


def collect_refusals(package: Path = PACKAGE) -> list[dict]:
    """Every `raise SomeError(message, ...)` and every `Blocker(...)` under `package`: module path, function,
    exception (`DTAUnsupportedError` for a blocker: they are raised together in one), message."""
    found = []
    paths = sorted(package.rglob("*.py"))
    keys = {path: path.relative_to(package.parent).with_suffix("").parts for path in paths}
    trees = {keys[path]: ast.parse(path.read_text(encoding="utf-8")) for path in paths}
    strings = _imported_strings(trees)
    for path in paths:
        tree = trees[keys[path]]
        module_names = strings[keys[path]]
        module = path.relative_to(package.parent).as_posix()

        def visit(node, function, names, module=module):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    inner = f"{function}.{child.name}" if function else child.name
                    scope = _strings(child.body, dict(names)) if not isinstance(child, ast.ClassDef) else names
                    visit(child, inner, scope)
                    continue
                if isinstance(child, ast.For) and (table := _string_table(child, names)):
                    # `for key, why in TABLE.items(): raise ...(f"...{key}...{why}")`: one refusal per entry.
                    (key, value), entries = table
                    for k, v in entries:
                        visit(child, function, {**names, key: ast.Constant(k), value: v})
                    continue
                if isinstance(child, ast.Call) and (text := _blocker(child, names)):
                    found.append({"module": module, "function": function,
                                  "line": child.lineno, "exception": "DTAUnsupportedError",
                                  "message": " ".join(text.split()), "blocker": True})
                if (isinstance(child, ast.Raise) and isinstance(child.exc, ast.Call) and child.exc.args
                        and ast.unparse(child.exc.func) != "DTAUnsupportedError"):  # its blockers are listed
                    exc = ast.unparse(child.exc.func)
                    message = " ".join(_render(child.exc.args[0], names).split())
                    row = {"module": module, "function": function, "line": child.lineno, "exception": exc,
                           "message": message}
                    if exc in _BLOCKER_FINDINGS:  # caught and refused as a blocker without a fix
                        row.update(exception="DTAUnsupportedError", message=f"{message}. No setting removes it.",
                                   blocker=True)
                    if not (exc in _BLOCKER_FINDINGS and _passed_on(message)):
                        found.append(row)
                visit(child, function, names)

        visit(tree, "", module_names)
    return found


def _under(module: str, paths) -> bool:
    return any(module == p or (p.endswith("/") and module.startswith(p)) for p in paths)


def group_of(module: str, blocker: bool = False) -> str:
    """The group of `GROUPS` a module's refusals go to; a model's blockers (`blocker=True`) to the model group,
    wherever they are found, except those of `_OWN_GROUP_BLOCKERS` (trainer arguments, distributed settings, the
    generation cache)."""
    if blocker and not _under(module, _OWN_GROUP_BLOCKERS):
        return GROUPS[2][0]
    matches = [(len(p), title) for title, _, paths in GROUPS for p in paths if _under(module, [p])]
    if matches:
        return max(matches)[1]
    raise RuntimeError(f"docs/hooks.py: {module} raises errors but belongs to no group of `GROUPS`: add it to one")


def is_refusal(entry: dict) -> bool:
    """A user-facing refusal: not an environment's answer to the policy, not a broken invariant, and a message with
    some text of its own."""
    literal = re.sub(r"⟨[^⟩]*⟩", "", entry["message"]).strip(" .:;,")
    return entry["exception"] not in NOT_REFUSALS and not _BUG.search(entry["message"]) and len(literal) > 3


def _cell(text: str) -> str:
    """`text` as a table cell: code spans kept, Markdown's emphasis, HTML and link characters escaped outside them."""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: no code spans at all
        parts = [text.replace("`", "\\`")]
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"([*_\[\]])", r"\\\1", parts[i]).replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts).replace("|", "\\|")


def refusals() -> str:
    """The generated part of `troubleshooting.md`: one section per group, one table row per refusal."""
    entries, templates = collect_refusals(), _template_fixes()
    by_group: dict[str, list[dict]] = {title: [] for title, _, _ in GROUPS}
    for entry in entries:
        by_group[group_of(entry["module"], entry.get("blocker", False))].append(entry)
    out = []
    for title, doing, _ in GROUPS:
        rows = [e for e in by_group[title] if is_refusal(e)]
        if not rows:
            continue
        out += [f"### {title}", "", f"While {doing}. {len(rows)} refusals.", "",
                "| error | message (the fix is in it) | raised in |", "|---|---|---|"]
        for e in rows:
            where = e["module"].removesuffix(".py").replace("/", ".") + (f".{e['function']}" if e["function"] else "")
            message = e["message"].replace(_TEMPLATE_FIX, f"{_TEMPLATE_FIX}: {templates}")
            out.append(f"| `{e['exception']}` | {_cell(message)} | `{where}` |")
        out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------------ the hook

GENERATORS = {
    "dta-parameters": dta_parameters,
    "analyze-help": analyze_help,
    "refusals": refusals,
}


def begin_marker(name: str) -> str:
    return f"<!-- generated: {name} -->"


def end_marker(name: str) -> str:
    return f"<!-- end generated: {name} -->"


def regenerate(markdown: str) -> str:
    """`markdown` with the text between each pair of markers of [`GENERATORS`] replaced by a fresh copy. A begin
    marker without its end marker (a part just asked for) gets one, after the generated text."""
    for name, generate in GENERATORS.items():
        begin, end = begin_marker(name), end_marker(name)
        if begin not in markdown:
            continue
        head, rest = markdown.split(begin, 1)
        _, found, tail = rest.partition(end)
        if not found:  # a new part: what followed the marker line follows the end marker
            tail = "\n" + rest.partition("\n")[2]
        markdown = f"{head}{begin}\n\n{generate().strip()}\n\n{end}{tail}"
    return markdown


_HF_REF = re.compile(r"\[<code>(~?)([\w.]+)</code>\]")


def on_page_content(html: str, page, config, files) -> str:
    """MkDocs' `on_page_content` event: the docstrings' Hugging Face cross-references (``[`~trl.GRPOTrainer`]``,
    ``[`DTAGRPOConfig`]``) shown as code, the `~` form by its last name, as Hugging Face's doc builder shows them."""
    return _HF_REF.sub(lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>", html)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """MkDocs' `on_page_markdown` event: each generated part regenerated ([`regenerate`])."""
    return regenerate(markdown)
