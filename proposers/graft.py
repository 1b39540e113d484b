"""``graft``: prune-then-graft hybrid draft trees (Graft, "Draft Less, Retrieve More", arXiv 2605.20104), with a node
budget that shrinks as the batch grows (ECHO, arXiv 2604.09603).

Reads each request's committed tokens (``ctx.committed(i)``) and, after every verify step, the target's logits at all
verified tree rows (``wants_target_logits``; ``on_verified`` sees tree rows only). Per request and step:

1. **Draft.** A model drafter (:class:`ModelDrafter`; the EAGLE-3 or KV-aware head of ``eagle_checkpoint``, drafting
   EAGLE-2 dynamic trees as ``eagle_tree`` / ``kv_aware`` do) grows a scored tree level by level. Without a head (``eagle_checkpoint``
   "auto" and no trained default head, or "none") the draft is the retrieval tree of the source that is most
   confident at the first checkpoint (ties: the order of ``sources``), read level by level, and the log says so once.
2. **Prune.** After the draft reaches each checkpoint depth d, the best path confidence ``exp(max cumulative
   log-prob at depth d)`` is compared with that checkpoint's threshold; below it, drafting stops and the rest of the
   budget is freed. With a head this happens inside the head's expansion ("draft less": the pruned levels are never
   drafted), and the stopped tree keeps only the nodes at least as likely as that best path.
3. **Graft.** The freed budget is filled best-first by path confidence from the other sources, at the root, under
   the deepest retained draft node, or both (``graft_position``); identical paths are merged, draft nodes always stay.
   Sources: a top-k successor table (Token Recycling, arXiv 2408.08696) refreshed online from the target's
   distribution at every verified row, accepted or rejected, and seeded from committed bigrams; suffix automata over
   the request's prompt + output, finished outputs and an optional corpus datastore; an n-gram index.
4. **Calibrate.** Path confidences multiply each source's step probabilities passed through
   :class:`AcceptanceCalibration`: the rate at which the target accepted that source's nodes of that raw confidence,
   learned online from every verified tree (``calibrate_acceptance``). Nodes below ``min_node_confidence`` are left out.
   Without a head, the draft source is chosen on calibrated confidences too; the pruning checkpoints compare the raw
   numbers, which their thresholds were chosen on.

On CPU the model drafter drafts only while the batch has at most ``model_draft_max_batch`` requests (default 1);
larger batches get retrieval-only trees.

Budgets: ``budget`` nodes per request at batch 1 (default ``num_speculative_tokens``), fewer as the batch grows —
from the calibration file's measured table, else ``knee_tokens / batch - 1`` (verification costs about one decode
step up to ``knee_tokens`` tokens per forward) when ``knee_tokens`` is given or off CPU, else a table measured on CPU
(:data:`DEFAULT_CPU_BUDGET_TABLE`). ``vllm-treespec graft calibrate`` (:mod:`vllm_treespec.tools.graft_calibrate`)
replays greedy outputs of the target offline to pick the thresholds and measures the step cost to build that table.
"""

from __future__ import annotations

import abc
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Literal, NamedTuple, Sequence

import msgspec
import numpy as np

from vllm_treespec.api import DraftTree, ProposeContext, TreeProposer, VerificationResult
from vllm_treespec.proposers._retrieval_base import check_datastore_option, compile_retrieval_kernels
from vllm_treespec.proposers.eagle_tree import DEFAULT_MIN_NODE_CONFIDENCE, below_checkpoint, device_kind
from vllm_treespec.retrieval import NgramRetriever, RetrievedTree, SuccessorTable, SuffixRetriever, load_datastore

logger = logging.getLogger("vllm.treespec")

SourceName = Literal["successor", "suffix", "ngram"]
GraftPosition = Literal["root", "deepest", "both"]
#: checkpoints and thresholds when neither the options nor a calibration file give them (see ``calibrate``)
#: (what ``calibrate`` chose for SmolLM2-135M on 2 CPU cores, MT-Bench + HumanEval, budget 32)
DEFAULT_CHECKPOINTS = (1, 2, 6)
DEFAULT_THRESHOLDS = (0.0, 0.4, 0.9)
#: tokens per verify forward below which a step costs about one decode step, when not calibrated (GPUs stay flat for
#: hundreds of tokens)
DEFAULT_KNEE_TOKENS = {"cpu": 16, "other": 512}
#: CPU budget by batch size when not calibrated. On 2 cores a forward is already compute-bound at a few tokens (the
#: no-speculation server's time per output token at concurrency 1/4/8/16: 50/48/60/83 ms for 1/4/8/16 tokens per
#: step), so a hinge at 16 tokens gave batches of 4 three nodes each and lost 15% to no speculation
#: (`vllm-treespec bench serve`, README). Full budget alone, 3 nodes each for two requests, none from four.
DEFAULT_CPU_BUDGET_TABLE = {1: 128, 2: 3, 4: 0}
#: largest batch for which the model drafter (EAGLE head) drafts, by device; larger batches get retrieval-only trees.
#: On 2 CPU cores the head's levels cost more than they win once requests share the step (`bench serve`, README: at
#: concurrency 2 the head at every batch 31.0 tok/s = 0.96x, at batch 1 only 43.7 = 1.35x); GPUs draft for any batch.
DEFAULT_MODEL_DRAFT_MAX_BATCH = {"cpu": 1, "other": 1 << 30}
#: raw-confidence bins of the online acceptance calibration (uniform over a node's probability given its parent)
ACCEPTANCE_BINS = 10
#: pseudo-trials at the raw confidence before a bin has data: early estimates stay near the source's own number
ACCEPTANCE_PRIOR_TRIALS = 8.0
#: the source name under which the model drafter's nodes are calibrated
MODEL_SOURCE = "model"
#: successor-table vocabulary when the model's is unknown (no vllm_config); tokens beyond it are not learned
FALLBACK_VOCAB_SIZE = 1 << 17
#: confidence scale of successors seeded from committed bigrams (they are counts, not target distributions)
SEED_CONFIDENCE = 0.5
CALIBRATION_VERSION = 1


# --- options --------------------------------------------------------------------------------------------------------
class GraftOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    #: tree nodes per request at batch 1; None = the verify budget (num_speculative_tokens)
    budget: int | None = None
    #: draft depths (levels below the root) where confidence is checked; None = calibration file, else (1, 2, 6)
    checkpoints: tuple[int, ...] | None = None
    #: one per checkpoint: below it the draft stops growing; None = calibration file, else (0, 0.4, 0.9)
    thresholds: tuple[float, ...] | None = None
    #: False = never prune the draft (ablation "graft without pruning")
    prune: bool = True
    #: False = the draft alone, freed budget unused (ablation "graft without grafting")
    graft: bool = True
    #: where retrieved continuations are attached: the root, the deepest retained draft node, or both
    graft_position: GraftPosition = "root"
    #: retrieval sources, in order of preference for the draft when no model drafter is loaded
    sources: tuple[SourceName, ...] = ("suffix", "successor", "ngram")
    #: successors kept per token in the successor table
    successor_k: int = 8
    #: deepest level of any retrieved tree
    max_depth: int = 16
    #: index finished outputs in a global suffix automaton and retrieve from it
    suffix_global: bool = True
    #: corpus datastore (``vllm-treespec datastore build``) for the suffix source; None = no corpus
    datastore: str | None = None
    #: shortest n-gram ending the context that the n-gram source looks up
    ngram_min_n: int = 2
    #: longest n-gram the n-gram source looks up
    ngram_max_n: int = 4
    #: model drafter head folder (an EAGLE-3 head or a KV-aware head); "auto" = the EAGLE-3 head
    #: `vllm-treespec train-eagle` wrote to the cache, "kv_aware" = the hybrid KV-aware head it wrote with
    #: `--mode hybrid`, if there is one; "none" (default) = retrieval-only trees, which need no trained head (on CPU
    #: with the small SmolLM2 head they are about as fast as grafting onto it: docs/benchmarks.md)
    eagle_checkpoint: str = "none"
    #: the model drafter's levels below the root (eagle_tree's ``depth``)
    eagle_depth: int = 6
    #: the model drafter's children per expanded node and nodes expanded per level (eagle_tree's ``top_k``)
    eagle_top_k: int = 8
    #: the head stops growing a request's tree at the checkpoint that prunes it (saves head levels); False = the
    #: full EAGLE tree is drafted and pruned afterwards (ablation: same checkpoints, more drafting)
    stop_drafting_at_checkpoints: bool = True
    #: the model drafter drafts (and reads the step's rows) only while the batch has at most this many requests;
    #: larger batches get retrieval-only trees. None = the device default (CPU 1, else no limit), or no limit when
    #: adaptive_budget is off (no load adaptation at all)
    model_draft_max_batch: int | None = None
    #: nodes whose path confidence (estimated chance the target accepts the whole path) is below this are not
    #: verified, even within the budget: each verified token costs forward time, which on a compute-bound device
    #: only a likely node pays back. 0 = fill the budget; None = the device default (CPU 0.05, else 0)
    min_node_confidence: float | None = None
    #: rank and floor nodes by their observed acceptance rate (per source and raw-confidence bin, learned online from
    #: every verification) instead of the sources' raw confidences, which are not comparable across sources
    calibrate_acceptance: bool = True
    #: shrink the per-request budget as the batch grows
    adaptive_budget: bool = True
    #: tokens per verify forward that cost about one decode step; None = calibration file, else a device default
    knee_tokens: int | None = None
    #: the adaptive budget never goes below this (0 = no speculation at high load)
    min_budget: int = 0
    #: JSON written by ``vllm-treespec graft calibrate``: thresholds and the budget-by-batch table
    calibration_path: str | None = None
    #: a request's suffix automaton and n-gram index cover at most this many of its latest tokens
    max_tokens_per_request: int = 32768
    #: requests whose retrieval state is kept (least recently used ones are dropped first)
    max_cached_requests: int = 256

    def __post_init__(self) -> None:
        positive = ("successor_k", "max_depth", "ngram_min_n", "ngram_max_n", "max_cached_requests", "eagle_depth",
                    "eagle_top_k")
        optional = ("budget", "knee_tokens", "model_draft_max_batch")
        for name in positive + tuple(n for n in optional if getattr(self, n) is not None):
            if getattr(self, name) < 1:
                raise ValueError(f"graft option {name!r} must be >= 1, got {getattr(self, name)}")
        if self.min_budget < 0:
            raise ValueError(f"graft option 'min_budget' must be >= 0, got {self.min_budget}")
        if self.min_node_confidence is not None and not 0.0 <= self.min_node_confidence < 1.0:
            raise ValueError(f"graft option 'min_node_confidence' must be in [0, 1), got {self.min_node_confidence}")
        if self.max_tokens_per_request < 2:
            raise ValueError(f"graft option 'max_tokens_per_request' must be >= 2, got {self.max_tokens_per_request}")
        if self.ngram_max_n < self.ngram_min_n:
            raise ValueError(f"graft option 'ngram_max_n' ({self.ngram_max_n}) must be >= 'ngram_min_n' "
                             f"({self.ngram_min_n})")
        if not self.sources or len(set(self.sources)) != len(self.sources):
            raise ValueError(f"graft option 'sources' must name each source at most once and not be empty, "
                             f"got {list(self.sources)}")
        if self.checkpoints is not None:
            check_checkpoints("graft option 'checkpoints'", self.checkpoints)
        if self.thresholds is not None:
            check_thresholds("graft option 'thresholds'", self.thresholds)
        if (self.checkpoints is None) != (self.thresholds is None) and self.calibration_path is None:
            given = "checkpoints" if self.thresholds is None else "thresholds"
            missing = "thresholds" if given == "checkpoints" else "checkpoints"
            raise ValueError(f"graft option {given!r} needs {missing!r} too (or a 'calibration_path' that has them)")
        if self.checkpoints is not None and self.thresholds is not None \
                and len(self.checkpoints) != len(self.thresholds):
            raise ValueError(f"graft options 'checkpoints' ({len(self.checkpoints)}) and 'thresholds' "
                             f"({len(self.thresholds)}) must have the same length")
        if self.datastore is not None:
            check_datastore_option("graft option 'datastore'", self.datastore)
        if self.eagle_checkpoint not in ("auto", "none", "kv_aware"):
            if not os.path.exists(self.eagle_checkpoint):
                raise ValueError(f"graft option 'eagle_checkpoint': no such file or directory "
                                 f"{self.eagle_checkpoint!r}")
            from vllm_treespec.proposers.eagle_tree import resolve_checkpoint

            resolve_checkpoint(self.eagle_checkpoint, "graft option 'eagle_checkpoint'")
        if self.calibration_path is not None:
            try:
                load_calibration(self.calibration_path)
            except (OSError, ValueError) as e:
                raise ValueError(f"graft option 'calibration_path': {e}") from e


def check_checkpoints(what: str, checkpoints: Sequence[int]) -> None:
    if any(d < 1 for d in checkpoints) or list(checkpoints) != sorted(set(checkpoints)):
        raise ValueError(f"{what} must be strictly increasing depths >= 1, got {list(checkpoints)}")


def check_thresholds(what: str, thresholds: Sequence[float]) -> None:
    if any(not 0.0 <= t <= 1.0 for t in thresholds):
        raise ValueError(f"{what} must be confidences in [0, 1], got {list(thresholds)}")


# --- calibration file -----------------------------------------------------------------------------------------------
class GraftCalibration(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What ``calibrate`` writes: the proposer reads checkpoints, thresholds and the budget table; ``report`` is for
    people (coverage per threshold, graft positions, measured step costs)."""

    version: int
    checkpoints: tuple[int, ...]
    thresholds: tuple[float, ...]
    #: batch size -> nodes per request (non-increasing); sizes between entries use the entry below
    budget_by_batch: dict[int, int] = {}
    #: measured tokens-per-forward knee (informational when budget_by_batch is given)
    knee_tokens: int | None = None
    report: dict[str, Any] = {}


def load_calibration(path: str | os.PathLike) -> GraftCalibration:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        cal = msgspec.json.decode(raw, type=GraftCalibration)
    except msgspec.ValidationError as e:
        raise ValueError(f"{path}: not a graft calibration file ({e})") from e
    except msgspec.DecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if cal.version != CALIBRATION_VERSION:
        raise ValueError(f"{path}: calibration version {cal.version}, this build reads {CALIBRATION_VERSION}")
    check_checkpoints(f"{path}: checkpoints", cal.checkpoints)
    check_thresholds(f"{path}: thresholds", cal.thresholds)
    if len(cal.checkpoints) != len(cal.thresholds):
        raise ValueError(f"{path}: checkpoints and thresholds differ in length")
    if any(b < 1 for b in cal.budget_by_batch) or any(v < 0 for v in cal.budget_by_batch.values()):
        raise ValueError(f"{path}: budget_by_batch needs batch sizes >= 1 and budgets >= 0")
    return cal


# --- adaptive budget ------------------------------------------------------------------------------------------------
class BudgetCurve:
    """Nodes per request as a function of the batch size: non-increasing, between ``min_budget`` and ``max_budget``.

    With a measured table (batch size -> budget) a batch uses the entry of the largest calibrated size not above it.
    Otherwise the hinge cost model of ECHO: a forward of up to ``knee_tokens`` tokens costs about one decode step,
    so a batch of n requests gets ``knee_tokens // n - 1`` nodes each.
    """

    def __init__(self, max_budget: int, *, adaptive: bool = True, knee_tokens: int = 32, min_budget: int = 0,
                 table: dict[int, int] | None = None) -> None:
        self.max_budget, self.adaptive = int(max_budget), adaptive
        self.knee_tokens, self.min_budget = int(knee_tokens), int(min_budget)
        self.sizes = np.array(sorted(table), np.int64) if table else None
        if table:
            # enforce monotonicity: a larger batch never gets more than a smaller one
            self.budgets = np.minimum.accumulate(np.array([table[s] for s in sorted(table)], np.int64))

    def __call__(self, batch_size: int) -> int:
        if not self.adaptive:
            return self.max_budget
        n = max(1, int(batch_size))
        if self.sizes is not None:
            k = int(np.searchsorted(self.sizes, n, side="right")) - 1
            b = int(self.budgets[max(k, 0)])
        else:
            b = self.knee_tokens // n - 1
        return max(min(b, self.max_budget), min(self.min_budget, self.max_budget))


# --- model drafter interface ----------------------------------------------------------------------------------------
class DraftLevel(NamedTuple):
    """One level of a drafted tree: new nodes whose parents are earlier nodes (numbered in drafting order, -1 = root)
    with the drafter's log-probability of each token given its parent's path."""

    token_ids: np.ndarray
    parents: np.ndarray
    log_probs: np.ndarray


class ModelDrafter(abc.ABC):
    """A draft model (e.g. an EAGLE head) that grows scored trees for a batch, one level per call, so that graft can
    stop each request's expansion at a confidence checkpoint. An implementation keeps its per-request state between
    :meth:`start` and the last :meth:`expand` of a step."""

    #: the target hidden states the drafter reads (TreeProposer semantics)
    needs_hidden_states: bool = False
    aux_hidden_state_layers: tuple[int, ...] = ()
    #: the drafter reads the target's KV cache (``ctx.kv_cache``)
    needs_kv_cache: bool = False

    def load_model(self, model: Any) -> None:
        """Called with the target model once it is loaded."""

    def ingest(self, ctx: ProposeContext) -> None:
        """Called every step for every request, drafting or not (e.g. to read newly committed hidden states)."""

    def release(self, req_ids: set[str]) -> None:
        """Requests that finished; drop their state."""

    @abc.abstractmethod
    def start(self, ctx: ProposeContext, rows: Sequence[int]) -> None:
        """Begin drafting for the batch rows ``rows`` of ``ctx``."""

    @abc.abstractmethod
    def expand(self, rows: Sequence[int], max_new: Sequence[int]) -> list[DraftLevel | None]:
        """The next level for each of ``rows`` (those still growing, a subset of the started ones), at most
        ``max_new[j]`` nodes for ``rows[j]``; None or an empty level ends that row's draft."""


def draft_tree_levels(tree: DraftTree) -> list[DraftLevel]:
    """A draft tree as levels, nodes renumbered in level order (parents first)."""
    probs = tree.node_probs if tree.node_probs is not None else np.ones(tree.num_nodes, np.float32)
    return list(_levels(tree.token_ids, tree.parents, tree.depths(), probs))


class EagleModelDrafter(ModelDrafter):
    """The ``eagle_tree`` drafter (EAGLE-3 head, EAGLE-2 dynamic tree) as graft's model drafter: the whole dynamic
    tree is drafted in :meth:`start` and handed out level by level, so pruning at a checkpoint frees verify budget."""

    needs_hidden_states = True

    def __init__(self, checkpoint: str, *, depth: int, top_k: int, vllm_config: Any = None,
                 stop_below: dict[int, float] | None = None) -> None:
        from vllm_treespec.proposers.eagle_tree import EagleDrafter

        self.drafter = EagleDrafter.for_target(checkpoint, vllm_config, depth=depth, top_k=top_k, dtype="bfloat16")
        #: graft's checkpoints: a request's head stops at the depth where graft prunes it ("draft less")
        self.stop_below = stop_below
        self.aux_hidden_state_layers = self.drafter.aux_layers
        self.needs_kv_cache = self.drafter.reads_target_kv
        self.vllm_config = vllm_config
        self._ready: set[int] = set()
        self._levels: dict[int, list[DraftLevel]] = {}

    def load_model(self, model: Any) -> None:
        self.drafter.load_from_target(model, self.vllm_config)

    def ingest(self, ctx: ProposeContext) -> None:
        self._ready = set(self.drafter.ingest(ctx))

    def release(self, req_ids: set[str]) -> None:
        self.drafter.release(req_ids)

    def start(self, ctx: ProposeContext, rows: Sequence[int]) -> None:
        trees = self.drafter.draft(ctx, [r for r in rows if r in self._ready], ctx.max_nodes, self.stop_below)
        self._levels = {r: draft_tree_levels(t)[::-1] for r, t in trees.items()}

    def expand(self, rows: Sequence[int], max_new: Sequence[int]) -> list[DraftLevel | None]:
        out: list[DraftLevel | None] = []
        for r in rows:
            levels = self._levels.get(r)
            out.append(levels.pop() if levels else None)
        return out


def load_model_drafter(checkpoint: str | None, vllm_config: Any, *, depth: int = 6, top_k: int = 8,
                       stop_below: dict[int, float] | None = None) -> ModelDrafter | None:
    """The model drafter for ``eagle_checkpoint`` ("auto" / "kv_aware": the trained default EAGLE-3 / hybrid
    KV-aware head if there is one); None for retrieval-only trees."""
    if checkpoint in (None, "none"):
        return None
    from vllm_treespec.proposers.eagle_tree import default_kv_head_path

    if checkpoint in ("auto", "kv_aware"):
        path = default_kv_head_path("hidden" if checkpoint == "auto" else "hybrid")
        if not (path / "config.json").is_file():
            return None
        checkpoint = str(path)
    return EagleModelDrafter(checkpoint, depth=depth, top_k=top_k, vllm_config=vllm_config, stop_below=stop_below)


# --- draft growth and pruning ---------------------------------------------------------------------------------------
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


def tree_levels(tree: RetrievedTree) -> Iterator[DraftLevel]:
    """A retrieved tree (best-first order) as draft levels, nodes renumbered in level order."""
    return _levels(tree.token_ids, tree.parents, tree.depths(), tree.probs)


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


# --- merging the draft and the grafts -------------------------------------------------------------------------------
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

    def table(self) -> dict[str, list[tuple[float, int]]]:
        """Per source and bin: (acceptance rate, trials), (nan, 0) for a bin without data (to inspect what a proposer
        has learned)."""
        return {name: [(round(float(a / t), 3), int(t)) if t else (float("nan"), 0)
                       for a, t in zip(self.accepts[i], self.trials[i])] for i, name in enumerate(self.names)}


class AssembledTree(NamedTuple):
    tree: DraftTree
    #: per node: the source (AcceptanceCalibration id, -1 = unknown) whose path gave its score, and that source's raw
    #: confidence of the node given its parent
    sources: np.ndarray
    raw_probs: np.ndarray


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
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    sources: list[int] = []
    raws: list[float] = []
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node

    def add(parent: int, token: int, score: float, source: int, raw: float) -> int:
        node = index.get((parent, token))
        if node is None:
            node = index[(parent, token)] = len(tokens)
            tokens.append(token)
            parents.append(parent)
            scores.append(score)
            sources.append(source)
            raws.append(raw)
        elif score > scores[node]:
            scores[node], sources[node], raws[node] = score, source, raw
        return node

    def calibrated(source: int, raw: np.ndarray) -> np.ndarray:
        return calibration(source, raw) if calibration is not None and source >= 0 else raw

    # the draft's own step probabilities (its nodes are in drafting order: parents first)
    log_scores = np.asarray(draft.log_scores, np.float64)
    draft_parents = np.asarray(draft.parents, np.int64)
    step_raw = np.exp(log_scores - np.where(draft_parents < 0, 0.0, log_scores[np.maximum(draft_parents, 0)])) \
        if log_scores.size else log_scores
    step = calibrated(draft_source, step_raw)
    draft_node: list[int] = []  # draft index -> node (a drafter may repeat a sibling)
    draft_score: list[float] = []
    for j, (t, p) in enumerate(zip(draft.tokens, draft_parents.tolist())):
        draft_score.append((1.0 if p < 0 else draft_score[p]) * float(step[j]))
        draft_node.append(add(-1 if p < 0 else draft_node[p], t, draft_score[j], draft_source, float(step_raw[j])))
    num_draft = len(tokens)
    for attach, tree, *source in grafts:
        source = int(source[0]) if source else -1
        attach = -1 if attach < 0 else draft_node[attach]
        base = 1.0 if attach < 0 else scores[attach]
        raw = np.asarray(tree.probs, np.float64)
        path = RetrievedTree(tree.token_ids, tree.parents, calibrated(source, raw)).path_scores() * base
        mapped = np.empty(tree.num_nodes, np.int64)
        for j, (t, p) in enumerate(zip(tree.token_ids.tolist(), tree.parents.tolist())):
            mapped[j] = add(attach if p < 0 else int(mapped[p]), t, float(path[j]), source, float(raw[j]))
    score = np.array(scores)
    grafted = np.arange(num_draft, len(tokens))
    # scores never increase along a path and ties keep creation order, so this order has parents first
    grafted = grafted[np.lexsort((grafted, -score[grafted]))][: max(0, budget - num_draft)]
    chosen = np.concatenate([np.arange(num_draft), grafted])
    # a child never scores above its parent, so the threshold keeps the tree closed under parents
    chosen = chosen[score[chosen] >= min_score]
    chosen = chosen[np.lexsort((chosen, -score[chosen]))]
    new_index = np.full(len(tokens), -1, np.int64)
    new_index[chosen] = np.arange(chosen.size)
    par = np.array(parents, np.int64)[chosen]
    out_parents = np.where(par < 0, -1, new_index[np.maximum(par, 0)])
    parent_score = np.where(par < 0, 1.0, score[np.maximum(par, 0)])
    tree = DraftTree(np.array(tokens, np.int64)[chosen], out_parents,
                     (score[chosen] / np.maximum(parent_score, 1e-30)).astype(np.float32))
    return AssembledTree(tree, np.array(sources, np.int64)[chosen], np.array(raws, np.float64)[chosen])


# --- retrieval sources ----------------------------------------------------------------------------------------------
class RetrievalSources:
    """Graft's retrieval side: the successor table, the suffix automata and the n-gram index, by source name."""

    def __init__(self, opts: GraftOptions, vocab_size: int, corpus: Any = None) -> None:
        self.names = tuple(opts.sources)
        self.max_depth = opts.max_depth
        self.successors = SuccessorTable(vocab_size, opts.successor_k) if "successor" in self.names else None
        self.suffix = SuffixRetriever(
            max_depth=opts.max_depth, max_tokens_per_request=opts.max_tokens_per_request,
            max_requests=opts.max_cached_requests, global_max_tokens=(1 << 20) if opts.suffix_global else 0,
            corpus=corpus) if "suffix" in self.names else None
        self.ngram = NgramRetriever(
            min_n=opts.ngram_min_n, max_n=opts.ngram_max_n, max_depth=opts.max_depth,
            max_tokens_per_request=opts.max_tokens_per_request,
            max_requests=opts.max_cached_requests) if "ngram" in self.names else None
        self._seen: dict[str, int] = {}  # committed tokens already fed to the successor table, per request

    def at_root(self, req_id: str, context: np.ndarray, budget: int, prompt_len: int) -> dict[str, RetrievedTree]:
        """Each source's tree continuing ``context``."""
        out = {}
        for name in self.names:
            if name == "successor":
                tok, par, prob = self.successors.tree(int(context[-1]), budget, self.max_depth)
                out[name] = RetrievedTree(tok, par, prob, 1)
            elif name == "suffix":
                out[name] = self.suffix.retrieve(req_id, context, budget, prompt_len=prompt_len)
            else:
                out[name] = self.ngram.retrieve(req_id, context, budget)
        return out

    def after_path(self, req_id: str, context: np.ndarray, path: list[int], budget: int,
                   names: Iterable[str]) -> list[tuple[str, RetrievedTree]]:
        """(source, tree) continuing ``context + path`` (a draft path that is not committed), from the successor
        table and the suffix automata; the n-gram index only answers for its indexed context."""
        out = []
        for name in names:
            if name == "successor":
                tok, par, prob = self.successors.tree(path[-1], budget, self.max_depth)
                out.append((name, RetrievedTree(tok, par, prob, 1)))
            elif name == "suffix":
                window = np.concatenate([context[-self.suffix.match_window:], np.asarray(path, context.dtype)])
                automata = [self.suffix.requests.get(req_id, len(context), 0).index]
                if self.suffix.global_store is not None and len(self.suffix.global_store):
                    automata.append(self.suffix.global_store.sam)
                if self.suffix.corpus is not None:
                    automata.append(self.suffix.corpus)
                for automaton in automata:
                    state, length = automaton.match(window)
                    if length > len(path):  # the match reaches into the committed context
                        tok, par, prob = automaton.tree(state, budget, self.max_depth)
                        out.append((name, RetrievedTree(tok, par, prob, length)))
        return out

    def observe(self, req_id: str, context: np.ndarray) -> None:
        """Seed the successor rows of tokens the target has not scored yet from the committed bigrams."""
        if self.successors is None:
            return
        seen = self._seen.get(req_id, 0)
        self._seen[req_id] = len(context)
        new = context[max(seen - 1, 0, len(context) - 8192):]
        if new.size < 2:
            return
        first = new[:-1].astype(np.int64)
        ok = (first < self.successors.vocab_size) & (new[1:] >= 0)
        first, second = first[ok], new[1:][ok].astype(np.int64)
        empty = self.successors.ids[first, 0] < 0
        if not empty.any():
            return
        pairs, counts = np.unique(np.stack([first[empty], second[empty]], 1), axis=0, return_counts=True)
        order = np.lexsort((-counts, pairs[:, 0]))  # by token, most frequent successor first
        pairs, counts = pairs[order], counts[order]
        starts = np.r_[0, np.nonzero(np.diff(pairs[:, 0]))[0] + 1]
        k = self.successors.k
        ids = np.full((starts.size, k), -1, np.int32)
        probs = np.zeros((starts.size, k), np.float32)
        ends = np.r_[starts[1:], pairs.shape[0]]
        for r, (s, e) in enumerate(zip(starts, ends)):
            m = min(k, e - s)
            ids[r, :m] = pairs[s:s + m, 1]
            probs[r, :m] = SEED_CONFIDENCE * counts[s:s + m] / counts[s:e].sum()
        self.successors.update(pairs[starts, 0], ids, probs)

    def learn(self, tokens: np.ndarray, topk_ids: np.ndarray, topk_probs: np.ndarray) -> None:
        """The target's top-k successors of each token (rows of verified distributions)."""
        if self.successors is not None and len(tokens):
            self.successors.update(tokens, topk_ids, topk_probs)

    def release(self, req_ids: set[str]) -> None:
        for r in req_ids:
            self._seen.pop(r, None)
        for retriever in (self.suffix, self.ngram):
            if retriever is not None:
                retriever.release(req_ids)


# --- the proposer ---------------------------------------------------------------------------------------------------
@dataclass
class GraftStats:
    steps: int = 0
    trees: int = 0
    draft_nodes: int = 0
    grafted_nodes: int = 0
    pruned: int = 0
    draft_source: dict[str, int] = field(default_factory=dict)
    #: steps where a loaded model drafter sat out because the batch exceeded model_draft_max_batch
    retrieval_only_steps: int = 0


class GraftProposer(TreeProposer):
    options_type = GraftOptions
    wants_target_logits = True

    def __init__(self, vllm_config: Any = None, options: GraftOptions | None = None, *,
                 drafter: ModelDrafter | None = None, vocab_size: int | None = None) -> None:
        super().__init__(vllm_config, options)
        opts: GraftOptions = self.options
        calibration = load_calibration(opts.calibration_path) if opts.calibration_path else None
        checkpoints = opts.checkpoints or (calibration.checkpoints if calibration else DEFAULT_CHECKPOINTS)
        thresholds = opts.thresholds or (calibration.thresholds if calibration else DEFAULT_THRESHOLDS)
        self.checkpoints = dict(zip(checkpoints, thresholds)) if opts.prune else {}
        self.first_checkpoint = int(checkpoints[0])
        model_config = getattr(vllm_config, "model_config", None)
        if vocab_size is None:
            vocab_size = model_config.get_vocab_size() if model_config is not None else FALLBACK_VOCAB_SIZE
        corpus = None
        if opts.datastore is not None:
            corpus = load_datastore(opts.datastore, model_vocab_size=vocab_size if model_config else None,
                                    expected_tokenizer=getattr(model_config, "tokenizer", None)).automaton
        self.sources = RetrievalSources(opts, vocab_size, corpus)
        kind = device_kind(vllm_config)  # key of the per-device defaults
        knee = opts.knee_tokens or (calibration.knee_tokens if calibration and calibration.knee_tokens else
                                    DEFAULT_KNEE_TOKENS[kind])
        table = None
        if opts.knee_tokens is None:
            if calibration is not None:
                table = calibration.budget_by_batch
            elif kind == "cpu":
                table = DEFAULT_CPU_BUDGET_TABLE
        self.max_budget = opts.budget or self.max_nodes or 0
        self.min_node_confidence = (opts.min_node_confidence if opts.min_node_confidence is not None else
                                    DEFAULT_MIN_NODE_CONFIDENCE[kind])
        if opts.model_draft_max_batch is not None:
            self.model_draft_max_batch = opts.model_draft_max_batch
        else:
            self.model_draft_max_batch = DEFAULT_MODEL_DRAFT_MAX_BATCH["other" if not opts.adaptive_budget else kind]
        self.budget_curve = BudgetCurve(self.max_budget or 1, adaptive=opts.adaptive_budget, knee_tokens=knee,
                                        min_budget=opts.min_budget, table=table)
        self.drafter = drafter if drafter is not None else load_model_drafter(
            opts.eagle_checkpoint, vllm_config, depth=opts.eagle_depth, top_k=opts.eagle_top_k,
            stop_below=self.checkpoints if opts.stop_drafting_at_checkpoints else None)
        if self.drafter is None:
            logger.warning("graft: no EAGLE head (eagle_checkpoint=%r), so no model drafter: drafting retrieval-only "
                           "trees (draft = the most confident of %s, pruned at depths %s, grafted from the others)",
                           opts.eagle_checkpoint, list(opts.sources), list(self.checkpoints))
        else:
            self.needs_hidden_states = self.drafter.needs_hidden_states
            self.aux_hidden_state_layers = tuple(self.drafter.aux_hidden_state_layers)
            self.needs_kv_cache = self.drafter.needs_kv_cache
        self._roots: dict[str, int] = {}  # root token of each request's last tree (row 0 of its target logits)
        self.calibration = (AcceptanceCalibration(list(opts.sources) + [MODEL_SOURCE]) if opts.calibrate_acceptance
                            else None)
        self._last_trees: dict[str, AssembledTree] = {}  # each request's last tree, to learn acceptance from
        self.stats = GraftStats()

    # --- budget ----------------------------------------------------------------------------------------------------
    def budget(self, ctx: ProposeContext) -> int:
        cap = ctx.max_nodes if ctx.max_nodes > 0 else self.max_budget
        return min(self.budget_curve(ctx.num_reqs), cap, self.max_budget or cap)

    # --- proposing -------------------------------------------------------------------------------------------------
    def propose_trees(self, ctx: ProposeContext) -> list[DraftTree | None]:
        self.stats.steps += 1
        budget = self.budget(ctx)
        use_drafter = self.drafter is not None and budget > 0 and ctx.num_reqs <= self.model_draft_max_batch
        if use_drafter:
            # When the head will not draft (zero budget at high load, or a batch above model_draft_max_batch) it
            # does not read this step's rows either: that cost 12-14% of throughput at 4-16 requests. Rows it skips
            # stay masked out of its KV (drafts get worse after a busy spell; verification keeps them exact).
            self.drafter.ingest(ctx)
        rows = [i for i in range(ctx.num_reqs) if ctx.needs_draft(i)]
        trees: list[DraftTree | None] = [None] * ctx.num_reqs
        if budget <= 0 or not rows:
            return trees
        if self.drafter is not None and not use_drafter:
            self.stats.retrieval_only_steps += 1
        model_drafts = self._model_drafts(ctx, rows, budget) if use_drafter else {}
        for i in rows:
            trees[i] = self._tree(ctx, i, budget, model_drafts.get(i))
        return trees

    def _model_drafts(self, ctx: ProposeContext, rows: list[int], budget: int) -> dict[int, DraftGrowth]:
        growths = {i: DraftGrowth(budget, self.checkpoints, self.options.max_depth) for i in rows}
        self.drafter.start(ctx, rows)
        active = list(rows)
        while active:
            levels = self.drafter.expand(active, [growths[i].remaining for i in active])
            active = [i for i, level in zip(active, levels) if level is not None and growths[i].add_level(level)]
        # a row the drafter could not draft (no hidden states yet, head not loaded) gets a retrieval-only tree
        return {i: g for i, g in growths.items() if len(g)}

    def _tree(self, ctx: ProposeContext, i: int, budget: int, draft: DraftGrowth | None) -> DraftTree:
        opts: GraftOptions = self.options
        req_id, context = ctx.req_ids[i], ctx.committed(i)
        prompt_len = int(ctx.num_tokens[i]) - len(ctx.sampled_token_ids[i])
        self.sources.observe(req_id, context)
        self._roots[req_id] = int(context[-1])
        found = self.sources.at_root(req_id, context, budget, prompt_len)
        graft_names = list(found)
        draft_source = MODEL_SOURCE
        cal = self.calibration
        sid = (lambda name: cal.source_id(name)) if cal is not None else (lambda name: -1)

        def confidence(name: str) -> float:  # of a source's tree at the first checkpoint, calibrated if learned
            t = found[name]
            if cal is not None and t.num_nodes:
                t = t._replace(probs=cal(sid(name), t.probs))
            return first_checkpoint_confidence(t, self.first_checkpoint)

        if draft is None:  # retrieval-only: the most confident source drafts
            ranked = sorted(found, key=lambda s: -confidence(s))
            source = ranked[0]
            draft = DraftGrowth(budget, self.checkpoints, opts.max_depth)
            for level in tree_levels(found[source]):
                if not draft.add_level(level):
                    break
            graft_names.remove(source)
            draft_source = source
            if len(draft):
                self.stats.draft_source[source] = self.stats.draft_source.get(source, 0) + 1
        grafts: list[tuple[int, RetrievedTree, int]] = []
        if opts.graft and draft.remaining > 0:
            if opts.graft_position in ("root", "both"):
                grafts += [(-1, found[s], sid(s)) for s in graft_names]
            deepest = draft.deepest()
            if opts.graft_position in ("deepest", "both") and deepest >= 0:
                path = draft.path_tokens(deepest)
                grafts += [(deepest, t, sid(s)) for s, t in
                           self.sources.after_path(req_id, context, path, draft.remaining, graft_names)]
        assembled = assemble_tree(draft, grafts, budget, self.min_node_confidence, calibration=cal,
                                  draft_source=sid(draft_source))
        tree = assembled.tree
        if cal is not None:
            self._last_trees[req_id] = assembled
        self.stats.trees += 1
        self.stats.draft_nodes += len(draft)
        self.stats.grafted_nodes += tree.num_nodes - len(draft)
        self.stats.pruned += draft.pruned_at is not None
        return tree

    # --- learning from verification --------------------------------------------------------------------------------
    def on_verified(self, results: list[VerificationResult]) -> None:
        """Refresh the successor table from the target's distribution at every verified row: row 0 follows the root
        token, row 1 + j follows node j's token, whether the node was accepted or not."""
        import torch

        if self.calibration is not None:
            self._learn_acceptance(results)
        tokens, logits = [], []
        for r in results:
            root = self._roots.get(r.req_id)
            if r.target_logits is None or root is None:
                continue
            n = min(r.target_logits.shape[0], r.tree.num_nodes + 1)
            tokens.append(np.concatenate([[root], r.tree.token_ids[: n - 1]]))
            logits.append(r.target_logits[:n])
        if not tokens or self.sources.successors is None:
            return
        rows = torch.cat(logits).float()
        top, ids = rows.topk(self.sources.successors.k, dim=-1)
        probs = torch.exp(top - torch.logsumexp(rows, dim=-1, keepdim=True))
        self.learn_successors(np.concatenate(tokens), ids.numpy(), probs.numpy())

    def _learn_acceptance(self, results: list[VerificationResult]) -> None:
        """Count each verified tree's nodes whose parent was accepted (the target reached them) by source."""
        sources, raws, accepted = [], [], []
        for r in results:
            last = self._last_trees.pop(r.req_id, None)
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
            self.calibration.observe(np.concatenate(sources), np.concatenate(raws), np.concatenate(accepted))

    def learn_successors(self, tokens: np.ndarray, topk_ids: np.ndarray, topk_probs: np.ndarray) -> None:
        """Row ``tokens[i]`` of the successor table := the target's top-k after it (also used by offline replay)."""
        self.sources.learn(tokens, topk_ids, topk_probs)

    def load_model(self, model: Any) -> None:
        super().load_model(model)
        compile_retrieval_kernels()
        if self.drafter is not None:
            self.drafter.load_model(model)

    def on_requests_finished(self, req_ids: set[str]) -> None:
        if self.drafter is not None:
            self.drafter.release(req_ids)
        for r in req_ids:
            self._roots.pop(r, None)
            self._last_trees.pop(r, None)
        self.sources.release(req_ids)
