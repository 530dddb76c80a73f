"""Numba fallback of cpufuse.rope (the "numba" ISA): the same two phases as native/kernels/rope.inc.

1. table_accurate / table_compat: per token, C[k] and S[k] (float32) of its n_dims/2 pairs into
   tab[t, 0, k] and tab[t, 1, k]. The accurate table uses `sincos`, the same float64 operations
   as the native kernels (no libm, no FMA), so it is the same table bit for bit. The per-op constants (1/freq_k, theta_scale, mscale, the YaRN
   ramps) come from cpufuse/ops/rope.py. The compat table calls the C library's cosf/sinf through
   ctypes, as ggml does (numpy's or LLVM's float cos may differ by an ulp); it is compiled without
   the on-disk cache because it embeds the function addresses.
2. apply: every (token, head) row under prange, y_a = fma(x_a, C, -(x_b*S)),
   y_b = fma(x_a, S, x_b*C) with an exact float32 FMA (float64 product, TwoSum, midpoint fix-up),
   stored as float32 or float16 (round to nearest even, integer-exact).
Every row is computed the same way on any thread: the result does not depend on the thread count.
"""
import ctypes
import ctypes.util
import math

import numba as nb
import numpy as np

_JIT = dict(cache=True, nogil=True, error_model="numpy")
_PJIT = dict(_JIT, parallel=True)


def _libm_fn(name, nargs=1):
    """the C library's float function `name` through ctypes, or None"""
    try:
        lib = ctypes.util.find_library("m")
        fn = getattr(ctypes.CDLL(lib), name) if lib else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.restype = ctypes.c_float
        fn.argtypes = [ctypes.c_float] * nargs
    return fn


_cosf = _libm_fn("cosf")
_sinf = _libm_fn("sinf")
_powf = _libm_fn("powf", 2)
_logf = _libm_fn("logf")
HAVE_LIBM = _cosf is not None and _sinf is not None


@nb.njit(inline="always", **_JIT)
def fma32(a, b, c):
    """float32 fma(a, b, c) with one rounding: a*b is exact in float64; the float64 sum's error is
    recovered exactly (TwoSum); when the float64 sum sits exactly on a float32 midpoint the error
    picks the side (the only case where rounding twice differs from rounding once)."""
    p = np.float64(a) * np.float64(b)
    cd = np.float64(c)
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    r = np.float32(s)
    if err != 0.0:
        rd = np.float64(r)
        t = s - rd
        if t != 0.0:
            r2 = np.float32(rd + 2.0 * t)
            if (rd + np.float64(r2)) * 0.5 == s:
                if err > 0.0:
                    r = r if r > r2 else r2
                else:
                    r = r if r < r2 else r2
    return r


@nb.njit(inline="always", **_JIT)
def _rne(v):
    # round half to even, v >= 0 and small (<= 2^12): exact in float64
    r = math.floor(v + 0.5)
    if r - v == 0.5 and r % 2.0 == 1.0:
        r -= 1.0
    return r


@nb.njit(**_JIT)
def f2h(v):
    """float32 -> binary16 bits, round to nearest even"""
    if v != v:
        return np.uint16(0x7E00)
    a = np.float64(v)
    sign = 0
    if a < 0.0 or (a == 0.0 and math.copysign(1.0, a) < 0.0):
        sign = 0x8000
        a = -a
    if a >= 65520.0:
        return np.uint16(sign | 0x7C00)
    if a < 6.103515625e-05:  # 2^-14: subnormal half, units of 2^-24
        return np.uint16(sign | int(_rne(a * 16777216.0)))
    m, e = math.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    q = int(_rne(m * 2048.0))
    if q == 2048:
        q = 1024
        e += 1
    E = e - 1 + 15
    if E >= 31:
        return np.uint16(sign | 0x7C00)
    return np.uint16(sign | (E << 10) | (q - 1024))


@nb.njit(inline="always", **_JIT)
def sincos(phi):
    """sin and cos of a float64 angle, the same operations as rp_sincos in native/kernels/rope.inc
    (so the same bits): n = round(phi*2/pi) by the 1.5*2^52 trick, r = phi - n*pi/2 by
    Cody-Waite with a three-constant split of pi/2 (exact n*P1, n*P2 for |n| < 2^23), cephes'
    polynomials for sin r and cos r on |r| <= pi/4, the quadrant n mod 4. |phi| > 1e7 or NaN:
    math.sin/math.cos (libm), as the native kernels."""
    if not abs(phi) <= 1.0e7:
        return math.sin(phi), math.cos(phi)
    t = phi * 0.63661977236758138 + 6755399441055744.0
    n = t - 6755399441055744.0
    r = phi - n * 1.5707963276654482
    r = r - n * -8.705515692000731e-10
    r = r - n * -3.50343439808993e-19
    z = r * r
    ps = 1.58962301576546568060e-10
    ps = ps * z + -2.50507477628578072866e-8
    ps = ps * z + 2.75573136213857245213e-6
    ps = ps * z + -1.98412698295895385996e-4
    ps = ps * z + 8.33333333332211858878e-3
    ps = ps * z + -1.66666666666666307295e-1
    sr = r + (r * z) * ps
    pc = -1.13585365213876817300e-11
    pc = pc * z + 2.08757008419747316778e-9
    pc = pc * z + -2.75573141792967388112e-7
    pc = pc * z + 2.48015872888517045348e-5
    pc = pc * z + -1.38888888888730564116e-3
    pc = pc * z + 4.16666666666665929218e-2
    cr = (1.0 - 0.5 * z) + (z * z) * pc
    q = np.int64(n) & 3
    s, c = (cr, sr) if q & 1 else (sr, cr)
    if q & 2:
        s = -s
    if (q + 1) & 2:
        c = -c
    return s, c


@nb.njit(**_PJIT)
def table_accurate(pos, invf, fs, rampd, ext, mscale, half, tab):
    T = pos.shape[0]
    for t in nb.prange(T):
        p = np.float64(pos[t])
        for k in range(half):
            te = p * invf[k]
            ti = fs * te
            phi = ti
            if ext:
                r = rampd[k]
                phi = ti * (1.0 - r) + te * r
            s, c = sincos(phi)
            tab[t, 0, k] = np.float32(c * mscale)
            tab[t, 1, k] = np.float32(s * mscale)


if HAVE_LIBM:  # the C library's cosf/sinf, as ggml calls them (ctypes calls: not disk-cacheable)
    _cos32, _sin32 = _cosf, _sinf
    _TC_JIT = dict(parallel=True, nogil=True, error_model="numpy")
else:  # no C library found: float64 cos/sin rounded to float32 (within an ulp of cosf/sinf)
    @nb.njit(cache=True)
    def _cos32(x):
        return np.float32(math.cos(np.float64(x)))

    @nb.njit(cache=True)
    def _sin32(x):
        return np.float32(math.sin(np.float64(x)))
    _TC_JIT = _PJIT


@nb.njit(**_TC_JIT)
def table_compat(pos, ff, fs, theta_scale, ramp, ext, mscale, half, tab):
    T = pos.shape[0]
    for t in nb.prange(T):
        theta = np.float32(pos[t])
        for k in range(half):
            te = theta / ff[k]
            ti = fs * te
            phi = ti
            if ext:
                r = ramp[k]
                phi = fma32(ti, np.float32(1.0) - r, te * r)
            tab[t, 0, k] = np.float32(_cos32(phi)) * mscale
            tab[t, 1, k] = np.float32(_sin32(phi)) * mscale
            theta = theta * theta_scale


@nb.njit(**_PJIT)
def apply(x, tab, nd, mode, yh, y, f16):
    T, H, D = x.shape
    half = nd // 2
    for kk in nb.prange(T * H):
        t = kk // H
        h = kk % H
        for k in range(half):
            if mode == 0:
                ia, ib = 2 * k, 2 * k + 1
            else:
                ia, ib = k, k + half
            a = x[t, h, ia]
            b = x[t, h, ib]
            C = tab[t, 0, k]
            S = tab[t, 1, k]
            ya = fma32(a, C, b * (-S))
            yb = fma32(a, S, b * C)
            if f16:
                yh[t, h, ia] = f2h(ya)
                yh[t, h, ib] = f2h(yb)
            else:
                y[t, h, ia] = ya
                y[t, h, ib] = yb
        for i in range(nd, D):
            if f16:
                yh[t, h, i] = f2h(x[t, h, i])
            else:
                y[t, h, i] = x[t, h, i]


# ------------------------------------------------------------------------------------------------
# the call (cpufuse.ops.rope checks the arguments; the registry's "rope" on isa="numba")

def _yarn_consts_f32(n_dims, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow,
                     n_ctx_orig):
    """ggml's per-op f32 constants (docs/semantics.md §7) for the Numba path: theta_scale, mscale,
    ramp(k)*ext_factor. powf/logf come from the C library (ctypes) as upstream; numpy otherwise."""
    f = np.float32
    powf = (lambda a, b: f(_powf(a, b))) if _powf else (lambda a, b: f(np.power(f(a), f(b))))
    logf = (lambda a: f(_logf(a))) if _logf else (lambda a: f(np.log(f(a))))
    nd = f(n_dims)
    theta_scale = powf(f(freq_base), f(f(-2.0) / nd))
    mscale = f(attn_factor)
    ramp = np.zeros(max(n_dims // 2, 1), np.float32)
    if ext_factor != 0.0:
        fs, base = f(freq_scale), f(freq_base)
        mscale = f(mscale * f(f(1.0) + f(f(0.1) * logf(f(f(1.0) / fs)))))

        def corr(r):
            return f(f(nd * logf(f(f(n_ctx_orig) / f(f(f(r) * f(2.0)) * f(math.pi))))) / f(f(2.0) * logf(base)))
        with np.errstate(all="ignore"):
            lo0, hi0 = f(np.floor(corr(beta_fast))), f(np.ceil(corr(beta_slow)))
        lo = f(0.0) if f(0.0) > lo0 else lo0
        hi = f(n_dims - 1) if f(n_dims - 1) < hi0 else hi0
        den = f(0.001) if f(0.001) > f(hi - lo) else f(hi - lo)
        for k in range(n_dims // 2):
            y = f(f(f(k) - lo) / den)
            m0 = f(0.0) if f(0.0) > y else y
            cl = f(1.0) if f(1.0) < m0 else m0
            ramp[k] = f(f(f(1.0) - cl) * f(ext_factor))
    return theta_scale, mscale, ramp


def _yarn_consts_f64(n_dims, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow,
                     n_ctx_orig, ff):
    """the accurate path's per-op constants in float64: 1/freq_k (base^(-2k/n_dims)/ff_k), mscale,
    ramp(k)*ext_factor (the same formulas as rope.inc)"""
    half = n_dims // 2
    k = np.arange(half, dtype=np.float64)
    invf = np.array([math.pow(freq_base, -2.0 * kk / n_dims) for kk in k], np.float64)
    if ff is not None:
        invf = invf / ff.astype(np.float64)
    mscale = attn_factor
    ramp = np.zeros(max(half, 1), np.float64)
    if ext_factor != 0.0:
        mscale = mscale * (1.0 + 0.1 * math.log(1.0 / freq_scale))

        def corr(r):
            with np.errstate(all="ignore"):
                arg = np.float64(n_ctx_orig) / (np.float64(r) * 2.0 * np.pi)
                return np.float64(n_dims) * np.log(arg) / (2.0 * np.log(np.float64(freq_base)))
        lo0, hi0 = np.floor(corr(beta_fast)), np.ceil(corr(beta_slow))
        lo = lo0 if lo0 > 0.0 else 0.0
        hi = (n_dims - 1) if (n_dims - 1) < hi0 else hi0
        den = 0.001 if 0.001 > hi - lo else hi - lo
        y = (k - lo) / den
        ramp[:half] = (1.0 - np.clip(y, 0.0, 1.0)) * ext_factor
    return np.ascontiguousarray(invf), mscale, ramp


def rope(x, pos, ff, nd, mode, compat, fparams, n_ctx_orig, y):
    """y (float32 or float16, any strides) = rope(x) with the checked arguments of cpufuse.rope:
    pos contiguous int32, ff float32 (n_dims/2,) or None, fparams (freq_base, freq_scale,
    ext_factor, attn_factor, beta_fast, beta_slow)"""
    base, fs, ext, attn, bfast, bslow = fparams
    T = x.shape[0]
    half = nd // 2
    tab = np.empty((T, 2, max(half, 1)), np.float32)
    if compat:
        ts, ms, ramp = _yarn_consts_f32(nd, base, fs, ext, attn, bfast, bslow, n_ctx_orig)
        table_compat(pos, ff if ff is not None else np.ones(max(half, 1), np.float32),
                     np.float32(fs), np.float32(ts), ramp, ext != 0.0, np.float32(ms), half, tab)
    else:
        invf, ms, ramp = _yarn_consts_f64(nd, base, fs, ext, attn, bfast, bslow, n_ctx_orig, ff)
        table_accurate(pos, invf, fs, ramp, ext != 0.0, ms, half, tab)
    f16 = y.dtype == np.float16
    dummy32 = np.zeros((1, 1, 1), np.float32)
    dummy16 = np.zeros((1, 1, 1), np.uint16)
    apply(x, tab, nd, mode, y.view(np.uint16) if f16 else dummy16, dummy32 if f16 else y, f16)
