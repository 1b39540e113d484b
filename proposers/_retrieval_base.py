"""Shared loop of the retrieval proposers: one :class:`vllm_treespec.retrieval.Retriever` query per request row."""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_treespec.api import DraftTree, ProposeContext, TreeProposer
from vllm_treespec.retrieval import DatastoreError, Retriever, check_datastore
from vllm_treespec.retrieval.warmup import compile_kernels

logger = logging.getLogger("vllm.treespec")


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
    """Subclasses build ``self.retriever`` in ``__init__``. ``options.max_nodes`` caps trees (None = verify budget)."""

    retriever: Retriever

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
            trees.append(DraftTree(t.token_ids, t.parents, t.probs) if t.num_nodes else DraftTree.empty())
        return trees

    def on_requests_finished(self, req_ids: set[str]) -> None:
        self.retriever.release(req_ids)
