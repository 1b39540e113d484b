"""Patch of ``vllm.triton_utils.dispatcher._rebind_kernels`` (module function), CPU only.

On CPU every worker rebinds vLLM's Triton kernels to C++ fallbacks (``CpuPlatform.register_triton_kernel_overrides``)
by scanning the namespace of every imported module and reading ``vars(value).get("kernel")`` of each attribute that
has a ``__dict__``. llvmlite (imported by numba, which the retrieval store uses) exposes ``llvmlite.binding.ffi.lib``,
whose ``__dict__`` is forwarded to a ctypes function wrapper, so the scan dies with "'_lib_fn_wrapper' object has no
attribute 'get'" and the engine never starts. That happens whenever numba is imported in the process that starts the
worker before it does: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (in-process engines), with or without speculation
(the plugin applies this patch to every CPU engine, as it does the CPU linear's).
The wrapper hides such attributes (``vars()`` is not a mapping, so they cannot hold a kernel) from their modules for
the duration of the original scan and puts them back afterwards.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from vllm.triton_utils import dispatcher

from vllm_treespec.patches import is_patched, wrap_function


def unscannable_attributes() -> list[tuple[Any, str, Any]]:
    """(module, name, value) of module attributes whose ``__dict__`` is not a mapping (vLLM's scan would crash)."""
    found = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for name, value in list(namespace.items()):
            try:
                if hasattr(value, "__dict__") and not isinstance(vars(value), Mapping):
                    found.append((module, name, value))
            except TypeError:  # vars() refused: vLLM's scan would raise too
                found.append((module, name, value))
    return found


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or is_patched(dispatcher, "_rebind_kernels"):
        return

    @wrap_function(dispatcher, "_rebind_kernels", ("overrides",))
    def _rebind_kernels(original, overrides):
        hidden = unscannable_attributes()
        for module, name, _ in hidden:
            delattr(module, name)
        try:
            return original(overrides)
        finally:
            for module, name, value in hidden:
                setattr(module, name, value)
