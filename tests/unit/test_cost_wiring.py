"""The verifier with a step budget installed (fake runner, no engine): scored trees are trimmed to the nodes that pay
before vLLM sees the drafts, unscored trees and partial prefills are untouched, and every forward's time (attach to
sample) refines the cost model; install_budget / budget_report over a stand-in worker."""

from __future__ import annotations

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

SCORED = DraftTree(np.array([10, 11, 12, 13]), np.array([-1, -1, 0, 0], np.int32),
                   np.array([0.9, 0.05, 0.8, 0.1], np.float32))  # path probs 0.9, 0.05, 0.72, 0.09


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
