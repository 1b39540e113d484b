"""A dense linear layer for CPUs where vLLM's GEMM makes every verified token dear: Numba, one thread, fp32 sums.

A tree step multiplies each weight by a handful of rows (the root and its draft nodes). On an AVX2 CPU without
AVX-512, vLLM's bf16 CPU linear is torch's fallback GEMM (oneDNN cannot build a bf16 matmul there), whose time grows
linearly with the rows: one more verified token cost about what a whole decode step does; and oneDNN's fp32 decode
pass reads the weight at a third of the memory bandwidth one core has (``scripts/bench_cpu_linear.py``). This kernel
streams each weight once per call and multiplies it by every row while it is in registers or L1:

* the weight is packed at load into tiles of 8 output columns, each tile ``[in_features, 8]`` contiguous (one AVX2
  register of fp32 per input element), so a call reads it as a few sequential streams;
* a block of up to 6 rows x 2 tiles keeps its 12 x 8 sums in registers; for each input element ``k`` it loads the
  2 tiles' weights once and multiplies them by each row's ``x[k]`` (broadcast), so up to 6 rows cost one pass over
  the weight, and more rows reuse each block's weights from L1/L2 (the hot loop is LLVM IR emitted through a numba
  intrinsic: numba's own loops would keep the sums in memory; 12 sums, 2 weight vectors, a broadcast and the bf16
  widening fit AVX2's 16 registers, where a 4 x 3 block's 12 sums, 3 weight vectors and broadcast left none);
* a call's last rows (its row count mod 6) run in wider blocks, 1 row x 8 tiles or 2 x 4, after the 6-row blocks
  of each group of 8 tiles, whose weights are then in L2: a block's sums are its only independent chains of
  multiply-adds, and 1 x 2 left the FMA units waiting on latency (a 7th row cost half what the first six did;
  now a third: ``scripts/bench_cpu_linear.py``);
* while a block computes, it prefetches the next tiles into the caches, a line per tile every few ``k``: the next
  block then finds its weights in L2, so the memory stream and the multiply-adds overlap (a step of 5-16 rows was
  one memory-bound pass plus compute-bound ones);
* every output is one fp32 sum over ``k`` in order from 0, a multiply-add per term (fused where the CPU has FMA),
  whatever block computes it: a row's result does not depend on how many rows share the call (batch invariant,
  unlike oneDNN's blocking);
* the result is narrowed to the layer's dtype once (round to nearest even, as torch does);
* an fp32 weight whose every value is a bf16 (a model stored in bf16 and run in fp32, as vLLM loads it) is kept as
  its bf16 bits: the same values, half the bytes to stream per step, and the same fp32 products and sums, so the
  output is what the fp32 weight gives with this kernel, bit for bit.

:func:`time_against` and :func:`ours_is_faster` compare it with the linear vLLM chose for the same weight
(:mod:`vllm_treespec.patches.cpu_gemm` keeps the faster): no CPU model or ISA is assumed.
"""

from __future__ import annotations

import hashlib
import os
import time
import weakref
from typing import Callable

import llvmlite.binding as llvm
import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

DTYPES = (torch.float32, torch.bfloat16)
#: output columns per tile: one 256-bit register of fp32 (AVX2; an AVX-512 CPU runs the same code on half registers)
TILE = 8
#: rows x tiles of one register block: 12 sums, 2 weight vectors, a broadcast and a widened bf16 fit AVX2's 16
#: registers (the 4 x 3 block it replaced, without the prefetch, took 1.1-1.7x as long at 4-16 rows: docs/benchmarks.md)
BLOCK_ROWS = 6
BLOCK_TILES = 2
#: tiles per block for the last ``r`` rows of a call (fewer than BLOCK_ROWS; index ``r``). Each sum is a chain of
#: multiply-adds, each waiting for the one before (an output is one ordered sum), so a block has as many independent
#: chains as sums: 1 row x 2 tiles kept the FMA units waiting on latency most cycles, and a 7th row cost half
#: what the six before it did. Wider blocks keep 8-12 chains going and sum each output in the same order
REST_TILES = (0, 8, 4, 2, 2, 2)
#: tiles whose 6-row blocks run before the last rows' blocks take the same tiles again, from L2 (the weight is still
#: streamed from memory once per call): a multiple of every block's width
GROUP_TILES = 8
#: the widest block of any shape
MAX_TILES = max(BLOCK_TILES, *REST_TILES)
#: bytes the prefetches step by: one cache line
CACHE_LINE = 64
#: a multiply-add is one fused operation where the CPU has FMA (the same in every block, so batch invariant)
FUSED = bool(llvm.get_host_cpu_features().get("fma", False))
#: part of the saved-choice key (vllm_treespec.patches.cpu_gemm): a new kernel is timed again, not trusted
KERNEL_VERSION = "tiles8-r6c2-rest-wide-prefetch-direct"

_F32 = ir.FloatType()
_VF = ir.VectorType(_F32, TILE)
_VI = ir.VectorType(ir.IntType(32), TILE)


def _splat(builder, value):
    undef = ir.Constant(_VF, ir.Undefined)
    vec = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(vec, undef, ir.Constant(_VI, [0] * TILE))


def _load_weights(builder, ptr, bf16: bool):
    if bf16:  # bf16 bits widened to fp32: exact (a bf16 is the top half of an fp32)
        raw = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(16), TILE).as_pointer()), align=2)
        return builder.bitcast(builder.shl(builder.zext(raw, _VI), ir.Constant(_VI, [16] * TILE)), _VF)
    return builder.load(builder.bitcast(ptr, _VF.as_pointer()), align=4)


def _multiply_add(builder, a, b, c):
    if FUSED:
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3), "llvm.fma.v8f32")
        return builder.call(fma, [a, b, c])
    return builder.fadd(c, builder.fmul(a, b))


def _prefetch(builder, ptr) -> None:
    """Fetch the line at ``ptr`` into every cache level (a hint: it never faults and changes no value)."""
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                        "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])  # read, keep in all levels, data


def _emit_block(builder, x_arr, w_arr, o_arr, r0, t0, ahead, rows: int, tiles: int, bf16: bool) -> None:
    """``out[r0 + r, (t0 + c) * 8:][:8] = x[r0 + r] @ tile t0 + c`` for r < ``rows``, c < ``tiles``, the sums in
    registers (``rows`` and ``tiles`` are compile-time), prefetching tiles ``ahead`` .. ``ahead + tiles - 1``."""
    i64 = r0.type
    in_features = builder.extract_value(x_arr.shape, 1)
    width = builder.extract_value(o_arr.shape, 1)
    x_rows = [builder.gep(x_arr.data, [builder.mul(builder.add(r0, i64(r)), in_features)]) for r in range(rows)]
    tile_len = builder.mul(in_features, i64(TILE))
    w_tiles = [builder.gep(w_arr.data, [builder.mul(builder.add(t0, i64(c)), tile_len)]) for c in range(tiles)]
    next_tiles = [builder.gep(w_arr.data, [builder.mul(builder.add(ahead, i64(c)), tile_len)]) for c in range(tiles)]
    k_per_line = CACHE_LINE // (TILE * (2 if bf16 else 4))
    sums = [[cgutils.alloca_once(builder, _VF) for _ in range(tiles)] for _ in range(rows)]
    for r in range(rows):
        for c in range(tiles):
            builder.store(ir.Constant(_VF, [0.0] * TILE), sums[r][c])
    with cgutils.for_range(builder, in_features) as loop:
        k = loop.index
        with builder.if_then(builder.icmp_unsigned("==", builder.urem(k, i64(k_per_line)), i64(0))):
            for c in range(tiles):
                _prefetch(builder, builder.gep(next_tiles[c], [builder.mul(k, i64(TILE))]))
        ws = [_load_weights(builder, builder.gep(w_tiles[c], [builder.mul(k, i64(TILE))]), bf16)
              for c in range(tiles)]
        for r in range(rows):
            xk = _splat(builder, builder.load(builder.gep(x_rows[r], [k])))
            for c in range(tiles):
                builder.store(_multiply_add(builder, xk, ws[c], builder.load(sums[r][c])), sums[r][c])
    for r in range(rows):
        o_row = builder.gep(o_arr.data, [builder.mul(builder.add(r0, i64(r)), width)])
        for c in range(tiles):
            ptr = builder.gep(o_row, [builder.mul(builder.add(t0, i64(c)), i64(TILE))])
            builder.store(builder.load(sums[r][c]), builder.bitcast(ptr, _VF.as_pointer()), align=4)


@intrinsic
def _register_block(typingctx, x, packed, out, r0, t0, ahead, rows, tiles):
    """``out[r0 + r, (t0 + c) * 8:][:8] = x[r0 + r] @ tile t0 + c`` for r < ``rows`` (1..6), c < ``tiles``
    (1.. :func:`_widest` of ``rows``), prefetching as many tiles from ``ahead`` on: one block shape per case of a
    switch (the sums must be registers, so each shape is its own code)."""
    if not all(isinstance(a, types.Array) and a.layout == "C" for a in (x, packed, out)):
        return None
    if x.dtype != types.float32 or out.dtype != types.float32 or packed.dtype not in (types.float32, types.uint16):
        return None  # the IR reads fp32 rows and writes fp32 sums
    bf16 = packed.dtype == types.uint16
    sig = types.void(x, packed, out, types.int64, types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        x_arr, w_arr, o_arr = (context.make_array(signature.args[i])(context, builder, args[i]) for i in range(3))
        r0, t0, ahead, rows, tiles = args[3:]
        i64 = r0.type
        done = builder.append_basic_block("block_done")
        shape = builder.add(builder.mul(rows, i64(MAX_TILES + 1)), tiles)
        switch = builder.switch(shape, done)
        for num_rows in range(1, BLOCK_ROWS + 1):
            for num_tiles in range(1, _widest(num_rows) + 1):
                case = builder.append_basic_block(f"block_{num_rows}x{num_tiles}")
                switch.add_case(i64(num_rows * (MAX_TILES + 1) + num_tiles), case)
                builder.position_at_end(case)
                _emit_block(builder, x_arr, w_arr, o_arr, r0, t0, ahead, num_rows, num_tiles, bf16)
                builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return sig, codegen


def _widest(rows: int) -> int:
    """The most tiles of a block of ``rows`` rows."""
    return BLOCK_TILES if rows == BLOCK_ROWS else REST_TILES[rows]


@njit(cache=True, nogil=True)
def linear_packed(x, packed, out):
    """out = x @ W.T for fp32 ``x`` (M x K) and W packed by :func:`pack_weight` (``[T, K, 8]``, fp32 or bf16 bits),
    into fp32 ``out`` (M x 8T). Per group of GROUP_TILES tiles: each block of 2 tiles times every block of 6 rows
    (the tiles stay in L1/L2), each prefetching the next block of tiles; then the last rows (M mod 6) in blocks of
    REST_TILES[M mod 6] tiles, reading the group from L2. Without a block of 6 rows, the last rows' blocks stream
    the weight themselves, each prefetching the next."""
    num_rows = x.shape[0]
    num_tiles = packed.shape[0]
    if num_rows == 0:
        return
    full = num_rows - num_rows % BLOCK_ROWS
    rest = num_rows - full
    rest_tiles = REST_TILES[rest]
    if full == 0:
        t = 0
        while t < num_tiles:
            tiles = min(rest_tiles, num_tiles - t)
            ahead = t + tiles if t + 2 * tiles <= num_tiles else t
            _register_block(x, packed, out, 0, t, ahead, rest, tiles)
            t += tiles
        return
    group = 0
    while group < num_tiles:
        group_end = min(group + GROUP_TILES, num_tiles)
        t = group
        while t < group_end:
            tiles = min(BLOCK_TILES, group_end - t)
            ahead = t + tiles if t + 2 * tiles <= num_tiles else t
            r = 0
            while r < full:
                _register_block(x, packed, out, r, t, ahead, BLOCK_ROWS, tiles)
                r += BLOCK_ROWS
            t += tiles
        t = group
        while rest and t < group_end:
            tiles = min(rest_tiles, group_end - t)
            _register_block(x, packed, out, full, t, t, rest, tiles)  # in cache: its prefetch is a no-op
            t += tiles
        group = group_end


def pack_weight(weight: np.ndarray) -> np.ndarray:
    """``[N, K]`` -> ``[ceil(N / 8), K, 8]``: tile t holds output columns 8t..8t+7 (zero columns pad the last)."""
    n, k = weight.shape
    num_tiles = -(-n // TILE)
    padded = np.zeros((num_tiles * TILE, k), weight.dtype)
    padded[:n] = weight
    return np.ascontiguousarray(padded.reshape(num_tiles, TILE, k).transpose(0, 2, 1))


def _weight_array(weight: torch.Tensor) -> np.ndarray:
    """The weight as the kernels take it: fp32 as is, bf16 as its uint16 bits (no copy)."""
    if weight.dtype == torch.bfloat16:
        return weight.view(torch.int16).numpy().view(np.uint16)
    return weight.numpy()


def holds_only_bf16_values(weight: torch.Tensor) -> bool:
    """Whether an fp32 weight loses nothing as bf16 (every value is a bf16: a bf16 checkpoint run in fp32)."""
    return weight.dtype == torch.float32 and torch.equal(weight.to(torch.bfloat16).to(torch.float32), weight)


def _linear(x: torch.Tensor, packed: np.ndarray, out_features: int, bias: torch.Tensor | None,
            out_dtype: torch.dtype) -> torch.Tensor:
    in_features = packed.shape[1]
    # an fp32 layer's own input (2-D, contiguous) is multiplied as it is: reshaping and copying it cost ~10 us of
    # torch dispatch a call (~90 calls a step, ~1 ms of a 30 ms decode step)
    as_passed = x.dtype is torch.float32 and x.dim() == 2 and x.shape[1] == in_features and x.is_contiguous()
    rows = x if as_passed else x.reshape(-1, in_features).to(torch.float32).contiguous()  # exact for bf16 inputs
    out_array = np.empty((rows.shape[0], packed.shape[0] * TILE), np.float32)
    if rows.shape[0]:
        linear_packed(rows.numpy(), packed, out_array)
    out = torch.from_numpy(out_array)
    if out.shape[1] != out_features:
        out = out[:, :out_features]
    if bias is not None:
        out += bias.to(torch.float32)
    if out_dtype is not torch.float32:
        out = out.to(out_dtype)
    return out if as_passed else out.reshape(*x.shape[:-1], out_features)


#: the live linears by id, for the custom op (a graph holds the id, not a copy of the weight); linears of equal
#: content share an id, and any live one of them serves it
_LINEARS: dict[int, weakref.WeakSet[NumbaLinear]] = {}


def content_id(packed: np.ndarray, out_features: int, out_dtype: torch.dtype) -> int:
    """A linear's id from what it computes (its packed weight, shape and output dtype), not from the order linears
    were built in: a compiled graph holds the id, and vLLM's compile cache hands that graph to later engines and
    processes, whose linears must answer to the same ids (a counter differed between an engine that timed its
    choices and one that read them, and kept counting across in-process engines). SHA-256 runs at ~1.5 GB/s here:
    ~0.2 s for a 135M-parameter model's weights, once per engine start."""
    digest = hashlib.sha256(f"{out_features} {out_dtype} {packed.dtype} {packed.shape}".encode())
    digest.update(memoryview(np.ascontiguousarray(packed)).cast("B"))
    return int.from_bytes(digest.digest()[:8], "little") >> 1  # the custom op's ``int`` is a signed int64


def live_linear(linear_id: int) -> NumbaLinear:
    for linear in _LINEARS.get(linear_id, ()):
        return linear
    raise KeyError(f"vllm_treespec: no live CPU linear has id {linear_id} (a compiled graph outlived its model's "
                   "weights)")


@torch.library.custom_op("vllm_treespec::numba_linear", mutates_args=())
def numba_linear(x: torch.Tensor, bias: torch.Tensor | None, linear_id: int) -> torch.Tensor:
    """The linear ``linear_id`` as one opaque op, for graphs torch.compile captures (vLLM's CPU default outside
    eager mode). Like vLLM's oneDNN handle, the graph refers to the weight the linear holds, not to the layer's."""
    return live_linear(linear_id).eager(x, bias)


@numba_linear.register_fake
def _(x, bias, linear_id):
    linear = live_linear(linear_id)
    return x.new_empty((*x.shape[:-1], linear.out_features), dtype=linear.out_dtype)


class NumbaLinear:
    """``layer.cpu_linear`` for one weight: ``(x, weight, bias) -> x @ weight.T + bias`` in the weight's dtype.

    Holds what it multiplies by, packed in tiles (the weight's values, as bf16 bits when an fp32 weight holds only
    bf16 values) and ignores the ``weight`` argument, so the layer's own weight may be dropped (vLLM's
    ``remove_weight``).
    Eager calls go straight to the kernel; under torch.compile the call is the custom op :func:`numba_linear`."""

    def __init__(self, weight: torch.Tensor, keep_bf16_values: bool = True):
        """``keep_bf16_values=False`` keeps an fp32 weight as fp32 even where it holds only bf16 values (tests)."""
        if weight.dtype not in DTYPES or weight.dim() != 2:
            raise ValueError(f"NumbaLinear takes a 2-D float32 or bfloat16 weight, got {tuple(weight.shape)} "
                             f"{weight.dtype}")
        weight = weight.detach().contiguous()
        self.out_dtype = weight.dtype
        self.out_features, self.in_features = weight.shape
        # fp32 values kept as bf16 bits: half the bytes, same sums
        self.compact = keep_bf16_values and holds_only_bf16_values(weight)
        stored = weight.to(torch.bfloat16) if self.compact else weight
        self.packed = pack_weight(_weight_array(stored))  # what the kernel reads; the layer's weight may go
        self.linear_id = content_id(self.packed, self.out_features, self.out_dtype)
        _LINEARS.setdefault(self.linear_id, weakref.WeakSet()).add(self)

    def eager(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _linear(x, self.packed, self.out_features, bias, self.out_dtype)

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
