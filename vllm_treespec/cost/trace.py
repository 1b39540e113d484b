"""A per-step record of the budget's decisions, for finding out why a server drafts (or does not) under load.

Set ``VLLM_TREESPEC_BUDGET_TRACE=/path/trace.jsonl`` in the server's environment: every worker with a step budget
appends one JSON line per engine step (``.<pid>`` is added to the name, so several workers never share a file):

    t          wall-clock seconds at the forward's start (``time.time()``, to align with a client's clock)
    reqs       requests in the step;  tokens: tokens in the forward;  forward_ms: its measured time
    predicted_ms  the step-cost model's prediction of that forward, before its time refined the model
    host_ms    the host time per step the budget charges (a running median)
    gate       "draft", "probe" or "skip" (the drafter gate's decision), "plain" (a plain step that measures the plain
               step drafts are priced against, StepBudget.needs_plain_sample), "glance" (a skipped step whose
               proposer's glance offered trees, TreeProposer.glance), absent when the gate was not asked
    glance_ms  a skipped step's glance, when the proposer was asked for one
    best, plain  the gate's predicted rates (tokens/s) with drafting and without, when it decided on them
    surplus_ms what the drafted steps' allocations saved lately, per step, from the drafts the target accepted (the
               gate drafts while it beats drafter_ms)
    admitted   draft nodes the allocator kept;  expected: tokens it expected of the step (plain ones included)
    offered    draft nodes the proposer's trees offered it (each tree counted up to the per-request cap), and
               offered_depth their deepest level: with admitted, whether the trees or the prices limited a step
    useful_nodes  the cap on a tree's size the proposer was asked to respect (``ProposeContext.useful_nodes``), when
               there was one
    drafter_ms the proposer's call with the pricing of its trees, when it drafted, less head_ms
    tree_ms    the verifier's host work of a step that verified trees (attach, acceptance, KV compaction); with what
               else the step ran beyond a plain step's host time, the budget's tree work, priced by the requests a
               step drafts for (:class:`~vllm_treespec.cost.online.RequestsMedian`)
    head_ms    the part of that call a proposer's own gate priced (graft's head, ``ProposeContext.self_gated_seconds``),
               when there was one
    excess     the step's context term E (rows times their sequence lengths beyond the sweep's context), when the
               model prices context: with ``tokens``, ``reqs`` and ``drafts`` what a replay of the model needs
               (``scripts/replay_cost_trace.py``)
    request_excess  its E_R (its requests' sequence lengths beyond the sweep's context, each once), likewise
    drafts     draft tokens the forward verified (vLLM's scheduled drafts: a tree's admitted nodes, or a chain's)
    factor     the acceptance tracker's expectation correction;  accepted: drafts the step accepted (tree or chain)
    learned, unverified  nodes the step's committed tokens taught the acceptance calibration: verified nodes whose
               parent was accepted, and proposed nodes the budget left out, children of the last accepted node
               (:class:`~vllm_treespec.verify.calibration.AcceptanceTracker`), when it taught any

A step's ``drafter_ms`` and ``head_ms`` ran before its forward, after the previous step's: the gap between two step
starts is the first's forward, host time and the second's drafter call, and what is left is work nobody priced
(:func:`unpriced_before_drafts`).

:func:`summarize` condenses the lines of a time window (one load level of ``bench serve``). Tracing costs a dict and
a write per step; it is off unless the variable is set.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path
from typing import IO, Any, Iterable

import msgspec

logger = logging.getLogger("vllm.treespec")

TRACE_ENV = "VLLM_TREESPEC_BUDGET_TRACE"

_encoder = msgspec.json.Encoder()


class BudgetTrace:
    """One line per step. What the proposer's call decides (gate, admitted nodes) is for the *next* forward
    (:meth:`plan`); what the sampler learns (forward time, accepted drafts) is the current one's (:meth:`note`)."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.path: Path | None = None  # the file, when opened by from_env
        self.current: dict[str, Any] | None = None
        self.planned: dict[str, Any] = {}

    @classmethod
    def from_env(cls) -> BudgetTrace | None:
        path = os.environ.get(TRACE_ENV)
        if not path:
            return None
        target = Path(f"{path}.{os.getpid()}")
        target.parent.mkdir(parents=True, exist_ok=True)
        trace = cls(open(target, "ab"))  # noqa: SIM115 - lives as long as the worker
        trace.path = target
        return trace

    def keep_record(self, record: Any) -> None:
        """Write the step-cost record the worker's model was fitted on next to the trace (:func:`record_file`); a
        failure costs a replay its curve, never the engine its budget (one log line)."""
        if self.path is None:
            return
        try:
            record_file(self.path).write_bytes(msgspec.json.encode(record))
        except OSError as error:
            logger.warning("vllm_treespec: cannot keep the step-cost record beside the trace %s (%s)", self.path, error)

    def note(self, **fields: Any) -> None:
        """Fields of the step whose forward started last."""
        if self.current is not None:
            self.current.update(fields)

    def plan(self, **fields: Any) -> None:
        """Fields of the next step (decided after this one's sampling)."""
        self.planned.update(fields)

    def step(self, reqs: int, tokens: int) -> None:
        """A forward starts: write the previous step's line, begin this one's."""
        self._write()
        self.current = {"t": time.time(), "reqs": reqs, "tokens": tokens, **self.planned}
        self.planned = {}

    def _write(self) -> None:
        if self.current is not None:
            self.stream.write(_encoder.encode(self.current) + b"\n")
            self.stream.flush()  # a worker is often killed, not closed; a step is tens of ms, a write microseconds
            self.current = None

    def close(self) -> None:
        self._write()
        self.stream.flush()


#: next to each worker's trace file, the step-cost record its model was fitted on (a later engine's start-up check
#: may measure the cached curve again and replace it, and a replay needs the curve the trace's predictions came from)
RECORD_SUFFIX = ".cost.json"


def files(base: Path) -> list[Path]:
    """The files the workers wrote for the trace path ``base`` (one per worker: ``base.<pid>``)."""
    return sorted(p for p in Path(base).parent.glob(f"{Path(base).name}.*") if not p.name.endswith(RECORD_SUFFIX))


def record_file(trace_file: Path | str) -> Path:
    """Where the worker that wrote ``trace_file`` keeps its step-cost record."""
    return Path(f"{trace_file}{RECORD_SUFFIX}")


def clear(base: Path) -> None:
    """Remove an earlier run's files for ``base`` (workers append), their records too."""
    for path in files(base):
        path.unlink()
        record_file(path).unlink(missing_ok=True)


def verifying_share(summary: dict[str, Any] | None) -> float | None:
    """The share of a :func:`summarize` window's steps that verified drafts; None without steps."""
    if not summary or not summary.get("steps"):
        return None
    return summary["verifying_steps"] / summary["steps"]


def read(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every line of the trace files, in time order (a torn last line is skipped)."""
    lines = []
    for path in paths:
        for raw in Path(path).read_bytes().splitlines():
            try:
                lines.append(msgspec.json.decode(raw))
            except msgspec.DecodeError:
                continue
    return sorted(lines, key=lambda line: line.get("t", 0.0))


def summarize(lines: list[dict[str, Any]], start: float | None = None, end: float | None = None) -> dict[str, Any]:
    """The steps between ``start`` and ``end`` (wall-clock): how many, the share that drafted and probed, admitted
    nodes and accepted drafts per verifying step, nodes the trees offered per step whose trees were priced, the
    nodes the calibration learnt (verified, and left out of the budget), mean expectation factor and forward
    time."""
    steps = [s for s in lines if (start is None or s["t"] >= start) and (end is None or s["t"] <= end)
             and s.get("reqs", 0) > 0]
    if not steps:
        return {"steps": 0}
    asked = [s for s in steps if "gate" in s]
    verifying = [s for s in steps if s.get("admitted", 0) > 0]
    offering = [s for s in steps if "offered" in s]
    factors = [s["factor"] for s in steps if "factor" in s]
    return {
        "steps": len(steps),
        "mean_reqs": sum(s["reqs"] for s in steps) / len(steps),
        "gate_asked": len(asked),
        "drafted": sum(s["gate"] in ("draft", "probe") for s in asked),
        "probes": sum(s["gate"] == "probe" for s in asked),
        "plain_samples": sum(s["gate"] == "plain" for s in asked),
        "verifying_steps": len(verifying),
        "admitted_per_verifying_step": sum(s["admitted"] for s in verifying) / max(len(verifying), 1),
        "accepted_per_verifying_step": sum(s.get("accepted", 0) for s in verifying) / max(len(verifying), 1),
        "offering_steps": len(offering),
        "offered_per_offering_step": sum(s["offered"] for s in offering) / max(len(offering), 1),
        "learned_nodes": sum(s.get("learned", 0) for s in steps),
        "unverified_nodes": sum(s.get("unverified", 0) for s in steps),
        "mean_factor": sum(factors) / len(factors) if factors else None,
        "forward_ms": sum(s.get("forward_ms", 0.0) for s in steps) / len(steps),
        "host_ms": steps[-1].get("host_ms"),
        "prediction_error": prediction_error(steps),
        "unpriced_before_drafts_ms": unpriced_before_drafts(steps),
        "own_plain": against_own_plain_steps(steps),
        "drafting_against_gate": drafting_against_gate(steps),
        "expected_vs_realized": expected_vs_realized(steps),
    }


def expected_vs_realized(steps: list[dict[str, Any]]) -> dict[str, float] | None:
    """Whether the calibrated acceptance the allocator spent was honest: over the steps that verified drafts, the
    tokens the allocation expected them to commit (plain decoding's one per request included) against those they
    committed (one per request plus the accepted drafts), as a ratio of sums; None without such steps."""
    counted = [s for s in steps if s.get("admitted", 0) > 0 and "expected" in s and "accepted" in s]
    realized = sum(s["reqs"] + s["accepted"] for s in counted)
    if not realized:
        return None
    return {"ratio": sum(s["expected"] for s in counted) / realized, "steps": len(counted)}


#: gaps between step starts longer than this are idle time (no request in flight), not a step's work
IDLE_GAP_SECONDS = 0.5


def _drafter_ms(step: dict[str, Any]) -> float:
    """The proposer's call before the step's forward (its drafter and the part its own gate priced)."""
    return step.get("drafter_ms", 0.0) + step.get("head_ms", 0.0)


def unpriced_before_drafts(steps: list[dict[str, Any]]) -> float:
    """Milliseconds, summed over the steps that drafted (gate "draft" or "probe"), of the time since the step before
    started that neither that step's forward, the drafting step's drafter call nor the host time the budget charges
    account for (nor its ``head_ms``, which the proposer's own gate priced): work before a draft that the budget did
    not price (an EAGLE head's catch-up on deferred rows, before it was priced). Gaps of idle time are left out."""
    total = 0.0
    for before, step in zip(steps, steps[1:]):
        gap = step["t"] - before["t"]
        if step.get("gate") not in ("draft", "probe") or gap > IDLE_GAP_SECONDS or "forward_ms" not in before:
            continue
        total += gap * 1e3 - before["forward_ms"] - _drafter_ms(step) - (before.get("host_ms") or 0.0)
    return total


#: plain steps of one request count a window needs before its steps of that count are weighed against them
MIN_PLAIN_REFERENCES = 3


def _drafts(step: dict[str, Any]) -> int:
    return int(step.get("drafts", step.get("admitted", 0)))


def _own_times(steps: list[dict[str, Any]]) -> Iterable[tuple[dict[str, Any], float]]:
    """Per decode step (as many tokens as requests and drafts; none before an idle gap): (its line, milliseconds of
    the step). A step's time runs from its start to the next step's, less the next step's call (made before that
    step's forward), plus its own."""
    for step, after in zip(steps, steps[1:]):
        gap = after["t"] - step["t"]
        reqs, drafts = step.get("reqs", 0), _drafts(step)
        if reqs <= 0 or gap > IDLE_GAP_SECONDS or step.get("tokens") != reqs + drafts:
            continue
        yield step, gap * 1e3 - _drafter_ms(after) - after.get("glance_ms", 0.0) + _drafter_ms(step) + \
            step.get("glance_ms", 0.0)


def decode_step_times(steps: list[dict[str, Any]]) -> list[tuple[int, int, int, float, float]]:
    """Per decode step (:func:`_own_times`): (requests, accepted drafts, drafts, milliseconds of the step, of which
    its proposer's call)."""
    return [(step["reqs"], step.get("accepted", 0) if _drafts(step) else 0, _drafts(step), ms, _drafter_ms(step))
            for step, ms in _own_times(steps)]


def drafting_against_gate(steps: list[dict[str, Any]], min_reqs: int = 1,
                          max_reqs: int | None = None) -> dict[str, dict[str, float]]:
    """Whether the steps that verified drafts paid at the gate's own prices, split by whether a drafter the proposer
    gates itself ran (``"self-gated"``: graft's head, ``head_ms``) or not (``"rest"``), over steps of ``min_reqs`` to
    ``max_reqs`` requests. Per kind: ``steps``; ``ms``, their mean own time (:func:`_own_times`); ``priced_ms``, the
    verifier's gate's price of them (``expected / best``, which leaves a self-gated drafter out); and ``vs_plain``,
    the tokens they committed over what the gate's plain rate for each (``plain``) commits in its time — below 1,
    drafting lost against the plain step the gate weighed it against (a plain rate the step-cost model predicts
    within a few percent: :func:`prediction_error`)."""
    kinds: dict[str, list[tuple[float, float, int, float]]] = {}  # own ms, priced ms, committed, plain's
    for step, ms in _own_times(steps):
        reqs = step["reqs"]
        if not _drafts(step) or not step.get("plain") or not step.get("best") or reqs < min_reqs \
                or (max_reqs is not None and reqs > max_reqs):
            continue
        committed = reqs + step.get("accepted", 0)
        kinds.setdefault("self-gated" if step.get("head_ms") else "rest", []).append(
            (ms, step["expected"] / step["best"] * 1e3, committed, step["plain"] * ms / 1e3))
    return {kind: {"steps": len(rows), "ms": statistics.fmean(r[0] for r in rows),
                   "priced_ms": statistics.fmean(r[1] for r in rows),
                   "vs_plain": sum(r[2] for r in rows) / sum(r[3] for r in rows)}
            for kind, rows in sorted(kinds.items())}


def against_own_plain_steps(steps: list[dict[str, Any]]) -> dict[str, float] | None:
    """The window's decode steps against the same server's plain steps: how much faster they committed tokens than
    its steps without drafts would have, at the same minutes (a ratio between two servers carries their speeds,
    which here differ by 10-30% between rounds, as much as what drafting changes at 4-16 requests).

    A step's time is its proposer's call, forward and host time (:func:`decode_step_times`). A step that verified
    no drafts, less its call, is what a plain step of its request count costs: their mean, so that the plain steps
    themselves read 1.0 (the median of a right-skewed spread read them at ~0.97x); counts with fewer than
    ``MIN_PLAIN_REFERENCES`` such steps are left out. A step of ``n`` requests that accepted ``a`` drafts committed
    ``(n + a) / n`` plain steps' worth of tokens; the ratio is those plain steps' time over the steps' own, summed
    over the window.

    It reads whether the steps the gate drafted paid against the steps it left plain, not a server without
    speculation: those plain steps carry the proposer's observation of each step (graft: ~1 ms), and the gate
    leaves plain the rows it prices dearest (long contexts), so where that follows the step's cost the reference is
    dear and the ratio overstates (fp32 at 2 served requests: 1.54x against its plain steps, 1.04x against no
    speculation's server). Returns ``{"ratio", "steps", "verifying_steps", "plain_steps"}``, or None without a
    plain reference."""
    timed = decode_step_times(steps)
    plain: dict[int, list[float]] = {}
    for reqs, _, drafts, ms, call in timed:
        if not drafts:
            plain.setdefault(reqs, []).append(ms - call)
    reference = {reqs: statistics.fmean(ms) for reqs, ms in plain.items() if len(ms) >= MIN_PLAIN_REFERENCES}
    counted = [(reqs, accepted, drafts, ms) for reqs, accepted, drafts, ms, _ in timed if reqs in reference]
    if not counted:
        return None
    as_plain = sum((reqs + accepted) / reqs * reference[reqs] for reqs, accepted, _, _ in counted)
    return {"ratio": as_plain / sum(ms for *_, ms in counted), "steps": len(counted),
            "verifying_steps": sum(drafts > 0 for _, _, drafts, _ in counted),
            "plain_steps": sum(len(plain[reqs]) for reqs in reference)}


def prediction_error(steps: list[dict[str, Any]]) -> dict[str, float] | None:
    """How far the step-cost model's predictions were from the forwards they predicted: the median of
    predicted / measured − 1 over the steps that verified drafts and over those that did not (None for a kind without
    steps), and the median absolute error over all; None when no step has both."""
    errors = [(s["predicted_ms"] / s["forward_ms"] - 1.0, bool(s.get("admitted")))
              for s in steps if s.get("predicted_ms") and s.get("forward_ms")]
    if not errors:
        return None

    def median(values: list[float]) -> float | None:
        return float(statistics.median(values)) if values else None

    return {"plain": median([e for e, verifying in errors if not verifying]),
            "verifying": median([e for e, verifying in errors if verifying]),
            "absolute": median([abs(e) for e, _ in errors])}
