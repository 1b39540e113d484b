"""Public tree-proposer API of vllm-treespec.

A proposer turns the committed context of each running request into a *draft tree*: token ids in topological order
(every parent before its children) plus the parent index of each node, where ``-1`` is the root, i.e. the last
committed token. vLLM's scheduler sees the flattened list as an ordinary chain of drafts; the worker verifies it as a
tree and commits the longest accepted root-to-leaf path as if it were a chain ("verify as a tree, commit as a chain").

Writing a proposer::

    from vllm_treespec.api import DraftTree, ProposeContext, TreeProposer, register_proposer

    @register_proposer("my_tree")
    class MyTree(TreeProposer):
        def propose_trees(self, ctx: ProposeContext) -> list[DraftTree | None]:
            return [DraftTree.chain(ctx.committed(i)[-3:]) for i in range(ctx.num_reqs)]

Select it with ``{"method": "my_tree"}`` once its module is imported, or by dotted path
``{"method": "my_pkg.MyTree"}`` (always works), or through the entry-point group ``vllm_treespec.proposers``.

This module imports neither vLLM nor torch at import time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import numpy as np

from vllm_treespec.registry import (ENTRY_POINT_GROUP, load_proposer_class, register_proposer,  # noqa: F401 - public API
                                    registered_proposers)
from vllm_treespec.settings import options_from_vllm_config

if TYPE_CHECKING:  # pragma: no cover
    import msgspec
    import torch

logger = logging.getLogger("vllm.treespec")

ROOT = -1


class DraftTreeError(ValueError):
    """A draft tree that violates the topological-order contract."""


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A draft tree for one request.

    token_ids: int64 [N], topological order (BFS recommended: any prefix is then a valid subtree, which keeps
        scheduler truncation safe).
    parents: int32 [N], ``parents[i] < i``; ``-1`` (ROOT) means the child of the last committed token.
    node_probs: optional float32 [N], the drafter's probability of each node's token given its parent. With it, the
        verifier calibrates each node into an acceptance probability (learned online from what the target accepts,
        by source and raw number: :mod:`vllm_treespec.verify.calibration`) and the step budget verifies only the
        nodes that pay (:mod:`vllm_treespec.cost`); without it the tree is verified as proposed. Verification is
        lossless either way.
    node_sources: optional int [N], which of the proposer's ``acceptance_sources`` scored each node (-1: none, the
        number is used as it is); None = all from one source.
    """

    token_ids: np.ndarray
    parents: np.ndarray
    node_probs: np.ndarray | None = None
    node_sources: np.ndarray | None = None

    def __post_init__(self) -> None:
        tokens = np.ascontiguousarray(self.token_ids, dtype=np.int64).reshape(-1)
        parents = np.ascontiguousarray(self.parents, dtype=np.int32).reshape(-1)
        object.__setattr__(self, "token_ids", tokens)
        object.__setattr__(self, "parents", parents)
        if tokens.shape != parents.shape:
            raise DraftTreeError(f"token_ids has {tokens.size} nodes but parents has {parents.size}")
        # numba only once a tree is built: imported with this module, it broke vLLM's CPU worker start-up where the
        # plugin is off (an unsupported vLLM: patches.triton_dispatcher is not applied)
        from vllm_treespec.tree_checks import BAD_PARENT, NEGATIVE_TOKEN, tree_problem

        problem = tree_problem(tokens, parents) if tokens.size else 0
        if problem == BAD_PARENT:
            raise DraftTreeError(
                "parents must satisfy -1 <= parents[i] < i (topological order, first node a child of the root); "
                f"got {parents.tolist()}")
        if problem == NEGATIVE_TOKEN:
            raise DraftTreeError("token_ids must be non-negative")
        if self.node_probs is not None:
            probs = np.ascontiguousarray(self.node_probs, dtype=np.float32).reshape(-1)
            if probs.shape != tokens.shape:
                raise DraftTreeError(f"node_probs has {probs.size} entries for {tokens.size} nodes")
            object.__setattr__(self, "node_probs", probs)
        if self.node_sources is not None:
            sources = np.ascontiguousarray(self.node_sources, dtype=np.int32).reshape(-1)
            if sources.shape != tokens.shape or (sources.size and sources.min() < -1):
                raise DraftTreeError(f"node_sources needs one source id >= -1 per node, got {sources.tolist()}")
            object.__setattr__(self, "node_sources", sources)

    @classmethod
    def of_valid(cls, token_ids: np.ndarray, parents: np.ndarray, node_probs: np.ndarray | None = None,
                 node_sources: np.ndarray | None = None) -> DraftTree:
        """A tree whose arrays are known to meet the contract — a checked tree's nodes re-scored, or a subset of them
        closed under parents and re-indexed — built without checking them again: the verifier re-prices and trims
        every proposed tree each step, and the checks cost ~40 us a tree on an AVX2 CPU."""
        tree = object.__new__(cls)
        object.__setattr__(tree, "token_ids", np.asarray(token_ids, np.int64))
        object.__setattr__(tree, "parents", np.asarray(parents, np.int32))
        object.__setattr__(tree, "node_probs", None if node_probs is None else np.asarray(node_probs, np.float32))
        object.__setattr__(tree, "node_sources", None if node_sources is None else np.asarray(node_sources, np.int32))
        return tree

    @property
    def num_nodes(self) -> int:
        return int(self.token_ids.size)

    def __len__(self) -> int:
        return self.num_nodes

    @classmethod
    def chain(cls, token_ids: Sequence[int] | np.ndarray) -> DraftTree:
        n = len(token_ids)
        return cls(np.asarray(token_ids, dtype=np.int64), np.arange(-1, n - 1, dtype=np.int32))

    @classmethod
    def empty(cls) -> DraftTree:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int32))

    def depths(self) -> np.ndarray:
        """Depth of each node, 1 for children of the root."""
        d: list[int] = []  # a Python list: NumPy element access cost twice as much
        for p in self.parents.tolist():
            d.append(1 if p < 0 else d[p] + 1)
        return np.array(d, np.int32)

    def truncate(self, n: int) -> DraftTree:
        """The first ``n`` nodes; a valid subtree because of topological order."""
        probs = None if self.node_probs is None else self.node_probs[:n]
        sources = None if self.node_sources is None else self.node_sources[:n]
        return DraftTree.of_valid(self.token_ids[:n], self.parents[:n], probs, sources)

    def is_chain(self) -> bool:
        return bool(np.array_equal(self.parents, np.arange(-1, self.num_nodes - 1)))

    def first_child_chain(self) -> DraftTree:
        """The path that always follows the first child: the chain a tree degrades to when a request can't use trees."""
        path: list[int] = []
        current = ROOT
        parents = self.parents.tolist()
        for i, p in enumerate(parents):
            if p == current:
                path.append(i)
                current = i
        return DraftTree.chain(self.token_ids[path]) if path else DraftTree.empty()

    def breadth_first(self) -> DraftTree:
        """The same tree reordered by depth (stable within a level), so that every prefix keeps shallow nodes."""
        order = np.argsort(self.depths(), kind="stable")
        new_index = np.empty_like(order)
        new_index[order] = np.arange(order.size)
        parents = self.parents[order]
        new_parents = np.where(parents < 0, -1, new_index[np.maximum(parents, 0)]).astype(np.int32)
        probs = None if self.node_probs is None else self.node_probs[order]
        sources = None if self.node_sources is None else self.node_sources[order]
        return DraftTree(self.token_ids[order], new_parents, probs, sources)

    @classmethod
    def from_branches(cls, branches: Sequence[Sequence[int] | np.ndarray]) -> DraftTree:
        """A breadth-first tree whose root children start the given token chains (shared prefixes are not merged)."""
        tokens: list[int] = []
        parents: list[int] = []
        for branch in branches:
            parent = ROOT
            for t in np.asarray(branch).tolist():
                parents.append(parent)
                parent = len(tokens)
                tokens.append(int(t))
        return cls(np.array(tokens, np.int64), np.array(parents, np.int32)).breadth_first()

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]


@dataclass
class ProposeContext:
    """What a proposer sees at one step. Row ``i`` of every array belongs to ``req_ids[i]``.

    sampled_token_ids: tokens committed by this step (accepted drafts + bonus) per row; ``[]`` for a partial
        prefill, for which no draft is needed (return None).
    num_tokens: committed length per row (prompt + output so far, this step's tokens included).
    num_prompt_tokens: prompt length per row, when known (the engine's input batch; None in vLLM's ``custom_class``
        path): see :meth:`prompt_len`.
    token_ids: [max_reqs, max_model_len] committed tokens; only ``token_ids[i, :num_tokens[i]]`` is valid. Read only.
    max_nodes: the verify budget (``num_speculative_tokens``); longer trees are truncated to it.
    hidden_states / aux_hidden_states: the target's hidden states of this step's *committed* rows (chainized), when
        the proposer sets ``needs_hidden_states``; request i's rows are ``hidden_row_start[i] ..
        hidden_row_index[i]`` (inclusive), at positions ``hidden_position_start[i]`` onwards: row r at position p holds
        the target's state after reading token p, so ``token_ids[i, p + 1]`` is the token it predicted and committed.
        A partial prefill has rows but no draft to make (``needs_draft`` is False); positions computed in earlier
        steps without hidden states (prefix-cache hits) have no rows at all.
    kv_cache: read-only view of the target's KV cache, when the proposer sets ``needs_kv_cache``.
    step_cost: the engine's measured step cost while the step budget is on (``predict(num_tokens, num_reqs)`` ->
        seconds of a whole step; ``predict_many`` for an array of token counts), else None. The verifier already
        verifies only the nodes that pay; a proposer uses it to decide what it would not otherwise know, e.g.
        whether an expensive drafter is worth running (graft's head, with
        :class:`vllm_treespec.cost.allocate.DraftGate`).
    probing: the step budget's gate drafts this step only to learn what the trees are worth now (it had stopped
        drafting because they did not pay): draft as fully as you can, or the probe measures a lesser tree than the
        one you would draft once drafting pays (graft's head drafts on every probe whose ``probe_seconds`` cover its
        catch-up).
    probe_seconds: on a probe, the seconds the skipped steps set aside for it (None: not capped): a proposer whose
        drafter would first catch up on work left by the steps without drafts (graft's head) drafts with it only if
        that catch-up fits, or the probe costs many times what the skipped steps saved for it.
    draft_rows: when set, the rows asked for a tree this step (a probe under load drafts for as many requests as
        it can verify nodes of); ``needs_draft`` is False for the others. None: every row that needs one.
    expectation_factor: the step budget's recent accepted-over-expected drafts, by which it scales every calibrated
        path probability before weighing the nodes (1.0 without a budget): a proposer's own gate prices its trees
        as the verifier will (``DraftGate.record(trees, scale=...)``).
    row_excess: per row, what one more verified token of that request adds to the step's context term (its
        sequence length beyond the step-cost curve's context) while the budget's model prices the context, else
        None: every row of a step attends to its request's whole sequence, and a proposer's own gate prices the
        rows of long requests as the verifier does (``DraftGate.should_draft(..., row_excess=mean)``).
    self_gated_seconds: set by a proposer that runs an expensive drafter only when its own gate expects that drafter
        to pay (graft's head): the seconds of this call spent in it. The step budget's gate charges the call without
        them, so that a cheap part that drafts on every step (graft's retrieval) is priced at its own cost and not
        gated off with the expensive one.
    useful_depth: the deepest level of a tree the step budget admitted in its recent allocations, plus one (None: no
        allocation yet, no budget, or a probe, which drafts in full): the levels below it are seldom verified, so a
        drafter that pays per level (an EAGLE head) stops there. Each allocation that admits a deeper node raises it.
    useful_nodes: twice the most nodes the step budget admitted into one request's tree in its recent allocations,
        plus one (None as for ``useful_depth``): a drafter whose cost grows with its tree's width (an EAGLE head
        expands up to ``min(top_k, budget)`` nodes a request at each level) grows no more than that
        (:attr:`useful_max_nodes`). An allocation that admits more raises it; a probe drafts in full.
    shared_draft_seconds: set by the step budget before it asks for trees: what drafting for these requests is
        predicted to cost besides a drafter the proposer gates itself (the proposer's measured call less
        ``self_gated_seconds``, and the verifier's host work of pricing and handing over the trees). A proposer's own
        gate adds it to that drafter's price and to its rival's: both are weighed against plain decoding at the
        whole drafting step's price (without it, graft's head steps at 5-8 served bf16 requests committed 0.88-0.90
        of the tokens the gate's plain rate commits in their time). 0 without a step budget.
    deferred_seconds: set by a proposer whose drafter caught up on this call with work the steps that did not draft
        left it (an EAGLE head writing their rows' K/V): seconds neither gate charges to this call's measured cost,
        since drafting for those requests at any later step would pay them too; the gates price them before the call
        instead (:meth:`TreeProposer.catch_up_price`).
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    num_tokens: np.ndarray
    token_ids: np.ndarray
    max_nodes: int
    num_prompt_tokens: np.ndarray | None = None
    hidden_states: torch.Tensor | None = None
    aux_hidden_states: list[torch.Tensor] | None = None
    hidden_row_index: np.ndarray | None = None
    hidden_row_start: np.ndarray | None = None
    hidden_position_start: np.ndarray | None = None
    kv_cache: Any = None
    step_cost: Any = None
    probing: bool = False
    probe_seconds: float | None = None
    expectation_factor: float = 1.0
    row_excess: np.ndarray | None = None
    draft_rows: np.ndarray | None = None
    self_gated_seconds: float = 0.0
    shared_draft_seconds: float = 0.0
    deferred_seconds: float = 0.0
    useful_depth: int | None = None
    useful_nodes: int | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def useful_max_nodes(self) -> int:
        """``max_nodes`` capped by ``useful_nodes``: the size of tree worth growing where each node costs."""
        return self.max_nodes if self.useful_nodes is None else min(self.max_nodes, self.useful_nodes)

    def committed(self, i: int) -> np.ndarray:
        return self.token_ids[i, : int(self.num_tokens[i])]

    def prompt_len(self, i: int) -> int:
        """Where row ``i``'s output starts in :meth:`committed`. Without ``num_prompt_tokens``, the committed
        length before this step's tokens: the prompt's only on the request's first step after its prefill."""
        if self.num_prompt_tokens is not None:
            return int(self.num_prompt_tokens[i])
        return int(self.num_tokens[i]) - len(self.sampled_token_ids[i])

    def needs_draft(self, i: int) -> bool:
        return len(self.sampled_token_ids[i]) > 0 and (self.draft_rows is None or bool(self.draft_rows[i]))


@dataclass
class VerificationResult:
    """Outcome of verifying one request's tree.

    accepted_nodes: indices into the tree of the accepted path, root's child first (empty if nothing accepted).
    bonus_token: the token the target sampled after the accepted path.
    target_logits: [N+1, V] logits of the target at the root (row 0) and at every node (row 1+i), before
        sampling constraints. Valid only during the ``on_verified`` call; copy what you keep.
    target_topk: (token ids int64 [N+1, k], probabilities float32 [N+1, k]): the target's k most likely tokens at
        the same rows, most likely first, and their softmax probabilities over the whole vocabulary (before
        sampling constraints); when the proposer sets ``wants_target_topk = k``.
    """

    req_id: str
    tree: DraftTree
    accepted_nodes: list[int]
    bonus_token: int
    target_logits: torch.Tensor | None = None
    target_topk: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def accepted_tokens(self) -> list[int]:
        return [int(self.tree.token_ids[n]) for n in self.accepted_nodes]


class TreeProposer:
    """Base class of tree proposers. Subclasses implement :meth:`propose_trees`.

    The worker builds one instance per process with ``cls(vllm_config)``; typed options for the method arrive as
    ``self.options`` (an instance of ``options_type``, from ``--speculative-config`` keys that are not vLLM's).
    """

    #: msgspec Struct type of this proposer's options; None = no options.
    options_type: ClassVar[type[msgspec.Struct] | None] = None
    #: ask the runner for the target's hidden states (and aux layers) in the context.
    needs_hidden_states: ClassVar[bool] = False
    #: target layers whose hidden states the proposer wants as aux_hidden_states (EAGLE-3 style); () = none.
    aux_hidden_state_layers: ClassVar[tuple[int, ...]] = ()
    #: ask for a read-only view of the target's KV cache in the context.
    needs_kv_cache: ClassVar[bool] = False
    #: hand target logits to on_verified: a float32 copy of every verified row (a request's 33 rows of a 49k vocabulary
    #: are 6.5 MB), so ask only for what ``wants_target_topk`` cannot give.
    wants_target_logits: ClassVar[bool] = False
    #: k > 0: hand on_verified the target's k most likely tokens and their probabilities at every verified row
    #: (``VerificationResult.target_topk``), read from the logits in place (~35 us a row of a 49k vocabulary on one
    #: CPU thread); an instance may set it (from its options).
    wants_target_topk: int = 0
    #: hand :meth:`on_outputs_finished` the output tokens of the requests that finished (graft and suffix_tree
    #: index them whole, where their own steps saw an output only as far as they last drafted for it); an instance
    #: may set it.
    wants_finished_outputs: bool = False
    #: names of the sources that score nodes (``DraftTree.node_sources`` indexes them); () = one source. The
    #: verifier learns an acceptance rate per source and raw-confidence bin for the step budget.
    acceptance_sources: tuple[str, ...] = ()

    def __init__(self, vllm_config: Any = None, options: Any = None) -> None:
        self.vllm_config = vllm_config
        spec = getattr(vllm_config, "speculative_config", None)
        self.max_nodes = int(getattr(spec, "num_speculative_tokens", 0) or 0)
        if options is None:
            options = options_from_vllm_config(vllm_config, self.options_type)
        self.options = options

    # --- lifecycle -------------------------------------------------------------------------------------------
    @classmethod
    def check_served_model(cls, options: Any, vllm_config: Any) -> None:
        """Called in the engine's main process when the speculative config is read, before any worker starts, with
        the parsed options and a config holding the served ``model_config``: raise a ``ValueError`` naming the
        option and the fix when these options cannot serve this model (so the user sees that message, not a
        worker's start-up failure). Default: nothing to check."""

    def load_model(self, model: Any) -> None:
        """Called with the target model once it is loaded (vLLM's CPU runner calls it unconditionally).
        Subclasses that override it should call ``super().load_model(model)``."""
        if self.aux_hidden_state_layers:
            model.set_aux_hidden_state_layers(tuple(self.aux_hidden_state_layers))

    def propose_trees(self, ctx: ProposeContext) -> list[DraftTree | None]:
        raise NotImplementedError

    def observe(self, ctx: ProposeContext) -> None:
        """Called instead of :meth:`propose_trees` on a step the verifier's budget decided not to draft (its trees
        would not pay for their verification): keep per-request state that follows every committed token current
        (a draft head's own KV cache), so that drafts are as good when drafting resumes. Default: nothing."""

    def glance(self, ctx: ProposeContext, rows: Sequence[int]) -> list[DraftTree | None] | None:
        """Called after :meth:`observe` on a step the budget's gate skips, for batch rows ``rows``: trees it can offer
        for almost nothing where a cheap look says they are likely to pay now (a long retrieval match), or None.
        The gate decides from what recent trees were worth, so a passage repeated from the prompt would otherwise
        wait for its next probe. The verifier calibrates these trees and admits only the nodes that pay, as on any
        step; they do not teach the gate what the proposer's full trees are worth. Keep it cheap: it runs on every
        skipped step. Default: None (nothing to offer; a proposer that does not override it is not asked)."""
        return None

    def catch_up_price(self, ctx: ProposeContext, rows: Sequence[int]) -> float:
        """Seconds a call drafting for batch rows ``rows`` would first spend on work the steps it only observed
        left (an EAGLE head writing their rows' K/V, deferred by :meth:`observe`). The step budget's gate adds it to
        the call's measured price, and a probe pays it out of its allowance: after a long spell without drafts,
        resuming costs more than one call. Default: 0 (nothing deferred)."""
        return 0.0

    def use_acceptance(self, calibration: Any) -> None:
        """Called by the verifier with the acceptance calibration it learns online for this proposer
        (:class:`vllm_treespec.verify.calibration.AcceptanceCalibration`: ``calibration(source_id, raw)`` -> rates),
        for proposers that rank their nodes by it (graft does)."""

    def on_verified(self, results: list[VerificationResult]) -> None:
        """Called after each verify step with the outcome of every tree row."""

    def on_outputs_finished(self, outputs: dict[str, np.ndarray]) -> None:
        """Called just before :meth:`on_requests_finished` when ``wants_finished_outputs``: by request id, the
        output tokens (after the prompt, every committed token) of those finishing requests the engine still
        holds. Read only."""

    def on_requests_finished(self, req_ids: set[str]) -> None:
        """Requests that finished, were aborted or preempted; drop their state."""

    def on_shutdown(self) -> None:
        """The engine is shutting down (vLLM's worker ``shutdown``): save what should outlive it. Not called when
        the process is killed, so save anything precious periodically too. An exception is logged, not raised."""

    # --- vLLM custom_class contract ---------------------------------------------------------------------------
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_: Any):
        """vLLM's ``custom_class`` entry. Used only when tree verification is not active: trees degrade to the
        chain that follows the first child, which stock vLLM verifies exactly."""
        n = len(sampled_token_ids)
        ctx = ProposeContext(req_ids=[str(i) for i in range(n)], sampled_token_ids=sampled_token_ids,
                             num_tokens=num_tokens_no_spec, token_ids=token_ids_cpu, max_nodes=self.max_nodes)
        trees = self.propose_trees(ctx)
        return [[] if t is None or not ctx.needs_draft(i) else t.first_child_chain().token_ids[: self.max_nodes].tolist()
                for i, t in enumerate(trees)]
