"""Which KV-cache slots move after acceptance (the move itself, per layer: :mod:`vllm_treespec.attn.compact`).

Node i of a tree request ran at the linear position ``context + 1 + i``; the k-th node of its accepted path must end at
the chain position ``context + 1 + k``, as if the path had been verified as a chain. Nodes already in place do not
move. The same moves, as flattened-query rows, chainize the step's hidden states (:mod:`.chainize`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_treespec.tree import TreeBatch


@dataclass
class Moves:
    rows: np.ndarray  # [n] batch row of every moved node
    src_positions: np.ndarray  # [n] its position now (context + 1 + node)
    dst_positions: np.ndarray  # [n] its chain position (context + 1 + k)
    src_query_rows: np.ndarray  # [n] the same, as rows of the step's flattened query
    dst_query_rows: np.ndarray  # [n]


def accepted_moves(batch: TreeBatch, out_nodes: np.ndarray, out_len: np.ndarray) -> Moves | None:
    """The moves that turn the accepted paths (``out_nodes[r, :out_len[r]]``) into chains; None if nothing moves.
    Request by request, in path order."""
    out_nodes = np.asarray(out_nodes, np.int64)
    k = np.arange(out_nodes.shape[1], dtype=np.int64)
    moved = (k[None, :] < np.asarray(out_len, np.int64)[:, None]) & (out_nodes != k[None, :])  # [R, max_len]
    if not moved.any():
        return None
    req, step = np.nonzero(moved)  # row-major: request by request, k ascending
    nodes = out_nodes[req, step]
    base = np.asarray(batch.context_len, np.int64)[req] + 1
    first_node_row = np.asarray(batch.query_start, np.int64)[req] + 1
    return Moves(np.asarray(batch.rows, np.int64)[req], base + nodes, base + step, first_node_row + nodes,
                 first_node_row + step)


def slots(block_table: np.ndarray, block_size: int, rows: np.ndarray, positions: np.ndarray) -> torch.Tensor:
    """KV slot (block * block_size + offset) of each (batch row, position), from the ``[rows, blocks]`` table."""
    blocks = block_table[rows, positions // block_size]
    return torch.from_numpy(blocks.astype(np.int64) * block_size + positions % block_size)
