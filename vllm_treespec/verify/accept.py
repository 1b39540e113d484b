"""Acceptance glue: the tree rows' logits in, vLLM's chain form out.

vLLM lays out one logits row per sampled position (``num_draft_tokens + 1`` per batch row); a tree request's
``1 + N`` rows are its root and its nodes. Greedy requests accept with :func:`vllm_treespec.tree.greedy_accept` (the
longest path whose every node is the target's argmax at its parent), the others with lossless recursive rejection
sampling (:func:`vllm_treespec.sampling.sample_accept`) on vLLM's own temperature / top-k / top-p. The result is
written into the sampler's output in chain form: path tokens, then the bonus token, padded with -1.
"""

from __future__ import annotations

from typing import Any

import numba
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
    if full:
        tree_logits = logits.index_select(0, torch.from_numpy(index).to(logits.device)).to(torch.float32)
        # the cast is exact: same argmax
        return argmax_rows(tree_logits, np.arange(index.size, dtype=np.int64)), tree_logits
    return argmax_rows(logits, index), None


# Bit patterns of +inf (anything above, once the sign is cleared, is a NaN) per dtype the row kernels read.
_INF_BITS = {torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00}
_ARGMAX_CHUNK = 64  # elements per vectorised "is the maximum here" test of the second pass


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _key16(b):
    # sign-magnitude bits -> an int16 ordered as the floats are (-0 sorts just below +0)
    return np.int16(b ^ np.int16((b >> 15) & 0x7FFF))


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _key32(b):
    return np.int32(b ^ np.int32((b >> 31) & 0x7FFFFFFF))


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _argmax16_kernel(bits, index, inf_bits, out):
    n = bits.shape[1]
    inf16 = np.int16(inf_bits)
    for i in range(index.size):
        row = bits[index[i]]
        hi = np.int16(-32768)
        magnitude = np.int16(0)
        for j in range(n):  # integer max/min: vectorised, no float compare
            k = _key16(row[j])
            hi = hi if hi > k else k
            m = np.int16(row[j] & 0x7FFF)
            magnitude = magnitude if magnitude > m else m
        if magnitude > inf16:  # a NaN: torch's argmax returns the first one
            for j in range(n):
                if np.int16(row[j] & 0x7FFF) > inf16:
                    out[i] = j
                    break
            continue
        alt = np.int16(-1) if hi == 0 else hi  # -0 == +0: the first of either
        start = 0
        while start < n:  # the first chunk holding the maximum, then the first position in it
            stop = min(start + _ARGMAX_CHUNK, n)
            hit = False
            for j in range(start, stop):
                k = _key16(row[j])
                hit |= (k == hi) | (k == alt)
            if hit:
                break
            start = stop
        for j in range(start, n):
            k = _key16(row[j])
            if k == hi or k == alt:
                out[i] = j
                break


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _argmax32_kernel(bits, index, inf_bits, out):
    n = bits.shape[1]
    inf32 = np.int32(inf_bits)
    for i in range(index.size):
        row = bits[index[i]]
        hi = np.int32(-2147483648)
        magnitude = np.int32(0)
        for j in range(n):
            k = _key32(row[j])
            hi = hi if hi > k else k
            m = np.int32(row[j] & 0x7FFFFFFF)
            magnitude = magnitude if magnitude > m else m
        if magnitude > inf32:
            for j in range(n):
                if np.int32(row[j] & 0x7FFFFFFF) > inf32:
                    out[i] = j
                    break
            continue
        alt = np.int32(-1) if hi == 0 else hi
        start = 0
        while start < n:
            stop = min(start + _ARGMAX_CHUNK, n)
            hit = False
            for j in range(start, stop):
                k = _key32(row[j])
                hit |= (k == hi) | (k == alt)
            if hit:
                break
            start = stop
        for j in range(start, n):
            k = _key32(row[j])
            if k == hi or k == alt:
                out[i] = j
                break


def argmax_rows(logits: torch.Tensor, index: np.ndarray) -> np.ndarray:
    """``logits[index].argmax(dim=-1)`` as int64 numpy, the same indices as torch's (first maximum; first NaN if
    any). On CPU (fp32, bf16, fp16, rows contiguous) the rows are read in place, as integers ordered like the floats:
    no copy of the rows, and no slow bf16 compare (torch's CPU argmax over bf16 is several times its fp32 time)."""
    index = np.ascontiguousarray(index, dtype=np.int64)
    inf_bits = _INF_BITS.get(logits.dtype)
    if (logits.device.type != "cpu" or inf_bits is None or logits.dim() != 2 or logits.stride(-1) != 1
            or logits.shape[1] == 0):
        return logits.index_select(0, torch.from_numpy(index).to(logits.device)).argmax(dim=-1).cpu().numpy()
    out = np.empty(index.size, np.int64)
    if logits.element_size() == 2:
        _argmax16_kernel(logits.view(torch.int16).numpy(), index, inf_bits, out)
    else:
        _argmax32_kernel(logits.view(torch.int32).numpy(), index, inf_bits, out)
    return out


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
