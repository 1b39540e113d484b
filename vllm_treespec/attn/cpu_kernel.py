"""Tree rows over vLLM's paged CPU KV cache, in numba: vLLM's CPU attention arithmetic, without copying the context.

One call per layer computes every tree row of the step (root and nodes) straight from the cache blocks: committed
context plus the row's ancestors, nothing else. The arithmetic is that of vLLM's C++ CPU attention
(``csrc/cpu/cpu_attn_impl.hpp``, VEC layout) operation for operation, so that on a chain-shaped tree the result is
the kernel's own, bit for bit (checked against the installed kernel by :mod:`vllm_treespec.attn.cpu_fast`):

* Q is widened to fp32 and multiplied by the fp32 softmax scale;
* each logit is a sequential fp32 sum over the head dimension, starting from 0;
* the softmax is online over vLLM's KV tiles (:func:`kv_tile_length`): the running max moves only when a tile's max
  exceeds it by more than 8, and then the sum and the partial output are rescaled by libm's ``expf`` of the
  difference; each tile's exponentials are summed in 16 lanes (lane = position mod 16) and the lanes reduced;
* each output element is the sequential fp32 sum over positions of ``p * v``, times ``1 / sum``, narrowed to the
  model dtype.

vLLM ships three x86 builds whose arithmetic differs; :func:`run` takes the one to follow:

* ``avx512`` (``vllm._C`` and ``vllm._C_AVX512``): multiply-adds fused (FMA), exponentials from vLLM's polynomial
  ``fast_exp``, lanes reduced as a tree (``_mm512_reduce_add_ps``); else (``vllm._C_AVX2``): separate multiply and add,
  libm ``expf`` (16 at a time by a replica of glibc's, :func:`_vec_libm_expf`, where it gives this libm's bits), lanes
  reduced as two sequential halves;
* ``rne``: bf16 outputs rounded to nearest even (``vllm._C``, AVX512-BF16), else truncated.

Non-ancestor tree positions get -inf logits, i.e. exact-zero weights. bf16 values travel as their uint16 bits. Four
query vectors of one KV head (tree rows x the query heads of its group) go through the cache together, so that each
K or V element loaded serves four dot products (on AVX2, 16 positions or dimensions at a time: the sums fill its 16
registers; AVX-512 takes 32 or 64). The hot loops (both products, the tile max, the exponentials and
their lane sums) are LLVM IR with 16-lane vectors, emitted through numba intrinsics; the rest is plain numba. The
kernel runs on one thread (vLLM's CPU worker here has one; with several, vLLM's kernel spreads its rows over them and
this one does not).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

#: changes whenever a tree row's cost does (step-cost curves timed with another kernel are measured again)
KERNEL_VERSION = "avx2-4x16"
LOWEST = np.float32(np.finfo(np.float32).min)
# Arithmetic profiles, told apart by type so that numba compiles one kernel per profile, with no branch in the loops.
AVX512_MARK = np.float64(0.0)
AVX2_MARK = np.float32(0.0)
#: the AVX2 arithmetic with libm's expf computed 16 lanes at a time (:func:`_vec_libm_expf`), where it agrees with
#: this process's libm (:func:`vector_expf_agrees`)
AVX2_VECTOR_EXP_MARK = np.int8(0)
RNE_MARK = np.int64(0)
TRUNC_MARK = np.int32(0)


@intrinsic
def _bits_to_f32(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _f32_to_bits(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _fma(typingctx, a, b, c):
    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return types.float32(types.float32, types.float32, types.float32), codegen


def _widen(x):  # pragma: no cover - replaced by the overload inside numba
    raise NotImplementedError


@overload(_widen, inline="always")
def _widen_impl(x):
    if x == types.float32:
        return lambda x: x
    if x == types.uint16:
        return lambda x: _bits_to_f32(np.uint32(x) << np.uint32(16))
    return None


def _narrow(value, like, rounding):  # pragma: no cover - replaced by the overload inside numba
    raise NotImplementedError


@overload(_narrow, inline="always")
def _narrow_impl(value, like, rounding):
    if like == types.float32:
        return lambda value, like, rounding: value
    if like == types.uint16:
        if rounding == types.int64:  # RNE_MARK
            def narrow_rne(value, like, rounding):
                bits = _f32_to_bits(value)
                bits = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
                return np.uint16(bits >> np.uint32(16))

            return narrow_rne
        return lambda value, like, rounding: np.uint16(_f32_to_bits(value) >> np.uint32(16))
    return None


def _is_avx512(profile):  # pragma: no cover - replaced by the overload inside numba
    raise NotImplementedError


@overload(_is_avx512, inline="always")
def _is_avx512_impl(profile):
    fused = profile == types.float64  # AVX512_MARK
    return lambda profile: fused


def _vector_exp(profile):  # pragma: no cover - replaced by the overload inside numba
    raise NotImplementedError


@overload(_vector_exp, inline="always")
def _vector_exp_impl(profile):
    vector = profile == types.int8  # AVX2_VECTOR_EXP_MARK
    return lambda profile: vector


_LN_FLT_MIN = np.float32(-87.3365478515625)  # 0xc2aeac50
_LN_FLT_MAX = np.float32(88.72283935546875)  # 0x42b17218
_LOG2E = np.float32(1.4426950216293335)  # 0x3fb8aa3b
_LN2 = np.float32(0.6931471824645996)  # 0x3f317218
_EXP_C5 = np.float32(0.00828929059)
_EXP_C4 = np.float32(0.0418978221)
_EXP_C3 = np.float32(0.166676521)
_EXP_C2 = np.float32(0.499991506)
_EXP_C1 = np.float32(0.999999701)


# The hot loops are LLVM IR emitted through numba intrinsics: numba's own loops keep the running sums in memory (it
# cannot tell LLVM that the arrays do not alias), which halves the throughput of the products and leaves the
# exponentials scalar.
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
LANES = 16
VF = ir.VectorType(_F32, LANES)
VI = ir.VectorType(_I32, LANES)


def _splat(builder, value):
    undef = ir.Constant(VF, ir.Undefined)
    vec = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, undef, ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))


def _load_vec(builder, elem_ptr, bf16):
    if bf16:
        raw = builder.load(builder.bitcast(elem_ptr, ir.VectorType(ir.IntType(16), LANES).as_pointer()), align=2)
        wide = builder.zext(raw, ir.VectorType(_I32, LANES))
        wide = builder.shl(wide, ir.Constant(ir.VectorType(_I32, LANES), [16] * LANES))
        return builder.bitcast(wide, VF)
    return builder.load(builder.bitcast(elem_ptr, VF.as_pointer()), align=4)


def _vec_madd(builder, a, b, c, fused):
    if fused:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VF, [VF, VF, VF]), "llvm.fma.v16f32")
        return builder.call(fn, [a, b, c])
    return builder.fadd(c, builder.fmul(a, b))


@intrinsic
def _pv_segment(typingctx, weights, flat, acc, v_off, p0, n, profile):
    """``acc[m] += weights[m, p0 + j] * V_j`` for j in ``[0, n)``, in that order, for the four query vectors m
    (``V_j = flat[v_off + j * D:][:D]``, D = ``acc.shape[1]``, a multiple of 16). The accumulators stay in
    registers: 2 x 16 lanes of each vector per pass over the positions."""
    if not all(isinstance(a, types.Array) and a.layout == "C" for a in (weights, flat, acc)):
        return None
    fused = profile == types.float64
    bf16 = flat.dtype == types.uint16
    sig = types.void(weights, flat, acc, types.int64, types.int64, types.int64, profile)

    def codegen(context, builder, signature, args):
        w_arr = context.make_array(signature.args[0])(context, builder, args[0])
        f_arr = context.make_array(signature.args[1])(context, builder, args[1])
        a_arr = context.make_array(signature.args[2])(context, builder, args[2])
        v_off, p0, n = args[3], args[4], args[5]
        i64 = v_off.type
        length = builder.extract_value(w_arr.shape, 1)
        d = builder.extract_value(a_arr.shape, 1)
        w_rows = [builder.gep(w_arr.data, [builder.add(builder.mul(i64(m), length), p0)]) for m in range(4)]
        a_rows = [builder.gep(a_arr.data, [builder.mul(i64(m), d)]) for m in range(4)]
        v_base = builder.gep(f_arr.data, [v_off])

        def emit_pass(c, chunks):
            slots = [[cgutils.alloca_once(builder, VF) for _ in range(chunks)] for _ in range(4)]
            for m in range(4):
                for u in range(chunks):
                    ptr = builder.gep(a_rows[m], [builder.add(c, i64(16 * u))])
                    builder.store(builder.load(builder.bitcast(ptr, VF.as_pointer()), align=4), slots[m][u])
            with cgutils.for_range(builder, n) as loop:
                j = loop.index
                row = builder.gep(v_base, [builder.add(builder.mul(j, d), c)])
                xs = [_load_vec(builder, builder.gep(row, [i64(16 * u)]), bf16) for u in range(chunks)]
                for m in range(4):
                    w = _splat(builder, builder.load(builder.gep(w_rows[m], [j])))
                    for u in range(chunks):
                        builder.store(_vec_madd(builder, w, xs[u], builder.load(slots[m][u]), fused), slots[m][u])
            for m in range(4):
                for u in range(chunks):
                    ptr = builder.gep(a_rows[m], [builder.add(c, i64(16 * u))])
                    builder.store(builder.load(slots[m][u]), builder.bitcast(ptr, VF.as_pointer()), align=4)

        if fused:
            pairs = builder.udiv(d, i64(32))
            with cgutils.for_range(builder, pairs) as loop:
                emit_pass(builder.mul(loop.index, i64(32)), 2)
            with builder.if_then(builder.icmp_unsigned("!=", builder.urem(d, i64(32)), i64(0))):
                emit_pass(builder.mul(pairs, i64(32)), 1)
        else:  # AVX2: 4 x 2 x 16 lanes of sums would spill AVX2's 16 registers; 4 x 16 lanes fit
            with cgutils.for_range(builder, builder.udiv(d, i64(16))) as loop:
                emit_pass(builder.mul(loop.index, i64(16)), 1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _qk_block(typingctx, q_buf, flat, logits, k_off, p0, n, bs, profile):
    """``logits[m, p0 + t] = sum_i q_buf[m, i] * K[i, t]``, summed over i in order from 0, for the four query vectors
    m and the block positions t in ``[0, n)`` rounded up to 16 (``K[i, t] = flat[k_off + i * bs + t]``, the block's
    K; bs a multiple of 16). The sums stay in registers: 4 x 16 positions of each vector per pass over i."""
    if not all(isinstance(a, types.Array) and a.layout == "C" for a in (q_buf, flat, logits)):
        return None
    fused = profile == types.float64
    bf16 = flat.dtype == types.uint16
    sig = types.void(q_buf, flat, logits, types.int64, types.int64, types.int64, types.int64, profile)

    def codegen(context, builder, signature, args):
        q_arr = context.make_array(signature.args[0])(context, builder, args[0])
        f_arr = context.make_array(signature.args[1])(context, builder, args[1])
        l_arr = context.make_array(signature.args[2])(context, builder, args[2])
        k_off, p0, n, bs = args[3], args[4], args[5], args[6]
        i64 = k_off.type
        d = builder.extract_value(q_arr.shape, 1)
        length = builder.extract_value(l_arr.shape, 1)
        q_rows = [builder.gep(q_arr.data, [builder.mul(i64(m), d)]) for m in range(4)]
        l_rows = [builder.gep(l_arr.data, [builder.add(builder.mul(i64(m), length), p0)]) for m in range(4)]
        k_base = builder.gep(f_arr.data, [k_off])
        chunks16 = builder.udiv(builder.add(n, i64(15)), i64(16))

        def emit_pass(t, chunks):
            slots = [[cgutils.alloca_once(builder, VF) for _ in range(chunks)] for _ in range(4)]
            zero = ir.Constant(VF, [0.0] * LANES)
            for m in range(4):
                for u in range(chunks):
                    builder.store(zero, slots[m][u])
            with cgutils.for_range(builder, d) as loop:
                i = loop.index
                row = builder.gep(k_base, [builder.add(builder.mul(i, bs), t)])
                ks = [_load_vec(builder, builder.gep(row, [i64(16 * u)]), bf16) for u in range(chunks)]
                for m in range(4):
                    q = _splat(builder, builder.load(builder.gep(q_rows[m], [i])))
                    for u in range(chunks):
                        builder.store(_vec_madd(builder, q, ks[u], builder.load(slots[m][u]), fused), slots[m][u])
            for m in range(4):
                for u in range(chunks):
                    ptr = builder.gep(l_rows[m], [builder.add(t, i64(16 * u))])
                    builder.store(builder.load(slots[m][u]), builder.bitcast(ptr, VF.as_pointer()), align=4)

        per_pass = 4 if fused else 1  # AVX2: 4 x 4 x 16 lanes of sums would spill its 16 registers
        quads = builder.udiv(chunks16, i64(per_pass))
        with cgutils.for_range(builder, quads) as loop:
            emit_pass(builder.mul(loop.index, i64(16 * per_pass)), per_pass)
        rest_start = builder.mul(quads, i64(per_pass))
        with cgutils.for_range(builder, builder.sub(chunks16, rest_start)) as loop:
            emit_pass(builder.mul(builder.add(rest_start, loop.index), i64(16)), 1)
        return context.get_dummy_value()

    return sig, codegen


def _vconst(value):
    return ir.Constant(VF, [float(value)] * LANES)


def _vcall(builder, name, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VF, [VF] * len(args)), name)
    return builder.call(fn, args)


def _vec_fast_exp(builder, x):
    """vLLM's AVX-512 ``fast_exp`` (``cpu_attn_macros.h``) on 16 lanes, operation for operation."""
    def fma(a, b, c):
        return _vcall(builder, "llvm.fma.v16f32", [a, b, c])

    src = builder.select(builder.fcmp_ordered("<", x, _vconst(_LN_FLT_MAX)), x, _vconst(_LN_FLT_MAX))
    src = builder.select(builder.fcmp_ordered(">", src, _vconst(_LN_FLT_MIN)), src, _vconst(_LN_FLT_MIN))
    fx = _vcall(builder, "llvm.floor.v16f32", [fma(src, _vconst(_LOG2E), _vconst(0.5))])
    r = fma(builder.fneg(fx), _vconst(_LN2), src)
    res = fma(r, _vconst(_EXP_C5), _vconst(_EXP_C4))
    res = fma(r, res, _vconst(_EXP_C3))
    res = fma(r, res, _vconst(_EXP_C2))
    res = fma(r, res, _vconst(_EXP_C1))
    res = fma(r, res, _vconst(1.0))
    n = builder.fptosi(builder.fsub(fx, _vconst(1.0)), VI)
    bits = builder.shl(builder.add(n, ir.Constant(VI, [127] * LANES)), ir.Constant(VI, [23] * LANES))
    power = builder.select(builder.fcmp_ordered("<", x, _vconst(_LN_FLT_MIN)), _vconst(0.0),
                           builder.bitcast(bits, VF))
    res = builder.fmul(res, power)
    return builder.fadd(res, res)


def _chunk_ptr(builder, base, index):
    """``<16 x float>*`` to the ``index``-th 16-float chunk from ``base``."""
    offset = builder.mul(index, ir.Constant(index.type, LANES))
    return builder.bitcast(builder.gep(base, [offset]), VF.as_pointer())


def _lane_mask(builder, count):
    """Lanes ``[0, count)`` true."""
    undef = ir.Constant(VI, ir.Undefined)
    limit = builder.insert_element(undef, builder.trunc(count, _I32), ir.Constant(_I32, 0))
    limit = builder.shuffle_vector(limit, undef, ir.Constant(VI, [0] * LANES))
    return builder.icmp_signed("<", ir.Constant(VI, list(range(LANES))), limit)


def _half(builder, vec, lanes, upper):
    """The lower or upper ``lanes`` lanes of ``vec``."""
    start = lanes if upper else 0
    mask = ir.Constant(ir.VectorType(_I32, lanes), list(range(start, start + lanes)))
    return builder.shuffle_vector(vec, ir.Constant(vec.type, ir.Undefined), mask)


@intrinsic
def _tile_max(typingctx, row, t0, stop, init):
    """``max(init, row[t0:stop])`` (16 lanes, then across them: the max of a set, whatever the order)."""
    if not (isinstance(row, types.Array) and row.layout == "C" and row.dtype == types.float32):
        return None
    sig = types.float32(row, types.int64, types.int64, types.float32)

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        t0, stop, init = args[1], args[2], args[3]
        i64 = t0.type
        base = builder.gep(arr.data, [t0])
        count = builder.sub(stop, t0)
        full = builder.udiv(count, i64(LANES))
        slot = cgutils.alloca_once_value(builder, _splat(builder, init))
        with cgutils.for_range(builder, full) as loop:
            x = builder.load(_chunk_ptr(builder, base, loop.index), align=4)
            cur = builder.load(slot)
            builder.store(builder.select(builder.fcmp_ordered(">", x, cur), x, cur), slot)
        rest = builder.sub(count, builder.mul(full, i64(LANES)))
        with builder.if_then(builder.icmp_signed(">", rest, i64(0))):
            x = builder.load(_chunk_ptr(builder, base, full), align=4)
            x = builder.select(_lane_mask(builder, rest), x, _splat(builder, init))
            cur = builder.load(slot)
            builder.store(builder.select(builder.fcmp_ordered(">", x, cur), x, cur), slot)
        vec = builder.load(slot)
        best = init
        for i in range(LANES):
            e = builder.extract_element(vec, ir.Constant(_I32, i))
            best = builder.select(builder.fcmp_ordered(">", e, best), e, best)
        return best

    return sig, codegen


def _tile_exp_sum_codegen(vec_exp, reduce):
    """Codegen of a ``(row, t0, stop, top) -> float32`` tile intrinsic: ``row[p] = vec_exp(row[p] - top)`` for p in
    ``[t0, stop)``, zeros up to the next multiple of 16 from t0, the exponentials summed in 16 lanes (lane = p mod 16,
    t0 a multiple of 16; each lane from 0 in order of p) and the lanes summed by ``reduce(builder, vec)``."""
    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        t0, stop, top = args[1], args[2], args[3]
        i64 = t0.type
        base = builder.gep(arr.data, [t0])
        count = builder.sub(stop, t0)
        full = builder.udiv(count, i64(LANES))
        vtop = _splat(builder, top)
        slot = cgutils.alloca_once_value(builder, _vconst(0.0))
        with cgutils.for_range(builder, full) as loop:
            ptr = _chunk_ptr(builder, base, loop.index)
            e = vec_exp(builder, builder.fsub(builder.load(ptr, align=4), vtop))
            builder.store(e, ptr, align=4)
            builder.store(builder.fadd(builder.load(slot), e), slot)
        rest = builder.sub(count, builder.mul(full, i64(LANES)))
        with builder.if_then(builder.icmp_signed(">", rest, i64(0))):
            ptr = _chunk_ptr(builder, base, full)
            e = vec_exp(builder, builder.fsub(builder.load(ptr, align=4), vtop))
            e = builder.select(_lane_mask(builder, rest), e, _vconst(0.0))  # + 0.0 leaves a lane's sum as it is
            builder.store(e, ptr, align=4)
            builder.store(builder.fadd(builder.load(slot), e), slot)
        return reduce(builder, builder.load(slot))

    return codegen


def _is_tile_row(row) -> bool:
    return isinstance(row, types.Array) and row.layout == "C" and row.dtype == types.float32


def _reduce_as_avx512(builder, vec):
    """The 16 lanes summed as ``_mm512_reduce_add_ps`` does (halves, quarters, pairs, then the last two)."""
    a = builder.fadd(_half(builder, vec, 8, False), _half(builder, vec, 8, True))
    b = builder.fadd(_half(builder, a, 4, False), _half(builder, a, 4, True))
    c = builder.fadd(_half(builder, b, 2, False), _half(builder, b, 2, True))
    return builder.fadd(builder.extract_element(c, ir.Constant(_I32, 0)),
                        builder.extract_element(c, ir.Constant(_I32, 1)))


def _reduce_in_two_halves(builder, vec):
    """The 16 lanes summed as vLLM's AVX2 build does: lanes 0-7 in order, lanes 8-15 in order, then the two."""
    halves = []
    for start in (0, LANES // 2):
        total = builder.extract_element(vec, ir.Constant(_I32, start))
        for i in range(start + 1, start + LANES // 2):
            total = builder.fadd(total, builder.extract_element(vec, ir.Constant(_I32, i)))
        halves.append(total)
    return builder.fadd(halves[0], halves[1])


@intrinsic
def _tile_exp_sum(typingctx, row, t0, stop, top):
    """AVX-512 profile: :func:`_tile_exp_sum_codegen` with vLLM's ``fast_exp``, the lanes reduced as
    ``_mm512_reduce_add_ps`` does."""
    if not _is_tile_row(row):
        return None
    return (types.float32(row, types.int64, types.int64, types.float32),
            _tile_exp_sum_codegen(_vec_fast_exp, _reduce_as_avx512))


# glibc's expf (sysdeps/ieee754/flt-32/e_expf.c, x86-64's FMA build): x / ln2 = k / 32 + r / 32 in double, 2^(k/32) from
# a 32-entry table of 2^(i/32) with the exponent bits of k added, 2^(r/32) a cubic; the compiler fuses the product
# into ``r`` (r = fma(x, 32 / ln2, -k)) and into the cubic's multiply-adds. Checked against libm at start-up.
_EXP2F_BITS = 5
_EXPF_INV_LN2_N = float.fromhex("0x1.71547652b82fep+0") * (1 << _EXP2F_BITS)
_EXPF_SHIFT = float.fromhex("0x1.8p+52")
_EXPF_POLY = (float.fromhex("0x1.c6af84b912394p-5") / 32 ** 3, float.fromhex("0x1.ebfce50fac4f3p-3") / 32 ** 2,
              float.fromhex("0x1.62e42ff0c52d6p-1") / 32)
_EXPF_UNDERFLOW = float.fromhex("-0x1.9fe368p6")  # below log(2^-150): 0
_EXPF_OVERFLOW = float.fromhex("0x1.62e42ep6")  # above log(2^128): inf
_F64 = ir.DoubleType()
_I64 = ir.IntType(64)
VD = ir.VectorType(_F64, LANES)
VL = ir.VectorType(_I64, LANES)


def _exp2_table() -> list[int]:
    """Bits of 2^(i/32), rounded to double, less i/32 of the exponent field (the table of glibc's expf)."""
    import decimal

    context = decimal.Context(prec=50)
    table = []
    for i in range(1 << _EXP2F_BITS):
        value = float(context.power(decimal.Decimal(2), decimal.Decimal(i) / (1 << _EXP2F_BITS)))
        bits = int(np.float64(value).view(np.uint64))
        table.append((bits - (i << 52) // (1 << _EXP2F_BITS)) % (1 << 64))
    return table


def _vec_libm_expf(builder, x):
    """libm's ``expf`` (glibc's, above) of 16 float lanes, bit for bit."""
    module = builder.module

    def dconst(value):
        return ir.Constant(VD, [float(value)] * LANES)

    def fma(a, b, c):
        return builder.call(cgutils.get_or_insert_function(module, ir.FunctionType(VD, [VD] * 3), "llvm.fma.v16f64"),
                            [a, b, c])

    xd = builder.fpext(x, VD)
    z = builder.fmul(xd, dconst(_EXPF_INV_LN2_N))
    kd = builder.fadd(z, dconst(_EXPF_SHIFT))  # rounds z to an integer, in kd's low bits
    ki = builder.bitcast(kd, VL)
    kd = builder.fsub(kd, dconst(_EXPF_SHIFT))
    r = fma(xd, dconst(_EXPF_INV_LN2_N), builder.fneg(kd))
    name = "vllm_treespec_exp2f_table"
    table = module.globals.get(name)
    if table is None:
        table = ir.GlobalVariable(module, ir.ArrayType(_I64, 1 << _EXP2F_BITS), name)
        table.initializer = ir.Constant(ir.ArrayType(_I64, 1 << _EXP2F_BITS), _exp2_table())
        table.global_constant = True
        table.linkage = "internal"
    index = builder.and_(ki, ir.Constant(VL, [(1 << _EXP2F_BITS) - 1] * LANES))
    t = ir.Constant(VL, ir.Undefined)
    for lane in range(LANES):  # llvmlite has no vector GEP: one load per lane
        i = builder.extract_element(index, ir.Constant(_I32, lane))
        t = builder.insert_element(t, builder.load(builder.gep(table, [_I64(0), i])), ir.Constant(_I32, lane))
    t = builder.add(t, builder.shl(ki, ir.Constant(VL, [52 - _EXP2F_BITS] * LANES)))
    c0, c1, c2 = (dconst(c) for c in _EXPF_POLY)
    y = fma(fma(c0, r, c1), builder.fmul(r, r), fma(c2, r, dconst(1.0)))
    out = builder.fptrunc(builder.fmul(y, builder.bitcast(t, VD)), VF)
    out = builder.select(builder.fcmp_ordered("<", x, _vconst(_EXPF_UNDERFLOW)), _vconst(0.0), out)
    out = builder.select(builder.fcmp_ordered(">", x, _vconst(_EXPF_OVERFLOW)), _vconst(float("inf")), out)
    return builder.select(builder.fcmp_unordered("uno", x, x), builder.fadd(x, x), out)


@intrinsic
def _tile_libm_exp_sum(typingctx, row, t0, stop, top):
    """AVX2 profile: :func:`_tile_exp_sum_codegen` with libm's ``expf`` 16 at a time (:func:`_vec_libm_expf`), the
    lanes reduced as vLLM's AVX2 build does."""
    if not _is_tile_row(row):
        return None
    return (types.float32(row, types.int64, types.int64, types.float32),
            _tile_exp_sum_codegen(_vec_libm_expf, _reduce_in_two_halves))


@intrinsic
def _libm_exp_lanes(typingctx, src, dst):
    """``dst[i] = expf(src[i])`` through :func:`_vec_libm_expf`, 16 at a time (sizes a multiple of 16)."""
    if not all(isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.float32 for a in (src, dst)):
        return None
    sig = types.void(src, dst)

    def codegen(context, builder, signature, args):
        s = context.make_array(signature.args[0])(context, builder, args[0])
        d = context.make_array(signature.args[1])(context, builder, args[1])
        with cgutils.for_range(builder, builder.udiv(builder.extract_value(s.shape, 0), _I64(LANES))) as loop:
            builder.store(_vec_libm_expf(builder, builder.load(_chunk_ptr(builder, s.data, loop.index), align=4)),
                          _chunk_ptr(builder, d.data, loop.index), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _vector_and_libm_expf(x, vector, libm):
    _libm_exp_lanes(x, vector)
    for i in range(x.size):
        libm[i] = math.exp(x[i])


@functools.cache
def vector_expf_agrees(samples: int = 1 << 20) -> bool:
    """Whether :func:`_vec_libm_expf` gives this process's libm ``expf`` bits (the one numba and vLLM's AVX2 build
    call) on every one of ``samples`` floats spread over the range an exponential of the softmax sees, and on the
    special values. (It did on every float in [-104, 89] with glibc 2.36.)"""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-110.0, 10.0, samples).astype(np.float32),
                        np.array([0.0, -0.0, -np.inf, np.inf, np.nan, _EXPF_UNDERFLOW, _EXPF_OVERFLOW, -87.5,
                                  np.finfo(np.float32).min, 8.0, -8.0, 1e-30, -1e-30, -103.5, 88.0, 1.0],
                                 np.float32)])
    x = x[: x.size // LANES * LANES]
    vector, libm = np.empty_like(x), np.empty_like(x)
    _vector_and_libm_expf(x, vector, libm)
    return bool(np.array_equal(vector.view(np.uint32), libm.view(np.uint32)))


def kernel_summary() -> str:
    """The kernel's version, and whether its AVX2 exponentials run 16 at a time in this process."""
    return f"{KERNEL_VERSION}{' vector-expf' if vector_expf_agrees() else ''}"


@njit(cache=True, nogil=True, boundscheck=False)
def _softmax_tile(row, t0, stop, t1, running_max, total, lanes, profile):
    """One KV tile of vLLM's online softmax for one query vector: the logits ``row[t0:stop]`` become exponentials and
    ``row[stop:t1]`` zeros. Returns the new running max and sum, and the factor the partial output must be
    multiplied by before this tile's P @ V (1 when the max stayed)."""
    zero = np.float32(0.0)
    tile_max = _tile_max(row, t0, stop, running_max)
    rescale = running_max - tile_max
    need_rescale = rescale < np.float32(-8.0)
    top = tile_max if need_rescale else running_max
    last = np.uint64(stop)
    if _is_avx512(profile):
        tile_sum = _tile_exp_sum(row, t0, stop, top)
        last = np.uint64(min(t0 + (stop - t0 + 15) // 16 * 16, t1))  # written by _tile_exp_sum
    elif _vector_exp(profile):
        tile_sum = _tile_libm_exp_sum(row, t0, stop, top)
        last = np.uint64(min(t0 + (stop - t0 + 15) // 16 * 16, t1))  # written by _tile_libm_exp_sum
    else:
        for i in range(16):
            lanes[i] = zero
        for p in range(np.uint64(t0), last):
            e = np.float32(math.exp(row[p] - top))
            row[p] = e
            lanes[p & np.uint64(15)] = lanes[p & np.uint64(15)] + e
        low = zero
        high = zero
        for i in range(8):
            low = low + lanes[i]
            high = high + lanes[8 + i]
        tile_sum = low + high
    for p in range(last, np.uint64(t1)):
        row[p] = zero
    if not need_rescale:
        return top, total + tile_sum, np.float32(1.0)
    factor = np.float32(math.exp(rescale))
    if _is_avx512(profile):
        return top, _fma(total, factor, tile_sum), factor
    return top, tile_sum + factor * total, factor


@njit(cache=True, nogil=True, boundscheck=False)
def tree_attention_rows(query, cache, output, q_start, num_rows, context_len, block_ids, ancestors, kv_tile, scale,
                        block_size, profile, rounding):
    """Attention of every tree row, written into ``output``; use it through :func:`run`.

    query and output ``[T, Hq, D]`` (float32, or bf16 bits as uint16; any strides); cache ``[NB, Hkv, 2 * bs * D]``,
    C-contiguous (vLLM's VEC layout per block and KV head: K as ``[D, bs]``, then V as ``[bs, D]``). Per tree request
    r: its first query row ``q_start[r]``, ``num_rows[r]`` rows (root + nodes), ``context_len[r]`` committed tokens
    (the root sits at that position, node i at the next ones), ``block_ids[r]`` its block table row,
    ``ancestors[r, i, j]`` whether row i sees tree row j, ``kv_tile[r]`` vLLM's KV tile length for it.
    ``profile``: :data:`AVX512_MARK`, :data:`AVX2_MARK` or :data:`AVX2_VECTOR_EXP_MARK`; ``rounding``: :data:`RNE_MARK` or :data:`TRUNC_MARK`.
    """
    hq = query.shape[1]
    d = query.shape[2]
    hkv = cache.shape[1]
    slab = cache.shape[2]
    flat = cache.reshape(-1)
    g = hq // hkv
    bs = block_size
    k_size = bs * d
    scale32 = np.float32(scale)
    zero = np.float32(0.0)
    neg_inf = np.float32(-np.inf)
    logits = np.zeros((4, block_ids.shape[1] * bs), np.float32)
    q_buf = np.zeros((4, d), np.float32)
    acc = np.zeros((4, d), np.float32)
    lanes = np.zeros(16, np.float32)
    ends = np.zeros(4, np.int64)
    running_max = np.zeros(4, np.float32)
    total = np.zeros(4, np.float32)
    for r in range(q_start.shape[0]):
        ctx = context_len[r]
        first_row = q_start[r]
        tile = kv_tile[r]
        vectors = num_rows[r] * g
        for hk in range(hkv):
            for v0 in range(0, vectors, 4):
                count = min(4, vectors - v0)
                for m in range(4):
                    running_max[m] = LOWEST
                    total[m] = zero
                    if m < count:
                        v = v0 + m
                        row = first_row + v // g
                        head = hk * g + v % g
                        for i in range(d):
                            q_buf[m, i] = _widen(query[row, head, i]) * scale32
                        ends[m] = ctx + v // g + 1
                    else:  # padding vector: zero query, no positions
                        for i in range(d):
                            q_buf[m, i] = zero
                        ends[m] = 0
                length = ends[count - 1]
                for b in range((length + bs - 1) // bs):
                    p0 = b * bs
                    _qk_block(q_buf, flat, logits, (block_ids[r, b] * hkv + hk) * slab, p0, min(bs, length - p0), bs,
                              profile)
                for m in range(count):  # tree positions other than the row's ancestors (and itself) see nothing
                    tree_row = (v0 + m) // g
                    for j in range(tree_row + 1):
                        if not ancestors[r, tree_row, j]:
                            logits[m, ctx + j] = neg_inf
                for t0 in range(0, length, tile):
                    t1 = min(t0 + tile, length)
                    for m in range(4):
                        stop = max(min(t1, ends[m]), t0)  # a vector whose row ends before the tile weighs zeros
                        running_max[m], total[m], factor = _softmax_tile(logits[m], t0, stop, t1, running_max[m],
                                                                         total[m], lanes, profile)
                        if t0 == 0:
                            for i in range(d):
                                acc[m, i] = zero
                        elif factor != np.float32(1.0):
                            for i in range(d):
                                acc[m, i] = acc[m, i] * factor
                    p = t0
                    while p < t1:  # P @ V, block segment by block segment
                        b = p // bs
                        seg_end = min(t1, (b + 1) * bs)
                        v_off = (block_ids[r, b] * hkv + hk) * slab + k_size + (p - b * bs) * d
                        _pv_segment(logits, flat, acc, v_off, p, seg_end - p, profile)
                        p = seg_end
                for m in range(count):
                    v = v0 + m
                    row = first_row + v // g
                    head = hk * g + v % g
                    inv = np.float32(1.0 / np.float64(total[m]))
                    for i in range(d):
                        output[row, head, i] = _narrow(inv * acc[m, i], output[row, head, i], rounding)


def run(query, cache, output, q_start, num_rows, context_len, block_ids, ancestors, kv_tile, scale: float,
        block_size: int, avx512: bool, rne: bool, vector_exp: bool = False) -> None:
    """:func:`tree_attention_rows` with the arithmetic profile given as booleans (see the module docstring);
    ``vector_exp``: the AVX2 profile's exponentials 16 at a time (only where :func:`vector_expf_agrees`)."""
    profile = AVX512_MARK if avx512 else (AVX2_VECTOR_EXP_MARK if vector_exp else AVX2_MARK)
    tree_attention_rows(query, cache, output, q_start, num_rows, context_len, block_ids, ancestors, kv_tile, scale,
                        block_size, profile, RNE_MARK if rne else TRUNC_MARK)


def kv_tile_length(num_rows: int, q_heads_per_kv: int, head_dim: int, kv_elem_size: int, isa: str,
                   l2_bytes: int | None = None) -> int:
    """vLLM's KV tile length for a request of ``num_rows`` query rows handled as one work item (one thread):
    ``AttentionScheduler::calcu_tile_size_with_constant_q`` with half the L2 cache."""
    max_q_per_iter, align = (16, 16) if isa == "vec16" else (8, 32)
    heads = q_heads_per_kv if max_q_per_iter % q_heads_per_kv == 0 else 1  # vLLM falls back to one head per tile
    cache = (l2_bytes if l2_bytes is not None else l2_cache_bytes()) >> 1
    rounded = -(-num_rows * heads // max_q_per_iter) * max_q_per_iter
    fixed = cache - rounded * head_dim * (4 + 4)
    if rounded <= max_q_per_iter:
        tile = fixed // (4 * max_q_per_iter)
    else:
        tile = fixed // (4 * max_q_per_iter + 2 * head_dim * kv_elem_size)
    return max(tile // align * align, align)


_SC_LEVEL2_CACHE_SIZE = 191  # glibc's constant (bits/confname.h)


@functools.cache  # asked per tree request and step (kv_tile_length); loading libc each time cost ~0.1 ms
def l2_cache_bytes() -> int:
    """The per-core L2 size vLLM's scheduler sizes tiles from (glibc's sysconf, else sysfs); 256 KiB if unknown."""
    size = 0
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.sysconf.restype = ctypes.c_long
        size = int(libc.sysconf(_SC_LEVEL2_CACHE_SIZE))
    except (OSError, AttributeError):
        size = 0
    if size <= 0:
        try:
            with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as f:
                text = f.read().strip()
            size = int(text[:-1]) * 1024 if text.endswith("K") else int(text)
        except (OSError, ValueError):
            size = 0
    return size if size > 0 else 256 * 1024
