"""Per-step tree attention plan: which query rows are tree rows, which blocks they read, and what each row sees.

The runner publishes the step's :class:`~vllm_treespec.tree.TreeBatch` before attention metadata is built; the
backend's builder turns it into one plan per step that every layer reuses. The plan holds what the fast CPU path
(:mod:`vllm_treespec.attn.cpu_kernel`) reads, as numpy arrays; the tensors of the torch path (a padded mask over
copies of the context) are built only if a layer takes that path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
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
    batch: TreeBatch
    block_table: torch.Tensor  # the step's block table (all batch rows)
    block_size: int
    # Fast path, per tree request r (in batch-row order):
    q_start: np.ndarray  # [R] int64, flattened-query row of the root
    num_rows: np.ndarray  # [R] int64, root + nodes
    context_len: np.ndarray  # [R] int64, committed tokens (the root's position)
    block_rows: np.ndarray  # [R, nb] int32, the blocks each request reads (nb covers the longest request)
    ancestors: np.ndarray  # [R, W, W] bool, row i sees tree row j
    kv_tiles: dict = field(default_factory=dict)  # vLLM's KV tile length per request, per layer geometry

    @property
    def num_reqs(self) -> int:
        return self.batch.num_reqs

    @cached_property
    def total_rows(self) -> int:
        """Query rows of all tree requests (a step with no other rows needs no kernel call)."""
        return int(self.num_rows.sum())

    # --- torch path (built on first use) -------------------------------------------------------------------------
    @cached_property
    def _torch_plan(self) -> dict[str, torch.Tensor]:
        started = time.perf_counter()
        batch, block_size = self.batch, self.block_size
        r, w = batch.num_reqs, batch.width
        num_nodes = torch.from_numpy(self.num_rows - 1)
        context = torch.from_numpy(self.context_len)
        start = torch.from_numpy(self.q_start)
        offsets = torch.arange(w)
        valid = offsets[None, :] <= num_nodes[:, None]  # [R, W]
        query_index = start[:, None] + torch.where(valid, offsets[None, :], 0)
        num_blocks = self.block_rows.shape[1]
        length = num_blocks * block_size
        # Committed context is visible to every row; the tree part follows the ancestor mask.
        mask = torch.zeros(r, w, length + w, dtype=torch.bool)
        mask[:, :, :length] = (torch.arange(length)[None, :] < context[:, None])[:, None, :]
        tree_cols = (context[:, None] + offsets[None, :]).unsqueeze(1).expand(r, w, w)
        mask.scatter_(2, tree_cols, torch.from_numpy(self.ancestors))
        flat_valid = valid.reshape(-1)
        plan = {
            "query_index": query_index,  # [R, W] (padding rows repeat the root)
            "valid_query_index": query_index.reshape(-1)[flat_valid],  # [n] real tree rows
            "valid_flat": torch.nonzero(flat_valid).squeeze(1),  # [n] their index in the flattened [R * W] plan
            "block_ids": torch.from_numpy(self.block_rows).to(torch.int64),  # [R, nb]
            "attn_mask": mask[:, None, :, :length],  # [R, 1, W, nb * block_size] True = may attend
        }
        build_seconds[0] += time.perf_counter() - started
        return plan

    @property
    def query_index(self) -> torch.Tensor:
        return self._torch_plan["query_index"]

    @property
    def valid_query_index(self) -> torch.Tensor:
        return self._torch_plan["valid_query_index"]

    @property
    def valid_flat(self) -> torch.Tensor:
        return self._torch_plan["valid_flat"]

    @property
    def block_ids(self) -> torch.Tensor:
        return self._torch_plan["block_ids"]

    @property
    def attn_mask(self) -> torch.Tensor:
        return self._torch_plan["attn_mask"]


def build_plan(batch: TreeBatch, block_table: torch.Tensor, block_size: int) -> TreeAttentionPlan:
    num_rows = (np.diff(batch.node_offsets) + 1).astype(np.int64)
    context = np.asarray(batch.context_len, np.int64)
    num_blocks = min(int((context + num_rows).max() + block_size - 1) // block_size, block_table.shape[1])
    rows = torch.from_numpy(np.asarray(batch.rows, np.int64))
    block_rows = block_table[rows, :num_blocks].to(torch.int32).numpy()
    return TreeAttentionPlan(
        batch=batch,
        block_table=block_table,
        block_size=block_size,
        q_start=np.asarray(batch.query_start, np.int64),
        num_rows=num_rows,
        context_len=context,
        block_rows=np.ascontiguousarray(block_rows),
        ancestors=np.ascontiguousarray(batch.mask),
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
