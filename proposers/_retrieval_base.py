"""Shared loop of the retrieval proposers: one :class:`vllm_treespec.retrieval.Retriever` query per request row."""

from __future__ import annotations

import bisect
import logging
import os
from typing import Any

import numpy as np

from vllm_treespec.api import DraftTree, ProposeContext, TreeProposer
from vllm_treespec.retrieval import DatastoreError, Retriever, check_datastore
from vllm_treespec.retrieval.warmup import compile_kernels

logger = logging.getLogger("vllm.treespec")

#: lower bounds of the match-length classes whose nodes the verifier calibrates apart (a retrieved tree's
#: ``match_len``: how many context tokens the retrieval matched). At one raw confidence the continuation of a short
#: match is accepted far less often than a long one's: replaying the suffix source against greedy outputs of 42
#: ShareGPT and HumanEval tuning prompts (``scripts/replay_matches.py``), root children scoring >= 0.9 were accepted
#: 32% / 45% / 65% / 84% of the time after matches of 1 / 2-3 / 4-7 / 8+ tokens (one pooled bin priced them alike)
MATCH_CLASSES = (1, 2, 4, 8)


def match_class_sources(source: str) -> tuple[str, ...]:
    """``source``'s acceptance-source names, one per match-length class: ``source@1``, ``source@2``, ..."""
    return tuple(f"{source}@{m}" for m in MATCH_CLASSES)


def match_class(match_len: int) -> int:
    """The class of a retrieval that matched ``match_len`` context tokens (an index into :data:`MATCH_CLASSES`)."""
    return max(bisect.bisect_right(MATCH_CLASSES, int(match_len)) - 1, 0)


def compile_retrieval_kernels() -> None:
    """At engine start-up (``load_model``), not inside the first requests: see :mod:`vllm_treespec.retrieval.warmup`."""
    seconds = compile_kernels()
    if seconds:
        logger.info("vllm_treespec: retrieval kernels compiled or loaded from numba's cache in %.1f s", seconds)


def check_positive(method: str, opts: Any, *names: str) -> None:
    for name in names:
        value = getattr(opts, name)
        if value < 1:
            raise ValueError(f"{method} option {name!r} must be >= 1, got {value}")


def check_unit(method: str, opts: Any, *names: str) -> None:
    for name in names:
        value = getattr(opts, name)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{method} option {name!r} must be in [0, 1], got {value}")


def check_datastore_option(what: str, path: str) -> None:
    """Fail at config time on a missing, corrupt or foreign datastore file (header only; the arrays load later)."""
    if not os.path.isfile(path):
        raise ValueError(f"{what}: no such file {path!r}; build one with `vllm-treespec datastore build`")
    try:
        check_datastore(path)
    except DatastoreError as e:
        raise ValueError(f"{what}: {e}") from e


class RetrievalTreeProposer(TreeProposer):
    """Subclasses build ``self.retriever`` in ``__init__``. ``options.max_nodes`` caps trees (None = verify budget).
    Each tree's nodes are marked with the match-length class of its retrieval (:data:`MATCH_CLASSES`), which the
    verifier calibrates apart."""

    retriever: Retriever
    acceptance_sources = match_class_sources("match")

    def load_model(self, model: Any) -> None:
        super().load_model(model)
        compile_retrieval_kernels()

    def budget(self, ctx: ProposeContext) -> int:
        limit = self.options.max_nodes
        if ctx.max_nodes <= 0:
            return limit or 0
        return ctx.max_nodes if limit is None else min(limit, ctx.max_nodes)

    def query(self, ctx: ProposeContext, i: int, budget: int) -> Any:
        return self.retriever.retrieve(ctx.req_ids[i], ctx.committed(i), budget)

    def propose_trees(self, ctx: ProposeContext) -> list[DraftTree | None]:
        budget = self.budget(ctx)
        trees: list[DraftTree | None] = []
        for i in range(ctx.num_reqs):
            if not ctx.needs_draft(i):
                trees.append(None)
                continue
            t = self.query(ctx, i, budget)
            if not t.num_nodes:
                trees.append(DraftTree.empty())
                continue
            sources = np.full(t.num_nodes, match_class(t.match_len), np.int32)
            trees.append(DraftTree(t.token_ids, t.parents, t.probs, sources))
        return trees

    def on_requests_finished(self, req_ids: set[str]) -> None:
        self.retriever.release(req_ids)
