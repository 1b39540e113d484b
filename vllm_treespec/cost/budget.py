"""The engine side of the cost-aware budget, ready for the verifier to hold: one :class:`StepBudget` per runner.

    budget = StepBudget.for_runner(runner, max_nodes)        # between steps: cached curve, or a fresh sweep
    if budget.should_draft(num_reqs): trees = proposer.propose_trees(ctx)   # drafter gate (optional)
    trees = budget.admit(trees, num_reqs)                     # after propose_trees: trees with node_probs are trimmed
    budget.step_started(num_tokens, num_reqs) ... budget.step_finished()   # around the forward: online refinement

The verifier (:mod:`vllm_treespec.verify.verifier`) calls :meth:`StepBudget.admit` after ``propose_trees`` and
times each forward (``attach`` to ``sample``, CPU only) once ``verifier.budget`` is set, which
:func:`install_budget` does through ``LLM.collective_rpc``; engines do not install one by themselves yet.
Trees without ``node_probs`` pass through untouched, so proposers that do not score their nodes keep today's
behaviour. Measuring or loading the curve never stops the engine: on any failure :meth:`StepBudget.for_runner` logs
one line and returns None (no budget: trees as proposed).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from vllm_treespec.api import DraftTree
from vllm_treespec.cost.allocate import Allocation, DraftGate, allocate
from vllm_treespec.cost.model import CostRecord, CurveModel, StepCostModel

logger = logging.getLogger("vllm.treespec")


class StepBudget:
    def __init__(self, cost: StepCostModel, max_nodes: int, drafter_cost: CurveModel | None = None,
                 batch_cap: int | None = None, min_gain: float = 0.0, overhead: float = 0.0) -> None:
        self.cost = cost
        self.max_nodes = int(max_nodes)
        self.batch_cap = batch_cap
        self.min_gain = min_gain
        self.overhead = overhead
        self.gate = DraftGate(cost, drafter_cost, overhead=overhead)
        self.last: Allocation | None = None
        self._step: tuple[int, int, float] | None = None
        self.stats = {"allocations": 0, "proposed_nodes": 0, "admitted_nodes": 0, "skipped_drafts": 0,
                      "observed_steps": 0}

    @classmethod
    def from_record(cls, record: CostRecord, max_nodes: int, drafter: str | None = None, **options: Any) -> StepBudget:
        samples = record.drafters.get(drafter or "", [])
        return cls(record.step_model(), max_nodes, CurveModel.fit(samples) if samples else None, **options)

    @classmethod
    def for_runner(cls, runner: Any, max_nodes: int, refresh: bool = False, **options: Any) -> StepBudget | None:
        """The runner's budget from its cached or freshly measured curve; None (one log line) if that fails."""
        try:
            from vllm_treespec.cost.measure import step_cost_model

            _, record = step_cost_model(runner, refresh=refresh)
            return cls.from_record(record, max_nodes, type(getattr(runner, "drafter", None)).__name__, **options)
        except Exception as e:  # noqa: BLE001 - a cost model is an optimisation, never a reason to fail start-up
            logger.warning("vllm_treespec: no step-cost model for this engine (%s: %s); trees run as proposed",
                           type(e).__name__, e)
            return None

    # --- per step ----------------------------------------------------------------------------------------------
    def should_draft(self, num_reqs: int) -> bool:
        draft = self.gate.should_draft(num_reqs, self.max_nodes)
        self.stats["skipped_drafts"] += not draft
        return draft

    def admit(self, trees: Sequence[DraftTree | None], num_reqs: int | None = None,
              base_tokens: int | None = None) -> list[DraftTree | None]:
        """The trees trimmed to the nodes that pay (only those with node_probs change)."""
        if not any(t is not None and t.node_probs is not None for t in trees):
            return list(trees)
        self.gate.record(trees)
        allocation = allocate(trees, self.cost, num_reqs=num_reqs, base_tokens=base_tokens,
                              per_request_cap=self.max_nodes, batch_cap=self.batch_cap, overhead=self.overhead,
                              min_gain=self.min_gain)
        self.last = allocation
        self.stats["allocations"] += 1
        self.stats["proposed_nodes"] += sum(min(t.num_nodes, self.max_nodes) for t in trees if t is not None)
        self.stats["admitted_nodes"] += allocation.total_nodes
        return allocation.trees

    def step_started(self, num_tokens: int, num_reqs: int) -> None:
        self._step = (int(num_tokens), int(num_reqs), time.perf_counter())

    def step_finished(self) -> None:
        """Fold the forward's time since :meth:`step_started` into the model (the caller synchronises the device)."""
        if self._step is None:
            return
        num_tokens, num_reqs, started = self._step
        self._step = None
        if num_tokens > 0 and num_reqs > 0:
            self.cost.observe(num_tokens, num_reqs, time.perf_counter() - started)
            self.stats["observed_steps"] += 1


def install_budget(worker: Any, refresh: bool = False, **options: Any) -> dict[str, Any]:
    """For ``LLM.collective_rpc`` (it runs between engine steps, so the sweep's dummy steps cannot disturb a real
    one): give this worker's tree verifier a :class:`StepBudget` from the cached curve or a fresh sweep. Returns
    what was installed."""
    verifier = getattr(worker.model_runner, "_treespec_verifier", None)
    if verifier is None:
        return {"installed": False, "reason": "no tree verifier on this worker"}
    budget = StepBudget.for_runner(worker.model_runner, verifier.max_nodes, refresh=refresh, **options)
    verifier.budget = budget
    return {"installed": budget is not None}


def budget_report(worker: Any) -> dict[str, Any]:
    """For ``LLM.collective_rpc``: the installed budget's counters and learnt corrections (empty without one)."""
    verifier = getattr(worker.model_runner, "_treespec_verifier", None)
    budget = getattr(verifier, "budget", None)
    if budget is None:
        return {}
    return {**budget.stats, "corrections": budget.cost.correction.buckets}
