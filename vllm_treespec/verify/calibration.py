"""The online acceptance calibration: how often the target accepts a draft node, by the source that scored it and
by its raw confidence, learned from every verified draft of every proposer, so that each proposer's ``node_probs``
become acceptance probabilities before the step budget (:mod:`vllm_treespec.cost`) weighs them.

A proposer's raw numbers are rarely acceptance rates (suffix-automaton continuation counts, a successor table's
learned target distributions, a head's softmax), and they are not on one scale across sources. A proposer names its
sources in ``TreeProposer.acceptance_sources`` and marks each node's source in ``DraftTree.node_sources`` (one
source, "proposer", when it names none); :class:`AcceptanceTracker` then

1. replaces each tree's ``node_probs`` by the calibrated rate of its node's source, depth class and raw-confidence
   bin (:class:`AcceptanceCalibration`: the raw number until the source has data, the source's rate until the bin
   has), never above the same estimate built on the source's record alone instead of its raw number (a raw 1.0 is
   not a certainty: :meth:`AcceptanceCalibration.capped`), and scales every path probability by how many drafts
   the last ~50 steps accepted against how many those rates expected (:class:`ExpectationCorrection`), and that
   by the request's own record (:class:`RequestCorrection`);
2. remembers the drafts each request was handed, cut to what vLLM scheduled (:meth:`AcceptanceTracker.scheduled`);
3. when the next step's committed tokens arrive, walks each remembered tree along them (accepted drafts are the
   committed tokens but the last) and counts every node the target reached — root children and children of
   accepted nodes — as accepted or not. Trees and chains alike, whoever verified them (our tree acceptance or
   vLLM's rejection sampler);
4. counts, too, the proposed nodes the budget left out that the last committed token decides: the children of the
   last accepted node (of the root, when none was) where none of them was verified. That token is then the
   target's own, drawn from its distribution (greedy: its argmax), so it equals such a node's token exactly as
   often as the node, verified alone, would have been accepted. Without them a class priced out by its first few
   outcomes was never verified again, and never re-priced: on a batch-1 run one engine verified a single root child
   for hundreds of steps of copied code whose deeper nodes another engine, on the same prompts, verified 6 at a
   time and had accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
from numba import njit

from vllm_treespec.api import DraftTree
from vllm_treespec.cost.allocate import fresh_array, path_products

#: raw-confidence bins (uniform over a node's probability given its parent)
ACCEPTANCE_BINS = 10
#: pseudo-trials of a bin's prior, and of a source's own prior at the raw number: early estimates stay near the
#: source's rate so far, and near its raw number before it has one
ACCEPTANCE_PRIOR_TRIALS = 8.0
#: depth classes learned apart: a root child, its child, deeper. Pooled over depths, a bin's rate is mostly deep
#: nodes of long accepted runs, and overstated a root child's by ~1.5x (batch-16 replay on MT-Bench)
DEPTH_CLASSES = 3
#: the source of every node of a proposer that names none
DEFAULT_SOURCE = "proposer"
#: ``FAMILY@CLASS`` names one class of a source split by a class (graft's match lengths, ``suffix@4``)
FAMILY_SEPARATOR = "@"
#: per committed step, the weight the expected/accepted sums of :class:`ExpectationCorrection` keep (~50 steps)
EXPECTATION_DECAY = 0.98
#: pseudo-tokens on both sides of the correction: no correction before ~20 expected tokens were verified
EXPECTATION_PRIOR = 20.0
#: the correction's range
EXPECTATION_LIMITS = (0.25, 2.0)
#: per verified step of a request, the weight its own expected/accepted sums keep (~15 steps): a request whose text
#: the sources' matches fit (code that repeats its prompt) or miss (free prose) departs from the batch's correction
#: for as long as it runs (batch-1 traces: its drafts' yield misjudged by 0.57 tokens a step by the batch's
#: correction, 0.29 by its own)
REQUEST_DECAY = 0.93
#: pseudo-tokens at the batch's correction: a request's own starts there and leaves it as its verified drafts add up
REQUEST_PRIOR = 4.0


def depth_class(depths: np.ndarray) -> np.ndarray:
    """0 for root children, 1 for their children, ``DEPTH_CLASSES - 1`` for every node deeper."""
    return np.clip(np.asarray(depths, np.int64), 1, DEPTH_CLASSES) - 1


def _kernel_array(values: Any, dtype: type, shape: tuple) -> np.ndarray:
    """``values`` broadcast to ``shape``, flat, as a writable C array of ``dtype`` (one compiled kernel for all)."""
    if isinstance(values, (int, float, np.integer, np.floating)):  # one source for every node: filled, not
        array = np.empty(math.prod(shape), dtype)  # broadcast and copied (~3x the time)
        array.fill(values)
        return array
    array = np.asarray(values, dtype)
    if array.shape != shape:
        return np.require(np.broadcast_to(array, shape), dtype, ("C", "W")).reshape(-1)
    return fresh_array(array, dtype).reshape(-1)


@njit(cache=True)
def _rates(trials, accepts, source_trials, source_accepts, family_trials, family_accepts, split, sources, raw,
           depths, pooled, capped, m):
    """:meth:`AcceptanceCalibration._rate` node by node (``pooled``: over all depths, else by ``depths``' class):
    graft calibrates several small trees a step, and the same arithmetic as NumPy array operations took ~100 us a
    call, mostly per-operation overhead."""
    num_bins = trials.shape[2]
    num_classes = trials.shape[1] - 1  # the last depth index pools every depth
    out = np.empty(raw.shape[0])
    for i in range(raw.shape[0]):
        r = raw[i]
        r = 0.0 if np.isnan(r) else min(max(r, 0.0), 1.0)
        b = min(int(r * num_bins), num_bins - 1)  # AcceptanceCalibration.bins, per node
        s = sources[i]
        d = num_classes if pooled else min(max(depths[i], 1), num_classes) - 1  # depth_class, per node
        s_trials, s_accepts = source_trials[s, d], source_accepts[s, d]
        prior = (s_accepts + m * r) / (s_trials + m)
        ceiling = (s_accepts + 1.0) / (s_trials + 2.0)
        if split[s]:  # a class's prior: its family's estimate, in place of the raw number and of 1/2
            f_trials, f_accepts = family_trials[s, d], family_accepts[s, d]
            prior = (s_accepts + m * ((f_accepts + m * r) / (f_trials + m))) / (s_trials + m)
            ceiling = (s_accepts + m * ((f_accepts + 1.0) / (f_trials + 2.0))) / (s_trials + m)
        if capped and ceiling < prior:
            prior = ceiling
        out[i] = min((accepts[s, d, b] + m * prior) / (trials[s, d, b] + m), 1.0)
    return out


class AcceptanceCalibration:
    """How often the target accepts a tree node, by source, by the node's depth class and by its raw confidence (its
    source's probability of the token given the parent's path), counted over the nodes whose parent was accepted.
    A bin's rate is ``(accepts + m * prior) / (trials + m)``, ``m`` = :data:`ACCEPTANCE_PRIOR_TRIALS`, its prior the
    source's rate at that depth over every bin, itself ``(accepts + m * raw) / (trials + m)``: the raw number before
    the source has data, the source's own rate before the bin has. A source named ``FAMILY@CLASS`` (one class of a
    source split by something its raw number misses, graft's match lengths) has its family's rate — the same
    estimate over every class of the family — in place of the raw number, and the family's record in place of
    the 1/2 of :meth:`capped`'s ceiling: a class starts from what its family learnt. ``trials``/``accepts`` hold the
    counts pooled over depths (sources x bins); ``depth_trials``/``depth_accepts`` by depth class (sources x classes
    x bins)."""

    def __init__(self, sources: Sequence[str]) -> None:
        self.names = list(sources)
        self.depth_trials = np.zeros((len(self.names), DEPTH_CLASSES, ACCEPTANCE_BINS))
        self.depth_accepts = np.zeros((len(self.names), DEPTH_CLASSES, ACCEPTANCE_BINS))
        # sources named FAMILY@CLASS split one source by a class (graft's match lengths): their prior is the family's
        # rate, so that a class starts from what its family has learnt, not from its raw number
        families = [name.split(FAMILY_SEPARATOR)[0] for name in self.names]
        self._family = np.array([[a == b for b in families] for a in families], np.float64).reshape(
            len(families), len(families))
        self._split = np.array([FAMILY_SEPARATOR in name for name in self.names], bool)
        self._tables: tuple[np.ndarray, ...] | None = None  # the counts' sums, until the next observe

    @property
    def trials(self) -> np.ndarray:
        return self.depth_trials.sum(axis=1)

    @property
    def accepts(self) -> np.ndarray:
        return self.depth_accepts.sum(axis=1)

    def source_id(self, name: str) -> int:
        return self.names.index(name)

    @staticmethod
    def bins(raw: np.ndarray) -> np.ndarray:
        return np.clip((np.asarray(raw, np.float64) * ACCEPTANCE_BINS).astype(np.int64), 0, ACCEPTANCE_BINS - 1)

    def __call__(self, source: int | np.ndarray, raw: np.ndarray, depth: np.ndarray | None = None) -> np.ndarray:
        """Calibrated probabilities of nodes with sources ``source`` (one id, or one per node), raw confidences
        ``raw`` and depths ``depth`` (1 = root child; None: pooled over depths)."""
        return self._rate(source, raw, depth, capped=False)

    def capped(self, source: int | np.ndarray, raw: np.ndarray, depth: np.ndarray) -> np.ndarray:
        """The rate the budget prices by: as calibrated, but under a ceiling, the same estimate with the source's
        prior taken from its record alone (Laplace's rule of succession on its verified nodes at that depth,
        ``(accepts + 1) / (trials + 2)``, 1/2 before any) instead of from the raw number. A raw number is not an
        acceptance rate — a retrieval continuation seen once scores 1.0 — and the prior at it made a fresh engine
        certain of such nodes: after one probe accepted its 5 nodes, a batch of 8 verified 120 of them at
        probability 1 and none was accepted. With a long record both estimates are the record. (The estimate rises
        with its prior, so the lower prior gives the lower of the two.)"""
        return self._rate(source, raw, depth, capped=True)

    def priced(self, sources: np.ndarray, raw: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """Per node, the probability the budget prices it at: :meth:`capped` for nodes of a known source, the raw
        number for nodes of source -1 (a new float64 array). Proposers rank by the uncapped rates; whatever weighs a
        tree's worth against its cost (the verifier, graft's gates) prices it here."""
        probs = np.asarray(raw, np.float64).copy()
        known = sources >= 0
        if known.any():
            probs[known] = self.capped(sources[known], probs[known], depths[known])
        return probs

    def _rate(self, source: int | np.ndarray, raw: np.ndarray, depth: np.ndarray | None, capped: bool
              ) -> np.ndarray:
        raw = np.asarray(raw, np.float64)
        shape = raw.shape
        depths = np.zeros(0, np.int64) if depth is None else _kernel_array(depth, np.int64, shape)  # none: pooled
        return _rates(*self._sums(), self._split, _kernel_array(source, np.int64, shape),
                      _kernel_array(raw, np.float64, shape), depths, depth is None, bool(capped),
                      ACCEPTANCE_PRIOR_TRIALS).reshape(shape)

    def _sums(self) -> tuple[np.ndarray, ...]:
        """Counts by source x depth index x bin (depth index :data:`DEPTH_CLASSES`: all depths), and their sums over
        bins by source x depth index, of each source and of its family. Kept until the next :meth:`observe`: graft
        calibrates several trees a step, and re-summing the counts for each cost more than the rates. (The counts
        are whole numbers, so the sums are exact in any order.)"""
        if self._tables is None:
            trials = np.concatenate([self.depth_trials, self.depth_trials.sum(axis=1, keepdims=True)], axis=1)
            accepts = np.concatenate([self.depth_accepts, self.depth_accepts.sum(axis=1, keepdims=True)], axis=1)
            source_trials, source_accepts = trials.sum(-1), accepts.sum(-1)
            self._tables = (trials, accepts, source_trials, source_accepts, self._family @ source_trials,
                            self._family @ source_accepts)
        return self._tables

    def observe(self, sources: np.ndarray, raw: np.ndarray, accepted: np.ndarray,
                depth: np.ndarray | None = None) -> None:
        """Count verified nodes (each one's parent was accepted): their sources, raw confidences, outcomes and depths
        (None: counted as root children)."""
        b = self.bins(raw)
        d = depth_class(np.ones(b.shape, np.int64) if depth is None else depth)
        np.add.at(self.depth_trials, (sources, d, b), 1.0)
        np.add.at(self.depth_accepts, (sources, d, b), np.asarray(accepted, np.float64))
        self._tables = None

    def observe_verified(self, results: Sequence[Any], last_trees: dict[str, Any]) -> None:
        """Count each verified tree's nodes whose parent was accepted (the target reached them) by source, from
        ``VerificationResult``s; ``last_trees``: what each request was last proposed, with per-node ``sources`` and
        ``raw_probs`` (popped here). For a proposer used without a verifier (offline replay)."""
        sources, raws, accepted, depths = [], [], [], []
        for r in results:
            last = last_trees.pop(r.req_id, None)
            n = r.tree.num_nodes
            # the verifier may have truncated the tree (a prefix) or replaced it (a chain fallback)
            if last is None or n == 0 or n > last.tree.num_nodes or \
                    not np.array_equal(r.tree.token_ids, last.tree.token_ids[:n]):
                continue
            hit = np.zeros(n, bool)
            hit[np.asarray(r.accepted_nodes, np.int64)] = True
            reached = reached_nodes(r.tree.parents, hit)
            known = reached & (last.sources[:n] >= 0)
            sources.append(last.sources[:n][known])
            raws.append(last.raw_probs[:n][known])
            accepted.append(hit[known])
            depths.append(r.tree.depths()[known])
        if sources:
            self.observe(np.concatenate(sources), np.concatenate(raws), np.concatenate(accepted),
                         np.concatenate(depths))

    def table(self) -> dict[str, list[tuple[float, int]]]:
        """Per source and bin, pooled over depths: (acceptance rate, trials), (nan, 0) for a bin without data (to
        inspect what has been learned)."""
        trials, accepts = self.trials, self.accepts
        return {name: [(round(float(a / t), 3), int(t)) if t else (float("nan"), 0)
                       for a, t in zip(accepts[i], trials[i])] for i, name in enumerate(self.names)}


def within_expectation_limits(factor: float) -> float:
    """``factor`` clipped to :data:`EXPECTATION_LIMITS` (min/max, not np.clip: read on every step, and np.clip of a
    scalar costs ~10x more)."""
    low, high = EXPECTATION_LIMITS
    return min(max(factor, low), high)


class ExpectationCorrection:
    """Accepted drafts over what the calibrated probabilities expected for them (the sum of the verified nodes' path
    probabilities), both sums decayed per step: the per-bin rates lag (a fresh engine starts from the sources' raw
    numbers) and assume a node's acceptance depends only on its own bin, and both errors overstate what wide trees
    yield (~1.5x over a 128-token batch on MT-Bench). :attr:`factor` scales every path probability."""

    def __init__(self, decay: float = EXPECTATION_DECAY, prior: float = EXPECTATION_PRIOR) -> None:
        self.decay = decay
        self.prior = prior
        self.expected = 0.0
        self.accepted = 0.0

    def observe(self, expected: float, accepted: float) -> None:
        """One step's verified drafts: their expected and their accepted token counts."""
        self.expected = self.decay * self.expected + float(expected)
        self.accepted = self.decay * self.accepted + float(accepted)

    @property
    def factor(self) -> float:
        return self.shrunk_to(1.0)

    def shrunk_to(self, prior_factor: float) -> float:
        """Accepted over expected with ``prior`` pseudo-tokens at ``prior_factor``, within the correction's range."""
        return within_expectation_limits((self.accepted + self.prior * prior_factor) / (self.expected + self.prior))


class RequestCorrection:
    """Each request's own accepted drafts over what the calibrated probabilities expected of them, shrunk to the
    batch's :class:`ExpectationCorrection` by :data:`REQUEST_PRIOR` pseudo-tokens: the batch's correction averages
    requests whose drafts the target keeps (a copied span) with requests whose drafts it rejects, and prices both
    wrong."""

    def __init__(self, decay: float = REQUEST_DECAY, prior: float = REQUEST_PRIOR) -> None:
        self.decay = decay
        self.prior = prior
        self._requests: dict[str, ExpectationCorrection] = {}

    def observe(self, req_id: str, expected: float, accepted: float) -> None:
        correction = self._requests.get(req_id)
        if correction is None:
            correction = self._requests[req_id] = ExpectationCorrection(self.decay, self.prior)
        correction.observe(expected, accepted)

    def factor(self, req_id: str, batch_factor: float) -> float:
        correction = self._requests.get(req_id)
        if correction is None:  # no verified drafts yet: the batch's
            return within_expectation_limits(float(batch_factor))
        return correction.shrunk_to(batch_factor)

    def forget(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self._requests.pop(req_id, None)


def reached_nodes(parents: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """Nodes the target verified a token for: children of the root and of accepted nodes."""
    parents = np.asarray(parents, np.int64)
    return (parents < 0) | accepted[np.maximum(parents, 0)]


def accepted_walk(tree: DraftTree, tokens: Sequence[int]) -> np.ndarray | None:
    """Which nodes the committed ``tokens`` (the accepted drafts, in order) accept: the path from the root that
    follows them; None when they leave the tree (it was not what was verified)."""
    hit = np.zeros(tree.num_nodes, bool)
    parents, token_ids = tree.parents.tolist(), tree.token_ids.tolist()
    current = -1
    for token in tokens:
        child = next((i for i in range(current + 1, tree.num_nodes)
                      if parents[i] == current and token_ids[i] == token), None)
        if child is None:
            return None
        hit[child] = True
        current = child
    return hit


@dataclass
class _Handed:
    """What one request was handed: the tree (cut to what was scheduled) and each node's source and raw number."""

    tree: DraftTree
    sources: np.ndarray
    raw: np.ndarray


@dataclass
class _Offered:
    """What one request's drafter proposed: the whole tree, each node's source and raw number, the tree handed over
    for verification (None: no node) and its nodes' indices in the whole tree (cut to what was scheduled once it
    was)."""

    tree: DraftTree
    sources: np.ndarray
    raw: np.ndarray
    verified: np.ndarray
    handed: DraftTree | None


class AcceptanceTracker:
    """The verifier's side of the calibration: calibrate proposed trees, remember what was scheduled, learn from the
    committed tokens (see the module docstring)."""

    def __init__(self, sources: Sequence[str]) -> None:
        self.calibration = AcceptanceCalibration(list(sources) or [DEFAULT_SOURCE])
        self._offered: dict[str, _Offered] = {}  # handed, until scheduled
        self._scheduled: dict[str, _Handed] = {}  # scheduled drafts, until committed
        self._unverified: dict[str, _Offered] = {}  # the same proposals whole, until committed
        self.expectation = ExpectationCorrection()
        self.by_request = RequestCorrection()
        self.stats = {"learned_trees": 0, "learned_nodes": 0, "unverified_nodes": 0}
        # the kernels compile (or load from numba's cache) here, at start-up, not inside the first request
        self.calibration.capped(0, np.zeros(1), np.ones(1, np.int64))
        path_products(np.array([-1]), np.ones(1))

    def _sources_of(self, tree: DraftTree) -> np.ndarray:
        if tree.node_sources is None:
            return np.zeros(tree.num_nodes, np.int64)
        sources = tree.node_sources.astype(np.int64)
        if sources.size and sources.max() >= len(self.calibration.names):
            raise ValueError(f"DraftTree.node_sources names source {int(sources.max())}, but the proposer's "
                             f"acceptance_sources has {len(self.calibration.names)}: {self.calibration.names}")
        return sources

    def calibrate(self, trees: Sequence[DraftTree | None], corrected: bool = True,
                  req_ids: Sequence[str] | None = None) -> list[DraftTree | None]:
        """The trees with ``node_probs`` replaced by calibrated acceptance probabilities (nodes of source -1 keep
        their number), root children scaled by the expectation correction (so every path probability is) unless
        ``corrected`` is False: each request's own (:class:`RequestCorrection`) where ``req_ids`` names the trees'
        requests, else the batch's; trees without ``node_probs`` unchanged."""
        batch_factor = self.expectation.factor if corrected else 1.0
        out: list[DraftTree | None] = []
        for i, tree in enumerate(trees):
            if tree is None or tree.node_probs is None or tree.num_nodes == 0:
                out.append(tree)
                continue
            factor = self.by_request.factor(req_ids[i], batch_factor) if corrected and req_ids is not None \
                else batch_factor
            probs = self.calibration.priced(self._sources_of(tree), tree.node_probs, tree.depths())
            roots = tree.parents < 0
            probs[roots] = np.minimum(probs[roots] * factor, 1.0)
            out.append(DraftTree.of_valid(tree.token_ids, tree.parents, probs, tree.node_sources))
        return out

    def handed(self, req_ids: Sequence[str], raw_trees: Sequence[DraftTree | None],
               final_trees: Sequence[DraftTree | None]) -> None:
        """This step's drafts: ``final_trees`` (what vLLM is handed, before its cut to ``num_speculative_tokens``),
        cut from ``raw_trees`` (as proposed, with raw ``node_probs``)."""
        self._offered = {}
        for req_id, raw, final in zip(req_ids, raw_trees, final_trees):
            if raw is None or raw.node_probs is None or raw.num_nodes == 0:
                continue
            if final is None or final.num_nodes == 0:
                final, index = None, np.zeros(0, np.int64)
            else:
                index = _node_index(raw, final)
                if index is None:
                    continue
            self._offered[req_id] = _Offered(raw, self._sources_of(raw), raw.node_probs.astype(np.float64), index,
                                             final)

    def scheduled(self, scheduled_spec_decode_tokens: dict[str, list[int]]) -> None:
        """The drafts vLLM scheduled this step: each remembered tree cut to them (dropped if they differ: a chain
        fallback, placeholders)."""
        offered, self._offered = self._offered, {}
        self._scheduled, self._unverified = {}, {}
        for req_id, proposal in offered.items():
            tokens = scheduled_spec_decode_tokens.get(req_id)
            n = len(tokens) if tokens is not None else 0
            verified = proposal.verified[:n]
            if n > proposal.verified.size or \
                    not np.array_equal(proposal.tree.token_ids[verified], np.asarray(tokens if n else (), np.int64)):
                continue
            self._unverified[req_id] = replace(proposal, verified=verified)
            if n:
                self._scheduled[req_id] = _Handed(proposal.handed.truncate(n), proposal.sources[verified],
                                                  proposal.raw[verified])

    def committed(self, req_ids: Sequence[str], sampled_token_ids: Sequence[Sequence[int]]) -> int | None:
        """The tokens the step committed per request (accepted drafts, then one token of the target's): learn from
        every scheduled tree (verified as a tree or, when it was a chain, by vLLM). Returns the drafts accepted,
        None when no draft was verified."""
        self._learn_unverified(req_ids, sampled_token_ids)
        scheduled, self._scheduled = self._scheduled, {}
        if not scheduled:
            return None
        sources, raws, accepted, depths = [], [], [], []
        expected = hits = 0.0
        for req_id, tokens in zip(req_ids, sampled_token_ids):
            handed = scheduled.get(req_id)
            if handed is None or len(tokens) == 0:
                continue
            tree = handed.tree
            hit = accepted_walk(tree, list(tokens)[:-1])
            if hit is None:
                continue
            depth = tree.depths()
            # what the rates learned so far (uncorrected) expected of this tree, against what it yielded
            priced = self.calibration.priced(handed.sources, handed.raw, depth)
            tree_expected, tree_hits = float(path_products(tree.parents, priced).sum()), float(hit.sum())
            self.by_request.observe(req_id, tree_expected, tree_hits)
            expected += tree_expected
            hits += tree_hits
            known = reached_nodes(tree.parents, hit) & (handed.sources >= 0)
            sources.append(handed.sources[known])
            raws.append(handed.raw[known])
            accepted.append(hit[known])
            depths.append(depth[known])
            self.stats["learned_trees"] += 1
            self.stats["learned_nodes"] += int(known.sum())
        if sources:
            self.calibration.observe(np.concatenate(sources), np.concatenate(raws), np.concatenate(accepted),
                                     np.concatenate(depths))
            self.expectation.observe(expected, hits)
            return int(hits)
        return None

    def _learn_unverified(self, req_ids: Sequence[str], sampled_token_ids: Sequence[Sequence[int]]) -> None:
        """Step 4 of the module docstring: the unverified children of each request's last accepted node, where none
        of them was verified, are accepted when their token is the committed step's last. They teach the rates only:
        the expectation corrections weigh what the budget verified."""
        offered, self._unverified = self._unverified, {}
        if not offered:
            return
        sources, raws, accepted, depths = [], [], [], []
        for req_id, tokens in zip(req_ids, sampled_token_ids):
            proposal = offered.get(req_id)
            if proposal is None or not 0 < len(tokens) <= proposal.verified.size + 1:
                continue
            tokens = list(tokens)
            hit = accepted_walk(proposal.tree, tokens[:-1])
            if hit is None:
                continue
            accepted_nodes = np.flatnonzero(hit)
            last = int(accepted_nodes[-1]) if accepted_nodes.size else -1
            children = np.flatnonzero(proposal.tree.parents == last)
            # a verified child was rejected: the last token is then drawn from what the target has left (sampling)
            if children.size == 0 or np.isin(children, proposal.verified).any():
                continue
            children = children[proposal.sources[children] >= 0]
            sources.append(proposal.sources[children])
            raws.append(proposal.raw[children])
            accepted.append(proposal.tree.token_ids[children] == tokens[-1])
            depths.append(np.full(children.size, 1 + accepted_nodes.size, np.int64))
            self.stats["unverified_nodes"] += int(children.size)
        if sources:
            self.calibration.observe(np.concatenate(sources), np.concatenate(raws), np.concatenate(accepted),
                                     np.concatenate(depths))

    def forget(self, req_ids: set[str]) -> None:
        self.by_request.forget(req_ids)
        for req_id in req_ids:
            for pending in (self._offered, self._scheduled, self._unverified):
                pending.pop(req_id, None)


def _node_index(original: DraftTree, cut: DraftTree) -> np.ndarray | None:
    """For each node of ``cut`` (a subtree of ``original``: the same paths, a subset of nodes) its index in
    ``original``, matched by parent and token; None if a node has no match."""
    children: dict[tuple[int, int], int] = {}
    for i, (p, t) in enumerate(zip(original.parents.tolist(), original.token_ids.tolist())):
        children.setdefault((p, t), i)
    index = np.empty(cut.num_nodes, np.int64)
    for i, (p, t) in enumerate(zip(cut.parents.tolist(), cut.token_ids.tolist())):
        found = children.get((int(index[p]) if p >= 0 else -1, t))
        if found is None:
            return None
        index[i] = found
    return index
