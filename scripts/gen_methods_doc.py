"""Write docs/methods.md from the built-in proposers' option structs.

For every method in the ``vllm_treespec.proposers`` entry-point group of pyproject.toml (the built-ins), the page
gives the proposer's docstring summary and a table of its options (``options_type``, a msgspec Struct): key, type,
default and meaning. The meaning is the ``#:`` comment block right above the field in the struct's source (or a
trailing ``# ...`` comment on the field's line); fields inherited from a base struct take the base's comment.
The shared keys come from :mod:`vllm_treespec.config`.

    .venv/bin/python scripts/gen_methods_doc.py            # rewrite docs/methods.md
    .venv/bin/python scripts/gen_methods_doc.py --check    # exit 1 if docs/methods.md is out of date

tests/tooling/test_docs.py runs the check.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "methods.md"
GROUP = "vllm_treespec.proposers"
RERUN = ".venv/bin/python scripts/gen_methods_doc.py"


# --- what the page is made of -----------------------------------------------------------------------------------------
def builtin_methods() -> dict[str, str]:
    """Method name -> ``module:Class``, in pyproject.toml order."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    return dict(project["entry-points"][GROUP])


def load_class(value: str) -> type:
    module, _, attr = value.partition(":")
    return getattr(importlib.import_module(module), attr)


def field_comments(struct: type) -> dict[str, str]:
    """Field name -> its ``#:`` comment (or trailing comment), for the struct and every Struct base it inherits."""
    comments: dict[str, str] = {}
    for cls in reversed(struct.__mro__):
        if cls is msgspec.Struct or not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
            continue
        comments.update(_class_comments(textwrap.dedent(inspect.getsource(cls))))
    return comments


def _class_comments(source: str) -> dict[str, str]:
    lines = source.splitlines()
    doc_lines: dict[int, str] = {}  # 1-based line -> text of a "#:" comment that is alone on its line
    trailing: dict[int, str] = {}  # 1-based line -> text of a "# ..." comment after code
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        row, col = tok.start
        alone = not lines[row - 1][:col].strip()
        if alone and tok.string.startswith("#:"):
            doc_lines[row] = tok.string[2:].strip()
        elif not alone:
            trailing[row] = tok.string.lstrip("#").strip()
    cls_node = ast.parse(source).body[0]
    found: dict[str, str] = {}
    for node in cls_node.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        block, row = [], node.lineno - 1
        while row in doc_lines:
            block.insert(0, doc_lines[row])
            row -= 1
        text = " ".join(block) or trailing.get(node.lineno, "")
        if text:
            found[node.target.id] = text
    return found


# --- rendering --------------------------------------------------------------------------------------------------------
def render_type(t: typing.Any) -> str:
    """A field's type as a user writes it in JSON."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if t is type(None):
        return "null"
    if origin is typing.Literal:
        return " / ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        text = " or ".join(render_type(a) for a in rest)
        return f"{text} or null" if len(rest) < len(args) else text
    if origin in (tuple, list, set, frozenset):
        return f"list of {render_type(args[0])}" if args else "list"
    if origin is dict or t is dict:
        return "object"
    names = {int: "int", float: "float", bool: "bool", str: "str"}
    return names.get(t, getattr(t, "__name__", str(t)))


def render_default(field: msgspec.structs.FieldInfo) -> str:
    if field.default is not msgspec.NODEFAULT:
        value = field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
    else:
        return "required"
    return f"`{msgspec.json.encode(value).decode()}`"


def cell(text: str) -> str:
    """Markdown table cell: RST double backticks as code, pipes escaped."""
    return text.replace("``", "`").replace("|", "\\|")


def json_words(text: str) -> str:
    """A comment's Python constants as the JSON a user writes (None = null, ...)."""
    return re.sub(r"\b(None|True|False)\b", lambda m: {"None": "null", "True": "true", "False": "false"}[m[1]], text)


def summary(name: str, value: str, cls: type) -> str:
    """The class's own docstring, else the docstring of the entry point's module, else of the class's module: first
    paragraph, without a leading ``name``: label."""
    module = value.partition(":")[0]
    for doc in (cls.__dict__.get("__doc__"), sys.modules[module].__doc__, inspect.getmodule(cls).__doc__):
        if doc and doc.strip():
            text = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
            label = f"``{name}``: "
            text = text[len(label):] if text.startswith(label) else text
            return text[:1].upper() + text[1:]
    return ""


def method_section(name: str, value: str) -> list[str]:
    cls = load_class(value)
    out = [f"## `{name}`", "", cell(summary(name, value, cls)), "", f"Class `{value.replace(':', '.')}`.", ""]
    options = cls.options_type
    if options is None:
        return out + ["No options.", ""]
    comments = field_comments(options)
    out += ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in msgspec.structs.fields(options):
        out.append(f"| `{f.encode_name}` | {cell(render_type(f.type))} | {render_default(f)} | "
                   f"{cell(json_words(comments.get(f.name, '')))} |")
    return out + [""]


def shared_section() -> list[str]:
    from vllm_treespec.config import DEFAULT_NUM_SPECULATIVE_TOKENS, MAX_NUM_SPECULATIVE_TOKENS

    return [
        "## Keys every tree method takes", "",
        "| key | type | default | meaning |", "|---|---|---|---|",
        "| `method` | str | required | a method below, a name given to `register_proposer`, a name in the "
        f"`{GROUP}` entry-point group, or the dotted path of a `TreeProposer` subclass; vLLM's own methods "
        "(`ngram`, `eagle3`, `suffix`, ...) pass through untouched |",
        f"| `num_speculative_tokens` | int | `{DEFAULT_NUM_SPECULATIVE_TOKENS}` | the tree node budget: draft nodes "
        f"verified per request per step, 1 to {MAX_NUM_SPECULATIVE_TOKENS} (vLLM verifies at most "
        f"{MAX_NUM_SPECULATIVE_TOKENS} drafts per step); a longer tree is cut to its first nodes |",
        "| `cost_budget` | bool | `true` | verify only the draft nodes that pay: at start-up the engine measures (or "
        "loads from its cache folder, after a spot check of a few steps; a curve that no longer fits is measured "
        "again) what a step costs by the tokens in it, learns the host time per step, the "
        "drafter's time per call and each source's acceptance rate while it serves, and each step admits the batch's "
        "nodes best-first while they raise the expected tokens per second (none when nothing pays: plain decoding, "
        "and the drafter sits out); nodes without `node_probs` are always kept. `false`: every tree verified as "
        "proposed, up to `num_speculative_tokens` |",
        "| any other field of vLLM's `SpeculativeConfig` | | | passed to vLLM unchanged |", "",
        "Every other key is an option of the method, listed in its table. Options are checked when the config is read, "
        "before any engine starts: an unknown method, an unknown key, a wrong type or a value out of range fails with "
        "one message that names the field, the bad value and the valid choices.", "",
    ]


def render() -> str:
    lines = [
        "# Methods and their options", "",
        f"<!-- Generated by scripts/gen_methods_doc.py from the option structs; do not edit. Rerun: {RERUN} -->", "",
        "A tree method is selected by the speculative config, `vllm-treespec serve MODEL --speculative-config "
        "'{\"method\": \"graft\", \"num_speculative_tokens\": 16}'` or `LLM(model, speculative_config={...})`. "
        "Keys are written in JSON: `null`, `true`/`false`, lists in brackets. A key missing from the config takes "
        "the default shown.", "",
    ]
    lines += shared_section()
    for name, value in builtin_methods().items():
        lines += method_section(name, value)
    return "\n".join(lines).rstrip("\n") + "\n"


def undocumented() -> list[str]:
    """``method.key`` of every option without a ``#:`` comment."""
    missing = []
    for name, value in builtin_methods().items():
        options = load_class(value).options_type
        if options is not None:
            comments = field_comments(options)
            missing += [f"{name}.{f.name}" for f in msgspec.structs.fields(options) if f.name not in comments]
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed page instead of writing it")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run {RERUN}", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
