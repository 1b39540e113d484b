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


def first_logits_rows(num_draft_tokens: Any) -> np.ndarray:
    """Per batch row, its first logits row (vLLM lays out ``num_draft_tokens + 1`` rows per batch row)."""
    num_sampled = np.asarray(num_draft_tokens, np.int64) + 1
    return np.cumsum(num_sampled) - num_sampled


def logits_rows(batch: TreeBatch, num_draft_tokens: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logits row of every tree query row, first of them per tree request in that list, ``1 + N`` per request)."""
    row_start = first_logits_rows(num_draft_tokens)
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


def chains_the_verifier_accepts(num_draft_tokens: Any, tree_rows: np.ndarray, req_ids: list[str],
                                requests: dict[str, Any], sampling_metadata: Any) -> np.ndarray | None:
    """The batch rows whose drafts are chains (drafted rows that are not ``tree_rows``), when the verifier can
    accept the whole step itself: every request of the step has parameters a tree could take (vLLM's rejection
    sampler applies nothing to draft rows then: no penalties, bad words, allowed tokens, min_tokens, logprobs),
    no thinking budget is tracked, and every chain samples greedily (:func:`accept_chains` then gives what vLLM's
    greedy rejection sampler would). None otherwise: vLLM verifies the step."""
    from vllm.sampling_params import SamplingType

    from vllm_treespec.verify.support import tree_unsupported_reason

    holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        return None
    trees = set(tree_rows.tolist())  # a set and a Python loop: NumPy's per-call cost exceeded the work at 1-16 rows
    chains = []
    for row, drafted in enumerate(num_draft_tokens):
        params = getattr(requests.get(req_ids[row]), "sampling_params", None)
        if params is None or tree_unsupported_reason(params) is not None:
            return None
        if drafted and row not in trees:
            if params.sampling_type != SamplingType.GREEDY:
                return None
            chains.append(row)
    return np.array(chains, dtype=np.int64)


def chain_target_rows(num_draft_tokens: Any, rows: np.ndarray) -> np.ndarray:
    """The logits rows of the drafts of ``rows`` (each chain's target rows, without its bonus row), in order."""
    num_draft = np.asarray(num_draft_tokens, np.int64)
    first = first_logits_rows(num_draft)
    return np.concatenate([np.arange(first[r], first[r] + num_draft[r]) for r in rows.tolist()] or
                          [np.zeros(0, np.int64)])


def accept_chains(sampled_token_ids: torch.Tensor, rows: np.ndarray, num_draft_tokens: Any, draft_token_ids: Any,
                  argmax: np.ndarray) -> None:
    """vLLM's greedy chain acceptance of ``rows``, in place: each row's drafts up to the first one that is not the
    target's argmax (``argmax``: at :func:`chain_target_rows`), then that argmax, or the bonus token vLLM sampled
    (column 0 of a step sampled by :func:`sample_bonus_rows`) when every draft holds; padded with -1."""
    if rows.size == 0:
        return
    num_draft = np.asarray(num_draft_tokens, np.int64)
    draft_start = np.cumsum(num_draft) - num_draft
    drafts = np.asarray(draft_token_ids.cpu().numpy() if isinstance(draft_token_ids, torch.Tensor)
                        else draft_token_ids, np.int64)
    bonus = sampled_token_ids[torch.from_numpy(rows).to(sampled_token_ids.device), 0].cpu().numpy()
    chains = np.full((rows.size, sampled_token_ids.shape[1]), -1, np.int64)
    offset = 0
    for j, r in enumerate(rows.tolist()):
        n = int(num_draft[r])
        draft, target = drafts[draft_start[r]: draft_start[r] + n], argmax[offset: offset + n]
        offset += n
        holds = draft == target
        held = n if holds.all() else int(np.argmin(holds))
        chains[j, :held] = draft[:held]
        chains[j, held] = target[held] if held < n else bonus[j]
    sampled_token_ids[torch.from_numpy(rows).to(sampled_token_ids.device)] = torch.from_numpy(chains).to(
        sampled_token_ids.device, sampled_token_ids.dtype)


def sample_bonus_rows(sample: Any, logits: torch.Tensor, metadata: Any) -> Any:
    """What vLLM's rejection sampler returns for a step whose drafts the verifier accepts itself, from vLLM's plain
    sampler (``sample(logits, None)``) on each request's bonus row: that row's token in column 0, placeholders (-1)
    up to the step's width ``max_spec_len + 1``. Where every drafted request is a tree request or a greedy chain
    (:func:`chains_the_verifier_accepts`), the rejection sampler's float32 copy, clone and argmax of every draft row
    (~140 ms for 16 requests' 32-node trees on one CPU thread) would be thrown away, and even without draft rows its
    fixed work (a logits clone for logprobs it is not asked for, its acceptance kernels) took ~0.43 ms a call at batch
    1 on an AVX-512 CPU against ~0.16 ms for the plain sampler. Such steps ask for no logprobs, penalties, bad words
    or seeds, so the bonus rows sample as vLLM's bonus sampler samples them."""
    output = sample(logits[metadata.bonus_logits_indices], None)
    sampled = output.sampled_token_ids
    widened = torch.full((sampled.shape[0], metadata.max_spec_len + 1), -1, dtype=torch.int32, device=sampled.device)
    widened[:, 0] = sampled[:, 0]
    output.sampled_token_ids = widened
    return output


def write_chain_form(sampled_token_ids: torch.Tensor, batch: TreeBatch, out_tokens: np.ndarray) -> None:
    """Replace the tree requests' rows of the sampler's ``[batch rows, max_len + 1]`` output, in place."""
    sampled_token_ids[torch.from_numpy(batch.rows).to(sampled_token_ids.device)] = torch.from_numpy(out_tokens).to(
        sampled_token_ids.device, sampled_token_ids.dtype)


def verification_results(batch: TreeBatch, out_tokens: np.ndarray, out_nodes: np.ndarray, out_len: np.ndarray,
                         tree_logits: torch.Tensor | None, row_offsets: np.ndarray, widths: np.ndarray,
                         want_logits: bool, topk: tuple[np.ndarray, np.ndarray] | None = None
                         ) -> list[VerificationResult]:
    """What ``TreeProposer.on_verified`` receives (with target logits if ``want_logits``, and each request's rows of
    ``topk``, the tree rows' :func:`~vllm_treespec.verify.topk.target_topk`, if given)."""
    results = []
    for r in range(batch.num_reqs):
        a = int(out_len[r])
        rows = slice(row_offsets[r], row_offsets[r] + widths[r])
        results.append(VerificationResult(batch.req_ids[r], batch.trees[r], out_nodes[r, :a].tolist(),
                                          int(out_tokens[r, a]), tree_logits[rows] if want_logits else None,
                                          (topk[0][rows], topk[1][rows]) if topk is not None else None))
    return results
