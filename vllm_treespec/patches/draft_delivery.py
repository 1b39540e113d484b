"""Drafts delivered with the sampled tokens: one RPC per engine step fewer.

vLLM's engine core asks the worker for the drafts of a ``custom_class`` method in a third RPC per step
(``EngineCore.post_step`` → ``take_draft_token_ids``), after ``execute_model`` and ``sample_tokens``. On CPU that
round trip was ~1.8 ms of every step, a price paid even by steps whose budget drafts nothing. Three wrappers, one per
vLLM symbol, deliver the same ``DraftTokenIds`` on the step's ``ModelRunnerOutput`` instead:

- ``Worker.sample_tokens`` (worker): reads the runner's drafts with ``take_draft_token_ids`` — the very call the RPC
  would make, which does not clear them — and attaches them to the output it returns;
- ``Scheduler.update_from_output`` (engine core): takes them off the output before vLLM reads it;
- ``EngineCore.post_step`` (engine core): hands them to ``Scheduler.update_draft_token_ids`` at the point where vLLM
  would have, and skips the RPC.

Each side falls back to vLLM's own path when the other is missing: an output without drafts makes ``post_step`` run
the RPC, and an engine core without the wrappers still gets the drafts from the RPC (the worker left them in place).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.worker.gpu_worker import Worker

from vllm_treespec.patches import is_patched, wrap_method

#: set on a ModelRunnerOutput by the worker, and on the Scheduler until post_step applies it; neither is a vLLM name
OUTPUT_ATTRIBUTE = "_vllm_treespec_drafts"
SCHEDULER_ATTRIBUTE = "_vllm_treespec_delivered_drafts"
_NOTHING = object()  # no drafts were delivered with this step's output


def attach_drafts(runner: Any, output: Any) -> None:
    """Worker side: put the runner's drafts for the next step on this step's output (tree methods only)."""
    if getattr(runner, "_treespec_verifier", None) is None:
        return
    # EMPTY_MODEL_RUNNER_OUTPUT is a shared instance: an attribute set on it would outlive the step
    if type(output) is not ModelRunnerOutput or output is EMPTY_MODEL_RUNNER_OUTPUT:
        return
    setattr(output, OUTPUT_ATTRIBUTE, runner.take_draft_token_ids())


def take_delivered(scheduler: Any, output: Any) -> None:
    """Engine-core side: move delivered drafts from the output to the scheduler (consumed once)."""
    drafts = getattr(output, OUTPUT_ATTRIBUTE, _NOTHING)
    if drafts is _NOTHING:
        return
    delattr(output, OUTPUT_ATTRIBUTE)
    setattr(scheduler, SCHEDULER_ATTRIBUTE, drafts)


def apply() -> None:
    if is_patched(EngineCore, "post_step"):
        return

    @wrap_method(Worker, "sample_tokens", ("self", "grammar_output"))
    def sample_tokens(original, self, grammar_output):
        output = original(self, grammar_output)
        attach_drafts(self.model_runner, output)
        return output

    @wrap_method(Scheduler, "update_from_output", ("self", "scheduler_output", "model_runner_output"))
    def update_from_output(original, self, scheduler_output, model_runner_output):
        take_delivered(self, model_runner_output)
        return original(self, scheduler_output, model_runner_output)

    @wrap_method(EngineCore, "post_step", ("self", "model_executed"))
    def post_step(original, self, model_executed):
        scheduler = self.scheduler
        drafts = vars(scheduler).pop(SCHEDULER_ATTRIBUTE, _NOTHING)
        if drafts is _NOTHING or self.async_scheduling or not self.check_for_draft_tokens:
            return original(self, model_executed)
        if model_executed and drafts is not None:
            scheduler.update_draft_token_ids(drafts)
