"""The batch's node budget (ECHO, arXiv 2604.09603): every request's draft tree is one branch of a super-tree, and
one rule decides width, depth and the split across requests.

A node's expected value is its *path* acceptance probability, the product of the (calibrated) per-node probabilities
``DraftTree.node_probs`` along its path: summed over a tree, the expected number of accepted tokens (siblings hold
distinct tokens, so their events are disjoint). Path probabilities never increase with depth (each factor is clipped
to [0, 1]), so admitting nodes best-first — ties broken by node index, parents come first — always admits an
ancestor-closed set. The rule: with ``E0`` tokens expected from plain decoding (one per decoding request) in ``t(T0)``,
admitting the first ``k`` nodes yields ``(E0 + G_k) / t(T0 + k)`` tokens per second, where ``G_k`` is the sum of the
first ``k`` path probabilities. ECHO admits while the next node's marginal gain per marginal second beats the rate so
far; we take the best prefix outright (the same prefix where the rate is unimodal in ``k``, and still the best on
cost curves with steps), and admit nothing — plain decoding — when no prefix beats ``E0 / t(T0)``.

:class:`DraftGate` decides whether a drafter should run at all: the best rate its recent trees could reach, with its
measured cost added to the step, against plain decoding's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np
from numba import njit

from vllm_treespec.api import DraftTree
from vllm_treespec.cost.online import log2_bucket


#: slack on comparisons of an allowance (a sum of many shares of steps) with a step's extra seconds
ROUNDING_SECONDS = 1e-12


class StepCost(Protocol):
    """Seconds of steps of ``num_tokens`` tokens, of which ``plain_tokens`` are not drafts (the counts above it are
    steps that verify drafts); ``excess`` and ``request_excess`` (passed only when the caller knows the requests'
    contexts): the steps' context terms E and E_R, :class:`~vllm_treespec.cost.model.StepCostModel`."""

    def predict_many(self, num_tokens: np.ndarray, num_reqs: int = 1, excess: np.ndarray | float = 0.0,
                     plain_tokens: float | None = None, request_excess: float | None = None) -> np.ndarray: ...


def _predict(cost: StepCost, num_tokens: np.ndarray, num_reqs: int, excess: np.ndarray | None,
             plain_tokens: float, request_excess: float | None = None) -> np.ndarray:
    """``cost`` at ``num_tokens`` (``plain_tokens`` of them not drafts)."""
    if excess is None:
        seconds = cost.predict_many(num_tokens, num_reqs, plain_tokens=plain_tokens)
    else:
        seconds = cost.predict_many(num_tokens, num_reqs, excess=excess, plain_tokens=plain_tokens,
                                    request_excess=request_excess)
    return np.asarray(seconds, np.float64).copy()


def _prefix_seconds(cost: StepCost, num_tokens: np.ndarray, num_reqs: int, excess: np.ndarray | None,
                    plain_tokens: float, request_excess: float | None = None) -> np.ndarray:
    """:func:`_predict` of steps with more and more rows (``num_tokens`` ascending, the plain step first), made
    non-decreasing: a step with drafts costs at least the plain step, and at most what a step with more drafts is
    predicted to.

    The floor: a row of a request shorter than the curve's context carries a negative context term, which on a curve
    flat between its points priced it below zero (a served engine's own curve: 18.17, 17.96, 17.75 ms for 0, 1, 2
    such rows at 4 requests), so drafting looked cheaper than the plain step. The ceiling trusts the cheaper of two
    predictions that disagree: a step timed while something else held the core (a neighbouring server's polling
    worker) only ever reads slower, and the correction of a size the gate then prices too dear is never timed again.
    In a served bf16 engine whose warm-up ran beside its neighbour's, verifying 1 draft was priced at 93 ms, 32 drafts
    at 50 ms and the plain step at 25 ms; a running maximum priced every tree at 93 ms or more, and graft stopped
    drafting at one request for a whole level (it drafted on 118 of its 1,854 steps)."""
    seconds = _predict(cost, num_tokens, num_reqs, excess, plain_tokens, request_excess)
    if seconds.size > 1:
        seconds[1:] = np.maximum(np.minimum.accumulate(seconds[:0:-1])[::-1], seconds[0])
    return seconds


#: no cap
INT64_MAX = int(np.iinfo(np.int64).max)


def _zero_then_cumsum(values: np.ndarray) -> np.ndarray:
    """0 followed by the running sums of ``values`` (float64)."""
    out = np.zeros(values.size + 1)
    np.cumsum(values, out=out[1:])
    return out


def path_probs(tree: DraftTree) -> np.ndarray:
    """Acceptance probability of each node's whole path (float64, non-increasing from parent to child)."""
    if tree.node_probs is None:
        raise ValueError("the tree has no node_probs")
    return path_products(tree.parents, tree.node_probs)


def path_products(parents: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Per node (topological order), the product of ``probs`` along its path from the root, each factor clipped to
    [0, 1] (NaN = 0)."""
    # fresh C arrays of fixed types: one compiled kernel for every caller
    return _path_products(fresh_array(parents, np.int64), fresh_array(probs, np.float64))


def fresh_array(values: Any, dtype: type) -> np.ndarray:
    """``values`` as a C-contiguous writable array of ``dtype`` (``np.require``'s result at a fifth of its cost)."""
    array = np.asarray(values)
    if array.dtype != dtype or not (array.flags.c_contiguous and array.flags.writeable):
        array = array.astype(dtype)  # a fresh C-ordered copy
    return array


@njit(cache=True)
def _path_products(parents, probs):
    """:func:`path_products` node by node (a NumPy element loop cost ~30 us a 32-node tree, several times a step)."""
    out = np.empty(probs.shape[0])
    for i in range(probs.shape[0]):
        q = probs[i]
        q = 0.0 if np.isnan(q) else min(max(q, 0.0), 1.0)
        out[i] = q if parents[i] < 0 else out[parents[i]] * q
    return out


def is_ancestor_closed(tree: DraftTree, keep: np.ndarray) -> bool:
    parents = tree.parents
    kept = np.flatnonzero(keep)
    return bool(np.all((parents[kept] < 0) | keep[np.maximum(parents[kept], 0)]))


def trim(tree: DraftTree, keep: np.ndarray) -> DraftTree:
    """The subtree of the kept nodes, in their original (topological; BFS stays BFS) order, parents re-indexed."""
    keep = np.asarray(keep, bool)
    if keep.shape != (tree.num_nodes,):
        raise ValueError(f"keep has shape {keep.shape} for {tree.num_nodes} nodes")
    if not is_ancestor_closed(tree, keep):
        raise ValueError("the kept nodes are not ancestor-closed")
    return _trim_closed(tree, keep)


def _trim_closed(tree: DraftTree, keep: np.ndarray) -> DraftTree:
    """:func:`trim` of a ``keep`` (bool, one per node) known to be ancestor-closed."""
    if keep.all():
        return tree
    new_index = np.cumsum(keep) - 1
    parents = tree.parents[keep]
    new_parents = np.where(parents < 0, -1, new_index[np.maximum(parents, 0)]).astype(np.int32)
    probs = None if tree.node_probs is None else tree.node_probs[keep]
    sources = None if tree.node_sources is None else tree.node_sources[keep]
    return DraftTree.of_valid(tree.token_ids[keep], new_parents, probs, sources)


@dataclass
class Allocation:
    """The admitted nodes. ``trees[i]`` is request i's trimmed tree (the input tree when it had no node_probs, None
    when it was None or nothing of it was admitted); ``num_nodes[i]`` its admitted node count."""

    trees: list[DraftTree | None]
    num_nodes: np.ndarray
    expected_tokens: float  # per step, plain decoding's tokens included
    seconds: float  # predicted step time
    plain_rate: float  # tokens per second without these drafts
    gains: np.ndarray = field(default_factory=lambda: np.zeros(0))  # path probs of the candidates, best first
    admitted_gain: float = 0.0  # expected accepted drafts of the admitted nodes (expected_tokens less plain's)

    @property
    def rate(self) -> float:
        return self.expected_tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def total_nodes(self) -> int:
        return int(self.num_nodes.sum())


def _row_seconds(cost: StepCost, num_reqs: int, base_tokens: int, base_excess: float, row_excess: np.ndarray,
                 request_excess: float | None = None) -> np.ndarray:
    """Per request, the seconds one more row of it adds to the plain step (at least a microsecond)."""
    tokens = np.full(row_excess.size + 1, base_tokens + 1, np.float64)
    tokens[0] = base_tokens
    seconds = _predict(cost, tokens, num_reqs, base_excess + np.concatenate([[0.0], row_excess]), base_tokens,
                       request_excess)
    return np.maximum(seconds[1:] - seconds[0], 1e-6)


def best_prefix(gains: np.ndarray, cost: StepCost, num_reqs: int, base_tokens: int, base_expected: float,
                overhead: float = 0.0, min_gain: float = 0.0, max_extra_seconds: float | None = None,
                explore: bool = False, excess: np.ndarray | None = None, plain_tokens: int | None = None,
                request_excess: float | None = None) -> tuple[int, float, float, float]:
    """The k in 0..len(gains) maximising (base_expected + sum(gains[:k])) / (t(base_tokens + k) + overhead * [k>0]),
    among the k whose step costs at most ``max_extra_seconds`` more than the plain step's (None: any).
    Returns (k, expected tokens, seconds, plain rate); k > 0 only if its rate beats plain's by the factor 1 + min_gain.
    ``explore`` (with ``max_extra_seconds``): the largest such k instead, paying or not. ``excess``: the context term
    of each prefix's step (len(gains) + 1 values; None: every row at the curve's context); ``request_excess``: the
    steps' E_R (:meth:`StepCostModel.predict_many`). ``plain_tokens``: the
    step's tokens without any draft (default ``base_tokens``; less when the base holds drafts of trees without
    node_probs)."""
    k_all = np.arange(gains.size + 1)
    plain_tokens = base_tokens if plain_tokens is None else plain_tokens
    seconds = _prefix_seconds(cost, base_tokens + k_all, num_reqs, excess, plain_tokens, request_excess)
    seconds[1:] += overhead
    expected = base_expected + _zero_then_cumsum(gains)
    rates = expected / np.maximum(seconds, 1e-12)
    plain = float(rates[0])
    if max_extra_seconds is not None:
        affordable = seconds - seconds[0] <= max_extra_seconds + ROUNDING_SECONDS
        affordable[0] = True  # the plain step, whatever the allowance (a negative one once killed a served engine)
        if explore:
            k = int(np.flatnonzero(affordable)[-1])
            return k, float(expected[k]), float(seconds[k]), plain
        rates[1:][~affordable[1:]] = -np.inf
    k = int(np.argmax(rates))  # first maximum: the fewest nodes among equals
    if k and not rates[k] > plain * (1 + min_gain):
        k = 0
    return k, float(expected[k]), float(seconds[k]), plain


def allocate(trees: Sequence[DraftTree | None], cost: StepCost, *, num_reqs: int | None = None,
             base_tokens: int | None = None, base_expected: float | None = None,
             per_request_cap: int | Sequence[int] | None = None, batch_cap: int | None = None,
             overhead: float = 0.0, min_gain: float = 0.0, max_extra_seconds: float | None = None,
             explore: bool = False, row_excess: np.ndarray | None = None) -> Allocation:
    """Admit the batch's draft nodes best-first by path probability while they raise expected tokens per second.

    trees: one per request (None: no draft). Trees without ``node_probs`` are kept whole; their nodes count as
        step tokens with no expected gain.
    num_reqs: requests in the step (default ``len(trees)``); base_tokens: the step's tokens without drafts (default
        ``num_reqs``, one per decoding request; add prefill chunks); base_expected: tokens plain decoding yields per
        step (default ``num_reqs``).
    per_request_cap: most nodes per request (``num_speculative_tokens``), an int or one per request;
        batch_cap: most nodes in the step.
    overhead: seconds a step with drafts costs beyond the curve (host work of tree verification).
    min_gain: admit only if the rate beats plain decoding's by this relative margin.
    max_extra_seconds: admit no more than a step this much dearer than plain decoding's can verify (a probe's
        allowance, :class:`DraftGate`).
    explore: with ``max_extra_seconds``, admit as many nodes (best first) as that allows, whether they pay at their
        prices or not: a probe that verifies only the nodes that pay learns nothing once low prices stopped the
        drafting, and the calibration learns only from the nodes of proposed trees (verified, or decided by the
        committed token after the last accepted node).
    row_excess: per request, what one more row of it adds to the step's context term (its sequence length beyond
        the cost curve's context; ``StepTime.row_excess``): a node of a long request costs more than one of a short
        one. The plain step's rows are priced with it too. None: every row at the curve's context.
    """
    n = len(trees)
    num_reqs = n if num_reqs is None else int(num_reqs)
    base_tokens = num_reqs if base_tokens is None else int(base_tokens)
    base_expected = float(num_reqs if base_expected is None else base_expected)
    if per_request_cap is None or isinstance(per_request_cap, (int, np.integer)):
        caps = np.full(n, INT64_MAX if per_request_cap is None else int(per_request_cap), np.int64)
    else:
        caps = np.broadcast_to(np.asarray(per_request_cap, np.int64), (n,)).copy()
    fixed = 0
    probs: list[np.ndarray] = []
    for i, tree in enumerate(trees):
        if tree is not None and tree.node_probs is None:
            fixed += min(tree.num_nodes, int(caps[i]))
        probs.append(path_probs(tree) if tree is not None and tree.node_probs is not None and tree.num_nodes
                     else np.zeros(0))
    per_request = None if row_excess is None else np.asarray(row_excess, np.float64)
    if per_request is not None and per_request.shape != (n,):
        per_request = np.broadcast_to(per_request, (n,))
    fixed_excess = 0.0 if per_request is None else sum(
        float(per_request[i]) * min(t.num_nodes, int(caps[i])) for i, t in enumerate(trees)
        if t is not None and t.node_probs is None)
    # each request's own row: its sequence, read once whatever its rows (E_R)
    request_excess = None if per_request is None else float(per_request.sum())
    base_excess = 0.0 if per_request is None else request_excess + fixed_excess
    if all(tree is None or (tree.node_probs is not None and not tree.num_nodes) for tree in trees):
        # nothing to admit (a step whose drafter found nothing): the plain step, priced as below, without the rest
        k, expected, seconds, plain = best_prefix(np.zeros(0), cost, num_reqs, base_tokens, base_expected, overhead,
                                                  min_gain, max_extra_seconds, explore,
                                                  None if per_request is None else np.array([base_excess]),
                                                  base_tokens, request_excess)
        return Allocation([None] * n, np.zeros(n, np.int64), expected, seconds, plain, np.zeros(0), 0.0)
    # past the shortcut some tree holds a node, so n >= 1 and every concatenation has arrays to join
    req = np.concatenate([np.full(p.size, i, np.int64) for i, p in enumerate(probs)])
    node = np.concatenate([np.arange(p.size) for p in probs])
    p_all = np.concatenate(probs)
    # best first by gain per second a node adds (by gain alone when every row costs the same); equal keys: lower
    # request, then parent before child. Within a request every node costs the same, so the order keeps parents
    # before children and any prefix is ancestor-closed.
    value = p_all if per_request is None else p_all / _row_seconds(cost, num_reqs, base_tokens + fixed, base_excess,
                                                                   per_request, request_excess)[req]
    order = np.lexsort((node, req, -value))
    counts, cap_of, req_of, positive = [0] * n, caps.tolist(), req.tolist(), (p_all > 0).tolist()
    room = INT64_MAX if batch_cap is None else max(int(batch_cap) - fixed, 0)
    candidates = []
    for j in order.tolist():  # on Python ints: NumPy's per-element access cost more than the rest of the loop
        if len(candidates) >= room or not positive[j]:
            break
        i = req_of[j]
        if counts[i] < cap_of[i]:
            counts[i] += 1
            candidates.append(j)
    candidates = np.array(candidates, np.int64)
    gains = p_all[candidates] if candidates.size else np.zeros(0)
    excess = None
    if per_request is not None:
        excess = base_excess + _zero_then_cumsum(per_request[req[candidates]])
    k, expected, seconds, plain = best_prefix(gains, cost, num_reqs, base_tokens + fixed, base_expected, overhead,
                                              min_gain, max_extra_seconds, explore, excess, base_tokens,
                                              request_excess)
    admitted = candidates[:k]
    out: list[DraftTree | None] = []
    num_nodes = np.zeros(n, np.int64)
    offsets = np.cumsum([0] + [p.size for p in probs]).tolist()
    for i, tree in enumerate(trees):
        if tree is None:
            out.append(None)
            continue
        if tree.node_probs is None:
            kept = tree.truncate(int(min(tree.num_nodes, caps[i])))
            num_nodes[i] = kept.num_nodes
            out.append(kept)
            continue
        keep = np.zeros(tree.num_nodes, bool)
        mine = admitted[req[admitted] == i] - offsets[i]
        keep[mine] = True
        num_nodes[i] = int(keep.sum())
        out.append(_trim_closed(tree, keep) if num_nodes[i] else None)  # best first keeps parents first
    return Allocation(out, num_nodes, expected, seconds, plain, gains, expected - base_expected)


def _zero_padded_sum(arrays: Sequence[np.ndarray], size: int = 0) -> np.ndarray:
    """The element-wise sum of 1-D ``arrays``, each padded with zeros to the longest (and to at least ``size``)."""
    out = np.zeros(max(size, max(a.size for a in arrays)))
    for a in arrays:
        out[: a.size] += a
    return out


#: :attr:`DraftGate.gains` per node: the batch sizes whose best nodes it tells apart exactly divide it
GAIN_RESOLUTION = 16
#: consecutive skipped steps a gate decides on one prediction of its candidate steps while its batch and its trees'
#: gains stay the same (:meth:`DraftGate.should_draft`): predicting every candidate node count took ~0.1 ms of each
#: plain step at 16 requests, and what enters it (the online corrections, host time, contexts) moves little in a few
#: steps
REPRICE_EVERY = 8


def load_bucket(num_reqs: int) -> int:
    """The load a drafter gate's saving is learnt for: the power of two nearest ``num_reqs`` in log2 (1, 2, 4, 8,
    ...; :func:`log2_bucket`, as the drafter's call cost it is weighed against)."""
    return 1 << log2_bucket(num_reqs)


class DrafterCost(Protocol):
    def predict(self, x: float) -> float | None: ...


class DraftGate:
    """Whether running the drafter pays: the best rate its recent trees could reach — per-request marginal gains learnt
    from recent allocations' candidates (an exponentially weighted mean, best first), merged best-first across the
    batch — with the drafter's own seconds added to the step, against plain decoding's rate. With no history it
    drafts. Otherwise, after ``probe_every`` consecutive skipped steps it drafts once (a probe) to refresh what its
    trees are worth. A probe after which drafting still does not pay doubles the wait for the next one, up to
    ``max_probe_every``; a step that drafts again resets it.

    A drafter whose measured call costs at most ``free_share`` of a plain step drafts on every step, without probes:
    the allocation still admits only the nodes that pay, so a step that admits none costs just the call, and a
    retrieval drafter's match (a passage repeated from the prompt) is verified on the step it appears, not at the
    next probe. So does a drafter whose recent allocations saved more seconds per call than the call costs
    (:meth:`allocated`, :meth:`verified`: measured from what the target accepted): the mean of its trees' gains
    hides a drafter whose trees are worthless on most steps and pay well on a few (a retrieval match every tenth
    step); what each allocation saved, averaged over the steps, does not. That saving is learnt per load: by the
    drafting requests' power-of-two bucket (:func:`load_bucket`). What drafting saved at 8 requests says nothing of
    16, where a verified token costs more beside a longer step: one surplus for every load kept a served head
    drafting for the first 24 steps of a 16-request level on what it had saved at 8 (18 nodes admitted in all).

    A probe's verification is paid from an allowance: every skipped step adds ``probe_share`` of its predicted time,
    and a probe adds to its step as many nodes as that pays for, best first, whether they pay at their prices or not
    (``probe_seconds``, for :func:`allocate`'s ``max_extra_seconds`` and ``explore``): prices only change with
    verified nodes. Where a verified token costs most of a step (bf16 on an AVX2 CPU) a probe of 16 nodes would cost
    ten plain steps; there a probe verifies a node or two, while on a flat curve (GPUs) it verifies whole trees. A
    probe waits, past its schedule, until the allowance pays for one node and the drafter's measured call for that
    node's request. The drafter is asked for only as many requests as the allowance pays nodes and calls for
    (``probe_requests``): the allocation admits no more nodes than that, and an EAGLE head's call for every request
    of a 16-request CPU step cost about two plain steps per probe. What the call is predicted to take is not left
    for verification (``probe_seconds`` is the rest): uncounted, graft's calls for the 5-8 requests of a probe at
    14-16 bf16 requests took 10-18 ms beside an allowance of 20-40 ms, and its two probes in a 16-request batch cost
    1.1% of the batch's decode time.
    A run of skipped steps on the same requests re-uses one prediction of its candidate steps for up to
    ``REPRICE_EVERY`` decisions (the online corrections, host time and contexts in it move little in a few steps);
    the drafter's price is added anew each time, and new gains, a draft or a probe predict afresh.
    Feed it every drafted step's trees (:meth:`record`), before or after :func:`allocate`."""

    def __init__(self, cost: StepCost, drafter_cost: DrafterCost | None = None, alpha: float = 0.2,
                 probe_every: int = 16, overhead: float = 0.0, max_probe_every: int = 128,
                 probe_share: float = 0.01, free_share: float = 0.02, surplus_alpha: float = 0.05) -> None:
        self.cost = cost
        self.free_share = free_share
        self.surplus_alpha = surplus_alpha
        #: by load bucket (load_bucket): seconds per drafted step its allocations saved against plain decoding,
        #: measured from their outcomes and exponentially weighted from 0 (one lucky probe does not start a run of
        #: calls; a sure match, saving whole steps, does)
        self.surplus_by_load: dict[int, float] = {}
        self._load = 1  # the load bucket of the last decision: the one its allocation's saving is learnt for
        #: the last allocation (its load bucket, base tokens, plain rate, seconds), until its outcome arrives
        self._pending: tuple[int, float, float, float] | None = None
        self.drafter_cost = drafter_cost
        self.alpha = alpha
        self.probe_every = probe_every
        self.max_probe_every = max(max_probe_every, probe_every)
        self.interval = probe_every  # skipped steps before the next probe
        self.overhead = overhead
        self.probe_share = probe_share
        self.allowance = 0.0  # seconds the skipped steps since the last probe set aside for the next one
        self.probe_seconds: float | None = None  # the last probe's verification allowance (None: not capped)
        #: requests the last probe drafts for (None: all): as many as its allowance verifies nodes
        self.probe_requests: int | None = None
        self.gains = None  # per request, the expected gain of its best nodes, finer than a node (a property)
        self.skipped = 0
        self.probing = False  # the last should_draft was a probe: its trees are explored, not priced
        self._after_probe = False  # no decision since the last probe
        self._forgotten = False  # forget() ran since the gains were last learnt: no history, but no probe either
        self.last_rates: tuple[float, float] | None = None  # (best with drafting, plain) of the last priced decision
        #: the prediction skipped steps re-use: ((cost model, requests, max nodes, base tokens), decisions it served,
        #: (expected tokens, predicted seconds) by drafts admitted)
        self._priced: tuple[tuple[int, int, int | None, int | None], int, tuple[np.ndarray, np.ndarray]] | None = None

    @property
    def marginal(self) -> np.ndarray | None:
        """Per request, the expected gain of its j-th best node (the mean of :attr:`gains` over each node)."""
        return None if self._gains is None else self._gains.reshape(-1, GAIN_RESOLUTION).mean(axis=1)

    @marginal.setter
    def marginal(self, value: np.ndarray | None) -> None:
        self.gains = None if value is None else np.repeat(np.asarray(value, np.float64), GAIN_RESOLUTION)

    @property
    def gains(self) -> np.ndarray | None:
        """Per request, the expected gain per node of each ``1 / GAIN_RESOLUTION`` of its nodes, best first: a step
        of 8 requests whose best node was one request's can only be told from 8 requests' best nodes at a resolution
        finer than a node per request."""
        return self._gains

    @gains.setter
    def gains(self, value: np.ndarray | None) -> None:
        self._gains = value
        self._prefix: tuple[tuple[int, int | None], np.ndarray, np.ndarray] | None = None
        self._priced = None

    def _gain_prefix(self, num_reqs: int, max_nodes: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(k = 0..K, expected tokens of a step of ``num_reqs`` requests with its best k nodes), kept until the
        gains change: the gate asks on every step, and they change only on drafted ones. The best k nodes of
        ``num_reqs`` requests are each request's best ``k / num_reqs``."""
        key = (int(num_reqs), max_nodes)
        if self._prefix is None or self._prefix[0] != key:
            gains = self._gains if self._gains is not None else np.zeros(0)
            if max_nodes is not None:
                gains = gains[: max_nodes * GAIN_RESOLUTION]
            per_request = np.concatenate([[0.0], np.cumsum(gains)]) / GAIN_RESOLUTION
            k = np.arange(num_reqs * (gains.size // GAIN_RESOLUTION) + 1)
            grid = np.arange(per_request.size) / GAIN_RESOLUTION
            self._prefix = (key, k, num_reqs + num_reqs * np.interp(k / num_reqs, grid, per_request))
        return self._prefix[1], self._prefix[2]

    def forget(self) -> None:
        """A batch of new requests: forget what the trees of the requests before them were worth (and the wait for
        the next probe), so that the next decision drafts and learns these requests' trees. Their text says little
        of a new prompt's: at one request a gate that had stopped drafting near the end of one prompt kept skipping
        the next prompts' steps until its next probe, 16-128 steps away (fp32, served: 5 of 16 requests of one round
        began so, and 371 of its 912 steps were skipped, where the same prompts drafted on every step in the next
        round). That decision is a draft, not a probe: its trees are priced as any (an engine's first step probes,
        and a probe has graft's head draft, catching up on the whole prompt). What drafting saved at a load
        (:attr:`surplus`) and the probes' allowance are kept: they price drafting at that load, not the text."""
        self.gains = None
        self.skipped = 0
        self.interval = self.probe_every
        self._after_probe = False
        self._forgotten = True

    @property
    def surplus(self) -> float:
        """What drafting saved per drafted step lately, at the load of the last decision (0 where never learnt)."""
        return self.surplus_by_load.get(self._load, 0.0)

    def record(self, trees: Sequence[DraftTree | None], scale: float = 1.0, requests: int | None = None,
               per_request_cap: int | None = None) -> None:
        """Learn from one step's proposals what a request's best nodes are worth, as :func:`allocate` takes them: the
        step's path probabilities merged best first across its ``n`` requests, the j-th of them at ``j / n`` of a
        request's nodes. A mean of each tree's j-th best node, repeated for every request, priced one long retrieval
        match beside seven empty trees as eight mediocre trees, where the allocator admits the match's nodes first.
        Each path probability is scaled by ``scale`` (at most 1): the verifier's expectation correction, for trees it
        has not corrected yet. ``requests``: the requests the drafter was asked for (default: the trees that are not
        None; a tree without nodes counts, as nothing); ``per_request_cap``: most nodes of one tree the allocator
        admits (``num_speculative_tokens``)."""
        sorted_probs = [np.minimum(np.sort(path_probs(t))[::-1][:per_request_cap] * scale, 1.0) for t in trees
                        if t is not None and t.node_probs is not None]
        if not any(p.size for p in sorted_probs):
            return
        num_requests = max(len(sorted_probs) if requests is None else int(requests), 1)
        merged = np.sort(np.concatenate(sorted_probs))[::-1]
        # a request's expected gain from its best x nodes, x = j / num_requests at the merged j-th node
        nodes = np.arange(merged.size + 1) / num_requests
        gain = np.concatenate([[0.0], np.cumsum(merged)]) / num_requests
        grid = np.arange(-(-merged.size // num_requests) * GAIN_RESOLUTION + 1) / GAIN_RESOLUTION
        current = np.diff(np.interp(grid, nodes, gain)) * GAIN_RESOLUTION
        self._forgotten = False
        if self.gains is None:
            self.gains = current
            return
        size = max(current.size, self.gains.size)
        old, current = _zero_padded_sum([self.gains], size), _zero_padded_sum([current], size)
        self.gains = (1 - self.alpha) * old + self.alpha * current

    def allocated(self, allocation: Allocation | None, extra_seconds: float = 0.0) -> None:
        """A drafted step's allocation (None: the drafter proposed nothing). One that admitted nothing saved nothing;
        what one that admitted nodes saved is learnt from its outcome (:meth:`verified`), with ``extra_seconds``
        (the tree work a probe is priced without) added to its step."""
        self._pending = None
        if allocation is None or not allocation.total_nodes or allocation.plain_rate <= 0:
            self._learn_saving(self._load, 0.0)
            return
        base_tokens = allocation.expected_tokens - allocation.admitted_gain
        self._pending = (self._load, base_tokens, allocation.plain_rate, allocation.seconds + extra_seconds)

    def verified(self, accepted: int | None) -> None:
        """The last allocation's outcome: ``accepted`` drafts (None: none was verified). What it saved is the
        seconds plain decoding needs for the tokens it committed less its predicted step — negative when its nodes
        cost more than their accepted tokens. Expected tokens would count what the calibration believed: after one
        allocation it overrated, the surplus kept a drafter calling for dozens of steps on a saving never made."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        load, base_tokens, plain_rate, seconds = pending
        self._learn_saving(load, (base_tokens + accepted) / plain_rate - seconds if accepted is not None else 0.0)

    def _learn_saving(self, load: int, saved: float) -> None:
        old = self.surplus_by_load.get(load, 0.0)
        self.surplus_by_load[load] = (1 - self.surplus_alpha) * old + self.surplus_alpha * saved

    def expected_best(self, num_reqs: int, max_nodes: int | None = None, base_tokens: int | None = None,
                      drafter_seconds: float = 0.0, row_excess: float | None = None) -> tuple[float, float]:
        """(best rate with drafting, plain rate) for a batch of ``num_reqs`` decoding requests (``row_excess``: the
        context term of one of their rows, on average; None: at the curve's context)."""
        k_all, tokens = self._gain_prefix(num_reqs, max_nodes)
        return self._best_rates(tokens, self._step_seconds(num_reqs, k_all, base_tokens, row_excess),
                                drafter_seconds)

    def _step_seconds(self, num_reqs: int, k_all: np.ndarray, base_tokens: int | None,
                      row_excess: float | None) -> np.ndarray:
        """The predicted step of ``num_reqs`` decoding requests with each count of ``k_all`` drafts."""
        base = num_reqs if base_tokens is None else base_tokens
        if row_excess is None:
            return _prefix_seconds(self.cost, base + k_all, num_reqs, None, base)
        # every request alike: a row each, then the drafts' rows; each sequence read once
        return _prefix_seconds(self.cost, base + k_all, num_reqs, (num_reqs + k_all) * row_excess, base,
                               num_reqs * row_excess)

    def _best_rates(self, tokens: np.ndarray, seconds: np.ndarray, drafter_seconds: float) -> tuple[float, float]:
        """(best rate with drafting, plain rate) of steps of ``seconds`` and expected ``tokens`` (plain first), a
        step with drafts ``drafter_seconds`` and the tree work dearer."""
        plain = float(tokens[0] / max(seconds[0], 1e-12))
        if seconds.size < 2:
            return 0.0, plain
        drafting = tokens[1:] / np.maximum(seconds[1:] + (drafter_seconds + self.overhead), 1e-12)
        return float(drafting.max()), plain

    def should_draft(self, num_reqs: int, max_nodes: int | None = None, base_tokens: int | None = None,
                     row_excess: float | None = None, extra_seconds: float = 0.0,
                     rival_rate: float | None = None, shared_seconds: float = 0.0) -> bool:
        """``row_excess``: the context term of one of the requests' rows, on average (None: at the curve's
        context). ``extra_seconds``: what drafting for these requests now costs beyond the drafter's measured call
        (a head's catch-up on the rows that steps without drafts left it): part of the price, and a probe pays it,
        per probed request, out of its allowance. ``rival_rate``: the expected rate of what runs instead of this
        drafter (graft's retrieval-only trees instead of its head), which it must beat as it must beat plain
        decoding's; a step it loses to either is skipped, so its probes still refresh what its trees are worth.
        ``shared_seconds``: what a drafting step costs besides this drafter, paid by its rival too (the rest of graft's
        call and the tree work, when its head's gate decides): added to drafting's step when it is weighed against
        plain decoding (``rival_rate`` must include it likewise), but neither to the call a free or saving drafter
        is judged by nor to a probe's price, which the step pays whether this drafter drafts or not."""
        self.probing = False
        self.probe_seconds = self.probe_requests = None
        self.last_rates = None
        if num_reqs <= 0:
            return False
        self._load = load_bucket(num_reqs)
        if self.gains is None:  # nothing known yet: draft, and learn (a probe, but after forget())
            if self._forgotten:  # (no prediction to drop: the gains setter dropped it)
                return True
            return self._probe(None)
        measured = self._measured_call(num_reqs)
        drafter = (measured or 0.0) + extra_seconds  # a drafter not timed yet counts as free: it drafts, is timed
        best, plain = self._rates(num_reqs, max_nodes, base_tokens, drafter + shared_seconds, row_excess)
        self.last_rates = (best, plain)
        after_probe, self._after_probe = self._after_probe, False
        cheap = measured is not None and plain > 0 and drafter <= self.free_share * num_reqs / plain
        saves = measured is not None and self.surplus > drafter
        if best > max(plain, rival_rate or 0.0) or cheap or saves:
            self.skipped = 0
            self.interval = self.probe_every
            self._priced = None
            return True
        if self.skipped >= self.interval:
            affordable, call = self._affordable_nodes(num_reqs, base_tokens, row_excess, limit=num_reqs,
                                                      per_request=extra_seconds / num_reqs)
            if affordable:
                allowance, self.allowance = self.allowance, 0.0
                return self._probe(max(allowance - call, 0.0), requests=affordable)
        if after_probe:  # what the probe learned does not pay either
            self.interval = min(2 * self.interval, self.max_probe_every)
        self.skipped += 1
        if plain > 0:
            self.allowance += self.probe_share * num_reqs / plain  # a share of the plain step's predicted seconds
        return False

    def _rates(self, num_reqs: int, max_nodes: int | None, base_tokens: int | None, drafter_seconds: float,
               row_excess: float | None) -> tuple[float, float]:
        """:meth:`expected_best`, its predicted steps re-used for up to ``REPRICE_EVERY`` consecutive decisions on the
        same requests, caps and gains (a decision to draft, a probe or new gains price the next one afresh); the
        drafter's price and the tree work are added anew each time."""
        key = (id(self.cost), int(num_reqs), max_nodes, base_tokens)
        priced = self._priced
        if priced is not None and priced[0] == key and priced[1] < REPRICE_EVERY:
            self._priced = (key, priced[1] + 1, priced[2])
            tokens, seconds = priced[2]
        else:
            k_all, tokens = self._gain_prefix(num_reqs, max_nodes)
            seconds = self._step_seconds(num_reqs, k_all, base_tokens, row_excess)
            self._priced = (key, 1, (tokens, seconds))
        return self._best_rates(tokens, seconds, drafter_seconds)

    def _affordable_nodes(self, num_reqs: int, base_tokens: int | None, row_excess: float | None,
                          limit: int, per_request: float = 0.0) -> tuple[int, float]:
        """How many nodes (at most ``limit``) the allowance pays for verifying in a step of ``num_reqs`` decoding
        requests, each node a request of its own that costs ``per_request`` seconds more to draft for, with the
        drafter's predicted call for that many requests; and that call's predicted seconds (0: not timed yet)."""
        extra = np.arange(limit + 1, dtype=np.float64)
        seconds = self._step_seconds(num_reqs, extra, base_tokens, row_excess)
        verifying = seconds[1:] - seconds[0] + per_request * extra[1:]  # >= 0: _step_seconds never decreases
        affordable, call = 0, 0.0
        for k in range(1, limit + 1):  # rarely more than a few: verifying alone soon exceeds the allowance
            seconds_k = self._measured_call(k) or 0.0
            if verifying[k - 1] + seconds_k > self.allowance + ROUNDING_SECONDS:
                break
            affordable, call = k, seconds_k
        return affordable, call

    def _measured_call(self, num_reqs: int) -> float | None:
        """The drafter's predicted call for ``num_reqs`` requests (None: no drafter cost, or not timed yet)."""
        return self.drafter_cost.predict(num_reqs) if self.drafter_cost is not None else None

    def _probe(self, seconds: float | None, requests: int | None = None) -> bool:
        """Draft this step to learn what the trees are worth, verifying at most ``seconds`` more (None: uncapped),
        for at most ``requests`` requests (None: all)."""
        self.skipped = 0
        self._priced = None
        self.probing = self._after_probe = True
        self.probe_seconds = seconds
        self.probe_requests = requests
        return True
