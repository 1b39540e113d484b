"""Every vLLM patch of vllm-treespec lives in this package: one module per vLLM class (or module, or one concern that
spans classes: ``draft_delivery``), one wrapper per symbol.

A patch replaces ``owner.name`` with a wrapper that receives the original as its first argument and calls it
explicitly. The original is kept in ``ORIGINALS`` so that patches can be undone (tests) and so that a second patch of
the same symbol is refused. ``EXPECTED_SIGNATURES`` records the parameters each wrapped symbol had in the vLLM version
we were written against; ``check_signatures`` compares them with the installed vLLM so that an upgrade fails loudly
(see tests/test_config_and_plugin.py) instead of silently mis-wiring a hook.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable

ORIGINALS: dict[tuple[Any, str], Any] = {}
EXPECTED_SIGNATURES: dict[str, tuple[str, ...]] = {}
_TARGETS: dict[str, tuple[str, str | None, str]] = {}  # key -> (module, class or None, attribute)


class PatchError(RuntimeError):
    pass


def wrap_method(owner: type, name: str, expected_params: tuple[str, ...]):
    """Decorator: install ``wrapper(original, self, *args, **kwargs)`` as ``owner.name``."""
    key = f"{owner.__module__}.{owner.__qualname__}.{name}"
    EXPECTED_SIGNATURES[key] = expected_params
    _TARGETS[key] = (owner.__module__, owner.__qualname__, name)
    return _wrap(owner, name, key, expected_params)


def expect_signature(owner: type, name: str, expected_params: tuple[str, ...]) -> None:
    """Record a vLLM method we depend on without wrapping it (a subclass overrides it and calls it through
    ``super()``, or it is wrapped only on another platform), so that ``check_signatures`` covers it everywhere."""
    key = f"{owner.__module__}.{owner.__qualname__}.{name}"
    EXPECTED_SIGNATURES[key] = expected_params
    _TARGETS[key] = (owner.__module__, owner.__qualname__, name)


def wrap_function(module: Any, name: str, expected_params: tuple[str, ...]):
    """Decorator: install ``wrapper(original, *args, **kwargs)`` as the module-level function ``module.name``
    (effective for callers that look the name up in that module at call time)."""
    key = f"{module.__name__}.{name}"
    EXPECTED_SIGNATURES[key] = expected_params
    _TARGETS[key] = (module.__name__, None, name)
    return _wrap(module, name, key, expected_params)


def _wrap(owner: Any, name: str, key: str, expected_params: tuple[str, ...]):
    def decorate(wrapper: Callable) -> Callable:
        if (owner, name) in ORIGINALS:
            raise PatchError(f"{key} is already patched by vllm_treespec")
        original = vars(owner).get(name)
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


def is_patched(owner: Any, name: str) -> bool:
    return (owner, name) in ORIGINALS


def unpatch_all() -> None:
    for (owner, name), original in list(ORIGINALS.items()):
        setattr(owner, name, original)
        del ORIGINALS[(owner, name)]


def check_signatures() -> list[str]:
    """Mismatches between the installed vLLM and EXPECTED_SIGNATURES (empty list = all good)."""
    problems = []
    for key, expected in EXPECTED_SIGNATURES.items():
        module_name, cls_name, attr = _TARGETS[key]
        try:
            owner = importlib.import_module(module_name)
            if cls_name is not None:
                owner = getattr(owner, cls_name)
        except (ImportError, AttributeError) as e:
            problems.append(f"{key}: cannot import ({e})")
            continue
        target = ORIGINALS.get((owner, attr), vars(owner).get(attr))
        if target is None:
            problems.append(f"{key}: missing")
            continue
        params = tuple(inspect.signature(target).parameters)
        if params != expected:
            problems.append(f"{key}: parameters {params} != expected {expected}")
    return problems
