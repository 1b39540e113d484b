"""The ``graft`` proposer (:class:`GraftProposer`): per request and step, draft (a model drafter or the most confident
retrieval source), prune at the checkpoints, graft retrieved continuations into the freed budget, and learn from
every verification (see the package docstring)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from vllm_treespec.api import DraftTree, ProposeContext, TreeProposer, VerificationResult
from vllm_treespec.cost.allocate import DraftGate
from vllm_treespec.cost.online import CallCost
from vllm_treespec.device_defaults import DEFAULT_MIN_NODE_CONFIDENCE, DEFAULT_MODEL_DRAFT_MAX_BATCH, device_kind
from vllm_treespec.proposers._retrieval_base import compile_retrieval_kernels, open_store_file, save_store_file
from vllm_treespec.proposers.graft.assemble import AssembledTree, assemble_tree, empty_assembled
from vllm_treespec.proposers.graft.budget import budget_curve
from vllm_treespec.proposers.graft.calibration import load_calibration
from vllm_treespec.proposers.graft.drafter import MODEL_SOURCE, ModelDrafter, check_head_path, load_model_drafter
from vllm_treespec.proposers.graft.growth import (DraftGrowth, compile_growth_kernel, first_checkpoint_confidence,
                                                  grow_draft_tree, grow_retrieved)
from vllm_treespec.proposers.graft.options import DEFAULT_CHECKPOINTS, DEFAULT_THRESHOLDS, NAMED_HEADS, GraftOptions
from vllm_treespec.proposers.graft.sources import (FALLBACK_VOCAB_SIZE, MATCHED_SOURCES, RetrievalSources,
                                                   match_class, match_class_sources)
from vllm_treespec.retrieval import RetrievedTree, load_datastore
from vllm_treespec.verify.calibration import AcceptanceCalibration
from vllm_treespec.verify.topk import target_topk

logger = logging.getLogger("vllm.treespec")


@dataclass
class GraftStats:
    steps: int = 0
    trees: int = 0
    #: nodes drafted (before the budget and the floor cut the tree)
    draft_nodes: int = 0
    #: nodes of the final trees that grafts added
    grafted_nodes: int = 0
    pruned: int = 0
    draft_source: dict[str, int] = field(default_factory=dict)
    #: steps where a loaded model drafter sat out because the batch exceeded model_draft_max_batch
    retrieval_only_steps: int = 0
    #: retrieval-only trees offered on steps the verifier's gate skipped (option ``glance``)
    glance_trees: int = 0
    #: steps where the head drafted only for the requests no retrieval source matched (option ``unmatched_head``)
    unmatched_head_steps: int = 0


class GraftProposer(TreeProposer):
    options_type = GraftOptions

    def __init__(self, vllm_config: Any = None, options: GraftOptions | None = None, *,
                 drafter: ModelDrafter | None = None, vocab_size: int | None = None) -> None:
        super().__init__(vllm_config, options)
        opts: GraftOptions = self.options
        calibration = load_calibration(opts.calibration_path) if opts.calibration_path else None
        checkpoints = opts.checkpoints or (calibration.checkpoints if calibration else DEFAULT_CHECKPOINTS)
        thresholds = opts.thresholds or (calibration.thresholds if calibration else DEFAULT_THRESHOLDS)
        self.checkpoints = dict(zip(checkpoints, thresholds)) if opts.prune else {}
        self.first_checkpoint = int(checkpoints[0])
        self.sources = self._retrieval_sources(vllm_config, vocab_size)
        # finished outputs go whole into the global store: graft's own steps see an output only where it drafted
        self.wants_finished_outputs = self.sources.suffix is not None and self.sources.suffix.global_store is not None
        self.store_file = open_store_file(
            "graft option 'suffix_global_file'", opts.suffix_global_file, self.sources.suffix, vllm_config,
            opts.suffix_global_save_every) if opts.suffix_global_file is not None else None
        # the successor table learns the target's top-k at every verified row (on_verified)
        self.wants_target_topk = self.sources.successors.k if self.sources.successors is not None else 0
        kind = device_kind(vllm_config)  # key of the per-device defaults
        self.max_budget = opts.budget or self.max_nodes or 0
        # With the engine's step budget on (ctx.step_cost), the verifier keeps the nodes that pay and DraftGate decides
        # whether the head drafts: graft drafts its full budget with no confidence floor. The device tables below are
        # the fallback for engines without a step-cost model; explicit options override both.
        self.min_node_confidence = (opts.min_node_confidence if opts.min_node_confidence is not None else
                                    DEFAULT_MIN_NODE_CONFIDENCE[kind])
        if opts.model_draft_max_batch is not None:
            self.model_draft_max_batch = opts.model_draft_max_batch
        else:
            self.model_draft_max_batch = DEFAULT_MODEL_DRAFT_MAX_BATCH["other" if not opts.adaptive_budget else kind]
        self.budget_curve = budget_curve(opts, calibration, kind, self.max_budget)
        #: graft's own budget-by-batch rule applies under a step budget too (an explicit knee or calibration table)
        self._explicit_budget = opts.knee_tokens is not None or bool(calibration and calibration.budget_by_batch)
        self.head_cost = CallCost()  # the head's seconds per drafting step (ingest + draft), by requests
        self.head_gate: DraftGate | None = None
        self.retrieval_gate: DraftGate | None = None  # what the retrieval-only trees are worth (no drafter cost)
        #: what the head's trees are worth for requests no retrieval source matched (option unmatched_head)
        self.unmatched_gate: DraftGate | None = None
        self.drafter = drafter if drafter is not None else load_model_drafter(
            opts.eagle_checkpoint, vllm_config, depth=opts.eagle_depth, top_k=opts.eagle_top_k,
            dtype=opts.eagle_dtype)
        if self.drafter is None:
            logger.warning("graft: no EAGLE head (eagle_checkpoint=%r), so no model drafter: drafting retrieval-only "
                           "trees (draft = the most confident of %s, pruned at depths %s, grafted from the others)",
                           opts.eagle_checkpoint, list(opts.sources), list(self.checkpoints))
        else:
            # the drafter stops a request's draft at the checkpoint that prunes it: those levels are never drafted
            self.drafter.stop_below = self.checkpoints if opts.stop_drafting_at_checkpoints else None
            self.needs_hidden_states = self.drafter.needs_hidden_states
            self.aux_hidden_state_layers = tuple(self.drafter.aux_hidden_state_layers)
            self.needs_kv_cache = self.drafter.needs_kv_cache
        self._roots: dict[str, int] = {}  # root token of each request's last tree (row 0 of its target logits)
        #: the sources node_sources names; the verifier learns their acceptance rates (use_acceptance). With
        #: calibrate_by_match_length the suffix and n-gram sources name one per match-length class (match_class)
        self._matched_sources = MATCHED_SOURCES if opts.calibrate_by_match_length else ()
        self.acceptance_sources = tuple(n for s in opts.sources for n in (
            match_class_sources(s) if s in self._matched_sources else (s,))) + (MODEL_SOURCE,)
        self.calibration = AcceptanceCalibration(self.acceptance_sources) if opts.calibrate_acceptance else None
        # without a verifier (offline replay) graft learns acceptance itself, from on_verified and its last trees
        self._learns_acceptance = True
        self._last_trees: dict[str, AssembledTree] = {}
        self.stats = GraftStats()

    def use_acceptance(self, calibration: AcceptanceCalibration) -> None:
        """The verifier's calibration, learned from every step's committed tokens, replaces graft's own."""
        self._learns_acceptance = False
        self._last_trees.clear()
        if self.options.calibrate_acceptance:
            self.calibration = calibration

    def _retrieval_sources(self, vllm_config: Any, vocab_size: int | None) -> RetrievalSources:
        opts: GraftOptions = self.options
        model_config = getattr(vllm_config, "model_config", None)
        if vocab_size is None:
            vocab_size = model_config.get_vocab_size() if model_config is not None else FALLBACK_VOCAB_SIZE
        corpus = None
        if opts.datastore is not None:
            corpus = load_datastore(opts.datastore, model_vocab_size=vocab_size if model_config else None,
                                    expected_tokenizer=getattr(model_config, "tokenizer", None)).automaton
        return RetrievalSources(opts, vocab_size, corpus)

    # --- budget ----------------------------------------------------------------------------------------------------
    def budget(self, ctx: ProposeContext) -> int:
        cap = ctx.max_nodes if ctx.max_nodes > 0 else self.max_budget
        by_batch = cap if ctx.step_cost is not None and not self._explicit_budget else self.budget_curve(ctx.num_reqs)
        return min(by_batch, cap, self.max_budget or cap)

    def floor(self, ctx: ProposeContext) -> float:
        """Path confidence below which nodes are left out: the option, else none under a step budget (the verifier
        weighs every node), else the device default."""
        if self.options.min_node_confidence is not None or ctx.step_cost is None:
            return self.min_node_confidence
        return 0.0

    def head_drafts(self, ctx: ProposeContext, budget: int, rows: list[int]) -> bool:
        """Whether the model drafter drafts this step: under a step budget when DraftGate expects its trees' gain to
        beat its measured cost (its call, and its catch-up on the rows of the steps it did not draft) with the rest of
        the drafting step (``ctx.shared_draft_seconds``, also charged to the retrieval-only rival), both against
        plain decoding and against the retrieval-only trees graft drafts without it (a head that adds little to a
        confident match only costs), and on every probe of the verifier's gate whose allowance covers that catch-up
        and its call (``model_draft_max_batch``, if given, still caps the batch); else up to
        ``model_draft_max_batch`` requests.
        What the retrieval-only trees are worth is learnt on the head's own steps, and only there
        (:meth:`propose_trees`): the rival is priced on the text the head's trees were. Learnt also from the steps the
        head sat out, it was priced on other text, and at batch 1 in bf16 the head drafted on 10-57% of the steps (~7 ms
        a call, median, twice the nodes verified) for no more tokens a step than graft without a head: 8% slower on the
        tuning prompts; priced on its own steps, it drafts on its probes alone there. A step drafted without the head
        only to measure them would also teach the verifier's gate, which prices whatever graft proposes, that graft's
        trees are worth less than the head's, and a fresh engine's gate then skipped drafting for the next 16-128 steps
        after each such step. Both gates price the drafting requests' rows by their sequence lengths
        (``ctx.row_excess``), as the verifier does."""
        num_drafting = len(rows)
        if self.drafter is None or budget <= 0 or num_drafting == 0:
            return False
        if ctx.step_cost is None:
            return ctx.num_reqs <= self.model_draft_max_batch
        if self._above_batch_cap(ctx):
            return False
        if self.head_gate is None or self.retrieval_gate is None:
            self.head_gate, self.retrieval_gate = DraftGate(ctx.step_cost, self.head_cost), DraftGate(ctx.step_cost)
        self.head_gate.cost = self.retrieval_gate.cost = ctx.step_cost
        # the head's writes of the rows the steps without drafts left it: paid by whichever call drafts next
        backlog = self.drafter.backlog_seconds([ctx.req_ids[i] for i in rows])
        if ctx.probing:
            # the verifier's probe must measure the trees graft would draft once drafting pays, but not at a
            # catch-up and call many times what the skipped steps set aside for it (at 16 requests in bf16, up to
            # 160 ms of catch-up; the head's call for 8 requests of a 14-request bf16 probe took 33 ms beside an
            # allowance of ~37 ms)
            head_call = self.head_cost.predict(num_drafting) or 0.0
            return ctx.probe_seconds is None or backlog + head_call <= ctx.probe_seconds
        excess = self._mean_row_excess(ctx, rows)
        # the head's trees must beat the retrieval-only ones too (unknown until a head step has priced them). A
        # step they lose is a skipped step of the head's gate: its probes keep what the head's trees are worth
        # current, where a veto after the gate would leave them as the first steps had priced them, for good
        # Both are priced with the rest of the drafting step (graft's call without the head, the verifier's tree
        # work), which either pays and plain decoding does not: weighed without it, the head's steps at 5-8 served
        # bf16 requests committed 0.88-0.90 of the tokens the gate's plain rate commits in their time
        shared = ctx.shared_draft_seconds
        retrieval_best = None if self.retrieval_gate.gains is None else \
            self.retrieval_gate.expected_best(num_drafting, budget, row_excess=excess, drafter_seconds=shared)[0]
        return self.head_gate.should_draft(num_drafting, budget, row_excess=excess, extra_seconds=backlog,
                                           rival_rate=retrieval_best, shared_seconds=shared)

    def unmatched_head_drafts(self, ctx: ProposeContext, budget: int, unmatched: list[int]) -> bool:
        """Whether the head drafts, on a step its own gate kept it out, for the ``unmatched`` rows (requests no
        retrieval source matched; option ``unmatched_head``): when a gate that learns what its trees are worth on such
        rows alone expects them to beat plain decoding at its measured call and catch-up. Its gate weighs the head on
        every drafting request against graft's retrieval-only trees, averaged over steps that matched and steps that
        did not; where nothing matched, graft has no tree and plain decoding is the only rival."""
        if not self.options.unmatched_head or self.drafter is None or ctx.step_cost is None or budget <= 0 \
                or not unmatched or ctx.probing:
            return False
        if self._above_batch_cap(ctx):
            return False
        backlog = self.drafter.backlog_seconds([ctx.req_ids[i] for i in unmatched])
        return self._unmatched_gate(ctx).should_draft(len(unmatched), budget, row_excess=self._mean_row_excess(
            ctx, unmatched), extra_seconds=backlog)

    def _above_batch_cap(self, ctx: ProposeContext) -> bool:
        """An explicit ``model_draft_max_batch`` keeps the head out of larger batches, whatever its gates say."""
        return self.options.model_draft_max_batch is not None and ctx.num_reqs > self.model_draft_max_batch

    @staticmethod
    def _mean_row_excess(ctx: ProposeContext, rows: list[int]) -> float | None:
        """The context term of ``rows``' rows on average, as the head's gates price them (None: at the curve's)."""
        return None if ctx.row_excess is None else float(np.mean(np.asarray(ctx.row_excess)[rows]))

    def _unmatched_gate(self, ctx: ProposeContext) -> DraftGate:
        if self.unmatched_gate is None:
            self.unmatched_gate = DraftGate(ctx.step_cost, self.head_cost)
        self.unmatched_gate.cost = ctx.step_cost
        return self.unmatched_gate

    # --- proposing -------------------------------------------------------------------------------------------------
    def observe(self, ctx: ProposeContext) -> None:
        if self.drafter is not None:
            self.drafter.observe(ctx)

    def glance(self, ctx: ProposeContext, rows: Sequence[int]) -> list[DraftTree | None] | None:
        """Retrieval-only trees for the rows whose suffix match pays for its first node (option ``glance``): its
        best root child's priced acceptance rate ``p`` beats what one more row costs a step of ``n`` requests,
        ``n * (t(n + 1) / t(n) - 1)`` on the step-cost model. The lookup is the suffix automaton's incremental match
        (a few tens of microseconds a request); a row that passes is offered the match's continuation tree as it
        was retrieved (at most the budget, ``max_depth`` deep), without graft's grafts."""
        if not self.options.glance or self.sources.suffix is None or self.calibration is None \
                or ctx.step_cost is None:
            return None
        budget = self.budget(ctx)
        if budget <= 0:
            return None
        n = ctx.num_reqs
        plain, one_more = ctx.step_cost.predict_many(np.array([n, n + 1], np.float64), n, plain_tokens=n)
        break_even = n * (one_more / plain - 1.0) if plain > 0 else np.inf
        matched: list[tuple[int, RetrievedTree, int]] = []
        firsts = []  # each matched row's best root child's raw confidence
        for i in rows:
            req_id, context = ctx.req_ids[i], ctx.committed(i)
            found = self.sources.suffix.retrieve(req_id, context, budget, prompt_len=ctx.prompt_len(i))
            roots = found.parents < 0
            if roots.any():
                matched.append((i, found, self._source_id("suffix", found.match_len)))
                firsts.append(float(np.max(found.probs[roots])))
        if not matched:
            return None
        rates = self.calibration.priced(np.array([source for _, _, source in matched]), np.array(firsts),
                                        np.ones(len(matched), np.int64))
        hits = [m for m, rate in zip(matched, rates) if rate > break_even]
        if not hits:
            return None
        trees: list[DraftTree | None] = [None] * n
        for i, found, source in hits:
            # the match's own tree: assembling graft's (every source, grafts) cost ~0.6 ms a request, 10 ms a
            # 16-request step in which most requests matched
            trees[i] = DraftTree(found.token_ids, found.parents, found.probs.astype(np.float32),
                                 np.full(found.num_nodes, source, np.int32))
        self.stats.glance_trees += len(hits)
        return trees

    def propose_trees(self, ctx: ProposeContext) -> list[DraftTree | None]:
        self.stats.steps += 1
        budget = self.budget(ctx)
        rows = [i for i in range(ctx.num_reqs) if ctx.needs_draft(i)]
        use_drafter = self.head_drafts(ctx, budget, rows)
        # retrieval first where the head's rows may depend on it: the rows nothing matched are the unmatched gate's
        found = {i: self._retrieve(ctx, i, budget) for i in rows} if self.options.unmatched_head \
            and self.drafter is not None and budget > 0 else {}
        unmatched = [i for i in rows if i in found and not any(t.num_nodes for t in found[i].values())]
        head_rows = rows if use_drafter else \
            unmatched if self.unmatched_head_drafts(ctx, budget, unmatched) else []
        started = time.perf_counter()
        if head_rows:
            asked = ctx.draft_rows
            if head_rows is not rows:  # the head reads and drafts for the unmatched rows only, keeps the others'
                ctx.draft_rows = np.zeros(ctx.num_reqs, dtype=bool)
                ctx.draft_rows[head_rows] = True
            self.drafter.ingest(ctx)
            ctx.draft_rows = asked
        elif self.drafter is not None:
            # the head does not draft (zero budget, a batch above model_draft_max_batch, or its gate): it only keeps
            # this step's rows for its cache (written with its next ingest). Ingesting every step (attention and LM
            # head for each row) cost 12-14% of throughput at 4-16 requests; skipping the rows left holes in its
            # cache that made its drafts worse after every busy spell.
            self.drafter.observe(ctx)
        trees: list[DraftTree | None] = [None] * ctx.num_reqs
        if budget <= 0 or not rows:
            return trees
        if self.drafter is not None and not use_drafter:
            self.stats.retrieval_only_steps += 1
        model_drafts = self._model_drafts(ctx, head_rows, budget) if head_rows else {}
        if head_rows:
            # the head's writes of rows that steps without drafts left are priced by neither gate: drafting for those
            # requests at any later step would pay them too
            ctx.deferred_seconds = self.drafter.catch_up_seconds
            head_seconds = time.perf_counter() - started - ctx.deferred_seconds
            self.head_cost.observe(len(head_rows), head_seconds)
            ctx.self_gated_seconds = head_seconds  # priced by the head's own gates, not the verifier's
            if not use_drafter:
                self.stats.unmatched_head_steps += 1
        floor = self.floor(ctx)
        # every head step under a step budget also assembles the tree each request would get without the head (never
        # verified): the retrieval gate's only lesson, so that the head's trees and their rival are priced on one text
        alternatives = use_drafter and self.retrieval_gate is not None
        built = {i: self._tree(ctx, i, budget, model_drafts.get(i), floor, alternatives, found.get(i)) for i in rows}
        assembled = {i: tree for i, (tree, _) in built.items()}
        # what the trees with the head, and without it, are worth, priced as the verifier will price them
        if use_drafter and self.head_gate is not None:
            self.head_gate.record([self._priced(a) for a in assembled.values()], scale=ctx.expectation_factor)
            if alternatives:
                self.retrieval_gate.record([self._priced(alt) for _, alt in built.values()],
                                           scale=ctx.expectation_factor)
        # what the head's trees are worth where nothing matched: learnt on every head step's unmatched rows
        if head_rows and unmatched and ctx.step_cost is not None:
            self._unmatched_gate(ctx).record([self._priced(assembled[i]) for i in unmatched],
                                             scale=ctx.expectation_factor)
        for i, a in assembled.items():
            # the raw numbers and their sources: the verifier calibrates them (the same rates graft ranked by)
            trees[i] = DraftTree(a.tree.token_ids, a.tree.parents, a.raw_probs.astype(np.float32), a.sources)
        return trees

    def _priced(self, assembled: AssembledTree) -> DraftTree:
        """``assembled``'s tree with each node's probability as the verifier's budget prices it: the calibrated rate
        under its ceiling (:meth:`AcceptanceCalibration.priced`; a node of unknown source keeps its raw number).
        graft ranks nodes by the uncapped rates, which a raw retrieval score of 1.0 lifts far above a source's record:
        weighed at those, retrieval-only trees kept the head's gate from ever drafting again on requests where
        ``eagle_tree``'s head paid (expected 80-160 tok/s at batch 1, 35-52 measured)."""
        tree = assembled.tree
        if self.calibration is None or tree.num_nodes == 0:
            return tree
        probs = self.calibration.priced(assembled.sources, assembled.raw_probs, tree.depths())
        return DraftTree.of_valid(tree.token_ids, tree.parents, probs, tree.node_sources)

    def _model_drafts(self, ctx: ProposeContext, rows: list[int], budget: int) -> dict[int, DraftGrowth]:
        """The drafter's trees, cut to the budget and pruned at the checkpoints; a row the drafter could not draft
        (no hidden states yet, head not loaded) gets a retrieval-only tree."""
        growths = {i: grow_draft_tree(t, budget, self.checkpoints, self.options.max_depth)
                   for i, t in self.drafter.draft(ctx, rows).items()}
        return {i: g for i, g in growths.items() if len(g)}

    def _retrieve(self, ctx: ProposeContext, i: int, budget: int) -> dict[str, RetrievedTree]:
        """Each retrieval source's tree continuing request row ``i``'s committed tokens (which they learn first)."""
        req_id, context = ctx.req_ids[i], ctx.committed(i)
        self.sources.observe(req_id, context)
        self._roots[req_id] = int(context[-1])
        return self.sources.at_root(req_id, context, budget, ctx.prompt_len(i))

    def _tree(self, ctx: ProposeContext, i: int, budget: int, draft: DraftGrowth | None, floor: float,
              alternative: bool = False, found: dict[str, RetrievedTree] | None = None,
              ) -> tuple[AssembledTree, AssembledTree | None]:
        """Request row ``i``'s tree (on the model drafter's ``draft``, else retrieval-only) and, if ``alternative``,
        the retrieval-only tree it would have had without the model drafter. ``found``: the sources' trees, when
        :meth:`_retrieve` ran already this step."""
        req_id, context = ctx.req_ids[i], ctx.committed(i)
        if found is None:
            found = self._retrieve(ctx, i, budget)
        retrieval_only = None
        if draft is None and not any(t.num_nodes for t in found.values()):
            # nothing retrieved: the empty tree assembly would build, without growing and grafting empty trees (a
            # quarter of graft's drafting steps at batch 1 on an AVX2 CPU, ~1 ms each)
            assembled = empty_assembled()
            retrieval_only = assembled if alternative else None
            draft = DraftGrowth(budget, self.checkpoints, self.options.max_depth)
        elif draft is None:
            draft_source, draft = self._retrieval_draft(found, budget)
            if len(draft):
                self.stats.draft_source[draft_source] = self.stats.draft_source.get(draft_source, 0) + 1
            assembled = self._assemble(req_id, context, draft, draft_source, found, budget, floor)
            retrieval_only = assembled if alternative else None
        else:
            assembled = self._assemble(req_id, context, draft, MODEL_SOURCE, found, budget, floor)
            if alternative:
                source, retrieval_draft = self._retrieval_draft(found, budget)
                retrieval_only = self._assemble(req_id, context, retrieval_draft, source, found, budget, floor)
        if self.calibration is not None and self._learns_acceptance:
            self._last_trees[req_id] = assembled
        self.stats.trees += 1
        self.stats.draft_nodes += len(draft)
        self.stats.grafted_nodes += assembled.grafted
        self.stats.pruned += draft.pruned_at is not None
        return assembled, retrieval_only

    def _retrieval_draft(self, found: dict[str, RetrievedTree], budget: int) -> tuple[str, DraftGrowth]:
        """The draft without a model drafter: the most confident source's tree, pruned at the checkpoints."""
        source = self._most_confident(found)
        return source, grow_retrieved(found[source], budget, self.checkpoints, self.options.max_depth)

    def _assemble(self, req_id: str, context: np.ndarray, draft: DraftGrowth, draft_source: str,
                  found: dict[str, RetrievedTree], budget: int, floor: float) -> AssembledTree:
        """``draft`` with the other sources' continuations grafted into the budget it left free."""
        grafts = self._grafts(req_id, context, draft, found, [s for s in found if s != draft_source])
        match_len = found[draft_source].match_len if draft_source in found else 0
        return assemble_tree(draft, grafts, budget, floor, calibration=self.calibration,
                             draft_source=self._source_id(draft_source, match_len))

    def _source_id(self, name: str, match_len: int = 0) -> int:
        """The id in ``acceptance_sources`` (and in the acceptance calibration) of source ``name``'s nodes, those of
        a retrieval that matched ``match_len`` context tokens."""
        if name in self._matched_sources:
            name = match_class_sources(name)[match_class(match_len)]
        return self.acceptance_sources.index(name)

    def _most_confident(self, found: dict[str, RetrievedTree]) -> str:
        """The source whose tree is most confident at the first checkpoint, calibrated if learned (ties: the order of
        ``sources``)."""
        confidence = self._root_confidences(found) if self.first_checkpoint == 1 else \
            self._checkpoint_confidences(found)
        return sorted(found, key=lambda s: -confidence[s])[0]

    def _checkpoint_confidences(self, found: dict[str, RetrievedTree]) -> dict[str, float]:
        """Each source's best path confidence at the first checkpoint (0 for an empty tree), calibrated if learned."""
        def confidence(name: str) -> float:
            t = found[name]
            if self.calibration is not None and t.num_nodes:
                t = t._replace(probs=self.calibration(self._source_id(name, t.match_len), t.probs))
            return first_checkpoint_confidence(t, self.first_checkpoint)

        return {name: confidence(name) for name in found}

    def _root_confidences(self, found: dict[str, RetrievedTree]) -> dict[str, float]:
        """:meth:`_checkpoint_confidences` at a first checkpoint of depth 1, where a path is one root child: the root
        children of every source calibrated in one call, not each tree whole (graft asks on every drafting step)."""
        roots = {name: np.flatnonzero(t.parents < 0) for name, t in found.items() if t.num_nodes}
        confidence = dict.fromkeys(found, 0.0)
        if not roots:
            return confidence
        raw = np.concatenate([found[name].probs[index] for name, index in roots.items()])
        if self.calibration is not None:
            raw = self.calibration(np.concatenate([np.full(index.size, self._source_id(name, found[name].match_len),
                                                           np.int64) for name, index in roots.items()]), raw)
        end = 0
        for name, index in roots.items():
            confidence[name] = float(np.max(raw[end: end + index.size]))
            end += index.size
        return confidence

    def _grafts(self, req_id: str, context: np.ndarray, draft: DraftGrowth, found: dict[str, RetrievedTree],
                names: list[str]) -> list[tuple[int, RetrievedTree, int]]:
        """(draft node or -1 for the root, retrieved tree, source id) to fill the budget the draft left free."""
        opts: GraftOptions = self.options
        grafts: list[tuple[int, RetrievedTree, int]] = []
        if not opts.graft or draft.remaining <= 0:
            return grafts
        if opts.graft_position in ("root", "both"):
            grafts += [(-1, found[s], self._source_id(s, found[s].match_len)) for s in names]
        deepest = draft.deepest()
        if opts.graft_position in ("deepest", "both") and deepest >= 0:
            path = draft.path_tokens(deepest)
            grafts += [(deepest, t, self._source_id(s, t.match_len)) for s, t in
                       self.sources.after_path(req_id, context, path, draft.remaining, names)]
        return grafts

    # --- learning from verification --------------------------------------------------------------------------------
    def on_verified(self, results: list[VerificationResult]) -> None:
        """Refresh the successor table from the target's distribution at every verified row: row 0 follows the root
        token, row 1 + j follows node j's token, whether the node was accepted or not."""
        if self.calibration is not None and self._learns_acceptance:
            self.calibration.observe_verified(results, self._last_trees)
        if self.sources.successors is None:
            return
        k = self.sources.successors.k
        tokens, topk_ids, topk_probs = [], [], []
        for r in results:
            root = self._roots.get(r.req_id)
            if root is None or (r.target_topk is None and r.target_logits is None):
                continue
            if r.target_topk is not None:  # the verifier's, of width wants_target_topk = k
                ids, probs = r.target_topk[0][:, :k], r.target_topk[1][:, :k]
            else:  # offline replay hands whole logits rows
                ids, probs = target_topk(r.target_logits, np.arange(r.target_logits.shape[0]), k)
            n = min(ids.shape[0], r.tree.num_nodes + 1)
            tokens.append(np.concatenate([[root], r.tree.token_ids[: n - 1]]))
            topk_ids.append(ids[:n])
            topk_probs.append(probs[:n])
        if tokens:
            self.learn_successors(np.concatenate(tokens), np.concatenate(topk_ids), np.concatenate(topk_probs))

    def learn_successors(self, tokens: np.ndarray, topk_ids: np.ndarray, topk_probs: np.ndarray) -> None:
        """Row ``tokens[i]`` of the successor table := the target's top-k after it (also used by offline replay)."""
        self.sources.learn(tokens, topk_ids, topk_probs)

    @classmethod
    def check_served_model(cls, options: GraftOptions, vllm_config: Any) -> None:
        if options.eagle_checkpoint not in NAMED_HEADS:  # the named heads fall back, with a log line
            check_head_path(options.eagle_checkpoint, vllm_config)

    def load_model(self, model: Any) -> None:
        super().load_model(model)
        compile_retrieval_kernels()
        compile_growth_kernel()
        if self.drafter is not None:
            self.drafter.load_model(model)

    def on_requests_finished(self, req_ids: set[str]) -> None:
        if self.drafter is not None:
            self.drafter.release(req_ids)
        for r in req_ids:
            self._roots.pop(r, None)
            self._last_trees.pop(r, None)
        self.sources.release(req_ids)  # those on_outputs_finished did not index whole, as far as they were read
        save_store_file(self.store_file)

    def on_outputs_finished(self, outputs: dict[str, np.ndarray]) -> None:
        self.sources.release(set(outputs), outputs)

    def on_shutdown(self) -> None:
        save_store_file(self.store_file, now=True)
