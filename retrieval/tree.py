"""Best-first extraction of draft trees from counted continuation graphs, and merging of trees from several sources.

Every retrieval structure in this package answers a query with a *count graph*: a node (a suffix-automaton state or a
trie node) whose outgoing edges are the tokens seen next, each leading to a node whose count says how often that
continuation occurred. :func:`extract_tree` turns such a graph into a draft tree of at most ``budget`` nodes by
best-first search on the path probability (product of empirical next-token probabilities along the path), the
frequency-weighted expansion of SuffixDecoding (arXiv 2411.04975) and SGLang's NGRAM trie.

Arrays shared by all count graphs (int32, one row per node / edge; only the listed columns are read here):

- ``states[v, S_CNT]``: occurrence count of node ``v``; ``states[v, S_FIRST]``: its first outgoing edge or -1.
- ``edges[e, E_TOK]``: the edge's token (``SEP`` = document separator, never proposed); ``edges[e, E_TO]``: target
  node; ``edges[e, E_NEXT]``: next edge of the same source or -1.

A tree is ``(token_ids int64[N], parents int32[N], probs float32[N])`` in best-first order: parents[i] < i, -1 is the
root (the last context token), the path probability never increases along the order, so every prefix is a valid
subtree holding the most probable nodes. ``probs[i]`` is P(token_i | path to its parent), the node's confidence.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
from numba import njit

# Column layout of state and edge tables (see module docstring; sam.py adds S_LEN/S_LINK/S_DEG and E_SRC).
S_LEN, S_LINK, S_CNT, S_FIRST, S_DEG = 0, 1, 2, 3, 4
E_TOK, E_TO, E_NEXT, E_SRC = 0, 1, 2, 3
#: Token value that separates documents inside one index. Contexts never contain it and trees never cross it.
SEP = -1


class RetrievedTree(NamedTuple):
    """A retrieved continuation tree (see module docstring) and the length of the context suffix it continues."""

    token_ids: np.ndarray
    parents: np.ndarray
    probs: np.ndarray
    match_len: int = 0

    @property
    def num_nodes(self) -> int:
        return int(self.token_ids.shape[0])

    def path_scores(self) -> np.ndarray:
        """Path probability of every node (product of ``probs`` from the root)."""
        # one kernel signature whatever the caller's dtypes (float32 probs were promoted to float64 inside anyway)
        return _path_scores(np.ascontiguousarray(self.parents, np.int32), np.ascontiguousarray(self.probs, np.float64))

    def depths(self) -> np.ndarray:
        d: list[int] = []  # a Python list: NumPy element access cost twice as much
        for p in self.parents.tolist():
            d.append(1 if p < 0 else d[p] + 1)
        return np.array(d, np.int32)

    def paths(self) -> list[list[int]]:
        """Token path from the root to each node."""
        out: list[list[int]] = []
        toks = self.token_ids.tolist()
        for i, p in enumerate(self.parents.tolist()):
            out.append((out[p] if p >= 0 else []) + [toks[i]])
        return out


def empty_tree(match_len: int = 0) -> RetrievedTree:
    return RetrievedTree(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32), match_len)


# --- binary max-heap of candidate ids, ordered by score then by push order (earlier first) -----------------------
@njit(cache=True, inline="always")
def _better(score, a, b):
    return score[a] > score[b] or (score[a] == score[b] and a < b)


@njit(cache=True)
def _heap_push(heap, size, score, item):
    i = size
    heap[i] = item
    while i > 0:
        p = (i - 1) >> 1
        if _better(score, heap[i], heap[p]):
            heap[i], heap[p] = heap[p], heap[i]
            i = p
        else:
            break
    return size + 1


@njit(cache=True)
def _heap_pop(heap, size, score):
    top = heap[0]
    size -= 1
    heap[0] = heap[size]
    i = 0
    while True:
        left = 2 * i + 1
        if left >= size:
            break
        best = left
        if left + 1 < size and _better(score, heap[left + 1], heap[left]):
            best = left + 1
        if _better(score, heap[best], heap[i]):
            heap[i], heap[best] = heap[best], heap[i]
            i = best
        else:
            break
    return top, size


@njit(cache=True)
def _path_scores(parents, probs):
    out = np.empty(parents.shape[0], np.float64)
    for i in range(parents.shape[0]):
        p = parents[i]
        out[i] = probs[i] * (out[p] if p >= 0 else 1.0)
    return out


# --- extraction from a count graph --------------------------------------------------------------------------------
@njit(cache=True)
def _push_children(states, edges, node, out_idx, depth, score, remaining, min_prob, min_score,
                   top_cnt, top_edge, c_score, c_prob, c_parent, c_node, c_tok, c_depth, n_cand, heap, heap_size):
    """Push the ``remaining`` most frequent children of ``node`` (only they can still fit in the tree)."""
    # One pass: total count of all children (separators included: a document end is a real outcome) and a min-heap
    # of the top ``remaining`` children by count (ties keep the earlier edge).
    total = 0
    k = 0
    e = states[node, S_FIRST]
    while e >= 0:
        child = edges[e, E_TO]
        c = states[child, S_CNT]
        total += c
        if edges[e, E_TOK] != SEP:
            if k < remaining:
                i = k
                k += 1
                top_cnt[i] = c
                top_edge[i] = e
                while i > 0:  # sift up (min-heap on count)
                    p = (i - 1) >> 1
                    if top_cnt[i] < top_cnt[p]:
                        top_cnt[i], top_cnt[p] = top_cnt[p], top_cnt[i]
                        top_edge[i], top_edge[p] = top_edge[p], top_edge[i]
                        i = p
                    else:
                        break
            elif c > top_cnt[0]:
                top_cnt[0] = c
                top_edge[0] = e
                i = 0
                while True:  # sift down
                    left = 2 * i + 1
                    if left >= k:
                        break
                    m = left
                    if left + 1 < k and top_cnt[left + 1] < top_cnt[left]:
                        m = left + 1
                    if top_cnt[m] < top_cnt[i]:
                        top_cnt[i], top_cnt[m] = top_cnt[m], top_cnt[i]
                        top_edge[i], top_edge[m] = top_edge[m], top_edge[i]
                        i = m
                    else:
                        break
        e = edges[e, E_NEXT]
    if total <= 0:
        return n_cand, heap_size
    # Push the kept children (their order only breaks ties between equal path probabilities, deterministically).
    for j in range(k):
        e = top_edge[j]
        prob = top_cnt[j] / total
        s = score * prob
        if prob < min_prob or s < min_score:
            continue
        c_score[n_cand] = s
        c_prob[n_cand] = prob
        c_parent[n_cand] = out_idx
        c_node[n_cand] = edges[e, E_TO]
        c_tok[n_cand] = edges[e, E_TOK]
        c_depth[n_cand] = depth + 1
        heap_size = _heap_push(heap, heap_size, c_score, n_cand)
        n_cand += 1
    return n_cand, heap_size


@njit(cache=True)
def extract_tree(states, edges, root, budget, max_depth, min_prob, min_score):
    """Best-first tree of at most ``budget`` nodes and ``max_depth`` levels below ``root`` of a count graph.

    A child is kept only if its empirical probability is >= ``min_prob`` and its path probability >= ``min_score``.
    Returns ``(token_ids int64, parents int32, probs float32)``.
    """
    if budget <= 0 or max_depth <= 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32)
    cap = budget
    for i in range(budget):
        cap += budget - i - 1
    c_score = np.empty(cap, np.float64)
    c_prob = np.empty(cap, np.float32)
    c_parent = np.empty(cap, np.int32)
    c_node = np.empty(cap, np.int64)
    c_tok = np.empty(cap, np.int64)
    c_depth = np.empty(cap, np.int32)
    heap = np.empty(cap, np.int32)
    top_cnt = np.empty(budget, np.int64)
    top_edge = np.empty(budget, np.int64)
    out_tok = np.empty(budget, np.int64)
    out_par = np.empty(budget, np.int32)
    out_prob = np.empty(budget, np.float32)

    n_cand, heap_size = _push_children(states, edges, root, -1, 0, 1.0, budget, min_prob, min_score, top_cnt,
                                       top_edge, c_score, c_prob, c_parent, c_node, c_tok, c_depth, 0, heap, 0)
    n = 0
    while n < budget and heap_size > 0:
        c, heap_size = _heap_pop(heap, heap_size, c_score)
        out_tok[n] = c_tok[c]
        out_par[n] = c_parent[c]
        out_prob[n] = c_prob[c]
        n += 1
        if c_depth[c] < max_depth and n < budget:
            n_cand, heap_size = _push_children(states, edges, c_node[c], n - 1, c_depth[c], c_score[c], budget - n,
                                               min_prob, min_score, top_cnt, top_edge, c_score, c_prob, c_parent,
                                               c_node, c_tok, c_depth, n_cand, heap, heap_size)
    return out_tok[:n].copy(), out_par[:n].copy(), out_prob[:n].copy()


# --- merging trees of several sources ---------------------------------------------------------------------------
@njit(cache=True)
def _union_kernel(tok, par, prob, offsets, attach):
    """Union trie of the trees ``[offsets[s], offsets[s+1])``, added in order; tree ``s`` continues the trie node of
    input node ``attach[s]`` (-1 = the root). A node's score is the highest any tree gives its path: the tree's path
    probability times the score its attachment node has when the tree is added. Returns the trie (node 0 = the root;
    tokens, parents, scores, the input node whose path gave each score (the first on ties), children lists) and the
    trie node of every input node."""
    total = tok.shape[0]
    # trie node 0 is the root; node i > 0 has token m_tok[i], parent m_par[i] (trie index) and children lists
    m_tok = np.empty(total + 1, np.int64)
    m_par = np.empty(total + 1, np.int64)
    m_score = np.zeros(total + 1, np.float64)
    m_from = np.full(total + 1, -1, np.int64)
    m_first = np.full(total + 1, -1, np.int64)
    m_next = np.full(total + 1, -1, np.int64)
    m_score[0] = 1.0
    n_nodes = 1
    node_of = np.empty(total, np.int64)  # input node -> trie node
    own = np.empty(total, np.float64)  # input node -> its path probability within its own tree
    for s in range(offsets.shape[0] - 1):
        base = offsets[s]
        root = 0 if attach[s] < 0 else node_of[attach[s]]
        root_score = m_score[root]
        for j in range(base, offsets[s + 1]):
            p = par[j]
            parent = root if p < 0 else node_of[base + p]
            own[j] = prob[j] * (1.0 if p < 0 else own[base + p])
            score = own[j] * root_score
            child = m_first[parent]
            while child >= 0 and m_tok[child] != tok[j]:
                child = m_next[child]
            if child < 0:
                child = n_nodes
                n_nodes += 1
                m_tok[child] = tok[j]
                m_par[child] = parent
                m_next[child] = m_first[parent]
                m_first[parent] = child
                m_from[child] = j
            if score > m_score[child]:
                m_score[child] = score
                m_from[child] = j
            node_of[j] = child
    return m_tok[:n_nodes], m_par[:n_nodes], m_score[:n_nodes], m_from[:n_nodes], m_first, m_next, node_of


@njit(cache=True)
def _merge_kernel(tok, par, prob, offsets, budget):
    """Union trie of the trees ``[offsets[s], offsets[s+1])``, all continuing the root (:func:`_union_kernel`).
    Returns the best-first top ``budget`` nodes with probs = score / parent score."""
    m_tok, m_par, m_score, _, m_first, m_next, _ = _union_kernel(tok, par, prob, offsets,
                                                                 np.full(offsets.shape[0] - 1, -1, np.int64))
    n_nodes = m_tok.shape[0]
    # best-first over the trie; the max of monotone path scores is monotone, so parents always come first
    out_tok = np.empty(budget, np.int64)
    out_par = np.empty(budget, np.int32)
    out_prob = np.empty(budget, np.float32)
    out_of = np.empty(n_nodes, np.int32)  # trie node -> output index
    heap = np.empty(n_nodes, np.int32)
    # candidate ids are trie ids; order ties by trie id (= first appearance), so key = score
    heap_size = 0
    c = m_first[0]
    while c >= 0:
        heap_size = _heap_push(heap, heap_size, m_score, c)
        c = m_next[c]
    n = 0
    while n < budget and heap_size > 0:
        c, heap_size = _heap_pop(heap, heap_size, m_score)
        parent = m_par[c]
        out_tok[n] = m_tok[c]
        out_par[n] = -1 if parent == 0 else out_of[parent]
        out_prob[n] = m_score[c] / m_score[parent]
        out_of[c] = n
        n += 1
        ch = m_first[c]
        while ch >= 0:
            heap_size = _heap_push(heap, heap_size, m_score, ch)
            ch = m_next[ch]
    return out_tok[:n].copy(), out_par[:n].copy(), out_prob[:n].copy()


def merge_trees(trees: Sequence[RetrievedTree], budget: int) -> RetrievedTree:
    """Merge trees that continue the same context into one tree of at most ``budget`` nodes.

    Identical paths are shared; each node keeps the highest path probability any source gives it, and the result is
    the best-first top ``budget`` of the union. ``match_len`` is the longest of the inputs.
    """
    trees = [t for t in trees if t.num_nodes]
    if not trees:
        return empty_tree()
    match_len = max(t.match_len for t in trees)
    if len(trees) == 1 and trees[0].num_nodes <= budget:
        return trees[0]._replace(match_len=match_len)
    offsets = np.zeros(len(trees) + 1, np.int64)
    offsets[1:] = np.cumsum([t.num_nodes for t in trees])
    tok, par, prob = _merge_kernel(np.concatenate([t.token_ids for t in trees]),
                                   np.concatenate([t.parents for t in trees]),
                                   np.concatenate([t.probs for t in trees]), offsets, int(budget))
    return RetrievedTree(tok, par, prob, match_len)


class TreeUnion(NamedTuple):
    """The union of several trees (:func:`union_trees`): node ``i`` has token ``token_ids[i]``, parent ``parents[i]``
    (-1 = the root; nodes are numbered in order of first appearance, so parents come first) and ``scores[i]``, the
    highest path probability any input gives it. ``origin[i]`` is the input node whose path gave that score (an index
    into the inputs' nodes, concatenated); ``node_of[j]`` is the union node of input node ``j``."""

    token_ids: np.ndarray
    parents: np.ndarray
    scores: np.ndarray
    origin: np.ndarray
    node_of: np.ndarray


def union_trees(trees: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], attach: Sequence[int]) -> TreeUnion:
    """Merge trees given as ``(token_ids, parents, probs)`` (topological order, ``probs`` = P(token | parent's path))
    into one, identical paths shared, without choosing nodes (:func:`merge_trees` chooses the best-first top).

    Tree ``s`` continues input node ``attach[s]`` of an earlier tree (an index into the inputs' nodes, concatenated;
    -1 = the root): its path probabilities are scaled by that node's score when it is added.
    """
    offsets = np.zeros(len(trees) + 1, np.int64)
    offsets[1:] = np.cumsum([len(t[0]) for t in trees])
    attach = np.asarray(attach, np.int64).reshape(-1)
    if attach.shape[0] != len(trees) or np.any(attach >= offsets[:-1]):
        raise ValueError(f"union_trees: each tree attaches under a node of an earlier tree or at -1 (the root), got "
                         f"{attach.tolist()}")
    # one kernel signature whatever the callers' dtypes
    tok, par, prob = (np.concatenate([np.asarray(t[k], dtype) for t in trees]) if trees else np.zeros(0, dtype)
                      for k, dtype in enumerate((np.int64, np.int64, np.float64)))
    m_tok, m_par, m_score, m_from, _, _, node_of = _union_kernel(tok, par, prob, offsets, attach)
    return TreeUnion(m_tok[1:], m_par[1:] - 1, m_score[1:], m_from[1:], node_of - 1)
