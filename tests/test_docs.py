"""The docs site's generated parts (`docs/hooks.py`) and the README's links into it. The site itself is built by CI
(`mkdocs build --strict` in `.ci/run`: a broken link, anchor or API reference fails it)."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import fields
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def hooks():
    spec = importlib.util.spec_from_file_location("trl_dta_docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_page_lists_every_dta_field_with_its_default(hooks):
    from trl_dta.trainers.config import DTAArguments

    assert "<!-- generated: dta-parameters -->" in (DOCS / "config.md").read_text()
    assert "docs/hooks.py" in (ROOT / "mkdocs.yml").read_text()
    page = hooks.on_page_markdown((DOCS / "config.md").read_text(), None, None, None)
    for f in fields(DTAArguments):
        default = f'"{f.default}"' if isinstance(f.default, str) else repr(f.default)
        row = re.search(rf"^\| \[`{f.name}`\]\(#{f.name}\) \| `[^|]+` \| `{re.escape(default)}` \| .+ \|$", page, re.M)
        assert row, f"{f.name} (default {default}) is not a row of the config page"
        assert f"#### `{f.name}` {{#{f.name}}}" in page and f.metadata["help"] in page


def test_every_refusal_has_a_group_and_the_page_lists_them(hooks):
    entries = hooks.collect_refusals()
    groups = {hooks.group_of(e["module"]) for e in entries}  # raises for a module outside every group
    assert groups == {title for title, _, _ in hooks.GROUPS}
    page = hooks.on_page_markdown((DOCS / "troubleshooting.md").read_text(), None, None, None)
    shown = [e for e in entries if hooks.is_refusal(e)]
    generated = page.split("## Every refusal", 1)[1]  # the hand-written table of the common ones comes before it
    assert generated.count("\n| `") == len(shown) > 250
    # A refusal of each kind the issue names, with its fix: a config value, a model family, a distributed setting.
    for text in ("`fp16=True` is not supported with DTA", "DeepSpeed ZeRO offload (",
                 "FSDP version ⟨version⟩ is not supported", "must be a list of positive integers",
                 # the one model refusal's blockers, each with its fix (`trl_dta/refusal.py`)
                 "Fix: set `fp16=False` in the trainer's config",
                 "Fix: set `attention_dropout=0.0` in the model config",
                 "Fix: set `router_aux_loss_coef=0.0` in the trainer's config",
                 "attention code; DTA's attention has no",
                 # the distributed refusals resolved (no template), with their fixes
                 "Megatron-LM is not supported with DTA. Fix: use FSDP2",
                 "XLA (TPU) is not supported with DTA. Fix: use a GPU or CPU device"):
        assert text in page, text
    assert not any(e["exception"] in hooks.NOT_REFUSALS for e in shown)
    # One refusal type: what DTA cannot run is a `DTAUnsupportedError`, never a `NotImplementedError`.
    assert not any(e["exception"] == "NotImplementedError" for e in shown)


def test_analyzer_page_has_the_commands_help(hooks):
    page = hooks.on_page_markdown((DOCS / "analyzer.md").read_text(), None, None, None)
    assert "usage: trl-dta analyze" in page and "tau2-bench results file" in page


def _anchors(markdown: str) -> set[str]:
    """The anchors MkDocs gives a page's headings (Python-Markdown's `toc` slugs) and explicit `{#id}`s."""
    out = set(re.findall(r"\{#([\w-]+)\}", markdown))
    for title in re.findall(r"^#+ (.+?)\s*$", markdown, re.M):
        title = re.sub(r"\{#[\w-]+\}", "", title).replace("`", "")
        out.add(re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower()))
    return out


def test_readme_links_into_the_docs_resolve():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert len({path for path, _ in links}) >= 10  # the README is a front page that points into the docs
    for path, anchor in links:
        target = ROOT / path
        assert target.is_file(), f"README links to {path}, which does not exist"
        if anchor:
            assert anchor in _anchors(target.read_text()), f"README links to {path}#{anchor}: no such heading"


def test_config_page_survives_hfargumentparser():
    """`HfArgumentParser` (the recipes' parser) replaces the config fields' `type` in place (`list[int] | None` becomes
    `list[int]`): the page, built later in the same process, reads the class's own annotations."""
    from transformers import HfArgumentParser

    from trl_dta import DTAGRPOConfig
    from trl_dta.trainers.config import dta_parameters_doc, dta_parameters_markdown

    before = dta_parameters_markdown(), dta_parameters_doc()
    HfArgumentParser(DTAGRPOConfig)
    assert (dta_parameters_markdown(), dta_parameters_doc()) == before
    assert "`list[int]` or `None`" in before[0]



def test_committed_generated_parts_are_fresh():
    """The generated parts are committed between their markers (they read on GitHub); `tools/gen_docs.py --check`
    fails when one differs from a fresh copy, and `regenerate` keeps the markers and is idempotent."""
    spec = importlib.util.spec_from_file_location("trl_dta_gen_docs", ROOT / "tools" / "gen_docs.py")
    gen_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_docs)
    assert gen_docs.stale_pages() == [], "stale generated docs: run `python tools/gen_docs.py` and commit the result"
    hooks = gen_docs.load_hooks()
    for name in hooks.GENERATORS:
        begin, end = hooks.begin_marker(name), hooks.end_marker(name)
        page = f"# t\n\n{begin}\n\n## after\n"
        once = hooks.regenerate(page)
        assert once.startswith(f"# t\n\n{begin}\n\n") and once.endswith(f"\n\n{end}\n\n## after\n")
        assert hooks.regenerate(once) == once
        assert hooks.regenerate(once.replace(f"{begin}\n\n", f"{begin}\n\nstale\n")) == once
