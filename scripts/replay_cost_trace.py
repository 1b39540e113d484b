"""Replay step-budget traces through this checkout's step-cost model, to compare its predictions with the ones the
traced engine made.

``vllm-treespec bench`` and ``bench serve`` write one trace per method and repeat (``budget-METHOD-rN.jsonl.PID`` in
``--out``; any run with ``VLLM_TREESPEC_BUDGET_TRACE``). Each line holds a step's tokens, requests, drafts and context
term, the forward's measured time and the time the engine's model predicted before it. (A batch-1 trace written
before lines carried drafts and the context term has them rebuilt: the prompt from the prefill step, then the
committed tokens.) The replay takes the step-cost record the traced worker kept next to its trace
(``<trace>.cost.json``), else the cached record whose curve gave the trace's first prediction (before any online
correction), and runs this checkout's :class:`StepCostModel` over the steps: predict, then observe the measured
time, as the engine does. Printed per trace: the median of predicted / measured - 1 over plain steps and over steps
verifying drafts, and the median absolute error, as traced and as replayed; then the medians over traces. An older
trace without its record, whose cached record an engine has since re-measured (its start-up spot check replaces a
cached curve that no longer fits), matches no record and is skipped.

    python scripts/replay_cost_trace.py OUT_DIR/budget-*.jsonl.* [--by-requests] [--by-context] [--record CURVE.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from pathlib import Path
from typing import NamedTuple

import msgspec

from vllm_treespec.cost import trace
from vllm_treespec.cost.model import CACHE_SUBDIR, CostRecord, StepCostModel, context_excess
from vllm_treespec.cost.online import WARMUP_SAMPLES
from vllm_treespec.settings import default_cache_dir

#: a prefill step has more tokens than this or more than its drafts plus one
PREFILL_TOKENS = 40
#: the first prediction of a trace must match a cached record's curve this closely to replay with it
MATCH_TOLERANCE = 1e-4


class Step(NamedTuple):
    """A traced forward, as the budget priced it: ``excess`` is the context term's E (None: computed from the
    sequence's end, ``seq_end``, for a batch-1 trace written before traces carried it)."""
    line: dict
    tokens: int
    reqs: int
    drafts: int
    excess: float | None
    seq_end: int = 0


def traced_steps(path: str) -> list[Step] | None:
    """The steps of a trace: as traced where its lines carry each step's draft count (and context term), else
    rebuilt for a batch-1 trace; None for an older batched trace (the context term needs every request's length,
    which it does not keep)."""
    lines = [json.loads(line) for line in open(path)]
    timed = [s for s in lines if s.get("reqs", 0) > 0]
    if timed and all("drafts" in s for s in timed):
        return [Step(s, s["tokens"], s["reqs"], s["drafts"], s.get("excess", 0.0)) for s in timed]
    if any(s.get("reqs", 0) > 1 for s in lines):
        return None
    steps, length = [], 0
    for s in timed:
        tokens, drafts = s["tokens"], s.get("admitted", 0)
        if tokens > PREFILL_TOKENS or tokens > drafts + 1:  # a prompt (whole, or its last chunk)
            length = tokens
            steps.append(Step(s, tokens, 1, 0, None, length))
            continue
        steps.append(Step(s, tokens, 1, drafts, None, length + tokens))
        length += 1 + s.get("accepted", 0)
    return steps


def excess_of(model: StepCostModel, step: Step) -> float:
    """The step's context term, as the verifier hands it to the budget (0 where the model prices no context)."""
    if not model.per_context:
        return 0.0
    return step.excess if step.excess is not None else context_excess(step.tokens, step.seq_end,
                                                                      model.reference_context)


def request_excess_of(step: Step) -> float | None:
    """The step's E_R as traced (None for a trace written before lines carried it: the model takes E * R / T)."""
    return step.line.get("request_excess")


def predicted_ms(model: StepCostModel, step: Step) -> float:
    """The model's prediction of a step, as the budget makes it before the step's forward."""
    return model.predict(step.tokens, step.reqs, excess_of(model, step), plain_tokens=step.tokens - step.drafts,
                         request_excess=request_excess_of(step)) * 1e3


def timed(steps: list[Step]) -> list[Step]:
    """The steps whose forward was timed: the ones :func:`replay` predicts and learns from."""
    return [step for step in steps if step.line.get("forward_ms")]


def replay(model: StepCostModel, steps: list[Step]) -> list[tuple[float, float | None, float, bool]]:
    """(replayed ms, traced ms, measured ms, verifying) per timed step. As in the engine (``StepBudget``), the first
    steps that verify drafts (``WARMUP_SAMPLES``: their kernels compile) are predicted but not learnt from."""
    out = []
    warmup = WARMUP_SAMPLES
    for step in timed(steps):
        measured = step.line["forward_ms"]
        out.append((predicted_ms(model, step), step.line.get("predicted_ms"), measured, step.drafts > 0))
        if step.drafts > 0 and warmup > 0:
            warmup -= 1
            continue
        model.observe(step.tokens, step.reqs, measured / 1e3, excess_of(model, step), drafts=step.drafts,
                      request_excess=request_excess_of(step))
    return out


def record_for(steps: list[Step], records: dict[str, CostRecord], path: str | None = None) -> CostRecord | None:
    """The record the trace's worker kept next to it (:func:`vllm_treespec.cost.trace.record_file`), else the cached
    record whose uncorrected curve made the trace's first prediction."""
    kept = trace.record_file(path) if path is not None else None
    if kept is not None and kept.exists():
        return msgspec.json.decode(kept.read_bytes(), type=CostRecord)
    first = next((step for step in steps if step.line.get("predicted_ms")), None)
    if first is None:
        return None
    for record in records.values():
        if abs(predicted_ms(record.step_model(), first) / first.line["predicted_ms"] - 1) < MATCH_TOLERANCE:
            return record
    return None


def errors(rows: list[tuple[float, float, bool]]) -> tuple[float | None, float | None, float | None]:
    """(plain, verifying, absolute) median errors of (predicted ms, measured ms, verifying) rows."""
    def median(values):
        return statistics.median(values) if values else None

    relative = [(p / m - 1, v) for p, m, v in rows]
    return (median([e for e, v in relative if not v]), median([e for e, v in relative if v]),
            median([abs(e) for e, _ in relative]))


#: request ranges of --by-requests: what bench serve's levels of 2, 4, 8 and 16 requests fill
REQUEST_RANGES = ((1, 2), (3, 4), (5, 8), (9, 16), (17, 1 << 30))


def by_requests(steps: list[Step], rows: list[tuple[float, float | None, float, bool]],
                pooled: dict[str, list[tuple[float, float | None, float]]] | None = None) -> str:
    """Median errors (traced / replayed) over the verifying steps of each range of requests, steps in brackets
    (``rows``: :func:`replay`'s, one per :func:`timed` step); each range's steps are also added to ``pooled``."""
    return _by_ranges(steps, rows, lambda step: step.reqs, REQUEST_RANGES, pooled)


#: ranges of --by-context: a step's context term per row (positions beyond the curve's context, on average)
CONTEXT_RANGES = ((-(1 << 30), -1), (0, 199), (200, 399), (400, 799), (800, 1 << 30))


def by_context(model: StepCostModel, steps: list[Step], rows: list[tuple[float, float | None, float, bool]],
               pooled: dict[str, list[tuple[float, float | None, float]]] | None = None) -> str:
    """As :func:`by_requests`, by the step's context term per row (:func:`excess_of` over its tokens): a model whose
    context slope misfits prices long-context steps off in one direction and short ones in the other."""
    return _by_ranges(steps, rows, lambda step: excess_of(model, step) / step.tokens, CONTEXT_RANGES, pooled)


def _range_name(low: int, high: int) -> str:
    return f"{low}+" if high >= 1 << 30 else f"<{high + 1}" if low <= -(1 << 30) else f"{low}-{high}"


def _by_ranges(steps: list[Step], rows: list[tuple[float, float | None, float, bool]], value,
               ranges: tuple[tuple[int, int], ...],
               pooled: dict[str, list[tuple[float, float | None, float]]] | None = None) -> str:
    picked_by_range = {}
    for low, high in ranges:
        picked = [(r, t, m) for step, (r, t, m, v) in zip(timed(steps), rows) if v and low <= value(step) < high + 1]
        if picked:
            name = _range_name(low, high)
            picked_by_range[name] = picked
            if pooled is not None:
                pooled.setdefault(name, []).extend(picked)
    return ranges_summary(picked_by_range)


def ranges_summary(picked_by_range: dict[str, list[tuple[float, float | None, float]]]) -> str:
    """Per range: its traced / replayed median error and its steps in brackets, from (replayed, traced, measured) ms."""
    parts = []
    for name, picked in picked_by_range.items():
        traced = statistics.median(t / m - 1 for _, t, m in picked) if all(t for _, t, _ in picked) else None
        replayed = statistics.median(r / m - 1 for r, _, m in picked)
        parts.append(f"{name}: {percent(traced).strip()} / {percent(replayed).strip()} ({len(picked)})")
    return ", ".join(parts) or "none"


def percent(value: float | None) -> str:
    return "   -  " if value is None else f"{100 * value:+5.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", help="budget trace files (globs are expanded)")
    parser.add_argument("--cache", default=str(default_cache_dir() / CACHE_SUBDIR),
                        help="the step-cost cache the traced engines read (default: this user's)")
    parser.add_argument("--record", default=None,
                        help="replay every trace on this record's curve instead of its engine's (a curve measured "
                             "again, say: vllm-treespec cost-model writes the cache)")
    parser.add_argument("--by-requests", action="store_true",
                        help="also print each trace's median error over its verifying steps by requests in the step")
    parser.add_argument("--by-context", action="store_true",
                        help="also print each trace's median error over its verifying steps by their context per "
                             "row (positions beyond the curve's context)")
    args = parser.parse_args()
    records = {str(p): msgspec.json.decode(p.read_bytes(), type=CostRecord) for p in Path(args.cache).glob("*.json")}
    forced = msgspec.json.decode(Path(args.record).read_bytes(), type=CostRecord) if args.record else None
    paths = sorted({p for pattern in args.traces for p in (glob.glob(pattern) or [pattern])
                    if not p.endswith(trace.RECORD_SUFFIX)})
    traced_all, replayed_all = [], []
    pooled_requests: dict[str, list[tuple[float, float | None, float]]] = {}
    pooled_context: dict[str, list[tuple[float, float | None, float]]] = {}
    print(f"{'trace':44} {'traced: plain / verifying / |all|':>36}   {'replayed: plain / verifying / |all|':>38}")
    for path in paths:
        steps = traced_steps(path)
        record = (forced or record_for(steps, records, path)) if steps else None
        if record is None:
            print(f"{path[-44:]:44} skipped: {'batched steps' if steps is None else 'no cached record made it'}")
            continue
        model = record.step_model()
        rows = replay(model, steps)
        traced = errors([(t, m, v) for _, t, m, v in rows if t])
        replayed = errors([(r, m, v) for r, _, m, v in rows])
        traced_all.append(traced)
        replayed_all.append(replayed)
        print(f"{path[-44:]:44} {'  /  '.join(percent(e) for e in traced):>36}   "
              f"{'  /  '.join(percent(e) for e in replayed):>38}")
        if args.by_requests:
            print("    verifying steps by requests, traced / replayed: " + by_requests(steps, rows, pooled_requests))
        if args.by_context:
            print("    verifying steps by context per row, traced / replayed: "
                  + by_context(model, steps, rows, pooled_context))
    if not traced_all:
        return
    # a served level's 5-8 and 9-16 request buckets see a few dozen verifying steps a trace: pooled over the traces
    # (rounds of one slice), each bucket's median error rests on more than one round's handful
    if args.by_requests and len(traced_all) > 1:
        print(f"all {len(traced_all)} traces, verifying steps by requests, traced / replayed: "
              + ranges_summary(pooled_requests))
    if args.by_context and len(traced_all) > 1:
        print(f"all {len(traced_all)} traces, verifying steps by context per row, traced / replayed: "
              + ranges_summary(pooled_context))
    for name, results in (("traced", traced_all), ("replayed", replayed_all)):
        verifying = [abs(r[1]) for r in results if r[1] is not None]
        plain = [abs(r[0]) for r in results if r[0] is not None]
        print(f"{name:8} over {len(results)} traces: median |bias| plain {100 * statistics.median(plain):.1f}%, "
              f"verifying {100 * statistics.median(verifying):.1f}%; traces with a bias over 10%: plain "
              f"{sum(b > 0.1 for b in plain)}, verifying {sum(b > 0.1 for b in verifying)}; median |error| "
              f"{100 * statistics.median(r[2] for r in results):.1f}%")


if __name__ == "__main__":
    main()
