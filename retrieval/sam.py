"""Suffix automaton over token ids with occurrence counts, online append, and a compact read-only form.

A suffix automaton (SAM; Blumer et al. 1985, used for drafting by SAM-Decoding, arXiv 2411.10666, and SGLang's NGRAM
corpora) is the minimal automaton of all substrings of a token stream. Each state is a class of substrings that end at
the same set of positions (*endpos*); ``S_CNT`` keeps the size of that set up to date on every append, so the
children of the state reached by a context suffix ``s`` give the exact empirical distribution of the token after
``s``. Matching the longest suffix of a context costs amortised O(1) per context token; for a stream indexed in its own
automaton the longest earlier-occurring suffix is simply ``link(last)``.

Tables (int32; one row per state / edge):

- states ``[cap, 4]``: ``S_LEN`` (longest string), ``S_LINK`` (suffix link, -1 at the root 0), ``S_CNT`` (|endpos|),
  ``S_FIRST`` (first outgoing edge). The compact form adds ``S_DEG`` (out-degree; its edges are contiguous and
  sorted by token).
- edges ``[cap, 4]``: ``E_TOK``, ``E_TO``, ``E_NEXT`` (next edge of the same source), ``E_SRC`` (source state; the
  compact form drops it).
- an open-addressing hash table ``int32[2^k]`` of edge ids keyed by (source, token), linear probing.

Appending checks capacity against the worst case (states <= 2n+1, edges <= 3n+4 for n tokens) so a kernel never writes
out of bounds; the Python class grows the tables. Documents are joined with :data:`SEP` so matches never cross them.
The count update walks the suffix-link path of the new state, whose length is at most the number of distinct
occurrence counts among the suffixes of the stream: small on natural text, up to n on a run of one repeated token
(the per-request token bound caps that worst case).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .tree import E_NEXT, E_SRC, E_TO, E_TOK, S_CNT, S_DEG, S_FIRST, S_LEN, S_LINK, SEP, extract_tree

M_STATES, M_EDGES, M_LAST, M_TOKENS = 0, 1, 2, 3

_H1 = np.uint64(0x9E3779B97F4A7C15)
_SHIFT = np.uint64(31)


@njit(cache=True, inline="always")
def _slot(src, tok, mask):
    x = (np.uint64(src) << np.uint64(32)) | np.uint64(np.uint32(tok))
    x = x * _H1
    x ^= x >> _SHIFT
    return np.int64(x & np.uint64(mask))


@njit(cache=True)
def _find(edges, table, src, tok):
    mask = table.shape[0] - 1
    i = _slot(src, tok, mask)
    while True:
        e = table[i]
        if e < 0:
            return -1
        if edges[e, E_SRC] == src and edges[e, E_TOK] == tok:
            return e
        i = (i + 1) & mask


@njit(cache=True)
def _add_edge(states, edges, table, meta, src, tok, to):
    e = meta[M_EDGES]
    meta[M_EDGES] = e + 1
    edges[e, E_TOK] = tok
    edges[e, E_TO] = to
    edges[e, E_SRC] = src
    edges[e, E_NEXT] = states[src, S_FIRST]
    states[src, S_FIRST] = e
    mask = table.shape[0] - 1
    i = _slot(src, tok, mask)
    while table[i] >= 0:
        i = (i + 1) & mask
    table[i] = e


@njit(cache=True)
def _new_state(states, meta, length, link, cnt):
    s = meta[M_STATES]
    meta[M_STATES] = s + 1
    states[s, S_LEN] = length
    states[s, S_LINK] = link
    states[s, S_CNT] = cnt
    states[s, S_FIRST] = -1
    return s


@njit(cache=True)
def _extend_one(states, edges, table, meta, tok):
    last = meta[M_LAST]
    cur = _new_state(states, meta, states[last, S_LEN] + 1, -1, 0)
    p = last
    e = -1
    while p >= 0:
        e = _find(edges, table, p, tok)
        if e >= 0:
            break
        _add_edge(states, edges, table, meta, p, tok, cur)
        p = states[p, S_LINK]
    if p < 0:
        states[cur, S_LINK] = 0
    else:
        q = edges[e, E_TO]
        if states[p, S_LEN] + 1 == states[q, S_LEN]:
            states[cur, S_LINK] = q
        else:
            clone = _new_state(states, meta, states[p, S_LEN] + 1, states[q, S_LINK], states[q, S_CNT])
            f = states[q, S_FIRST]
            while f >= 0:
                _add_edge(states, edges, table, meta, clone, edges[f, E_TOK], edges[f, E_TO])
                f = edges[f, E_NEXT]
            while p >= 0:
                e = _find(edges, table, p, tok)
                if e < 0 or edges[e, E_TO] != q:
                    break
                edges[e, E_TO] = clone
                p = states[p, S_LINK]
            states[q, S_LINK] = clone
            states[cur, S_LINK] = clone
    meta[M_LAST] = cur
    meta[M_TOKENS] += 1
    # the new end position belongs to every suffix of the stream: the states on cur's suffix-link path
    v = cur
    while v > 0:
        states[v, S_CNT] += 1
        v = states[v, S_LINK]


@njit(cache=True)
def _extend(states, edges, table, meta, tokens):
    """Append ``tokens`` while the tables are guaranteed large enough; returns how many were appended."""
    for i in range(tokens.shape[0]):
        n = meta[M_TOKENS] + 1
        if 2 * n + 1 > states.shape[0] or 3 * n + 4 > edges.shape[0] or 2 * (3 * n + 4) > table.shape[0]:
            return i
        _extend_one(states, edges, table, meta, tokens[i])
    return tokens.shape[0]


@njit(cache=True)
def _rehash(edges, n_edges, table):
    table[:] = -1
    mask = table.shape[0] - 1
    for e in range(n_edges):
        i = _slot(edges[e, E_SRC], edges[e, E_TOK], mask)
        while table[i] >= 0:
            i = (i + 1) & mask
        table[i] = e


@njit(cache=True)
def _match_dynamic(states, edges, table, context):
    """Longest suffix of ``context`` that occurs in the automaton: (state, length)."""
    v = 0
    length = 0
    for i in range(context.shape[0]):
        tok = context[i]
        e = _find(edges, table, v, tok)
        while e < 0 and v > 0:
            v = states[v, S_LINK]
            length = states[v, S_LEN]
            e = _find(edges, table, v, tok)
        if e >= 0:
            v = edges[e, E_TO]
            length += 1
    return v, length


@njit(cache=True)
def _find_sorted(states, edges, v, tok):
    lo = states[v, S_FIRST]
    hi = lo + states[v, S_DEG]
    while lo < hi:
        mid = (lo + hi) >> 1
        if edges[mid, E_TOK] < tok:
            lo = mid + 1
        else:
            hi = mid
    if lo < states[v, S_FIRST] + states[v, S_DEG] and edges[lo, E_TOK] == tok:
        return lo
    return -1


@njit(cache=True)
def _match_static(states, edges, context):
    v = 0
    length = 0
    for i in range(context.shape[0]):
        tok = context[i]
        e = _find_sorted(states, edges, v, tok)
        while e < 0 and v > 0:
            v = states[v, S_LINK]
            length = states[v, S_LEN]
            e = _find_sorted(states, edges, v, tok)
        if e >= 0:
            v = edges[e, E_TO]
            length += 1
    return v, length


@njit(cache=True)
def validate_static(states, edges, num_tokens):
    """Structural check of a compact automaton (so that no kernel can read out of bounds or loop): returns "" or the
    first problem found."""
    ns = states.shape[0]
    ne = edges.shape[0]
    if ns < 1 or states[0, S_LINK] != -1 or states[0, S_LEN] != 0:
        return "root state malformed"
    if ns > 2 * num_tokens + 1 or ne > 3 * num_tokens + 4:
        return "more states or edges than the token count allows"
    for v in range(ns):
        link = states[v, S_LINK]
        if v > 0 and (link < 0 or link >= ns or states[link, S_LEN] >= states[v, S_LEN]):
            return "suffix link out of range or not shorter"
        if v > 0 and states[v, S_CNT] < 1:
            return "state with zero count"
        first = states[v, S_FIRST]
        deg = states[v, S_DEG]
        if deg < 0 or (deg == 0 and first != -1) or (deg > 0 and (first < 0 or first + deg > ne)):
            return "edge range out of bounds"
        for e in range(first, first + deg):
            to = edges[e, E_TO]
            if to <= 0 or to >= ns or states[to, S_LEN] <= states[v, S_LEN]:
                return "edge target out of range"
            nxt = edges[e, E_NEXT]
            if (e + 1 < first + deg and nxt != e + 1) or (e + 1 == first + deg and nxt != -1):
                return "edge list not contiguous"
            if e > first and edges[e - 1, E_TOK] >= edges[e, E_TOK]:
                return "edge tokens not sorted"
    return ""


class SuffixAutomaton:
    """Growable suffix automaton with occurrence counts over one token stream (documents joined by SEP).

    ``extend`` appends tokens; ``match`` finds the longest suffix of a context; ``tree`` extracts a continuation tree
    below a state. ``tokens`` keeps the indexed stream (the class can rebuild from it)."""

    STATE_COLS = 4
    EDGE_COLS = 4

    def __init__(self, capacity: int = 1024) -> None:
        self._alloc(max(16, int(capacity)))
        self.meta = np.zeros(4, np.int64)
        self.clear()

    def _alloc(self, cap_tokens: int) -> None:
        self.cap_tokens = cap_tokens
        self.tokens = np.empty(cap_tokens, np.int32)
        self.states = np.empty((2 * cap_tokens + 1, self.STATE_COLS), np.int32)
        self.edges = np.empty((3 * cap_tokens + 4, self.EDGE_COLS), np.int32)
        self.table = np.full(_pow2(2 * (3 * cap_tokens + 4)), -1, np.int32)

    def clear(self) -> None:
        self.meta[:] = 0
        self.meta[M_STATES] = 1
        self.states[0] = (0, -1, 0, -1)
        self.table.fill(-1)

    def __len__(self) -> int:
        return int(self.meta[M_TOKENS])

    @property
    def num_states(self) -> int:
        return int(self.meta[M_STATES])

    @property
    def num_edges(self) -> int:
        return int(self.meta[M_EDGES])

    @property
    def last(self) -> int:
        return int(self.meta[M_LAST])

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.states.nbytes + self.edges.nbytes + self.table.nbytes

    @staticmethod
    def nbytes_for(num_tokens: int) -> int:
        """Upper bound of ``nbytes`` for an automaton whose capacity is ``num_tokens`` tokens."""
        edges = 3 * num_tokens + 4
        return 4 * num_tokens + 16 * (2 * num_tokens + 1) + 16 * edges + 4 * _pow2(2 * edges)

    def reserve(self, num_tokens: int) -> None:
        """Make room for ``num_tokens`` tokens in total (tables are copied, the hash table rebuilt)."""
        if num_tokens <= self.cap_tokens:
            return
        old_tokens, old_states, old_edges = self.tokens, self.states, self.edges
        self._alloc(num_tokens)
        n, ns, ne = len(self), self.num_states, self.num_edges
        self.tokens[:n] = old_tokens[:n]
        self.states[:ns] = old_states[:ns]
        self.edges[:ne] = old_edges[:ne]
        _rehash(self.edges, ne, self.table)

    def extend(self, tokens, max_capacity: int | None = None) -> None:
        """Append tokens (ints >= 0, or SEP). Capacity doubles as needed, never beyond ``max_capacity`` tokens."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        need = len(self) + tokens.shape[0]
        if need > self.cap_tokens:
            cap = max(need, 2 * self.cap_tokens)
            if max_capacity is not None:
                if need > max_capacity:
                    raise ValueError(f"{need} tokens exceed the automaton's capacity bound of {max_capacity}")
                cap = min(cap, max_capacity)
            self.reserve(cap)
        start = len(self)
        self.tokens[start:need] = tokens
        done = _extend(self.states, self.edges, self.table, self.meta, tokens)
        assert done == tokens.shape[0], "automaton capacity invariant violated"

    def add_document(self, tokens, max_capacity: int | None = None) -> None:
        """Append a document followed by SEP, so that no match spans two documents."""
        tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
        self.extend(np.concatenate([tokens, np.array([SEP], np.int32)]), max_capacity)

    def match(self, context) -> tuple[int, int]:
        """(state, length) of the longest suffix of ``context`` that occurs in the indexed stream."""
        ctx = np.ascontiguousarray(context, dtype=np.int32).reshape(-1)
        v, length = _match_dynamic(self.states, self.edges, self.table, ctx)
        return int(v), int(length)

    def self_match(self) -> tuple[int, int]:
        """(state, length) of the longest suffix of the indexed stream that also occurs earlier in it."""
        v = int(self.states[self.last, S_LINK]) if len(self) else 0
        v = max(v, 0)
        return v, int(self.states[v, S_LEN])

    def tree(self, state: int, budget: int, max_depth: int, min_prob: float = 0.0, min_score: float = 0.0):
        return extract_tree(self.states, self.edges, state, budget, max_depth, min_prob, min_score)

    def count(self, state: int) -> int:
        return int(self.states[state, S_CNT])

    def compact(self) -> "StaticSuffixAutomaton":
        """Read-only copy with contiguous, token-sorted edges and no hash table (about 60 bytes per token)."""
        ns, ne = self.num_states, self.num_edges
        src = self.edges[:ne, E_SRC]
        tok = self.edges[:ne, E_TOK]
        order = np.lexsort((tok, src))
        edges = np.empty((ne, 3), np.int32)
        edges[:, E_TOK] = tok[order]
        edges[:, E_TO] = self.edges[:ne, E_TO][order]
        sorted_src = src[order]
        nxt = np.arange(1, ne + 1, dtype=np.int32)
        if ne:
            nxt[:-1][sorted_src[1:] != sorted_src[:-1]] = -1
            nxt[-1] = -1
        edges[:, E_NEXT] = nxt
        states = np.empty((ns, 5), np.int32)
        states[:, :3] = self.states[:ns, :3]
        deg = np.bincount(sorted_src, minlength=ns).astype(np.int32)
        first = np.concatenate([[0], np.cumsum(deg)[:-1]]).astype(np.int32)
        states[:, S_FIRST] = np.where(deg > 0, first, -1)
        states[:, S_DEG] = deg
        return StaticSuffixAutomaton(states, edges, self.tokens[: len(self)].copy())


class StaticSuffixAutomaton:
    """Read-only suffix automaton in compact form (states ``[S, 5]``, edges ``[E, 3]``), e.g. memory-mapped from a
    datastore. Same query interface as :class:`SuffixAutomaton`."""

    def __init__(self, states: np.ndarray, edges: np.ndarray, tokens: np.ndarray, validate: bool = True) -> None:
        if states.ndim != 2 or states.shape[1] != 5 or edges.ndim != 2 or edges.shape[1] != 3:
            raise ValueError(f"bad table shapes: states {states.shape}, edges {edges.shape}")
        if states.dtype != np.int32 or edges.dtype != np.int32 or tokens.dtype != np.int32:
            raise ValueError("automaton tables must be int32")
        if validate:
            problem = validate_static(states, edges, tokens.shape[0])
            if problem:
                raise ValueError(f"corrupt suffix automaton: {problem}")
        self.states, self.edges, self.tokens = states, edges, tokens

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_states(self) -> int:
        return int(self.states.shape[0])

    @property
    def num_edges(self) -> int:
        return int(self.edges.shape[0])

    @property
    def nbytes(self) -> int:
        return self.states.nbytes + self.edges.nbytes + self.tokens.nbytes

    def match(self, context) -> tuple[int, int]:
        ctx = np.ascontiguousarray(context, dtype=np.int32).reshape(-1)
        v, length = _match_static(self.states, self.edges, ctx)
        return int(v), int(length)

    def tree(self, state: int, budget: int, max_depth: int, min_prob: float = 0.0, min_score: float = 0.0):
        return extract_tree(self.states, self.edges, state, budget, max_depth, min_prob, min_score)

    def count(self, state: int) -> int:
        return int(self.states[state, S_CNT])


def _pow2(n: int) -> int:
    return 1 << max(4, int(n - 1).bit_length())
