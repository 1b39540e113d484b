"""Batched tree layout: depth positions, ancestor masks and greedy tree acceptance.

Knows nothing about proposers or attention backends. A batch of trees is given as flat arrays (``parents`` of every
request's nodes concatenated, ``node_offsets`` = prefix sums of node counts); request r verifies ``W_r = 1 + N_r``
query rows: row 0 is the root (the last committed token), row ``1 + i`` is node ``i``. Kernels are Numba-jitted and
loop over nodes in compiled code, never in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from vllm_treespec.api import DraftTree


@numba.njit(cache=True)
def _layout_kernel(parents, node_offsets, width, depth_out, mask_out):
    num_reqs = node_offsets.size - 1
    for r in range(num_reqs):
        start = node_offsets[r]
        n = node_offsets[r + 1] - start
        mask_out[r, 0, 0] = True
        for i in range(n):
            w = i + 1
            p = parents[start + i] + 1  # row of the parent, 0 = root
            depth_out[start + i] = depth_out[start + p - 1] + 1 if p > 0 else 1
            for v in range(w):
                mask_out[r, w, v] = mask_out[r, p, v]
            mask_out[r, w, w] = True
        for w in range(n + 1, width):  # padding rows see the root only, so softmax stays finite
            mask_out[r, w, 0] = True


def tree_layout(parents: np.ndarray, node_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depth of every node (1 = child of the root) and the ``[R, W, W]`` ancestor-or-self mask of each request."""
    num_nodes = np.diff(node_offsets)
    width = int(num_nodes.max()) + 1 if num_nodes.size else 1
    depth = np.zeros(parents.size, np.int32)
    mask = np.zeros((node_offsets.size - 1, width, width), np.bool_)
    _layout_kernel(parents.astype(np.int32, copy=False), node_offsets.astype(np.int64, copy=False), width, depth, mask)
    return depth, mask


@numba.njit(cache=True)
def _greedy_accept_kernel(tokens, parents, depth, node_offsets, row_offsets, argmax, out_tokens, out_nodes, out_len):
    num_reqs = node_offsets.size - 1
    for r in range(num_reqs):
        start = node_offsets[r]
        n = node_offsets[r + 1] - start
        base = row_offsets[r]
        accepted = np.zeros(n + 1, np.bool_)
        accepted[0] = True
        best = 0
        best_depth = 0
        for i in range(n):
            p = parents[start + i] + 1
            if accepted[p] and tokens[start + i] == argmax[base + p]:
                accepted[i + 1] = True
                if depth[start + i] > best_depth:  # strict: the first node in BFS order wins ties
                    best_depth = depth[start + i]
                    best = i + 1
        # Walk back from the deepest accepted node to the root.
        w = best
        k = best_depth
        while w > 0:
            k -= 1
            out_nodes[r, k] = w - 1
            out_tokens[r, k] = tokens[start + w - 1]
            w = parents[start + w - 1] + 1
        out_tokens[r, best_depth] = argmax[base + best]
        out_len[r] = best_depth


def greedy_accept(tokens: np.ndarray, parents: np.ndarray, depth: np.ndarray, node_offsets: np.ndarray,
                  row_offsets: np.ndarray, argmax: np.ndarray, max_len: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy tree acceptance for a batch.

    A node is accepted iff its token is the target's argmax at its parent's row and its parent is accepted; the
    deepest accepted node (first in BFS order on ties) ends the committed path, and the bonus token is the argmax
    at its row. ``argmax[row_offsets[r] + w]`` is the target's argmax at query row w of request r.

    Returns (out_tokens ``[R, max_len + 1]`` in vLLM's chain form, path tokens then bonus, padded with -1;
    out_nodes ``[R, max_len]`` node indices of the path, padded with -1; out_len ``[R]`` accepted count).
    """
    num_reqs = node_offsets.size - 1
    out_tokens = np.full((num_reqs, max_len + 1), -1, np.int64)
    out_nodes = np.full((num_reqs, max_len), -1, np.int64)
    out_len = np.zeros(num_reqs, np.int64)
    _greedy_accept_kernel(tokens.astype(np.int64, copy=False), parents.astype(np.int32, copy=False),
                          depth.astype(np.int32, copy=False), node_offsets.astype(np.int64, copy=False),
                          row_offsets.astype(np.int64, copy=False), argmax.astype(np.int64, copy=False),
                          out_tokens, out_nodes, out_len)
    return out_tokens, out_nodes, out_len


@dataclass
class TreeBatch:
    """The trees verified in one step, in batch-row order, with their layout."""

    rows: np.ndarray  # [R] batch row of each tree request
    req_ids: list[str]
    trees: list[DraftTree]
    query_start: np.ndarray  # [R] index of the root row in the flattened query
    context_len: np.ndarray  # [R] committed tokens before the root (the root sits at position context_len)
    node_offsets: np.ndarray  # [R + 1]
    tokens: np.ndarray  # [sum N] flat node tokens
    parents: np.ndarray  # [sum N] flat parents (-1 = root)
    depth: np.ndarray  # [sum N]
    mask: np.ndarray  # [R, W, W] ancestor-or-self mask over query rows

    @classmethod
    def build(cls, rows, req_ids, trees, query_start, context_len) -> TreeBatch:
        sizes = np.fromiter((t.num_nodes for t in trees), np.int64, len(trees))
        node_offsets = np.zeros(len(trees) + 1, np.int64)
        np.cumsum(sizes, out=node_offsets[1:])
        tokens = np.concatenate([t.token_ids for t in trees]) if trees else np.zeros(0, np.int64)
        parents = np.concatenate([t.parents for t in trees]) if trees else np.zeros(0, np.int32)
        depth, mask = tree_layout(parents, node_offsets)
        return cls(np.asarray(rows, np.int64), list(req_ids), list(trees), np.asarray(query_start, np.int64),
                   np.asarray(context_len, np.int64), node_offsets, tokens, parents, depth, mask)

    @property
    def num_reqs(self) -> int:
        return len(self.trees)

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def node_token_index(self) -> np.ndarray:
        """Flattened-query index of every node (root rows excluded)."""
        sizes = np.diff(self.node_offsets)
        return np.repeat(self.query_start + 1, sizes) + (np.arange(self.tokens.size) - np.repeat(self.node_offsets[:-1], sizes))

    def node_positions(self) -> np.ndarray:
        """RoPE position of every node: committed length + depth (the root is at context_len)."""
        return np.repeat(self.context_len, np.diff(self.node_offsets)) + self.depth
