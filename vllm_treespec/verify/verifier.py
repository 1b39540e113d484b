"""TreeVerifier: the per-runner orchestration of tree verification, called by the runner patch
(:mod:`vllm_treespec.patches.model_runner`) at four points of each step: propose, attach, sample, finished."""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import Any

import numpy as np
import torch

from vllm_treespec.api import DraftTree, ProposeContext, TreeProposer
from vllm_treespec.attn import plan
from vllm_treespec.attn.compact import compact_layers
from vllm_treespec.cost.model import context_excess
from vllm_treespec.settings import NEVER_DRAFT_ENV
from vllm_treespec.tree import TreeBatch
from vllm_treespec.verify.accept import (accept, accept_chains, argmax_rows, chain_target_rows,
                                         chains_the_verifier_accepts, greedy_mask, logits_rows, read_logits,
                                         sample_bonus_rows, verification_results, write_chain_form)
from vllm_treespec.verify.attach import (build_batch, committable_depths, cut_to_depth, flatten_trees, match_scheduled,
                                         rewrite_positions)
from vllm_treespec.verify.calibration import AcceptanceTracker
from vllm_treespec.verify.chainize import aux_in_asked_order, chainize, committed_rows
from vllm_treespec.verify.compact import accepted_moves, slots
from vllm_treespec.verify.report import StepTimer
from vllm_treespec.verify.support import attention_layers, tree_unsupported_reason, unsupported_model_reason
from vllm_treespec.verify.topk import target_topk

logger = logging.getLogger("vllm.treespec")

#: recent allocations whose deepest admitted node sets ``ProposeContext.useful_depth``, and whose largest admitted
#: tree ``ProposeContext.useful_nodes``
ADMITTED_WINDOW = 16

# The vLLM objects tree verification relies on, attribute by attribute: everything the modules of CONTRACT_MODULES
# read or write on vLLM's model runner (GPUModelRunner, CPUModelRunner), its InputBatch, the BlockTable of KV-cache
# group 0 and the runner's CachedRequestState entries (the step-cost sweep of vllm_treespec.cost drives the runner's
# dummy steps). tests/unit/test_runner_contract.py checks that those modules use exactly these (parsing them) and that
# the installed vLLM has each.
CONTRACT_MODULES = ("vllm_treespec.verify", "vllm_treespec.kv_view", "vllm_treespec.patches.model_runner",
                    "vllm_treespec.cost", "vllm_treespec.patches.cpu_worker", "vllm_treespec.patches.gpu_worker",
                    "vllm_treespec.patches.draft_delivery")
RUNNER_ATTRIBUTES = (
    "_draft_prob_req_ids", "_draft_probs", "_dummy_run", "_sync_device", "device", "drafter", "input_batch",
    "kv_cache_config", "max_model_len", "max_num_tokens", "model", "positions", "query_start_loc", "requests",
    "scheduler_config", "speculative_config", "take_draft_token_ids", "uniform_decode_query_len",
    "use_aux_hidden_state_outputs", "uses_mrope", "vllm_config",
)
INPUT_BATCH_ATTRIBUTES = (
    "block_table", "num_computed_tokens_cpu", "num_prompt_tokens", "num_reqs", "num_tokens_no_spec", "req_id_to_index",
    "req_ids", "sampling_metadata", "token_ids_cpu",
)
BLOCK_TABLE_ATTRIBUTES = ("block_size", "block_table")
REQUEST_STATE_ATTRIBUTES = ("sampling_params",)
#: set on the runner by the patch; must not collide with a vLLM attribute
OWN_RUNNER_ATTRIBUTES = ("_treespec_verifier",)


class TreeVerifier:
    """One per model runner whose drafter is a :class:`~vllm_treespec.api.TreeProposer`."""

    def __init__(self, runner: Any, proposer: TreeProposer) -> None:
        self.runner = runner
        self.proposer = proposer
        self.max_nodes = int(runner.speculative_config.num_speculative_tokens)
        self.pending: dict[str, DraftTree] = {}
        self.batch: TreeBatch | None = None
        self.enabled: bool | None = None  # decided lazily, once the model and KV cache exist
        self.timer = StepTimer()
        self.stats = {"tree_steps": 0, "tree_rows": 0, "accepted": 0}
        self.last_moves: tuple[np.ndarray, np.ndarray] | None = None
        self._layers: list[Any] | None = None
        #: a vllm_treespec.cost.budget.StepBudget, installed at the worker's warm-up (cost.budget.install_at_startup)
        #: unless the config says "cost_budget": false: gates the drafter, trims scored trees to the nodes that pay
        #: and learns step times; None = trees run as proposed
        self.budget: Any = None
        self._tree_seconds = 0.0  # this step's host work on trees so far (attach, acceptance, compaction)
        self._probe_cursor = 0  # where the next probe that drafts for some requests takes its first
        #: of each of the last allocations of drafted trees: (the deepest admitted node, the most nodes one request's
        #: tree was admitted); (0, 0): none admitted
        self._admitted: collections.deque[tuple[int, int]] = collections.deque(maxlen=ADMITTED_WINDOW)
        self._requests: set[str] = set()  # the last step's requests (_follow_requests)
        self.never_draft = os.environ.get(NEVER_DRAFT_ENV) == "1"
        if self.never_draft:
            logger.warning("vllm_treespec: %s=1: this engine never drafts (its proposer only observes each step)",
                           NEVER_DRAFT_ENV)
        #: acceptance rates by source and raw confidence, learned from every step's committed tokens: they turn
        #: node_probs into acceptance probabilities for the budget, and graft ranks its sources by them
        self.acceptance = AcceptanceTracker(getattr(proposer, "acceptance_sources", ()))
        if proposer is not None:
            proposer.use_acceptance(self.acceptance.calibration)

    # --- support -----------------------------------------------------------------------------------------------
    def _decide_support(self) -> bool:
        reason = unsupported_model_reason(self.runner, self._attention_layers())
        if reason:
            logger.warning("vllm_treespec: tree verification is off for this model (%s); proposals run as chains.",
                           reason)
        return reason is None

    def _attention_layers(self) -> list[Any]:
        if self._layers is None:
            self._layers = attention_layers(self.runner.vllm_config)
        return self._layers

    def _request_can_use_tree(self, req_id: str) -> bool:
        state = self.runner.requests.get(req_id)
        return state is not None and tree_unsupported_reason(state.sampling_params) is None

    # --- hook: propose ---------------------------------------------------------------------------------------
    def propose(self, sampled_token_ids: list[list[int]], hidden_states=None, aux_hidden_states=None,
                query_start_loc=None, scheduled_drafts: dict[str, list[int]] | None = None) -> list[list[int]]:
        if self.enabled is None:
            self.enabled = self._decide_support()
        input_batch = self.runner.input_batch
        num_reqs = len(sampled_token_ids)
        req_ids = list(input_batch.req_ids[:num_reqs])
        tracking = self._tracks_acceptance()
        if tracking:
            stats = self.acceptance.stats
            learned, unverified = stats["learned_nodes"], stats["unverified_nodes"]
            accepted = self.acceptance.committed(req_ids, sampled_token_ids)
            if self.budget is not None:
                self.budget.verified(accepted)
                trace = self.budget.trace
                if trace is not None:
                    if accepted is not None:
                        trace.note(accepted=accepted)
                    taught = {"learned": stats["learned_nodes"] - learned,
                              "unverified": stats["unverified_nodes"] - unverified}
                    trace.note(**{field: nodes for field, nodes in taught.items() if nodes})
        if self.budget is not None:
            self._follow_requests(req_ids)
        ctx = ProposeContext(req_ids=req_ids, sampled_token_ids=sampled_token_ids,
                             num_tokens=input_batch.num_tokens_no_spec, token_ids=input_batch.token_ids_cpu,
                             max_nodes=self.max_nodes, num_prompt_tokens=input_batch.num_prompt_tokens,
                             step_cost=self.budget.step_time if self.budget is not None else None,
                             expectation_factor=self.acceptance.expectation.factor if self.budget is not None else 1.0)
        proposer = self.proposer
        if proposer.needs_hidden_states and hidden_states is not None and query_start_loc is not None:
            # rows were chainized after sample()
            ctx.hidden_states = hidden_states
            ctx.aux_hidden_states = aux_in_asked_order(aux_hidden_states, proposer.aux_hidden_state_layers)
            ctx.hidden_row_start, ctx.hidden_row_index = committed_rows(query_start_loc, num_reqs, req_ids,
                                                                        sampled_token_ids, scheduled_drafts)
            # computed before this step = position of the step's first row
            ctx.hidden_position_start = input_batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        if proposer.needs_kv_cache and self.enabled:
            from vllm_treespec.kv_view import build_view

            ctx.kv_cache = build_view(self.runner, self._attention_layers(), num_reqs, sampled_token_ids,
                                      query_start_loc)
        # a row of a request attends to its whole sequence: the budget prices rows of long requests higher
        row_excess = (self.budget.step_time.row_excess(input_batch.num_tokens_no_spec[:num_reqs])
                      if self.budget is not None else None)
        ctx.row_excess = row_excess
        if self.budget is not None and self._admitted:
            ctx.useful_depth = max(depth for depth, _ in self._admitted) + 1
            # twice what one tree was admitted, plus one: a tree that pays more than lately is offered in full within
            # a few steps, and a probe drafts in full
            ctx.useful_nodes = 2 * max(nodes for _, nodes in self._admitted) + 1
        started = time.perf_counter()
        drafted, drafting, glanced = self._draft(ctx)
        if drafting and ctx.useful_nodes is not None and self.budget.trace is not None:
            self.budget.trace.plan(useful_nodes=ctx.useful_nodes)
        if not drafting:  # no tree for any request (the gate skipped the drafter, or none needs a draft)
            return self._hand_over_nothing(num_reqs, tracking, ctx.expectation_factor)
        # nodes no step can commit (the request ends first) are neither priced nor verified
        reach = committable_depths(self.runner.requests, req_ids, input_batch.num_tokens_no_spec,
                                   input_batch.num_prompt_tokens, self.runner.max_model_len)
        proposed = [cut_to_depth(t, int(d)) if ctx.needs_draft(i) else None
                    for i, (t, d) in enumerate(zip(drafted, reach))]
        trees = proposed
        if self.budget is not None:
            # A probe is priced without the expectation correction: the correction learns only from verified drafts,
            # so once it has stopped the drafting, probes priced by it verify a node or two and it never recovers
            # (one unlucky prompt kept graft off for the rest of a batch-1 run)
            probing = self.budget.gate.probing
            calibrated = self.acceptance.calibrate(proposed, corrected=not probing, req_ids=req_ids)
            trees = self.budget.admit(calibrated, num_reqs, row_excess=row_excess, drafting_requests=drafting,
                                      glance=glanced)
            if not glanced:
                admitted = [t for t in trees if t is not None and t.num_nodes]
                self._admitted.append((max((int(t.depths().max()) for t in admitted), default=0),
                                       max((t.num_nodes for t in admitted), default=0)))
            if self.budget.trace is not None:
                self.budget.trace.plan(factor=ctx.expectation_factor)
        if tracking:
            self.acceptance.handed(req_ids, proposed, trees)
        drafts, self.pending = flatten_trees(ctx, trees,
                                             lambda req_id: bool(self.enabled) and self._request_can_use_tree(req_id))
        if self.budget is not None and not glanced:
            # the price of drafting at all: the drafter's call and the host work that pricing and handing over its
            # trees takes (calibration, allocation, flattening); the gate weighs it against what the trees yield. A
            # drafter the proposer gates itself (graft's head) is priced by the proposer's gate, not by this one.
            call = time.perf_counter() - started
            priced = max(call - ctx.self_gated_seconds - ctx.deferred_seconds, 0.0)
            self.budget.drafted(drafting, priced, call - priced)
            if ctx.self_gated_seconds and self.budget.trace is not None:
                self.budget.trace.plan(head_ms=ctx.self_gated_seconds * 1e3)
        return drafts

    def _follow_requests(self, req_ids: list[str]) -> None:
        """A step whose requests are all new (at one request: every new prompt) starts the budget's gate afresh and
        offers their trees in full: what the requests before them drafted says little of their text. (The engine's
        first step has no requests before it: its gate knows nothing yet, and probes.)"""
        if self._requests and self._requests.isdisjoint(req_ids):
            self.budget.new_requests()
            self._admitted.clear()
        self._requests = set(req_ids)

    def _hand_over_nothing(self, num_reqs: int, tracking: bool, factor: float) -> list[list[int]]:
        """What pricing and handing over a step's trees does when it has none, without walking them: a plain step
        at 8-16 served requests is most steps, and each of those walks cost tens of microseconds there."""
        if self.budget is not None and self.budget.trace is not None:
            self.budget.trace.plan(factor=factor)
        if tracking:
            self.acceptance.handed((), (), ())
        self.pending = {}
        return [[] for _ in range(num_reqs)]

    def _tracks_acceptance(self) -> bool:
        """Learn acceptance rates: the budget weighs nodes by them, a proposer with named sources ranks by them."""
        return self.budget is not None or bool(getattr(self.proposer, "acceptance_sources", ()))

    def _draft(self, ctx: ProposeContext) -> tuple[list[DraftTree | None], int, bool]:
        """The proposer's trees, the requests it drafted for (0 when it was not called) and whether they are a
        glance's; no trees at all when the budget's gate says drafting would not pay (then the proposer only observes
        the step), unless its glance offers some (:meth:`TreeProposer.glance`). A probe asks only for as many
        requests' trees as its allowance verifies nodes (``ctx.draft_rows``).
        The gate prices the drafting requests' rows by ``ctx.row_excess``."""
        budget = self.budget
        row_excess = ctx.row_excess
        rows = [i for i in range(ctx.num_reqs) if ctx.needs_draft(i)]
        drafting = len(rows)
        if self.never_draft or (budget is not None and drafting and not budget.should_draft(
                drafting, None if row_excess is None else row_excess[rows], step_reqs=ctx.num_reqs,
                extra_seconds=self.proposer.catch_up_price(ctx, rows))):
            self.proposer.observe(ctx)  # its state follows the committed tokens; cheap, and counted as host time
            # a proposer that does not override glance is not asked: its skipped steps count no glance
            if self.never_draft or not drafting or type(self.proposer).glance is TreeProposer.glance:
                return [None] * ctx.num_reqs, 0, False
            started = time.perf_counter()
            glanced = self.proposer.glance(ctx, rows)
            if glanced is not None:
                self._check_tree_count(glanced, ctx, "glance")
            offered = 0 if glanced is None else sum(t is not None for t in glanced)
            if budget is not None:
                budget.glanced(offered, time.perf_counter() - started)
            if not offered:
                return [None] * ctx.num_reqs, 0, False
            return glanced, drafting, True
        ctx.probing = budget is not None and budget.gate.probing
        if ctx.probing:
            ctx.useful_depth = ctx.useful_nodes = None  # a probe measures what the full trees are worth
            ctx.probe_seconds = budget.gate.probe_seconds
        if ctx.probing and budget.gate.probe_requests is not None and budget.gate.probe_requests < drafting:
            ctx.draft_rows = self._probe_rows(rows, budget.gate.probe_requests, ctx.num_reqs)
            drafting = budget.gate.probe_requests
        if budget is not None:
            ctx.shared_draft_seconds = budget.draft_price(drafting)
        trees = self.proposer.propose_trees(ctx)
        self._check_tree_count(trees, ctx, "propose_trees")
        return trees, drafting, False  # propose() times the call with the work on its trees that follows

    def _check_tree_count(self, trees: list[DraftTree | None], ctx: ProposeContext, method: str) -> None:
        if len(trees) != ctx.num_reqs:
            raise RuntimeError(f"{type(self.proposer).__name__}.{method} returned {len(trees)} trees "
                               f"for {ctx.num_reqs} requests")

    def _probe_rows(self, rows: list[int], count: int, num_reqs: int) -> np.ndarray:
        """A mask of ``count`` of ``rows``, taken in turn from one probe to the next (every request is probed)."""
        start = self._probe_cursor % len(rows)
        self._probe_cursor = start + count
        mask = np.zeros(num_reqs, dtype=bool)
        mask[[rows[(start + j) % len(rows)] for j in range(count)]] = True
        return mask

    # --- hook: after _prepare_inputs -------------------------------------------------------------------------
    def attach(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> None:
        started = time.perf_counter()
        if self.budget is not None:
            num_reqs = len(num_scheduled_tokens)
            excess, request_excess = 0.0, None
            if self.budget.cost.per_context:  # each row attends to its request's sequence up to the step's end
                seq_lens = self.runner.input_batch.num_computed_tokens_cpu[:num_reqs] + num_scheduled_tokens
                reference = self.budget.cost.reference_context
                excess = context_excess(num_scheduled_tokens, seq_lens, reference)
                request_excess = context_excess(1, seq_lens, reference)  # each sequence read once
            scheduled = scheduler_output.scheduled_spec_decode_tokens.values()
            drafts, draft_reqs = sum(len(d) for d in scheduled), sum(bool(d) for d in scheduled)
            self.budget.step_started(int(np.sum(num_scheduled_tokens)), num_reqs, excess, drafts, request_excess,
                                     draft_reqs)
        if self._tracks_acceptance():
            self.acceptance.scheduled(scheduler_output.scheduled_spec_decode_tokens)
        pending, self.pending = self.pending, {}
        self.batch = None
        self._tree_seconds = 0.0
        plan.publish(None)
        if not pending:
            return
        input_batch = self.runner.input_batch
        found = match_scheduled(pending, scheduler_output.scheduled_spec_decode_tokens, input_batch.req_id_to_index,
                                num_scheduled_tokens)
        if not found:
            return
        batch = build_batch(found, self.runner.query_start_loc.np, input_batch.num_computed_tokens_cpu)
        rewrite_positions(self.runner.positions, batch)
        self.batch = batch
        plan.publish(batch)
        if self.stats["tree_steps"] == 0:
            logger.info("vllm_treespec: tree verification active (%d tree rows in the first tree step)", batch.num_reqs)
        self._tree_seconds = time.perf_counter() - started
        self.timer.add("attach", self._tree_seconds)

    # --- hook: around _sample -----------------------------------------------------------------------------------
    def sample(self, original, logits: torch.Tensor, spec_decode_metadata: Any):
        if self.budget is not None and logits.device.type == "cpu":  # a CPU forward is synchronous: it ended here
            self.budget.step_finished()
        batch, self.batch = self.batch, None
        plan.publish(None)
        metadata = spec_decode_metadata
        if metadata is None or not any(metadata.num_draft_tokens):
            # vLLM builds spec-decode metadata for every step of a speculative engine (on CPU a step without drafts
            # is prepared without it: patches.model_runner.prepare_inputs_of_step) and runs its rejection sampler
            # even when no request has a draft; without drafts that is the plain sampler's result at about twice
            # its cost (~0.5 ms a step on CPU): take the plain sampler, as without speculation
            return original(logits, None)
        input_batch = self.runner.input_batch
        # Where every drafted request is a tree or a greedy chain and no request needs vLLM's processing of draft
        # rows, the verifier accepts them itself and vLLM's plain sampler samples each request's bonus row
        # (sample_bonus_rows): the rejection sampler's work on the draft rows would be thrown away
        chains = chains_the_verifier_accepts(
            metadata.num_draft_tokens, batch.rows if batch is not None else np.zeros(0, np.int64),
            input_batch.req_ids, self.runner.requests, input_batch.sampling_metadata)
        fast = chains is not None
        if batch is None and not fast:
            return original(logits, metadata)
        started = time.perf_counter()
        # Read what acceptance needs before vLLM's sampler runs (it may modify logits in place)
        chain_argmax = argmax_rows(logits, chain_target_rows(metadata.num_draft_tokens, chains)) if fast else None
        if batch is not None:
            logits_index, row_offsets, widths = logits_rows(batch, metadata.num_draft_tokens)
            greedy = greedy_mask(batch, self.runner.requests)
            # argmax for greedy rows; a float32 copy only where sampling or the proposer needs full distributions
            argmax, tree_logits = read_logits(logits, logits_index,
                                              full=not greedy.all() or self.proposer.wants_target_logits)
            learns = type(self.proposer).on_verified is not TreeProposer.on_verified
            topk = (target_topk(logits, logits_index, self.proposer.wants_target_topk)
                    if learns and self.proposer.wants_target_topk > 0 else None)
            seconds = time.perf_counter() - started
            self.timer.add("accept", seconds)
            self._tree_seconds += seconds

        output = sample_bonus_rows(original, logits, metadata) if fast else original(logits, metadata)
        if fast:
            accept_chains(output.sampled_token_ids, chains, metadata.num_draft_tokens, metadata.draft_token_ids,
                          chain_argmax)
        if batch is None:
            return output

        started = time.perf_counter()
        out_tokens, out_nodes, out_len = accept(
            batch, row_offsets, widths, argmax, output.sampled_token_ids.shape[1] - 1, greedy, tree_logits,
            input_batch.sampling_metadata, input_batch.num_reqs)
        write_chain_form(output.sampled_token_ids, batch, out_tokens)
        accept_seconds = time.perf_counter() - started
        self.timer.add("accept", accept_seconds)

        started = time.perf_counter()
        self.last_moves = self._compact(batch, out_nodes, out_len)
        compact_seconds = time.perf_counter() - started
        self.timer.add("compact", compact_seconds)
        self._tree_seconds += accept_seconds + compact_seconds
        self.timer.steps += 1
        self.stats["tree_steps"] += 1
        self.stats["tree_rows"] += batch.num_reqs
        self.stats["accepted"] += int(out_len.sum())
        if os.environ.get("VLLM_TREESPEC_DEBUG"):
            logger.warning("vllm_treespec step: rows=%s accepted=%s", batch.rows.tolist(), out_len.tolist())

        if learns:
            started = time.perf_counter()
            self.proposer.on_verified(verification_results(batch, out_tokens, out_nodes, out_len, tree_logits,
                                                           row_offsets, widths, self.proposer.wants_target_logits,
                                                           topk))
            self._tree_seconds += time.perf_counter() - started
        if self.budget is not None:
            self.budget.tree_worked(self._tree_seconds)
        return output

    # --- KV compaction --------------------------------------------------------------------------------------------
    def _compact(self, batch: TreeBatch, out_nodes: np.ndarray, out_len: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray] | None:
        """Move accepted nodes' K/V from their linear slots to the chain slots in every layer.
        Returns the (source, destination) flattened-query rows, for chainizing hidden states."""
        moves = accepted_moves(batch, out_nodes, out_len)
        if moves is None:
            return None
        block_table = self.runner.input_batch.block_table[0]
        table, block_size = block_table.block_table.np, block_table.block_size
        compact_layers(self._attention_layers(), slots(table, block_size, moves.rows, moves.src_positions),
                       slots(table, block_size, moves.rows, moves.dst_positions))
        return moves.src_query_rows, moves.dst_query_rows

    def chainize_rows(self, tensors) -> None:
        """Apply this step's accepted-path moves to per-token rows (hidden / aux hidden states) in place."""
        moves, self.last_moves = self.last_moves, None
        if moves is not None:
            chainize(tensors, moves)

    # --- hook: finished requests --------------------------------------------------------------------------------
    def finished(self, req_ids: set[str]) -> None:
        if req_ids:
            for req_id in req_ids:
                self.pending.pop(req_id, None)
            self.acceptance.forget(req_ids)
            if self.proposer.wants_finished_outputs:
                self.proposer.on_outputs_finished(self._outputs_of(req_ids))
            self.proposer.on_requests_finished(set(req_ids))

    def _outputs_of(self, req_ids: set[str]) -> dict[str, np.ndarray]:
        """The output tokens of the finishing requests still in the input batch (called before vLLM removes them)."""
        batch = self.runner.input_batch
        outputs = {}
        for req_id in req_ids:
            row = batch.req_id_to_index.get(req_id)
            if row is not None:
                start, stop = int(batch.num_prompt_tokens[row]), int(batch.num_tokens_no_spec[row])
                outputs[req_id] = batch.token_ids_cpu[row, start:stop].copy()
        return outputs

    # --- hook: engine shutdown ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """The worker is shutting down: the proposer saves what it keeps (a failure is one log line: vLLM's own
        shutdown goes on)."""
        try:
            self.proposer.on_shutdown()
        except Exception as e:  # noqa: BLE001 - shutting down must not fail on a proposer's save
            logger.warning("vllm_treespec: %s's shutdown failed: %s: %s", type(self.proposer).__name__,
                           type(e).__name__, e)
