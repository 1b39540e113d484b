"""Exact per-function timers of an engine step, in process (``scripts/step_split.py``) or in a server's engine core and
worker (``vllm-treespec bench serve --step-timers``): where a speculative engine's host time per step goes against no
speculation's.

A timer wraps a function (vLLM's or this project's, :data:`TIMED`) with ``perf_counter`` and adds its wall time and a
call to per-process totals; nested functions count in both, and each wrapper costs about a microsecond per call. They
change no behaviour and are never installed unless a benchmark asks: instruments, which is why they pass any arguments
through without the signature checks of :func:`vllm_treespec.patches.wrap_method` (a vLLM upgrade that renames a
timed function leaves it untimed, nothing else) and wrap whatever is installed, a patch's wrapper included.

In a server: ``VLLM_TREESPEC_STEP_TIMERS_FILE=/path/timers.jsonl`` (``bench serve --step-timers`` sets it for each
server) makes the plugin install them in every process vLLM starts, after this project's own patches (so a patched
vLLM function is timed with its wrapper), and each process that runs a timed function appends a snapshot of its
running totals to ``/path/timers.jsonl.<pid>`` at most once a second: its wall-clock time, the totals in seconds and
the calls, each function's calls by their time (:func:`duration_bucket`) and the process's minor page faults; the
garbage collector's collections are timed as functions of their own (``gc.generationN``). The step's big functions
(:data:`OFF_CPU_TIMED`) also count the part of their wall time their thread was not on a CPU and the times it was
preempted (involuntary context switches): whether a function that is slower in one server than in another computed
longer or waited for a core. :func:`window_totals` reads the difference over a load level's window back from every
process's file (the engine core's and the worker's functions are disjoint), :func:`per_step` turns it into
milliseconds per engine step, :func:`window_durations` gives one function's calls by time. This project's functions
are wrapped once their module has been imported (checked at each snapshot).
"""

from __future__ import annotations

import collections
import functools
import gc
import importlib
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import IO, Iterable, Iterator, NamedTuple

STEP_TIMERS_FILE_ENV = "VLLM_TREESPEC_STEP_TIMERS_FILE"
#: a server process writes its running totals at most this often
SNAPSHOT_SECONDS = 1.0
#: the function whose calls count the engine steps: one per step in the worker, whatever the process layout
STEP_KEY = "GPUModelRunner.execute_model"

#: the functions whose calls also count their time off a CPU (wall less the thread's CPU time) and involuntary context
#: switches, read back as ``"KEY off-CPU"`` (seconds, calls) and ``"KEY switches"`` (calls): four system calls a
#: call, so only for the few calls a step that hold nearly all of its time
OFF_CPU_TIMED = frozenset({
    "EngineCore.step", "Worker.execute_model", "Worker.sample_tokens", "GPUModelRunner._prepare_inputs",
    "GPUModelRunner._model_forward", "LlamaForCausalLM.compute_logits", "Sampler.forward",
    "GPUModelRunner.propose_draft_token_ids",
})
OFF_CPU_SUFFIX = " off-CPU"
SWITCHES_SUFFIX = " switches"

#: (module, class, method) of the functions timed; missing ones are skipped (a method without a tree verifier, a
#: process without an engine core). A module-level function is timed as the module that calls it imported it:
#: (that module, None, name). Only a function defined on the class itself is wrapped (not an inherited one).
TIMED = (
    ("vllm.v1.engine.llm_engine", "LLMEngine", "step"),
    ("vllm.v1.engine.core", "EngineCore", "step"),
    ("vllm.v1.engine.core", "EngineCore", "post_step"),
    ("vllm.v1.engine.core", "EngineCoreProc", "_process_input_queue"),
    ("vllm.v1.engine.core", "EngineCoreProc", "_process_engine_step"),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "execute_model"),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "sample_tokens"),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "take_draft_token_ids"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_draft_token_ids"),
    ("vllm.v1.worker.gpu_worker", "Worker", "execute_model"),
    ("vllm.v1.worker.gpu_worker", "Worker", "sample_tokens"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_sample"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_bookkeeping_sync"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "propose_draft_token_ids"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_update_states"),
    ("vllm.model_executor.models.llama", "LlamaForCausalLM", "compute_logits"),
    ("vllm.v1.sample.sampler", "Sampler", "forward"),
    ("vllm.v1.sample.rejection_sampler", "RejectionSampler", "forward"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", "forward"),
    ("vllm_treespec.attn.cpu", "TreeCPUAttentionImpl", "forward"),
    ("vllm_treespec.verify.verifier", "TreeVerifier", "propose"),
    ("vllm_treespec.verify.verifier", "TreeVerifier", "attach"),
    ("vllm_treespec.verify.verifier", "TreeVerifier", "sample"),
    ("vllm_treespec.verify.verifier", "TreeVerifier", "_draft"),
    ("vllm_treespec.cost.budget", "StepBudget", "should_draft"),
    ("vllm_treespec.cost.allocate", "DraftGate", "expected_best"),
    ("vllm_treespec.eagle.drafter", "EagleDrafter", "observe"),
    ("vllm_treespec.eagle.drafter", "EagleDrafter", "_write_segments"),
    ("vllm_treespec.eagle.drafter", "EagleDrafter", "ingest"),
    ("vllm_treespec.eagle.drafter", "EagleDrafter", "draft"),
    ("vllm_treespec.eagle.drafter", "EagleDrafter", "_expand_level"),
    ("vllm_treespec.eagle.drafter", "EagleDrafter", "_segments"),
    ("vllm_treespec.proposers.graft.proposer", "GraftProposer", "propose_trees"),
    ("vllm_treespec.proposers.graft.proposer", "GraftProposer", "glance"),
    ("vllm_treespec.proposers.graft.proposer", "GraftProposer", "observe"),
    ("vllm_treespec.proposers.graft.proposer", "GraftProposer", "head_drafts"),
    ("vllm_treespec.proposers.graft.proposer", "GraftProposer", "_tree"),
    ("vllm_treespec.proposers.graft.proposer", "GraftProposer", "_assemble"),
    ("vllm_treespec.proposers.graft.proposer", "GraftProposer", "on_verified"),
    ("vllm_treespec.proposers.graft.sources", "RetrievalSources", "observe"),
    ("vllm_treespec.proposers.graft.sources", "RetrievalSources", "at_root"),
    ("vllm_treespec.verify.calibration", "AcceptanceTracker", "calibrate"),
    ("vllm_treespec.verify.calibration", "AcceptanceTracker", "committed"),
    ("vllm_treespec.verify.calibration", "AcceptanceTracker", "handed"),
    ("vllm_treespec.cost.budget", "StepBudget", "admit"),
    ("vllm_treespec.cost.budget", "StepBudget", "step_started"),
    ("vllm_treespec.cost.budget", "StepBudget", "step_finished"),
    ("vllm_treespec.verify.calibration", "AcceptanceCalibration", "_rate"),
    ("vllm_treespec.proposers.graft.proposer", "GraftProposer", "_retrieval_draft"),
    ("vllm_treespec.proposers.graft.proposer", "GraftProposer", "_most_confident"),
    ("vllm_treespec.proposers.graft.proposer", "GraftProposer", "_grafts"),
    ("vllm_treespec.proposers.graft.proposer", "GraftProposer", "_model_drafts"),
    ("vllm_treespec.proposers.graft.proposer", None, "assemble_tree"),
    ("vllm_treespec.cost.budget", None, "allocate"),
    ("vllm_treespec.cost.allocate", "DraftGate", "record"),
    ("vllm_treespec.cost.allocate", "DraftGate", "should_draft"),
    ("vllm_treespec.verify.verifier", None, "flatten_trees"),
    ("vllm_treespec.verify.verifier", None, "committable_depths"),
    ("vllm_treespec.verify.verifier", None, "build_batch"),
    ("vllm_treespec.verify.verifier", "TreeVerifier", "_compact"),
    ("vllm_treespec.verify.verifier", None, "accept"),
    ("vllm_treespec.verify.verifier", None, "verification_results"),
    ("vllm_treespec.proposers.graft.sources", "RetrievalSources", "after_path"),
    ("vllm_treespec.retrieval.store", "SuffixRetriever", "retrieve"),
    ("vllm_treespec.retrieval.ngram", "NgramRetriever", "retrieve"),
    ("vllm_treespec.verify.verifier", None, "target_topk"),
    ("vllm_treespec.verify.verifier", None, "read_logits"),
    ("vllm_treespec.verify.verifier", None, "argmax_rows"),
    ("vllm_treespec.verify.verifier", None, "chains_the_verifier_accepts"),
)


class StepTimers:
    """Per-process totals (seconds and calls per function key) and the wrappers that add to them. ``on_forward``
    (in process): called with (tokens, seconds) of each model forward. ``sink``: a file a snapshot of the totals is
    appended to at most every ``SNAPSHOT_SECONDS`` (a server's processes). ``entries``: what to time (as
    :data:`TIMED`)."""

    def __init__(self, on_forward=None, sink: IO[str] | None = None,
                 entries: Iterable[tuple[str, str | None, str]] = TIMED) -> None:
        self.entries = tuple(entries)
        self.totals: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self.on_forward = on_forward
        self.sink = sink
        self._wrapped: set[tuple[str, str | None, str]] = set()
        self._last_snapshot = 0.0
        self._gc_started: float | None = None
        #: per function, calls by :func:`duration_bucket` of their time: whether a dear function is dear at every call
        #: or at a few
        self.durations: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        #: per function of :data:`OFF_CPU_TIMED`: [seconds off a CPU, involuntary context switches]
        self.off_cpu: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])

    def install(self) -> None:
        """Wrap every function of :data:`TIMED` not wrapped yet (idempotent), and time the garbage collector's
        collections (``gc.generation0`` to ``2``: a pause lands in whatever function allocated, so a process that
        keeps more Python objects shows its collections as time in other functions). This project's modules are
        wrapped only once imported: a server process that does not use them (no speculation's) does not import them
        for a timer."""
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)
        for entry in self.entries:
            if entry in self._wrapped:
                continue
            module_name, class_name, name = entry
            if module_name.startswith("vllm_treespec.") and module_name not in sys.modules:
                continue
            try:
                module = importlib.import_module(module_name)
                owner = module if class_name is None else getattr(module, class_name)
            except (ImportError, AttributeError):
                continue
            original = owner.__dict__.get(name) if class_name is not None else getattr(owner, name, None)
            if original is None:
                continue
            self._wrapped.add(entry)
            setattr(owner, name, self._timed(original, f"{class_name or module_name.rsplit('.', 1)[-1]}.{name}"))

    def _timed(self, original, key: str):
        record = self._recorder(key)
        if key in OFF_CPU_TIMED:
            off_cpu = self.off_cpu[key]

            @functools.wraps(original)
            def timed_off_cpu(*args, **kwargs):
                # the thread's CPU clock is exact; getrusage's CPU times advance only at the scheduler's ticks, its
                # switch counts are exact
                switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
                cpu = time.thread_time()
                started = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    seconds = time.perf_counter() - started
                    off_cpu[0] += max(seconds - (time.thread_time() - cpu), 0.0)
                    off_cpu[1] += resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw - switches
                    record(seconds, args, kwargs)

            return timed_off_cpu

        @functools.wraps(original)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                record(time.perf_counter() - started, args, kwargs)

        return timed

    def _recorder(self, key: str):
        """What every timed call of ``key`` does once it returned: add its time and call (and a forward's tokens to
        ``on_forward``), and write a snapshot when one is due."""
        totals, calls = self.totals, self.calls
        durations = self.durations[key]
        forward = key == "GPUModelRunner._model_forward" and self.on_forward is not None

        def record(seconds: float, args, kwargs) -> None:
            totals[key] += seconds
            calls[key] += 1
            durations[duration_bucket(seconds)] += 1
            if forward:
                ids = kwargs.get("input_ids", args[1] if len(args) > 1 else None)
                self.on_forward(int(ids.shape[0]) if ids is not None else -1, seconds)
            if self.sink is not None:
                self._maybe_snapshot()

        return record

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            key = f"gc.generation{info.get('generation', '?')}"
            self.totals[key] += time.perf_counter() - self._gc_started
            self.calls[key] += 1
            self._gc_started = None

    def uninstall_gc(self) -> None:
        """Stop timing collections (tests; a server's timers live as long as its process)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _maybe_snapshot(self) -> None:
        now = time.time()
        if now - self._last_snapshot < SNAPSHOT_SECONDS:
            return
        self._last_snapshot = now
        self.install()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # pages first touched: fresh allocations
        self.sink.write(json.dumps({"time": now, "seconds": self.totals, "calls": self.calls,
                                    "minor_faults": faults, "durations": self.durations,
                                    "off_cpu": self.off_cpu}) + "\n")


_installed: list[StepTimers] = []


def install_from_env() -> None:
    """The plugin's call in every process: timers with a snapshot file where ``VLLM_TREESPEC_STEP_TIMERS_FILE`` is
    set, else nothing."""
    base = os.environ.get(STEP_TIMERS_FILE_ENV)
    if not base or _installed:
        return
    # line-buffered: a server is stopped, not asked to close its files
    timers = StepTimers(sink=open(f"{base}.{os.getpid()}", "a", buffering=1))  # noqa: SIM115
    timers.install()
    _installed.append(timers)


#: the calls key under which :func:`window_totals` counts the processes' minor page faults (0 seconds)
FAULTS_KEY = "process.minor_faults"


def duration_bucket(seconds: float) -> int:
    """A call's bucket of :attr:`StepTimers.durations`: b holds calls of [2^(b-1), 2^b) microseconds (0: under one)."""
    return int(seconds * 1e6).bit_length()


class Snapshot(NamedTuple):
    """One line of a process's timer file: its running totals at ``time`` (wall clock). ``calls`` also holds the
    process's minor page faults under :data:`FAULTS_KEY`, and for each function of :data:`OFF_CPU_TIMED` its seconds
    off a CPU under ``seconds`` and ``calls`` as ``KEY + OFF_CPU_SUFFIX`` and its involuntary switches under ``calls``
    as ``KEY + SWITCHES_SUFFIX``; ``durations``: function -> bucket (a string, as JSON keeps
    it) -> calls (empty in files written before they were recorded)."""
    time: float
    seconds: dict[str, float]
    calls: dict[str, int]
    durations: dict[str, dict[str, int]]


def read_snapshots(path: Path) -> list[Snapshot]:
    """Every snapshot in one process's file (a torn line is skipped)."""
    snapshots = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
            calls = dict(record["calls"])
            seconds = dict(record["seconds"])
            if "minor_faults" in record:
                calls[FAULTS_KEY] = int(record["minor_faults"])
            for key, (off, switches) in (record.get("off_cpu") or {}).items():
                seconds[key + OFF_CPU_SUFFIX] = float(off)
                calls[key + OFF_CPU_SUFFIX] = calls.get(key, 0)
                calls[key + SWITCHES_SUFFIX] = int(switches)
            snapshots.append(Snapshot(float(record["time"]), seconds, calls, record.get("durations") or {}))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return snapshots


def _window_ends(paths: Iterable[Path], start: float, end: float) -> Iterator[tuple[Snapshot | None, Snapshot]]:
    """Per process's file with a snapshot before ``end``: (its last snapshot before ``start``, None if none; its last
    before ``end``). A window's totals are the second less the first."""
    for path in paths:
        snapshots = read_snapshots(path)
        upto = [s for s in snapshots if s.time < end]
        if upto:
            before = [s for s in upto if s.time < start]
            yield (before[-1] if before else None), upto[-1]


def window_durations(paths: Iterable[Path], key: str, start: float, end: float) -> dict[int, int]:
    """``key``'s calls over [start, end) by :func:`duration_bucket`, from every process's file (as
    :func:`window_totals`; snapshots written before durations were recorded count none)."""
    counts: dict[int, int] = collections.defaultdict(int)
    for first, last in _window_ends(paths, start, end):
        earlier = first.durations.get(key, {}) if first is not None else {}
        for bucket, n in last.durations.get(key, {}).items():
            counts[int(bucket)] += n - earlier.get(bucket, 0)
    return {bucket: n for bucket, n in sorted(counts.items()) if n}


def window_totals(paths: Iterable[Path], start: float, end: float) -> tuple[dict[str, float], dict[str, int]]:
    """Seconds and calls per function over [start, end) in every process's file: each file's last snapshot before
    ``end`` less its last before ``start`` (none: zero), summed over the files (the page faults of
    :data:`FAULTS_KEY` too)."""
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    for first, last in _window_ends(paths, start, end):
        for key, value in last.seconds.items():
            seconds[key] += value - (first.seconds.get(key, 0.0) if first is not None else 0.0)
        for key, value in last.calls.items():
            calls[key] += value - (first.calls.get(key, 0) if first is not None else 0)
    return dict(seconds), dict(calls)


def per_step(seconds: dict[str, float], calls: dict[str, int]) -> dict[str, float] | None:
    """Milliseconds per engine step of each function (the steps counted by :data:`STEP_KEY`'s calls); None without
    steps."""
    steps = calls.get(STEP_KEY, 0)
    if steps <= 0:
        return None
    return {key: value / steps * 1e3 for key, value in sorted(seconds.items(), key=lambda item: -item[1])
            if calls.get(key, 0) > 0}
