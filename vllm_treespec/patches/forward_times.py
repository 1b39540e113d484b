"""Patch of ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._model_forward`` (inherited by ``CPUModelRunner``): the
wall time of a CPU engine's plain decode forwards, for benchmarks.

Engines of one configuration started minutes apart ran up to a third apart in speed on a small shared CPU, for
their whole life, so that three engines per method resolved a ratio to about +-15%. A benchmark that knows how fast
each engine ran can tell that apart from the method's effect (``vllm-treespec bench``: norm. speedup). This records
the time of every forward in which each request decodes one token (a plain step, whatever the method), by the
number of requests; :func:`read_forward_times` returns them through ``LLM.collective_rpc``.

Off unless ``VLLM_TREESPEC_FORWARD_TIMES=1`` is set when the engine starts (the bench sets it); then it is installed
in every process of the engine, speculative or not. A GPU forward returns before it ends, so nothing is recorded
there.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from vllm_treespec.patches import is_patched, wrap_method

FORWARD_TIMES_ENV = "VLLM_TREESPEC_FORWARD_TIMES"
MODEL_FORWARD_PARAMS = ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds", "model_kwargs")

#: requests in the forward -> seconds of each plain decode forward of this process since the last reset
_seconds: dict[int, list[float]] = {}


def enabled() -> bool:
    return os.environ.get(FORWARD_TIMES_ENV) == "1"


def _forward_tokens(input_ids: Any, inputs_embeds: Any) -> int | None:
    rows = input_ids if input_ids is not None else inputs_embeds
    return int(rows.shape[0]) if rows is not None else None


def model_forward(original, self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                  **model_kwargs):
    """vLLM's forward, timed when it is a plain decode step on a CPU (one token per request)."""
    if self.device.type != "cpu":
        return original(self, input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs)
    started = time.perf_counter()
    output = original(self, input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs)
    seconds = time.perf_counter() - started
    num_reqs = int(self.input_batch.num_reqs)
    if num_reqs > 0 and _forward_tokens(input_ids, inputs_embeds) == num_reqs:
        _seconds.setdefault(num_reqs, []).append(seconds)
    return output


def read_forward_times(worker: Any = None, reset: bool = False) -> dict[int, tuple[float, int]]:
    """For ``LLM.collective_rpc``: requests -> (median ms, count) of this process's plain decode forwards since the
    last reset (``reset``: start counting again after this reading)."""
    reading = {reqs: (1e3 * statistics.median(times), len(times)) for reqs, times in _seconds.items() if times}
    if reset:
        _seconds.clear()
    return reading


def install() -> None:
    """Wrap the forward (idempotent). :func:`apply` calls it when the variable is set; tests call it directly."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # not at plugin registration: seconds to import

    if not is_patched(GPUModelRunner, "_model_forward"):
        wrap_method(GPUModelRunner, "_model_forward", MODEL_FORWARD_PARAMS)(model_forward)


def apply() -> None:
    if enabled():
        install()
