"""Patch of ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._model_forward`` (inherited by ``CPUModelRunner``): the
wall time of a CPU engine's plain decode forwards, for benchmarks.

Engines of one configuration started minutes apart ran up to a third apart in speed on a small shared CPU, for
their whole life, so that three engines per method resolved a ratio to about +-15%. A benchmark that knows how fast
each engine ran can tell that apart from the method's effect (``vllm-treespec bench``: norm. speedup). This records
the time of every forward in which each request decodes one token (a plain step, whatever the method), by the
number of requests; :func:`read_forward_times` returns them through ``LLM.collective_rpc``.

Off unless ``VLLM_TREESPEC_FORWARD_TIMES=1`` is set when the engine starts (the bench sets it); then it is installed
in every process of the engine, speculative or not. A GPU forward returns before it ends, so nothing is recorded
there. ``VLLM_TREESPEC_FORWARD_TIMES_FILE=/path/forwards.txt`` (``bench serve`` sets it for each server) also turns
it on, and each worker appends a line per plain forward to ``/path/forwards.txt.<pid>`` — its start (wall clock, as
``time.time()``), the requests, the milliseconds and the requests' summed sequence lengths — which
:func:`read_trace`, :func:`window_reading` and :func:`window_fit` read back per load level (the files are named
as the budget trace's: :func:`vllm_treespec.cost.trace.files` lists them): a server has no ``collective_rpc`` to
ask.
"""

from __future__ import annotations

import collections
import os
import statistics
import time
from pathlib import Path
from typing import IO, Any, Iterable

import numpy as np

from vllm_treespec.patches import is_patched, wrap_method

FORWARD_TIMES_ENV = "VLLM_TREESPEC_FORWARD_TIMES"
FORWARD_TIMES_FILE_ENV = "VLLM_TREESPEC_FORWARD_TIMES_FILE"
MODEL_FORWARD_PARAMS = ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds", "model_kwargs")

#: requests in the forward -> (seconds, the requests' summed sequence lengths or None) of each plain decode forward
#: of this process since the last reset
_seconds: dict[int, list[tuple[float, int | None]]] = {}


#: [this process's trace file, or None without VLLM_TREESPEC_FORWARD_TIMES_FILE], opened at its first plain forward
_sink: list[IO[str] | None] = []


def enabled() -> bool:
    return os.environ.get(FORWARD_TIMES_ENV) == "1" or bool(os.environ.get(FORWARD_TIMES_FILE_ENV))


def _trace_file() -> IO[str] | None:
    if not _sink:
        base = os.environ.get(FORWARD_TIMES_FILE_ENV)
        # line-buffered: a server is stopped, not asked to close its files, and each line is read after it stops
        _sink.append(open(f"{base}.{os.getpid()}", "a", buffering=1) if base else None)  # noqa: SIM115
    return _sink[0]


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
        # each request's sequence length is its position + 1 (M-RoPE's 2-D positions: not recorded)
        context = None if positions is None or positions.dim() != 1 else int(positions[:num_reqs].sum()) + num_reqs
        _seconds.setdefault(num_reqs, []).append((seconds, context))
        sink = _trace_file()
        if sink is not None:
            sink.write(f"{time.time() - seconds:.6f} {num_reqs} {seconds * 1e3:.4f}"
                       f"{'' if context is None else f' {context}'}\n")
    return output


def read_forward_times(worker: Any = None, reset: bool = False, contexts: bool = False
                       ) -> dict[int, tuple[float, int]] | dict[int, list[tuple[float, int | None]]]:
    """For ``LLM.collective_rpc``: requests -> (median ms, count) of this process's plain decode forwards since the
    last reset (``reset``: start counting again after this reading); with ``contexts``, requests -> (ms, the
    requests' summed sequence lengths or None) of each of them instead."""
    if contexts:
        reading = {reqs: [(1e3 * seconds, context) for seconds, context in forwards]
                   for reqs, forwards in _seconds.items() if forwards}
    else:
        reading = {reqs: (1e3 * statistics.median(seconds for seconds, _ in forwards), len(forwards))
                   for reqs, forwards in _seconds.items() if forwards}
    if reset:
        _seconds.clear()
    return reading


def read_trace(paths: Iterable[Path]) -> list[tuple[float, int, float, int | None]]:
    """(start, requests, ms, context) of every plain forward in the files, in time order (a torn line is skipped;
    context, the requests' summed sequence lengths, is None in files written before it was recorded)."""
    records = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            fields = line.split()
            try:
                context = int(fields[3]) if len(fields) > 3 else None
                records.append((float(fields[0]), int(fields[1]), float(fields[2]), context))
            except (IndexError, ValueError):
                continue
    return sorted(records, key=lambda r: r[:3])


def window_reading(records: list[tuple[float, int, float, int | None]], start: float, end: float, min_count: int
                   ) -> tuple[float, int, int] | None:
    """(median ms, requests, count) of the plain forwards that started in [start, end), at the request count most of
    them had (a load level's: the others are its ramp-up and its tail); None with fewer than ``min_count``."""
    by_reqs: dict[int, list[float]] = collections.defaultdict(list)
    for started, reqs, ms, _ in records:
        if start <= started < end:
            by_reqs[reqs].append(ms)
    if not by_reqs:
        return None
    reqs = max(by_reqs, key=lambda r: (len(by_reqs[r]), r))
    times = by_reqs[reqs]
    return (statistics.median(times), reqs, len(times)) if len(times) >= min_count else None


def window_gap(records: list[tuple[float, int, float, int | None]], start: float, end: float, reqs: int,
               min_count: int) -> tuple[float, int] | None:
    """(median ms, count) of the host time between consecutive plain forwards of ``reqs`` requests that started in
    [start, end) (no plain forward of another request count between them): the next one's start less this one's
    start and length, i.e. the engine's work between two forwards (sampling, the drafter's call, scheduling, output
    processing, input preparation). Only pairs with less than a forward's time between them count: anything longer
    had a step that is not recorded in between (a prefill, a verifying step: never shorter than a plain forward of
    its requests). Two servers' host work per step compares through it far more finely than their throughput does.
    None with fewer than ``min_count`` pairs."""
    window = [(started, r, ms) for started, r, ms, _ in records if start <= started < end]
    gaps = []
    for (started, r, ms), (following, r_next, _) in zip(window, window[1:]):
        gap = (following - started) * 1e3 - ms
        if r == r_next == reqs and 0 <= gap < ms:
            gaps.append(gap)
    return (statistics.median(gaps), len(gaps)) if len(gaps) >= min_count else None


def window_fit(records: list[tuple[float, int, float, int | None]], start: float, end: float, reqs: int,
               min_count: int) -> tuple[float, float, float, float, float] | None:
    """The plain forwards of ``reqs`` requests that started in [start, end) as a line in their context: (ms at no
    context, ms per 1000 tokens of context, and the 10th, 50th and 90th percentiles of their contexts: the range where
    the line is measured, not extrapolated). Two servers' plain forwards compare at one context through it: a
    server's gate can leave different steps plain (graft drafted on the short-context steps and ran the long ones
    plain), and then their medians compare different steps. None with fewer than ``min_count`` forwards that
    recorded a context, or all at one context."""
    points = [(context, ms) for started, r, ms, context in records
              if start <= started < end and r == reqs and context is not None]
    if len(points) < min_count:
        return None
    contexts, times = np.array(points, np.float64).T
    if np.ptp(contexts) <= 0:
        return None
    slope, intercept = np.polyfit(contexts / 1000.0, times, 1)
    low, median, high = np.percentile(contexts, [10, 50, 90])
    return float(intercept), float(slope), float(low), float(median), float(high)


def install() -> None:
    """Wrap the forward (idempotent). :func:`apply` calls it when the variable is set; tests call it directly."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # not at plugin registration: seconds to import

    if not is_patched(GPUModelRunner, "_model_forward"):
        wrap_method(GPUModelRunner, "_model_forward", MODEL_FORWARD_PARAMS)(model_forward)


def apply() -> None:
    if enabled():
        install()
