"""The ``vllm.general_plugins`` entry point. vLLM calls :func:`register` once in every process it starts.

It gates on the vLLM version (unsupported → one log line, nothing registered, vLLM keeps working), installs the
process-0 config translation, on CPU the measured choice of dense linear (:mod:`vllm_treespec.patches.cpu_gemm`, in
every engine: no speculation must run on the linear the tree methods run on), where a benchmark asks for it the
forward timer (:mod:`vllm_treespec.patches.forward_times`) and the step timers
(:mod:`vllm_treespec.patches.step_timers`), and — only in processes that serve a tree method — the
worker patches and the tree-aware attention backend.
"""

from __future__ import annotations

import logging
import os

from vllm_treespec.config import TREE_MODE_ENV

logger = logging.getLogger("vllm.treespec")

SUPPORTED_VLLM_PREFIXES = ("0.32.",)
SKIP_VERSION_CHECK_ENV = "VLLM_TREESPEC_SKIP_VERSION_CHECK"
# Testing knob: pretend the installed vLLM has this version (exercises the version gate).
ASSUME_VERSION_ENV = "VLLM_TREESPEC_ASSUME_VLLM_VERSION"

_state = {"registered": False, "enabled": False, "tree_mode": False}


def vllm_version() -> str:
    assumed = os.environ.get(ASSUME_VERSION_ENV)
    if assumed:
        return assumed
    import vllm

    return getattr(vllm, "__version__", "unknown")


def version_supported(version: str) -> bool:
    return version.startswith(SUPPORTED_VLLM_PREFIXES) or os.environ.get(SKIP_VERSION_CHECK_ENV) == "1"


def register() -> None:
    """Entry point; idempotent."""
    if _state["registered"]:
        return
    _state["registered"] = True
    version = vllm_version()
    if not version_supported(version):
        logger.warning("vllm_treespec is disabled: vLLM %s is not supported (supported: %s); vLLM runs without it. "
                       "Install a supported vLLM or set %s=1 to try anyway.",
                       version, ", ".join(p + "x" for p in SUPPORTED_VLLM_PREFIXES), SKIP_VERSION_CHECK_ENV)
        return
    from vllm_treespec.patches import compile_cache, cpu_gemm, engine_args, forward_times, triton_dispatcher

    engine_args.apply(activate_tree_mode)
    cpu_gemm.apply()  # every CPU engine, speculative or not: no speculation is measured on the same linear
    compile_cache.apply()  # every compiled CPU engine loads its model from vLLM's cache (keyed by our linears)
    forward_times.apply()  # only where a benchmark asks (VLLM_TREESPEC_FORWARD_TIMES=1): every engine's speed
    # every CPU engine too: once this package has imported numba (llvmlite), vLLM's kernel scan in an in-process
    # worker crashes, speculative or not
    triton_dispatcher.apply()
    _state["enabled"] = True
    if os.environ.get(TREE_MODE_ENV) == "1":
        activate_tree_mode()
    from vllm_treespec.patches import step_timers

    # only where a benchmark asks (VLLM_TREESPEC_STEP_TIMERS_FILE): after the patches, so that they are timed too
    step_timers.install_from_env()


def activate_tree_mode() -> None:
    """Install worker patches and the tree attention backend in this process (and, through the environment,
    in the engine and worker processes vLLM starts after this)."""
    os.environ[TREE_MODE_ENV] = "1"
    if _state["tree_mode"]:
        return
    _state["tree_mode"] = True
    from vllm_treespec.attn import register_backends
    from vllm_treespec.patches import (cpu_worker, cudagraph_dispatcher, draft_delivery, gpu_worker, model_runner,
                                       rejection_sampler, topk_topp_sampler)

    register_backends()
    model_runner.apply()
    rejection_sampler.apply()
    topk_topp_sampler.apply()
    cudagraph_dispatcher.apply()
    cpu_worker.apply()
    gpu_worker.apply()
    draft_delivery.apply()


def is_enabled() -> bool:
    return _state["enabled"]
