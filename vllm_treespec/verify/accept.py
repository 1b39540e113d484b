"""Acceptance glue: the tree rows' logits in, vLLM's chain form out.

vLLM lays out one logits row per sampled position (``num_draft_tokens + 1`` per batch row); a tree request's
``1 + N`` rows are its root and its nodes. Greedy requests accept with :func:`vllm_treespec.tree.greedy_accept` (the
longest path whose every node is the target's argmax at its parent), the others with lossless recursive rejection
sampling (:func:`vllm_treespec.sampling.sample_accept`) on vLLM's own temperature / top-k / top-p. The result is
written into the sampler's output in chain form: path tokens, then the bonus token, padded with -1.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_treespec.api import VerificationResult
from vllm_treespec.sampling import sample_accept
from vllm_treespec.tree import TreeBatch, greedy_accept


def logits_rows(batch: TreeBatch, num_draft_tokens: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logits row of every tree query row, first of them per tree request in that list, ``1 + N`` per request)."""
    num_sampled = np.asarray(num_draft_tokens, np.int64) + 1
    row_start = np.cumsum(num_sampled) - num_sampled  # first logits row of each batch row
    widths = np.diff(batch.node_offsets) + 1
    row_offsets = np.cumsum(widths) - widths
    index = np.repeat(row_start[batch.rows], widths) + (np.arange(widths.sum()) - np.repeat(row_offsets, widths))
    return index, row_offsets, widths


def greedy_mask(batch: TreeBatch, requests: dict[str, Any]) -> np.ndarray:
    """Per tree request: does it sample greedily?"""
    from vllm.sampling_params import SamplingType

    return np.array([requests[r].sampling_params.sampling_type == SamplingType.GREEDY for r in batch.req_ids])


def read_logits(logits: torch.Tensor, index: np.ndarray, full: bool) -> tuple[np.ndarray, torch.Tensor | None]:
    """The argmax of the given logits rows, and a float32 copy of the rows when ``full`` (sampling or the proposer
    needs whole distributions). Read before vLLM's sampler runs: it may modify logits in place."""
    index_t = torch.from_numpy(index).to(logits.device)
    if full:
        tree_logits = logits.index_select(0, index_t).to(torch.float32)
        return tree_logits.argmax(dim=-1).cpu().numpy(), tree_logits  # the cast is exact: same argmax, one pass fewer
    return logits.index_select(0, index_t).argmax(dim=-1).cpu().numpy(), None


def accept(batch: TreeBatch, row_offsets: np.ndarray, widths: np.ndarray, argmax: np.ndarray, max_len: int,
           greedy: np.ndarray, tree_logits: torch.Tensor | None, sampling_metadata: Any, num_batch_rows: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Accepted path of every tree request: (tokens ``[R, max_len + 1]`` in chain form, node indices ``[R, max_len]``
    padded with -1, accepted counts ``[R]``). ``tree_logits`` and ``sampling_metadata`` are read only for requests
    that do not sample greedily."""
    out_tokens, out_nodes, out_len = greedy_accept(
        batch.tokens, batch.parents, batch.depth, batch.node_offsets, row_offsets, argmax, max_len)
    if not greedy.all():
        sample_random(batch, ~greedy, tree_logits, row_offsets, widths, sampling_metadata, num_batch_rows,
                      out_tokens, out_nodes, out_len)
    return out_tokens, out_nodes, out_len


def sample_random(batch: TreeBatch, random_mask: np.ndarray, tree_logits: torch.Tensor, row_offsets: np.ndarray,
                  widths: np.ndarray, sampling_metadata: Any, num_batch_rows: int,
                  out_tokens: np.ndarray, out_nodes: np.ndarray, out_len: np.ndarray) -> None:
    """Overwrite the rows of ``random_mask`` with lossless tree sampling."""
    from vllm.v1.sample.rejection_sampler import apply_sampling_constraints

    picked = np.nonzero(random_mask)[0]
    counts = np.zeros(num_batch_rows, np.int64)
    counts[batch.rows[picked]] = widths[picked]
    index = np.concatenate([np.arange(row_offsets[r], row_offsets[r] + widths[r]) for r in picked])
    # vLLM's own temperature / top-k / top-p, applied to the tree rows of the sampled requests (batch-row order).
    processed = apply_sampling_constraints(tree_logits[torch.from_numpy(index)].clone(),
                                           torch.from_numpy(np.cumsum(counts)).to(tree_logits.device, torch.int32),
                                           sampling_metadata)
    probs = processed.softmax(dim=-1)
    offset = 0
    for r in picked:
        start, end = batch.node_offsets[r], batch.node_offsets[r + 1]
        path, token = sample_accept(batch.tokens[start:end], batch.parents[start:end],
                                    probs[offset: offset + widths[r]])
        offset += widths[r]
        out_tokens[r, :] = -1
        out_nodes[r, :] = -1
        out_tokens[r, : len(path)] = batch.tokens[start + np.asarray(path, np.int64)] if path else []
        out_tokens[r, len(path)] = token
        out_nodes[r, : len(path)] = path
        out_len[r] = len(path)


def write_chain_form(sampled_token_ids: torch.Tensor, batch: TreeBatch, out_tokens: np.ndarray) -> None:
    """Replace the tree requests' rows of the sampler's ``[batch rows, max_len + 1]`` output, in place."""
    sampled_token_ids[torch.from_numpy(batch.rows).to(sampled_token_ids.device)] = torch.from_numpy(out_tokens).to(
        sampled_token_ids.device, sampled_token_ids.dtype)


def verification_results(batch: TreeBatch, out_tokens: np.ndarray, out_nodes: np.ndarray, out_len: np.ndarray,
                         tree_logits: torch.Tensor | None, row_offsets: np.ndarray, widths: np.ndarray,
                         want_logits: bool) -> list[VerificationResult]:
    """What ``TreeProposer.on_verified`` receives (with target logits if ``want_logits``)."""
    results = []
    for r in range(batch.num_reqs):
        a = int(out_len[r])
        logits_rows = tree_logits[row_offsets[r]: row_offsets[r] + widths[r]] if want_logits else None
        results.append(VerificationResult(batch.req_ids[r], batch.trees[r], out_nodes[r, :a].tolist(),
                                          int(out_tokens[r, a]), logits_rows))
    return results
