"""Patch of ``vllm.v1.worker.cpu_worker.CPUWorker.compile_or_warm_up_model``: build the step-cost budget at start-up.

vLLM calls it once per engine, after the KV cache exists and before the first request, on every CPU engine (unlike
``CPUModelRunner.warming_up_model``, which runs before the KV cache is allocated and is skipped under
``enforce_eager`` with an explicit KV-cache size, i.e. in most CPU engines). After vLLM's own warm-up the runner's
tree verifier gets its :class:`~vllm_treespec.cost.budget.StepBudget`: the cached step-cost curve, or a sweep of a
few seconds (:func:`vllm_treespec.cost.budget.install_at_startup`; any failure: one log line, trees as proposed), and
the kernels of a tree step are compiled (:func:`vllm_treespec.verify.warmup.compile_step_kernels`), so that a fresh
install's first request does not wait for them.
"""

from __future__ import annotations

import logging

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_treespec.patches import expect_signature, is_patched, wrap_method

logger = logging.getLogger("vllm.treespec")

WARM_UP_PARAMS = ("self",)
expect_signature(CPUWorker, "compile_or_warm_up_model", WARM_UP_PARAMS)  # checked on every platform


def install() -> None:
    """Wrap the warm-up (idempotent). :func:`apply` calls it on CPU; tests call it directly."""
    if is_patched(CPUWorker, "compile_or_warm_up_model"):
        return

    @wrap_method(CPUWorker, "compile_or_warm_up_model", WARM_UP_PARAMS)
    def compile_or_warm_up_model(original, self):
        result = original(self)
        from vllm_treespec.cost.budget import install_at_startup

        install_at_startup(self.model_runner)
        if getattr(self.model_runner, "_treespec_verifier", None) is not None:
            from vllm_treespec.verify.warmup import compile_step_kernels

            seconds = compile_step_kernels(self.model_runner)
            if seconds > 0.5:
                logger.info("vllm_treespec: compiled the tree step's kernels in %.1f s", seconds)
        return result


def apply() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        install()
