"""The budget trace (``VLLM_TREESPEC_BUDGET_TRACE``): one line per engine step, with what the proposer's call decided
for that step (gate, admitted nodes) and what its verification measured (forward time, accepted drafts); summaries
per time window; off when the variable is unset."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest
import torch
from fake_runner import FakeProposer, FakeRequest, fake_runner, recording_layer, schedule

from vllm_treespec.api import DraftTree
from vllm_treespec.attn import plan
from vllm_treespec.cost import trace
from vllm_treespec.cost.budget import StepBudget
from vllm_treespec.cost.model import PiecewiseLinear, StepCostModel
from vllm_treespec.verify.verifier import TreeVerifier

SCORED = DraftTree(np.array([10, 11, 12, 13]), np.array([-1, -1, 0, 0], np.int32),
                   np.array([0.9, 0.05, 0.8, 0.1], np.float32))


@pytest.fixture(autouse=True)
def no_published_batch():
    yield
    plan.publish(None)


def flat_budget(max_nodes=8):
    tokens = np.arange(1, 40)
    return StepBudget(StepCostModel(PiecewiseLinear(tokens, np.full(tokens.shape, 0.05))), max_nodes)


def test_no_trace_unless_the_variable_is_set(monkeypatch):
    monkeypatch.delenv(trace.TRACE_ENV, raising=False)
    assert flat_budget().trace is None


def test_decisions_land_on_the_step_that_verifies_them(monkeypatch, tmp_path):
    monkeypatch.setenv(trace.TRACE_ENV, str(tmp_path / "budget.jsonl"))
    monkeypatch.setattr("vllm_treespec.cost.budget.PLAIN_SAMPLES", 0)  # the gate decides every step (not measured
    # plain steps: test_cost_wiring.py)
    runner = fake_runner([FakeRequest("a", [1, 2, 3, 4, 9], [3, 0])], 8)
    proposer = FakeProposer({"a": SCORED})
    trees_of = proposer.propose_trees

    def with_a_self_gated_head(ctx):
        ctx.self_gated_seconds = 0.002  # graft's head: 2 ms of the call its own gate priced
        return trees_of(ctx)

    proposer.propose_trees = with_a_self_gated_head
    verifier = TreeVerifier(runner, proposer)
    verifier._layers = [recording_layer()]
    verifier.budget = flat_budget()
    assert verifier.budget.trace is not None
    drafts = verifier.propose([[9]])  # the first call: no history, so the gate probes; on a flat curve all 4 pay
    for _ in range(2):
        scheduler_output, num_scheduled = schedule(runner, {"a": drafts[0]})
        verifier.attach(scheduler_output, num_scheduled)
        verifier.sample(lambda logits, metadata: "vllm's", torch.zeros(int(num_scheduled.sum()), 8), None)
        drafts = verifier.propose([[9]])
    verifier.budget.trace.close()
    (path,) = tmp_path.glob("budget.jsonl.*")
    lines = trace.read([path])
    assert len(lines) == 2
    first = lines[0]
    assert first["gate"] == "probe" and first["admitted"] == 4 and first["tokens"] == 5 and first["reqs"] == 1
    assert first["offered"] == 4 and first["offered_depth"] == int(SCORED.depths().max())
    assert "useful_nodes" not in first  # a probe drafts in full; the next step's tree is capped by what it admitted
    assert lines[1]["useful_nodes"] == 2 * 4 + 1
    assert first["factor"] == pytest.approx(1.0) and first["forward_ms"] >= 0.0
    assert first["predicted_ms"] == pytest.approx(50.0)  # the flat 50 ms curve, before the step refined it
    assert first["accepted"] == 0  # the step committed only the target's token
    # its two root children were verified and rejected (the calibration learnt 2 nodes); their children were not
    # reached, and no root child was left out
    assert first["learned"] == 2 and "unverified" not in first
    assert first["drafts"] == 4 and "excess" not in first  # this model prices no context
    assert first["head_ms"] == pytest.approx(2.0)  # the self-gated part of the call, apart from drafter_ms
    assert lines[1]["gate"] == "draft" and lines[1]["best"] > lines[1]["plain"] > 0
    summary = trace.summarize(lines)
    assert summary["steps"] == 2 and summary["drafted"] == 2 and summary["probes"] == 1
    assert summary["verifying_steps"] == 2 and summary["admitted_per_verifying_step"] == 4


def test_a_worker_keeps_its_step_cost_record_next_to_its_trace(monkeypatch, tmp_path):
    """A later engine's start-up check may measure the cached curve again and replace it: the record a traced
    worker's model was fitted on is kept beside its trace, apart from the trace files, and cleared with them."""
    from vllm_treespec.cost.model import FORMAT_VERSION, CostKey, CostRecord, StepSample

    base = tmp_path / "budget-graft-r1.jsonl"
    monkeypatch.setenv(trace.TRACE_ENV, str(base))
    key = CostKey(model="m", dtype="float32", device="cpu", vllm_version="0.32.0", torch_threads=1)
    record = CostRecord(format_version=FORMAT_VERSION, key=key, measured_at=1.0, drafters={},
                        samples=[StepSample(t, 1, 0.04 + 0.001 * t) for t in (1, 2, 4, 8)])
    budget = StepBudget.from_record(record, max_nodes=8)
    budget.trace.close()
    (trace_file,) = trace.files(base)
    assert trace.record_file(trace_file).exists()
    assert msgspec.json.decode(trace.record_file(trace_file).read_bytes(), type=CostRecord) == record
    trace.clear(base)
    assert not list(tmp_path.iterdir())
    # a record that cannot be written leaves the budget in place
    blocked = tmp_path / "blocked"
    monkeypatch.setenv(trace.TRACE_ENV, str(blocked / "budget.jsonl"))
    trace.record_file(f"{blocked / 'budget.jsonl'}.{os.getpid()}").mkdir(parents=True)  # a folder in its place
    budget = StepBudget.from_record(record, max_nodes=8)
    assert budget.trace is not None and budget.max_nodes == 8
    budget.trace.close()


def test_summaries_cut_by_time_and_skip_idle_steps(tmp_path):
    lines = [{"t": 1.0, "reqs": 2, "tokens": 2, "gate": "skip"},
             {"t": 2.0, "reqs": 2, "tokens": 10, "gate": "draft", "admitted": 8, "accepted": 3, "factor": 0.5,
              "offered": 20, "learned": 5},
             {"t": 3.0, "reqs": 0, "tokens": 0},
             {"t": 4.0, "reqs": 1, "tokens": 1, "gate": "probe", "admitted": 0, "factor": 1.0, "offered": 6,
              "unverified": 2}]
    path = tmp_path / "t.jsonl.1"
    path.write_bytes(b"\n".join(trace._encoder.encode(line) for line in reversed(lines)) + b"\n{\"t\": 5")
    read = trace.read([path])  # time order, the torn last line dropped
    assert [line["t"] for line in read] == [1.0, 2.0, 3.0, 4.0]
    whole = trace.summarize(read)
    assert whole["steps"] == 3 and whole["drafted"] == 2 and whole["probes"] == 1 and whole["verifying_steps"] == 1
    assert whole["plain_samples"] == 0
    assert whole["offering_steps"] == 2 and whole["offered_per_offering_step"] == 13
    assert whole["learned_nodes"] == 5 and whole["unverified_nodes"] == 2
    assert whole["accepted_per_verifying_step"] == 3 and whole["mean_factor"] == pytest.approx(0.75)
    assert trace.summarize(read, 1.5, 3.5)["steps"] == 1
    assert trace.summarize(read, 10.0) == {"steps": 0}
    assert whole["prediction_error"] is None  # no step has a prediction and a time
    assert whole["expected_vs_realized"] is None  # no verifying step says what it expected


def test_summaries_weigh_what_verifying_steps_expected_against_what_they_committed():
    """Expected tokens (plain decoding's one per request included) against one per request plus accepted drafts,
    over the steps that verified drafts only, as a ratio of sums."""
    lines = [{"t": 1.0, "reqs": 2, "tokens": 10, "gate": "draft", "admitted": 8, "expected": 4.5, "accepted": 3},
             {"t": 2.0, "reqs": 1, "tokens": 3, "gate": "draft", "admitted": 2, "expected": 2.0, "accepted": 0},
             {"t": 3.0, "reqs": 2, "tokens": 2, "gate": "plain", "expected": 2.0, "accepted": 0},  # verified none
             {"t": 4.0, "reqs": 1, "tokens": 5, "gate": "probe", "admitted": 4, "accepted": 1}]  # no expectation
    honest = trace.summarize(lines)["expected_vs_realized"]
    assert honest["steps"] == 2 and honest["ratio"] == pytest.approx((4.5 + 2.0) / ((2 + 3) + (1 + 0)))


def test_summaries_say_how_far_the_model_predicted_the_steps():
    """Predicted against measured forwards, by steps that verified drafts and steps that did not."""
    lines = [{"t": 1.0, "reqs": 4, "tokens": 4, "predicted_ms": 110.0, "forward_ms": 100.0},
             {"t": 2.0, "reqs": 4, "tokens": 4, "predicted_ms": 120.0, "forward_ms": 100.0},
             {"t": 3.0, "reqs": 4, "tokens": 4, "predicted_ms": 130.0, "forward_ms": 100.0},
             {"t": 4.0, "reqs": 4, "tokens": 20, "admitted": 16, "predicted_ms": 180.0, "forward_ms": 200.0},
             {"t": 5.0, "reqs": 4, "tokens": 4, "forward_ms": 100.0}]  # no prediction: not counted
    error = trace.summarize(lines)["prediction_error"]
    assert error["plain"] == pytest.approx(0.2) and error["verifying"] == pytest.approx(-0.1)
    assert error["absolute"] == pytest.approx(0.15)


def test_summaries_add_up_the_time_before_drafts_that_nothing_priced():
    """Between two step starts: the first's forward and host time, then the second's drafter call (with the part a
    proposer's own gate priced, ``head_ms``); what is left before a drafting step is work the budget did not price
    (a head's catch-up). Idle gaps and steps that did not draft are left out."""
    lines = [{"t": 1.000, "reqs": 4, "tokens": 4, "forward_ms": 50.0, "host_ms": 3.0},
             {"t": 1.100, "reqs": 4, "tokens": 9, "gate": "probe", "drafter_ms": 7.0, "head_ms": 15.0,
              "forward_ms": 70.0, "host_ms": 3.0},  # 100 ms after a 50 ms forward, 3 ms of host and a 22 ms call
             {"t": 1.180, "reqs": 4, "tokens": 4, "gate": "skip", "forward_ms": 50.0, "host_ms": 3.0},
             {"t": 1.240, "reqs": 4, "tokens": 8, "gate": "draft", "drafter_ms": 7.0, "forward_ms": 60.0},
             {"t": 3.000, "reqs": 4, "tokens": 8, "gate": "draft", "drafter_ms": 7.0, "forward_ms": 60.0}]  # idle
    assert trace.summarize(lines)["unpriced_before_drafts_ms"] == pytest.approx(25.0 + 0.0)


def test_summaries_weigh_decode_steps_against_the_servers_own_plain_steps():
    """A step's time is its proposer's call, forward and host time (start to the next start, less the next step's
    call); a step of n requests that accepted a drafts is worth (n + a) / n of the server's mean plain step at n (a
    step that verified nothing, less its call: the plain steps alone read 1.0). Prefill steps, idle gaps and
    request counts with fewer than three plain steps are left out."""
    lines = [{"t": 0.000, "reqs": 2, "tokens": 2, "drafts": 0},  # 50 ms
             {"t": 0.050, "reqs": 2, "tokens": 2, "drafts": 0},  # 70 ms
             {"t": 0.120, "reqs": 2, "tokens": 2, "drafts": 0},  # 50 ms, then the next step's 10 ms call
             {"t": 0.180, "reqs": 2, "tokens": 6, "drafts": 4, "accepted": 3, "drafter_ms": 10.0, "gate": "draft",
              "admitted": 4},  # 10 + 60 ms for 2 + 3 tokens: 2.5 plain steps' worth
             {"t": 0.250, "reqs": 2, "tokens": 2, "drafts": 0, "drafter_ms": 4.0, "head_ms": 6.0,
              "gate": "draft"},  # a call that admitted nothing: 10 + 50 ms for one plain step's worth
             {"t": 0.300, "reqs": 2, "tokens": 40, "drafts": 0},  # a prefill chunk
             {"t": 0.420, "reqs": 1, "tokens": 1, "drafts": 0},  # one request: no plain reference at 1
             {"t": 0.470, "reqs": 1, "tokens": 1, "drafts": 0},
             {"t": 2.000, "reqs": 1, "tokens": 1, "drafts": 0}]  # after an idle gap
    assert [ms for *_, ms, _ in trace.decode_step_times(lines)] == pytest.approx([50, 70, 50, 70, 60, 50])
    plain_step = (50 + 70 + 50 + 50) / 4  # the mean, not the median (50)
    own = trace.summarize(lines)["own_plain"]
    assert own["ratio"] == pytest.approx((3 + 2.5 + 1) * plain_step / (50 + 70 + 50 + 70 + 60))
    assert own["steps"] == 5 and own["verifying_steps"] == 1 and own["plain_steps"] == 4
    assert trace.summarize(lines[:4])["own_plain"]["ratio"] == pytest.approx(1.0)  # plain steps alone
    assert trace.summarize(lines[3:])["own_plain"] is None  # one plain step of 2 requests: no reference
    drafting_never_paid = [{**line, "accepted": 0} for line in lines]
    assert trace.summarize(drafting_never_paid)["own_plain"]["ratio"] == pytest.approx(
        5 * plain_step / (50 + 70 + 50 + 70 + 60))


def test_drafting_steps_are_weighed_against_the_gates_plain_rate_by_kind():
    """Each step that verified drafts is charged its own time (its call, forward and host time; a glance like a
    call) and weighed against the plain rate the gate priced it against: a self-gated drafter's steps (graft's head,
    ``head_ms``) apart from the others, the verifier's price of them beside, outside the request range left out."""
    lines = [{"t": 0.000, "reqs": 4, "tokens": 4, "drafts": 0},  # 50 ms less the next step's call: 42
             {"t": 0.050, "reqs": 4, "tokens": 8, "drafts": 4, "accepted": 2, "drafter_ms": 3.0, "head_ms": 5.0,
              "expected": 6.0, "best": 100.0, "plain": 100.0},  # 8 + 69 ms for 6 tokens; plain: 7.7 in 77 ms
             {"t": 0.120, "reqs": 4, "tokens": 4, "drafts": 0, "glance_ms": 1.0},  # 1 + 28 ms
             {"t": 0.150, "reqs": 4, "tokens": 6, "drafts": 2, "accepted": 2, "drafter_ms": 2.0, "expected": 6.0,
              "best": 150.0, "plain": 120.0},  # 2 + 38 ms for 6 tokens; plain: 4.8 in 40 ms
             {"t": 0.190, "reqs": 2, "tokens": 4, "drafts": 2, "accepted": 0, "drafter_ms": 2.0, "expected": 3.0,
              "best": 100.0, "plain": 100.0},  # 62 ms, 2 requests: out of a 3- range
             {"t": 0.250, "reqs": 2, "tokens": 2, "drafts": 0}]
    assert [ms for *_, ms, _ in trace.decode_step_times(lines)] == pytest.approx([42, 77, 29, 40, 62])
    kinds = trace.drafting_against_gate(lines, 3)
    assert kinds == {"rest": {"steps": 1, "ms": pytest.approx(40.0), "priced_ms": pytest.approx(40.0),
                              "vs_plain": pytest.approx(6 / 4.8)},
                     "self-gated": {"steps": 1, "ms": pytest.approx(77.0), "priced_ms": pytest.approx(60.0),
                                    "vs_plain": pytest.approx(6 / 7.7)}}
    assert trace.drafting_against_gate(lines)["rest"]["steps"] == 2
    # pooled: tokens committed over those the plain rate commits in the same time
    assert trace.drafting_against_gate(lines)["rest"]["vs_plain"] == pytest.approx((6 + 2) / (4.8 + 6.2))
    assert trace.drafting_against_gate(lines, 3, 3) == {}
    assert trace.summarize(lines)["drafting_against_gate"] == trace.drafting_against_gate(lines)
