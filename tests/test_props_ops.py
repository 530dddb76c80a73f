"""Property tests (hypothesis) for softmax, rms_norm, add_rms_norm and flash_attn on every path.

Each example draws a path (isa from cpufuse.available_isas(), n_threads 1/2/3, fused or not),
shapes from 0 up to a few thousand per row (not multiples of the vector widths), views with
offsets, steps and permuted memory order, masks with -inf patterns and fully masked rows,
NaN/inf/subnormal/huge values, broadcast operands, and out= (new, aliasing, overlapping, read-only,
wrong shape or dtype). The call either matches the float64 reference within the op's bound
(docs/semantics.md §1 accuracy: NMSE 1e-12 for softmax and rms_norm, 1e-10 for flash_attn; NaN exactly where the
reference is NaN) or raises the documented TypeError/ValueError naming the argument. Inputs and
everything outside the output view are never modified. Profiles: tests/conftest.py.
"""
import numpy as np
import pytest

from _props import (F16, F32, SENTINEL, SPECIAL_KINDS, Snapshot, assert_matches, bad_last, cap_leading, dim,
                    guard_ok, layouts, paths, place, refused, row_len, values)
from hypothesis import given, strategies as st

import cpufuse
from cpufuse import reference

SMALL = (0, 1, 2, 3, 4, 5)
# the float64 reference of an empty row (n == 0) takes numpy's mean of nothing
pytestmark = pytest.mark.filterwarnings("ignore:Mean of empty slice:RuntimeWarning")


def _out_mode(d, allow_alias):
    modes = ["none", "none", "new", "new", "overlap", "readonly", "shape", "dtype"]
    if allow_alias:
        modes += ["alias", "alias"]
    return d(st.sampled_from(modes))


def _make_out(d, mode, shape, errs, name="out"):
    """an output array for `mode` (not alias/overlap) -> (out, buf, inside) and the errors it implies"""
    if mode == "shape":
        shape = shape[:-1] + (shape[-1] + 1,)
        errs.append((ValueError, name))
    if mode == "dtype":
        errs.append((TypeError, name))
        o = np.full(shape, SENTINEL, np.float64)
        return o, o, np.ones(shape, bool)
    o, buf, inside = place(np.full(shape, SENTINEL, F32), d(layouts(len(shape))), writeable=mode != "readonly")
    if mode == "readonly":
        errs.append((ValueError, name))
    if bad_last(o):
        errs.append((ValueError, name))
    return o, buf, inside


def _single_out(d, x, xbuf, xin, shape, errs, alias_ok):
    """draw out= for an op with one output of x's shape: none, new, out=x (in place; refused unless
    alias_ok), overlapping x, read-only, wrong shape/dtype -> (x, xbuf, xin, out, obuf, oin, errs)"""
    mode = _out_mode(d, allow_alias=True)
    out = obuf = oin = None
    if mode == "alias":
        out = x
        if not alias_ok and x.size:  # an empty array shares no memory
            errs.append((ValueError, "out"))
    elif mode == "overlap" and x.size > 1:  # one element shifted by one shares no byte
        x, out, xbuf = _overlapping_pair(x)
        xin = np.ones(xbuf.shape, bool)
        errs = [e for e in errs if e[1] != "x"] + [(ValueError, "out")]
    elif mode not in ("none", "overlap"):
        out, obuf, oin = _make_out(d, mode, shape, errs)
    return x, xbuf, xin, out, obuf, oin, errs


def _checked_call(call, errs, snap, x, xc, xbuf, xin, out, obuf, oin, shape):
    """a one-output op: refused as errs says (-> None), or its result, with out, the guards around
    out (and around x when out is x) and the unmodified inputs checked"""
    if errs:
        return refused(call, errs, snap, (x, xc))
    y = call()
    if out is not None:
        assert y is out
        if obuf is not None:
            guard_ok(obuf, oin)
    else:
        assert y.shape == shape and y.dtype == F32 and y.flags.c_contiguous
    snap.check(obuf)
    if out is x:
        guard_ok(xbuf, xin)
    return y


def _overlapping_pair(x):
    """(x2, out): x2 equal to x, out the same shape shifted by one element in the same buffer"""
    n = x.size
    big = np.empty(n + 1, F32)
    x2 = big[:n].reshape(x.shape)
    x2[...] = x
    return x2, big[1:].reshape(x.shape), big


def _tiled(d, xshape, errs, name, allow_bad=True):
    """shape of a weight/bias/residual operand tiling xshape (docs/semantics.md §3); sometimes a bad one"""
    nd = d(st.integers(1, len(xshape)))
    sh = []
    for n in xshape[len(xshape) - nd:]:
        c = [n, n, 1]
        if n and n % 2 == 0:
            c.append(n // 2)
        sh.append(d(st.sampled_from(c)))
    if allow_bad and d(st.integers(0, 11)) == 0:
        k = d(st.integers(0, len(sh) - 1))
        sh[k] = sh[k] + 1
    if allow_bad and d(st.integers(0, 23)) == 0 and len(sh) == len(xshape) and len(sh) < 4:
        sh = [1] + sh
    # the documented rule
    if len(sh) > len(xshape):
        errs.append((ValueError, name))
    else:
        ash = (1,) * (len(xshape) - len(sh)) + tuple(sh)
        if any((m == 0 and n != 0) or (m != 0 and n % m) for n, m in zip(xshape, ash)):
            errs.append((ValueError, name))
    return tuple(sh)


def _fused(d, isa):
    return d(st.booleans()) if isa != "numba" else True


# ------------------------------------------------------------------------------------------------
# softmax

@st.composite
def _mask(draw, S, H, R, C, errs, pad_rows=True):
    mS = draw(st.sampled_from((1, S))) if S else 1
    mH = draw(st.sampled_from((1, H))) if H else 1
    mR = R + (draw(st.integers(0, 2)) if pad_rows else 0)
    mC = C
    if draw(st.integers(0, 15)) == 0:  # a bad mask shape now and then
        which = draw(st.sampled_from(("C", "R", "H", "S")))
        if which == "C":
            mC = C + draw(st.sampled_from((-1, 1))) if C else 1
        elif which == "R" and R:
            mR = R - 1
        elif which == "H":
            mH = H + 1 if H else 0
        elif which == "S":
            mS = S + 1 if S else 0
    shape = (mS, mH, mR, mC)
    lead = 0
    while lead < 3 and shape[lead] == 1:
        lead += 1
    shape = shape[draw(st.integers(0, lead)):]
    dt = draw(st.sampled_from((F32, F16)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from((0.0, 1.0)))
    m = rng.standard_normal(shape) * scale
    p = draw(st.sampled_from((0.0, 0.2, 0.9)))
    m[rng.random(shape) < p] = -np.inf
    if m.size and draw(st.booleans()):  # some fully masked rows
        rows = m.reshape(-1, shape[-1])
        rows[rng.integers(0, rows.shape[0], 2)] = -np.inf
    if m.size and draw(st.integers(0, 9)) == 0:
        m.reshape(-1)[rng.integers(0, m.size)] = np.nan
    m = m.astype(dt)
    view, buf, _ = place(m, draw(layouts(m.ndim)))
    return view, buf


def _mask_errors(mask, S, H, rows, cols, exact, errs):
    m4 = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    mS, mH, mR, mC = m4.shape
    if bad_last(mask) or ((mC != cols) if exact else (mC < cols)) or mR < rows or mH == 0 or H % mH \
            or mS == 0 or S % mS:
        errs.append((ValueError, "mask"))


@given(st.data())
def test_softmax(data):
    d = data.draw
    isa, nth = d(paths)
    fused = _fused(d, isa)
    nd = d(st.integers(1, 4))
    C = d(row_len())
    shape = cap_leading(tuple(d(dim(5, SMALL)) for _ in range(nd - 1)) + (C,))
    S, H, R, _ = (1,) * (4 - nd) + shape
    errs = []
    scale = d(st.sampled_from((1.0, 1.0, 0.125, 0.5, 2.0, -1.0)))
    use_mask = d(st.booleans())
    max_bias = d(st.sampled_from((0.0, 0.0, 8.0))) if use_mask else 0.0
    plain = scale == 1.0 and not use_mask
    xv = d(values(shape, mag=(1.0, 4.0, 30.0) if plain else (1.0, 4.0),
                  specials=SPECIAL_KINDS if plain else SPECIAL_KINDS[:-1]))
    x, xbuf, xin = place(xv, d(layouts(nd)))
    if bad_last(x):
        errs.append((ValueError, "x"))
    mask = mbuf = None
    if use_mask:
        mask, mbuf = d(_mask(S, H, R, C, errs))
        _mask_errors(mask, S, H, R, C, True, errs)
    sinks = None
    if d(st.integers(0, 3)) == 0:
        sv = d(values((H + (1 if d(st.integers(0, 9)) == 0 else 0),), mag=(2.0,), specials=("-inf", "zero")))
        sinks = sv
        if sv.shape != (H,):
            errs.append((ValueError, "sinks"))
    x, xbuf, xin, out, obuf, oin, errs = _single_out(d, x, xbuf, xin, shape, errs, alias_ok=True)
    snap = Snapshot(*(a for a in (xbuf if out is not x else None, mbuf, sinks, obuf) if a is not None))
    xc = x.copy()
    call = lambda: cpufuse.softmax(x, mask, scale=scale, max_bias=max_bias, sinks=sinks, out=out,  # noqa: E731
                                   isa=isa, fused=fused, n_threads=nth)
    y = _checked_call(call, errs, snap, x, xc, xbuf, xin, out, obuf, oin, shape)
    if y is None:
        return
    ref = reference.softmax(xc, mask, scale, max_bias, sinks)
    assert_matches(ref, y, 1e-12, f"softmax {isa} fused={fused} nth={nth} {shape}")


# ------------------------------------------------------------------------------------------------
# rms_norm and add_rms_norm

def _operand(d, shape, errs, name, **kw):
    v = d(values(shape, mag=(1.0, 3.0), **kw))
    a, buf, _ = place(v, d(layouts(len(shape))))
    if bad_last(a):
        errs.append((ValueError, name))
    return a, buf


def _rms_case(d):
    isa, nth = d(paths)
    nd = d(st.integers(1, 4))
    C = d(row_len())
    shape = cap_leading(tuple(d(dim(5, SMALL)) for _ in range(nd - 1)) + (C,))
    eps = d(st.sampled_from((0.0, 1e-6, 1e-5, 1.0, 10.0)))
    specials = SPECIAL_KINDS if eps > 0 else tuple(k for k in SPECIAL_KINDS if k != "sub")
    return isa, nth, _fused(d, isa), shape, eps, specials


@given(st.data())
def test_rms_norm(data):
    d = data.draw
    isa, nth, fused, shape, eps, specials = _rms_case(d)
    errs = []
    xv = d(values(shape, mag=(1.0, 1e-3, 100.0), specials=specials, huge=1e15))
    x, xbuf, xin = place(xv, d(layouts(len(shape))))
    if bad_last(x):
        errs.append((ValueError, "x"))
    w = wbuf = b = bbuf = None
    if d(st.integers(0, 3)):
        w, wbuf = _operand(d, _tiled(d, shape, errs, "weight"), errs, "weight", specials=("zero",))
        if d(st.booleans()):
            b, bbuf = _operand(d, _tiled(d, shape, errs, "bias"), errs, "bias", specials=("zero",))
    elif d(st.integers(0, 15)) == 0:
        b = np.ones(shape[-1:], F32)
        errs.append((ValueError, "bias"))
    x, xbuf, xin, out, obuf, oin, errs = _single_out(d, x, xbuf, xin, shape, errs,
                                                     alias_ok=w is None and b is None)
    snap = Snapshot(*(a for a in (xbuf if out is not x else None, wbuf, bbuf, obuf) if a is not None))
    xc = x.copy()
    call = lambda: cpufuse.rms_norm(x, w, eps=eps, bias=b, out=out, isa=isa, fused=fused,  # noqa: E731
                                    n_threads=nth)
    y = _checked_call(call, errs, snap, x, xc, xbuf, xin, out, obuf, oin, shape)
    if y is None:
        return
    ref = reference.rms_norm(xc, eps, w, b)
    assert_matches(ref, y, 1e-12, f"rms_norm {isa} fused={fused} nth={nth} {shape}")


@given(st.data())
def test_add_rms_norm(data):
    d = data.draw
    isa, nth, fused, shape, eps, specials = _rms_case(d)
    errs = []
    xv = d(values(shape, mag=(1.0, 100.0), specials=specials, huge=1e15))
    x, xbuf, _ = place(xv, d(layouts(len(shape))))
    if bad_last(x):
        errs.append((ValueError, "x"))
    rshape = _tiled(d, shape, errs, "residual")
    r, rbuf = _operand(d, rshape, errs, "residual", specials=specials, huge=1e15)
    w = wbuf = b = bbuf = None
    if d(st.booleans()):
        w, wbuf = _operand(d, _tiled(d, shape, errs, "weight"), errs, "weight", specials=("zero",))
        if d(st.booleans()):
            b, bbuf = _operand(d, _tiled(d, shape, errs, "bias"), errs, "bias", specials=("zero",))
    mode = d(st.sampled_from(("none", "none", "new", "h_is_x", "h_is_r", "y_is_x", "h_is_y", "notuple")))
    out = None
    h_out = y_out = None
    bufs = []
    inplace = None
    if mode == "notuple":
        out = np.empty(shape, F32)
        errs.append((TypeError, "out"))
    elif mode != "none":
        m_h = m_y = "new"
        if mode == "new":
            m_h = d(st.sampled_from(("new", "new", "readonly", "shape", "dtype")))
            m_y = d(st.sampled_from(("new", "new", "readonly", "shape", "dtype")))
        if mode == "h_is_x":
            h_out, inplace = x, "x"
        elif mode == "h_is_r":
            h_out, inplace = r, "residual"
            if r.shape != shape:
                errs.append((ValueError, "out"))
        elif mode == "h_is_y":
            h_out, hb, hin = _make_out(d, "new", shape, errs, "out")
            bufs.append((hb, hin))
            y_out = h_out
            if x.size:
                errs.append((ValueError, "out"))
        else:
            h_out, hb, hin = _make_out(d, m_h, shape, errs, "out")
            bufs.append((hb, hin))
        if mode == "y_is_x":
            y_out = x
            if x.size:
                errs.append((ValueError, "out"))
        elif y_out is None:
            y_out, yb, yin = _make_out(d, m_y, shape, errs, "out")
            bufs.append((yb, yin))
        out = (h_out, y_out)
    keep = [a for a in (xbuf, rbuf, wbuf, bbuf) if a is not None]
    drop = ([xbuf] if inplace == "x" or mode == "y_is_x" else []) + ([rbuf] if inplace == "residual" else [])
    keep = [a for a in keep if not any(a is b for b in drop)]
    snap = Snapshot(*keep, *(bb for bb, _ in bufs))
    xc, rc = x.copy(), r.copy()
    call = lambda: cpufuse.add_rms_norm(x, r, w, eps=eps, bias=b, out=out, isa=isa, fused=fused,  # noqa: E731
                                        n_threads=nth)
    if errs:
        return refused(call, errs, snap, (x, xc), (r, rc))
    h, y = call()
    if out is not None:
        assert h is out[0] and y is out[1]
        for bb, inside in bufs:
            guard_ok(bb, inside)
    snap.check(*(bb for bb, _ in bufs))
    href, yref = reference.rms_norm(xc, eps, w, b, residual=rc)
    assert np.array_equal(h, href, equal_nan=True), f"add_rms_norm h {isa} {shape}: x + residual differs"
    assert_matches(yref, y, 1e-12, f"add_rms_norm {isa} fused={fused} nth={nth} {shape}")


# ------------------------------------------------------------------------------------------------
# flash_attn

@given(st.data())
def test_flash_attn(data):
    d = data.draw
    isa, nth = d(paths)
    fused = _fused(d, isa)
    S = d(st.sampled_from((1, 1, 2, 0)))
    Hk = d(st.sampled_from((1, 1, 2)))
    Hv = d(st.sampled_from((Hk, 1)))
    g = d(st.sampled_from((1, 2, 3)))
    Hq = int(np.lcm(Hk, Hv)) * g
    N = d(st.one_of(st.sampled_from((0, 1, 1, 7, 8, 9)), st.integers(0, 20)))
    T = d(st.one_of(st.sampled_from((0, 1, 63, 64, 65, 129)), st.integers(0, 80),
                    st.sampled_from((511, 512, 513, 700)) if N <= 1 else st.integers(0, 80)))
    DK = d(st.sampled_from((1, 4, 7, 8, 16, 17, 40, 64, 65)))
    DV = d(st.sampled_from((DK, DK, 1, 5, 16, 33)))
    if S * Hq * max(N, 1) > 48:
        N = max(1, 48 // max(S * Hq, 1))
    errs = []
    kdt, vdt = d(st.sampled_from((F16, F32))), d(st.sampled_from((F16, F32)))
    mag = (0.5, 1.0, 2.0)
    # No inf in q or k (found by `make fuzz`, README limits): a score of -inf from q*k (not from the
    # mask) gets select semantics in the reference (a NaN in V at that position stays out), while
    # the native kernels multiply the 0 weight into V (NaN); and Numba's online softmax weights a
    # +inf score 1 where the reference's e^(inf - inf) is NaN.
    sp = ("nan", "sub", "zero")
    q, qbuf, _ = place(d(values((S, Hq, N, DK), mag=mag, specials=sp, p_special=0.1)), d(layouts(4)))
    k, kbuf, _ = place(d(values((S, Hk, T, DK), kdt, mag=mag, specials=sp, p_special=0.1)), d(layouts(4)))
    # no inf in V: a weight below float32's range is 0 there (0*inf = NaN) where float64 keeps it
    # (e^-121 * inf = inf); the f32 edge, not a kernel property
    v, vbuf, _ = place(d(values((S, Hv, T, DV), vdt, mag=mag, specials=("nan", "sub", "zero"), p_special=0.1)), d(layouts(4)))
    for nm, a in (("q", q), ("k", k), ("v", v)):
        if bad_last(a):
            errs.append((ValueError, nm))
    scale = d(st.sampled_from((1.0, 0.125, 0.3, 1.0 / np.sqrt(max(DK, 1)))))
    softcap = d(st.sampled_from((0.0, 0.0, 20.0)))
    mask = mbuf = None
    max_bias = 0.0
    if d(st.booleans()):
        mask, mbuf = d(_mask(S, Hq, N, T + d(st.sampled_from((0, 0, 3))), errs))
        _mask_errors(mask, S, Hq, N, T, False, errs)
        max_bias = d(st.sampled_from((0.0, 0.0, 8.0)))
    sinks = None
    if d(st.integers(0, 3)) == 0:
        sinks = d(values((Hq + (1 if d(st.integers(0, 9)) == 0 else 0),), mag=(2.0,), specials=("-inf",)))
        if sinks.shape != (Hq,):
            errs.append((ValueError, "sinks"))
    strategy = d(st.sampled_from((None, None, "rows", "tiled", "split")))
    chunk = d(st.sampled_from((256, 1, 7, 64)))
    q_tile = d(st.sampled_from((64, 1, 3)))
    oshape = (S, N, Hq, DV)
    mode = d(st.sampled_from(("none", "none", "new", "new", "overlap", "readonly", "shape", "dtype")))
    out = obuf = oin = None
    n_out = int(np.prod(oshape))
    if mode == "overlap" and kdt == F32 and k.flags.c_contiguous and k.size >= n_out > 0:
        out = k.reshape(-1)[:n_out].reshape(oshape)
        errs.append((ValueError, "out"))
    elif mode not in ("none", "overlap"):
        out, obuf, oin = _make_out(d, mode, oshape, errs)
    snap = Snapshot(*(a for a in (qbuf, kbuf, vbuf, mbuf, sinks, obuf) if a is not None))
    call = lambda: cpufuse.flash_attn(q, k, v, mask, scale=scale, max_bias=max_bias, softcap=softcap,  # noqa: E731
                                      sinks=sinks, out=out, isa=isa, strategy=strategy, chunk=chunk,
                                      q_tile=q_tile, fused=fused, n_threads=nth)
    if errs:
        return refused(call, errs, snap)
    y = call()
    if out is not None:
        assert y is out
        guard_ok(obuf, oin)
    assert y.shape == oshape and y.dtype == F32
    snap.check(obuf)
    ref = reference.flash_attn(q, k, v, mask, scale, max_bias, softcap, sinks)
    assert_matches(ref, y, 1e-10, f"flash_attn {isa} fused={fused} nth={nth} strategy={strategy} "
                                  f"q{q.shape} k{k.shape} {kdt} v{v.shape} {vdt}")
