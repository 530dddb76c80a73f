"""cpufuse.matmul(x, w, residual=r): y = r + x . dequant(w)^T in one kernel call (the residual-add
epilogue, docs/semantics.md "Quantized matmul"). On every path (each ISA, both activation modes, GGUF
or repacked weights, with and without the RMS_NORM prologue) the result is bit for bit what
`r + cpufuse.matmul(x, w)` gives, and within the float64 reference's tolerance; out=r updates r in
place; every thread count gives the same bits; NaN / inf in r propagate as in r + d.
"""
import numpy as np
import pytest

import cpufuse
from cpufuse.reference import quant as qref
from _util import assert_nmse

TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "F16")
ROWS = (1, 3, 17, 40)   # one row, the 4-row tiles with a tail, and AMX's 16-row tiles with a tail
N_OUT = 37              # two output chunks, the second a partial panel


def _k(qt):
    return 256 if qt.endswith("K") else 96


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def _same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32, what
    assert np.array_equal(_bits(a), _bits(b)), f"{what}: {np.argwhere(_bits(a) != _bits(b))[:5].tolist()}"


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("repack", [False, True])
@pytest.mark.parametrize("act", ["q8", "f32"])
def test_equals_unfused(isa, act, repack, norm, rng):
    for qt in TYPES:
        K = _k(qt)
        wg = qref.make_weight(qt, N_OUT, K, rng)
        w = wg.repack() if repack else wg
        kw = dict(norm_weight=rng.uniform(0.5, 1.5, K).astype(np.float32), eps=1e-5) if norm else {}
        for rows in ROWS:
            what = f"{isa} {qt} {act} repack={repack} norm={norm} rows={rows}"
            x = rng.standard_normal((rows, K)).astype(np.float32)
            r = (rng.standard_normal((rows, N_OUT)) * 4).astype(np.float32)
            x0, r0 = x.copy(), r.copy()
            y = cpufuse.matmul(x, w, act=act, isa=isa, residual=r, **kw)
            _same(y, r + cpufuse.matmul(x, w, act=act, isa=isa, **kw), what)
            assert np.array_equal(x, x0) and np.array_equal(r, r0), what
            if not norm:
                assert_nmse(qref.ref_matmul_residual(x, wg, r, act), y, 1e-10, what)
            # in place: out is the residual itself
            rr = r.copy()
            got = cpufuse.matmul(x, w, act=act, isa=isa, residual=rr, out=rr, **kw)
            assert got is rr or np.shares_memory(got, rr)
            _same(rr, y, what + " out=residual")
            # one row as a 1-D vector
            y1 = cpufuse.matmul(x[0], w, act=act, isa=isa, residual=r[0], **kw)
            _same(y1, y[0], what + " 1-D")


@pytest.mark.parametrize("act", ["q8", "f32"])
def test_threads_bit_identical(isa, act, rng):
    for qt, rows in (("Q4_K", 1), ("Q4_1", 5), ("Q8_0", 33)):
        K = 512 if qt.endswith("K") else 160
        w = qref.make_weight(qt, 70, K, rng)
        x = rng.standard_normal((rows, K)).astype(np.float32)
        r = rng.standard_normal((rows, 70)).astype(np.float32)
        ys = [cpufuse.matmul(x, w, act=act, isa=isa, residual=r, n_threads=n) for n in (1, 2, 3)]
        for n, y in zip((2, 3), ys[1:]):
            _same(ys[0], y, f"{isa} {qt} {act} n_threads=1 vs {n}")
        _same(ys[0], r + cpufuse.matmul(x, w, act=act, isa=isa, n_threads=2), f"{isa} {qt} {act}")


def test_nonfinite_residual(isa, rng):
    """NaN and +-inf in the residual give what r + d gives (inf + finite = inf, inf - inf = NaN)"""
    w = qref.make_weight("Q4_0", 40, 64, rng)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    d = cpufuse.matmul(x, w, isa=isa)
    r = rng.standard_normal((3, 40)).astype(np.float32)
    r[0, 1], r[1, 17], r[2, 39], r[2, 0] = np.nan, np.inf, -np.inf, np.float32(3e38)
    y = cpufuse.matmul(x, w, isa=isa, residual=r)
    e = r + d
    assert np.array_equal(np.isnan(y), np.isnan(e)) and np.array_equal(y[~np.isnan(e)], e[~np.isnan(e)])
    assert np.isnan(y[0, 1]) and y[1, 17] == np.inf and y[2, 39] == -np.inf
    # inf in the product (an inf activation) meeting -inf in the residual: NaN, as r + d
    x[1, 5] = np.inf
    r[1, :] = -np.inf
    y = cpufuse.matmul(x, w, isa=isa, act="f32", residual=r)
    with np.errstate(invalid="ignore"):
        e = r + cpufuse.matmul(x, w, isa=isa, act="f32")
    assert np.array_equal(np.isnan(y), np.isnan(e)) and np.array_equal(y[~np.isnan(e)], e[~np.isnan(e)])


def test_strided_and_batched_residual(isa, rng):
    """a residual with strided rows, an offset start, 3-D leading axes, or non-mergeable axes
    (copied) gives the contiguous residual's bits; out may be strided too"""
    w = qref.make_weight("Q4_K", 21, 256, rng)
    x = rng.standard_normal((6, 256)).astype(np.float32)
    big = rng.standard_normal((12, 40)).astype(np.float32)
    r = big[::2, 3:24]
    assert not r.flags.c_contiguous
    want = np.ascontiguousarray(r) + cpufuse.matmul(x, w, isa=isa)
    _same(cpufuse.matmul(x, w, isa=isa, residual=r), want, "strided residual")
    out = np.full((6, 30), np.nan, np.float32)
    cpufuse.matmul(x, w, isa=isa, residual=r, out=out[:, 2:23])
    _same(out[:, 2:23], want, "strided out")
    assert np.isnan(out[:, :2]).all() and np.isnan(out[:, 23:]).all()
    # rows in reverse order (a negative row stride)
    rv = np.ascontiguousarray(r[::-1])[::-1]
    assert rv.strides[0] < 0
    _same(cpufuse.matmul(x, w, isa=isa, residual=rv), want, "reversed rows")
    # in place on a strided view
    before = big.copy()
    cpufuse.matmul(x, w, isa=isa, residual=r, out=r)
    _same(big[::2, 3:24], want, "strided in place")
    mask = np.ones(big.shape, bool)
    mask[::2, 3:24] = False
    assert np.array_equal(big[mask], before[mask])
    # 3-D: (2, 3, n) leading axes; and a transposed residual whose axes do not merge (copied)
    x3 = x.reshape(2, 3, 256)
    r3 = rng.standard_normal((2, 3, 21)).astype(np.float32)
    _same(cpufuse.matmul(x3, w, isa=isa, residual=r3), r3 + cpufuse.matmul(x3, w, isa=isa), "3-D")
    rt = np.ascontiguousarray(r3.transpose(1, 0, 2)).transpose(1, 0, 2)
    _same(cpufuse.matmul(x3, w, isa=isa, residual=rt), r3 + cpufuse.matmul(x3, w, isa=isa), "3-D transposed")


def test_errors(rng):
    w = qref.make_weight("Q4_0", 8, 64, rng)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    r = np.zeros((2, 8), np.float32)
    with pytest.raises(TypeError, match="residual must be float32.*got float64"):
        cpufuse.matmul(x, w, residual=r.astype(np.float64))
    with pytest.raises(TypeError, match="residual must be a numpy.ndarray.*got list"):
        cpufuse.matmul(x, w, residual=r.tolist())
    with pytest.raises(ValueError, match=r"residual must have the output's shape \(2, 8\).*got \(2, 9\)"):
        cpufuse.matmul(x, w, residual=np.zeros((2, 9), np.float32))
    with pytest.raises(ValueError, match=r"residual must have the output's shape \(8,\).*got \(1, 8\)"):
        cpufuse.matmul(x[0], w, residual=np.zeros((1, 8), np.float32))
    # out partially overlapping the residual
    buf = np.zeros((2, 9), np.float32)
    with pytest.raises(ValueError, match="out must not overlap the input 'residual'"):
        cpufuse.matmul(x, w, residual=buf[:, :8], out=buf[:, 1:])
    flat = np.zeros(17, np.float32)
    with pytest.raises(ValueError, match="out must not overlap the input 'residual'"):
        cpufuse.matmul(x, w, residual=flat[:16].reshape(2, 8), out=flat[1:].reshape(2, 8))
    # the residual overlapping x or the weights
    xb = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="residual must not share memory.*'x'"):
        cpufuse.matmul(xb, w, residual=xb[:, :8])
    wr = np.frombuffer(w.raw, np.float32)[:16].reshape(2, 8)
    with pytest.raises(ValueError, match="residual must not share memory.*'w'"):
        cpufuse.matmul(x, w, residual=wr)
    with pytest.raises(TypeError, match="residual"):
        cpufuse.matmul_swiglu(x, w, w, residual=r)
    with pytest.raises(TypeError, match="residual"):
        cpufuse.matmul_multi(x, (w,), residual=r)
    # empty calls still check the residual
    assert cpufuse.matmul(np.empty((0, 64), np.float32), w, residual=np.empty((0, 8), np.float32)).shape == (0, 8)
    with pytest.raises(ValueError, match="residual must have"):
        cpufuse.matmul(np.empty((0, 64), np.float32), w, residual=np.empty((1, 8), np.float32))


def test_native_kernel_refuses_a_residual_epilogue_without_a_residual(rng):
    """EPI 2 with a NULL residual, or with more than one weight, is refused by the C kernel (rc 1)"""
    from cpufuse import _registry
    from cpufuse._backend import ffi
    from cpufuse.quant.matmul import qm_desc
    isa = next(iter(_registry.NATIVE), None)
    if isa is None or ffi is None:
        pytest.skip("native extension not built")
    w = qref.make_weight("Q8_0", 8, 64, rng)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    y = np.zeros(8, np.float32)
    d = ffi.new("int64_t[]", qm_desc(1, 64, 64, True, 2, 0, [w], [8]))
    wp = ffi.from_buffer(w.raw)
    xp, yp = ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", y)
    fn = _registry.kernel("qmatmul", isa)
    assert fn(d, xp, ffi.NULL, 0.0, wp, ffi.NULL, ffi.NULL, yp, ffi.NULL, ffi.NULL, ffi.NULL, 1) == 1
    assert fn(d, xp, ffi.NULL, 0.0, wp, ffi.NULL, ffi.NULL, yp, ffi.NULL, ffi.NULL, yp, 1) == 0
