"""Proposer names: ``register_proposer`` at run time, the ``vllm_treespec.proposers`` entry-point group (the built-in
methods are registered there too, in pyproject.toml), or a dotted class path. Resolving a name never imports the other
proposers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_treespec.api import TreeProposer

ENTRY_POINT_GROUP = "vllm_treespec.proposers"
_REGISTRY: dict[str, str | type[TreeProposer]] = {}


def register_proposer(name: str, cls: type[TreeProposer] | str | None = None):
    """Register a proposer under ``name``. Use as a decorator or call with a class or a dotted class path."""

    def _register(c):
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not c and _qualname(existing) != _qualname(c):
            raise ValueError(f"proposer name {name!r} is already registered to {_qualname(existing)}")
        _REGISTRY[name] = c
        return c

    return _register(cls) if cls is not None else _register


def _qualname(c: str | type) -> str:
    return c if isinstance(c, str) else f"{c.__module__}.{c.__qualname__}"


def registered_proposers() -> dict[str, str]:
    """Every known proposer name (registered or by entry point) → dotted class path."""
    from importlib.metadata import entry_points

    names = {n: _qualname(c) for n, c in _REGISTRY.items()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        names.setdefault(ep.name, ep.value.replace(":", "."))
    return names


def is_dotted_path(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and all(p.isidentifier() for p in parts)


def proposer_class_path(name: str) -> str:
    """Resolve a method name or dotted path to a dotted class path (without importing the proposer)."""
    known = registered_proposers()
    if name in known:
        return known[name]
    if is_dotted_path(name):
        return name
    raise KeyError(name)


def load_proposer_class(path_or_name: str) -> type[TreeProposer]:
    path = proposer_class_path(path_or_name)
    module_name, _, attr = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"cannot import proposer class {path!r}: {e}") from e
    if not isinstance(cls, type):
        raise TypeError(f"{path!r} is not a class")
    return cls
