"""scripts/replay_cost_trace.py on made-up traces: it rebuilds a batch-1 trace's context (or reads a batched trace's),
finds the cached record that made the trace's first prediction, and replays the engine's predict-then-observe loop
exactly."""

from __future__ import annotations

import json

import msgspec
import pytest
from script_helpers import load_script

from vllm_treespec.cost import trace
from vllm_treespec.cost.model import FORMAT_VERSION, CostKey, CostRecord, StepSample, context_excess

KEY = CostKey(model="/models/smollm2", dtype="float32", device="AMD EPYC 7B13", vllm_version="0.32.0+cpu",
              torch_threads=1)


def record(scale: float) -> CostRecord:
    samples = [StepSample(t, 1, scale * (0.04 + 0.002 * t), context_len=c) for t in (1, 2, 4, 8, 16, 32, 64)
               for c in (0, 2048)]
    return CostRecord(format_version=FORMAT_VERSION, key=KEY, samples=samples, drafters={}, measured_at=1.0)


def traced(rec: CostRecord, slowdown: float) -> list[dict]:
    """An engine's trace: a 100-token prompt, then steps verifying 5 drafts (2 accepted) and plain steps, each
    forward ``slowdown`` times the curve, each prediction made as the engine makes it. The first verifying step
    takes six times as long (its kernels compile) and, as in the engine, is not learnt from."""
    model = rec.step_model()
    lines, length, compiled = [], 0, False
    for tokens, admitted, accepted in [(100, 0, 0)] + [(6, 5, 2), (1, 0, 0)] * 20:
        seq_end = tokens if admitted == 0 and tokens > 1 else length + tokens
        excess = context_excess(tokens, seq_end, model.reference_context)
        predicted = model.predict(tokens, 1, excess, plain_tokens=tokens - admitted)
        measured = slowdown * float(model.base(tokens, 1, excess))
        if admitted and not compiled:
            measured *= 6.0
        line = {"reqs": 1, "tokens": tokens, "predicted_ms": predicted * 1e3, "forward_ms": measured * 1e3}
        if admitted:
            line.update(admitted=admitted, accepted=accepted)
        lines.append(line)
        if admitted and not compiled:
            compiled = True
        else:
            model.observe(tokens, 1, measured, excess, drafts=admitted)
        length = seq_end if tokens > 1 and not admitted else length + 1 + accepted
    return lines


def test_the_replay_finds_the_record_and_reproduces_the_engines_predictions(tmp_path):
    script = load_script("replay_cost_trace")
    used, other = record(1.0), record(1.5)
    trace = tmp_path / "budget-graft-r1.jsonl.1"
    trace.write_text("".join(json.dumps(line) + "\n" for line in traced(used, 1.2)))
    steps = script.traced_steps(str(trace))
    # the prompt; then each step ends at the positions computed so far (+ 1 + accepted per step) plus its rows
    assert [step.seq_end for step in steps[:5]] == [100, 106, 104, 110, 108]
    records = {"other": other, "used": used}
    assert script.record_for(steps, records) is used
    rows = script.replay(used.step_model(), steps)
    assert [r for r, *_ in rows] == pytest.approx([t for _, t, *_ in rows], rel=1e-9)
    plain, verifying, absolute = script.errors([(r, m, v) for r, _, m, v in rows])
    # the correction follows a 20% slowdown (uncorrected, every prediction would be 1 / 1.2 - 1 = -17% off)
    assert abs(plain) < 0.05 and abs(verifying) < 0.05 and absolute < 0.1


def test_a_batched_trace_replays_from_its_own_draft_counts_and_context_terms(tmp_path):
    """Lines that carry each step's drafts and context term (as the budget writes them) replay as traced, whatever
    the batch; a batched trace written before they did is skipped."""
    script = load_script("replay_cost_trace")
    used = record(1.0)
    model = used.step_model()
    lines = []
    for j in range(30):
        reqs, drafts = 8, (5 if j % 3 else 0)
        tokens, excess = reqs + drafts, float(reqs * 1500 + 40 * j)
        predicted = model.predict(tokens, reqs, excess, plain_tokens=tokens - drafts)
        measured = (1.3 if drafts else 1.1) * float(model.base(tokens, reqs, excess))
        lines.append({"reqs": reqs, "tokens": tokens, "drafts": drafts, "excess": excess,
                      "predicted_ms": predicted * 1e3, "forward_ms": measured * 1e3})
        if j != 1:  # the first verifying step is not learnt from
            model.observe(tokens, reqs, measured, excess, drafts=drafts)
    trace_path = tmp_path / "budget-graft-r1.jsonl.2"
    trace_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    steps = script.traced_steps(str(trace_path))
    assert [(s.reqs, s.drafts, s.excess) for s in steps[:2]] == [(8, 0, 12000.0), (8, 5, 12040.0)]
    assert script.record_for(steps, {"other": record(1.5), "used": used}) is used
    # the record the worker kept beside its trace is taken first, whatever the cache holds now
    trace.record_file(trace_path).write_bytes(msgspec.json.encode(used))
    assert script.record_for(steps, {"other": record(1.5)}, str(trace_path)) == used
    rows = script.replay(used.step_model(), steps)
    assert len(rows) == 30
    assert [r for r, *_ in rows] == pytest.approx([t for _, t, *_ in rows], rel=1e-9)
    old = tmp_path / "budget-graft-r1.jsonl.1"
    old.write_text(json.dumps({"reqs": 2, "tokens": 2}) + "\n")
    assert script.traced_steps(str(old)) is None


def test_by_context_splits_verifying_steps_by_their_context_per_row(tmp_path):
    """``--by-context``: verifying steps whose rows reach far beyond the curve's context, measured 20% slower than
    the model prices them, read low in their range and nowhere else; plain steps are left out."""
    script = load_script("replay_cost_trace")
    model = record(1.0).step_model()
    model.per_context = 1e-6  # seconds per row and position beyond the curve's context
    model.observe = lambda *args, **kwargs: None  # priced as traced: no online correction in between
    lines = []
    for j in range(40):
        reqs, drafts = 8, (5 if j % 2 else 0)
        tokens = reqs + drafts
        per_row = 1000.0 if j >= 20 else 100.0  # positions a row beyond the curve's context, on average
        excess = per_row * tokens
        predicted = 1e3 * model.predict(tokens, reqs, excess, plain_tokens=reqs)
        slow = 1.2 if drafts and j >= 20 else 1.0
        lines.append({"reqs": reqs, "tokens": tokens, "drafts": drafts, "excess": excess,
                      "predicted_ms": predicted, "forward_ms": slow * predicted})
    path = tmp_path / "budget-graft-r1.jsonl.3"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    steps = script.traced_steps(str(path))
    rows = script.replay(model, steps)
    assert script.by_context(model, steps, rows) == "0-199: +0.0% / +0.0% (10), 800+: -16.7% / -16.7% (10)"
    # pooled over traces (the rounds of one slice): each range's median over all their steps
    pooled = {}
    script.by_context(model, steps, rows, pooled)
    script.by_context(model, steps[:20], rows[:20], pooled)
    assert script.ranges_summary(pooled) == "0-199: +0.0% / +0.0% (20), 800+: -16.7% / -16.7% (10)"


def test_the_replay_prices_each_sequence_once_as_the_engine_did(tmp_path):
    """Where the model prices a request's sequence apart from its rows, a batched line's ``request_excess`` (each
    sequence's positions beyond the curve's context, once) is what the engine priced with: the replay reads it and
    reproduces the traced predictions; without it the replay takes ``E * R / T``, another price when the requests'
    lengths differ."""
    script = load_script("replay_cost_trace")
    model = record(1.0).step_model()
    model.per_context, model.per_request_context = 1e-6, 5e-6
    model.observe = lambda *args, **kwargs: None
    lines = []
    for j in range(6):
        rows, lengths = [1, 6, 1, 4], [3000.0, 200.0, 900.0, 100.0]  # a long request drafting nothing
        excess = context_excess(rows, lengths, model.reference_context)
        request_excess = context_excess(1, lengths, model.reference_context)
        tokens, drafts = sum(rows), sum(rows) - len(rows)
        predicted = 1e3 * model.predict(tokens, 4, excess, plain_tokens=4, request_excess=request_excess)
        lines.append({"reqs": 4, "tokens": tokens, "drafts": drafts, "excess": excess,
                      "request_excess": request_excess, "predicted_ms": predicted, "forward_ms": predicted})
    path = tmp_path / "budget-graft-r1.jsonl.4"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = script.replay(model, script.traced_steps(str(path)))
    assert all(replayed == pytest.approx(traced, rel=1e-12) for replayed, traced, _, _ in rows)
    for line in lines:
        del line["request_excess"]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = script.replay(model, script.traced_steps(str(path)))
    assert all(replayed < 0.95 * traced for replayed, traced, _, _ in rows)
