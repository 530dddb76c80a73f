"""The binder's entries (cpufuse/ops/binder.py) of the small calls (issue 14): a planned call is
bit-identical to the general one, raises the same errors, leaves inputs alone and keeps out= and
in-place. The general path is forced with an argument of another type but the same value (max_bias=0,
eps=np.float64(...), chunk=np.int64(256), n_ctx_orig=np.int64(0)) or a non-contiguous view, which a
plan leaves to it. A plan never skips a check: after a call made one, a call whose arguments differ
only in what the signature leaves out (addresses, layout, writeability, overlap, pos0) still raises."""
import numpy as np
import pytest

import cpufuse
from cpufuse.reference.quant import make_weight
from cpufuse.ops.attention import auto_split_chunk
from _util import AVAILABLE, assert_bit_identical, raised

ISAS = [i for i in AVAILABLE]  # every path here, numba included
RNG = np.random.default_rng(1414)
EPS = 1e-6


def f32(*shape):
    return RNG.standard_normal(shape, dtype=np.float32)


def strided(a):
    """a copy of a whose rows are padded apart (not C-contiguous when it has several rows)"""
    big = np.zeros(a.shape[:-1] + (a.shape[-1] + 3,), a.dtype)
    big[..., :a.shape[-1]] = a
    return big[..., :a.shape[-1]]


# ------------------------------------------------------------------------------------------------
# a planned call == the general call, bit for bit

@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(64,), (1, 64), (3, 37), (5, 576)])
def test_softmax_planned_matches_general(isa, shape):
    x = f32(*shape) * 4
    x0 = x.copy()
    planned = cpufuse.softmax(x, scale=0.5, isa=isa)
    gen = cpufuse.softmax(x, scale=0.5, max_bias=0, isa=isa)
    assert_bit_identical(planned, gen)
    assert_bit_identical(cpufuse.softmax(strided(x), scale=0.5, isa=isa), gen)
    y = np.empty_like(x)
    assert cpufuse.softmax(x, scale=0.5, out=y, isa=isa) is y
    assert_bit_identical(y, gen)
    assert_bit_identical(x, x0)
    xi = x.copy()
    assert cpufuse.softmax(xi, scale=0.5, out=xi, isa=isa) is xi  # in place
    assert_bit_identical(xi, gen)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mdt", [np.float32, np.float16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 37), (5, 576)])
def test_softmax_masked_planned_matches_general(isa, mdt, shape):
    """the planned path takes an (R, C) f32/f16 mask like x's: same bits as the general path (forced by
    max_bias=0 as an int), -inf columns and a fully masked row (NaN) included; a mask that shares
    bytes with out is refused with the general path's message"""
    x = f32(*shape) * 4
    mask = np.where(RNG.random(shape) < 0.3, -np.inf, RNG.standard_normal(shape)).astype(mdt)
    if shape[0] > 1:
        mask[0, :] = -np.inf  # a fully masked row: NaN
    x0, m0 = x.copy(), mask.copy()
    gen = cpufuse.softmax(x, mask, scale=0.5, max_bias=0, isa=isa)
    assert_bit_identical(cpufuse.softmax(x, mask, scale=0.5, isa=isa), gen)
    assert_bit_identical(cpufuse.softmax(x, strided(mask), scale=0.5, isa=isa), gen)
    y = np.empty_like(x)
    assert cpufuse.softmax(x, mask, scale=0.5, out=y, isa=isa) is y
    assert_bit_identical(y, gen)
    xi = x.copy()
    assert cpufuse.softmax(xi, mask, scale=0.5, out=xi, isa=isa) is xi
    assert_bit_identical(xi, gen)
    assert_bit_identical(x, x0)
    assert_bit_identical(mask, m0)
    if mdt is np.float32:
        both = np.concatenate([x, x], axis=0)
        m_alias = both[:shape[0]]
        m_alias[...] = mask
        want = raised(lambda: cpufuse.softmax(x, m_alias.copy(), scale=0.5, max_bias=0, out=both[:shape[0]], isa=isa))
        got = raised(lambda: cpufuse.softmax(x, m_alias, scale=0.5, out=both[:shape[0]], isa=isa))
        assert got is not None and got[0] is ValueError and "mask" in got[1], got
        assert want is None  # a separate mask is fine


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(64,), (1, 64), (3, 37), (2, 576)])
def test_rms_norm_planned_matches_general(isa, shape):
    x, w = f32(*shape), f32(shape[-1])
    x0, w0 = x.copy(), w.copy()
    gen = cpufuse.rms_norm(x, w, eps=np.float64(EPS), isa=isa)
    assert_bit_identical(cpufuse.rms_norm(x, w, eps=EPS, isa=isa), gen)
    assert_bit_identical(cpufuse.rms_norm(strided(x), w, eps=EPS, isa=isa), gen)
    y = np.empty_like(x)
    assert cpufuse.rms_norm(x, w, eps=EPS, out=y, isa=isa) is y
    assert_bit_identical(y, gen)
    assert_bit_identical(x, x0)
    assert_bit_identical(w, w0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(64,), (1, 64), (3, 37)])
def test_add_rms_norm_planned_matches_general(isa, shape):
    x, r, w = f32(*shape), f32(*shape), f32(shape[-1])
    x0, r0 = x.copy(), r.copy()
    gh, gy = cpufuse.add_rms_norm(x, r, w, eps=np.float64(EPS), isa=isa)
    h, y = cpufuse.add_rms_norm(x, r, w, eps=EPS, isa=isa)
    assert_bit_identical(h, gh)
    assert_bit_identical(y, gy)
    ho, yo = np.empty_like(x), np.empty_like(x)
    res = cpufuse.add_rms_norm(x, r, w, eps=EPS, out=(ho, yo), isa=isa)
    assert res[0] is ho and res[1] is yo
    assert_bit_identical(ho, gh)
    assert_bit_identical(yo, gy)
    assert_bit_identical(x, x0)
    assert_bit_identical(r, r0)
    xi = x.copy()  # in-place residual update: h_out is x
    cpufuse.add_rms_norm(xi, r, w, eps=EPS, out=(xi, yo), isa=isa)
    assert_bit_identical(xi, gh)
    assert_bit_identical(yo, gy)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv", [np.float16, np.float32])
@pytest.mark.parametrize("geom", [(1, 1, 1, 64, 1, 1, 64), (2, 4, 3, 64, 2, 37, 48), (1, 2, 1, 32, 1, 600, 32)])
def test_flash_attn_planned_matches_general(isa, kv, geom):
    S, Hq, N, DK, Hk, T, DV = geom
    q = f32(S, Hq, N, DK)
    k = f32(S, Hk, T, DK).astype(kv)
    v = f32(S, Hk, T, DV).astype(kv)
    q0, k0 = q.copy(), k.copy()
    # a numpy int chunk takes the general path; the default's chunk is auto_split_chunk(T)
    gen = cpufuse.flash_attn(q, k, v, scale=0.125, chunk=np.int64(auto_split_chunk(T)), isa=isa)
    assert_bit_identical(cpufuse.flash_attn(q, k, v, scale=0.125, isa=isa), gen)
    o = np.empty_like(gen)
    assert cpufuse.flash_attn(q, k, v, scale=0.125, out=o, isa=isa) is o
    assert_bit_identical(o, gen)
    assert_bit_identical(q, q0)
    assert_bit_identical(k, k0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("rows", [1, 3])
def test_qmatmul_planned_matches_general(isa, qtype, rows):
    ws = [make_weight(qtype, 64, 64, RNG) for _ in range(3)]
    x = f32(rows, 64)
    xs = x[None]  # the long way (3-D)
    nw = 1 + 0.1 * f32(64)
    x0 = x.copy()
    for fn, args in ((cpufuse.matmul, (ws[0],)), (cpufuse.matmul_multi, (tuple(ws),)),
                     (cpufuse.matmul_swiglu, (ws[0], ws[1]))):
        for kw in ({}, {"norm_weight": nw, "eps": EPS}):
            planned = fn(x, *args, isa=isa, **kw)
            gen = fn(xs, *args, isa=isa, **kw)
            if fn is cpufuse.matmul_multi:
                for a, b in zip(planned, gen):
                    assert_bit_identical(a, b[0])
            else:
                assert_bit_identical(planned, gen[0])
    y = np.empty((rows, 64), np.float32)
    assert cpufuse.matmul(x, ws[0], out=y, isa=isa) is y
    assert_bit_identical(y, cpufuse.matmul(xs, ws[0], isa=isa)[0])
    assert_bit_identical(x, x0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", ["norm", "neox"])
def test_rope_out_planned_matches_general(isa, mode):
    x = f32(3, 2, 64)
    pos = np.array([0, 7, 4096], np.int32)
    x0 = x.copy()
    gen = cpufuse.rope(x, pos, n_dims=48, mode=mode, n_ctx_orig=np.int64(0), isa=isa)
    assert_bit_identical(cpufuse.rope(x, pos, n_dims=48, mode=mode, isa=isa), gen)
    y = np.empty_like(x)
    assert cpufuse.rope(x, pos, n_dims=48, mode=mode, out=y, isa=isa) is y
    assert_bit_identical(y, gen)
    assert_bit_identical(x, x0)
    xi = x.copy()
    assert cpufuse.rope(xi, pos, n_dims=48, mode=mode, out=xi, isa=isa) is xi
    assert_bit_identical(xi, gen)


# ------------------------------------------------------------------------------------------------
# bad arguments: the planned call raises what the general call raises

def _pairs():
    x, w = f32(2, 64), f32(64)
    buf = np.zeros(200, np.float32)
    a, b = buf[:128].reshape(2, 64), buf[10:138].reshape(2, 64)  # overlapping views
    ro = np.empty((2, 64), np.float32)
    ro.flags.writeable = False
    q = f32(1, 1, 1, 64)
    k = f32(1, 1, 1, 64).astype(np.float16)
    qbuf = np.zeros(200, np.float32)
    qv, ov = qbuf[:64].reshape(1, 1, 1, 64), qbuf[32:96].reshape(1, 1, 1, 64)
    xr, pos = f32(1, 1, 64), np.array([3], np.int32)
    return {
        "softmax out shape": (lambda: cpufuse.softmax(x, out=np.empty((64, 2), np.float32)),
                              lambda: cpufuse.softmax(x, max_bias=0, out=np.empty((64, 2), np.float32))),
        "softmax out dtype": (lambda: cpufuse.softmax(x, out=np.empty((2, 64))),
                              lambda: cpufuse.softmax(x, max_bias=0, out=np.empty((2, 64)))),
        "softmax out read-only": (lambda: cpufuse.softmax(x, out=ro), lambda: cpufuse.softmax(x, max_bias=0, out=ro)),
        "softmax overlap": (lambda: cpufuse.softmax(a, out=b), lambda: cpufuse.softmax(a, max_bias=0, out=b)),
        "softmax isa": (lambda: cpufuse.softmax(x, isa="bogus"), lambda: cpufuse.softmax(x, max_bias=0, isa="bogus")),
        "softmax n_threads": (lambda: cpufuse.softmax(x, n_threads=0),
                              lambda: cpufuse.softmax(x, max_bias=0, n_threads=0)),
        "softmax x dtype": (lambda: cpufuse.softmax(x.astype(np.float64)),
                            lambda: cpufuse.softmax(x.astype(np.float64), max_bias=0)),
        "rms weight shape": (lambda: cpufuse.rms_norm(x, f32(63), eps=EPS),
                             lambda: cpufuse.rms_norm(x, f32(63), eps=np.float64(EPS))),
        "rms eps": (lambda: cpufuse.rms_norm(x, w, eps=-1.0), lambda: cpufuse.rms_norm(strided(x), w, eps=-1.0)),
        "rms overlap": (lambda: cpufuse.rms_norm(a, w, eps=EPS, out=b),
                        lambda: cpufuse.rms_norm(a, w, eps=np.float64(EPS), out=b)),
        "rms out read-only": (lambda: cpufuse.rms_norm(x, w, eps=EPS, out=ro),
                              lambda: cpufuse.rms_norm(x, w, eps=np.float64(EPS), out=ro)),
        "add_rms overlap y": (lambda: cpufuse.add_rms_norm(a, x, w, eps=EPS, out=(np.empty_like(x), b)),
                              lambda: cpufuse.add_rms_norm(a, x, w, eps=np.float64(EPS), out=(np.empty_like(x), b))),
        "add_rms overlap h": (lambda: cpufuse.add_rms_norm(a, x, w, eps=EPS, out=(b, np.empty_like(x))),
                              lambda: cpufuse.add_rms_norm(a, x, w, eps=np.float64(EPS), out=(b, np.empty_like(x)))),
        "add_rms residual shape": (lambda: cpufuse.add_rms_norm(x, f32(3, 64), w, eps=EPS),
                                   lambda: cpufuse.add_rms_norm(x, f32(3, 64), w, eps=np.float64(EPS))),
        "add_rms out type": (lambda: cpufuse.add_rms_norm(x, x, w, eps=EPS, out=[x, x]),
                             lambda: cpufuse.add_rms_norm(x, x, w, eps=np.float64(EPS), out=[x, x])),
        "flash overlap": (lambda: cpufuse.flash_attn(qv, k, k, scale=0.1, out=ov),
                          lambda: cpufuse.flash_attn(qv, k, k, scale=0.1, out=ov, chunk=np.int64(256))),
        "flash scale nan": (lambda: cpufuse.flash_attn(q, k, k, scale=float("nan")),
                            lambda: cpufuse.flash_attn(q, k, k, scale=float("nan"), chunk=np.int64(256))),
        "flash heads": (lambda: cpufuse.flash_attn(f32(1, 3, 1, 64), f32(1, 2, 1, 64), f32(1, 2, 1, 64), scale=0.1),
                        lambda: cpufuse.flash_attn(f32(1, 3, 1, 64), f32(1, 2, 1, 64), f32(1, 2, 1, 64), scale=0.1,
                                                   chunk=np.int64(256))),
        "rope overlap": (lambda: cpufuse.rope(qbuf[:64].reshape(1, 1, 64), pos, n_dims=64,
                                              out=qbuf[32:96].reshape(1, 1, 64)),
                         lambda: cpufuse.rope(qbuf[:64].reshape(1, 1, 64), pos, n_dims=64, n_ctx_orig=np.int64(0),
                                              out=qbuf[32:96].reshape(1, 1, 64))),
        "rope out shape": (lambda: cpufuse.rope(xr, pos, n_dims=64, out=np.empty((1, 64, 1), np.float32)),
                           lambda: cpufuse.rope(xr, pos, n_dims=64, n_ctx_orig=np.int64(0),
                                                out=np.empty((1, 64, 1), np.float32))),
    }


@pytest.mark.parametrize("case", list(_pairs()))
def test_planned_errors_match_general(case):
    planned, gen = _pairs()[case]
    want = raised(gen)
    assert want is not None, f"{case}: the general call did not raise"
    assert raised(planned) == want


def test_matmul_errors_match_general():
    w = make_weight("Q8_0", 64, 64, RNG)
    buf = np.zeros(300, np.float32)
    x, y = buf[:128].reshape(2, 64), buf[100:228].reshape(2, 64)
    want = raised(lambda: cpufuse.matmul(x[None], w, out=y[None]))
    assert want is not None and raised(lambda: cpufuse.matmul(x, w, out=y)) == want
    wb = np.frombuffer(w.raw, np.uint8)  # an output over the weight's own bytes
    assert raised(lambda: cpufuse.matmul(np.zeros(64, np.float32), w, out=wb[:256].view(np.float32))) is not None


def test_unaligned_overlap_is_caught():
    """float32 arrays 2 bytes apart share bytes: the pointer test must not take them for disjoint
    (nor for the same array)"""
    raw = np.zeros(1024, np.uint8)
    a = np.frombuffer(raw.data, np.float32, 64, offset=2).reshape(1, 64)
    b = np.frombuffer(raw.data, np.float32, 64, offset=4).reshape(1, 64)
    assert not a.flags.aligned
    got = raised(lambda: cpufuse.softmax(a, out=b))
    assert got == raised(lambda: cpufuse.softmax(a, max_bias=0, out=b)) and got is not None
    w = np.ones(64, np.float32)
    got = raised(lambda: cpufuse.add_rms_norm(a, a, w, eps=EPS, out=(np.empty_like(a), b)))
    assert got == raised(lambda: cpufuse.add_rms_norm(a, a, w, eps=np.float64(EPS), out=(np.empty_like(a), b)))
    assert got is not None
    q, o = a.reshape(1, 1, 1, 64), b.reshape(1, 1, 1, 64)
    got = raised(lambda: cpufuse.flash_attn(q, q, q, scale=0.1, out=o))
    assert got == raised(lambda: cpufuse.flash_attn(q, q, q, scale=0.1, out=o, chunk=np.int64(256))) and got
    pos = np.array([1], np.int32)
    got = raised(lambda: cpufuse.rope(a.reshape(1, 1, 64), pos, n_dims=64, out=b.reshape(1, 1, 64)))
    assert got == raised(lambda: cpufuse.rope(a.reshape(1, 1, 64), pos, n_dims=64, n_ctx_orig=np.int64(0),
                                              out=b.reshape(1, 1, 64))) and got


# ------------------------------------------------------------------------------------------------
# the serial Numba twins compute what the parallel kernels compute

@pytest.mark.skipif("numba" not in AVAILABLE, reason="numba is not installed")
@pytest.mark.parametrize("shape", [(1, 1, 1, 576), (2, 3, 5, 37)])
def test_numba_serial_twins_bit_identical(shape):
    from cpufuse.numba import kernels as nk
    from cpufuse.numba.entries import D1 as d1, D16 as d16, D32 as d32
    x = f32(*shape) * 3
    w = 1 + 0.1 * f32(1, 1, 1, shape[-1])
    ys, yp = np.empty_like(x), np.empty_like(x)
    nk.softmax_serial(x, d32, d16, 0, d1, False, d1, False, 0.7, ys)
    nk.softmax(x, d32, d16, 0, d1, False, d1, False, 0.7, yp)
    assert_bit_identical(ys, yp)
    nk.rms_norm_serial(x, d32, False, w, True, d32, False, EPS, d32, ys)
    nk.rms_norm(x, d32, False, w, True, d32, False, EPS, d32, yp)
    assert_bit_identical(ys, yp)
    # and a call above the serial threshold takes the parallel kernel with the same result
    big = f32(64, 576)
    assert_bit_identical(cpufuse.softmax(big, isa="numba"), cpufuse.softmax(big, max_bias=0, isa="numba"))


# ------------------------------------------------------------------------------------------------
# a plan never outlives a check: same signature, bad operands

def test_plan_never_skips_a_check():
    x, w = f32(2, 64), f32(64)
    y = np.empty((2, 64), np.float32)
    for _ in range(2):  # the first call makes the plan, the second uses it
        cpufuse.rms_norm(x, w, eps=1e-6, out=y, n_threads=1)
        cpufuse.softmax(x, out=y, n_threads=1)
    with pytest.raises((TypeError, ValueError), match="n_threads"):
        cpufuse.rms_norm(x, w, eps=1e-6, out=y, n_threads=True)  # True == 1 as a dict key
    with pytest.raises((TypeError, ValueError), match="n_threads"):
        cpufuse.softmax(x, out=y, n_threads=True)
    ro = np.empty((2, 64), np.float32)
    ro.flags.writeable = False
    buf = np.zeros(300, np.float32)
    xo, yo = buf[:128].reshape(2, 64), buf[100:228].reshape(2, 64)  # partially overlapping
    xo[:] = x
    for op in (lambda x_, o: cpufuse.rms_norm(x_, w, eps=1e-6, out=o, n_threads=1),
               lambda x_, o: cpufuse.softmax(x_, out=o, n_threads=1)):
        with pytest.raises(ValueError, match="writeable"):
            op(x, ro)
        with pytest.raises(ValueError, match="overlap"):
            op(xo, yo)
        po = np.empty((2, 80), np.float32)[:, :64]  # same shape and dtype, padded rows
        assert_bit_identical(op(x, po), op(x, np.empty((2, 64), np.float32)))
    # the Numba plans bind by the same rules: a misaligned output is refused, as the checks refuse it
    mis = np.zeros(2 * 64 * 4 + 4, np.uint8)[1:1 + 2 * 64 * 4].view(np.float32).reshape(2, 64)
    assert not mis.flags.aligned
    for op in (lambda o: cpufuse.rms_norm(x, w, eps=1e-6, out=o, isa="numba"),
               lambda o: cpufuse.softmax(x, out=o, isa="numba")):
        op(y)
        op(y)
        with pytest.raises(ValueError, match="aligned"):
            op(mis)
    # a plan's rope cache write still checks pos0 against the cache
    xr, pos = f32(2, 1, 64), np.arange(2, dtype=np.int32)
    kc = np.zeros((4, 1, 64), np.float16)
    for p0 in (0, 2):
        cpufuse.rope(xr, pos, n_dims=64, cache=(kc, p0))
    with pytest.raises(ValueError, match="exceeds"):
        cpufuse.rope(xr, pos, n_dims=64, cache=(kc, 3))
    with pytest.raises(ValueError, match="pos0"):
        cpufuse.rope(xr, pos, n_dims=64, cache=(kc, -1))
    # the quantized matmul: a read-only or overlapping out after a plan was made
    wq = make_weight("Q8_0", 64, 64, RNG)
    cpufuse.matmul(x, wq, out=y)
    cpufuse.matmul(x, wq, out=y)
    with pytest.raises(ValueError, match="writeable"):
        cpufuse.matmul(x, wq, out=ro)
    buf = np.zeros(300, np.float32)
    xo, yo = buf[:128].reshape(2, 64), buf[100:228].reshape(2, 64)
    with pytest.raises(ValueError, match="overlap"):
        cpufuse.matmul(xo, wq, out=yo)
    assert_bit_identical(cpufuse.matmul(x, wq, out=np.empty((2, 80), np.float32)[:, :64]), cpufuse.matmul(x, wq))
