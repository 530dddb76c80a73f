"""Property tests (hypothesis) for rope (out=, in place, the KV-cache write) and for graph plans.

rope: every path, n_tokens/heads from 0, head_dim not a multiple of the vector width, partial
rotary, both modes, YaRN, freq_factors, positions up to 131072, NaN/inf/subnormal/huge values, x as
any view; the result matches the float64 reference (tests/test_rope.py ref64, NMSE <= 1e-12, NaN
where it is NaN), the cache rows are the same call's float32 result rounded to the cache dtype and
nothing else in the cache changes, or the documented error is raised.

graph: x + residual -> rms_norm -> * weight -> softmax (with a mask) [-> qmatmul], compiled with
fusion on or off for a drawn isa, bound once and run twice with new input values and drawn
n_threads; each stage matches the float64 reference computed from the previous stage's output.
"""
import numpy as np

from _props import (F16, F32, SENTINEL, Snapshot, assert_matches, bad_last, expect_error, guard_ok, layouts, paths,
                    place, refused, values)
from hypothesis import given, strategies as st
from test_rope import ref64

import cpufuse
from cpufuse import Graph, GraphError, reference
from cpufuse.reference import quant as qref
from cpufuse.quant.types import QTYPES, SUPPORTED


# ------------------------------------------------------------------------------------------------
# rope

@given(st.data())
def test_rope(data):
    d = data.draw
    isa, nth = d(paths)
    T = d(st.one_of(st.sampled_from((0, 1, 2, 7, 9)), st.integers(0, 12)))
    H = d(st.sampled_from((0, 1, 1, 2, 3, 5)))
    D = d(st.sampled_from((1, 2, 3, 6, 8, 9, 16, 17, 33, 64, 65, 128)))
    errs = []
    nd = d(st.sampled_from(tuple(range(2, D + 1, 2)) or (2,)))
    if d(st.integers(0, 19)) == 0:
        nd = d(st.sampled_from((nd + 1, D + 2, 0)))
    if nd <= 0 or nd % 2 or nd > D:
        errs.append((ValueError, "n_dims"))
    mode = d(st.sampled_from(("norm", "neox", 0, 2, "norm", "neox")))
    if d(st.integers(0, 29)) == 0:
        mode = d(st.sampled_from(("glm", 1, 8)))
        errs.append((ValueError, "mode"))
    base = d(st.sampled_from((10000.0, 500000.0, 1e6)))
    fs = d(st.sampled_from((1.0, 1.0, 0.25)))
    ext = d(st.sampled_from((0.0, 0.0, 1.0)))
    nco = 4096 if ext else d(st.sampled_from((0, 4096)))
    attn = d(st.sampled_from((1.0, 0.5)))
    ff = None
    if d(st.integers(0, 3)) == 0 and nd > 0 and nd % 2 == 0:
        rng = np.random.default_rng(d(st.integers(0, 2**32 - 1)))
        ff = rng.uniform(1.0, 8.0, nd // 2 + (1 if d(st.integers(0, 9)) == 0 else 0)).astype(F32)
        if ff.shape != (nd // 2,) and not any(n == "n_dims" for _, n in errs):
            errs.append((ValueError, "freq_factors"))
    xv = d(values((T, H, D), mag=(1.0, 4.0), huge=1e30))
    x, xbuf, xin = place(xv, d(layouts(3)))
    if bad_last(x):
        errs.append((ValueError, "x"))
    rng = np.random.default_rng(d(st.integers(0, 2**32 - 1)))
    pos = rng.integers(0, 131073, T).astype(np.int32)
    if T:
        pos[0] = d(st.sampled_from((0, 1, 131072, int(pos[0]))))
    target = d(st.sampled_from(("new", "new", "out", "alias", "cache", "cache", "overlap", "readonly", "both")))
    out = obuf = oin = cache = None
    kc = kc0 = None
    p0 = 0
    if target in ("out", "readonly"):
        out, obuf, oin = place(np.full((T, H, D), SENTINEL, F32), d(layouts(3)), writeable=target == "out")
        if target == "readonly" or bad_last(out):
            errs.append((ValueError, "out"))
    elif target == "alias":
        out = x
    elif target == "overlap" and x.size and x.flags.c_contiguous:
        big = np.empty(x.size + 1, F32)
        x = big[:-1].reshape(x.shape)
        x[...] = xv
        xbuf, xin = big, np.ones(big.shape, bool)
        out = big[1:].reshape(x.shape)
        errs = [e for e in errs if e[1] != "x"] + [(ValueError, "out")]
    elif target in ("cache", "both"):
        n_ctx = T + d(st.integers(0, 5))
        p0 = d(st.integers(0, n_ctx - T))
        kdt = d(st.sampled_from((F16, F16, F32)))
        kc = np.full((n_ctx, H, D), -1234.5, kdt)
        kc0 = kc.copy()
        cache = (kc, p0)
        if target == "both":
            out = np.empty((T, H, D), F32)
            errs.append((ValueError, "cache"))
    snap = Snapshot(*(a for a in (xbuf if out is not x else None, pos, ff, obuf, kc) if a is not None))
    xc = x.copy()
    call = lambda: cpufuse.rope(x, pos, n_dims=nd, mode=mode, freq_base=base, freq_scale=fs,  # noqa: E731
                                ext_factor=ext, attn_factor=attn, n_ctx_orig=nco, freq_factors=ff, out=out,
                                cache=cache, isa=isa, n_threads=nth)
    if errs:
        return refused(call, errs, snap, (x, xc))
    y = call()
    snap.check(obuf, kc)
    m = "norm" if mode in ("norm", 0) else "neox"
    with np.errstate(all="ignore"):
        ref = ref64(xc, pos, nd, m, base, fs, ext, attn, 32.0, 1.0, nco, ff)
    what = f"rope {isa} nth={nth} x{x.shape} n_dims={nd} {m} ext={ext} ff={ff is not None} {target}"
    if cache is not None:
        # the cache rows are the f32 result of the same call with out=, rounded to the cache dtype
        assert y is None
        y32 = cpufuse.rope(xc, pos, n_dims=nd, mode=mode, freq_base=base, freq_scale=fs, ext_factor=ext,
                           attn_factor=attn, n_ctx_orig=nco, freq_factors=ff, isa=isa, n_threads=nth)
        assert_matches(ref, y32, 1e-12, what)
        assert np.array_equal(kc[p0:p0 + T], y32.astype(kc.dtype), equal_nan=True), what + ": cache rows"
        rest = np.ones(kc.shape[0], bool)
        rest[p0:p0 + T] = False
        assert np.array_equal(kc[rest].view(np.uint8), kc0[rest].view(np.uint8)), what + ": other cache rows changed"
        return
    if out is not None:
        assert y is out
        if obuf is not None:
            guard_ok(obuf, oin)
        if out is x:
            guard_ok(xbuf, xin)
    assert y.shape == (T, H, D) and y.dtype == F32
    assert_matches(ref, y, 1e-12, what)


# ------------------------------------------------------------------------------------------------
# graph plans

@given(st.data())
def test_graph_plan(data):
    d = data.draw
    isa, nth = d(paths)
    fusion = d(st.booleans())
    R = d(st.sampled_from((1, 2, 3, 7, 9)))
    qt = d(st.sampled_from(SUPPORTED)) if d(st.integers(0, 2)) == 0 else None
    use_q = qt is not None
    if use_q:
        C = 256 if QTYPES[qt].block_size == 256 else 32 * d(st.integers(1, 3))
    else:
        C = d(st.one_of(st.sampled_from((1, 7, 8, 9, 16, 17, 33, 65)), st.integers(1, 300)))
    eps = d(st.sampled_from((1e-6, 1e-5, 1.0)))
    scale = d(st.sampled_from((1.0, 0.125, 2.0)))
    use_mask = d(st.booleans())
    show_y = d(st.booleans())
    rng = np.random.default_rng(d(st.integers(0, 2**32 - 1)))
    wv = rng.uniform(-2, 2, C).astype(F32)
    g = Graph()
    x = g.input("x", (R, C))
    r = g.input("res", (R, C))
    m = g.input("mask", (R, C)) if use_mask else None
    h = g.add(x, r)
    y = g.mul(g.rms_norm(h, eps), g.constant(wv, "w"))
    s = g.softmax(y, m, scale=scale)
    outs = [h, s] + ([y] if show_y else [])
    W = act = None
    if use_q:
        W = qref.random_blocks(qt, d(st.sampled_from((1, 5, 16, 33))), C, rng)
        act = d(st.sampled_from(("q8", "f32")))
        outs.append(g.qmatmul(y, W, act=act))
    g.output(*outs)
    plan = g.compile(fusion=fusion, isa=isa)
    arrays = {"x": np.empty((R, C), F32), "res": np.empty((R, C), F32)}
    if use_mask:
        arrays["mask"] = np.empty((R, C), F32)
    if d(st.integers(0, 9)) == 0:  # a wrong input at bind: GraphError (a ValueError) naming it
        bad = dict(arrays)
        name = d(st.sampled_from(sorted(bad)))
        bad[name] = d(st.sampled_from((np.empty((R, C + 1), F32), np.empty((R, C), np.float64), [0.0])))
        expect_error(lambda: plan.bind(**bad), [(GraphError, name)])
        return
    run = plan.bind(**arrays)
    for _ in range(2):
        sp = ("zero", "sub") if act == "q8" else ("nan", "zero", "sub")  # q8 quantizes finite rows only
        arrays["x"][...] = d(values((R, C), mag=(1.0, 3.0), specials=sp))
        arrays["res"][...] = rng.standard_normal((R, C)).astype(F32)
        if use_mask:
            mk = np.where(rng.random((R, C)) < 0.3, -np.inf, rng.standard_normal((R, C))).astype(F32)
            if d(st.booleans()):
                mk[rng.integers(0, R)] = -np.inf
            arrays["mask"][...] = mk
        snap = Snapshot(*arrays.values())
        res = run(copy=True, n_threads=nth)
        snap.check()
        what = f"graph {isa} fusion={fusion} nth={nth} R={R} C={C} q={W is not None and W.qtype} act={act}"
        hx = arrays["x"] + arrays["res"]
        assert np.array_equal(res[0], hx, equal_nan=True), what + ": h"
        y64 = reference.rms_norm(hx, eps, wv)
        tol_s = 1e-10
        if show_y:
            assert_matches(y64, res[2], 1e-12, what + ": y")
            yk, tol_s = res[2], 1e-12
        else:
            yk = y64.astype(F32)
        with np.errstate(all="ignore"):
            assert_matches(reference.softmax(yk, arrays.get("mask"), scale), res[1], tol_s, what + ": softmax")
        if use_q:
            yq = res[2] if show_y else yk
            with np.errstate(all="ignore"):
                qr = qref.ref_matmul_q8(yq, W) if act == "q8" else qref.ref_matmul_f32(yq, W)
            if act == "q8" and not show_y:
                # the q8 codes depend on y's exact f32 rounding: check against the output y only
                continue
            assert_matches(qr, res[-1], 1e-10, what + ": qmatmul")
