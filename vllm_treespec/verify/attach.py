"""Trees to the scheduler's drafts and back.

Before scheduling, every tree is truncated to the verify budget and flattened: the scheduler sees its nodes as an
ordinary list of drafts. A tree is kept for re-attachment only where the request may verify as a tree; elsewhere it
degrades to the chain that follows the first child. After ``_prepare_inputs`` a kept tree is re-attached only if the
scheduled drafts are a prefix of its flattened nodes that is still a tree and its row runs the root plus exactly those
drafts (truncated and placeholder drafts run as chains); its nodes' RoPE positions then become ``context + depth``.

Before all that, nodes no step can commit are cut (:func:`committable_depths`): vLLM's scheduler schedules every
draft, but a request stops at its ``max_tokens`` and at ``max_model_len``, so near its end the deeper drafts would be
verified (and priced by the budget) for nothing.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from vllm_treespec.api import DraftTree, ProposeContext
from vllm_treespec.cost.allocate import trim
from vllm_treespec.tree import TreeBatch


def committable_depths(requests: Any, req_ids: list[str], num_tokens: np.ndarray, num_prompt_tokens: np.ndarray,
                       max_model_len: int) -> np.ndarray:
    """Per request row, the deepest draft the next step can still commit: it commits the accepted drafts plus one
    token of the target, and the request stops at ``max_tokens`` output tokens and at ``max_model_len`` tokens.
    ``num_tokens``: each row's tokens so far, this step's included."""
    n = len(req_ids)
    num_tokens = np.asarray(num_tokens[:n], np.int64)
    depths = max_model_len - num_tokens - 1
    for i, req_id in enumerate(req_ids):
        params = getattr(requests.get(req_id), "sampling_params", None)
        max_tokens = getattr(params, "max_tokens", None)
        if max_tokens is not None:
            outputs = int(num_tokens[i]) - int(num_prompt_tokens[i])
            depths[i] = min(depths[i], int(max_tokens) - outputs - 1)
    return np.maximum(depths, 0)


def cut_to_depth(tree: DraftTree | None, max_depth: int) -> DraftTree | None:
    """The tree without its nodes deeper than ``max_depth`` (None when nothing is left)."""
    if tree is None or tree.num_nodes == 0:
        return tree
    if max_depth <= 0:
        return None
    depths = tree.depths()
    if int(depths.max()) <= max_depth:
        return tree
    return trim(tree, depths <= max_depth)


def flatten_trees(ctx: ProposeContext, trees: list[DraftTree | None], can_use_tree: Callable[[str], bool]
                  ) -> tuple[list[list[int]], dict[str, DraftTree]]:
    """The drafts to hand vLLM (one list per row of ``ctx``) and the trees to re-attach, by request id."""
    drafts: list[list[int]] = []
    pending: dict[str, DraftTree] = {}
    for i, (req_id, tree) in enumerate(zip(ctx.req_ids, trees)):
        if tree is None or tree.num_nodes == 0 or not ctx.needs_draft(i):
            drafts.append([])
            continue
        if tree.num_nodes > ctx.max_nodes:
            tree = tree.truncate(ctx.max_nodes)
        if not tree.is_chain():
            if can_use_tree(req_id):
                pending[req_id] = tree
            else:
                tree = tree.first_child_chain()
        drafts.append(tree.token_ids.tolist())
    return drafts, pending


def match_scheduled(pending: dict[str, DraftTree], scheduled_spec_decode_tokens: dict[str, list[int]],
                    req_id_to_index: dict[str, int], num_scheduled_tokens: np.ndarray
                    ) -> list[tuple[int, str, DraftTree]]:
    """(batch row, request id, the tree cut to its scheduled drafts) of every request that verifies as a tree this
    step, in batch-row order."""
    found = []
    for req_id, spec_tokens in scheduled_spec_decode_tokens.items():
        tree = pending.get(req_id)
        n = len(spec_tokens)
        if tree is None or n == 0 or n > tree.num_nodes:
            continue
        if not np.array_equal(tree.token_ids[:n], np.asarray(spec_tokens, dtype=np.int64)):
            continue
        if n < tree.num_nodes:  # pending trees are not chains; a prefix of one may be
            tree = tree.truncate(n)
            if tree.is_chain():
                continue
        row = req_id_to_index[req_id]
        if int(num_scheduled_tokens[row]) != n + 1:
            continue
        found.append((row, req_id, tree))
    found.sort(key=lambda x: x[0])
    return found


def build_batch(found: list[tuple[int, str, DraftTree]], query_start_loc: Any, num_computed_tokens: Any) -> TreeBatch:
    """The step's :class:`TreeBatch` from :func:`match_scheduled`'s rows (root row = the row's first query row,
    context = its tokens computed before this step)."""
    rows = np.array([f[0] for f in found], np.int64)
    return TreeBatch.build(rows, [f[1] for f in found], [f[2] for f in found], query_start_loc[rows],
                           num_computed_tokens[rows])


def rewrite_positions(positions: torch.Tensor, batch: TreeBatch) -> None:
    """Nodes' RoPE positions to context + depth, in place. Slots stay linear (already computed)."""
    positions[torch.from_numpy(batch.node_token_index()).to(positions.device)] = (
        torch.from_numpy(batch.node_positions()).to(positions.device, positions.dtype))
