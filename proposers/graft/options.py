"""graft's options (:class:`GraftOptions`), checked when the config is read, and the pruning defaults they fall back
on."""

from __future__ import annotations

import os
from typing import Literal

import msgspec

from vllm_treespec.proposers._retrieval_base import check_datastore_option, check_store_file_option
from vllm_treespec.proposers.graft.calibration import check_checkpoints, check_thresholds, load_calibration

SourceName = Literal["successor", "suffix", "ngram"]
GraftPosition = Literal["root", "deepest", "both"]
#: checkpoints and thresholds when neither the options nor a calibration file give them (see ``calibrate``)
#: (what ``calibrate`` chose for SmolLM2-135M on 2 CPU cores, MT-Bench + HumanEval, budget 32)
DEFAULT_CHECKPOINTS = (1, 2, 6)
DEFAULT_THRESHOLDS = (0.0, 0.4, 0.9)


#: ``eagle_checkpoint`` values that name no folder: no head, the default EAGLE-3 head, the cache's KV-aware head
NO_HEAD, DEFAULT_HEAD, KV_AWARE_HEAD = "none", "auto", "kv_aware"
#: the named heads: each falls back to retrieval-only trees, with one log line, when there is none for the model
NAMED_HEADS = (NO_HEAD, DEFAULT_HEAD, KV_AWARE_HEAD)


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
    #: datastore file that keeps the global store of finished outputs across restarts: loaded at start (if it
    #: exists), saved every ``suffix_global_save_every`` finished requests and at shutdown. None = kept in memory only
    suffix_global_file: str | None = None
    #: finished requests between two saves of ``suffix_global_file``
    suffix_global_save_every: int = 256
    #: corpus datastore (``vllm-treespec datastore build``) for the suffix source; None = no corpus
    datastore: str | None = None
    #: shortest n-gram ending the context that the n-gram source looks up
    ngram_min_n: int = 2
    #: longest n-gram the n-gram source looks up
    ngram_max_n: int = 4
    #: model drafter head folder (an EAGLE-3 head or a KV-aware head); "auto" (default) = the default EAGLE-3 head
    #: (one trained into the cache, else the one shipped for SmolLM2) if it was trained for the served model, else
    #: retrieval-only trees with one log line; "kv_aware" = the hybrid KV-aware head `vllm-treespec train-eagle
    #: --mode hybrid` wrote to the cache, if there is one; "none" = retrieval-only trees, no head
    eagle_checkpoint: str = DEFAULT_HEAD
    #: the model drafter's levels below the root (eagle_tree's ``depth``)
    eagle_depth: int = 6
    #: the model drafter's children per expanded node and nodes expanded per level (eagle_tree's ``top_k``)
    eagle_top_k: int = 8
    #: the model drafter's compute dtype (eagle_tree's ``dtype``): "fastest" = bf16 or fp32, whichever runs the
    #: head's layers faster on this CPU (timed at load); "int8" = int8 weights, fp32 activations
    eagle_dtype: Literal["fastest", "auto", "float32", "bfloat16", "float16", "int8"] = "fastest"
    #: the head stops growing a request's tree at the checkpoint that prunes it (saves head levels); False = the
    #: full EAGLE tree is drafted and pruned afterwards (ablation: same checkpoints, more drafting)
    stop_drafting_at_checkpoints: bool = True
    #: the model drafter drafts (and reads the step's rows) only while the batch has at most this many requests;
    #: larger batches get retrieval-only trees. None = under the step budget (``cost_budget``) the head drafts while
    #: its trees are expected to gain more than its measured time per step costs, and more than the retrieval-only
    #: trees graft would draft without it; without one the device default
    #: (CPU 1, else no limit), or no limit when adaptive_budget is off
    model_draft_max_batch: int | None = None
    #: under the step budget, on a step the head's gate keeps it out, the head still drafts for the requests that no
    #: retrieval source matched when a gate of their own expects its trees to pay against plain decoding (graft has
    #: no other tree for those requests, so retrieval is no rival there); False = the head drafts only where its gate
    #: says so for every drafting request
    unmatched_head: bool = True
    #: nodes whose path confidence (estimated chance the target accepts the whole path) is below this are not
    #: verified, even within the budget: each verified token costs forward time, which on a compute-bound device
    #: only a likely node pays back. 0 = fill the budget; None = 0 under the step budget (``cost_budget``: the
    #: verifier keeps the nodes that pay), else the device default (CPU 0.05, else 0)
    min_node_confidence: float | None = None
    #: rank and floor nodes by their observed acceptance rate (per source and raw-confidence bin, learned online from
    #: every verification) instead of the sources' raw confidences, which are not comparable across sources
    calibrate_acceptance: bool = True
    #: learn the suffix and n-gram sources' nodes apart by how many context tokens their retrieval matched (1, 2-3,
    #: 4-7, 8+): at one raw confidence a long match's continuation is accepted far more often than a short one's
    #: (``scripts/replay_matches.py``), but with four rate tables to learn per source instead of one it gained no
    #: tok/s at batch 1 (docs/benchmarks.md), so it is off unless asked
    calibrate_by_match_length: bool = False
    #: on a step the verifier's gate skips (recent trees did not pay), look up each request's suffix match anyway
    #: and offer the match's continuation tree when its first node, priced by the acceptance calibration, pays for
    #: its verification on the step-cost model: a passage repeated from the prompt is verified as it appears, not at
    #: the gate's next probe. It tells long matches from short ones only with calibrate_by_match_length
    glance: bool = False
    #: shrink the per-request budget as the batch grows (under the step budget, ``cost_budget``, the verifier's
    #: allocation does this for every method; graft's own rule then applies only with knee_tokens or a calibration
    #: file's table)
    adaptive_budget: bool = True
    #: tokens per verify forward that cost about one decode step (graft's own rule: knee_tokens / batch - 1 nodes
    #: each); None = the step budget decides, else the calibration file's table, else a device default
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
        if self.suffix_global_save_every < 1:
            raise ValueError(f"graft option 'suffix_global_save_every' must be >= 1, got "
                             f"{self.suffix_global_save_every}")
        if self.suffix_global_file is not None:
            if not self.suffix_global or "suffix" not in self.sources:
                raise ValueError("graft option 'suffix_global_file' keeps the global store of finished outputs: it "
                                 "needs 'suffix_global': true and 'suffix' in 'sources'")
            self.suffix_global_file = os.path.expanduser(self.suffix_global_file)
            check_store_file_option("graft option 'suffix_global_file'", self.suffix_global_file)
        if self.eagle_checkpoint not in NAMED_HEADS:
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
