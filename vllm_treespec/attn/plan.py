"""Per-step tree attention plan: which query rows are tree rows, which blocks they read, and their mask.

The runner publishes the step's :class:`~vllm_treespec.tree.TreeBatch` before attention metadata is built; the
backend's builder turns it into one plan per step that every layer reuses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vllm_treespec.tree import TreeBatch

_current: dict = {"batch": None, "plans": {}}
build_seconds = [0.0]  # host time spent building plans (reported by the overhead benchmark)


def publish(batch: TreeBatch | None) -> None:
    _current["batch"] = batch
    _current["plans"] = {}


def current_batch() -> TreeBatch | None:
    return _current["batch"]


@dataclass
class TreeAttentionPlan:
    query_index: torch.Tensor  # [R, W] flattened-query row of each tree row (padding rows repeat the root)
    valid_query_index: torch.Tensor  # [n] flattened-query rows that are real tree rows
    valid_flat: torch.Tensor  # [n] their index in the flattened [R * W] plan
    block_ids: torch.Tensor  # [R, nb] blocks each request reads
    attn_mask: torch.Tensor  # [R, 1, W, nb * block_size] True = may attend


def build_plan(batch: TreeBatch, block_table: torch.Tensor, block_size: int) -> TreeAttentionPlan:
    r, w = batch.num_reqs, batch.width
    num_nodes = torch.from_numpy(batch.node_offsets[1:] - batch.node_offsets[:-1])
    context = torch.from_numpy(batch.context_len)
    start = torch.from_numpy(batch.query_start)
    offsets = torch.arange(w)
    valid = offsets[None, :] <= num_nodes[:, None]  # [R, W]
    query_index = start[:, None] + torch.where(valid, offsets[None, :], 0)
    num_blocks = min(int((context + w).max() + block_size - 1) // block_size, block_table.shape[1])
    length = num_blocks * block_size
    rows = torch.from_numpy(batch.rows)
    block_ids = block_table[rows, :num_blocks].to(torch.int64)
    # Committed context is visible to every row; the tree part follows the ancestor mask.
    mask = torch.zeros(r, w, length + w, dtype=torch.bool)
    mask[:, :, :length] = (torch.arange(length)[None, :] < context[:, None])[:, None, :]
    tree_cols = (context[:, None] + offsets[None, :]).unsqueeze(1).expand(r, w, w)
    mask.scatter_(2, tree_cols, torch.from_numpy(batch.mask))
    flat_valid = valid.reshape(-1)
    return TreeAttentionPlan(
        query_index=query_index,
        valid_query_index=query_index.reshape(-1)[flat_valid],
        valid_flat=torch.nonzero(flat_valid).squeeze(1),
        block_ids=block_ids,
        attn_mask=mask[:, None, :, :length],
    )


def current_plan(block_size: int, common_attn_metadata) -> TreeAttentionPlan | None:
    batch = _current["batch"]
    if batch is None or batch.num_reqs == 0:
        return None
    plan = _current["plans"].get(block_size)
    if plan is None:
        started = time.perf_counter()
        plan = build_plan(batch, common_attn_metadata.block_table_tensor, block_size)
        _current["plans"][block_size] = plan
        build_seconds[0] += time.perf_counter() - started
    return plan
