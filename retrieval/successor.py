"""Top-k successor table: Token Recycling (arXiv 2408.08696) and Graft's retriever (arXiv 2605.20104).

Row ``t`` holds the ``k`` tokens the target found most likely right after token ``t`` and their probabilities,
overwritten online from the target's distributions at verified nodes (``update``). A tree grows from a root token by
following rows: best-first on the product of the stored probabilities, so the rank-0 chain runs deep while lower
ranks stay shallow, and every node's confidence is the stored probability of its rank. Memory is ``vocab * k * 8``
bytes, fixed at construction.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .tree import _heap_pop, _heap_push


@njit(cache=True)
def _update(ids, probs, tokens, topk_ids, topk_probs):
    k = ids.shape[1]
    kk = min(k, topk_ids.shape[1])
    for i in range(tokens.shape[0]):
        t = tokens[i]
        if t < 0 or t >= ids.shape[0]:
            continue
        order = np.argsort(-topk_probs[i])  # rows from a top-k are sorted already; be robust to any order
        for r in range(kk):
            ids[t, r] = topk_ids[i, order[r]]
            probs[t, r] = topk_probs[i, order[r]]
        for r in range(kk, k):
            ids[t, r] = -1
            probs[t, r] = 0.0


@njit(cache=True)
def _tree(ids, probs, root, budget, max_depth, min_prob, min_score):
    k = ids.shape[1]
    cap = budget * (k + 1) + 1
    c_score = np.empty(cap, np.float64)
    c_prob = np.empty(cap, np.float32)
    c_parent = np.empty(cap, np.int32)
    c_tok = np.empty(cap, np.int64)
    c_depth = np.empty(cap, np.int32)
    heap = np.empty(cap, np.int32)
    out_tok = np.empty(budget, np.int64)
    out_par = np.empty(budget, np.int32)
    out_prob = np.empty(budget, np.float32)
    n_cand = 0
    heap_size = 0
    n = 0
    # the root "candidate" is expanded first: token root at depth 0, output index -1, score 1
    tok = root
    out_idx = -1
    depth = 0
    score = 1.0
    while True:
        if 0 <= tok < ids.shape[0] and depth < max_depth:
            for r in range(min(k, budget - n)):
                child = ids[tok, r]
                p = probs[tok, r]
                if child < 0 or p <= 0.0 or p < min_prob or score * p < min_score:
                    continue
                c_score[n_cand] = score * p
                c_prob[n_cand] = p
                c_parent[n_cand] = out_idx
                c_tok[n_cand] = child
                c_depth[n_cand] = depth + 1
                heap_size = _heap_push(heap, heap_size, c_score, n_cand)
                n_cand += 1
        if n >= budget or heap_size == 0:
            break
        c, heap_size = _heap_pop(heap, heap_size, c_score)
        out_tok[n] = c_tok[c]
        out_par[n] = c_parent[c]
        out_prob[n] = c_prob[c]
        tok, out_idx, depth, score = c_tok[c], n, c_depth[c], c_score[c]
        n += 1
    return out_tok[:n].copy(), out_par[:n].copy(), out_prob[:n].copy()


@njit(cache=True)
def _seed_rows(ids, tokens, confidence):
    """The rows ``seed`` writes: for every empty row (no successor yet) whose token ``tokens`` follows by another,
    its most frequent followers there (the ``k`` most, ties by token id) at ``confidence`` times their share."""
    vocab, k = ids.shape
    n = max(tokens.shape[0] - 1, 0)
    keys = np.empty(n, np.int64)
    m = 0
    for j in range(n):
        first, second = tokens[j], tokens[j + 1]
        if 0 <= first < vocab and 0 <= second < (1 << 31) and ids[first, 0] < 0:
            keys[m] = (first << 32) | second  # second < 2^31: sorts by first, then second
            m += 1
    keys = np.sort(keys[:m])
    # distinct (first, second) pairs with their counts, in key order
    pair_keys = np.empty(m, np.int64)
    pair_counts = np.empty(m, np.int64)
    pairs = 0
    for j in range(m):
        if pairs > 0 and pair_keys[pairs - 1] == keys[j]:
            pair_counts[pairs - 1] += 1
        else:
            pair_keys[pairs] = keys[j]
            pair_counts[pairs] = 1
            pairs += 1
    rows = np.empty(pairs, np.int64)
    out_ids = np.full((pairs, k), -1, np.int32)
    out_probs = np.zeros((pairs, k), np.float32)
    r = 0
    start = 0
    while start < pairs:
        first = pair_keys[start] >> 32
        stop = start
        total = 0
        while stop < pairs and (pair_keys[stop] >> 32) == first:
            total += pair_counts[stop]
            stop += 1
        size = stop - start
        order = np.argsort(-pair_counts[start:stop], kind="mergesort")  # most first; stable: ties in token order
        rows[r] = first
        for j in range(min(k, size)):
            q = start + order[j]
            out_ids[r, j] = np.int32(pair_keys[q] & 0xFFFFFFFF)
            out_probs[r, j] = np.float32(confidence * pair_counts[q] / total)
        r += 1
        start = stop
    return rows[:r], out_ids[:r], out_probs[:r]


class SuccessorTable:
    """``vocab_size x k`` table of likely successors; unknown entries are -1 with probability 0."""

    def __init__(self, vocab_size: int, k: int = 8) -> None:
        if vocab_size <= 0 or k <= 0:
            raise ValueError(f"vocab_size and k must be positive, got {vocab_size}, {k}")
        self.ids = np.full((vocab_size, k), -1, np.int32)
        self.probs = np.zeros((vocab_size, k), np.float32)

    @property
    def vocab_size(self) -> int:
        return self.ids.shape[0]

    @property
    def k(self) -> int:
        return self.ids.shape[1]

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.probs.nbytes

    def update(self, tokens, topk_ids, topk_probs) -> None:
        """Row ``tokens[i]`` := the successors ``topk_ids[i]`` with probabilities ``topk_probs[i]`` (any number of
        columns; missing ranks are cleared). Tokens outside the vocabulary are ignored."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64).reshape(-1)
        topk_ids = np.ascontiguousarray(topk_ids, dtype=np.int32).reshape(tokens.shape[0], -1)
        topk_probs = np.ascontiguousarray(topk_probs, dtype=np.float32).reshape(tokens.shape[0], -1)
        _update(self.ids, self.probs, tokens, topk_ids, topk_probs)

    def seed(self, tokens, confidence: float) -> None:
        """Fill the rows still empty of the tokens in ``tokens`` (a committed text) from its bigrams: each token's
        most frequent followers in it, at ``confidence`` times their share of its followers. Rows that hold
        successors already (the target's, or an earlier seed) are kept."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.shape[0] >= 2:
            rows, ids, probs = _seed_rows(self.ids, tokens, float(confidence))
            if rows.shape[0]:
                _update(self.ids, self.probs, rows, ids, probs)

    def row(self, token: int) -> tuple[np.ndarray, np.ndarray]:
        return self.ids[token], self.probs[token]

    def tree(self, root_token: int, budget: int, max_depth: int = 16, min_prob: float = 0.0, min_score: float = 0.0):
        """Best-first tree below ``root_token``: (token_ids int64, parents int32, probs float32)."""
        return _tree(self.ids, self.probs, int(root_token), int(budget), int(max_depth), float(min_prob),
                     float(min_score))
