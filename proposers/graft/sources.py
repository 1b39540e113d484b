"""graft's retrieval sources, by name: a top-k successor table (Token Recycling, arXiv 2408.08696) learned online from
the target's distributions and seeded from committed bigrams, suffix automata (the request's prompt + output,
finished outputs, an optional corpus datastore) and an n-gram index."""

from __future__ import annotations

import bisect
from typing import Any, Iterable

import numpy as np

from vllm_treespec.proposers.graft.options import GraftOptions
from vllm_treespec.retrieval import NgramRetriever, RetrievedTree, SuccessorTable, SuffixRetriever
from vllm_treespec.verify.calibration import FAMILY_SEPARATOR

#: successor-table vocabulary when the model's is unknown (no vllm_config); tokens beyond it are not learned
FALLBACK_VOCAB_SIZE = 1 << 17
#: confidence scale of successors seeded from committed bigrams (they are counts, not target distributions)
SEED_CONFIDENCE = 0.5
#: the sources whose trees continue a matched context suffix (the successor table's follow one token)
MATCHED_SOURCES = ("suffix", "ngram")
#: lower bounds of the match-length classes ``calibrate_by_match_length`` learns apart (a retrieved tree's
#: ``match_len``: how many context tokens the retrieval matched). At one raw confidence the continuation of a short
#: match is accepted far less often than a long one's: replaying the suffix source against greedy outputs of 42
#: ShareGPT and HumanEval tuning prompts (``scripts/replay_matches.py``), root children scoring >= 0.9 were accepted
#: 32% / 45% / 65% / 84% of the time after matches of 1 / 2-3 / 4-7 / 8+ tokens (one pooled bin priced them alike)
MATCH_CLASSES = (1, 2, 4, 8)


def match_class_sources(source: str) -> tuple[str, ...]:
    """``source``'s acceptance-source names, one per match-length class: ``source@1``, ``source@2``, ... (the
    calibration's ``FAMILY@CLASS`` names: a class starts from its family's rate)"""
    return tuple(f"{source}{FAMILY_SEPARATOR}{m}" for m in MATCH_CLASSES)


def match_class(match_len: int) -> int:
    """The class of a retrieval that matched ``match_len`` context tokens (an index into :data:`MATCH_CLASSES`)."""
    return max(bisect.bisect_right(MATCH_CLASSES, int(match_len)) - 1, 0)


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
        self.successors.seed(context[max(seen - 1, 0, len(context) - 8192):], SEED_CONFIDENCE)

    def learn(self, tokens: np.ndarray, topk_ids: np.ndarray, topk_probs: np.ndarray) -> None:
        """The target's top-k successors of each token (rows of verified distributions)."""
        if self.successors is not None and len(tokens):
            self.successors.update(tokens, topk_ids, topk_probs)

    def release(self, req_ids: set[str], outputs: dict[str, np.ndarray] | None = None) -> None:
        """Drop the requests' state; the suffix source indexes their ``outputs`` (whole, when given) globally."""
        for r in req_ids:
            self._seen.pop(r, None)
        if self.suffix is not None:
            self.suffix.release(req_ids, outputs=outputs)
        if self.ngram is not None:
            self.ngram.release(req_ids)
