"""graft's online acceptance calibration: how often the target accepts a node, by source and raw confidence, learned
from every verified tree, so that nodes of different sources are ranked and floored on one scale."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

#: raw-confidence bins of the online acceptance calibration (uniform over a node's probability given its parent)
ACCEPTANCE_BINS = 10
#: pseudo-trials at the raw confidence before a bin has data: early estimates stay near the source's own number
ACCEPTANCE_PRIOR_TRIALS = 8.0


class AcceptanceCalibration:
    """How often the target accepts a tree node, by source and by the node's raw confidence (its source's probability
    of the token given the parent's path), counted over the nodes whose parent was accepted.

    The sources' raw numbers are not on one scale (suffix-automaton continuation counts, the successor table's
    learned target distributions, the head's softmax), so graft ranks nodes across sources, and applies its
    confidence floor, on the observed rate instead: ``(accepts + m * raw) / (trials + m)`` per bin, ``m`` =
    :data:`ACCEPTANCE_PRIOR_TRIALS`, which is the raw number until a bin has data.
    """

    def __init__(self, sources: Sequence[str]) -> None:
        self.names = list(sources)
        self.trials = np.zeros((len(self.names), ACCEPTANCE_BINS))
        self.accepts = np.zeros((len(self.names), ACCEPTANCE_BINS))

    def source_id(self, name: str) -> int:
        return self.names.index(name)

    @staticmethod
    def bins(raw: np.ndarray) -> np.ndarray:
        return np.clip((np.asarray(raw, np.float64) * ACCEPTANCE_BINS).astype(np.int64), 0, ACCEPTANCE_BINS - 1)

    def __call__(self, source: int, raw: np.ndarray) -> np.ndarray:
        """Calibrated probabilities of nodes of one source with raw confidences ``raw``."""
        raw = np.clip(np.asarray(raw, np.float64), 0.0, 1.0)
        b = self.bins(raw)
        rate = (self.accepts[source, b] + ACCEPTANCE_PRIOR_TRIALS * raw) / (self.trials[source, b] +
                                                                           ACCEPTANCE_PRIOR_TRIALS)
        return np.minimum(rate, 1.0)

    def observe(self, sources: np.ndarray, raw: np.ndarray, accepted: np.ndarray) -> None:
        """Count verified nodes (each one's parent was accepted): their sources, raw confidences, outcomes."""
        b = self.bins(raw)
        np.add.at(self.trials, (sources, b), 1.0)
        np.add.at(self.accepts, (sources, b), np.asarray(accepted, np.float64))

    def observe_verified(self, results: Sequence[Any], last_trees: dict[str, Any]) -> None:
        """Count each verified tree's nodes whose parent was accepted (the target reached them) by source.
        ``last_trees``: the :class:`~.assemble.AssembledTree` each request was last proposed (popped here)."""
        sources, raws, accepted = [], [], []
        for r in results:
            last = last_trees.pop(r.req_id, None)
            n = r.tree.num_nodes
            # the verifier may have truncated the tree (a prefix) or replaced it (a chain fallback)
            if last is None or n == 0 or n > last.tree.num_nodes or \
                    not np.array_equal(r.tree.token_ids, last.tree.token_ids[:n]):
                continue
            hit = np.zeros(n, bool)
            hit[np.asarray(r.accepted_nodes, np.int64)] = True
            parents = np.asarray(r.tree.parents, np.int64)
            reached = (parents < 0) | hit[np.maximum(parents, 0)]
            known = reached & (last.sources[:n] >= 0)
            sources.append(last.sources[:n][known])
            raws.append(last.raw_probs[:n][known])
            accepted.append(hit[known])
        if sources:
            self.observe(np.concatenate(sources), np.concatenate(raws), np.concatenate(accepted))

    def table(self) -> dict[str, list[tuple[float, int]]]:
        """Per source and bin: (acceptance rate, trials), (nan, 0) for a bin without data (to inspect what a proposer
        has learned)."""
        return {name: [(round(float(a / t), 3), int(t)) if t else (float("nan"), 0)
                       for a, t in zip(self.accepts[i], self.trials[i])] for i, name in enumerate(self.names)}
