"""Compile the store's numba kernels before the first request needs them.

Every kernel is ``@njit(cache=True)``: the first process on a machine compiles it, later processes load it from the
on-disk cache. Either way it happens on the kernel's first call, which would otherwise be inside the first requests an
engine serves (measured on 2 CPU cores with a cold cache: graft's first 32-token request took 13.9 s instead of
3.6 s). :func:`compile_kernels` runs every public entry of the store once on a small synthetic stream, through the
same wrappers (and so with the same argument types) as the proposers, so that the cost moves to start-up: 21 s there
with a cold cache (every path, the datastore's read-only tables included), 0.3 s from the cache.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from .ngram import NgramIndex
from .sam import StaticSuffixAutomaton, SuffixAutomaton
from .store import NgramRetriever, SuffixRetriever
from .successor import SuccessorTable
from .tree import merge_trees, union_trees

_done = [False]


def compile_kernels() -> float:
    """Compile (or load from the cache) every kernel of the store; seconds spent (0 after the first call)."""
    if _done[0]:
        return 0.0
    started = time.perf_counter()
    # a repeating stream, so that every structure finds matches and builds non-empty trees
    stream = np.tile(np.arange(1, 41, dtype=np.int64), 6)
    budget, depth = 8, 4

    automaton = SuffixAutomaton(capacity=16)  # small: extending past it exercises the rehash path
    automaton.extend(stream)
    automaton.add_document(stream[:50])
    state, _ = automaton.match(stream[-12:])
    automaton.tree(state, budget, depth)
    automaton.self_match()
    static = automaton.compact()
    for tables in ((static.states, static.edges, static.tokens), _read_only(static)):  # the second: a datastore
        corpus = StaticSuffixAutomaton(*tables)  # validates
        state, _ = corpus.match(stream[-12:])
        corpus.tree(state, budget, depth)

    ngrams = NgramIndex(min_n=1, max_n=3)
    ngrams.extend(stream)
    ngrams.tree(budget, depth)

    successors = SuccessorTable(64, 4)
    successors.update(stream[:8], np.tile(stream[1:5], (8, 1)), np.full((8, 4), 0.25, np.float32))
    successors.tree(int(stream[0]), budget, depth)

    # the retrievers the proposers use: per-request windows that overflow (rebuild), the store of finished outputs
    suffix = SuffixRetriever(max_depth=depth, max_tokens_per_request=64, max_requests=2, global_max_tokens=128)
    ngram = NgramRetriever(min_n=1, max_n=3, max_depth=depth, max_tokens_per_request=64, max_requests=2)
    trees = []
    for end in (60, 61, 130, 240):
        trees.append(suffix.retrieve("warm-up", stream[:end], budget, prompt_len=20))
        trees.append(ngram.retrieve("warm-up", stream[:end], budget))
    suffix.release(["warm-up"])
    ngram.release(["warm-up"])
    trees.append(suffix.retrieve("warm-up 2", stream[:90], budget, prompt_len=20))
    suffix.release(["warm-up 2"], commit=False)
    merged = merge_trees(trees, budget)
    merged.path_scores()
    union_trees([(merged.token_ids, merged.parents, merged.probs), (stream[:3], [-1, 0, 0], [0.5, 0.5, 0.25])],
                [-1, 0])  # graft's assembly: a draft and a tree grafted under its first node
    _done[0] = True
    return time.perf_counter() - started


def _read_only(automaton: StaticSuffixAutomaton) -> tuple[np.ndarray, ...]:
    """Read-only copies of the tables, as a memory-mapped datastore has them (numba compiles those separately)."""
    tables = tuple(a.copy() for a in (automaton.states, automaton.edges, automaton.tokens))
    for a in tables:
        a.setflags(write=False)
    return tables


def kernel_signatures(package: str = __package__) -> dict[str, int]:
    """Compiled signatures per numba kernel of ``package``'s loaded modules (default: the store's;
    ``module.function`` -> count), to check coverage."""
    from numba.core.registry import CPUDispatcher

    out = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(package + "."):
            continue
        for attr, value in vars(module).items():
            if isinstance(value, CPUDispatcher) and value.__module__ == name:
                out[f"{name}.{attr}"] = len(value.signatures)
    return out
