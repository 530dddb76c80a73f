"""Numba path of the fused dequantize x matmul (the "numba" ISA of cpufuse.quant.matmul).

Semantics: docs/quant-design.md; formats and arithmetic: docs/semantics.md §8, §9.

Each weight row is decoded once per task into a K-long scratch (`_unpack`): integer codes plus
per-block scales, and in f32 mode also the f32 values, bit-identical to gguf.quants.dequantize
(same grouping: Q4_1 f32(f32(d*q) + m), K-quants f32(f32(d*sc)*q - f32(dmin*m)), ...). That row is
then dotted with each activation row of the task (`_rowdot`), in float64:
 - f32 mode: exact f64 products of the f32 values, summed in 32 f64 lanes (`_fdot8` gives the
   order); F32/F16/BF16 weights always use it;
 - q8 mode (docs/semantics.md §9): the activation rows are quantized once per call and per vec_dot
   kind (Q8_0 and Q8_1 share codes and d; Q8_K) into a scratch; exact integer block sums, then
     Q4_0/Q5_0/Q8_0:  y = sum_b d_w*d_a*I_b
     Q4_1/Q5_1:       y = sum_b (d_w*d_a*I_b + m_w*s_a)
     Q4_K/Q5_K:       y = sum_b d_a*(d_w*sum_j sc_j*I_j - dmin_w*sum_j m_j*(bs_2j + bs_2j+1))
     Q6_K, Q3_K:      y = sum_b d_a*d_w*sum_j sc_j*I_j  (signed codes, 16 sub-blocks)
     Q2_K:            y = sum_b d_a*(d_w*sum_j sc_j*I_j - dmin_w*sum_j m_j*bs_j)  (16 sub-blocks)
     IQ4_NL, MXFP4:   as Q4_0, codes = the table values (MXFP4: d_w = 2^(e-128)); IQ4_XS: as Q4_K
                      without the mins
   in f64 (d_w*d_a and m_w*s_a are exact there, a product with an integer sum rounds at most
   once), accumulated in f64 in block order.
The f64 sum is rounded to f32 once per output, so both modes sit within about one f32 rounding
of their float64 references (ggml and the C kernels scale and accumulate in f32 instead; the
difference is far inside the L0 tolerance of docs/semantics.md §9). The swiglu epilogue
silu(g)*u = g/(1+exp(-g))*u runs in f32 on the two rounded dots. The optional RMS norm prologue
writes rms_norm(x)*w to a private scratch with the arithmetic of cpufuse.numba.kernels.rms_norm, so the
fused result equals cpufuse.rms_norm (isa="numba") followed by the matmul, bit for bit.

Work split: tasks of (up to) _CO output columns x _CR activation rows under prange; the cut does
not depend on the thread count and every output is one full-K dot computed the same way, so the
result is bit-identical for every n_threads.

The inner loops (nibble unpack, int8 dot, int8 -> f32 scaling, f32 dot) are small numba
intrinsics that emit LLVM vector IR: numba's own pipeline leaves such short fixed-length loops
scalar (its SLP vectorizer is off), which cost about 6x in the dots. All arithmetic in them is
either exact integer math or elementwise f32/f64 with the same rounding as the scalar code.

Arrays reach the kernels in one layout each (flat 1-D f32 views with a row stride for x and the
outputs, read-only C-contiguous uint8 2-D for the weights, dummies for absent operands) and type
ids are runtime ints, so each kernel compiles once per machine (cache=True).
"""
import math

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numpy.lib.stride_tricks import as_strided

from ..quant.types import ACT_QTYPES, CODE_OFFSET, KVALUES_IQ4NL, KVALUES_MXFP4, QTYPES

_JIT = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
_PJIT = dict(_JIT, parallel=True)

_CO = 16  # output columns per task
_CR = 64  # activation rows per task

# The type table (cpufuse.quant.types) as module constants, which numba freezes into the compiled
# code: ggml ids of the weight types (GT_*) and activation types (QA_*), bytes per block (QB_*), the
# code offsets (OFF_*) and elements per block by type id (_BLK).
_ID = {n: t.type_id for n, t in QTYPES.items()}
_QB = {n: t.type_size for n, t in list(QTYPES.items()) + list(ACT_QTYPES.items())}
GT_F32, GT_F16, GT_BF16 = _ID["F32"], _ID["F16"], _ID["BF16"]
GT_Q4_0, GT_Q4_1, GT_Q5_0, GT_Q5_1, GT_Q8_0 = _ID["Q4_0"], _ID["Q4_1"], _ID["Q5_0"], _ID["Q5_1"], _ID["Q8_0"]
GT_Q2_K, GT_Q3_K, GT_Q4_K, GT_Q5_K, GT_Q6_K = _ID["Q2_K"], _ID["Q3_K"], _ID["Q4_K"], _ID["Q5_K"], _ID["Q6_K"]
GT_IQ4_NL, GT_IQ4_XS, GT_MXFP4 = _ID["IQ4_NL"], _ID["IQ4_XS"], _ID["MXFP4"]
QA_Q8_0, QA_Q8_1, QA_Q8_K = (ACT_QTYPES[n].type_id for n in ("Q8_0", "Q8_1", "Q8_K"))
QB_Q4_0, QB_Q4_1, QB_Q5_0, QB_Q5_1, QB_Q8_0 = _QB["Q4_0"], _QB["Q4_1"], _QB["Q5_0"], _QB["Q5_1"], _QB["Q8_0"]
QB_Q2_K, QB_Q3_K, QB_Q4_K, QB_Q5_K, QB_Q6_K = _QB["Q2_K"], _QB["Q3_K"], _QB["Q4_K"], _QB["Q5_K"], _QB["Q6_K"]
QB_IQ4_NL, QB_IQ4_XS, QB_Q8_1, QB_Q8_K = _QB["IQ4_NL"], _QB["IQ4_XS"], _QB["Q8_1"], _QB["Q8_K"]
QB_MXFP4 = _QB["MXFP4"]
OFF_Q4_0, OFF_Q5_0, OFF_Q6_K = CODE_OFFSET["Q4_0"], CODE_OFFSET["Q5_0"], CODE_OFFSET["Q6_K"]
_BLK = np.zeros(max(_ID.values()) + 1, np.int64)
for _t in QTYPES.values():
    _BLK[_t.type_id] = _t.block_size
_VEC_DOT = {t.type_id: ACT_QTYPES[t.vec_dot_type].type_id for t in QTYPES.values() if t.vec_dot_type}

# IQ4_NL / IQ4_XS code -> value (ggml's kvalues_iq4nl); MXFP4's (the doubled E2M1 values)
_KV = KVALUES_IQ4NL
_KV_MX = KVALUES_MXFP4

# binary16 exponent field e -> 2^(e-25) (e = 0: 2^-24, the subnormal quantum)
_P2 = np.array([2.0 ** -24] + [2.0 ** (e - 25) for e in range(1, 32)], np.float64)

F32 = np.float32


# --------------------------------------------------------------------------------------------
# vector intrinsics (unchecked: callers keep every access inside the arrays)

_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_F32, _F64 = ir.FloatType(), ir.DoubleType()
_i64 = types.int64


def _c(v, ty=_I64):
    return ir.Constant(ty, v)


def _at(context, builder, aty, aval, off, vty):
    """pointer to a vty vector at element `off` (an i64) of the array aval"""
    ary = context.make_array(aty)(context, builder, aval)
    return builder.bitcast(builder.gep(ary.data, [off]), vty.as_pointer())


def _splat(builder, val, n):
    vty = ir.VectorType(val.type, n)
    undef = ir.Constant(vty, ir.Undefined)
    v = builder.insert_element(undef, val, _c(0, _I32))
    return builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _args(context, builder, sig, args, want):
    """cast the scalar arguments to the types in `want` (None: leave as is, e.g. arrays)"""
    return [a if w is None else context.cast(builder, a, t, w) for a, t, w in zip(args, sig.args, want)]


@intrinsic
def _idot(typingctx, w, wo, a, ao, n16):
    """sum_{k < 16*n16} w[wo+k] * a[ao+k] over int8 arrays, as int64 (exact)"""
    def codegen(context, builder, sig, args):
        w_, wo_, a_, ao_, n_ = _args(context, builder, sig, args, [None, _i64, None, _i64, _i64])
        v8, v32 = ir.VectorType(_I8, 16), ir.VectorType(_I32, 16)
        acc = cgutils.alloca_once_value(builder, ir.Constant(v32, None))
        with cgutils.for_range(builder, n_) as loop:
            off = builder.mul(loop.index, _c(16))
            x = builder.load(_at(context, builder, sig.args[0], w_, builder.add(wo_, off), v8), align=1)
            y = builder.load(_at(context, builder, sig.args[2], a_, builder.add(ao_, off), v8), align=1)
            prod = builder.mul(builder.sext(x, v32), builder.sext(y, v32))
            builder.store(builder.add(builder.load(acc), prod), acc)
        fnty = ir.FunctionType(_I32, [v32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.vector.reduce.add.v16i32")
        return builder.sext(builder.call(fn, [builder.load(acc)]), _I64)
    return types.int64(w, wo, a, ao, n16), codegen


@intrinsic
def _fdot8(typingctx, x, xo, w, n8):
    """sum_{k < 8*n8} f64(x[xo+k]) * f64(w[k]) over f32 arrays: exact f64 products in four
    8-lane f64 accumulators A0..A3 (element k in A[(k div 8) mod 4] lane k mod 8; the chunks
    past the last full 32 go to A0), then A = (A0+A1) + (A2+A3) lanewise and the lanes
    ((a0+a4)+(a2+a6))+((a1+a5)+(a3+a7))"""
    def codegen(context, builder, sig, args):
        x_, xo_, w_, n_ = _args(context, builder, sig, args, [None, _i64, None, _i64])
        vf, vd = ir.VectorType(_F32, 8), ir.VectorType(_F64, 8)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vd, None)) for _ in range(4)]

        def step(acc, off):
            a = builder.load(_at(context, builder, sig.args[0], x_, builder.add(xo_, off), vf), align=4)
            b = builder.load(_at(context, builder, sig.args[2], w_, off, vf), align=4)
            prod = builder.fmul(builder.fpext(a, vd), builder.fpext(b, vd))
            builder.store(builder.fadd(builder.load(acc), prod), acc)

        n32 = builder.sdiv(n_, _c(4))
        with cgutils.for_range(builder, n32) as loop:
            base = builder.mul(loop.index, _c(32))
            for i in range(4):
                step(accs[i], builder.add(base, _c(8 * i)))
        base = builder.mul(n32, _c(32))
        with cgutils.for_range(builder, builder.sub(n_, builder.mul(n32, _c(4)))) as loop:
            step(accs[0], builder.add(base, builder.mul(loop.index, _c(8))))
        fa = builder.fadd
        ld = [builder.load(a) for a in accs]
        v = fa(fa(ld[0], ld[1]), fa(ld[2], ld[3]))
        ln = [builder.extract_element(v, _c(i, _I32)) for i in range(8)]
        return fa(fa(fa(ln[0], ln[4]), fa(ln[2], ln[6])), fa(fa(ln[1], ln[5]), fa(ln[3], ln[7])))
    return types.float64(x, xo, w, n8), codegen


@intrinsic
def _copy16(typingctx, src, so, dst, do, n16):
    """dst[do+k] = src[so+k] for k < 16*n16 (bytes; int8 or uint8 arrays)"""
    def codegen(context, builder, sig, args):
        src_, so_, dst_, do_, n_ = _args(context, builder, sig, args, [None, _i64, None, _i64, _i64])
        v8 = ir.VectorType(_I8, 16)
        with cgutils.for_range(builder, n_) as loop:
            off = builder.mul(loop.index, _c(16))
            v = builder.load(_at(context, builder, sig.args[0], src_, builder.add(so_, off), v8), align=1)
            builder.store(v, _at(context, builder, sig.args[2], dst_, builder.add(do_, off), v8), align=1)
        return context.get_dummy_value()
    return types.none(src, so, dst, do, n16), codegen


@intrinsic
def _cvt16(typingctx, q, qo, n16, d, m, wf):
    """wf[qo+k] = f32(f32(d * f32(q[qo+k])) + m) for k < 16*n16 (q int8; no contraction)"""
    def codegen(context, builder, sig, args):
        f32 = types.float32
        q_, qo_, n_, d_, m_, wf_ = _args(context, builder, sig, args, [None, _i64, _i64, f32, f32, None])
        v8, vf = ir.VectorType(_I8, 16), ir.VectorType(_F32, 16)
        dv, mv = _splat(builder, d_, 16), _splat(builder, m_, 16)
        with cgutils.for_range(builder, n_) as loop:
            off = builder.add(qo_, builder.mul(loop.index, _c(16)))
            c = builder.sitofp(builder.load(_at(context, builder, sig.args[0], q_, off, v8), align=1), vf)
            r = builder.fadd(builder.fmul(dv, c), mv)
            builder.store(r, _at(context, builder, sig.args[5], wf_, off, vf), align=4)
        return context.get_dummy_value()
    return types.none(q, qo, n16, d, m, wf), codegen


@intrinsic
def _nib16(typingctx, src, so, hsrc, ho, dst, dlo, dhi, slo, shi, hmask, off):
    """16 bytes b = src[so:so+16] and h = hsrc[ho:ho+16] (uint8) -> int8 codes
    dst[dlo+i] = ((b & 15) | (((h >> slo) & hmask) << 4)) - off,
    dst[dhi+i] = ((b >> 4) | (((h >> shi) & hmask) << 4)) - off   (hmask 0: plain nibbles)"""
    def codegen(context, builder, sig, args):
        src_, so_, hs_, ho_, dst_, dlo_, dhi_, slo_, shi_, hm_, off_ = _args(
            context, builder, sig, args, [None, _i64, None, _i64, None] + [_i64] * 6)
        v8 = ir.VectorType(_I8, 16)

        def sp(v):
            return _splat(builder, builder.trunc(v, _I8) if v.type != _I8 else v, 16)

        b = builder.load(_at(context, builder, sig.args[0], src_, so_, v8), align=1)
        h = builder.load(_at(context, builder, sig.args[2], hs_, ho_, v8), align=1)
        four, hm, o = sp(_c(4, _I8)), sp(hm_), sp(off_)
        hl = builder.shl(builder.and_(builder.lshr(h, sp(slo_)), hm), four)
        hh = builder.shl(builder.and_(builder.lshr(h, sp(shi_)), hm), four)
        lo = builder.or_(builder.and_(b, sp(_c(15, _I8))), hl)
        hi = builder.or_(builder.lshr(b, four), hh)
        builder.store(builder.sub(lo, o), _at(context, builder, sig.args[4], dst_, dlo_, v8), align=1)
        builder.store(builder.sub(hi, o), _at(context, builder, sig.args[4], dst_, dhi_, v8), align=1)
        return context.get_dummy_value()
    return types.none(src, so, hsrc, ho, dst, dlo, dhi, slo, shi, hmask, off), codegen


# --------------------------------------------------------------------------------------------
# scalars


@nb.njit(**_JIT)
def _h2f(h):
    """binary16 bits (an int) -> float32, exact"""
    e = (h >> 10) & 31
    m = h & 1023
    if e == 31:
        v = math.inf if m == 0 else math.nan
    else:
        v = np.float64(m + 1024 if e != 0 else m) * _P2[e]
    return np.float32(-v if h & 0x8000 else v)


@nb.njit(**_JIT)
def _f16r(v):
    """h2f(f2h(v)) for a float32 v: binary16 rounding to nearest even (overflow -> inf)"""
    a = abs(np.float64(v))
    if a != a or a == 0.0:
        return v
    if a >= 65520.0:
        a = math.inf
    else:
        _, e = math.frexp(a)  # a in [2^(e-1), 2^e)
        q = math.ldexp(1.0, max(e - 11, -24))
        a = np.rint(a / q) * q
    return np.float32(-a if v < 0 else a)


@nb.njit(**_JIT)
def _rd16(wb, o):
    return np.int64(wb[o]) | (np.int64(wb[o + 1]) << 8)


# --------------------------------------------------------------------------------------------
# activation rows (of a flat f32 buffer): RMS norm prologue and q8 quantization


@nb.njit(**_JIT)
def _norm_row(xf, xo, K, normw, have_nw, eps, xn, no):
    """xn[no:no+K] = rms_norm(x row) * norm_w, the arithmetic of cpufuse.numba.kernels.rms_norm:
    ss = sum of f32 squares in f64, s = f32(1) / f32(sqrt(f32(ss/K) + eps)), y = f32(x*s) * w"""
    ss = 0.0
    for i in range(K):
        v = xf[xo + i]
        ss += np.float64(v * v)
    mean = np.float32(ss / K)
    sc = np.float32(1.0) / np.float32(math.sqrt(mean + np.float32(eps)))
    for i in range(K):
        v = xf[xo + i] * sc
        if have_nw:
            v = v * normw[i]
        xn[no + i] = v


@nb.njit(**_JIT)
def _q8_32_row(x, xo, K, q, qo, d, s, bo):
    """Q8_0 codes and h2f(d_a) (ggml's x86 quantizer) plus the Q8_1 s_a, for one row"""
    for b in range(K // 32):
        o = xo + 32 * b
        amax = F32(0.0)
        for i in range(32):
            a = abs(x[o + i])
            if a > amax:
                amax = a
        db = amax / F32(127.0)
        idb = F32(127.0) / amax if amax != 0 else F32(0.0)
        tot = 0
        for i in range(32):
            v = np.rint(x[o + i] * idb)
            v = min(max(v, F32(-127.0)), F32(127.0))
            iv = np.int64(v)
            q[qo + 32 * b + i] = iv
            tot += iv
        d[bo + b] = _f16r(db)
        s[bo + b] = _f16r(db * F32(tot))


@nb.njit(**_JIT)
def _q8_k_row(x, xo, K, q, qo, d, bs, bo):
    """Q8_K (ggml's reference quantizer): codes, f32 d (negative when max > 0), 16-element sums"""
    for b in range(K // 256):
        o = xo + 256 * b
        e = qo + 256 * b
        amax = F32(0.0)
        mx = F32(0.0)
        for i in range(256):
            a = abs(x[o + i])
            if a > amax:
                amax = a
                mx = x[o + i]
        if amax == 0:
            d[bo + b] = F32(0.0)
            for i in range(256):
                q[e + i] = 0
        else:
            isc = F32(-127.0) / mx
            for i in range(256):
                v = np.rint(isc * x[o + i])
                q[e + i] = np.int64(min(v, F32(127.0)))
            d[bo + b] = F32(1.0) / isc
        for j in range(16):
            t = 0
            for i in range(16):
                t += np.int64(q[e + 16 * j + i])
            bs[16 * (bo + b) + j] = t


@nb.njit(**_JIT)
def _prologue(xf, xs, rows, K, normw, have_nw, eps, do_norm, xn,
              need32, aq32, ad32, sa32, needk, aqk, adk, bsk):
    """per row: the norm into xn (do_norm), then the q8 activations from x (or xn). Serial: it
    is O(rows*K) next to the O(rows*K*n_out) products, and a parallel loop here would cost
    seconds of extra JIT compilation."""
    for r in range(rows):
        if do_norm:
            _norm_row(xf, r * xs, K, normw, have_nw, eps, xn, r * K)
            src, so = xn, r * K
        else:
            src, so = xf, r * xs
        if need32:
            _q8_32_row(src, so, K, aq32, r * K, ad32, sa32, r * (K // 32))
        if needk:
            _q8_k_row(src, so, K, aqk, r * K, adk, bsk, r * (K // 256))


# --------------------------------------------------------------------------------------------
# weight rows


@nb.njit(**_JIT)
def _unpack(t, tof32, wb, K, wq, sd, sm, ssc, smn, wf, hb):
    """Decode one weight row (bytes wb, K elements). Quantized types: integer codes wq (signed
    for Q4_0/Q5_0/Q8_0/Q6_K, unsigned for the types with a min), scales sd (d), sm (m or dmin),
    sub-block scales ssc (8 or 16 per super-block, at 16*b) and mins smn (8 per super-block);
    with tof32 also the f32 values wf, bit-identical to gguf.quants.dequantize (same grouping).
    Float types: wf only. hb: a 16-byte scratch."""
    if t == GT_F32:
        wv = wb.view(np.float32)
        for k in range(K):
            wf[k] = wv[k]
        return
    if t == GT_F16:
        for k in range(K):
            wf[k] = _h2f(_rd16(wb, 2 * k))
        return
    if t == GT_BF16:
        wu = wf.view(np.uint32)
        for k in range(K):
            wu[k] = _rd16(wb, 2 * k) << 16
        return
    if t == GT_Q4_0 or t == GT_Q4_1 or t == GT_Q5_0 or t == GT_Q5_1:
        hasmin = t == GT_Q4_1 or t == GT_Q5_1
        five = t == GT_Q5_0 or t == GT_Q5_1
        bsz = (QB_Q5_1 if hasmin else QB_Q5_0) if five else (QB_Q4_1 if hasmin else QB_Q4_0)
        qo = (4 if hasmin else 2) + (4 if five else 0)
        off = 0 if hasmin else (OFF_Q5_0 if five else OFF_Q4_0)
        for b in range(K // 32):
            o = bsz * b
            e = 32 * b
            sd[b] = _h2f(_rd16(wb, o))
            if hasmin:
                sm[b] = _h2f(_rd16(wb, o + 2))
            if five:  # bit e of qh is the 5th bit of element e: hb[i] = bit i | bit (i+16) << 1
                ho = o + qo - 4
                qh = _rd16(wb, ho) | (_rd16(wb, ho + 2) << 16)
                for i in range(16):
                    hb[i] = ((qh >> i) & 1) | (((qh >> (i + 16)) & 1) << 1)
                _nib16(wb, o + qo, hb, 0, wq, e, e + 16, 0, 1, 1, off)
            else:
                _nib16(wb, o + qo, wb, o + qo, wq, e, e + 16, 0, 0, 0, off)
        if tof32:
            for b in range(K // 32):
                _cvt16(wq, 32 * b, 2, sd[b], sm[b] if hasmin else F32(-0.0), wf)
    elif t == GT_Q8_0:
        for b in range(K // 32):
            o = QB_Q8_0 * b
            sd[b] = _h2f(_rd16(wb, o))
            _copy16(wb, o + 2, wq, 32 * b, 2)
        if tof32:
            for b in range(K // 32):
                _cvt16(wq, 32 * b, 2, sd[b], F32(-0.0), wf)
    elif t == GT_Q4_K or t == GT_Q5_K:
        five = t == GT_Q5_K
        bsz = QB_Q5_K if five else QB_Q4_K
        for b in range(K // 256):
            o = bsz * b
            e = 256 * b
            sd[b] = _h2f(_rd16(wb, o))
            sm[b] = _h2f(_rd16(wb, o + 2))
            c = o + 4
            for j in range(4):  # get_scale_min_k4 (docs/semantics.md §8)
                b0 = np.int64(wb[c + j])
                b4 = np.int64(wb[c + j + 4])
                b8 = np.int64(wb[c + j + 8])
                ssc[16 * b + j] = b0 & 63
                smn[8 * b + j] = b4 & 63
                ssc[16 * b + j + 4] = (b8 & 15) | ((b0 >> 6) << 4)
                smn[8 * b + j + 4] = (b8 >> 4) | ((b4 >> 6) << 4)
            qo = o + (48 if five else 16)
            for p in range(4):  # sub-blocks 2p (low nibbles) and 2p+1 (high nibbles)
                for h in range(0, 32, 16):  # 5th bit of sub-block s: bit s of qh[l]
                    _nib16(wb, qo + 32 * p + h, wb, o + 16 + h, wq, e + 64 * p + h, e + 64 * p + 32 + h,
                           2 * p, 2 * p + 1, 1 if five else 0, 0)
            if tof32:
                for j in range(8):
                    dl = sd[b] * F32(ssc[16 * b + j])
                    ml = sm[b] * F32(smn[8 * b + j])
                    _cvt16(wq, e + 32 * j, 2, dl, -ml, wf)
    elif t == GT_IQ4_NL:  # the codes index _KV
        for b in range(K // 32):
            o = QB_IQ4_NL * b
            e = 32 * b
            sd[b] = _h2f(_rd16(wb, o))
            for i in range(16):
                v = wb[o + 2 + i]
                wq[e + i] = _KV[v & 15]
                wq[e + 16 + i] = _KV[v >> 4]
            if tof32:
                _cvt16(wq, e, 2, sd[b], F32(-0.0), wf)
    elif t == GT_MXFP4:  # f32(2^(e-128)) * value, the codes index _KV_MX
        for b in range(K // 32):
            o = QB_MXFP4 * b
            e = 32 * b
            sd[b] = np.float32(math.ldexp(1.0, np.int64(wb[o]) - 128))  # exact (subnormal for e < 2)
            for i in range(16):
                v = wb[o + 1 + i]
                wq[e + i] = _KV_MX[v & 15]
                wq[e + 16 + i] = _KV_MX[v >> 4]
            if tof32:
                _cvt16(wq, e, 2, sd[b], F32(-0.0), wf)
    elif t == GT_IQ4_XS:  # f32(d*(ls-32)) * value
        for b in range(K // 256):
            o = QB_IQ4_XS * b
            e = 256 * b
            sd[b] = _h2f(_rd16(wb, o))
            sm[b] = F32(0.0)
            sh = _rd16(wb, o + 2)
            for j in range(8):
                ls = ((np.int64(wb[o + 4 + j // 2]) >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)
                ssc[16 * b + j] = ls - 32
                smn[8 * b + j] = 0
                for i in range(16):
                    v = wb[o + 8 + 16 * j + i]
                    wq[e + 32 * j + i] = _KV[v & 15]
                    wq[e + 32 * j + 16 + i] = _KV[v >> 4]
                if tof32:
                    _cvt16(wq, e + 32 * j, 2, sd[b] * F32(ssc[16 * b + j]), F32(-0.0), wf)
    elif t == GT_Q2_K or t == GT_Q3_K:  # element 128h + 32g + l at bits 2g of qs[32h + l]
        q3 = t == GT_Q3_K
        bsz = QB_Q3_K if q3 else QB_Q2_K
        qo = 32 if q3 else 16
        for b in range(K // 256):
            o = bsz * b
            e = 256 * b
            if q3:
                sd[b] = _h2f(_rd16(wb, o + 108))
                for j in range(16):
                    lo = (np.int64(wb[o + 96 + j]) & 15) if j < 8 else (np.int64(wb[o + 88 + j]) >> 4)
                    hi = (np.int64(wb[o + 104 + (j & 3)]) >> (2 * (j >> 2))) & 3
                    ssc[16 * b + j] = (lo | (hi << 4)) - 32
            else:
                sd[b] = _h2f(_rd16(wb, o + 80))
                sm[b] = _h2f(_rd16(wb, o + 82))
                for j in range(16):
                    v = np.int64(wb[o + j])
                    ssc[16 * b + j] = v & 15
                    smn[16 * b + j] = v >> 4
            for h in range(2):
                for g in range(4):
                    for l in range(32):
                        c = (np.int64(wb[o + qo + 32 * h + l]) >> (2 * g)) & 3
                        if q3 and ((np.int64(wb[o + l]) >> (4 * h + g)) & 1) == 0:
                            c -= 4
                        wq[e + 128 * h + 32 * g + l] = c
            if tof32:
                for j in range(16):
                    dl = sd[b] * F32(ssc[16 * b + j])
                    ml = sm[b] * F32(smn[16 * b + j]) if not q3 else F32(0.0)
                    _cvt16(wq, e + 16 * j, 1, dl, -ml, wf)
    elif t == GT_Q6_K:
        for b in range(K // 256):
            o = QB_Q6_K * b
            e = 256 * b
            sd[b] = _h2f(_rd16(wb, o + 208))
            for j in range(16):
                v = np.int64(wb[o + 192 + j])
                ssc[16 * b + j] = v - 256 if v >= 128 else v
            for h in range(2):  # groups g: low bits ql[64h + 32(g%2) + l], high (qh[32h+l] >> 2g) & 3
                for l in range(0, 32, 16):
                    g = e + 128 * h + l
                    _nib16(wb, o + 64 * h + l, wb, o + 128 + 32 * h + l, wq, g, g + 64, 0, 4, 3, OFF_Q6_K)
                    _nib16(wb, o + 64 * h + 32 + l, wb, o + 128 + 32 * h + l, wq, g + 32, g + 96, 2, 6, 3,
                           OFF_Q6_K)
            if tof32:
                for j in range(16):
                    _cvt16(wq, e + 16 * j, 1, sd[b] * F32(ssc[16 * b + j]), F32(-0.0), wf)


# --------------------------------------------------------------------------------------------
# one decoded weight row against one activation row


@nb.njit(**_JIT)
def _rowdot(path, t, K, x, xo, wf, wq, sd, sm, ssc, smn, r, aq32, ad32, sa32, aqk, adk, bsk):
    """float64 dot of the decoded weight row with activation row r (x at offset xo); path 0: f32
    mode, 1: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 x Q8_0/Q8_1, 2: K-quants x Q8_K (module docstring)"""
    if path == 0:
        n8 = K // 8
        acc = _fdot8(x, xo, wf, n8)
        for k in range(8 * n8, K):  # tail (float weights only)
            acc += np.float64(x[xo + k]) * np.float64(wf[k])
        return acc
    acc = 0.0
    ao = r * K
    if path == 1:
        nb_ = K // 32
        bo = r * nb_
        hasmin = t == GT_Q4_1 or t == GT_Q5_1
        for b in range(nb_):
            s = _idot(wq, 32 * b, aq32, ao + 32 * b, 2)
            acc += (np.float64(sd[b]) * np.float64(ad32[bo + b])) * np.float64(s)
            if hasmin:
                acc += np.float64(sm[b]) * np.float64(sa32[bo + b])
        return acc
    nb_ = K // 256
    bo = r * nb_
    for b in range(nb_):
        e = 256 * b
        S = 0
        if t == GT_Q6_K or t == GT_Q3_K:
            for j in range(16):
                S += ssc[16 * b + j] * _idot(wq, e + 16 * j, aqk, ao + e + 16 * j, 1)
            acc += (np.float64(adk[bo + b]) * np.float64(sd[b])) * np.float64(S)
        elif t == GT_Q2_K:
            N = 0
            g = 16 * (bo + b)
            for j in range(16):
                S += ssc[16 * b + j] * _idot(wq, e + 16 * j, aqk, ao + e + 16 * j, 1)
                N += smn[16 * b + j] * bsk[g + j]
            acc += np.float64(adk[bo + b]) * (np.float64(sd[b]) * np.float64(S)
                                              - np.float64(sm[b]) * np.float64(N))
        else:
            for j in range(8):
                S += ssc[16 * b + j] * _idot(wq, e + 32 * j, aqk, ao + e + 32 * j, 2)
            N = 0
            g = 16 * (bo + b)
            for j in range(8):
                N += smn[8 * b + j] * (bsk[g + 2 * j] + bsk[g + 2 * j + 1])
            acc += np.float64(adk[bo + b]) * (np.float64(sd[b]) * np.float64(S)
                                              - np.float64(sm[b]) * np.float64(N))
    return acc


@nb.njit(**_JIT)
def _path(t, act_q8):
    if not act_q8 or _BLK[t] == 1:
        return 0
    return 2 if _BLK[t] == 256 else 1


@nb.njit(**_JIT)
def _work(lo, hi, nrc, c0, c1, rows, K, x, xs, w0, w1, w2, t0, t1, t2, act_q8, epi,
          y0, y1, y2, ys0, ys1, ys2, aq32, ad32, sa32, aqk, adk, bsk, res, rs):
    """tasks lo..hi-1; task = (weight, chunk of _CO output columns) x (chunk of _CR rows), in
    that order. Per output column the weight row (both, for epi 1) is decoded once and dotted
    with every row of the chunk; epi 1: y = silu(x.W0^T) * (x.W1^T) in f32; epi 2: y = res + x.W0^T
    in f32 (res read before y is written at the same index, so res may be y)."""
    nsub = max(K // 32, 1)
    hb = np.zeros(16, np.uint8)
    wq = np.empty(K, np.int8)
    wf = np.empty(K, np.float32)
    sd = np.empty(nsub, np.float32)
    sm = np.empty(nsub, np.float32)
    ssc = np.empty(2 * nsub, np.int64)
    smn = np.empty(2 * nsub, np.int64)
    if epi == 1 or epi == 3:
        wq2 = np.empty(K, np.int8)
        wf2 = np.empty(K, np.float32)
        sd2 = np.empty(nsub, np.float32)
        sm2 = np.empty(nsub, np.float32)
        ssc2 = np.empty(2 * nsub, np.int64)
        smn2 = np.empty(2 * nsub, np.int64)
    else:
        wq2, wf2, sd2, sm2, ssc2, smn2 = wq, wf, sd, sm, ssc, smn
    pb = _path(t1, act_q8)
    for task in range(lo, hi):
        c = task // nrc
        r0 = (task % nrc) * _CR
        r1 = min(r0 + _CR, rows)
        if c < c0:
            oc, wa, ta, y, ys = c, w0, t0, y0, ys0
        elif c < c0 + c1:
            oc, wa, ta, y, ys = c - c0, w1, t1, y1, ys1
        else:
            oc, wa, ta, y, ys = c - c0 - c1, w2, t2, y2, ys2
        pa = _path(ta, act_q8)
        o0 = oc * _CO
        for o in range(o0, min(o0 + _CO, wa.shape[0])):
            _unpack(ta, pa == 0, wa[o], K, wq, sd, sm, ssc, smn, wf, hb)
            if epi == 1 or epi == 3:
                _unpack(t1, pb == 0, w1[o], K, wq2, sd2, sm2, ssc2, smn2, wf2, hb)
            for r in range(r0, r1):
                g = np.float32(_rowdot(pa, ta, K, x, r * xs, wf, wq, sd, sm, ssc, smn, r,
                                       aq32, ad32, sa32, aqk, adk, bsk))
                if epi == 1 or epi == 3:
                    u = np.float32(_rowdot(pb, t1, K, x, r * xs, wf2, wq2, sd2, sm2, ssc2, smn2, r,
                                           aq32, ad32, sa32, aqk, adk, bsk))
                    if epi == 3:   # gelu, tanh form (graph.inc gelu_v's operation order)
                        z = g * (F32(0.07135481627159025) * (g * g) + F32(1.5957691216057308))
                        g = g / (F32(1.0) + np.float32(math.exp(-z))) * u
                    else:
                        g = g / (F32(1.0) + np.float32(math.exp(-g))) * u
                elif epi == 2:
                    g = res[r * rs + o] + g
                y[r * ys + o] = g


@nb.njit(**_PJIT)
def _tasks(ntask, nrc, c0, c1, rows, K, x, xs, w0, w1, w2, t0, t1, t2, act_q8, epi,
           y0, y1, y2, ys0, ys1, ys2, aq32, ad32, sa32, aqk, adk, bsk, res, rs):
    for task in nb.prange(ntask):
        _work(task, task + 1, nrc, c0, c1, rows, K, x, xs, w0, w1, w2, t0, t1, t2, act_q8, epi,
              y0, y1, y2, ys0, ys1, ys2, aq32, ad32, sa32, aqk, adk, bsk, res, rs)


# --------------------------------------------------------------------------------------------
# Python side


def _flat(a, writable):
    """2-D f32 (unit stride on the last axis, row stride >= 0) -> (1-D C view, row stride in
    elements), or None when the rows cannot be walked that way"""
    rows, n = a.shape
    s0 = a.strides[0]
    if rows <= 1:
        s = n
    elif s0 >= 0 and s0 % 4 == 0:
        s = s0 // 4
    else:
        return None
    if a.shape[1] > 1 and a.strides[1] != 4:
        return None
    if writable and not a.flags.writeable:
        return None
    if not a.flags.aligned:
        return None
    length = (rows - 1) * s + n if rows > 0 else 0
    return as_strided(a, shape=(length,), strides=(4,)), s


_DUMMY_W = np.zeros((1, 1), np.uint8)
_DUMMY_W.flags.writeable = False
_DUMMY_F = np.zeros(1, np.float32)


def _flat_in(a):
    """_flat of a read-only float32 input, through a contiguous copy where its layout (or a read-only
    array: one array type for the compiled kernel) does not fit"""
    f = _flat(a, False)
    if f is None or not a.flags.writeable:
        f = _flat(np.ascontiguousarray(a, dtype=np.float32).copy(), False)
    return f


def _ro_weight(w):
    v = np.asarray(w).view(np.ndarray)
    if not v.flags.c_contiguous or v.dtype != np.uint8 or not v.flags.aligned:
        v = np.ascontiguousarray(v, dtype=np.uint8)
    v = v.view()
    v.flags.writeable = False
    return v


def qmatmul(x, norm_w, eps, do_norm, ws, type_ids, act_q8, epi, ys, res=None):
    """ys[i] = x . dequant(ws[i])^T (epi 0), ys[0] = silu(x.W0^T) * (x.W1^T) (epi 1), or
    ys[0] = res + x.W0^T (epi 2, res float32 of ys[0]'s shape; it may be ys[0] itself), with x
    first replaced by rms_norm(x) * norm_w when do_norm. Arguments are checked by the caller, who
    also sets numba's thread count (cpufuse._registry.kernel)."""
    x = np.asarray(x)
    rows, K = x.shape
    if rows == 0:
        return
    xf, xs = _flat_in(x)
    if norm_w is None:
        nwv, have_nw = _DUMMY_F, False
    else:
        nwv = np.ascontiguousarray(norm_w, dtype=np.float32).reshape(-1)
        if not nwv.flags.writeable:
            nwv = nwv.copy()
        have_nw = True
    n = len(ws)
    wl = [_ro_weight(w) for w in ws] + [_DUMMY_W] * (3 - n)
    tl = [int(t) for t in type_ids] + [0] * (3 - n)
    outs, yl, sl = [], [], []
    n_y = 1 if epi in (1, 3) else n
    for i in range(3):
        if i < n_y:
            y = ys[i]
            fy = _flat(y, True)
            if fy is None:  # unusual layout: compute into a temporary, copy back after
                tmp = np.empty(y.shape, np.float32)
                outs.append((y, tmp))
                fy = _flat(tmp, True)
            yl.append(fy[0])
            sl.append(fy[1])
        else:
            yl.append(_DUMMY_F)
            sl.append(0)
    rf, rs = _flat_in(res) if epi == 2 else (_DUMMY_F, 0)
    need32 = needk = False
    if act_q8:
        for t in tl[:n]:
            v = _VEC_DOT.get(t)
            need32 |= v in (QA_Q8_0, QA_Q8_1)
            needk |= v == QA_Q8_K
    i8, f32, i64 = np.int8, np.float32, np.int64
    n32 = rows * (K // 32) if need32 else 0
    nk = rows * (K // 256) if needk else 0
    aq32, ad32, sa32 = np.empty(rows * K if need32 else 0, i8), np.empty(n32, f32), np.empty(n32, f32)
    aqk, adk, bsk = np.empty(rows * K if needk else 0, i8), np.empty(nk, f32), np.empty(16 * nk, i64)
    if do_norm:
        xn, xns = np.empty(rows * K, f32), K
    else:
        xn, xns = xf, xs
    if do_norm or need32 or needk:
        _prologue(xf, xs, rows, K, nwv, have_nw, 0.0 if eps is None else float(eps), bool(do_norm), xn,
                  need32, aq32, ad32, sa32, needk, aqk, adk, bsk)
    nrc = (rows + _CR - 1) // _CR
    cs = [(wl[i].shape[0] + _CO - 1) // _CO if i < n_y else 0 for i in range(3)]
    _tasks(sum(cs) * nrc, nrc, cs[0], cs[1], rows, K, xn, xns, wl[0], wl[1], wl[2], tl[0], tl[1], tl[2],
           bool(act_q8), int(epi), yl[0], yl[1], yl[2], sl[0], sl[1], sl[2], aq32, ad32, sa32, aqk, adk, bsk, rf, rs)
    for y, tmp in outs:
        y[...] = tmp


def quantize_act(x, vtype_id):
    """Activation rows -> ggml block bytes (rows, K/B * block_bytes) uint8: vtype_id QA_Q8_0 (f16 d,
    32 int8), QA_Q8_1 (f16 d, f16 s, 32 int8), QA_Q8_K (f32 d, 256 int8, 16 int16 bsums), quantized
    as in docs/quant-design.md."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None]
    rows, K = x.shape
    xf, xs = _flat_in(x)
    B = 256 if vtype_id == QA_Q8_K else 32
    nbk = K // B
    q = np.empty(rows * K, np.int8)
    d = np.empty(rows * nbk, np.float32)
    s = np.empty(rows * nbk if B == 32 else 0, np.float32)
    bs = np.empty(rows * nbk * 16 if B == 256 else 0, np.int64)
    e8, e32 = np.empty(0, np.int8), np.empty(0, np.float32)
    if B == 32:
        _prologue(xf, xs, rows, K, _DUMMY_F, False, 0.0, False, xf, True, q, d, s, False, e8, e32,
                  np.empty(0, np.int64))
    else:
        _prologue(xf, xs, rows, K, _DUMMY_F, False, 0.0, False, xf, False, e8, e32, e32, True, q, d, bs)
    qb = q.view(np.uint8).reshape(rows, nbk, B)
    if vtype_id == QA_Q8_0:
        out = np.empty((rows, nbk, QB_Q8_0), np.uint8)
        out[..., 0:2] = d.astype("<f2").view(np.uint8).reshape(rows, nbk, 2)
        out[..., 2:] = qb
    elif vtype_id == QA_Q8_1:
        out = np.empty((rows, nbk, QB_Q8_1), np.uint8)
        out[..., 0:2] = d.astype("<f2").view(np.uint8).reshape(rows, nbk, 2)
        out[..., 2:4] = s.astype("<f2").view(np.uint8).reshape(rows, nbk, 2)
        out[..., 4:] = qb
    elif vtype_id == QA_Q8_K:
        out = np.empty((rows, nbk, QB_Q8_K), np.uint8)
        out[..., 0:4] = d.astype("<f4").view(np.uint8).reshape(rows, nbk, 4)
        out[..., 4:260] = qb
        out[..., 260:] = bs.astype("<i2").view(np.uint8).reshape(rows, nbk, 32)
    else:
        raise NotImplementedError(f"activation type {vtype_id}")
    return out.reshape(rows, nbk * out.shape[2])
