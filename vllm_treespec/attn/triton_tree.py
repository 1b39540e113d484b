"""Paged tree attention in Triton: the tree rows of a verify step, for CUDA backends (and the Triton interpreter).

Request r verifies ``W_r = 1 + N_r`` rows (row 0 = the root, row 1+i = node i) whose K/V sit at the linear cache
positions ``C_r .. C_r + W_r - 1`` after its ``C_r`` committed tokens. Row j attends to every committed position and to
the tree positions ``C_r + i`` of its ancestors-or-self i, given per row as an ancestor bitmask (int32 words, bit i of
word i // 32), so memory grows with ``W^2 / 32`` per request instead of a dense ``[rows x context]`` mask.

One program handles one tile of consecutive tree rows of one request for one KV head, with all the query heads that
share that KV head packed into the tile's M dimension (GQA), so each K/V block is read once per tile. Where those
programs are too few to fill the GPU (one request, long context), the committed context is split over several
programs whose partial results are merged by their log-sum-exp (split-KV, :func:`choose_num_splits`). The cache is
read through the strides of the logical ``[num_blocks, block_size, num_kv_heads, head_dim]`` views of K and V: any
physical layout that can be viewed that way works. Softmax and accumulation are fp32; the kernel also returns the
natural-log log-sum-exp of every (row, head).

Imports only torch, numpy and triton (no vLLM, no numba), so ``scripts/bench_gpu_tree_attention.py`` can run it on a
machine without vLLM. On CPU tensors the kernel needs Triton's interpreter: set ``TRITON_INTERPRET=1`` before triton
is first imported.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

BITS_PER_WORD = 32
DEFAULT_TILE_M = 64  # query (row, head) pairs per program
DEFAULT_BLOCK_N = 64  # keys per inner step


class LaunchConfig(NamedTuple):
    tile_m: int  # query (row, head) pairs per program
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int


#: Measured on an H200 (docs/gpu.md): over 6 shapes the defaults ranked first of 36 configurations, but trees of 64
#: rows at 32k context ran 7-25% faster in 128-pair tiles with 128 keys a step and 8 warps; on 24 other shapes those
#: launches won at 16k context with trees of 48 rows or more and lost up to 1.6x at 2k context or 32 rows
DEFAULT_LAUNCH = LaunchConfig(DEFAULT_TILE_M, DEFAULT_BLOCK_N, 4, 3)
WIDE_TREE_LAUNCH = LaunchConfig(128, 128, 8, 3)
WIDE_TREE_MIN_PAIRS = 192  # (tree row, query head) pairs of the widest tree per KV head: 48 rows of 4 heads
WIDE_TREE_MIN_CONTEXT = 8192  # committed tokens of the longest context
#: split-KV: programs wanted per streaming multiprocessor, fewest context keys a split reads, most splits. Measured on
#: an H200 (docs/gpu.md): splits of 256 keys of a 512-token context cost more (a second launch) than they saved, and
#: a grid of at least one program per multiprocessor gained little or lost from splitting
PROGRAMS_PER_SM = 2
MIN_KEYS_PER_SPLIT = 512
MAX_SPLITS = 64
_LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, block_table_row_ptr, positions, key_valid,
                  visible, kv_head, d, d_valid, block_size, stride_kb, stride_ks, stride_kh, stride_kd,
                  stride_vb, stride_vs, stride_vh, stride_vd, scale_log2,
                  UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr):
    """One online-softmax step over BLOCK_N keys at logical ``positions``; ``visible`` is [BLOCK_M, BLOCK_N]."""
    physical = tl.load(block_table_row_ptr + positions // block_size, mask=key_valid, other=0).to(tl.int64)
    offset = (positions % block_size).to(tl.int64)
    kv_mask = key_valid[:, None] & d_valid[None, :]
    k = tl.load(key_cache_ptr + physical[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh
                + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(value_cache_ptr + physical[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh
                + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE_DOT:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(visible, scores * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _tree_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, output_ptr, lse_ptr,
    row_query_index_ptr, ancestor_words_ptr, request_context_len_ptr, request_block_row_ptr,
    request_row_start_ptr, request_num_rows_ptr, tile_request_ptr, tile_first_row_ptr,
    partial_out_ptr, partial_lse_ptr,
    scale_log2, block_size, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt, stride_ot, stride_oh, stride_od, stride_lr, stride_lh, stride_aw,
    stride_ps, stride_pr, stride_ph, stride_pd, stride_pls, stride_plr, stride_plh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, ROWS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr,
    SPLIT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    request = tl.load(tile_request_ptr + tile)
    first_row = tl.load(tile_first_row_ptr + tile)
    context_len = tl.load(request_context_len_ptr + request)
    num_rows = tl.load(request_num_rows_ptr + request)
    row_start = tl.load(request_row_start_ptr + request)
    block_table_row_ptr = block_table_ptr + tl.load(request_block_row_ptr + request).to(tl.int64) * stride_bt

    # M packs (tree row, query head of this KV head) pairs: m = row_in_tile * GROUP + head_in_group.
    m = tl.arange(0, BLOCK_M)
    local_row = first_row + m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_valid = (m < ROWS_PER_TILE * GROUP) & (local_row < num_rows)
    row = row_start + local_row
    token = tl.load(row_query_index_ptr + row, mask=row_valid, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q = tl.load(query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # A finite floor instead of -inf keeps alpha = exp2(m_old - m_new) defined for rows that have seen no key yet.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)

    # Committed context: visible to every row of the request. Split s reads its own whole BLOCK_N chunks of it.
    chunk = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
    context_start = split * chunk
    context_end = tl.minimum(context_start + chunk, context_len)
    for start in range(context_start, context_end, BLOCK_N):
        positions = start + n
        key_valid = positions < context_end
        visible = row_valid[:, None] & key_valid[None, :]
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, block_table_row_ptr,
                                      positions, key_valid, visible, kv_head, d, d_valid, block_size,
                                      stride_kb, stride_ks, stride_kh, stride_kd,
                                      stride_vb, stride_vs, stride_vh, stride_vd, scale_log2, UPCAST, IEEE_DOT)

    # The tree rows' own K/V (in the last split): row j sees tree row i iff bit i of its ancestor words is set.
    tree_end = tl.where(split == num_splits - 1, num_rows, 0)
    for start in range(0, tree_end, BLOCK_N):
        tree_col = start + n
        col_valid = tree_col < num_rows
        words = tl.load(ancestor_words_ptr + row[:, None].to(tl.int64) * stride_aw + (tree_col // 32)[None, :],
                        mask=row_valid[:, None] & col_valid[None, :], other=0)
        visible = ((words >> (tree_col % 32)[None, :]) & 1) != 0
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, block_table_row_ptr,
                                      context_len + tree_col, col_valid, visible, kv_head, d, d_valid, block_size,
                                      stride_kb, stride_ks, stride_kh, stride_kd,
                                      stride_vb, stride_vs, stride_vh, stride_vd, scale_log2, UPCAST, IEEE_DOT)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = (m_i + tl.log2(l_safe)) / 1.4426950408889634  # a split that saw no key: ~-7e29, weight 0 in the merge
    if SPLIT:
        row64 = row.to(tl.int64)
        tl.store(partial_out_ptr + split * stride_ps + row64[:, None] * stride_pr + head[:, None] * stride_ph
                 + d[None, :] * stride_pd, out, mask=row_valid[:, None] & d_valid[None, :])
        tl.store(partial_lse_ptr + split * stride_pls + row64 * stride_plr + head * stride_plh, lse, mask=row_valid)
    else:
        tl.store(output_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
                 out.to(output_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])
        tl.store(lse_ptr + row.to(tl.int64) * stride_lr + head * stride_lh, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr, partial_lse_ptr, row_query_index_ptr, output_ptr, lse_ptr, num_splits,
    stride_ps, stride_pr, stride_ph, stride_pd, stride_pls, stride_plr, stride_plh,
    stride_ot, stride_oh, stride_od, stride_lr, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One (tree row, head): the splits' normalised outputs weighted by exp(lse_s - lse), lse their log-sum-exp."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_valid = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    lse_s = tl.load(partial_lse_ptr + s * stride_pls + row * stride_plr + head * stride_plh, mask=s_valid,
                    other=float("-inf"))
    lse_max = tl.max(lse_s, 0)
    weight = tl.exp(lse_s - lse_max)
    total = tl.sum(weight, 0)
    parts = tl.load(partial_out_ptr + s[:, None] * stride_ps + row * stride_pr + head * stride_ph
                    + d[None, :] * stride_pd, mask=s_valid[:, None] & d_valid[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / total
    token = tl.load(row_query_index_ptr + row).to(tl.int64)
    tl.store(output_ptr + token * stride_ot + head * stride_oh + d * stride_od, out.to(output_ptr.dtype.element_ty),
             mask=d_valid)
    tl.store(lse_ptr + row * stride_lr + head * stride_lh, lse_max + tl.log(total))


@dataclass
class TreeKernelPlan:
    """Kernel inputs for one step's tree rows, all int32 on the target device (one host-to-device copy).

    Rows are the real tree rows of every request, request by request (padding rows of the ``[R, W, W]`` mask are
    dropped). Tiles split each request's rows into groups of ``rows_per_tile``.
    """

    row_query_index: torch.Tensor  # [n] flattened-query row (query/output index) of each tree row
    row_request: torch.Tensor  # [n] request of each tree row
    ancestor_words: torch.Tensor  # [n, num_words] ancestor-or-self bits over the request's own rows
    request_context_len: torch.Tensor  # [R] committed tokens before the root
    request_block_row: torch.Tensor  # [R] row of the request in the block table
    request_row_start: torch.Tensor  # [R] first tree row of the request
    request_num_rows: torch.Tensor  # [R] W_r
    tile_request: torch.Tensor  # [T]
    tile_first_row: torch.Tensor  # [T] first row of the tile within its request
    rows_per_tile: int
    max_context_len: int = 0  # the longest committed context (host side: split-KV's choice needs it)
    launch: LaunchConfig = field(default=DEFAULT_LAUNCH)  # block_n, warps and stages of the main kernel

    @property
    def num_rows(self) -> int:
        return self.row_query_index.shape[0]


def pack_ancestor_words(mask: np.ndarray) -> np.ndarray:
    """``[..., W]`` bool -> ``[..., ceil(W / 32)]`` int32 with bit i of word i // 32 = ``mask[..., i]``."""
    width = mask.shape[-1]
    num_words = max(1, -(-width // BITS_PER_WORD))
    padded = np.zeros(mask.shape[:-1] + (num_words * BITS_PER_WORD,), np.bool_)
    padded[..., :width] = mask
    packed = np.packbits(padded, axis=-1, bitorder="little")  # 4 little-endian bytes per word
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32).view(np.int32)


def rows_per_tile_for(group: int, tile_m: int = DEFAULT_TILE_M) -> tuple[int, int]:
    """(tree rows per tile, BLOCK_M) for ``group`` query heads per KV head."""
    block_m = max(16, tile_m, triton.next_power_of_2(group))
    return block_m // group, block_m


def launch_config(widest_rows: int, group: int, max_context_len: int) -> LaunchConfig:
    """The main kernel's launch configuration for a step whose widest tree has ``widest_rows`` rows (root included)
    with ``group`` query heads per KV head and whose longest committed context is ``max_context_len``: wide tiles
    only for wide trees over long contexts, where each tile's pass over the context dominates. Measured in bf16, the
    dtypes FLASH_ATTN serves (fp16/bf16): fp32 tiles that wide may not fit a multiprocessor's shared memory."""
    wide = widest_rows * group >= WIDE_TREE_MIN_PAIRS and max_context_len >= WIDE_TREE_MIN_CONTEXT
    return WIDE_TREE_LAUNCH if wide else DEFAULT_LAUNCH


def plan_for_step(batch: Any, group: int, device: torch.device | str = "cpu") -> TreeKernelPlan:
    """:func:`build_kernel_plan` with the tiles and launch configuration :func:`launch_config` picks for ``batch``."""
    widest = int(np.max(np.diff(np.asarray(batch.node_offsets, np.int64)))) + 1 if len(batch.node_offsets) > 1 else 1
    longest = int(np.max(batch.context_len)) if len(batch.context_len) else 0
    return plan_for_launch(batch, group, launch_config(widest, group, longest), device)


def plan_for_launch(batch: Any, group: int, launch: LaunchConfig, device: torch.device | str = "cpu"
                    ) -> TreeKernelPlan:
    """:func:`build_kernel_plan` in ``launch``'s tiles (``group`` query heads per KV head), carrying ``launch``."""
    return build_kernel_plan(batch, rows_per_tile_for(group, launch.tile_m)[0], device, launch)


def build_kernel_plan(batch: Any, rows_per_tile: int, device: torch.device | str = "cpu",
                      launch: LaunchConfig = DEFAULT_LAUNCH) -> TreeKernelPlan:
    """Kernel inputs from a step's tree batch (``vllm_treespec.tree.TreeBatch`` or any object with its ``rows``,
    ``query_start``, ``context_len``, ``node_offsets`` and ``mask [R, W, W]``). Host work is numpy; one copy.
    ``launch`` travels with the plan (its ``tile_m`` should be the one ``rows_per_tile`` came from)."""
    widths = np.diff(np.asarray(batch.node_offsets, np.int64)) + 1  # W_r = 1 + N_r
    num_reqs = widths.size
    row_start = np.cumsum(widths) - widths
    local_row = np.arange(int(widths.sum())) - np.repeat(row_start, widths)
    row_request = np.repeat(np.arange(num_reqs), widths)
    row_query_index = np.repeat(np.asarray(batch.query_start, np.int64), widths) + local_row
    words = pack_ancestor_words(np.asarray(batch.mask)[row_request, local_row])  # [n, num_words]
    tiles_per_request = -(-widths // rows_per_tile)
    tile_request = np.repeat(np.arange(num_reqs), tiles_per_request)
    tile_first_row = (np.arange(int(tiles_per_request.sum()))
                      - np.repeat(np.cumsum(tiles_per_request) - tiles_per_request, tiles_per_request)) * rows_per_tile
    columns = [row_query_index, row_request, np.asarray(batch.context_len), np.asarray(batch.rows), row_start, widths,
               tile_request, tile_first_row]
    flat = np.concatenate([c.astype(np.int32).ravel() for c in columns] + [words.ravel()])
    on_device = torch.from_numpy(flat).to(device, non_blocking=True)
    parts = list(torch.split(on_device, [c.size for c in columns] + [words.size]))
    return TreeKernelPlan(row_query_index=parts[0], row_request=parts[1], ancestor_words=parts[8].view(words.shape),
                          request_context_len=parts[2], request_block_row=parts[3], request_row_start=parts[4],
                          request_num_rows=parts[5], tile_request=parts[6], tile_first_row=parts[7],
                          rows_per_tile=rows_per_tile,
                          max_context_len=int(np.max(batch.context_len)) if num_reqs else 0, launch=launch)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_programs: int, max_context_len: int, multiprocessors: int) -> int:
    """Splits of the committed context: enough programs for :data:`PROGRAMS_PER_SM` per multiprocessor, each split
    reading at least :data:`MIN_KEYS_PER_SPLIT` keys of the longest context, at most :data:`MAX_SPLITS`; 1 when the
    programs are already one per multiprocessor or more."""
    if num_programs >= multiprocessors:
        return 1
    wanted = -(-PROGRAMS_PER_SM * multiprocessors // max(num_programs, 1))
    return max(1, min(wanted, max_context_len // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def tree_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                   plan: TreeKernelPlan, scale: float, output: torch.Tensor | None = None,
                   lse: torch.Tensor | None = None, block_n: int | None = None, num_splits: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the tree rows' attention into ``output`` (same shape as ``query``; a zero tensor if None).

    query / output ``[num_tokens, num_heads, head_dim]``; key_cache / value_cache logical views
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` (any strides); block_table ``[batch_rows, max_blocks]``.
    num_splits: splits of the committed context (None: :func:`choose_num_splits` on CUDA, 1 elsewhere).
    block_n / num_warps / num_stages: the main kernel's launch options (None: the plan's ``launch``).
    Returns (output, lse ``[plan.num_rows, num_heads]`` fp32, natural log). Rows not in the plan are not touched.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    if output is None:
        output = torch.zeros_like(query)
    if lse is None:
        lse = torch.empty(plan.num_rows, num_heads, dtype=torch.float32, device=query.device)
    if plan.num_rows == 0:
        return output, lse
    block_m = max(16, triton.next_power_of_2(plan.rows_per_tile * group))
    block_n = plan.launch.block_n if block_n is None else block_n
    num_warps = plan.launch.num_warps if num_warps is None else num_warps
    num_stages = plan.launch.num_stages if num_stages is None else num_stages
    on_cpu = query.device.type == "cpu"
    # Triton's interpreter computes bf16/fp16 dots wrongly: upcast there. fp32 dots must not round through TF32.
    upcast = on_cpu or query.dtype == torch.float32
    num_tiles = plan.tile_request.shape[0]
    if num_splits is None:
        num_splits = 1 if query.device.type != "cuda" else choose_num_splits(
            num_tiles * num_kv_heads, plan.max_context_len, _multiprocessors(query.device))
    num_splits = max(1, int(num_splits))
    split = num_splits > 1
    if split:
        partial_out = torch.empty(num_splits, plan.num_rows, num_heads, head_dim, dtype=torch.float32,
                                  device=query.device)
        partial_lse = torch.empty(num_splits, plan.num_rows, num_heads, dtype=torch.float32, device=query.device)
    else:  # unused: the kernel writes output and lse directly
        partial_out, partial_lse = output, lse
    block_d = triton.next_power_of_2(head_dim)
    _tree_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_table, output, lse,
        plan.row_query_index, plan.ancestor_words, plan.request_context_len, plan.request_block_row,
        plan.request_row_start, plan.request_num_rows, plan.tile_request, plan.tile_first_row,
        partial_out, partial_lse,
        scale * _LOG2E, key_cache.shape[1], num_splits,
        *query.stride(), *key_cache.stride(), *value_cache.stride(),
        block_table.stride(0), *output.stride(), *lse.stride(), plan.ancestor_words.stride(0),
        *_strides(partial_out, 4), *_strides(partial_lse, 3),
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, ROWS_PER_TILE=plan.rows_per_tile,
        BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=upcast, IEEE_DOT=upcast, SPLIT=split,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        _merge_splits_kernel[(plan.num_rows, num_heads)](
            partial_out, partial_lse, plan.row_query_index, output, lse, num_splits,
            *partial_out.stride(), *partial_lse.stride(), *output.stride(), *lse.stride(),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return output, lse


def _strides(tensor: torch.Tensor, ndim: int) -> tuple[int, ...]:
    """``tensor``'s strides padded to ``ndim`` (the unused workspace arguments when the kernel does not split)."""
    return (tuple(tensor.stride()) + (0,) * ndim)[:ndim]

