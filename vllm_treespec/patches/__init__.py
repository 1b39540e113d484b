"""Every vLLM patch of vllm-treespec lives in this package: one module per vLLM class, one wrapper per symbol.

A patch replaces ``owner.name`` with a wrapper that receives the original as its first argument and calls it
explicitly. The original is kept in ``ORIGINALS`` so that patches can be undone (tests) and so that a second patch of
the same symbol is refused. ``EXPECTED_SIGNATURES`` records the parameters each wrapped symbol had in the vLLM version
we were written against; ``check_signatures`` compares them with the installed vLLM so that an upgrade fails loudly
(see tests/test_patch_signatures.py) instead of silently mis-wiring a hook.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

ORIGINALS: dict[tuple[type, str], Any] = {}
EXPECTED_SIGNATURES: dict[str, tuple[str, ...]] = {}


class PatchError(RuntimeError):
    pass


def wrap_method(owner: type, name: str, expected_params: tuple[str, ...]):
    """Decorator: install ``wrapper(original, self, *args, **kwargs)`` as ``owner.name``."""

    key = f"{owner.__module__}.{owner.__qualname__}.{name}"
    EXPECTED_SIGNATURES[key] = expected_params

    def decorate(wrapper: Callable) -> Callable:
        if (owner, name) in ORIGINALS:
            raise PatchError(f"{key} is already patched by vllm_treespec")
        original = owner.__dict__.get(name)
        if original is None:
            raise PatchError(f"{key} does not exist in the installed vLLM")
        params = tuple(inspect.signature(original).parameters)
        if params != expected_params:
            raise PatchError(f"{key} has parameters {params}, vllm_treespec expects {expected_params}")

        @functools.wraps(original)
        def patched(*args, **kwargs):
            return wrapper(original, *args, **kwargs)

        patched.__vllm_treespec_original__ = original  # type: ignore[attr-defined]
        ORIGINALS[(owner, name)] = original
        setattr(owner, name, patched)
        return wrapper

    return decorate


def is_patched(owner: type, name: str) -> bool:
    return (owner, name) in ORIGINALS


def unpatch_all() -> None:
    for (owner, name), original in list(ORIGINALS.items()):
        setattr(owner, name, original)
        del ORIGINALS[(owner, name)]


def check_signatures() -> list[str]:
    """Mismatches between the installed vLLM and EXPECTED_SIGNATURES (empty list = all good)."""
    import importlib

    problems = []
    for key, expected in EXPECTED_SIGNATURES.items():
        module_name, cls_name, attr = _split_key(key)
        try:
            owner = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError) as e:
            problems.append(f"{key}: cannot import ({e})")
            continue
        target = ORIGINALS.get((owner, attr), owner.__dict__.get(attr))
        if target is None:
            problems.append(f"{key}: missing")
            continue
        params = tuple(inspect.signature(target).parameters)
        if params != expected:
            problems.append(f"{key}: parameters {params} != expected {expected}")
    return problems


def _split_key(key: str) -> tuple[str, str, str]:
    rest, attr = key.rsplit(".", 1)
    module_name, cls_name = rest.rsplit(".", 1)
    return module_name, cls_name, attr
