"""Patch of ``vllm.v1.worker.gpu_worker.Worker.compile_or_warm_up_model`` (GPU workers; the CPU worker overrides it,
see :mod:`vllm_treespec.patches.cpu_worker`): build the step-cost budget at start-up.

vLLM calls it once per engine, after the KV cache exists, after compilation and CUDA-graph capture (so the sweep
times the steps the engine will run) and whether or not graphs are captured (``GPUModelRunner.capture_model`` is
skipped under ``enforce_eager``). The runner's tree verifier then gets its
:class:`~vllm_treespec.cost.budget.StepBudget` (:func:`vllm_treespec.cost.budget.install_at_startup`; any failure:
one log line, trees as proposed). Written for CUDA, exercised on CPU only through its signature check.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from vllm_treespec.patches import expect_signature, is_patched, wrap_method

WARM_UP_PARAMS = ("self",)
expect_signature(Worker, "compile_or_warm_up_model", WARM_UP_PARAMS)  # checked on every platform


def install() -> None:
    """Wrap the warm-up (idempotent). :func:`apply` calls it on GPUs; tests call it directly."""
    if is_patched(Worker, "compile_or_warm_up_model"):
        return

    @wrap_method(Worker, "compile_or_warm_up_model", WARM_UP_PARAMS)
    def compile_or_warm_up_model(original, self):
        result = original(self)
        from vllm_treespec.cost.budget import install_at_startup

        install_at_startup(self.model_runner)
        return result


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        install()
