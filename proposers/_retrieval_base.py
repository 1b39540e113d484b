"""Shared loop of the retrieval proposers: one :class:`vllm_treespec.retrieval.Retriever` query per request row."""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_treespec.api import DraftTree, ProposeContext, TreeProposer
from vllm_treespec.retrieval import DatastoreError, Retriever, StoreFile, SuffixRetriever, check_datastore
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


def check_store_file_option(what: str, path: str) -> None:
    """Fail at config time on a store file (``global_file``) that could not be loaded or saved: a corrupt or foreign
    file, a folder named instead of a file, or a folder that is missing or not writable."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{what}: {path!r} is a folder; name a file in it, e.g. "
                         f"{os.path.join(path, 'outputs.tsds')!r}")
    if not os.path.isdir(folder):
        raise ValueError(f"{what}: the folder {folder!r} does not exist; create it, or name a file in another")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: cannot write in {folder!r}; name a file in a folder this user can write")
    if os.path.exists(path):
        try:
            check_datastore(path)
        except DatastoreError as e:
            raise ValueError(f"{what}: {e}; delete it to start an empty store, or name another file") from e


def open_store_file(what: str, path: str, retriever: SuffixRetriever, vllm_config: Any,
                    save_every: int) -> StoreFile:
    """The store file of ``retriever``'s global store, its documents loaded (one log line). A file of another
    tokenizer's vocabulary raises :class:`~vllm_treespec.retrieval.DatastoreError` naming it."""
    model_config = getattr(vllm_config, "model_config", None)
    vocab_size = model_config.get_vocab_size() if model_config is not None else None
    tokenizer = str(getattr(model_config, "tokenizer", None) or "")
    store_file = StoreFile(path, retriever.global_store, vocab_size=vocab_size, tokenizer=tokenizer,
                           save_every=save_every)
    count = store_file.load(model_vocab_size=vocab_size, expected_tokenizer=tokenizer or None)
    logger.info("vllm_treespec: %s: %s", what, f"{count} finished outputs ({len(retriever.global_store)} tokens) "
                f"loaded from {path}" if count else f"no outputs yet in {path}; they are saved there")
    return store_file


def save_store_file(store_file: StoreFile | None, *, now: bool = False) -> None:
    """Save ``store_file`` when it is due (``now``: whenever anything is unsaved, as at shutdown). A failing disk
    is one log line per try; serving goes on with the store in memory."""
    if store_file is None:
        return
    try:
        if now:
            store_file.save()
        else:
            store_file.saved_if_due()
    except OSError as e:
        logger.warning("vllm_treespec: could not save the store of finished outputs to %s (%s: %s); it is kept in "
                       "memory and saved again later", store_file.path, type(e).__name__, e)


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
