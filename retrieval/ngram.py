"""N-gram index: prompt lookup (PLD; Saxena 2023, vLLM ``ngram``) generalised to trees.

For every position and every n in ``[min_n, max_n]`` the index chains the earlier positions where the same n-gram
ended (a hash bucket head per n-gram and a ``prev`` link per position, like a hash-chained LZ77 matcher). A lookup
takes the longest n whose last n-gram occurred before, follows up to ``max_occurrences`` of its most recent earlier
occurrences, inserts the ``max_depth`` tokens that followed each into a counted trie, and extracts a best-first tree
from it (see :mod:`.tree`): a node's confidence is the fraction of those occurrences that continue with its token.

Unlike the suffix automaton this weights recent occurrences only and bounds lookup work by ``max_occurrences``;
appends cost O(max_n - min_n + 1) hash updates per token.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .tree import E_NEXT, E_TO, E_TOK, S_CNT, S_FIRST, extract_tree

_H1 = np.uint64(0x9E3779B97F4A7C15)
_H2 = np.uint64(0xC2B2AE3D27D4EB4F)


@njit(cache=True)
def _hash(tokens, end, n, mask):
    h = np.uint64(n) * _H2
    for i in range(end - n + 1, end + 1):
        h = (h ^ np.uint64(np.uint32(tokens[i]))) * _H1
        h ^= h >> np.uint64(29)
    return np.int64(h & np.uint64(mask))


@njit(cache=True)
def _index(tokens, start, stop, heads, prev, min_n):
    """Chain positions ``start..stop-1`` into the hash buckets of their n-grams."""
    mask = heads.shape[1] - 1
    for i in range(start, stop):
        for k in range(heads.shape[0]):
            n = min_n + k
            if i + 1 >= n:
                h = _hash(tokens, i, n, mask)
                prev[k, i] = heads[k, h]
                heads[k, h] = i
            else:
                prev[k, i] = -1


@njit(cache=True)
def _same(tokens, a, b, n):
    for d in range(n):
        if tokens[a - d] != tokens[b - d]:
            return False
    return True


@njit(cache=True)
def _lookup(tokens, num_tokens, prev, min_n, max_occurrences, max_depth, budget, min_prob, min_score):
    """Tree continuing ``tokens[:num_tokens]``; returns (token_ids, parents, probs, matched n)."""
    last = num_tokens - 1
    occ = np.empty(max_occurrences, np.int64)
    found = 0
    matched = 0
    max_steps = 4 * max_occurrences + 16  # bounds work on hash collisions
    for k in range(prev.shape[0] - 1, -1, -1):
        n = min_n + k
        if last < n:  # an earlier occurrence needs at least n+1 tokens
            continue
        j = prev[k, last]
        steps = 0
        while j >= 0 and found < max_occurrences and steps < max_steps:
            if j >= n - 1 and _same(tokens, j, last, n):
                occ[found] = j
                found += 1
            j = prev[k, j]
            steps += 1
        if found:
            matched = n
            break
    if found == 0 or budget <= 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32), 0
    # counted trie of the continuations: node 0 is the root; node i > 0 is entered by edge i - 1
    cap = found * max_depth + 1
    states = np.zeros((cap, 4), np.int32)
    edges = np.empty((cap, 3), np.int32)
    states[0, S_FIRST] = -1
    n_nodes = 1
    for o in range(found):
        node = 0
        states[0, S_CNT] += 1
        for pos in range(occ[o] + 1, min(occ[o] + 1 + max_depth, num_tokens)):
            tok = tokens[pos]
            e = states[node, S_FIRST]
            while e >= 0 and edges[e, E_TOK] != tok:
                e = edges[e, E_NEXT]
            if e < 0:
                child = n_nodes
                n_nodes += 1
                e = child - 1
                edges[e, E_TOK] = tok
                edges[e, E_TO] = child
                edges[e, E_NEXT] = states[node, S_FIRST]
                states[node, S_FIRST] = e
                states[child, S_FIRST] = -1
                node = child
            else:
                node = edges[e, E_TO]
            states[node, S_CNT] += 1
    tok, par, prob = extract_tree(states, edges, 0, budget, max_depth, min_prob, min_score)
    return tok, par, prob, matched


class NgramIndex:
    """Growable n-gram index over one token stream."""

    def __init__(self, min_n: int = 2, max_n: int = 4, capacity: int = 1024) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = int(min_n), int(max_n)
        self.num_tokens = 0
        self._alloc(max(16, int(capacity)))

    def _alloc(self, cap: int) -> None:
        orders = self.max_n - self.min_n + 1
        self.cap_tokens = cap
        self.tokens = np.empty(cap, np.int32)
        self.prev = np.empty((orders, cap), np.int32)
        self.heads = np.full((orders, 1 << max(4, (2 * cap - 1).bit_length())), -1, np.int32)

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.prev.nbytes + self.heads.nbytes

    @staticmethod
    def nbytes_for(num_tokens: int, min_n: int, max_n: int) -> int:
        orders = max_n - min_n + 1
        return 4 * num_tokens * (1 + orders) + 4 * orders * (1 << max(4, (2 * num_tokens - 1).bit_length()))

    def clear(self) -> None:
        self.num_tokens = 0
        self.heads.fill(-1)

    def extend(self, tokens, max_capacity: int | None = None) -> None:
        tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        n = self.num_tokens
        need = n + tokens.shape[0]
        if need > self.cap_tokens:
            cap = max(need, 2 * self.cap_tokens)
            if max_capacity is not None:
                if need > max_capacity:
                    raise ValueError(f"{need} tokens exceed the index's capacity bound of {max_capacity}")
                cap = min(cap, max_capacity)
            old = self.tokens[:n]
            self._alloc(cap)
            self.tokens[:n] = old
            _index(self.tokens, 0, n, self.heads, self.prev, self.min_n)  # re-bucket for the larger table
        self.tokens[n:need] = tokens
        _index(self.tokens, n, need, self.heads, self.prev, self.min_n)
        self.num_tokens = need

    def tree(self, budget: int, max_depth: int, max_occurrences: int = 32, min_prob: float = 0.0,
             min_score: float = 0.0):
        """Continuation tree of the whole indexed stream: (token_ids, parents, probs, matched n)."""
        if self.num_tokens == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32), 0
        return _lookup(self.tokens, self.num_tokens, self.prev, self.min_n, max_occurrences, max_depth, budget,
                       min_prob, min_score)
