"""graft's draft, grown level by level under the node budget and pruned at the confidence checkpoints (Graft's "draft
less"): the one place graft prunes, for a model drafter's tree and a retrieved tree alike. The rule itself is
:func:`vllm_treespec.pruning.below_checkpoint`, which the EAGLE drafter also applies while it expands."""

from __future__ import annotations

import math
from typing import Iterable, Iterator, NamedTuple

import numpy as np
from numba import njit

from vllm_treespec.api import DraftTree
from vllm_treespec.pruning import below_checkpoint
from vllm_treespec.retrieval import RetrievedTree


class DraftLevel(NamedTuple):
    """One level of a drafted tree: new nodes whose parents are earlier nodes (numbered in drafting order, -1 = root)
    with the drafter's log-probability of each token given its parent's path."""

    token_ids: np.ndarray
    parents: np.ndarray
    log_probs: np.ndarray


class DraftGrowth:
    """A draft tree grown level by level under a node budget and pruned at confidence checkpoints."""

    def __init__(self, budget: int, checkpoints: dict[int, float], max_depth: int) -> None:
        self.budget, self.checkpoints, self.max_depth = budget, checkpoints, max_depth
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.log_scores: list[float] = []  # cumulative log-prob of each node's path
        self.depths: list[int] = []
        self.depth = 0
        self.pruned_at: int | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def remaining(self) -> int:
        return self.budget - len(self.tokens)

    def add_level(self, level: DraftLevel) -> bool:
        """Add a level (its best nodes, if it does not fit); returns whether drafting should go on."""
        n = len(level.token_ids)
        if n == 0 or self.remaining <= 0 or self.depth >= self.max_depth:
            return False
        base = np.array([0.0 if p < 0 else self.log_scores[p] for p in level.parents.tolist()])
        scores = base + np.asarray(level.log_probs, np.float64)
        keep = np.arange(n)
        if n > self.remaining:  # the best nodes, in drafting order (a partial level is the last one)
            keep = np.sort(np.argsort(-scores, kind="stable")[: self.remaining])
        self.depth += 1
        self.tokens += level.token_ids[keep].tolist()
        self.parents += level.parents[keep].tolist()
        self.log_scores += scores[keep].tolist()
        self.depths += [self.depth] * keep.size
        if keep.size < n or self.remaining <= 0:
            return False
        if below_checkpoint(self.checkpoints, self.depth, float(scores.max())):
            self.pruned_at = self.depth
            return False
        return True

    @classmethod
    def grown(cls, token_ids: np.ndarray, parents: np.ndarray, depths: np.ndarray, probs: np.ndarray, budget: int,
              checkpoints: dict[int, float], max_depth: int) -> DraftGrowth:
        """A topologically ordered tree's nodes (``probs``: each node's probability given its parent's path) grown
        level by level as :func:`grow_draft` grows :func:`tree_levels`, node for node, in one compiled pass (the
        per-level NumPy calls were ~40% of graft's host time per request)."""
        draft = cls(budget, checkpoints, max_depth)
        if token_ids.size == 0:
            return draft
        log_probs = np.log(np.maximum(np.asarray(probs, np.float64), 1e-30))  # NumPy's log, as in _levels
        thresholds = np.full(max(checkpoints, default=0) + 1, np.nan)
        for depth, threshold in checkpoints.items():
            thresholds[depth] = threshold
        kept, kept_parents, scores, kept_depths, draft.depth, pruned_at = _grow(
            np.ascontiguousarray(parents, np.int64), np.ascontiguousarray(depths, np.int64), log_probs,
            int(budget), thresholds, int(max_depth))
        draft.tokens = np.asarray(token_ids)[kept].tolist()
        draft.parents = kept_parents.tolist()
        draft.log_scores = scores.tolist()
        draft.depths = kept_depths.tolist()
        draft.pruned_at = pruned_at if pruned_at > 0 else None
        return draft

    def deepest(self) -> int:
        """Index of the best-scored node on the deepest level (-1 if empty)."""
        if not self.tokens:
            return -1
        d = max(self.depths)
        return max((i for i in range(len(self.tokens)) if self.depths[i] == d), key=lambda i: self.log_scores[i])

    def path_tokens(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(self.tokens[node])
            node = self.parents[node]
        return path[::-1]


def grow_draft(levels: Iterable[DraftLevel], budget: int, checkpoints: dict[int, float],
               max_depth: int) -> DraftGrowth:
    """A drafted tree's levels, taken in order until the budget, ``max_depth`` or a checkpoint stops the draft."""
    draft = DraftGrowth(budget, checkpoints, max_depth)
    for level in levels:
        if not draft.add_level(level):
            break
    return draft


def grow_retrieved(tree: RetrievedTree, budget: int, checkpoints: dict[int, float], max_depth: int) -> DraftGrowth:
    """``grow_draft(tree_levels(tree), ...)`` in one compiled pass (:meth:`DraftGrowth.grown`)."""
    return DraftGrowth.grown(tree.token_ids, tree.parents, tree.depths(), tree.probs, budget, checkpoints, max_depth)


def grow_draft_tree(tree: DraftTree, budget: int, checkpoints: dict[int, float], max_depth: int) -> DraftGrowth:
    """``grow_draft(draft_tree_levels(tree), ...)`` in one compiled pass (:meth:`DraftGrowth.grown`)."""
    probs = tree.node_probs if tree.node_probs is not None else np.ones(tree.num_nodes, np.float32)
    return DraftGrowth.grown(tree.token_ids, tree.parents, tree.depths(), probs, budget, checkpoints, max_depth)


@njit(cache=True)
def _grow(parents, depths, log_probs, budget, thresholds, max_depth):  # pragma: no cover - compiled
    """:meth:`DraftGrowth.add_level` over :func:`_levels`, fused: (the kept nodes' indices into the tree, their
    parents in the kept numbering, cumulative log-probs and depths, the levels grown, the pruned depth or 0)."""
    n = parents.size
    order = np.argsort(depths, kind="mergesort")  # stable, as _levels
    new_index = np.empty(n, np.int64)
    for i in range(n):
        new_index[order[i]] = i
    capacity = max(min(n, budget), 0)
    kept = np.empty(capacity, np.int64)
    kept_parents = np.empty(capacity, np.int64)
    scores = np.empty(capacity, np.float64)
    kept_depths = np.empty(capacity, np.int64)
    count, depth, pruned_at, start = 0, 0, 0, 0
    while start < n:
        end = start
        while end < n and depths[order[end]] == depths[order[start]]:
            end += 1
        size, remaining = end - start, budget - count
        if remaining <= 0 or depth >= max_depth:
            break
        level = np.empty(size, np.float64)
        for j in range(size):
            parent = parents[order[start + j]]
            level[j] = (0.0 if parent < 0 else scores[new_index[parent]]) + log_probs[order[start + j]]
        if size > remaining:  # the best nodes, in drafting order (a partial level is the last one)
            chosen = np.sort(np.argsort(-level, kind="mergesort")[:remaining])
        else:
            chosen = np.arange(size)
        depth += 1
        for j in chosen:
            node = order[start + j]
            parent = parents[node]
            kept[count] = node
            kept_parents[count] = -1 if parent < 0 else new_index[parent]
            scores[count] = level[j]
            kept_depths[count] = depth
            count += 1
        if chosen.size < size or budget - count <= 0:
            break
        if depth < thresholds.size and math.exp(level.max()) < thresholds[depth]:  # below_checkpoint
            pruned_at = depth
            break
        start = end
    return kept[:count], kept_parents[:count], scores[:count], kept_depths[:count], depth, pruned_at


def compile_growth_kernel() -> None:
    """Compile :func:`_grow` (or load it from Numba's cache) at engine start-up, not inside the first request."""
    DraftGrowth.grown(np.array([5, 6, 7]), np.array([-1, 0, 0]), np.array([1, 2, 2]), np.array([0.9, 0.5, 0.4]),
                      2, {1: 0.1}, 4)


def tree_levels(tree: RetrievedTree) -> Iterator[DraftLevel]:
    """A retrieved tree (best-first order) as draft levels, nodes renumbered in level order."""
    return _levels(tree.token_ids, tree.parents, tree.depths(), tree.probs)


def draft_tree_levels(tree: DraftTree) -> list[DraftLevel]:
    """A draft tree as levels, nodes renumbered in level order (parents first)."""
    probs = tree.node_probs if tree.node_probs is not None else np.ones(tree.num_nodes, np.float32)
    return list(_levels(tree.token_ids, tree.parents, tree.depths(), probs))


def _levels(token_ids: np.ndarray, parents: np.ndarray, depths: np.ndarray, probs: np.ndarray
            ) -> Iterator[DraftLevel]:
    """Nodes of a topologically ordered tree grouped by depth, renumbered in level order, with log-probs."""
    if token_ids.size == 0:
        return
    order = np.argsort(depths, kind="stable")
    new_index = np.empty_like(order)
    new_index[order] = np.arange(order.size)
    log_probs = np.log(np.maximum(np.asarray(probs, np.float64), 1e-30))
    start = 0
    for d in range(1, int(depths.max()) + 1):
        nodes = order[start: start + int((depths == d).sum())]
        start += nodes.size
        node_parents = parents[nodes].astype(np.int64)
        yield DraftLevel(token_ids[nodes], np.where(node_parents < 0, -1, new_index[np.maximum(node_parents, 0)]),
                         log_probs[nodes])


def first_checkpoint_confidence(tree: RetrievedTree, depth: int) -> float:
    """Best path confidence of a retrieved tree at ``depth`` (or its deepest level, if shallower)."""
    if tree.num_nodes == 0:
        return 0.0
    depths, scores = tree.depths(), tree.path_scores()
    return float(scores[depths == min(depth, int(depths.max()))].max())
