"""docs/methods.md is generated from the option structs by scripts/gen_methods_doc.py: the committed page must be what
the script writes today, and every option must have a meaning (a ``#:`` comment above its field)."""

from __future__ import annotations

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
