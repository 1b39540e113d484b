"""graft's final tree: the draft plus the best grafted nodes up to the budget, identical paths merged (the merge is
retrieval's :func:`vllm_treespec.retrieval.union_trees`), less the nodes below the confidence floor."""

from __future__ import annotations

from typing import Iterable, NamedTuple

import numpy as np

from vllm_treespec.api import DraftTree
from vllm_treespec.proposers.graft.growth import DraftGrowth
from vllm_treespec.retrieval import union_trees
from vllm_treespec.verify.calibration import AcceptanceCalibration


class AssembledTree(NamedTuple):
    tree: DraftTree
    #: per node: the source (AcceptanceCalibration id, -1 = unknown) whose path gave its score, and that source's raw
    #: confidence of the node given its parent (what the verifier calibrates and learns from)
    sources: np.ndarray
    raw_probs: np.ndarray
    #: nodes a graft added (not on the draft; the budget and the floor may also have dropped draft nodes)
    grafted: int = 0


def empty_assembled() -> AssembledTree:
    """What :func:`assemble_tree` makes of an empty draft and empty grafts."""
    return AssembledTree(DraftTree.of_valid(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32)),
                         np.zeros(0, np.int64), np.zeros(0, np.float64))


def assemble(draft: DraftGrowth, grafts: Iterable[tuple], budget: int, min_score: float = 0.0, *,
             calibration: AcceptanceCalibration | None = None, draft_source: int = -1) -> DraftTree:
    """:func:`assemble_tree` without the per-node sources."""
    return assemble_tree(draft, grafts, budget, min_score, calibration=calibration, draft_source=draft_source).tree


def assemble_tree(draft: DraftGrowth, grafts: Iterable[tuple], budget: int, min_score: float = 0.0, *,
                  calibration: AcceptanceCalibration | None = None, draft_source: int = -1) -> AssembledTree:
    """The draft nodes plus the best grafted nodes up to ``budget``, with identical paths merged, less the nodes
    scoring below ``min_score``.

    ``grafts`` are (draft node or -1 for the root, tree continuing that node[, source id]). A node's score is its path
    confidence (the highest any source gives the path), each step's probability passed through ``calibration`` (by
    source) when given; the result is ordered by score, so every prefix is the best subtree.
    """
    # the draft's own step probabilities (its nodes are in drafting order: parents first)
    log_scores = np.asarray(draft.log_scores, np.float64)
    draft_parents = np.asarray(draft.parents, np.int64)
    step_raw = np.exp(log_scores - np.where(draft_parents < 0, 0.0, log_scores[np.maximum(draft_parents, 0)])) \
        if log_scores.size else log_scores
    # the draft comes first, so a graft's draft node is also its index among all input nodes
    structure, attach, sources, raws = [(draft.tokens, draft_parents)], [-1], \
        [np.full(len(draft), draft_source, np.int64)], [step_raw]
    for at, tree, *source in grafts:
        source = int(source[0]) if source else -1
        structure.append((tree.token_ids, tree.parents))
        attach.append(-1 if at < 0 else at)
        sources.append(np.full(tree.num_nodes, source, np.int64))
        raws.append(np.asarray(tree.probs, np.float64))
    all_sources, all_raw = np.concatenate(sources), np.concatenate(raws)
    scored = all_raw
    if calibration is not None:  # every node of a known source in one call (each rate is the node's own)
        known = all_sources >= 0
        scored = all_raw.copy()
        if known.any():
            scored[known] = calibration(all_sources[known], all_raw[known])
    ends = np.cumsum([r.size for r in raws]).tolist()
    trees = [(tokens, parents, scored[end - raw.size: end]) for (tokens, parents), raw, end in zip(structure, raws, ends)]
    union = union_trees(trees, attach)
    num_draft = int(union.node_of[: len(draft)].max()) + 1 if len(draft) else 0  # a drafter may repeat a sibling
    score = union.scores
    grafted = np.arange(num_draft, score.size)
    # scores never increase along a path and ties keep creation order, so this order has parents first
    grafted = grafted[np.lexsort((grafted, -score[grafted]))][: max(0, budget - num_draft)]
    chosen = np.concatenate([np.arange(num_draft), grafted])
    # a child never scores above its parent, so the threshold keeps the tree closed under parents
    chosen = chosen[score[chosen] >= min_score]
    chosen = chosen[np.lexsort((chosen, -score[chosen]))]
    new_index = np.full(score.size, -1, np.int64)
    new_index[chosen] = np.arange(chosen.size)
    par = union.parents[chosen]
    out_parents = np.where(par < 0, -1, new_index[np.maximum(par, 0)])
    parent_score = np.where(par < 0, 1.0, score[np.maximum(par, 0)])
    # parents first by the order above (checked where graft hands its trees over, GraftProposer.propose_trees)
    tree = DraftTree.of_valid(union.token_ids[chosen], out_parents, score[chosen] / np.maximum(parent_score, 1e-30))
    origin = union.origin[chosen]
    return AssembledTree(tree, all_sources[origin], all_raw[origin], int(np.count_nonzero(chosen >= num_draft)))
