"""graft's draft, grown level by level under the node budget and pruned at the confidence checkpoints (Graft's "draft
less"): the one place graft prunes, for a model drafter's tree and a retrieved tree alike. The rule itself is
:func:`vllm_treespec.pruning.below_checkpoint`, which the EAGLE drafter also applies while it expands."""

from __future__ import annotations

from typing import Iterable, Iterator, NamedTuple

import numpy as np

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
