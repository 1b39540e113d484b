"""graft's model drafter: a draft model (an EAGLE-3 or KV-aware head drafting EAGLE-2 dynamic trees, as ``eagle_tree``
/ ``kv_aware`` do) that drafts each request's scored tree, stopping at graft's checkpoints where it can."""

from __future__ import annotations

import abc
import logging
from typing import Any, Sequence

from vllm_treespec.api import DraftTree, ProposeContext
from vllm_treespec.proposers.graft.options import DEFAULT_HEAD, KV_AWARE_HEAD, NO_HEAD

logger = logging.getLogger("vllm.treespec")

#: the source name under which the model drafter's nodes are calibrated
MODEL_SOURCE = "model"


class ModelDrafter(abc.ABC):
    """A draft model (e.g. an EAGLE head) that drafts a finished, scored tree per request in one call. graft cuts
    each tree to its budget and prunes it at its checkpoints level by level (:mod:`.growth`); a drafter that can stop
    early at the checkpoints in :attr:`stop_below` saves the levels graft would prune."""

    #: the target hidden states the drafter reads (TreeProposer semantics)
    needs_hidden_states: bool = False
    aux_hidden_state_layers: tuple[int, ...] = ()
    #: the drafter reads the target's KV cache (``ctx.kv_cache``)
    needs_kv_cache: bool = False
    #: graft's checkpoints (depth -> confidence; set by the proposer): a request's draft may stop at the first one its
    #: best path falls below ("draft less"). None = draft in full
    stop_below: dict[int, float] | None = None

    def load_model(self, model: Any) -> None:
        """Called with the target model once it is loaded."""

    def ingest(self, ctx: ProposeContext) -> None:
        """Called every step the drafter drafts, for every request (e.g. to read newly committed hidden states)."""

    def observe(self, ctx: ProposeContext) -> None:
        """Called on every step it does not draft, for every request: keep state that follows each committed token
        (its own KV cache) current at the least cost."""

    def release(self, req_ids: set[str]) -> None:
        """Requests that finished; drop their state."""

    @property
    def catch_up_seconds(self) -> float:
        """Seconds the last :meth:`ingest` spent on rows that steps without drafts left (not this step's price)."""
        return 0.0

    def backlog_seconds(self, req_ids: Sequence[str]) -> float:
        """What an :meth:`ingest` drafting for ``req_ids`` would spend first on rows that steps without drafts left
        (graft's gates price it with the call)."""
        return 0.0

    @abc.abstractmethod
    def draft(self, ctx: ProposeContext, rows: Sequence[int]) -> dict[int, DraftTree]:
        """Scored trees (``node_probs`` given) of at most ``ctx.max_nodes`` nodes for the batch rows ``rows``; a row
        it cannot draft (no hidden states yet) is left out and gets a retrieval-only tree."""


class EagleModelDrafter(ModelDrafter):
    """The ``eagle_tree`` drafter (EAGLE-3 head, EAGLE-2 dynamic tree) as graft's model drafter: it stops a request's
    expansion at the checkpoint that prunes it, so pruned levels are never drafted."""

    needs_hidden_states = True

    def __init__(self, checkpoint: str, *, depth: int, top_k: int, vllm_config: Any = None,
                 dtype: str = "fastest") -> None:
        from vllm_treespec.eagle.drafter import EagleDrafter  # torch: only once a head is used

        self.drafter = EagleDrafter.for_target(checkpoint, vllm_config, depth=depth, top_k=top_k, dtype=dtype)
        self.aux_hidden_state_layers = self.drafter.aux_layers
        self.needs_kv_cache = self.drafter.reads_target_kv
        self.vllm_config = vllm_config
        self._ready: set[int] = set()

    def load_model(self, model: Any) -> None:
        self.drafter.load_from_target(model, self.vllm_config)

    def ingest(self, ctx: ProposeContext) -> None:
        self._ready = set(self.drafter.ingest(ctx))

    def observe(self, ctx: ProposeContext) -> None:
        self._ready = set()
        self.drafter.observe(ctx)

    def release(self, req_ids: set[str]) -> None:
        self.drafter.release(req_ids)

    @property
    def catch_up_seconds(self) -> float:
        return self.drafter.catch_up_seconds

    def backlog_seconds(self, req_ids: Sequence[str]) -> float:
        return self.drafter.backlog_seconds(req_ids)

    def draft(self, ctx: ProposeContext, rows: Sequence[int]) -> dict[int, DraftTree]:
        return self.drafter.draft(ctx, [r for r in rows if r in self._ready], ctx.useful_max_nodes,
                                  self.stop_below, max_depth=ctx.useful_depth)


def check_head_path(checkpoint: str, vllm_config: Any) -> None:
    """Refuse a head folder (``eagle_checkpoint`` given as a path) trained for another model than the served one."""
    from vllm_treespec.eagle.target import check_head_target, served_identity

    check_head_target(checkpoint, served_identity(vllm_config), "graft option 'eagle_checkpoint'",
                      alternative=', or "eagle_checkpoint": "none" for retrieval-only trees')


def load_model_drafter(checkpoint: str | None, vllm_config: Any, *, depth: int = 6, top_k: int = 8,
                       dtype: str = "fastest") -> ModelDrafter | None:
    """The model drafter for ``eagle_checkpoint``; None for retrieval-only trees.

    "auto": the default EAGLE-3 head (trained into the cache, else shipped), "kv_aware": the hybrid KV-aware head
    trained into the cache, each only if there is one and it was trained for the served model (else one log line
    says why not; without a served model to check against, none). A head folder given by path must fit the served
    model: another one is refused."""
    if checkpoint in (None, NO_HEAD):
        return None
    from vllm_treespec.eagle.target import mismatch_message, served_identity
    from vllm_treespec.proposers.eagle_tree import default_kv_head_path

    served = served_identity(vllm_config)
    if checkpoint in (DEFAULT_HEAD, KV_AWARE_HEAD):
        path = default_kv_head_path("hidden" if checkpoint == DEFAULT_HEAD else "hybrid")
        if not (path / "config.json").is_file():
            return None
        if served is None:  # no served model to check the head against (unit tests): do not guess
            return None
        mismatch = mismatch_message(path, served)
        if mismatch:
            logger.warning("graft: eagle_checkpoint=%r: %s; not using it", checkpoint, mismatch)
            return None
        checkpoint = str(path)
    else:
        check_head_path(checkpoint, vllm_config)
    return EagleModelDrafter(checkpoint, depth=depth, top_k=top_k, vllm_config=vllm_config, dtype=dtype)
