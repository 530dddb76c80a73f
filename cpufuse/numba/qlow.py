"""The low-level pieces of the Numba quantized matmul (cpufuse.numba.quant): the jit options, binary16
conversions, and the small numba intrinsics that emit LLVM vector IR for the inner loops (nibble
unpack, int8 dot, int8 -> f32 scaling, f32 dot). numba's own pipeline leaves such short fixed-length
loops scalar (its SLP vectorizer is off), which cost about 6x in the dots. All arithmetic in them is
either exact integer math or elementwise f32/f64 with the same rounding as the scalar code."""
import math

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_JIT = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
_PJIT = dict(_JIT, parallel=True)

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

