"""Patches of ``vllm.v1.worker.gpu_worker.Worker``, the worker class vLLM's CPU worker also derives from:

- ``compile_or_warm_up_model`` (GPU workers; the CPU worker overrides it, see :mod:`vllm_treespec.patches.cpu_worker`):
  build the step-cost budget at start-up. vLLM calls it once per engine, after the KV cache exists, after
  compilation and CUDA-graph capture (so the sweep times the steps the engine will run) and whether or not graphs are
  captured (``GPUModelRunner.capture_model`` is skipped under ``enforce_eager``). The runner's tree verifier then gets
  its :class:`~vllm_treespec.cost.budget.StepBudget` (:func:`vllm_treespec.cost.budget.install_at_startup`; any
  failure: one log line, trees as proposed). Written for CUDA, exercised on CPU only through its signature check.
- ``shutdown`` (every worker, CPU ones included: they inherit it): before vLLM's own shutdown, the runner's tree
  verifier lets its proposer save what should outlive the engine (``TreeProposer.on_shutdown``: graft's and
  suffix_tree's store of finished outputs, when given a file). vLLM's engine core calls it through its executor when
  the engine stops (a server's exit, ``LLM`` shutdown); a killed process skips it.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from vllm_treespec.patches import expect_signature, is_patched, wrap_method

WARM_UP_PARAMS = ("self",)
expect_signature(Worker, "compile_or_warm_up_model", WARM_UP_PARAMS)  # checked on every platform
SHUTDOWN_PARAMS = ("self",)


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


def install_shutdown() -> None:
    """Wrap the worker's shutdown (idempotent): :func:`apply` calls it on every platform."""
    if is_patched(Worker, "shutdown"):
        return

    @wrap_method(Worker, "shutdown", SHUTDOWN_PARAMS)
    def shutdown(original, self):
        verifier = getattr(getattr(self, "model_runner", None), "_treespec_verifier", None)
        if verifier is not None:
            verifier.shutdown()
        return original(self)


def apply() -> None:
    from vllm.platforms import current_platform

    install_shutdown()
    if not current_platform.is_cpu():
        install()
