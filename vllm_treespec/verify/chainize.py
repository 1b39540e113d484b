"""Hidden states of a tree step in chain order, for proposers that read them (``needs_hidden_states``).

After acceptance the accepted nodes' rows are moved to the chain rows (:func:`chainize`), so the rows of request i's
committed tokens are contiguous from its first query row, as after a chain step: the row that produced its newest
token is its last query row minus the drafts it rejected.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch


def chainize(tensors: Sequence[torch.Tensor | None], moves: tuple[np.ndarray, np.ndarray]) -> None:
    """Apply (source rows, destination rows) to per-token tensors in place (None entries are skipped)."""
    src, dst = (torch.from_numpy(m) for m in moves)
    for t in tensors:
        if t is not None:
            t[dst] = t[src]  # advanced indexing gathers first, so overlapping moves are safe


def committed_rows(query_start_loc: Any, num_reqs: int, req_ids: list[str], sampled_token_ids: list[list[int]],
                   scheduled_drafts: dict[str, list[int]] | None) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) chainized row of each request's committed tokens this step. Prefill chunks have no drafts:
    their last row."""
    ends = np.asarray(query_start_loc[1: num_reqs + 1], np.int64) - 1
    drafts = np.array([len((scheduled_drafts or {}).get(r, ())) for r in req_ids], np.int64)
    accepted = np.array([max(len(s) - 1, 0) for s in sampled_token_ids], np.int64)
    return np.asarray(query_start_loc[:num_reqs], np.int64), ends - (drafts - accepted)


def aux_in_asked_order(aux_hidden_states: list[torch.Tensor] | None, layers: Sequence[int]
                       ) -> list[torch.Tensor] | None:
    """The model returns aux hidden states in forward (ascending layer) order; the proposer asked for ``layers``."""
    layers = tuple(layers)
    if aux_hidden_states and layers and len(aux_hidden_states) == len(set(layers)):
        ascending = sorted(set(layers))
        return [aux_hidden_states[ascending.index(layer)] for layer in layers]
    return aux_hidden_states
