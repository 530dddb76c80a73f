"""Activation rows of the Numba quantized matmul (cpufuse.numba.quant), from a flat f32 buffer: the
RMS norm prologue and the q8 quantizers (Q8_0 / Q8_1 codes and scales, Q8_K), docs/semantics.md §9."""
import math

import numba as nb
import numpy as np

from .qlow import _JIT, F32, _f16r



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

