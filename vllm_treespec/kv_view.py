"""Read-only view of the target's paged KV cache for proposers that set ``needs_kv_cache`` (e.g. KV-aware drafters).

Valid during one ``propose_trees`` call, after tree acceptance and KV compaction: position p of request i holds the
K/V of its p-th committed token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_treespec.attn import layout


@dataclass
class TargetKVView:
    layer_names: list[str]
    _caches: list[torch.Tensor]
    block_table: np.ndarray  # [max_reqs, max_blocks] (rows follow the ProposeContext rows)
    block_size: int
    num_computed: np.ndarray  # [rows] positions with valid K/V per request

    @property
    def num_layers(self) -> int:
        return len(self._caches)

    def read(self, layer: int, row: int, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``[start, end)`` of request ``row`` in ``layer``, each ``[n, kv_heads, head_dim]``."""
        end = int(self.num_computed[row]) if end is None else end
        if not 0 <= start <= end <= int(self.num_computed[row]):
            raise IndexError(f"positions [{start}, {end}) outside the {int(self.num_computed[row])} cached of row {row}")
        positions = np.arange(start, end)
        blocks = self.block_table[row, positions // self.block_size].astype(np.int64)
        slots = torch.from_numpy(blocks * self.block_size + positions % self.block_size)
        return layout.read_slots(self._caches[layer], slots)


def build_view(runner: Any, layers: list[Any], num_reqs: int, sampled_token_ids: list[list[int]] | None = None,
               query_start_loc: Any = None) -> TargetKVView:
    batch = runner.input_batch
    block_table = batch.block_table[0]
    # After bookkeeping every committed token but the newest (the bonus, not yet run) has K/V in the cache.
    num_computed = np.maximum(batch.num_tokens_no_spec[:num_reqs] - 1, 0).astype(np.int64)
    if sampled_token_ids is not None:
        # A prefill chunk that is not the last samples nothing: its K/V reach only as far as this step computed.
        before = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        if query_start_loc is not None:
            this_step = np.diff(np.asarray(query_start_loc[: num_reqs + 1], np.int64))
        else:
            this_step = np.zeros(num_reqs, np.int64)
        partial = np.array([len(s) == 0 for s in sampled_token_ids[:num_reqs]])
        num_computed = np.where(partial, np.minimum(before + this_step, num_computed), num_computed)
    return TargetKVView(
        layer_names=[layer.layer_name for layer in layers],
        _caches=[layer.kv_cache for layer in layers],
        block_table=block_table.block_table.np[:num_reqs],
        block_size=block_table.block_size,
        num_computed=num_computed,
    )
