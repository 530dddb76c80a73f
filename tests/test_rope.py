"""cpufuse.rope (ggml rope_ext, docs/semantics.md §7) on every ISA and the Numba path:

* accurate angles (the default) vs a float64 reference written here: both modes, partial rotary,
  YaRN on/off, freq_factors, positions up to 131072, head_dim 6..128 (not multiples of the SIMD
  width), 1/3/9 heads: NMSE <= 1e-12;
* ggml_compat=True vs a float32 emulation of ggml's chain written here (np.float32 arithmetic step
  by step, an exact float32 FMA where GCC contracts), bit for bit on the FMA ISAs and Numba. The
  C library's powf/cosf/sinf/logf are called through ctypes for that. numpy's own float32 cos/sin
  differ from glibc's cosf/sinf by 1 ulp on ~9% of arguments (and np.power(float32) from powf on
  some exponents, e.g. -2/64), so the variant of the emulation that uses np.cos/np.sin is checked
  with a 1-ulp-of-the-table tolerance instead. The scalar ISA rounds the two products of the
  rotation separately (no FMA), so it is checked within one rounding of the products;
* strided x, out= (new, strided with guards, in place), x untouched, cache write (float16 RNE and
  float32, pos0 > 0, nothing else in the cache touched), thread counts 1/2/3 bit-identical, errors.
"""
import ctypes
import ctypes.util
import math

import numpy as np
import pytest

import cpufuse
from _util import assert_bit_identical, assert_nmse

F32, F64 = np.float32, np.float64
f = np.float32
NMSE_TOL = 1e-12
POS = np.array([0, 1, 2, 17, 4095, 8192, 65535, 131071, 131072], np.int32)

_lm = None
try:
    _name = ctypes.util.find_library("m")
    if _name:
        _lm = ctypes.CDLL(_name)
        for _fn in ("powf", "logf", "cosf", "sinf"):
            getattr(_lm, _fn).restype = ctypes.c_float
            getattr(_lm, _fn).argtypes = [ctypes.c_float] * (2 if _fn == "powf" else 1)
except OSError:
    _lm = None
NO_LIBM = "the C library's float math (libm powf/cosf/sinf/logf) cannot be loaded through ctypes here"


def U(rng, shape):
    return rng.uniform(-4.0, 4.0, shape).astype(F32)


def positions(rng, T):
    p = rng.integers(0, 131073, T).astype(np.int32)
    p[: min(T, len(POS))] = POS[: min(T, len(POS))]
    return p


def llama3_factors(nd, base=500000.0):
    """Llama 3.1 rope_freqs (docs/semantics.md §7), float32"""
    k = np.arange(nd // 2)
    lam = 2 * np.pi / base ** (-2.0 * k / nd)
    ff = np.where(lam < 8192 / 4, 1.0, np.where(lam > 8192 / 1, 8.0, 0.0))
    mid = (lam >= 8192 / 4) & (lam <= 8192)
    sig = (8192 / lam - 1) / (4 - 1)
    ff[mid] = 1.0 / ((1 - sig[mid]) / 8.0 + sig[mid])
    return ff.astype(F32)


# ------------------------------------------------------------------------------------------------
# references

def pair_index(nd, mode):
    half = nd // 2
    if mode in ("norm", 0):
        return np.arange(0, nd, 2), np.arange(1, nd, 2)
    return np.arange(half), np.arange(half, nd)


def ref64(x, pos, nd, mode="norm", base=10000.0, fs=1.0, ext=0.0, attn=1.0, bfast=32.0, bslow=1.0,
          nco=0, ff=None):
    """float64 rope_ext: theta_k = p * base^(-2k/n_dims) / ff_k, YaRN mix and mscale in float64"""
    half = nd // 2
    k = np.arange(half, dtype=F64)
    te = pos.astype(F64)[:, None] * base ** (-2.0 * k / nd)
    if ff is not None:
        te = te / ff.astype(F64)
    ti = fs * te
    m = attn
    phi = ti
    if ext != 0.0:
        def corr(r):
            with np.errstate(all="ignore"):
                return nd * np.log(nco / (r * 2 * np.pi)) / (2 * np.log(base))
        lo = max(0.0, np.floor(corr(bfast)))
        hi = min(nd - 1.0, np.ceil(corr(bslow)))
        ramp = (1 - np.clip((k - lo) / max(0.001, hi - lo), 0, 1)) * ext
        phi = ti * (1 - ramp) + te * ramp
        m = attn * (1 + 0.1 * np.log(1 / fs))
    c, s = (np.cos(phi) * m)[:, None, :], (np.sin(phi) * m)[:, None, :]
    x = x.astype(F64)
    y = x.copy()
    ia, ib = pair_index(nd, mode)
    a, b = x[..., ia], x[..., ib]
    y[..., ia] = a * c - b * s
    y[..., ib] = a * s + b * c
    return y


def fma32(a, b, c):
    """float32 fma with one rounding: exact float64 product, TwoSum of the float64 sum, and the
    float32 midpoint case decided by the sign of the sum's error"""
    p = np.asarray(a, F64) * np.asarray(b, F64)
    cd = np.asarray(c, F64)
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    r = s.astype(F32)
    rd = r.astype(F64)
    t = s - rd
    r2 = (rd + 2 * t).astype(F32)
    mid = (err != 0) & (t != 0) & ((rd + r2.astype(F64)) * 0.5 == s)
    return np.where(mid, np.where(err > 0, np.maximum(r, r2), np.minimum(r, r2)), r).astype(F32)


def _libm_vec(name):
    fn = getattr(_lm, name)
    return lambda v: np.array([fn(float(e)) for e in np.ravel(v)], F32).reshape(np.shape(v))


def ggml_tables(pos, nd, base=10000.0, fs=1.0, ext=0.0, attn=1.0, bfast=32.0, bslow=1.0, nco=0,
                ff=None, trig="libm"):
    """ggml's f32 cache loop (docs/semantics.md §7), float32 step by step -> C, S of shape (T, nd/2).
    powf/logf always from the C library; cosf/sinf from it (trig='libm') or np.cos/np.sin."""
    powf = lambda a, b: f(_lm.powf(float(a), float(b)))  # noqa: E731
    logf = lambda a: f(_lm.logf(float(a)))  # noqa: E731
    cosf, sinf = (_libm_vec("cosf"), _libm_vec("sinf")) if trig == "libm" else (np.cos, np.sin)
    half = nd // 2
    ts = powf(f(base), f(-2.0) / f(nd))
    theta = pos.astype(F32)
    fs_, m = f(fs), f(attn)
    if ext != 0.0:
        m = f(m * f(f(1) + f(f(0.1) * logf(f(1) / fs_))))
        with np.errstate(all="ignore"):
            corr = lambda r: f(f(f(nd) * logf(f(f(nco) / f(f(f(r) * f(2)) * f(np.pi))))) / f(f(2) * logf(f(base))))  # noqa: E731
            lo0, hi0 = f(np.floor(corr(bfast))), f(np.ceil(corr(bslow)))
        lo = f(0) if f(0) > lo0 else lo0
        hi = f(nd - 1) if f(nd - 1) < hi0 else hi0
        den = f(0.001) if f(0.001) > f(hi - lo) else f(hi - lo)
    C = np.empty((len(pos), half), F32)
    S = np.empty((len(pos), half), F32)
    for k in range(half):
        te = theta / ff[k] if ff is not None else theta
        ti = fs_ * te
        phi = ti
        if ext != 0.0:
            y = f(f(f(k) - lo) / den)
            y = f(0) if f(0) > y else y
            r = f(f(f(1) - (f(1) if f(1) < y else y)) * f(ext))
            phi = fma32(ti, f(1) - r, te * r)
        C[:, k] = (cosf(phi) * m).astype(F32)
        S[:, k] = (sinf(phi) * m).astype(F32)
        theta = (theta * ts).astype(F32)
    return C, S


def ggml_rotate(x, C, S, nd, mode, fma=True):
    """y_a = fma(x_a, C, -(x_b*S)), y_b = fma(x_a, S, x_b*C) (GCC's contraction), or unfused"""
    y = x.astype(F32).copy()
    ia, ib = pair_index(nd, mode)
    a, b = x[..., ia], x[..., ib]
    c, s = C[:, None, :], S[:, None, :]
    if fma:
        y[..., ia] = fma32(a, c, -(b * s))
        y[..., ib] = fma32(a, s, b * c)
    else:
        y[..., ia] = a * c - b * s
        y[..., ib] = a * s + b * c
    return y


def product_scale(x, C, S, nd, mode):
    """|x_a C| + |x_b S| per rotated element (the size the products' roundings scale with)"""
    sc = np.zeros(x.shape, F64)
    ia, ib = pair_index(nd, mode)
    a, b = np.abs(x[..., ia].astype(F64)), np.abs(x[..., ib].astype(F64))
    c, s = np.abs(C[:, None, :].astype(F64)), np.abs(S[:, None, :].astype(F64))
    sc[..., ia] = a * c + b * s
    sc[..., ib] = a * s + b * c
    return sc


# ------------------------------------------------------------------------------------------------
# accuracy of the default (float64-angle) path

DIMS = [(6, 6), (6, 4), (10, 10), (10, 6), (34, 34), (34, 16), (64, 64), (64, 32), (80, 80), (80, 40),
        (128, 128), (128, 64)]


@pytest.mark.parametrize("H", [1, 3, 9])
@pytest.mark.parametrize("D,nd", DIMS, ids=[f"d{a}n{b}" for a, b in DIMS])
@pytest.mark.parametrize("mode", ["norm", "neox"])
def test_accurate(isa, mode, D, nd, H, rng):
    T = 11
    x = U(rng, (T, H, D))
    pos = positions(rng, T)
    x0 = x.copy()
    y = cpufuse.rope(x, pos, n_dims=nd, mode=mode, isa=isa)
    assert y.dtype == F32 and y.shape == x.shape
    assert_bit_identical(x, x0, "x modified")
    ref = ref64(x, pos, nd, mode)
    assert_nmse(ref, y, NMSE_TOL, f"{isa} {mode} D={D} nd={nd} H={H}")
    assert_bit_identical(y[..., nd:], x[..., nd:], "pass-through dims")
    rel = np.max(np.abs(y - ref) / (np.abs(x).max() + 1e-30))
    assert rel < 2e-6, f"max error {rel:.3e} of max|x|"


def rope_table(isa, pos, nd, mode="norm", **kw):
    """the (C, S) table of the accurate path, read through the rotation of a one-hot x (x_a = 1,
    x_b = 0 gives y_a = C, y_b = S exactly on every path, FMA or not)"""
    x = np.zeros((len(pos), 1, nd), F32)
    ia, ib = pair_index(nd, mode)
    x[..., ia] = 1.0
    y = cpufuse.rope(x, pos, n_dims=nd, mode=mode, isa=isa, **kw)
    return y[:, 0, ia], y[:, 0, ib]


EXTREME_POS = np.array([131071, 131072, 131070, 100003, 65537, 0, 1, -131071, 2 ** 20 + 1, 2 ** 23 - 1,
                        9_999_999, 10_000_001, 2 ** 31 - 1, -2 ** 31], np.int32)


@pytest.mark.parametrize("base", [1e4, 1e6])
@pytest.mark.parametrize("nd", [6, 64, 128, 256])
def test_accurate_angles_extreme(isa, base, nd):
    """the accurate table (float64 angle, Cody-Waite reduction, polynomial sin/cos; libm beyond
    |phi| = 1e7) vs numpy's float64 cos/sin: NMSE <= 1e-12 and within 1 f32 ulp of the exact value
    element by element, at the largest positions; and the same bits on every ISA"""
    C, S = rope_table(isa, EXTREME_POS, nd, freq_base=base)
    # the float64 angle as defined (libm pow, then one product), so that the reference differs
    # only by cos/sin: numpy's vectorized power may be an ulp off pow, 2e-7 rad at pos 2^31
    invf = np.array([math.pow(base, -2.0 * k / nd) for k in range(nd // 2)], F64)
    phi = EXTREME_POS.astype(F64)[:, None] * invf
    rc, rs = np.cos(phi), np.sin(phi)
    assert_nmse(np.concatenate([rc, rs]), np.concatenate([C, S]).astype(F64), NMSE_TOL, f"{isa} base={base} nd={nd}")
    err = np.maximum(np.abs(C - rc), np.abs(S - rs))
    assert err.max() <= 2.0 ** -24, f"max table error {err.max():.3e} (> 1 f32 ulp of 1)"
    # the angle itself: atan2 of the table against phi mod 2 pi
    dphi = np.angle(np.exp(1j * (np.arctan2(S.astype(F64), C.astype(F64)) - phi)))
    assert np.abs(dphi).max() < 2e-7
    Cs, Ss = rope_table("scalar", EXTREME_POS, nd, freq_base=base)
    assert_bit_identical(C, Cs, f"{isa} vs scalar table (cos)")
    assert_bit_identical(S, Ss, f"{isa} vs scalar table (sin)")


def test_plan_matches_checked(rng):
    """a planned call (plain arguments) and one through the checks (numpy scalars, lists) give the same bits,
    and a plan never skips a check: overlaps and bounds still raise"""
    T, H, D = 5, 4, 64
    x = U(rng, (T, H, D))
    pos = positions(rng, T)
    kc = np.zeros((8, H, D), np.float16)
    cpufuse.rope(x, pos, n_dims=D, cache=(kc, 2), freq_base=500000.0)
    kc2 = np.zeros((8, H, D), np.float16)
    cpufuse.rope(x, pos, n_dims=np.int64(D), cache=[kc2, np.int32(2)], freq_base=np.float64(500000.0))
    assert np.array_equal(kc.view(np.uint16), kc2.view(np.uint16))
    y = cpufuse.rope(x, pos, n_dims=D, mode=2, freq_scale=0.5)
    y2 = cpufuse.rope(x, pos, n_dims=D, mode="NEOX", freq_scale=np.float32(0.5))
    assert_bit_identical(y, y2, "planned vs checked")
    # overlaps a plan must not miss
    buf = np.zeros(8192, np.uint8)
    kco = buf[:8 * H * D * 2].view(np.float16).reshape(8, H, D)
    xo = buf[1024:1024 + T * H * D * 4].view(np.float32).reshape(T, H, D)
    with pytest.raises(ValueError, match="cache"):
        cpufuse.rope(xo, pos, n_dims=D, cache=(kco, 0))
    po = buf[16:16 + 4 * T].view(np.int32)
    with pytest.raises(ValueError, match="cache"):
        cpufuse.rope(x, po, n_dims=D, cache=(kco, 0))
    with pytest.raises(ValueError, match="cache"):
        cpufuse.rope(x, pos, n_dims=D, cache=(kc, 4))  # 4 + 5 > 8
    with pytest.raises(TypeError, match="pos0"):
        cpufuse.rope(x, pos, n_dims=D, cache=(kc, True))
    with pytest.raises(ValueError, match="freq_base"):
        cpufuse.rope(x, pos, n_dims=D, cache=(kc, 0), freq_base=float("inf"))
    with pytest.raises(TypeError, match="ggml_compat"):
        cpufuse.rope(x, pos, n_dims=D, cache=(kc, 0), ggml_compat=1)
    with pytest.raises(TypeError, match="mode"):
        cpufuse.rope(x, pos, n_dims=D, mode=False)


YARN = {
    "plain": {},
    "base5e5": dict(base=500000.0),
    "linear": dict(fs=0.25),
    "yarn": dict(fs=0.25, ext=1.0, attn=1.0, nco=4096),
    "yarn_attn": dict(base=1e6, fs=0.125, ext=0.5, attn=0.8, bfast=16.0, bslow=2.0, nco=8192),
    "llama3_ff": dict(base=500000.0, ff="llama3"),
    "random_ff_yarn": dict(fs=0.5, ext=1.0, nco=2048, ff="random"),
}


def _kw(cfg, nd, rng):
    c = dict(cfg)
    if c.get("ff") == "llama3":
        c["ff"] = llama3_factors(nd, c.get("base", 10000.0))
    elif c.get("ff") == "random":
        c["ff"] = rng.uniform(0.5, 8.0, nd // 2).astype(F32)
    api = dict(freq_base=c.get("base", 10000.0), freq_scale=c.get("fs", 1.0), ext_factor=c.get("ext", 0.0),
               attn_factor=c.get("attn", 1.0), beta_fast=c.get("bfast", 32.0), beta_slow=c.get("bslow", 1.0),
               n_ctx_orig=c.get("nco", 0), freq_factors=c.get("ff"))
    return c, api


@pytest.mark.parametrize("cfg", list(YARN), ids=list(YARN))
@pytest.mark.parametrize("mode", ["norm", "neox"])
@pytest.mark.parametrize("D,nd", [(128, 128), (80, 64), (34, 34)], ids=["d128", "d80n64", "d34"])
def test_accurate_yarn_ff(isa, mode, cfg, D, nd, rng):
    T, H = 9, 3
    x = U(rng, (T, H, D))
    pos = positions(rng, T)
    c, api = _kw(YARN[cfg], nd, rng)
    y = cpufuse.rope(x, pos, n_dims=nd, mode=mode, isa=isa, **api)
    assert_nmse(ref64(x, pos, nd, mode, **c), y, NMSE_TOL, f"{isa} {cfg} {mode}")


# ------------------------------------------------------------------------------------------------
# ggml_compat: ggml's float32 chain

@pytest.mark.skipif(_lm is None, reason=NO_LIBM)
@pytest.mark.parametrize("cfg", list(YARN), ids=list(YARN))
@pytest.mark.parametrize("mode", ["norm", "neox"])
@pytest.mark.parametrize("D,nd", [(128, 128), (64, 64), (80, 64), (34, 34), (6, 6)],
                         ids=["d128", "d64", "d80n64", "d34", "d6"])
def test_ggml_compat(isa, mode, cfg, D, nd, rng):
    T, H = 9, 3
    x = U(rng, (T, H, D))
    pos = positions(rng, T)
    c, api = _kw(YARN[cfg], nd, rng)
    y = cpufuse.rope(x, pos, n_dims=nd, mode=mode, isa=isa, ggml_compat=True, **api)
    C, S = ggml_tables(pos, nd, **c)
    ref = ggml_rotate(x, C, S, nd, mode)
    if isa != "scalar":
        assert_bit_identical(y, ref, f"{isa} {cfg} {mode}: ggml f32 chain")
    else:
        # no FMA on the scalar ISA: within one rounding of each product of the exact-table result
        assert_bit_identical(y[..., nd:], ref[..., nd:], "pass-through")
        ref_nf = ggml_rotate(x, C, S, nd, mode, fma=False)
        assert_bit_identical(y, ref_nf, f"scalar {cfg} {mode}: ggml f32 chain without FMA")
        tol = product_scale(x, C, S, nd, mode) * 2.0 ** -23
        assert np.all(np.abs(y.astype(F64) - ref) <= tol), "scalar: further than one product rounding from the FMA form"


@pytest.mark.skipif(_lm is None, reason=NO_LIBM)
@pytest.mark.parametrize("mode", ["norm", "neox"])
def test_ggml_compat_numpy_trig(isa, mode, rng):
    """the same check with np.cos/np.sin in the emulation: numpy's float32 cos/sin differ from
    glibc's cosf/sinf by 1 ulp on some arguments, so allow 1 ulp of C and S (and count them)"""
    T, H, D, nd = 16, 3, 128, 128
    x = U(rng, (T, H, D))
    pos = positions(rng, T)
    y = cpufuse.rope(x, pos, n_dims=nd, mode=mode, isa=isa, ggml_compat=True)
    C, S = ggml_tables(pos, nd, trig="numpy")
    ref = ggml_rotate(x, C, S, nd, mode)
    tol = product_scale(x, C, S, nd, mode) * 2.0 ** -22
    assert np.all(np.abs(y.astype(F64) - ref) <= tol)
    Cl, Sl = ggml_tables(pos, nd, trig="libm")
    n_off = int((Cl != C).sum() + (Sl != S).sum())
    assert np.all(np.abs(Cl.view(np.int32).astype(np.int64) - C.view(np.int32)) <= 1), "numpy cos > 1 ulp off cosf"
    print(f"numpy cos/sin differ from libm cosf/sinf in {n_off} of {2 * C.size} table entries (1 ulp)")


@pytest.mark.skipif(_lm is None, reason=NO_LIBM)
def test_ggml_compat_far_from_exact(rng):
    """docs/semantics.md §7: the f32 chain is ~1e-2 rad off at 131072 (base 1e4, d 128); the default is not"""
    x = np.zeros((1, 1, 128), F32)
    x[..., 16] = 1.0  # pair 8 (norm), where the angle error peaks
    pos = np.array([131072], np.int32)
    ref = ref64(x, pos, 128)
    yc = cpufuse.rope(x, pos, n_dims=128, ggml_compat=True)
    ya = cpufuse.rope(x, pos, n_dims=128)
    assert np.abs(yc - ref).max() > 1e-3
    assert np.abs(ya - ref).max() < 1e-6


# ------------------------------------------------------------------------------------------------
# layouts, out, in place, cache

@pytest.mark.parametrize("mode", ["norm", "neox"])
def test_strided_out_inplace(isa, mode, rng):
    T, H, D, nd = 7, 3, 34, 30
    big = U(rng, (T * 2, H + 2, D + 5))
    x = big[::2, 1:H + 1, 3:3 + D]  # token and head strides arbitrary, last axis unit
    assert not x.flags.c_contiguous
    pos = positions(rng, T)
    ref = cpufuse.rope(np.ascontiguousarray(x), pos, n_dims=nd, mode=mode, isa=isa)
    assert_nmse(ref64(x, pos, nd, mode), ref, NMSE_TOL)
    big0 = big.copy()
    y = cpufuse.rope(x, pos, n_dims=nd, mode=mode, isa=isa)
    assert_bit_identical(y, ref, "strided x")
    assert_bit_identical(big, big0, "x modified")
    # strided out inside a sentinel buffer
    buf = np.full((T + 2, H + 2, D + 4), -7.25e11, F32)
    out = buf[1:T + 1, 1:H + 1, 2:2 + D]
    r = cpufuse.rope(x, pos, n_dims=nd, mode=mode, isa=isa, out=out)
    assert r is out
    assert_bit_identical(out, ref, "out=")
    inside = np.zeros(buf.shape, bool)
    inside[1:T + 1, 1:H + 1, 2:2 + D] = True
    assert np.all(buf[~inside] == F32(-7.25e11)), "write outside out"
    # in place on the strided view
    r = cpufuse.rope(x, pos, n_dims=nd, mode=mode, isa=isa, out=x)
    assert r is x
    assert_bit_identical(x, ref, "in place")
    mask = np.ones(big.shape, bool)
    mask[::2, 1:H + 1, 3:3 + D] = False
    assert np.array_equal(big[mask], big0[mask]), "in place wrote outside x"


@pytest.mark.parametrize("compat", [False, True], ids=["accurate", "compat"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("mode,D,nd", [("norm", 128, 128), ("neox", 80, 64), ("norm", 10, 6), ("neox", 34, 34)])
def test_cache_write(isa, mode, D, nd, dtype, compat, rng):
    T, H, n_ctx, pos0 = 5, 3, 16, 9
    x = U(rng, (T, H, D))
    pos = (np.arange(T) + pos0).astype(np.int32) * 3  # the angles come from pos, not from pos0
    sentinel = np.array(-3.5, dtype)
    kc = np.full((n_ctx, H, D), sentinel, dtype)
    ref = cpufuse.rope(x, pos, n_dims=nd, mode=mode, isa=isa, ggml_compat=compat)
    r = cpufuse.rope(x, pos, n_dims=nd, mode=mode, isa=isa, ggml_compat=compat, cache=(kc, pos0))
    assert r is None
    want = ref.astype(dtype)  # numpy's float16 conversion rounds to nearest even
    got = kc[pos0:pos0 + T]
    assert np.array_equal(got.view(np.uint16 if dtype == "float16" else np.uint32),
                          want.view(np.uint16 if dtype == "float16" else np.uint32))
    rest = np.concatenate([kc[:pos0], kc[pos0 + T:]])
    assert np.all(rest == sentinel), "cache rows outside [pos0, pos0 + T) touched"


def test_cache_f16_rounding(isa, rng):
    """the f16 store rounds to nearest even on every path: ties, subnormals, overflow, inf, NaN
    (carried through the pass-through dims, which are only converted)"""
    T, H, D, nd = 3, 2, 64, 2
    spec = np.array([65504, 65519.99, 65520, 70000, -65520, np.inf, -np.inf, 1e-8, -1e-8, 2.0 ** -25,
                     2.0 ** -25 * 1.0000001, 3 * 2.0 ** -25, 2.0 ** -24 * 1.5, 2.0 ** -14 * (1 - 2 ** -11),
                     6.1e-5, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, -0.0, 0.0, 2049, 2051, 1e-4, 3.14159, -2.71828],
                    F32)
    x = rng.standard_normal((T, H, D)).astype(F32) * F32(1000)
    x.reshape(-1, D)[:, nd:nd + len(spec)] = spec
    kc = np.zeros((T, H, D), np.float16)
    cpufuse.rope(x, np.arange(T, dtype=np.int32), n_dims=nd, isa=isa, cache=(kc, 0))
    with np.errstate(over="ignore"):
        want = x[..., nd:].astype(np.float16)
    got = kc[..., nd:]
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok].view(np.uint16), want[ok].view(np.uint16))


@pytest.mark.parametrize("compat", [False, True], ids=["accurate", "compat"])
@pytest.mark.parametrize("mode", ["norm", "neox"])
def test_threads_bit_identical(isa, mode, compat, rng):
    T, H, D, nd = 70, 9, 80, 64  # several token chunks and row chunks
    x = U(rng, (T, H, D))
    pos = positions(rng, T)
    ys = [cpufuse.rope(x, pos, n_dims=nd, mode=mode, isa=isa, ggml_compat=compat, n_threads=n)
          for n in (1, 2, 3)]
    assert_bit_identical(ys[0], ys[1], "1 vs 2 threads")
    assert_bit_identical(ys[0], ys[2], "1 vs 3 threads")
    kcs = []
    for n in (1, 3):
        kc = np.zeros((T + 4, H, D), np.float16)
        cpufuse.rope(x, pos, n_dims=nd, mode=mode, isa=isa, ggml_compat=compat, cache=(kc, 2), n_threads=n)
        kcs.append(kc.view(np.uint16))
    assert np.array_equal(kcs[0], kcs[1])


@pytest.mark.parametrize("mode", ["norm", "neox"])
def test_many_heads_split_tokens(isa, mode, rng):
    """more heads than a chunk holds (each token's heads split over chunks, each computing the
    token's table): same bits for 1 and 3 threads, accurate vs float64, and the cache write"""
    T, H, D, nd = 3, 70, 128, 128
    x = U(rng, (T, H, D))
    pos = positions(rng, T)
    y1 = cpufuse.rope(x, pos, n_dims=nd, mode=mode, isa=isa, n_threads=1)
    y3 = cpufuse.rope(x, pos, n_dims=nd, mode=mode, isa=isa, n_threads=3)
    assert_bit_identical(y1, y3, "1 vs 3 threads")
    assert_nmse(ref64(x, pos, nd, mode), y1, NMSE_TOL, f"{isa} {mode} H={H}")
    kc = np.zeros((T + 1, H, D), np.float16)
    cpufuse.rope(x, pos, n_dims=nd, mode=mode, isa=isa, cache=(kc, 1), n_threads=3)
    assert np.array_equal(kc[1:].view(np.uint16), y1.astype(np.float16).view(np.uint16))


def test_int_modes_and_empty(isa, rng):
    x = U(rng, (4, 2, 16))
    pos = positions(rng, 4)
    for s, i in (("norm", 0), ("neox", 2)):
        assert_bit_identical(cpufuse.rope(x, pos, n_dims=16, mode=s, isa=isa),
                             cpufuse.rope(x, pos, n_dims=16, mode=i, isa=isa), s)
    e = cpufuse.rope(np.zeros((0, 2, 16), F32), np.zeros(0, np.int32), n_dims=16, isa=isa)
    assert e.shape == (0, 2, 16)
    kc = np.zeros((4, 2, 16), np.float16)
    assert cpufuse.rope(np.zeros((0, 2, 16), F32), np.zeros(0, np.int32), n_dims=16, isa=isa,
                        cache=(kc, 4)) is None


def test_isas_agree(rng):
    """every path gives the same bits in compat mode except scalar (no FMA); accurate mode agrees to
    float rounding"""
    x = U(rng, (9, 3, 80))
    pos = positions(rng, 9)
    isas = [i for i in cpufuse.available_isas()]
    outs = {i: cpufuse.rope(x, pos, n_dims=64, mode="neox", ggml_compat=True, isa=i) for i in isas}
    fma_isas = [i for i in isas if i != "scalar"]
    for i in fma_isas[1:]:
        assert_bit_identical(outs[i], outs[fma_isas[0]], f"{i} vs {fma_isas[0]}")


# ------------------------------------------------------------------------------------------------
# errors

_X = np.zeros((3, 2, 16), F32)
_P = np.arange(3, dtype=np.int32)


def _ro(a):
    a = a.copy()
    a.setflags(write=False)
    return a


ERRORS = [
    ("x-f64", TypeError, "x", lambda i: cpufuse.rope(_X.astype(F64), _P, n_dims=16, isa=i)),
    ("x-list", TypeError, "x", lambda i: cpufuse.rope(_X.tolist(), _P, n_dims=16, isa=i)),
    ("x-2d", ValueError, "x", lambda i: cpufuse.rope(_X[0], _P, n_dims=16, isa=i)),
    ("x-stride", ValueError, "x", lambda i: cpufuse.rope(np.zeros((3, 2, 32), F32)[..., ::2], _P, n_dims=16, isa=i)),
    ("pos-i64", TypeError, "pos", lambda i: cpufuse.rope(_X, _P.astype(np.int64), n_dims=16, isa=i)),
    ("pos-list", TypeError, "pos", lambda i: cpufuse.rope(_X, [0, 1, 2], n_dims=16, isa=i)),
    ("pos-len", ValueError, "pos", lambda i: cpufuse.rope(_X, _P[:2], n_dims=16, isa=i)),
    ("n_dims-odd", ValueError, "n_dims", lambda i: cpufuse.rope(_X, _P, n_dims=15, isa=i)),
    ("n_dims-big", ValueError, "n_dims", lambda i: cpufuse.rope(_X, _P, n_dims=18, isa=i)),
    ("n_dims-0", ValueError, "n_dims", lambda i: cpufuse.rope(_X, _P, n_dims=0, isa=i)),
    ("n_dims-float", TypeError, "n_dims", lambda i: cpufuse.rope(_X, _P, n_dims=16.0, isa=i)),
    ("mode-bad", ValueError, "mode", lambda i: cpufuse.rope(_X, _P, n_dims=16, mode="gptj", isa=i)),
    ("mode-mrope", ValueError, "mode", lambda i: cpufuse.rope(_X, _P, n_dims=16, mode=8, isa=i)),
    ("mode-1", ValueError, "mode", lambda i: cpufuse.rope(_X, _P, n_dims=16, mode=1, isa=i)),
    ("mode-type", TypeError, "mode", lambda i: cpufuse.rope(_X, _P, n_dims=16, mode=None, isa=i)),
    ("base-0", ValueError, "freq_base", lambda i: cpufuse.rope(_X, _P, n_dims=16, freq_base=0.0, isa=i)),
    ("scale-neg", ValueError, "freq_scale", lambda i: cpufuse.rope(_X, _P, n_dims=16, freq_scale=-1.0, isa=i)),
    ("ext-nan", ValueError, "ext_factor", lambda i: cpufuse.rope(_X, _P, n_dims=16, ext_factor=float("nan"), isa=i)),
    ("attn-str", TypeError, "attn_factor", lambda i: cpufuse.rope(_X, _P, n_dims=16, attn_factor="1", isa=i)),
    ("nctx-neg", ValueError, "n_ctx_orig", lambda i: cpufuse.rope(_X, _P, n_dims=16, n_ctx_orig=-1, isa=i)),
    ("ff-len", ValueError, "freq_factors",
     lambda i: cpufuse.rope(_X, _P, n_dims=16, freq_factors=np.ones(16, F32), isa=i)),
    ("ff-dtype", TypeError, "freq_factors",
     lambda i: cpufuse.rope(_X, _P, n_dims=16, freq_factors=np.ones(8, F64), isa=i)),
    ("compat-type", TypeError, "ggml_compat", lambda i: cpufuse.rope(_X, _P, n_dims=16, ggml_compat="yes", isa=i)),
    ("out-shape", ValueError, "out", lambda i: cpufuse.rope(_X, _P, n_dims=16, out=np.zeros((3, 2, 8), F32), isa=i)),
    ("out-dtype", TypeError, "out", lambda i: cpufuse.rope(_X, _P, n_dims=16, out=np.zeros((3, 2, 16), np.float16), isa=i)),
    ("out-ro", ValueError, "out", lambda i: cpufuse.rope(_X, _P, n_dims=16, out=_ro(_X), isa=i)),
    ("out-overlap", ValueError, "out",
     lambda i: (lambda b: cpufuse.rope(b[:96].reshape(3, 2, 16), _P, n_dims=16, out=b[8:104].reshape(3, 2, 16), isa=i))(
         np.zeros(112, F32))),
    ("cache-type", TypeError, "cache", lambda i: cpufuse.rope(_X, _P, n_dims=16, cache=np.zeros((4, 2, 16), np.float16), isa=i)),
    ("cache-dtype", TypeError, "cache", lambda i: cpufuse.rope(_X, _P, n_dims=16, cache=(np.zeros((4, 2, 16), F64), 0), isa=i)),
    ("cache-shape", ValueError, "cache", lambda i: cpufuse.rope(_X, _P, n_dims=16, cache=(np.zeros((4, 3, 16), np.float16), 0), isa=i)),
    ("cache-rows", ValueError, "cache",
     lambda i: cpufuse.rope(_X, _P, n_dims=16, cache=(np.zeros((4, 2, 32), np.float16)[..., ::2], 0), isa=i)),
    ("cache-bounds", ValueError, "cache", lambda i: cpufuse.rope(_X, _P, n_dims=16, cache=(np.zeros((4, 2, 16), np.float16), 2), isa=i)),
    ("cache-pos0", ValueError, "cache", lambda i: cpufuse.rope(_X, _P, n_dims=16, cache=(np.zeros((4, 2, 16), np.float16), -1), isa=i)),
    ("cache-ro", ValueError, "cache", lambda i: cpufuse.rope(_X, _P, n_dims=16, cache=(_ro(np.zeros((4, 2, 16), np.float16)), 0), isa=i)),
    ("cache-and-out", ValueError, "cache",
     lambda i: cpufuse.rope(_X, _P, n_dims=16, out=np.zeros_like(_X), cache=(np.zeros((4, 2, 16), np.float16), 0), isa=i)),
]


@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_errors(isa, case):
    _, exc, name, fn = case
    with pytest.raises(exc) as ei:
        fn(isa)
    assert name in str(ei.value), f"message does not name {name!r}: {ei.value}"


def test_cache_bounds_message():
    with pytest.raises(ValueError, match=r"cache.*context size.*n_ctx = 4"):
        cpufuse.rope(_X, _P, n_dims=16, cache=(np.zeros((4, 2, 16), np.float16), 2))


def test_exported():
    assert "rope" in cpufuse.OPS and "rope" in cpufuse.__all__
    from cpufuse.ops import rope as rope_module
    assert cpufuse.rope is rope_module.rope


def test_rope_params_is_the_one_check_and_shares_ropes_defaults():
    """rope and the graph's rope record both normalize their parameters through rope_params"""
    from cpufuse.ops.rope import rope, rope_params
    dr = rope.__kwdefaults__
    dp = rope_params.__kwdefaults__
    assert {k: dr[k] for k in dp} == dp
    assert rope_params.__defaults__ == (dr["mode"],)
    p = rope_params(8, 16, "neox", freq_base=5e5)
    assert p.n_dims == 8 and p.mode == 1 and p.fps == [5e5, 1.0, 0.0, 1.0, 32.0, 1.0]
    with pytest.raises(ValueError, match="n_dims"):
        rope_params(18, 16)
    with pytest.raises(TypeError, match="freq_scale"):
        rope_params(8, 16, freq_scale="1")
