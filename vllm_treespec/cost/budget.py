"""The engine side of the cost-aware budget: one :class:`StepBudget` per tree verifier, built at engine start-up.

    budget = StepBudget.for_runner(runner, max_nodes)        # at warm-up: cached curve, or a fresh sweep
    if budget.should_draft(num_reqs): ...propose_trees...; budget.drafted(num_reqs, seconds)   # drafter gate
    trees = budget.admit(trees, num_reqs)                     # after propose_trees: trees with node_probs are trimmed
    budget.verified(accepted)                                 # next step: what the target accepted of them
    budget.step_started(num_tokens, num_reqs) ... budget.step_finished()   # around the forward: online refinement
    budget.tree_worked(seconds)                               # the verifier's own host work of a tree step

What a step costs is the forward (the measured :class:`~vllm_treespec.cost.model.StepCostModel`, refined online from
each CPU forward's time) plus the host time outside it — scheduler, sampler, output processing — measured online on
plain steps as the time between two forwards' starts less the forward and the drafter's call. A step that verifies
drafts costs its tree work besides: the verifier's own work on its trees and whatever else its drafts add to the host
time, learnt per power-of-two bucket of the requests it verified drafts for. The tree work is charged only to steps
that verify drafts; the drafter's call only when deciding whether to draft at all.

:func:`install_at_startup` runs from the worker's warm-up (:mod:`vllm_treespec.patches.cpu_worker`,
:mod:`vllm_treespec.patches.gpu_worker`) unless the speculative config says ``"cost_budget": false``;
:func:`install_budget` does the same later through ``LLM.collective_rpc``. Trees without ``node_probs`` pass through
untouched. Measuring or loading the curve never stops the engine: on any failure :meth:`StepBudget.for_runner` logs
one line and returns None (no budget: trees as proposed).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

from vllm_treespec.api import DraftTree
from vllm_treespec.cost.allocate import Allocation, DraftGate, allocate
from vllm_treespec.cost.model import CostRecord, CurveModel, StepCostModel
from vllm_treespec.cost.online import WARMUP_SAMPLES, CallCost, RequestsMedian, RunningMedian
from vllm_treespec.cost.trace import BudgetTrace

logger = logging.getLogger("vllm.treespec")

#: a gap between two forwards longer than this is the engine waiting for requests, not host work
MAX_HOST_SECONDS = 1.0
#: plain steps a token bucket of the plain steps' correction needs before the gate may draft at it, and the steps
#: after which its last one is too old (drift): drafting is priced against the plain step, so that price is
#: measured on plain steps, not taken from verifying steps of as many tokens or from a sweep taken while the machine
#: was busy (a fresh batch of 8 fp32 requests drafted for 30 steps against a plain step predicted 40% too dear)
PLAIN_SAMPLES = 3
PLAIN_SAMPLE_AGE = 64


class StepTime:
    """Seconds of a whole engine step: the forward (``forward``, the cost model) plus the measured host time."""

    def __init__(self, forward: StepCostModel) -> None:
        self.forward = forward
        self.host = RunningMedian()

    def predict_many(self, num_tokens: float | np.ndarray, num_reqs: int = 1, excess: float | np.ndarray = 0.0,
                     plain_tokens: float | None = None, request_excess: float | None = None) -> np.ndarray:
        """``excess``, ``request_excess``: the step's context terms E and E_R; ``plain_tokens``: its tokens
        without drafts (:meth:`StepCostModel.predict_many`)."""
        return self.forward.predict_many(num_tokens, num_reqs, excess, plain_tokens, request_excess) + \
            self.host.seconds

    def predict(self, num_tokens: float, num_reqs: int = 1, excess: float = 0.0,
                plain_tokens: float | None = None, request_excess: float | None = None) -> float:
        return float(self.predict_many(num_tokens, num_reqs, excess, plain_tokens, request_excess))

    def row_excess(self, seq_lens: np.ndarray) -> np.ndarray | None:
        """Per request, the context term of one more row of it (its sequence length beyond the curve's context);
        None when the model has no context term (a row costs the same at any length)."""
        if not self.forward.per_context:
            return None
        return np.asarray(seq_lens, np.float64) - self.forward.reference_context


class StepRecord(NamedTuple):
    """The step whose forward started last, for its host time when the next one starts."""
    started: float
    tokens: int
    reqs: int
    forward: float | None  # its measured seconds (None: not timed, on an asynchronous device)
    drafts: int  # draft tokens it verified
    draft_reqs: int  # the requests they were drafted for


class DrafterCost:
    """The drafter's seconds per call: timed online (:class:`CallCost`), else a start-up probe's curve, else None
    (not measured yet)."""

    def __init__(self, probed: CurveModel | None = None) -> None:
        self.probed = probed
        self.timed = CallCost()

    def predict(self, num_reqs: float) -> float | None:
        timed = self.timed.predict(num_reqs)
        if timed is not None:
            return timed
        return self.probed.predict(num_reqs) if self.probed is not None else None


class StepBudget:
    def __init__(self, cost: StepCostModel, max_nodes: int, drafter_cost: CurveModel | None = None,
                 batch_cap: int | None = None, min_gain: float = 0.0) -> None:
        self.cost = cost  # the forward's model
        self.step_time = StepTime(cost)
        #: what a step verifying drafts costs beyond a plain step's host time, by the requests it verified drafts of:
        #: the verifier's tree work and the rest of the host work its drafts add (vLLM's sampler, scheduler and input
        #: preparation on the draft rows)
        self.tree_work = RequestsMedian()
        self.drafter_cost = DrafterCost(drafter_cost)
        self.max_nodes = int(max_nodes)
        self.batch_cap = batch_cap
        self.min_gain = min_gain
        self.gate = DraftGate(self.step_time, self.drafter_cost)
        self.last: Allocation | None = None
        self._step: tuple[int, int, float] | None = None
        self._drafts = 0  # draft tokens in the step whose forward started last
        self._tree_seconds: float | None = None  # and the verifier's tree work on them (None: it had no trees)
        #: steps verifying drafts still to leave out of the model: the first compiles the tree path (step_finished)
        self._verifying_warmup = WARMUP_SAMPLES
        self._previous: StepRecord | None = None
        self._plain_seen: dict[int, tuple[int, int]] = {}  # plain-step bucket -> (steps observed, last step index)
        self._cycle_other = 0.0  # drafter and tree-work seconds since the last forward started
        self._excess = 0.0  # the context term of the step whose forward started last
        self._request_excess: float | None = None  # and its E_R (None: not known)
        self.stats = {"allocations": 0, "proposed_nodes": 0, "admitted_nodes": 0, "skipped_drafts": 0,
                      "probes": 0, "observed_steps": 0, "plain_samples": 0, "glance_steps": 0, "glance_trees": 0,
                      "glance_nodes": 0, "new_batches": 0}
        self.trace = BudgetTrace.from_env()

    @classmethod
    def from_record(cls, record: CostRecord, max_nodes: int, drafter: str | None = None,
                    model: StepCostModel | None = None, **options: Any) -> StepBudget:
        """``model``: the record's step model when the caller has fitted it already."""
        samples = record.drafters.get(drafter or "", [])
        drafter_cost = CurveModel.fit(samples) if samples else None
        budget = cls(model if model is not None else record.step_model(), max_nodes, drafter_cost, **options)
        if budget.trace is not None:
            budget.trace.keep_record(record)
        return budget

    @classmethod
    def for_runner(cls, runner: Any, max_nodes: int, refresh: bool = False, sweep: dict[str, Any] | None = None,
                   **options: Any) -> StepBudget | None:
        """The runner's budget from its cached or freshly measured curve (``sweep``: options of the sweep); None
        (one log line) if that fails."""
        try:
            from vllm_treespec.cost.measure import step_cost_model

            model, record = step_cost_model(runner, refresh=refresh, **(sweep or {}))
            return cls.from_record(record, max_nodes, type(getattr(runner, "drafter", None)).__name__, model,
                                   **options)
        except Exception as e:  # noqa: BLE001 - a cost model is an optimisation, never a reason to fail start-up
            logger.warning("vllm_treespec: no step-cost model for this engine (%s: %s); trees run as proposed",
                           type(e).__name__, e)
            return None

    @property
    def host_seconds(self) -> float:
        """Measured host time of a plain step outside its forward and the drafter's call."""
        return self.step_time.host.seconds

    # --- per step ----------------------------------------------------------------------------------------------
    def needs_plain_sample(self, plain_tokens: int) -> bool:
        """Whether the next step should run plain to measure the plain step it would be priced against: its token
        bucket has fewer than ``PLAIN_SAMPLES`` plain steps or none in the last ``PLAIN_SAMPLE_AGE`` steps. Only
        where forwards are timed (a CPU worker): elsewhere no step would ever count."""
        if not self.stats["observed_steps"]:
            return False
        seen, last = self._plain_seen.get(self.cost.correction.bucket(plain_tokens), (0, 0))
        return seen < PLAIN_SAMPLES or self.stats["observed_steps"] - last > PLAIN_SAMPLE_AGE

    def should_draft(self, num_reqs: int, row_excess: np.ndarray | None = None, step_reqs: int | None = None,
                     extra_seconds: float = 0.0) -> bool:
        """``row_excess``: :meth:`StepTime.row_excess` of the drafting requests (None: at the curve's context);
        ``step_reqs``: the requests of the step (default ``num_reqs``), whose plain step must be measured
        (:meth:`needs_plain_sample`) before drafts are priced against it; ``extra_seconds``: the proposer's
        catch-up for these requests (``TreeProposer.catch_up_price``), priced with the call."""
        if self.needs_plain_sample(num_reqs if step_reqs is None else step_reqs):
            self.stats["plain_samples"] += 1
            if self.trace is not None:
                self.trace.plan(gate="plain")
            return False
        self.gate.overhead = self.tree_work.predict(num_reqs)
        draft = self.gate.should_draft(num_reqs, self.max_nodes,
                                       row_excess=None if row_excess is None else float(np.mean(row_excess)),
                                       extra_seconds=extra_seconds)
        self.stats["skipped_drafts"] += not draft
        if self.trace is not None:
            rates = self.gate.last_rates
            self.trace.plan(gate="probe" if self.gate.probing else "draft" if draft else "skip",
                            **({"best": rates[0], "plain": rates[1]} if rates is not None else {}),
                            surplus_ms=self.gate.surplus * 1e3,
                            **({"catch_up_ms": extra_seconds * 1e3} if extra_seconds else {}))
        return draft

    def new_requests(self) -> None:
        """The step's requests are all new: the gate forgets what earlier requests' trees were worth
        (:meth:`DraftGate.forget`)."""
        self.gate.forget()
        self.stats["new_batches"] += 1

    def verified(self, accepted: int | None) -> None:
        """The drafts the last step accepted (None: it verified none): the gate learns what its allocation saved."""
        self.gate.verified(accepted)

    def drafted(self, num_reqs: int, seconds: float, unpriced_seconds: float = 0.0) -> None:
        """The drafter's call for ``num_reqs`` requests took ``seconds`` that its price counts, and
        ``unpriced_seconds`` more that it does not (a proposer's self-gated drafter, a catch-up: priced elsewhere).
        Neither is host time: counted as such, graft's head (8 ms a drafting step, bf16, batch 1) tripled the host
        time every step was priced with, plain steps too, and a dearer plain step makes every node look cheaper."""
        self.drafter_cost.timed.observe(num_reqs, seconds)
        self._cycle_other += seconds + max(unpriced_seconds, 0.0)
        if self.trace is not None:
            self.trace.plan(drafter_ms=seconds * 1e3)

    def draft_price(self, num_reqs: int) -> float:
        """Seconds the gate charges a drafting step of ``num_reqs`` requests beyond its forward: the drafter's
        measured call (0 before it is timed) and the tree work of pricing and handing over its trees."""
        return (self.drafter_cost.predict(num_reqs) or 0.0) + self.tree_work.predict(num_reqs)

    def glanced(self, trees: int, seconds: float) -> None:
        """A skipped step's glance (:meth:`TreeProposer.glance`) offered ``trees`` trees in ``seconds``. Not host
        time: once every skipped step glances, it is spent whether its trees are verified or not, so it belongs to
        neither price (counted as host time, it made plain steps dearer and every node look cheaper)."""
        self.stats["glance_steps"] += 1
        self.stats["glance_trees"] += trees
        self._cycle_other += max(seconds, 0.0)
        if self.trace is not None:
            self.trace.plan(glance_ms=seconds * 1e3, **({"gate": "glance"} if trees else {}))

    def admit(self, trees: Sequence[DraftTree | None], num_reqs: int | None = None,
              base_tokens: int | None = None, row_excess: np.ndarray | None = None,
              drafting_requests: int | None = None, glance: bool = False) -> list[DraftTree | None]:
        """The trees the drafter (or a skipped step's glance) proposed, trimmed to the nodes that pay (only those with
        node_probs change; a step that drafted nothing does not call it). ``drafting_requests``: how many
        requests it was asked for (default: the trees that are not None), the gate's share of each tree's nodes
        (:meth:`DraftGate.record`). ``row_excess``: per tree's request,
        :meth:`StepTime.row_excess` (None: every row at the curve's context). ``glance``: the trees are a skipped
        step's glance: priced and trimmed alike, but the gate learns nothing from them (they are what a cheap look
        found where it looked, not what the drafter's trees are worth, nor what drafting saves)."""
        if not any(t is not None and t.node_probs is not None for t in trees):
            if not glance and all(t is None for t in trees):
                self.gate.allocated(None)  # a call that proposed nothing saved nothing
            return list(trees)
        if not glance:
            self.gate.record(trees, requests=drafting_requests, per_request_cap=self.max_nodes)
        # the tree work of as many requests as were asked for trees (the allocator may keep fewer: priced high)
        tree_work = self.tree_work.predict(drafting_requests if drafting_requests is not None
                                           else sum(t is not None and t.num_nodes > 0 for t in trees))
        # a probe's trees are verified without the tree work's price, so that price is measured again
        overhead = 0.0 if self.gate.probing else tree_work
        allocation = allocate(trees, self.step_time, num_reqs=num_reqs, base_tokens=base_tokens,
                              per_request_cap=self.max_nodes, batch_cap=self.batch_cap,
                              overhead=overhead, min_gain=self.min_gain,
                              max_extra_seconds=self.gate.probe_seconds if self.gate.probing else None,
                              explore=self.gate.probing, row_excess=row_excess)
        self.last = allocation
        if glance:
            self.stats["glance_nodes"] += allocation.total_nodes
        else:
            # a probe is priced without the tree work: what it saves is counted with it
            self.gate.allocated(allocation, tree_work if self.gate.probing else 0.0)
        self.stats["allocations"] += 1
        self.stats["probes"] += self.gate.probing
        offered = sum(min(t.num_nodes, self.max_nodes) for t in trees if t is not None)
        self.stats["proposed_nodes"] += offered
        self.stats["admitted_nodes"] += allocation.total_nodes
        if self.trace is not None:
            self.trace.plan(admitted=allocation.total_nodes, expected=allocation.expected_tokens, offered=offered,
                            offered_depth=max((int(t.depths().max()) for t in trees if t is not None and t.num_nodes),
                                              default=0))
        return allocation.trees

    def step_started(self, num_tokens: int, num_reqs: int, excess: float = 0.0, drafts: int = 0,
                     request_excess: float | None = None, draft_reqs: int | None = None) -> None:
        """A forward of ``num_tokens`` tokens from ``num_reqs`` requests (``excess``, ``request_excess``: its
        context terms E and E_R; ``drafts``: its draft tokens, ``draft_reqs``: the requests they belong to, default
        all) starts: the previous step's host time is what the time since its start leaves after its forward, its
        drafter call and its tree work. A plain step's is the plain steps' host time; a step that verified drafts
        adds what it ran beyond that to its tree work, the price of verifying drafts for as many requests: at 8-16
        served requests its sampler, scheduler and input preparation ran ~1 ms a step above a plain step's beside
        the verifier's tree work, unpriced while one host median covered both kinds of step."""
        now = time.perf_counter()
        if self._previous is not None:
            started, tokens, reqs, forward, drafted, drafted_reqs = self._previous
            if forward is None:  # not timed (an asynchronous device): the model's prediction
                forward = self.cost.predict(tokens, reqs, self._excess, plain_tokens=tokens - drafted,
                                            request_excess=self._request_excess)
            host = now - started - forward - self._cycle_other
            if host <= MAX_HOST_SECONDS:
                if drafted or self._tree_seconds is not None:
                    self.tree_work.add(max((self._tree_seconds or 0.0) + host - self.host_seconds, 0.0),
                                       max(drafted_reqs, 1))
                else:
                    self.step_time.host.add(max(host, 0.0))
        self._cycle_other = 0.0
        self._tree_seconds = None
        self._step = (int(num_tokens), int(num_reqs), now)
        self._excess = float(excess)
        self._request_excess = None if request_excess is None else float(request_excess)
        self._drafts = int(drafts)
        if self.trace is not None:
            self.trace.step(int(num_reqs), int(num_tokens))
            self.trace.note(host_ms=self.host_seconds * 1e3, drafts=self._drafts)
            if self.cost.per_context:
                self.trace.note(excess=self._excess)
                if self._request_excess is not None:
                    self.trace.note(request_excess=self._request_excess)
            if num_tokens > 0 and num_reqs > 0:  # before this step's time refines the model
                self.trace.note(predicted_ms=self.cost.predict(int(num_tokens), int(num_reqs), self._excess,
                                                               plain_tokens=int(num_tokens) - self._drafts,
                                                               request_excess=self._request_excess) * 1e3)
        if num_tokens > 0 and num_reqs > 0:
            draft_reqs = (int(num_reqs) if draft_reqs is None else int(draft_reqs)) if drafts else 0
            self._previous = StepRecord(now, int(num_tokens), int(num_reqs), None, self._drafts, draft_reqs)
        else:
            self._previous = None

    def step_finished(self) -> None:
        """Fold the forward's time since :meth:`step_started` into the model (the caller synchronises the device)."""
        if self._step is None:
            return
        num_tokens, num_reqs, started = self._step
        self._step = None
        if num_tokens > 0 and num_reqs > 0:
            seconds = time.perf_counter() - started
            if self._drafts and self._verifying_warmup > 0:
                # The engine's first step that verifies drafts compiles what tree steps run (numba kernels, from a
                # cold cache after an install or upgrade: 235 ms for a 36 ms step). Folded in, it doubled the
                # price of every drafting step for good (the steps it priced out were never verified again to
                # correct it: graft verified 1 node a step for a whole batch-1 run); like a drafter's first call
                # (CallCost) it is not counted.
                self._verifying_warmup -= 1
            else:
                self.cost.observe(num_tokens, num_reqs, seconds, self._excess, drafts=self._drafts,
                                  request_excess=self._request_excess)
            self._previous = self._previous._replace(forward=seconds)  # the record step_started made
            self.stats["observed_steps"] += 1
            if not self._drafts:
                bucket = self.cost.correction.bucket(num_tokens)
                self._plain_seen[bucket] = (self._plain_seen.get(bucket, (0, 0))[0] + 1, self.stats["observed_steps"])
            if self.trace is not None:
                self.trace.note(forward_ms=seconds * 1e3)

    def tree_worked(self, seconds: float) -> None:
        """The verifier's host work of a step that verified trees (attach, acceptance, KV compaction): with the
        rest of what that step runs beyond a plain step, measured when the next step starts, the tree work's
        sample (:meth:`step_started`)."""
        self._tree_seconds = (self._tree_seconds or 0.0) + seconds
        if self.trace is not None:
            self.trace.note(tree_ms=seconds * 1e3)
        self._cycle_other += seconds

    def report(self) -> dict[str, Any]:
        return {**self.stats, "corrections": self.cost.correction.buckets,
                "draft_corrections": self.cost.draft_correction.buckets,
                "draft_corrections_by_requests": {2 ** b: table.buckets for b, table
                                                  in sorted(self.cost.draft_by_requests.items())},
                "host_ms": self.host_seconds * 1e3,
                "tree_work_ms": self.tree_work.seconds * 1e3,
                "tree_work_ms_by_requests": {reqs: s * 1e3 for reqs, s in self.tree_work.buckets.items()},
                "drafter_ms": {2 ** b: s * 1e3 for b, s in sorted(self.drafter_cost.timed.buckets.items())}}


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """The sweep's dummy steps leave torch's random state as they found it (vLLM seeds it just before)."""
    import torch

    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def install_at_startup(runner: Any) -> StepBudget | None:
    """At the worker's warm-up, after the KV cache exists: give the runner's tree verifier its budget (cached
    curve, or a sweep of a few seconds), unless the speculative config has ``"cost_budget": false``."""
    from vllm_treespec.cost.measure import STARTUP_SWEEP
    from vllm_treespec.settings import cost_budget_enabled

    verifier = getattr(runner, "_treespec_verifier", None)
    if verifier is None:
        return None
    if not cost_budget_enabled(getattr(runner, "vllm_config", None)):
        logger.info("vllm_treespec: cost_budget is off: every tree is verified as proposed")
        return None
    started = time.perf_counter()
    with rng_preserved():
        budget = StepBudget.for_runner(runner, verifier.max_nodes, sweep=STARTUP_SWEEP)
    if budget is not None:
        logger.info("vllm_treespec: step-cost budget on (%.1f s at start-up; forward %.1f ms at 1 token, %.1f ms at "
                    "%d)", time.perf_counter() - started, budget.cost.predict(1) * 1e3,
                    budget.cost.predict(1 + verifier.max_nodes) * 1e3, 1 + verifier.max_nodes)
    verifier.budget = budget
    return budget


def install_budget(worker: Any, refresh: bool = False, **options: Any) -> dict[str, Any]:
    """For ``LLM.collective_rpc`` (it runs between engine steps, so the sweep's dummy steps cannot disturb a real
    one): give this worker's tree verifier a :class:`StepBudget` from the cached curve or a fresh sweep (``refresh``:
    always measure). Returns what was installed."""
    verifier = getattr(worker.model_runner, "_treespec_verifier", None)
    if verifier is None:
        return {"installed": False, "reason": "no tree verifier on this worker"}
    with rng_preserved():
        budget = StepBudget.for_runner(worker.model_runner, verifier.max_nodes, refresh=refresh, **options)
    verifier.budget = budget
    return {"installed": budget is not None}


def budget_report(worker: Any) -> dict[str, Any]:
    """For ``LLM.collective_rpc``: the installed budget's counters and learnt costs (empty without one)."""
    verifier = getattr(worker.model_runner, "_treespec_verifier", None)
    budget = getattr(verifier, "budget", None)
    if budget is None:
        return {}
    return {**budget.report(), "expectation_factor": verifier.acceptance.expectation.factor}
