"""Patch of ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``: a measured choice of CPU linear.

vLLM picks each dense layer's CPU GEMM once, at load time (zentorch, sgl-kernel, oneDNN, else torch's linear). On a
CPU without AVX-512 its bf16 choice is torch's fallback, whose time grows linearly with the rows of a step, so every
verified tree token costs about a decode step. After vLLM's choice this patch times it against
:class:`vllm_treespec.cpu_gemm.NumbaLinear` on the layer's weight shape (once per shape and dtype in a process,
~1-2 s per model) and keeps the faster. It applies to every CPU engine of a process where the plugin is enabled,
speculative or not, so that no speculation is measured with the same linear as the tree methods.

``VLLM_TREESPEC_CPU_LINEAR``: ``auto`` (default: measured), ``vllm`` (vLLM's choice, untimed), ``numba`` (ours
wherever it applies, untimed).
"""

from __future__ import annotations

import logging
import os

import torch
from vllm.model_executor.layers import utils as layer_utils

from vllm_treespec.patches import is_patched, wrap_function

logger = logging.getLogger("vllm.treespec")

DISPATCH_PARAMS = ("layer", "remove_weight")
LINEAR_ENV = "VLLM_TREESPEC_CPU_LINEAR"
LINEAR_CHOICES = ("auto", "vllm", "numba")

#: (dtype, out_features, in_features) -> ours is used; one timing per shape and process
_choices: dict[tuple[torch.dtype, int, int], bool] = {}


def linear_mode() -> str:
    mode = os.environ.get(LINEAR_ENV, "auto").strip().lower() or "auto"
    if mode not in LINEAR_CHOICES:
        raise ValueError(f"{LINEAR_ENV}={mode!r} is not one of {', '.join(LINEAR_CHOICES)} "
                         "(auto: the faster of vLLM's CPU linear and ours, timed at load)")
    return mode


def kernel_summary() -> str:
    """What this process's dense layers use, for the step-cost cache key: ``vllm``, ``numba`` or ``mixed``."""
    used = set(_choices.values())
    if not used:
        return "vllm"
    return "mixed" if len(used) == 2 else ("numba" if used == {True} else "vllm")


def _eligible(layer: torch.nn.Module) -> bool:
    from vllm_treespec.cpu_gemm import DTYPES

    weight = getattr(layer, "weight", None)
    return (isinstance(weight, torch.Tensor) and not weight.is_meta and weight.dim() == 2
            and weight.dtype in DTYPES and weight.device.type == "cpu" and weight.numel() > 0)


def _choose(original, layer: torch.nn.Module, remove_weight: bool, mode: str) -> bool:
    """Whether ``layer`` should use ours; leaves vLLM's linear installed (built without removing the weight)."""
    from vllm_treespec import cpu_gemm  # numba: imported where a CPU model loads, not at plugin registration

    weight = layer.weight
    shape = (weight.dtype, int(weight.shape[0]), int(weight.shape[1]))
    original(layer, remove_weight=False)
    if mode == "numba":
        _choices[shape] = True
    elif shape not in _choices:
        times = cpu_gemm.time_against(weight, layer.cpu_linear)
        _choices[shape] = cpu_gemm.ours_is_faster(times)
        logger.info("vllm_treespec CPU linear %s %dx%d: %s (time ours / vLLM's: %s rows)", str(shape[0])[6:],
                    shape[1], shape[2], "ours" if _choices[shape] else "vLLM's",
                    ", ".join(f"{ours / theirs:.2f} at {n}" for n, (ours, theirs) in times.items()))
    return _choices[shape]


def dispatch_wrapper(original, layer, remove_weight):
    """The patched dispatch: vLLM's, then ours where it is faster (see the module docstring)."""
    mode = linear_mode()
    if mode == "vllm" or not _eligible(layer):
        return original(layer, remove_weight)
    try:
        use_ours = _choose(original, layer, remove_weight, mode)
    except Exception as error:  # noqa: BLE001 - a failed timing must not stop the model from loading
        logger.warning("vllm_treespec CPU linear: timing failed (%s); vLLM's linear is kept", error)
        use_ours = False
    if use_ours:
        from vllm_treespec.cpu_gemm import NumbaLinear

        layer.cpu_linear = NumbaLinear(layer.weight)  # keeps the weight; vLLM's handler (and its copy) goes
    elif remove_weight:
        original(layer, remove_weight)  # vLLM's own dispatch, exactly as it would have run
    return None


def install() -> None:
    """Wrap the dispatch (idempotent). :func:`apply` calls it on CPU; tests call it directly."""
    if not is_patched(layer_utils, "dispatch_cpu_unquantized_gemm"):
        wrap_function(layer_utils, "dispatch_cpu_unquantized_gemm", DISPATCH_PARAMS)(dispatch_wrapper)


def apply() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        linear_mode()  # a bad value fails here, at start-up, naming the variable
        install()
