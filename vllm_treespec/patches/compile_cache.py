"""Patches of ``vllm.compilation.decorators`` (``_try_load_aot_compiled_fn``, ``_model_hash_key``): a compiled CPU
engine loads its model from vLLM's compile cache instead of compiling it again at every start.

vLLM 0.32 saves every compiled model to ``<VLLM_CACHE_ROOT>/torch_compile_cache/torch_aot_compile/<hash>`` but never
loads it back on CPU: there it compiles with the string backend ``"inductor"``, whose saved artifact torch wraps in
``BundledAOTAutogradSerializableCallable``, and the loader then calls ``finalize_loading`` on it, a method only
vLLM's own backend has. Every compiled start logged "Compiling model again due to a load failure ...
'finalize_loading'" and recompiled (~45-100 s of a CPU engine's start on 2 cores). That artifact is fully loaded
when torch deserializes it, so :func:`load_aot_compiled` lends it a ``finalize_loading`` that does nothing, only
for the duration of vLLM's load.

A graph compiled with our CPU linear (:mod:`vllm_treespec.patches.cpu_gemm`) holds each layer's linear by id, and
vLLM's cache key knows nothing of which layers use ours or of what weights they hold. :func:`model_hash_key` adds a
digest of the compiled module's linears (layer names and content ids, :func:`vllm_treespec.cpu_gemm.content_id`) to
vLLM's key: a graph is loaded only by a model whose linears answer to the ids it holds, and a changed choice
(``VLLM_TREESPEC_CPU_LINEAR``, a new timing) or changed weights compile afresh. A failed load still falls back to
vLLM's compile, with vLLM's log line.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from typing import Any, Callable, Iterator

from vllm.compilation import decorators

from vllm_treespec.patches import is_patched, wrap_function

logger = logging.getLogger("vllm.treespec")

LOAD_PARAMS = ("model", "aot_compilation_path")
HASH_KEY_PARAMS = ("fn",)


def _already_loaded(self: Any, vllm_config: Any) -> None:
    """What vLLM's ``finalize_loading`` does for an inductor artifact: nothing (torch loaded it whole)."""


@contextlib.contextmanager
def _finalize_loading_for_inductor_artifacts() -> Iterator[None]:
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as bundled
    except ImportError:  # another torch: vLLM's load runs as it would
        yield
        return
    if hasattr(bundled, "finalize_loading"):  # a torch or vLLM that handles it
        yield
        return
    bundled.finalize_loading = _already_loaded
    try:
        yield
    finally:
        del bundled.finalize_loading


def load_aot_compiled(original: Callable, model: Any, aot_compilation_path: str) -> Any:
    with _finalize_loading_for_inductor_artifacts():
        return original(model, aot_compilation_path)


def linear_digest(module: Any) -> str | None:
    """A digest of ``module``'s layers that run our CPU linear (name and content id of each, in module order);
    None when none does."""
    from vllm_treespec.cpu_gemm import NumbaLinear

    named_modules = getattr(module, "named_modules", None)
    if named_modules is None:
        return None
    ours = [f"{name}={layer.cpu_linear.linear_id}" for name, layer in named_modules()
            if isinstance(getattr(layer, "cpu_linear", None), NumbaLinear)]
    return hashlib.sha256("\n".join(ours).encode()).hexdigest() if ours else None


def model_hash_key(original: Callable, fn: Callable[..., Any]) -> str:
    key = original(fn)
    digest = linear_digest(getattr(fn, "__self__", None))  # fn: the compiled module's bound forward
    return key if digest is None else f"{key} vllm_treespec-cpu-linears {digest}"


def install() -> None:
    """Wrap both (idempotent). :func:`apply` calls it on CPU; tests call it directly."""
    if not is_patched(decorators, "_try_load_aot_compiled_fn"):
        wrap_function(decorators, "_try_load_aot_compiled_fn", LOAD_PARAMS)(load_aot_compiled)
    if not is_patched(decorators, "_model_hash_key"):
        wrap_function(decorators, "_model_hash_key", HASH_KEY_PARAMS)(model_hash_key)


def apply() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        install()
