"""Replay batch-1 step-budget traces through this checkout's step-cost model, to compare its predictions with the
ones the traced engine made.

``vllm-treespec bench`` writes one trace per method and repeat (``budget-METHOD-rN.jsonl.PID`` in ``--out``; any run
with ``VLLM_TREESPEC_BUDGET_TRACE``). Each line holds a step's tokens, drafts admitted and accepted, the forward's
measured time and the time the engine's model predicted before it. The replay rebuilds each step's context term from
the trace (the prompt from the prefill step, then the committed tokens), takes the cached cost record whose curve
gave the trace's first prediction (before any online correction), and runs this checkout's :class:`StepCostModel`
over the steps: predict, then observe the measured time, as the engine does. Printed per trace: the median of
predicted / measured - 1 over plain steps and over steps verifying drafts, and the median absolute error, as traced
and as replayed; then the medians over traces. A trace whose record an engine has since re-measured (its start-up
spot check replaces a cached curve that no longer fits) matches no record and is skipped, so a rerun can cover fewer
traces than the first.

    python scripts/replay_cost_trace.py OUT_DIR/budget-*.jsonl.*
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from pathlib import Path

import msgspec

from vllm_treespec.cost.model import CACHE_SUBDIR, CostRecord, StepCostModel, context_excess
from vllm_treespec.settings import default_cache_dir

#: a prefill step has more tokens than this or more than its drafts plus one
PREFILL_TOKENS = 40
#: the first prediction of a trace must match a cached record's curve this closely to replay with it
MATCH_TOLERANCE = 1e-4


def single_request_steps(path: str) -> list[tuple[dict, int, int, int]] | None:
    """(trace line, tokens, drafts, sequence length at the step's end) per step; None for a trace with batched
    steps (the context term needs every request's length, which the trace does not keep)."""
    lines = [json.loads(line) for line in open(path)]
    if any(s.get("reqs", 0) > 1 for s in lines):
        return None
    steps, length = [], 0
    for s in (s for s in lines if s.get("reqs", 0) == 1):
        tokens, drafts = s["tokens"], s.get("admitted", 0)
        if tokens > PREFILL_TOKENS or tokens > drafts + 1:  # a prompt (whole, or its last chunk)
            length = tokens
            steps.append((s, tokens, 0, length))
            continue
        steps.append((s, tokens, drafts, length + tokens))
        length += 1 + s.get("accepted", 0)
    return steps


def excess_of(model: StepCostModel, tokens: int, seq_end: int) -> float:
    """The step's context term, as the verifier hands it to the budget (0 where the model prices no context)."""
    return context_excess(tokens, seq_end, model.reference_context) if model.per_context else 0.0


def predicted_ms(model: StepCostModel, tokens: int, drafts: int, seq_end: int) -> float:
    """The model's prediction of a step, as the budget makes it before the step's forward."""
    return model.predict(tokens, 1, excess_of(model, tokens, seq_end), plain_tokens=tokens - drafts) * 1e3


def replay(model: StepCostModel, steps: list[tuple[dict, int, int, int]]
           ) -> list[tuple[float, float | None, float, bool]]:
    """(replayed ms, traced ms, measured ms, verifying) per timed step."""
    out = []
    for line, tokens, drafts, seq_end in steps:
        predicted = predicted_ms(model, tokens, drafts, seq_end)
        measured = line.get("forward_ms")
        if measured:
            out.append((predicted, line.get("predicted_ms"), measured, drafts > 0))
            model.observe(tokens, 1, measured / 1e3, excess_of(model, tokens, seq_end), drafts=drafts)
    return out


def record_for(steps: list[tuple[dict, int, int, int]], records: dict[str, CostRecord]) -> CostRecord | None:
    """The cached record whose uncorrected curve made the trace's first prediction."""
    first = next(((line, tokens, drafts, seq) for line, tokens, drafts, seq in steps if line.get("predicted_ms")),
                 None)
    if first is None:
        return None
    line, tokens, drafts, seq_end = first
    for record in records.values():
        if abs(predicted_ms(record.step_model(), tokens, drafts, seq_end) / line["predicted_ms"] - 1) < MATCH_TOLERANCE:
            return record
    return None


def errors(rows: list[tuple[float, float, bool]]) -> tuple[float | None, float | None, float | None]:
    """(plain, verifying, absolute) median errors of (predicted ms, measured ms, verifying) rows."""
    def median(values):
        return statistics.median(values) if values else None

    relative = [(p / m - 1, v) for p, m, v in rows]
    return (median([e for e, v in relative if not v]), median([e for e, v in relative if v]),
            median([abs(e) for e, _ in relative]))


def percent(value: float | None) -> str:
    return "   -  " if value is None else f"{100 * value:+5.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", help="budget trace files (globs are expanded)")
    parser.add_argument("--cache", default=str(default_cache_dir() / CACHE_SUBDIR),
                        help="the step-cost cache the traced engines read (default: this user's)")
    args = parser.parse_args()
    records = {str(p): msgspec.json.decode(p.read_bytes(), type=CostRecord) for p in Path(args.cache).glob("*.json")}
    paths = sorted({p for pattern in args.traces for p in (glob.glob(pattern) or [pattern])})
    traced_all, replayed_all = [], []
    print(f"{'trace':44} {'traced: plain / verifying / |all|':>36}   {'replayed: plain / verifying / |all|':>38}")
    for path in paths:
        steps = single_request_steps(path)
        record = record_for(steps, records) if steps else None
        if record is None:
            print(f"{path[-44:]:44} skipped: {'batched steps' if steps is None else 'no cached record made it'}")
            continue
        rows = replay(record.step_model(), steps)
        traced = errors([(t, m, v) for _, t, m, v in rows if t])
        replayed = errors([(r, m, v) for r, _, m, v in rows])
        traced_all.append(traced)
        replayed_all.append(replayed)
        print(f"{path[-44:]:44} {'  /  '.join(percent(e) for e in traced):>36}   "
              f"{'  /  '.join(percent(e) for e in replayed):>38}")
    if not traced_all:
        return
    for name, results in (("traced", traced_all), ("replayed", replayed_all)):
        verifying = [abs(r[1]) for r in results if r[1] is not None]
        plain = [abs(r[0]) for r in results if r[0] is not None]
        print(f"{name:8} over {len(results)} traces: median |bias| plain {100 * statistics.median(plain):.1f}%, "
              f"verifying {100 * statistics.median(verifying):.1f}%; traces with a bias over 10%: plain "
              f"{sum(b > 0.1 for b in plain)}, verifying {sum(b > 0.1 for b in verifying)}; median |error| "
              f"{100 * statistics.median(r[2] for r in results):.1f}%")


if __name__ == "__main__":
    main()
