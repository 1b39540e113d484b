"""docs/methods.md is generated from the option structs by scripts/gen_methods_doc.py: the committed page must be what
the script writes today, and every option must have a meaning (a ``#:`` comment above its field)."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from script_helpers import load_script

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    return load_script("gen_methods_doc")


def test_methods_page_matches_the_option_structs():
    gen = _generator()
    committed = (ROOT / "docs" / "methods.md").read_text()
    assert committed == gen.render(), (
        "docs/methods.md is out of date with the proposers' option structs: run "
        f"`{gen.RERUN}` and commit docs/methods.md")


def test_every_builtin_method_and_option_is_documented():
    gen = _generator()
    page = gen.render()
    for name in gen.builtin_methods():
        assert f"## `{name}`" in page
    missing = gen.undocumented()
    assert not missing, (f"options without a meaning in docs/methods.md: {missing}; add a `#:` comment line above "
                         f"each field in its options struct, then run `{gen.RERUN}`")


def _heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings: lowercased, every character but word characters, spaces and
    hyphens dropped, spaces turned into hyphens; a repeated heading gets -1, -2, ..."""
    anchors: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        anchor = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        unique, n = anchor, 0
        while unique in anchors:
            n += 1
            unique = f"{anchor}-{n}"
        anchors.add(unique)
    return anchors


def test_every_link_between_the_docs_resolves():
    """A link from one of the repository's Markdown pages to a file of the repository names a file that exists and,
    with ``#anchor``, a heading of it: the benchmark page's sections are renamed as figures change."""
    pages = []
    for folder, subfolders, files in os.walk(ROOT):
        # not into .venv, .git, caches or node_modules: pages of other projects
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d != "node_modules"]
        pages += [Path(folder) / f for f in files if f.endswith(".md")]
    assert ROOT / "README.md" in pages and ROOT / "docs" / "benchmarks.md" in pages
    anchors = functools.cache(_heading_anchors)  # a page is linked many times
    broken = []
    for page in sorted(pages):
        for target, anchor in re.findall(r"\]\((?!https?:|mailto:)([^)#\s]*)(?:#([^)\s]+))?\)", page.read_text()):
            linked = (page.parent / target).resolve() if target else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(ROOT)} -> {target}#{anchor} (no such heading)")
    assert not broken, "broken links between the docs:\n" + "\n".join(broken)
