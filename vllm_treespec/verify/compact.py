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
    """The moves that turn the accepted paths (``out_nodes[r, :out_len[r]]``) into chains; None if nothing moves."""
    src_pos, dst_pos, rows, src_tok, dst_tok = [], [], [], [], []
    for r in range(batch.num_reqs):
        a = int(out_len[r])
        if a == 0:
            continue
        nodes = out_nodes[r, :a]
        k = np.arange(a)
        moved = nodes != k
        if not moved.any():
            continue
        base = int(batch.context_len[r]) + 1
        src_pos.append(base + nodes[moved])
        dst_pos.append(base + k[moved])
        rows.append(np.full(int(moved.sum()), batch.rows[r]))
        src_tok.append(int(batch.query_start[r]) + 1 + nodes[moved])
        dst_tok.append(int(batch.query_start[r]) + 1 + k[moved])
    if not src_pos:
        return None
    return Moves(np.concatenate(rows), np.concatenate(src_pos), np.concatenate(dst_pos), np.concatenate(src_tok),
                 np.concatenate(dst_tok))


def slots(block_table: np.ndarray, block_size: int, rows: np.ndarray, positions: np.ndarray) -> torch.Tensor:
    """KV slot (block * block_size + offset) of each (batch row, position), from the ``[rows, blocks]`` table."""
    blocks = block_table[rows, positions // block_size]
    return torch.from_numpy(blocks.astype(np.int64) * block_size + positions % block_size)
