"""A dense linear layer for CPUs where vLLM's GEMM makes every verified token dear: Numba, one thread, fp32 sums.

A tree step multiplies each weight by a handful of rows (the root and its draft nodes). On an AVX2 CPU without
AVX-512, vLLM's bf16 CPU linear is torch's fallback GEMM (oneDNN cannot build a bf16 matmul there), whose time grows
linearly with the rows: one more verified token cost about what a whole decode step does
(``scripts/bench_cpu_linear.py``). This kernel streams each weight once per call and multiplies it by all rows
while it is in cache:

* the weight is walked in chunks of rows that fit in L2 (bf16 chunks are widened to fp32 once, into a buffer);
* each output is a 2-row x 4-column register block whose products are summed in fp32 over the input dimension, in
  the same order for every row of every call: an odd last row is computed as its own pair (and one copy
  dropped), so a row's result does not depend on how many rows share the call (batch invariant, unlike
  oneDNN's blocking);
* the result is narrowed to the layer's dtype once (round to nearest even, as torch does);
* an fp32 weight whose every value is a bf16 (a model stored in bf16 and run in fp32, as vLLM loads it) is kept as
  its bf16 bits: the same values, half the bytes to stream per step, and the same fp32 products and sums, so the
  output is what the fp32 weight gives with this kernel, bit for bit.

:func:`time_against` and :func:`ours_is_faster` compare it with the linear vLLM chose for the same weight
(:mod:`vllm_treespec.patches.cpu_gemm` keeps the faster): no CPU model or ISA is assumed.
"""

from __future__ import annotations

import itertools
import os
import time
import weakref
from typing import Callable

import numba
import numpy as np
import torch

DTYPES = (torch.float32, torch.bfloat16)
# Bytes of fp32 weight rows per chunk: a chunk stays in L2 (512 KiB per core on the CPUs we measured, 1-2 MiB on
# newer ones) while every input row passes over it.
CHUNK_BYTES = 256 * 1024


def chunk_rows(in_features: int) -> int:
    """Weight rows per chunk: a multiple of the 4-column block, at least one block."""
    return max(4, (CHUNK_BYTES // (4 * in_features)) // 4 * 4)


@numba.njit(cache=True, nogil=True, fastmath=True, boundscheck=False)
def _rows_times_chunk(x, w, row0, chunk, out, col0):
    """out[:, col0 + j] = x @ w[row0 + j] for j < chunk (``w`` fp32, rows x K), in 2 x 4 register blocks."""
    num_rows, in_features = x.shape
    for m in range(0, num_rows, 2):
        mb = m + 1 if m + 1 < num_rows else m  # an odd last row pairs with itself: same sums as any other row
        j = 0
        while j + 4 <= chunk:
            a0 = np.float32(0.0); a1 = np.float32(0.0); a2 = np.float32(0.0); a3 = np.float32(0.0)
            b0 = np.float32(0.0); b1 = np.float32(0.0); b2 = np.float32(0.0); b3 = np.float32(0.0)
            for k in range(in_features):
                xa = x[m, k]
                xb = x[mb, k]
                r = row0 + j
                w0 = w[r, k]; w1 = w[r + 1, k]; w2 = w[r + 2, k]; w3 = w[r + 3, k]
                a0 += xa * w0; a1 += xa * w1; a2 += xa * w2; a3 += xa * w3
                b0 += xb * w0; b1 += xb * w1; b2 += xb * w2; b3 += xb * w3
            c = col0 + j
            out[m, c] = a0; out[m, c + 1] = a1; out[m, c + 2] = a2; out[m, c + 3] = a3
            out[mb, c] = b0; out[mb, c + 1] = b1; out[mb, c + 2] = b2; out[mb, c + 3] = b3
            j += 4
        while j < chunk:  # the chunk's last columns (a weight whose row count is not a multiple of 4)
            a0 = np.float32(0.0); b0 = np.float32(0.0)
            for k in range(in_features):
                a0 += x[m, k] * w[row0 + j, k]
                b0 += x[mb, k] * w[row0 + j, k]
            out[m, col0 + j] = a0
            out[mb, col0 + j] = b0
            j += 1


@numba.njit(cache=True, nogil=True, boundscheck=False)
def linear_f32(x, w, out, rows_per_chunk):
    """out = x @ w.T for fp32 ``x`` (M x K), fp32 ``w`` (N x K), fp32 ``out`` (M x N)."""
    n = w.shape[0]
    for n0 in range(0, n, rows_per_chunk):
        n1 = min(n, n0 + rows_per_chunk)
        _rows_times_chunk(x, w, n0, n1 - n0, out, n0)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def linear_bf16(x, w_bits, out, rows_per_chunk):
    """out = x @ w.T for fp32 ``x``, bf16 ``w`` given as its uint16 bits (N x K), fp32 ``out``: each chunk of
    weight rows is widened to fp32 once (exact: bf16 is the top half of an fp32)."""
    n, in_features = w_bits.shape
    wide = np.empty((rows_per_chunk, in_features), np.uint32)
    wide_f32 = wide.view(np.float32)
    for n0 in range(0, n, rows_per_chunk):
        n1 = min(n, n0 + rows_per_chunk)
        for j in range(n1 - n0):
            for k in range(in_features):
                wide[j, k] = np.uint32(w_bits[n0 + j, k]) << 16
        _rows_times_chunk(x, wide_f32, 0, n1 - n0, out, n0)


def _weight_array(weight: torch.Tensor) -> np.ndarray:
    """The weight as the kernels take it: fp32 as is, bf16 as its uint16 bits (no copy)."""
    if weight.dtype == torch.bfloat16:
        return weight.view(torch.int16).numpy().view(np.uint16)
    return weight.numpy()


def holds_only_bf16_values(weight: torch.Tensor) -> bool:
    """Whether an fp32 weight loses nothing as bf16 (every value is a bf16: a bf16 checkpoint run in fp32)."""
    return weight.dtype == torch.float32 and torch.equal(weight.to(torch.bfloat16).to(torch.float32), weight)


def _linear(x: torch.Tensor, weight_array: np.ndarray, bias: torch.Tensor | None, out_dtype: torch.dtype,
            rows_per_chunk: int) -> torch.Tensor:
    out_features, in_features = weight_array.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, in_features).to(torch.float32).contiguous()  # exact for bf16 inputs
    out = torch.empty((rows.shape[0], out_features), dtype=torch.float32)
    if rows.shape[0]:
        kernel = linear_bf16 if weight_array.dtype == np.uint16 else linear_f32
        kernel(rows.numpy(), weight_array, out.numpy(), rows_per_chunk)
    if bias is not None:
        out += bias.to(torch.float32)
    return out.to(out_dtype).reshape(*lead, out_features)


#: the live linears by id, for the custom op (a graph holds the id, not a copy of the weight)
_LINEARS: weakref.WeakValueDictionary[int, NumbaLinear] = weakref.WeakValueDictionary()
_linear_ids = itertools.count()


@torch.library.custom_op("vllm_treespec::numba_linear", mutates_args=())
def numba_linear(x: torch.Tensor, bias: torch.Tensor | None, linear_id: int) -> torch.Tensor:
    """The linear ``linear_id`` as one opaque op, for graphs torch.compile captures (vLLM's CPU default outside
    eager mode). Like vLLM's oneDNN handle, the graph refers to the weight the linear holds, not to the layer's."""
    return _LINEARS[linear_id].eager(x, bias)


@numba_linear.register_fake
def _(x, bias, linear_id):
    linear = _LINEARS[linear_id]
    return x.new_empty((*x.shape[:-1], linear.out_features), dtype=linear.out_dtype)


class NumbaLinear:
    """``layer.cpu_linear`` for one weight: ``(x, weight, bias) -> x @ weight.T + bias`` in the weight's dtype.

    Holds what it multiplies by (the weight itself, or its bf16 bits when an fp32 weight holds only bf16 values)
    and ignores the ``weight`` argument, so the layer's own weight may be dropped (vLLM's ``remove_weight``).
    Eager calls go straight to the kernel; under torch.compile the call is the custom op :func:`numba_linear`."""

    def __init__(self, weight: torch.Tensor):
        if weight.dtype not in DTYPES or weight.dim() != 2:
            raise ValueError(f"NumbaLinear takes a 2-D float32 or bfloat16 weight, got {tuple(weight.shape)} "
                             f"{weight.dtype}")
        weight = weight.detach().contiguous()
        self.out_dtype = weight.dtype
        self.out_features, self.in_features = weight.shape
        self.compact = holds_only_bf16_values(weight)  # fp32 values kept as bf16 bits: half the bytes, same sums
        self.stored = weight.to(torch.bfloat16) if self.compact else weight
        self.rows_per_chunk = chunk_rows(self.in_features)
        self._w = _weight_array(self.stored)
        self.linear_id = next(_linear_ids)
        _LINEARS[self.linear_id] = self

    def eager(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _linear(x, self._w, bias, self.out_dtype, self.rows_per_chunk)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return numba_linear(x, bias, self.linear_id)
        return self.eager(x, bias)


def best_seconds(call: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> float:
    """Seconds of ``call()``, best of ``repeats`` after one untimed call (compiles, packs, first touch);
    ``before()`` runs untimed ahead of each call."""
    call()
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def last_level_cache_bytes() -> int:
    """The CPU's last-level cache (Linux reports it; 32 MiB where it does not)."""
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            size = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if size > 0:
            return int(size)
    return 32 * 1024 * 1024


class CacheEvictor:
    """Reads a buffer twice the last-level cache, so that the next call finds its weight in memory, as a step
    does (the other layers' weights pass through the caches between two calls of one layer)."""

    def __init__(self) -> None:
        self.buffer = np.ones(min(2 * last_level_cache_bytes(), 512 * 1024 * 1024) // 8, np.float64)

    def __call__(self) -> float:
        return float(self.buffer.sum())


#: rows timed when choosing: a decode step, a tree of a few nodes, a wide tree or a small batch's trees
CHOICE_ROWS = (1, 8, 32)


def time_against(weight: torch.Tensor, current: Callable, rows: tuple[int, ...] = CHOICE_ROWS,
                 repeats: int = 2) -> dict[int, tuple[float, float]]:
    """{rows: (seconds of :class:`NumbaLinear`, seconds of ``current``)} on this weight, best of ``repeats``, each
    call with the weight out of cache as in a model's step."""
    ours = NumbaLinear(weight)
    evict = CacheEvictor()
    times: dict[int, tuple[float, float]] = {}
    generator = torch.Generator().manual_seed(0)
    for n in rows:
        x = torch.randn(n, weight.shape[1], generator=generator).to(weight.dtype)
        times[n] = (best_seconds(lambda: ours(x, None, None), repeats, evict),
                    best_seconds(lambda: current(x, weight, None), repeats, evict))
    return times


def ours_is_faster(times: dict[int, tuple[float, float]]) -> bool:
    """Ours wins when it is faster in total over the timed row counts, each weighted equally (sum of ratios):
    a decode step counts as much as a tree step. (A near tie may go either way; the patch saves the choice, so
    every engine on the machine makes the same one.)"""
    return sum(ours / theirs for ours, theirs in times.values()) < len(times)
