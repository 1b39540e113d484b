"""One retriever interface over the suffix automata, the n-gram index and the successor table, with bounded memory.

A tree builder asks ``retriever.retrieve(key, context, budget)`` — "give me up to ``budget`` nodes continuing this
context" — and gets a :class:`~.tree.RetrievedTree`, whichever structure answers. ``key`` names the request whose
per-request state is used; ``release(keys)`` drops it when the request ends.

Per-request state is synchronised with the context on each call: tokens past what was indexed are appended; a context
that does not extend the indexed one (shorter, or another token where the indexed part ended) is indexed afresh.
Memory bounds, all enforced:

- ``max_tokens_per_request``: a request's index covers at most this many of its latest tokens; on overflow it is
  rebuilt from the latest half (amortised O(1) per token).
- ``max_requests``: per-request states kept; the least recently used is evicted first.
- ``global_max_tokens``: the store of finished outputs; on overflow the oldest documents are dropped until it is at
  most half full, and the automaton is rebuilt (amortised O(1) per token).
"""

from __future__ import annotations

import abc
from collections import OrderedDict, deque
from typing import Callable, Generic, Hashable, Iterable, Mapping, TypeVar

import numpy as np

from .ngram import NgramIndex
from .sam import StaticSuffixAutomaton, SuffixAutomaton
from .successor import SuccessorTable
from .tree import RetrievedTree, empty_tree, merge_trees

T = TypeVar("T")


class Retriever(abc.ABC):
    """Answers "give me up to N nodes continuing this context"."""

    @abc.abstractmethod
    def retrieve(self, key: Hashable, context: np.ndarray, budget: int) -> RetrievedTree:
        """Tree of at most ``budget`` nodes continuing ``context`` (1-D token ids; the last one is the root)."""

    def release(self, keys: Iterable[Hashable]) -> None:
        """Forget the per-request state of ``keys``."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes held by the retriever's arrays."""


class _Indexed(Generic[T]):
    """A per-request index over a window of the request's context, with what is needed to keep it in sync."""

    __slots__ = ("index", "context_len", "last_token", "window_start", "prompt_len")

    def __init__(self, index: T, prompt_len: int) -> None:
        self.index = index
        self.context_len = 0  # context tokens seen
        self.last_token = -1
        self.window_start = 0  # context position of the index's first token
        self.prompt_len = prompt_len

    def sync(self, context: np.ndarray, max_tokens: int) -> None:
        n = context.shape[0]
        index = self.index
        if self.context_len and self.context_len <= n and int(context[self.context_len - 1]) == self.last_token:
            new = context[self.context_len:]
        else:
            index.clear()
            self.window_start = 0
            new = context
        if len(index) + new.shape[0] > max_tokens:  # slide the window: rebuild from the latest half
            index.clear()
            new = context[n - min(n, max_tokens // 2):]
            self.window_start = n - new.shape[0]
        if new.shape[0]:
            index.extend(new, max_capacity=max_tokens)
        self.context_len = n
        self.last_token = int(context[-1]) if n else -1


class RequestCache(Generic[T]):
    """Per-request states, at most ``max_requests``, evicting the least recently used."""

    def __init__(self, max_requests: int, make: Callable[[int], T]) -> None:
        if max_requests <= 0:
            raise ValueError(f"max_requests must be positive, got {max_requests}")
        self.max_requests = max_requests
        self._make = make
        self._items: OrderedDict[Hashable, _Indexed[T]] = OrderedDict()

    def get(self, key: Hashable, context_len: int, prompt_len: int) -> _Indexed[T]:
        item = self._items.get(key)
        if item is None:
            while len(self._items) >= self.max_requests:
                self._items.popitem(last=False)
            item = self._items[key] = _Indexed(self._make(context_len), prompt_len)
        else:
            self._items.move_to_end(key)
        return item

    def pop(self, key: Hashable) -> _Indexed[T] | None:
        return self._items.pop(key, None)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def values(self):
        return self._items.values()


class GlobalSuffixStore:
    """Suffix automaton over finished outputs (one document each), bounded to ``max_tokens`` (separators included)."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
        self.max_tokens = max_tokens
        self.sam = SuffixAutomaton(capacity=min(max_tokens, 4096))
        self.doc_lens: deque[int] = deque()  # stored length of each document, separator included
        self.documents_added = 0  # ever, evicted ones included: what a store file counts its saves by

    def __len__(self) -> int:
        return len(self.sam)

    @property
    def num_documents(self) -> int:
        """Documents held now."""
        return len(self.doc_lens)

    @property
    def nbytes(self) -> int:
        return self.sam.nbytes

    def add(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
        if tokens.shape[0] == 0:
            return
        tokens = tokens[max(0, tokens.shape[0] - (self.max_tokens - 1)):]
        size = tokens.shape[0] + 1
        if len(self.sam) + size > self.max_tokens:
            total = len(self.sam)
            drop = 0
            while self.doc_lens and total - drop + size > self.max_tokens // 2:
                drop += self.doc_lens.popleft()
            kept = self.sam.tokens[drop:total].copy()
            self.sam.clear()
            self.sam.extend(kept, max_capacity=self.max_tokens)
        self.sam.add_document(tokens, max_capacity=self.max_tokens)
        self.doc_lens.append(size)
        self.documents_added += 1


class SuffixRetriever(Retriever):
    """Suffix-automaton retrieval: a per-request automaton over the request's own context, a global one over finished
    outputs, and an optional read-only corpus automaton (a datastore). Each source with a match of at least
    ``min_match_len`` tokens yields a best-first tree; the trees are merged (see :func:`.tree.merge_trees`).

    ``max_spec_factor`` (SuffixDecoding's adaptive length) caps a source's nodes at ``factor * match_len``.
    ``match_window`` bounds how many context tokens are matched against the global and corpus automata.
    """

    def __init__(self, *, max_depth: int = 24, min_prob: float = 0.0, min_score: float = 0.0, min_match_len: int = 1,
                 max_spec_factor: float | None = None, match_window: int = 32, max_tokens_per_request: int = 32768,
                 max_requests: int = 256, global_max_tokens: int = 1 << 20,
                 corpus: StaticSuffixAutomaton | None = None) -> None:
        self.max_depth, self.min_prob, self.min_score = int(max_depth), float(min_prob), float(min_score)
        self.min_match_len = max(1, int(min_match_len))
        self.max_spec_factor = max_spec_factor
        self.match_window = int(match_window)
        if max_tokens_per_request < 2:
            raise ValueError(f"max_tokens_per_request must be >= 2, got {max_tokens_per_request}")
        self.max_tokens_per_request = int(max_tokens_per_request)
        self.requests: RequestCache[SuffixAutomaton] = RequestCache(
            max_requests, lambda n: SuffixAutomaton(capacity=min(max(n + 256, 1024), self.max_tokens_per_request)))
        self.global_store = GlobalSuffixStore(global_max_tokens) if global_max_tokens else None
        self.corpus = corpus

    def _source_budget(self, budget: int, match_len: int) -> int:
        if match_len < self.min_match_len:
            return 0
        if self.max_spec_factor is not None:
            budget = min(budget, int(self.max_spec_factor * match_len))
        return budget

    def _tree(self, automaton, state: int, match_len: int, budget: int) -> RetrievedTree | None:
        b = self._source_budget(budget, match_len)
        if b <= 0:
            return None
        tok, par, prob = automaton.tree(state, b, self.max_depth, self.min_prob, self.min_score)
        return RetrievedTree(tok, par, prob, match_len)

    def retrieve(self, key: Hashable, context: np.ndarray, budget: int, prompt_len: int = 0) -> RetrievedTree:
        """``prompt_len`` (used when ``key`` is first seen) marks where the output starts, for the global store."""
        context = np.ascontiguousarray(context, dtype=np.int32).reshape(-1)
        item = self.requests.get(key, context.shape[0], prompt_len)
        item.sync(context, self.max_tokens_per_request)
        trees = []
        state, length = item.index.self_match()
        t = self._tree(item.index, state, length, budget)
        if t is not None:
            trees.append(t)
        window = context[max(0, context.shape[0] - self.match_window):]
        for automaton in (self.global_store.sam if self.global_store is not None and len(self.global_store) else None,
                          self.corpus):
            if automaton is not None:
                state, length = automaton.match(window)
                t = self._tree(automaton, state, length, budget)
                if t is not None:
                    trees.append(t)
        if len(trees) == 1:
            return trees[0]
        return merge_trees(trees, budget) if trees else empty_tree()

    def release(self, keys: Iterable[Hashable], commit: bool = True,
                outputs: Mapping[Hashable, np.ndarray] | None = None) -> None:
        """Drop the requests' state; with ``commit``, index their outputs globally: a request's tokens in
        ``outputs`` when given (its whole output), else its indexed tokens from ``prompt_len`` (as far as the last
        :meth:`retrieve` for it read)."""
        outputs = outputs or {}
        for key in keys:
            item = self.requests.pop(key)
            if not commit or self.global_store is None:
                continue
            if key in outputs:
                self.global_store.add(outputs[key])
            elif item is not None:
                sam = item.index
                self.global_store.add(sam.tokens[max(0, item.prompt_len - item.window_start):len(sam)])

    @property
    def nbytes(self) -> int:
        total = sum(item.index.nbytes for item in self.requests.values())
        if self.global_store is not None:
            total += self.global_store.nbytes
        return total

    def max_nbytes(self) -> int:
        """Upper bound of :attr:`nbytes` implied by the configuration (the corpus is memory-mapped, not counted)."""
        bound = self.requests.max_requests * SuffixAutomaton.nbytes_for(self.max_tokens_per_request)
        if self.global_store is not None:
            bound += SuffixAutomaton.nbytes_for(self.global_store.max_tokens)
        return bound


class NgramRetriever(Retriever):
    """N-gram index over each request's own context (prompt lookup as a tree)."""

    def __init__(self, *, min_n: int = 2, max_n: int = 4, max_occurrences: int = 32, max_depth: int = 8,
                 min_prob: float = 0.0, min_score: float = 0.0, max_tokens_per_request: int = 32768,
                 max_requests: int = 256) -> None:
        NgramIndex(min_n, max_n, capacity=16)  # validates min_n / max_n
        if max_occurrences <= 0:
            raise ValueError(f"max_occurrences must be positive, got {max_occurrences}")
        if max_tokens_per_request < 2:
            raise ValueError(f"max_tokens_per_request must be >= 2, got {max_tokens_per_request}")
        self.min_n, self.max_n = min_n, max_n
        self.max_occurrences, self.max_depth = int(max_occurrences), int(max_depth)
        self.min_prob, self.min_score = float(min_prob), float(min_score)
        self.max_tokens_per_request = int(max_tokens_per_request)
        self.requests: RequestCache[NgramIndex] = RequestCache(
            max_requests,
            lambda n: NgramIndex(min_n, max_n, capacity=min(max(n + 256, 1024), self.max_tokens_per_request)))

    def retrieve(self, key: Hashable, context: np.ndarray, budget: int) -> RetrievedTree:
        context = np.ascontiguousarray(context, dtype=np.int32).reshape(-1)
        item = self.requests.get(key, context.shape[0], 0)
        item.sync(context, self.max_tokens_per_request)
        tok, par, prob, n = item.index.tree(budget, self.max_depth, self.max_occurrences, self.min_prob,
                                            self.min_score)
        return RetrievedTree(tok, par, prob, int(n))

    def release(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self.requests.pop(key)

    @property
    def nbytes(self) -> int:
        return sum(item.index.nbytes for item in self.requests.values())

    def max_nbytes(self) -> int:
        return self.requests.max_requests * NgramIndex.nbytes_for(self.max_tokens_per_request, self.min_n, self.max_n)


class SuccessorRetriever(Retriever):
    """Root-centred tree from a :class:`~.successor.SuccessorTable`; only the last context token matters."""

    def __init__(self, table: SuccessorTable, *, max_depth: int = 16, min_prob: float = 0.0,
                 min_score: float = 0.0) -> None:
        self.table = table
        self.max_depth, self.min_prob, self.min_score = int(max_depth), float(min_prob), float(min_score)

    def retrieve(self, key: Hashable, context: np.ndarray, budget: int) -> RetrievedTree:
        if len(context) == 0:
            return empty_tree()
        tok, par, prob = self.table.tree(int(context[-1]), budget, self.max_depth, self.min_prob, self.min_score)
        return RetrievedTree(tok, par, prob, 1 if tok.shape[0] else 0)

    @property
    def nbytes(self) -> int:
        return self.table.nbytes
