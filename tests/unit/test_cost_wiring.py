"""The verifier with a step budget installed (fake runner, no engine): scored trees are trimmed to the nodes that pay
before vLLM sees the drafts, unscored trees and partial prefills are untouched, and every forward's time (attach to
sample) refines the cost model; install_budget / budget_report over a stand-in worker."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fake_runner import FakeProposer, FakeRequest, fake_runner, recording_layer, schedule

from vllm_treespec.api import DraftTree
from vllm_treespec.attn import plan
from vllm_treespec.cost.budget import StepBudget, budget_report, install_budget
from vllm_treespec.cost.model import PiecewiseLinear, StepCostModel
from vllm_treespec.verify.verifier import TreeVerifier

# path probs 0.9, 0.05, 0.72, 0.09; source -1: the scores are taken as acceptance probabilities, uncalibrated (these
# tests are about the budget; a fresh calibration would cap them at 1/2, see test_calibration.py)
SCORED = DraftTree(np.array([10, 11, 12, 13]), np.array([-1, -1, 0, 0], np.int32),
                   np.array([0.9, 0.05, 0.8, 0.1], np.float32), np.full(4, -1, np.int32))


def verifier_with(cost_fn, trees, max_nodes=8):
    requests = [FakeRequest("a", [1, 2, 3, 4, 9], [3, 0]), FakeRequest("b", [1, 2, 3], [1]),
                FakeRequest("c", [5, 6], [2])]
    runner = fake_runner(requests, max_nodes)
    verifier = TreeVerifier(runner, FakeProposer(trees))
    verifier._layers = [recording_layer()]
    tokens = np.arange(1, 40)
    verifier.budget = StepBudget(StepCostModel(PiecewiseLinear(tokens, cost_fn(tokens))), max_nodes)
    return verifier


@pytest.fixture(autouse=True)
def no_published_batch():
    yield
    plan.publish(None)


def test_flat_cost_keeps_every_scored_node_and_unscored_trees_untouched():
    verifier = verifier_with(lambda t: np.full(t.shape, 0.05), {"a": SCORED, "b": DraftTree.chain([20, 21])})
    assert verifier.propose([[9], [3], [6]]) == [[10, 11, 12, 13], [20, 21], []]


def test_a_steep_cost_leaves_only_what_pays():
    # every token costs 20 ms over a 50 ms step: only nodes with path probability > 0.4 pay (0.9, then 0.72)
    verifier = verifier_with(lambda t: 0.05 + 0.02 * (t - 1), {"a": SCORED, "c": SCORED})
    drafts = verifier.propose([[9], [3], []])  # c is a partial prefill: no draft, and no share of the budget
    assert drafts == [[10, 12], [], []]
    assert verifier.budget.stats["admitted_nodes"] == 2
    nothing = verifier_with(lambda t: 0.05 * t, {"a": SCORED})
    assert nothing.propose([[9], [3], [6]]) == [[], [], []] and nothing.pending == {}


def test_the_gate_learns_an_allocations_saving_from_what_the_target_accepted():
    """An allocation's saving reaches the drafter gate with the next step's committed tokens: a tree whose nodes
    were all rejected cost its rows and saved nothing, so the surplus goes below zero."""
    verifier = verifier_with(lambda t: 0.05 + 0.002 * (t - 1), {"a": SCORED})
    gate = verifier.budget.gate
    drafts = verifier.propose([[9], [3], [6]])
    assert drafts[0] and gate.surplus == 0.0  # not learnt before the outcome
    scheduler_output, num_scheduled = schedule(verifier.runner, {"a": drafts[0]})
    verifier.attach(scheduler_output, num_scheduled)
    plan.publish(None)
    verifier.propose([[7], [3], [6]])  # the target's own 7: every draft rejected
    assert gate.surplus < 0


def test_the_proposer_is_told_how_deep_and_how_large_the_budget_admits():
    """``ctx.useful_depth`` is the deepest node of the recent allocations plus one: a drafter that pays per level
    stops there; ``ctx.useful_nodes`` twice the largest admitted tree plus one: a drafter that pays per node (an
    EAGLE head's frontier) grows no larger (``useful_max_nodes``, never above ``max_nodes``). Both unknown before the
    first allocation."""
    verifier = verifier_with(lambda t: 0.05 + 0.02 * (t - 1), {"a": SCORED})  # admits 0.9 and its child 0.72
    proposer = verifier.proposer
    verifier.propose([[9], [3], [6]])
    first = proposer.contexts[0]
    assert first.useful_depth is None and first.useful_nodes is None and first.useful_max_nodes == 8
    assert verifier._admitted[-1] == (2, 2)  # (deepest admitted node, most nodes of one tree)
    scheduler_output, num_scheduled = schedule(verifier.runner, {"a": [10, 12]})
    verifier.attach(scheduler_output, num_scheduled)
    plan.publish(None)
    verifier.propose([[10, 12, 7], [3], [6]])
    asked = (proposer.contexts + proposer.observed)[-1]
    assert asked.useful_depth == 3
    assert asked.useful_nodes == 5 and asked.useful_max_nodes == 5
    asked.useful_nodes = 17
    assert asked.useful_max_nodes == 8  # the cap stays the request's


def test_the_gate_prices_the_proposers_catch_up_with_its_call():
    """``TreeProposer.catch_up_price`` of the rows that would draft is added to the drafter's price: the trees that
    pay at a 2 ms token do not pay for ten seconds of catch-up, and the step only observes."""
    decisions = []
    for price in (0.0, 10.0):
        verifier = verifier_with(lambda t: 0.05 + 0.002 * (t - 1), {"a": SCORED})
        proposer, asked = verifier.proposer, []
        proposer.catch_up_price = lambda ctx, rows, price=price: asked.append(list(rows)) or price
        drafts = verifier.propose([[9], [3], [6]])
        assert drafts[0]  # nothing known yet: it drafts, and learns what the trees are worth
        scheduler_output, num_scheduled = schedule(verifier.runner, {"a": drafts[0]})
        verifier.attach(scheduler_output, num_scheduled)
        plan.publish(None)
        decisions.append(bool(verifier.propose([[10, 12, 7], [3], [6]])[0]))
        assert asked[-1] == [0, 1, 2]
    assert decisions == [True, False]
    assert len(proposer.observed) == 1 and verifier.budget.stats["skipped_drafts"] == 1


def test_forward_times_refine_the_model(monkeypatch):
    verifier = verifier_with(lambda t: np.full(t.shape, 0.05), {})
    clock = iter(np.arange(0, 100, 0.2).tolist())
    monkeypatch.setattr("vllm_treespec.cost.budget.time.perf_counter", lambda: next(clock))
    for _ in range(40):
        scheduler_output, num_scheduled = schedule(verifier.runner, {})
        verifier.attach(scheduler_output, num_scheduled)  # starts the clock: 3 tokens of 3 requests
        verifier.sample(lambda logits, metadata: "vllm's", torch.zeros(3, 8), None)  # 0.2 s later
    assert verifier.budget.stats["observed_steps"] == 40
    assert verifier.budget.cost.predict(3, 3) == pytest.approx(0.2, rel=0.05)


def test_the_verifier_tells_the_budget_how_many_requests_a_step_verifies_drafts_for(monkeypatch):
    """A step's drafts and the requests they belong to reach the budget when its forward starts, so that what the
    step runs beyond a plain step is learnt for as many requests as it verified drafts for (2 of 3 here)."""
    verifier = verifier_with(lambda t: np.full(t.shape, 0.05), {"a": SCORED})
    started = []
    original = verifier.budget.step_started
    monkeypatch.setattr(verifier.budget, "step_started",
                        lambda *args, **kw: started.append(args) or original(*args, **kw))
    scheduler_output, num_scheduled = schedule(verifier.runner, {"a": [10, 11], "b": [20]})
    verifier.attach(scheduler_output, num_scheduled)
    num_tokens, num_reqs, _, drafts, _, draft_reqs = started[-1]
    assert (num_reqs, drafts, draft_reqs) == (3, 3, 2) and num_tokens == int(np.sum(num_scheduled))


def test_install_budget_and_report_over_collective_rpc(monkeypatch):
    verifier = verifier_with(lambda t: np.full(t.shape, 0.05), {})
    budget = verifier.budget
    verifier.budget = None
    monkeypatch.setattr(StepBudget, "for_runner", classmethod(lambda cls, runner, max_nodes, **kw: budget))
    runner = verifier.runner
    runner._treespec_verifier = verifier
    worker = SimpleNamespace(model_runner=runner)
    assert budget_report(worker) == {}
    assert install_budget(worker) == {"installed": True} and verifier.budget is budget
    assert budget_report(worker)["allocations"] == 0
    assert install_budget(SimpleNamespace(model_runner=SimpleNamespace()))["installed"] is False


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_host_time_is_the_cycle_less_the_forward_the_drafter_and_the_tree_work(monkeypatch):
    """Each step costs its forward plus what the engine does around it: a plain step's host time is the time
    between two forwards' starts less the forward and the drafter's call; a step that verified drafts adds its
    tree work, the verifier's own and whatever more its host time ran than a plain step's."""
    clock = Clock()
    monkeypatch.setattr("vllm_treespec.cost.budget.time.perf_counter", clock)
    tokens = np.arange(1, 40)
    budget = StepBudget(StepCostModel(PiecewiseLinear(tokens, np.full(tokens.shape, 0.05))), max_nodes=8)
    for _ in range(5):
        budget.step_started(1, 1)
        clock.now += 0.05  # forward
        budget.step_finished()
        budget.drafted(1, 0.002)
        clock.now += 0.002 + 0.010  # drafter, 10 ms of scheduler and sampler
        budget.step_started(4, 1, drafts=3)
        clock.now += 0.05
        budget.step_finished()
        budget.tree_worked(0.004)
        clock.now += 0.004 + 0.011  # tree work, and 1 ms more of the rest than a plain step
    budget.step_started(1, 1)
    assert budget.host_seconds == pytest.approx(0.010)
    assert budget.tree_work.seconds == pytest.approx(0.005)
    assert budget.drafter_cost.predict(1) == pytest.approx(0.002)
    assert budget.step_time.predict(1) == pytest.approx(0.05 + 0.010)
    # the allocator sees the whole step: a node of path probability 0.1 pays when it adds 5 ms of tree work to a
    # 60 ms step...
    cheap = DraftTree(np.array([7]), np.array([-1], np.int32), np.array([0.1], np.float32))
    assert budget.admit([cheap])[0] is not None
    # ...but not once tree work of 20 ms is charged to steps with drafts
    for _ in range(6):
        budget.tree_work.add(0.02)
    assert budget.admit([cheap])[0] is None
    # an idle engine (a gap of minutes between two forwards) is not host time
    clock.now += 300
    budget.step_started(1, 1)
    assert budget.host_seconds == pytest.approx(0.010)


def test_tree_work_is_priced_by_the_requests_a_step_verifies_drafts_for(monkeypatch):
    """What a step verifying drafts runs beyond a plain step grows with the requests it verifies (vLLM's sampler,
    scheduler and input preparation on their draft rows, the verifier's work on their trees): learnt per
    power-of-two bucket of them, a chain step without tree work included, so 16 requests' drafts pay only if they
    beat 16 requests' price, though most steps so far verified one request's."""
    clock = Clock()
    monkeypatch.setattr("vllm_treespec.cost.budget.time.perf_counter", clock)
    tokens = np.arange(1, 80)
    budget = StepBudget(StepCostModel(PiecewiseLinear(tokens, np.full(tokens.shape, 0.05))), max_nodes=8)

    def step(reqs: int, drafts: int, host: float, tree: float | None = None) -> None:
        budget.step_started(reqs + drafts, reqs, drafts=drafts, draft_reqs=min(reqs, drafts))
        clock.now += 0.05
        budget.step_finished()
        if tree is not None:
            budget.tree_worked(tree)
            clock.now += tree
        clock.now += host

    for _ in range(4):
        step(1, 0, 0.002)  # plain steps: 2 ms of host time
    for _ in range(9):
        step(1, 2, 0.003, tree=0.001)  # 1 ms of tree work, and 1 ms more of the rest
    for _ in range(4):
        step(16, 0, 0.002)
    for _ in range(4):
        step(16, 16, 0.012)  # chains (no tree work) that ran 10 ms more than a plain step
    step(16, 0, 0.002)
    assert budget.host_seconds == pytest.approx(0.002)
    assert budget.tree_work.predict(1) == pytest.approx(0.002) and budget.tree_work.predict(16) == pytest.approx(0.01)
    tree = DraftTree(np.array([7]), np.array([-1], np.int32), np.array([0.1], np.float32))
    assert budget.admit([tree], num_reqs=1)[0] is not None  # 1.1 tokens in 54 ms beats 1 in 52
    assert all(t is None for t in budget.admit([tree] * 16, num_reqs=16))  # 17.6 in 62 ms does not beat 16 in 52
    assert budget.draft_price(16) == pytest.approx(0.01) and budget.draft_price(1) == pytest.approx(0.002)
    assert budget.report()["tree_work_ms_by_requests"] == {1: pytest.approx(2.0), 16: pytest.approx(10.0)}


def test_a_drafter_part_priced_elsewhere_is_not_host_time(monkeypatch):
    """graft's head is priced by graft's own gate and a catch-up before the call, so the verifier's gate times the
    call without them; they are still drafter work, not host time that every step, plain ones too, is priced with."""
    clock = Clock()
    monkeypatch.setattr("vllm_treespec.cost.budget.time.perf_counter", clock)
    tokens = np.arange(1, 40)
    budget = StepBudget(StepCostModel(PiecewiseLinear(tokens, np.full(tokens.shape, 0.03))), max_nodes=8)
    for _ in range(5):
        budget.step_started(4, 1)
        clock.now += 0.03  # forward
        budget.step_finished()
        budget.drafted(1, 0.001, 0.008)  # retrieval 1 ms, the head 8 ms
        clock.now += 0.001 + 0.008 + 0.003  # drafter, 3 ms of scheduler and sampler
    budget.step_started(1, 1)
    assert budget.host_seconds == pytest.approx(0.003)
    assert budget.drafter_cost.predict(1) == pytest.approx(0.001)
    assert budget.step_time.predict(1) == pytest.approx(0.03 + 0.003)


def test_drafts_wait_for_measured_plain_steps(monkeypatch):
    """The gate prices drafting against the plain step: where forwards are timed, a token bucket whose plain
    steps were not measured (or not lately) gets plain steps first, and the proposer only observes them."""
    from vllm_treespec.cost import budget as budget_module

    clock = Clock()
    monkeypatch.setattr("vllm_treespec.cost.budget.time.perf_counter", clock)
    tokens = np.arange(1, 40)
    budget = StepBudget(StepCostModel(PiecewiseLinear(tokens, 0.05 + 0.001 * tokens)), max_nodes=8)

    def step(num_tokens, num_reqs, drafts, seconds):
        budget.step_started(num_tokens, num_reqs, drafts=drafts)
        clock.now += seconds
        budget.step_finished()

    assert budget.should_draft(8, step_reqs=8)  # nothing timed yet (as on an asynchronous GPU): no plain steps
    step(17, 8, 9, 1.0)  # the engine's first verifying step (it compiles kernels): not folded into the model
    assert not budget.cost.draft_correction.observed
    step(17, 8, 9, 0.1)  # a verifying step of 8 requests
    assert not budget.should_draft(8, step_reqs=8) and budget.stats["plain_samples"] == 1
    for n in range(budget_module.PLAIN_SAMPLES):
        assert not budget.should_draft(8, step_reqs=8)
        step(8, 8, 0, 0.04)
    assert budget.cost.correction.buckets[3] < 1.0 < budget.cost.draft_correction.buckets[4]
    assert budget.should_draft(8, step_reqs=8) and budget.gate.probing  # measured: the gate decides (no history)
    assert budget.stats["plain_samples"] == 1 + budget_module.PLAIN_SAMPLES
    for _ in range(budget_module.PLAIN_SAMPLE_AGE + 1):
        step(17, 8, 9, 0.1)
    assert budget.should_draft(1, step_reqs=1) is False  # a bucket never measured (1 request)
    samples = budget.stats["plain_samples"]
    assert not budget.should_draft(8, step_reqs=8) and budget.stats["plain_samples"] == samples + 1  # too old
    step(8, 8, 0, 0.04)
    assert not budget.needs_plain_sample(8)


def test_the_first_verifying_steps_compile_time_does_not_price_drafts_out_for_good(monkeypatch):
    """The engine's first step that verifies drafts compiles the tree path's kernels on a fresh install (235 ms for
    a 36 ms step). Folded into the model, it doubled every drafting step's price, which no later step corrected
    (steps priced out were not drafted): the budget must price the next verifying steps from the curve."""
    clock = Clock()
    monkeypatch.setattr("vllm_treespec.cost.budget.time.perf_counter", clock)
    tokens = np.arange(1, 40)
    budget = StepBudget(StepCostModel(PiecewiseLinear(tokens, 0.030 + 0.001 * tokens)), max_nodes=8)

    def step(num_tokens, drafts, seconds):
        budget.step_started(num_tokens, 1, drafts=drafts)
        clock.now += seconds
        budget.step_finished()

    predicted = budget.cost.predict(4, 1, plain_tokens=1)
    step(4, 3, 0.235)  # the first: a compile
    assert budget.cost.predict(4, 1, plain_tokens=1) == pytest.approx(predicted)
    step(4, 3, 2 * predicted)  # later verifying steps are folded in as before
    assert budget.cost.predict(4, 1, plain_tokens=1) > predicted * 1.2


def test_the_gate_skips_the_drafter_when_its_trees_do_not_pay():
    steep = np.arange(1, 40)
    budget = StepBudget(StepCostModel(PiecewiseLinear(steep, 0.05 * steep)), max_nodes=8)
    verifier = verifier_with(lambda t: 0.05 * t, {"a": SCORED})
    verifier.budget = budget
    verifier.propose([[9], [3], [6]])  # no history: it drafts, and learns what the trees are worth
    calls = len(verifier.proposer.contexts)
    assert verifier.proposer.contexts[-1].probing  # told so: a probe drafts as fully as drafting that pays would
    drafts = [verifier.propose([[9], [3], [6]]) for _ in range(3)]
    assert drafts == [[[], [], []]] * 3 and len(verifier.proposer.contexts) == calls  # not even called...
    assert len(verifier.proposer.observed) == 3  # ...it only observes the steps (a head keeps its cache whole)
    assert budget.stats["skipped_drafts"] == 3


def rename_requests(runner, names: list[str]) -> None:
    """The runner's batch rows now hold the requests ``names`` (new prompts in the same rows)."""
    old = runner.input_batch.req_ids
    runner.input_batch.req_ids = list(names)
    runner.input_batch.req_id_to_index = {name: i for i, name in enumerate(names)}
    runner.requests = {new: runner.requests[was] for was, new in zip(old, names)}


def test_a_batch_of_new_requests_starts_the_gate_afresh():
    """The gate stopped drafting for requests whose trees did not pay; a step whose requests are all new drafts
    again (what it learnt of the old text says little of the new: not a probe, its trees are priced as any), and
    its trees are offered in full. A step that keeps one of the old requests keeps the gate as it was."""
    steep = np.arange(1, 40)
    verifier = verifier_with(lambda t: 0.05 * t, {"a": SCORED, "x": SCORED, "p": SCORED})
    verifier.budget = StepBudget(StepCostModel(PiecewiseLinear(steep, 0.05 * steep)), max_nodes=8)
    for _ in range(4):
        verifier.propose([[9], [3], [6]])
    calls, skipped = len(verifier.proposer.contexts), verifier.budget.stats["skipped_drafts"]
    assert calls == 1 and skipped == 3 and verifier.budget.stats["new_batches"] == 0  # the first step probed
    rename_requests(verifier.runner, ["a", "x", "z"])  # one old request stays: the gate carries on
    verifier.propose([[9], [3], [6]])
    assert len(verifier.proposer.contexts) == calls and verifier.budget.stats["skipped_drafts"] == skipped + 1
    verifier._admitted.append((1, 1))  # a small tree admitted lately: the proposer would be offered less
    rename_requests(verifier.runner, ["p", "q", "r"])  # all new (at one request: every new prompt)
    verifier.propose([[9], [3], [6]])
    assert len(verifier.proposer.contexts) == calls + 1 and not verifier.proposer.contexts[-1].probing
    assert verifier.proposer.contexts[-1].useful_nodes is None  # the (1, 1) admitted before is forgotten
    assert verifier.budget.stats["new_batches"] == 1 and verifier.budget.stats["probes"] == 1
    verifier.propose([[9], [3], [6]])  # its trees do not pay either: skipped again
    assert len(verifier.proposer.contexts) == calls + 1


def test_a_step_without_trees_leaves_nothing_of_the_last_ones_handed_over():
    """A step that drafts nothing (its gate skipped the drafter) hands vLLM no drafts, and nothing of the trees the
    step before handed over stays pending or remembered, to be matched to a later step's drafts."""
    verifier = verifier_with(lambda t: np.full(t.shape, 0.05), {"a": SCORED})  # flat: every node pays
    assert verifier.propose([[9], [3], [6]])[0]
    assert "a" in verifier.pending and "a" in verifier.acceptance._offered
    verifier.never_draft = True  # the path of a step whose gate skips the drafter
    assert verifier.propose([[9], [3], [6]]) == [[], [], []]
    assert verifier.pending == {} and verifier.acceptance._offered == {}


def test_install_at_startup(monkeypatch, caplog):
    from vllm_treespec.cost import budget as budget_module
    from vllm_treespec.settings import ADDITIONAL_CONFIG_KEY

    verifier = verifier_with(lambda t: np.full(t.shape, 0.05), {})
    made = verifier.budget
    verifier.budget = None
    runner = verifier.runner
    runner._treespec_verifier = verifier
    sweeps = []
    monkeypatch.setattr(StepBudget, "for_runner",
                        classmethod(lambda cls, runner, max_nodes, **kw: sweeps.append(kw) or made))
    assert budget_module.install_at_startup(runner) is made and verifier.budget is made
    assert sweeps[0]["sweep"]["budget_s"] <= 5  # seconds, not minutes
    # "cost_budget": false in the speculative config: no sweep, trees as proposed
    verifier.budget = None
    runner.vllm_config.additional_config = {ADDITIONAL_CONFIG_KEY: {"cost_budget": False}}
    assert budget_module.install_at_startup(runner) is None and verifier.budget is None and len(sweeps) == 1
    # a runner without a tree verifier: nothing to do
    assert budget_module.install_at_startup(SimpleNamespace()) is None


def test_a_failed_measurement_is_one_log_line_and_no_budget(monkeypatch, caplog):
    import logging

    verifier = verifier_with(lambda t: np.full(t.shape, 0.05), {})
    verifier.budget = None
    runner = verifier.runner
    runner._treespec_verifier = verifier

    def broken(*args, **kwargs):
        raise RuntimeError("no dummy run on this runner")

    monkeypatch.setattr("vllm_treespec.cost.measure.step_cost_model", broken)
    from vllm_treespec.cost.budget import install_at_startup

    with caplog.at_level(logging.WARNING, logger="vllm.treespec"):
        assert install_at_startup(runner) is None
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "no dummy run on this runner" in lines[0] and "trees run as proposed" in lines[0]
    assert verifier.budget is None


def test_cost_budget_key_is_checked_and_travels_to_the_workers():
    from vllm_treespec.config import TreeSpecConfigError, translate
    from vllm_treespec.settings import ADDITIONAL_CONFIG_KEY, cost_budget_enabled

    _, extra, _ = translate({"method": "suffix_tree", "cost_budget": False}, None)
    assert extra[ADDITIONAL_CONFIG_KEY]["cost_budget"] is False
    assert not cost_budget_enabled(SimpleNamespace(additional_config=extra))
    _, extra, _ = translate({"method": "suffix_tree"}, None)
    assert cost_budget_enabled(SimpleNamespace(additional_config=extra))
    assert cost_budget_enabled(SimpleNamespace(additional_config=None))
    with pytest.raises(TreeSpecConfigError, match="cost_budget.*true.*false"):
        translate({"method": "suffix_tree", "cost_budget": "off"}, None)


def test_a_cost_measured_too_high_is_measured_again_by_the_gates_probes():
    """A first tree step or drafter call that compiles kernels is not counted, and a tree-work price measured too
    high under a moment of load cannot keep drafting out for good: the gate's probes verify trees without that
    price, so it is measured again."""
    from vllm_treespec.cost.online import MIN_TIMED_CALLS

    tokens = np.arange(1, 40)
    budget = StepBudget(StepCostModel(PiecewiseLinear(tokens, np.full(tokens.shape, 0.05))), max_nodes=8)
    tree = DraftTree(np.array([7, 8]), np.array([-1, 0], np.int32), np.array([0.6, 0.6], np.float32))
    budget.tree_work.add(5.0)  # the first tree step compiled the kernels
    budget.drafted(1, 3.0)  # and so did the drafter's first call
    assert budget.tree_work.seconds == 0.0 and budget.drafter_cost.predict(1) is None
    for _ in range(MIN_TIMED_CALLS - 1):
        budget.drafted(1, 0.002)
    assert budget.drafter_cost.predict(1) is None  # too few timings to price it: it drafts, and is timed
    budget.drafted(1, 0.002)
    assert budget.drafter_cost.predict(1) == pytest.approx(0.002)
    for _ in range(3):
        budget.tree_work.add(0.2)  # load: tree work dearer than anything the tree can gain
    assert budget.should_draft(1) and budget.gate.probing  # no history yet: a probe
    assert budget.admit([tree])[0] is not None  # explored despite the price
    skipped = 0
    while not budget.should_draft(1):
        skipped += 1
    # the first probe's trees did not pay at that price: the next probe came twice as late
    assert skipped == 2 * budget.gate.probe_every and budget.gate.probing
    assert budget.admit([tree])[0] is not None
    for _ in range(4):
        budget.tree_work.add(0.001)  # measured again: cheap
    assert budget.should_draft(1) and not budget.gate.probing
    assert budget.admit([tree])[0] is not None
    assert budget.stats["probes"] == 2 and budget.stats["skipped_drafts"] == 2 * budget.gate.probe_every


def test_a_probes_verification_is_capped_by_its_allowance():
    """A probe verifies no more than the skipped steps' allowance buys (1% of each one's predicted time), and
    waits until that buys a node."""
    tokens = np.arange(1, 40)
    budget = StepBudget(StepCostModel(PiecewiseLinear(tokens, 0.05 + 0.02 * (tokens - 1))), max_nodes=8)
    tree = DraftTree(np.array([7, 8]), np.array([-1, 0], np.int32), np.array([0.9, 0.9], np.float32))
    budget.gate.marginal = np.array([0.0])  # drafting has not paid lately
    skipped = 0
    while not budget.should_draft(1):
        skipped += 1
    # due after 16 skipped steps (8 ms of allowance), it waited for a token's 20 ms
    assert skipped == 40 and budget.gate.probing
    assert budget.gate.probe_seconds == pytest.approx(skipped * 0.01 * 0.05)
    assert budget.admit([tree])[0].num_nodes == 1
    budget.gate.probing = False  # the same tree on a priced step pays whole (2.71 tokens in 90 ms)
    assert budget.admit([tree])[0].num_nodes == 2


def test_a_probe_is_priced_without_the_expectation_correction():
    """Once the correction has stopped the drafting, a probe priced by it would verify a node or two and the
    correction could never recover; probes are priced by the calibrated rates alone."""
    # every token costs 20 ms over a 50 ms step: a node pays above path probability 0.4 (SCORED: 0.9, then 0.72)
    verifier = verifier_with(lambda t: 0.05 + 0.02 * (t - 1), {"a": SCORED})
    verifier.acceptance.expectation.observe(expected=400.0, accepted=80.0)  # recent trees yielded a fifth
    assert verifier.acceptance.expectation.factor == 0.25  # (bounded below)
    verifier.budget.gate.marginal = None  # no history: the next step is a probe
    assert verifier.propose([[9], [3], [6]])[0] == [10, 12] and verifier.budget.gate.probing
    verifier.budget.gate.marginal = np.array([1.0])  # a priced step: the corrected 0.9 * 0.25 no longer pays
    assert verifier.propose([[9], [3], [6]])[0] == [] and not verifier.budget.gate.probing


def test_the_drafters_price_includes_pricing_and_handing_over_its_trees(monkeypatch):
    """What the gate charges a drafting step covers the proposer's call and the verifier's work on its trees
    (calibration, allocation, flattening), all of which only a drafting step does."""
    verifier = verifier_with(lambda t: np.full(t.shape, 0.05), {"a": SCORED})
    clock = iter(np.arange(0, 100, 0.001).tolist())
    monkeypatch.setattr("vllm_treespec.verify.verifier.time.perf_counter", lambda: next(clock))
    calls = []
    monkeypatch.setattr(verifier.budget, "drafted",
                        lambda num_reqs, seconds, unpriced=0.0: calls.append((num_reqs, seconds, unpriced)))
    verifier.propose([[9], [3], [6]])
    (num_reqs, seconds, unpriced), = calls
    assert num_reqs == 3 and seconds == pytest.approx(0.001)  # one clock tick: start to after flatten_trees
    assert unpriced == pytest.approx(0.0)


def test_a_drafter_the_proposer_gates_itself_is_not_charged_to_the_verifiers_gate(monkeypatch):
    """graft's head runs only when graft's own gate expects it to pay; the verifier's gate charges graft's call
    without it (``ctx.self_gated_seconds``). Charged with it, a head step's 20 ms made the whole call look dear and
    the verifier's gate stopped asking for graft's cheap retrieval trees as well (HumanEval's repeated code, verified
    on every step by vLLM's ngram, was drafted on a few steps in six)."""

    class SelfGating(FakeProposer):
        def propose_trees(self, ctx):
            ctx.self_gated_seconds = 0.020  # 20 clock ticks of the call below were its own gated drafter
            for _ in range(25):
                time.perf_counter()
            return super().propose_trees(ctx)

    verifier = verifier_with(lambda t: np.full(t.shape, 0.05), {"a": SCORED})
    verifier.proposer = SelfGating({"a": SCORED})
    clock = iter(np.arange(0, 100, 0.001).tolist())
    # the time module's clock, which the verifier and the proposer above both read
    monkeypatch.setattr("vllm_treespec.verify.verifier.time.perf_counter", lambda: next(clock))
    calls = []
    monkeypatch.setattr(verifier.budget, "drafted",
                        lambda num_reqs, seconds, unpriced=0.0: calls.append((num_reqs, seconds, unpriced)))
    verifier.propose([[9], [3], [6]])
    (num_reqs, seconds, unpriced), = calls
    assert num_reqs == 3 and seconds == pytest.approx(0.026 - 0.020)  # 26 ticks in the call, 20 of them gated
    assert unpriced == pytest.approx(0.020)  # still the drafter's time, not host time (the budget's host median)


def test_the_proposer_is_told_the_price_of_drafting_besides_a_drafter_it_gates_itself():
    """Before asking for trees the verifier hands the proposer what the gate charges a drafting step beyond its
    forward (``ctx.shared_draft_seconds``: the drafter's measured call and the tree work), so that graft's head gate
    weighs its head against plain decoding at the whole drafting step's price."""
    verifier = verifier_with(lambda t: np.full(t.shape, 0.05), {"a": SCORED})
    verifier.propose([[9], [3], [6]])
    assert verifier.proposer.contexts[-1].shared_draft_seconds == 0.0  # nothing timed yet
    verifier.budget.drafter_cost.predict = lambda num_reqs: 0.001 * num_reqs  # a call of 1 ms a request
    for _ in range(4):  # the first is a warm-up's
        verifier.budget.tree_work.add(0.002, num_reqs=3)
    verifier.propose([[9], [3], [6]])
    assert verifier.proposer.contexts[-1].shared_draft_seconds == pytest.approx(0.003 + 0.002)  # 3 drafting


def test_the_verifier_prices_each_requests_rows_by_its_sequence_length():
    """Every row attends to its request's whole sequence: with a context term, the verifier hands the budget each
    request's length, so the same tree keeps fewer nodes on a longer request, and each forward is observed with
    its rows' context."""
    cheap = lambda t: 0.05 + 0.002 * (t - 1)  # noqa: E731
    kept = {}
    for name, per_context in (("no term", 0.0), ("term", 0.006)):
        verifier = verifier_with(cheap, {"a": SCORED, "b": SCORED})
        verifier.budget.cost.per_context, verifier.budget.cost.reference_context = per_context, 0
        drafts = verifier.propose([[9], [3], []])
        kept[name] = [len(d) for d in drafts[:2]]
        # the proposer sees the same per-row prices (for a gate of its own): lengths 5, 3 and 2 over a context of 0
        seen = verifier.proposer.contexts[-1].row_excess
        assert seen is None if not per_context else seen.tolist() == [5.0, 3.0, 2.0]
    assert kept["no term"][0] == kept["no term"][1] > 0  # request a has 5 tokens, b 3: alike without the term
    assert kept["term"] == [0, kept["no term"][1]]  # a's rows (5 positions each) cost too much, b's (3) still pay
    # the forward of the scheduled step is observed with its rows' context: rows x sequence length at the step's end
    scheduler_output, num_scheduled = schedule(verifier.runner, {})
    verifier.attach(scheduler_output, num_scheduled)
    computed = verifier.runner.input_batch.num_computed_tokens_cpu[:3]
    assert verifier.budget._excess == pytest.approx(float(np.sum(num_scheduled * (computed + num_scheduled))))
    # and with each request's sequence once (the per-request context term's E_R)
    assert verifier.budget._request_excess == pytest.approx(float(np.sum(computed + num_scheduled)))


def test_a_probe_under_load_drafts_for_as_many_requests_as_it_verifies_nodes():
    """Where a node costs 20 ms over a 50 ms step and nothing pays, a probe's allowance verifies a node or two: the
    proposer is asked for that many requests' trees (``ctx.needs_draft``), each probe taking the next requests in
    turn, not for every request's (a drafter's call for all of them cost more than the probe verifies). The first
    probe, with nothing known yet, asks every request."""
    weak = DraftTree(np.array([10, 11]), np.array([-1, -1], np.int32), np.array([0.2, 0.1], np.float32),
                     np.full(2, -1, np.int32))
    verifier = verifier_with(lambda t: 0.05 + 0.02 * (t - 1), {"a": weak, "b": weak, "c": weak})
    proposer, gate = verifier.proposer, verifier.budget.gate
    asked, counts, priced = [], [], []
    drafted = verifier.budget.drafted
    verifier.budget.drafted = lambda num_reqs, seconds, unpriced=0.0: (priced.append(num_reqs),
                                                                        drafted(num_reqs, seconds, unpriced))
    for _ in range(200):
        calls = len(proposer.contexts)
        drafts = verifier.propose([[9], [3], [6]])
        if len(proposer.contexts) > calls:
            ctx = proposer.contexts[-1]
            asked.append([i for i in range(3) if ctx.needs_draft(i)])
            counts.append(gate.probe_requests)
            assert [i for i, d in enumerate(drafts) if d] == [i for i in asked[-1] if drafts[i]]
    assert asked[0] == [0, 1, 2] and counts[0] is None  # nothing known yet
    # the first allowance pays for one node: one request; the next (twice the wait) for two: the next two
    assert asked[1:3] == [[0], [1, 2]] and counts[1:3] == [1, 2]
    assert all(len(a) == (c or 3) for a, c in zip(asked, counts))
    assert priced == [len(a) for a in asked]  # each call is priced for the requests it was asked for


def test_a_never_drafting_verifier_only_observes(monkeypatch):
    """VLLM_TREESPEC_NEVER_DRAFT=1: every step takes the gate-refuses path, whatever the budget would say (a flat
    cost, where every scored node pays): the proposer is never asked for trees, only shown each step."""
    from vllm_treespec.settings import NEVER_DRAFT_ENV

    monkeypatch.setenv(NEVER_DRAFT_ENV, "1")
    verifier = verifier_with(lambda t: np.full(t.shape, 0.05), {"a": SCORED})
    drafts = [verifier.propose([[9], [3], [6]]) for _ in range(3)]
    assert drafts == [[[], [], []]] * 3
    assert verifier.proposer.contexts == [] and len(verifier.proposer.observed) == 3
    monkeypatch.delenv(NEVER_DRAFT_ENV)
    drafting = verifier_with(lambda t: np.full(t.shape, 0.05), {"a": SCORED})
    assert drafting.propose([[9], [3], [6]])[0]  # the same verifier without it drafts


def test_one_slow_timing_does_not_price_a_drafter_out_of_drafting():
    """A drafter's first call is not counted (it compiles), and its next ones are averaged alike until there are
    enough to price it: one timing taken while the machine was busy (eagle_tree's head at 11.4 ms against its 7.8 ms)
    had priced it for a whole run, since a gate that skips its drafts times it again only at its probes. Until then
    the gate lets it draft, and times it; past 1 / alpha timings the mean is exponentially weighted."""
    from vllm_treespec.cost.allocate import DraftGate
    from vllm_treespec.cost.online import CALL_ALPHA, MIN_TIMED_CALLS, CallCost

    calls = CallCost()
    calls.observe(1, 3.0)  # compiles: not counted
    calls.observe(1, 0.0114)  # a busy moment
    assert calls.predict(1) is None
    for _ in range(MIN_TIMED_CALLS - 1):
        calls.observe(1, 0.0078)
    busy = (0.0114 + 0.0078 * (MIN_TIMED_CALLS - 1)) / MIN_TIMED_CALLS
    assert calls.predict(1) == pytest.approx(busy)  # the plain mean: the busy timing weighs as one of them
    for _ in range(round(1 / CALL_ALPHA) - MIN_TIMED_CALLS):
        calls.observe(1, 0.0078)
    settled = calls.predict(1)
    assert settled == pytest.approx(0.0078 + (0.0114 - 0.0078) / round(1 / CALL_ALPHA))
    calls.observe(1, 0.0178)
    assert calls.predict(1) == pytest.approx(settled + CALL_ALPHA * (0.0178 - settled))  # weighted from here

    # a gate whose drafter has one counted timing, dear enough to lose to plain decoding, still drafts (and is
    # timed); with as many timings at that price it does not
    tokens = np.arange(1, 40)
    cost = StepCostModel(PiecewiseLinear(tokens, 0.02 + 0.001 * tokens))
    tree = DraftTree(np.array([7]), np.array([-1], np.int32), np.array([0.5], np.float32))
    decisions = []
    for timings in (1, MIN_TIMED_CALLS):
        timed = CallCost(warmup=0)
        for _ in range(timings):
            timed.observe(1, 0.02)
        gate = DraftGate(cost, SimpleNamespace(predict=timed.predict))
        gate.record([tree])
        decisions.append(gate.should_draft(1))
    assert decisions == [True, False]


def test_a_drafters_call_beyond_the_requests_it_was_timed_at_is_priced_per_request():
    """A drafter timed only for one request is not priced at that for sixteen: beyond the largest timed bucket the
    call costs that bucket's seconds per request (graft's calls for 1 request took 2.5 ms and for 16 took 31 ms; a
    flat estimate let the gate draft at 16 requests on a call it priced at 2.5 ms). Between timed buckets the
    estimate interpolates, below the smallest it is the smallest's; a gate then sees drafting at 16 as dear."""
    from vllm_treespec.cost.allocate import DraftGate
    from vllm_treespec.cost.online import CallCost

    calls = CallCost(warmup=0, min_calls=1)
    assert calls.predict(4) is None
    calls.observe(1, 0.0025)
    assert calls.predict(1) == pytest.approx(0.0025) and calls.predict(16) == pytest.approx(0.040)
    calls.observe(4, 0.008)
    assert calls.predict(1) == pytest.approx(0.0025) and calls.predict(2) == pytest.approx((0.0025 + 0.008) / 2)
    assert calls.predict(4) == pytest.approx(0.008) and calls.predict(16) == pytest.approx(0.032)

    # 16 requests, a 100 ms plain step and 0.5 ms a node: trees of 0.3 a request pay for a 2.5 ms call, not 40 ms
    tokens = np.arange(1, 80)
    cost = StepCostModel(PiecewiseLinear(tokens, 0.1 + 0.0005 * np.maximum(tokens - 16, 0)))
    tree = DraftTree(np.array([7]), np.array([-1], np.int32), np.array([0.3], np.float32))
    flat, per_request = CallCost(warmup=0, min_calls=1), CallCost(warmup=0, min_calls=1)
    flat.observe(1, 0.0025)
    flat.buckets[4] = 0.0025  # as the flat estimate had it at 16
    per_request.observe(1, 0.0025)
    drafters = []
    for timed in (flat, per_request):
        gate = DraftGate(cost, SimpleNamespace(predict=timed.predict))
        gate.record([tree] * 16)
        drafters.append(gate.should_draft(16))
    assert drafters == [True, False]


class GlancingProposer(FakeProposer):
    """A FakeProposer whose glance on skipped steps offers ``glances`` (by request id)."""

    def __init__(self, trees, glances):
        super().__init__(trees)
        self.glances = glances
        self.glanced_rows: list[list[int]] = []

    def glance(self, ctx, rows):
        self.glanced_rows.append(list(rows))
        return [self.glances.get(r) if i in rows else None for i, r in enumerate(ctx.req_ids)]


def test_a_skipped_steps_glance_is_priced_like_any_tree_and_teaches_the_gate_nothing():
    """Where the gate skips the drafter (its trees did not pay), the proposer's glance may still offer trees: they
    are trimmed to the nodes that pay, as on a drafted step, but neither the gate's picture of the drafter's trees nor
    its learnt saving nor the drafter's timed call changes. A glance that offers nothing leaves a plain step."""
    weak = DraftTree(np.array([10, 11]), np.array([-1, 0], np.int32), np.array([0.05, 0.5], np.float32),
                     np.full(2, -1, np.int32))
    verifier = verifier_with(lambda t: 0.05 + 0.02 * (t - 1), {})
    verifier.proposer = GlancingProposer({"a": weak}, {"a": SCORED})
    budget = verifier.budget
    verifier.propose([[9], [3], [6]])  # no history: a probe, which learns that the weak trees do not pay
    gains, timed = budget.gate.gains.copy(), dict(budget.drafter_cost.timed.buckets)
    calls = len(verifier.proposer.contexts)
    drafts = verifier.propose([[9], [3], []])
    assert len(verifier.proposer.contexts) == calls and len(verifier.proposer.observed) == 1  # skipped...
    assert verifier.proposer.glanced_rows == [[0, 1]]  # ...then glanced at the rows that draft (c is a prefill)
    assert drafts == [[10, 12], [], []]  # the glance's nodes that pay at 20 ms a row: 0.9 and 0.72
    assert budget.stats["skipped_drafts"] == 1 and budget.stats["glance_trees"] == 1
    assert budget.stats["glance_nodes"] == 2
    np.testing.assert_array_equal(budget.gate.gains, gains)
    assert budget.drafter_cost.timed.buckets == timed and budget.gate.surplus == 0.0
    verifier.proposer.glances = {}
    assert verifier.propose([[9], [3], [6]]) == [[], [], []]
    assert budget.stats["glance_steps"] == 2 and budget.stats["glance_trees"] == 1
    verifier.proposer = FakeProposer({"a": weak})  # does not glance: never asked, no glance step counted
    assert verifier.propose([[9], [3], [6]]) == [[], [], []]
    assert budget.stats["skipped_drafts"] == 3 and budget.stats["glance_steps"] == 2
