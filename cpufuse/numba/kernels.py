"""Numba-jitted fallbacks (the "numba" ISA): same semantics and argument layout as the C kernels.

Inputs arrive as 4-D views; optional operands come as 1-element dummies with a flag, so each
kernel compiles to one signature per dtype combination. Compiled once per machine (cache=True).
"""
import math
import types

import numba as nb
import numpy as np

_JIT = dict(cache=True, nogil=True, error_model="numpy")  # IEEE: 1/0 = inf, no exception
# rows (softmax, rms_norm) and (sequence, head, query) rows (attention) run under prange; each row is
# computed the same way on any thread, so results do not depend on the thread count
_PJIT = dict(_JIT, parallel=True)


@nb.njit(**_JIT)
def _h2f(b):
    # exact binary16 bits -> float32
    sign = -1.0 if (b >> 15) & 1 else 1.0
    e = (b >> 10) & 0x1F
    m = b & 0x3FF
    if e == 0x1F:
        return np.float32(sign * math.inf) if m == 0 else np.float32(math.nan)
    if e == 0:
        return np.float32(sign * m * 2.0 ** -24)
    return np.float32(sign * (1024 + m) * 2.0 ** (e - 25))


def _softmax(x, mf, mh, mkind, slopes, have_slopes, sinks, have_sinks, scale, y):
    S, H, R, C = x.shape
    mS, mH = (mf.shape[0], mf.shape[1]) if mkind == 1 else (mh.shape[0], mh.shape[1])
    sc = np.float32(scale)
    for k in nb.prange(S * H * R):
        s, h, r = k // (H * R), (k // R) % H, k % R
        if True:
            slope = slopes[h] if have_slopes else np.float32(1.0)
            if True:
                M = np.float32(-np.inf)
                for c in range(C):
                    z = x[s, h, r, c] * sc
                    if mkind == 1:
                        z = z + slope * mf[s % mS, h % mH, r, c]
                    elif mkind == 2:
                        z = z + slope * _h2f(mh[s % mS, h % mH, r, c])
                    y[s, h, r, c] = z
                    if z > M or z != z:
                        M = z
                if have_sinks and sinks[h] > M:
                    M = sinks[h]
                total = 0.0
                for c in range(C):
                    e = np.float32(math.exp(y[s, h, r, c] - M))
                    y[s, h, r, c] = e
                    total += e
                if have_sinks:
                    total += np.float32(math.exp(sinks[h] - M))
                inv = np.float32(1.0 / total)
                for c in range(C):
                    y[s, h, r, c] = y[s, h, r, c] * inv


def _rms_norm(x, r, have_r, w, have_w, b, have_b, eps, h, y):
    n3, n2, n1, n = x.shape
    e = np.float32(eps)
    for k in nb.prange(n3 * n2 * n1):
        i3, i2, i1 = k // (n2 * n1), (k // n1) % n2, k % n1
        if True:
            if True:
                ss = 0.0
                if have_r:
                    rr = r[i3 % r.shape[0], i2 % r.shape[1], i1 % r.shape[2]]
                    for i in range(n):
                        v = x[i3, i2, i1, i] + rr[i]
                        h[i3, i2, i1, i] = v
                        ss += np.float64(v * v)
                    src = h[i3, i2, i1]
                else:
                    src = x[i3, i2, i1]
                    for i in range(n):
                        v = src[i]
                        ss += np.float64(v * v)
                mean = np.float32(ss / n)
                sc = np.float32(1.0) / np.float32(math.sqrt(mean + e))
                wr = w[i3 % w.shape[0], i2 % w.shape[1], i1 % w.shape[2]]
                br = b[i3 % b.shape[0], i2 % b.shape[1], i1 % b.shape[2]]
                yr = y[i3, i2, i1]
                for i in range(n):
                    v = src[i] * sc
                    if have_w:
                        v = v * wr[i]
                    if have_b:
                        v = v + br[i]
                    yr[i] = v


def _serial(f, name):
    """a twin of the Python function f for the serial (non-parallel) jit: the same code (prange
    runs as range), so the same per-row arithmetic; its own name, so its own cache files"""
    g = types.FunctionType(f.__code__, f.__globals__, name, f.__defaults__, f.__closure__)
    g.__qualname__ = name
    return nb.njit(**_JIT)(g)


# small calls take the serial twins (cpufuse.numba.entries.NB_SMALL): no parallel region to start
softmax = nb.njit(**_PJIT)(_softmax)
softmax_serial = _serial(_softmax, "softmax_serial")
rms_norm = nb.njit(**_PJIT)(_rms_norm)
rms_norm_serial = _serial(_rms_norm, "rms_norm_serial")


@nb.njit(**_PJIT)
def flash_attn(q, k, v, mf, mkind, slopes, have_slopes, sinks, have_sinks, scale, softcap, out, kq, qc, qd, kc, kd):
    """Per-row online softmax (docs/semantics.md §4) over f32 K/V (f16 K/V are widened by the caller).
    kq: a quantized K, given as int8 codes kc and block scales kd, scored against Q's Q8_0 codes qc and
    scales qd by int32 block dots."""
    S, Hq, N, DK = q.shape
    Hk, T, Hv, DV = k.shape[1], v.shape[2], v.shape[1], v.shape[3]
    if kq:
        Hk = kc.shape[1]
    mS, mH = mf.shape[0], mf.shape[1]
    sc = np.float32(scale / softcap) if softcap != 0.0 else np.float32(scale)
    cap = np.float32(softcap)
    for row in nb.prange(S * Hq * N):
        s, h, n = row // (Hq * N), (row // N) % Hq, row % N
        acc = np.zeros(DV, np.float32)
        if True:
            kh = h // (Hq // Hk)
            vh = h // (Hq // Hv)
            slope = slopes[h] if have_slopes else np.float32(1.0)
            if True:
                M = np.float32(-np.inf)
                Ssum = np.float32(0.0)
                acc[:] = 0.0
                for t in range(T):
                    a = np.float32(0.0)
                    if mkind != 0:
                        a = slope * mf[s % mS, h % mH, n, t]
                        if a == -np.inf:
                            continue
                    dot = np.float32(0.0)
                    if kq:
                        for b in range(DK // 32):
                            isum = 0
                            for i in range(32 * b, 32 * b + 32):
                                isum += np.int32(qc[s, h, n, i]) * np.int32(kc[s, kh, t, i])
                            dot += np.float32(isum) * (kd[s, kh, t, b] * qd[s, h, n, b])
                    else:
                        for i in range(DK):
                            dot += q[s, h, n, i] * k[s, kh, t, i]
                    z = dot * sc
                    if softcap != 0.0:
                        z = cap * np.float32(math.tanh(z))
                    z = z + a
                    if z > M:
                        ms = np.float32(math.exp(M - z))
                        M = z
                        for i in range(DV):
                            acc[i] = acc[i] * ms
                        vs = np.float32(1.0)
                    else:
                        ms = np.float32(1.0)
                        vs = np.float32(math.exp(z - M))
                    for i in range(DV):
                        acc[i] += vs * v[s, vh, t, i]
                    Ssum = Ssum * ms + vs
                if have_sinks:
                    sk = sinks[h]
                    if sk > M:
                        ms = np.float32(math.exp(M - sk))
                        for i in range(DV):
                            acc[i] = acc[i] * ms
                        Ssum = Ssum * ms + np.float32(1.0)
                    elif M != -np.inf:
                        Ssum += np.float32(math.exp(sk - M))
                inv = np.float32(0.0) if Ssum == 0.0 else np.float32(1.0) / Ssum
                for i in range(DV):
                    out[s, n, h, i] = acc[i] * inv
