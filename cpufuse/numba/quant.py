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
intrinsics that emit LLVM vector IR (qlow.py, with the binary16 conversions); the activation rows
(the norm prologue, the q8 quantizers) are in qact.py.

Arrays reach the kernels in one layout each (flat 1-D f32 views with a row stride for x and the
outputs, read-only C-contiguous uint8 2-D for the weights, dummies for absent operands) and type
ids are runtime ints, so each kernel compiles once per machine (cache=True).
"""
import math

import numba as nb
import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..quant.types import ACT_QTYPES, CODE_OFFSET, KVALUES_IQ4NL, KVALUES_MXFP4, QTYPES
from .qact import _prologue
from .qlow import _JIT, _PJIT, F32, _copy16, _cvt16, _fdot8, _h2f, _idot, _nib16, _rd16

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

# IQ4_NL / IQ4_XS code -> value (ggml's kvalues_iq4nl)
_KV = KVALUES_IQ4NL
_KV_MX = KVALUES_MXFP4   # MXFP4's: the doubled E2M1 values

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
