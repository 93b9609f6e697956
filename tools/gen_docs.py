"""Rewrites the generated parts of the docs' pages (`docs/hooks.py`: the `dta_*` fields, `trl-dta analyze --help`,
every refusal), committed between their markers so that the pages read on GitHub as they do on the site.

    python tools/gen_docs.py           # rewrite every stale part
    python tools/gen_docs.py --check   # exit 1, naming the pages, when a committed part is stale (CI)

Run it after changing a `dta_*` field's help, the analyzer's options or a refusal's message.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def load_hooks():
    """`docs/hooks.py` as a module (it is MkDocs' hook file, not part of the package)."""
    spec = importlib.util.spec_from_file_location("trl_dta_docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stale_pages(write: bool = False) -> list[Path]:
    """The pages under `docs/` whose committed generated parts differ from a fresh copy; rewritten when `write`."""
    hooks = load_hooks()
    stale = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        fresh = hooks.regenerate(text)
        if fresh != text:
            stale.append(page)
            if write:
                page.write_text(fresh, encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale pages, exit 1 if there is one")
    args = parser.parse_args(argv)
    stale = stale_pages(write=not args.check)
    names = ", ".join(str(page.relative_to(ROOT)) for page in stale)
    if args.check and stale:
        print(f"stale generated docs: {names}; run `python tools/gen_docs.py` and commit the result", file=sys.stderr)
        return 1
    print(f"rewrote {names}" if stale else "generated docs up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
