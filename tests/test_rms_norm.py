"""cpufuse.rms_norm / add_rms_norm vs the float64 oracle (docs/semantics.md §3, §1): accuracy on every ISA,
fused vs unfused bit-identity (§5), planned vs checked calls, ggml tiling, ggml's test-backend-ops
grids, edge cases, aliasing, guards, inputs untouched, empty tensors."""
import functools

import numpy as np
import pytest

import cpufuse
from cpufuse import _registry, reference
from cpufuse.ops.checks import clear_plans
from _util import (AVAILABLE, assert_bit_identical, assert_guard_intact, assert_nmse, fused_modes, guarded,
                   max_rel_err)

NMSE_TOL = 1e-12
REL_TOL = 2e-6
SIZES = (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 1025, 4097, 16896)


def U(rng, shape, lo=-10.0, hi=10.0):
    return rng.uniform(lo, hi, shape).astype(np.float32)


def check_plain(y, ref, what=""):
    assert y.dtype == np.float32
    assert_nmse(ref, y, NMSE_TOL, what)
    rel = max_rel_err(ref, y, 1e-30)
    assert rel <= REL_TOL, f"{what}: max relative error {rel:.3e} > {REL_TOL:.0e}"


def check(y, ref, what="", terms=None):
    """NMSE against the float64 reference; with `terms` (the magnitude of the summed terms, e.g.
    |rms_norm(x)*w| + |b|), outputs that cancel to far below their terms are held to float32
    rounding of the terms instead (NMSE of a near-zero output measures the cancellation)"""
    assert y.dtype == np.float32
    if terms is not None:
        err = np.abs(y.astype(np.float64) - ref)
        assert np.all(err <= 8 * 2.0 ** -24 * terms + 1e-30), f"{what}: max error {err.max():.3e}"
        return
    assert_nmse(ref, y, NMSE_TOL, what)


@pytest.fixture(params=[True, False], ids=["fused", "unfused"])
def fused(request, isa):
    if not request.param and isa == "numba":
        pytest.skip("numba: fused=False is ignored (there is no separate-pass chain)")
    return request.param


def f32_rms_norm(x, eps, w=None, b=None):
    """docs/semantics.md §3 evaluated in float32 (squares rounded to f32, summed in f64), for rows whose
    sum of squares the kernels form exactly (n == 1)"""
    f = np.float32
    sq = (x * x).astype(np.float64)
    mean = (sq.sum(-1, keepdims=True) / x.shape[-1]).astype(f)
    s = f(1) / np.sqrt(mean + f(eps)).astype(f)
    y = (x * s).astype(f)
    if w is not None:
        y = (y * reference.tile_to(w, x.shape)).astype(f)
    if b is not None:
        y = (y + reference.tile_to(b, x.shape)).astype(f)
    return y


# ------------------------------------------------------------------------------------------------
# accuracy over row lengths

@pytest.mark.parametrize("variant", ["plain", "weight", "weight_bias", "add", "add_weight_bias"])
@pytest.mark.parametrize("n", SIZES)
def test_sizes(isa, fused, n, variant, rng):
    rows = 3 if n > 4000 else 5
    x = U(rng, (rows, n))
    w = U(rng, (n,)) if "weight" in variant else None
    b = U(rng, (n,)) if "bias" in variant else None
    eps = 1e-6
    if variant.startswith("add"):
        r = U(rng, (rows, n))
        h, y = cpufuse.add_rms_norm(x, r, w, eps=eps, bias=b, isa=isa, fused=fused)
        assert np.array_equal(h, x + r)
        href, ref = reference.rms_norm(x, eps, w, b, residual=r)
        (check_plain if w is None else check)(y, ref, f"{isa} n={n} {variant}")
    else:
        y = cpufuse.rms_norm(x, w, eps=eps, bias=b, isa=isa, fused=fused)
        ref = reference.rms_norm(x, eps, w, b)
        (check_plain if w is None else check)(y, ref, f"{isa} n={n} {variant}")
        if w is None:  # mean square of the output is ms / (ms + eps)
            ms = (x.astype(np.float64) ** 2).mean(-1)
            np.testing.assert_allclose((y.astype(np.float64) ** 2).mean(-1), ms / (ms + eps), rtol=1e-5)


@pytest.mark.parametrize("n", SIZES)
def test_fused_unfused_bit_identical(native_isa, n, rng):
    """docs/semantics.md §3, §5: RMS_NORM+MUL(+ADD) fused is bit-identical to the unfused chain, NaN
    positions included (rows with 0, inf and NaN are mixed in)."""
    x = U(rng, (2, 3, 5, n))
    x[0, 0, 1] = 0.0          # eps = 0: NaN row
    x[0, 1, 2, n // 2] = np.inf
    x[1, 2, 3, n - 1] = np.nan
    x[1, 0, 0, 0] = -np.inf
    w = U(rng, (n,))
    b = U(rng, (n,))
    r = U(rng, (3, 1, n))
    w3 = U(rng, (3, 5, n))
    for eps in (0.0, 1e-5):
        cases = [dict(weight=None), dict(weight=w), dict(weight=w, bias=b), dict(weight=w3, bias=b)]
        for kw in cases:
            a = cpufuse.rms_norm(x, eps=eps, isa=native_isa, fused=True, **kw)
            u = cpufuse.rms_norm(x, eps=eps, isa=native_isa, fused=False, **kw)
            assert_bit_identical(a, u, f"rms_norm {sorted(kw)} eps={eps}")
        for kw in [dict(weight=None), dict(weight=w), dict(weight=w, bias=b)]:
            ha, ya = cpufuse.add_rms_norm(x, r, eps=eps, isa=native_isa, fused=True, **kw)
            hu, yu = cpufuse.add_rms_norm(x, r, eps=eps, isa=native_isa, fused=False, **kw)
            assert_bit_identical(ha, hu, "add_rms_norm h")
            assert_bit_identical(ya, yu, f"add_rms_norm y {sorted(kw)} eps={eps}")
        # the 2-D planned call against the unfused chain
        x2 = x.reshape(-1, n)
        assert_bit_identical(cpufuse.rms_norm(x2, w, eps=eps, isa=native_isa),
                             cpufuse.rms_norm(x2, w, eps=eps, isa=native_isa, fused=False), "planned vs unfused")


def test_isas_agree(rng):
    x = U(rng, (4, 7, 300))
    w, b = U(rng, (300,)), U(rng, (7, 300))
    ref = reference.rms_norm(x, 1e-5, w, b)
    for isa in AVAILABLE:
        check(cpufuse.rms_norm(x, w, eps=1e-5, bias=b, isa=isa), ref, isa)


# ------------------------------------------------------------------------------------------------
# a planned call (2-D contiguous x + 1-D weight) vs the same values through the checks (strided, 2-D weight...)

@pytest.mark.parametrize("n", [1, 5, 8, 16, 33, 100, 1025])
def test_planned_equals_general(isa, n, rng):
    rows = 6
    x = U(rng, (rows, n))
    w = U(rng, (n,))
    planned = cpufuse.rms_norm(x, w, eps=1e-6, isa=isa)
    # the same data, non-contiguous
    xs = np.empty((rows, n + 7), np.float32)[:, 3:3 + n]
    xs[...] = x
    assert_bit_identical(planned, cpufuse.rms_norm(xs, w, eps=1e-6, isa=isa), "non-contiguous x")
    assert_bit_identical(planned, cpufuse.rms_norm(x, w.reshape(1, n), eps=1e-6, isa=isa), "2-D weight")
    assert_bit_identical(planned, cpufuse.rms_norm(x, w, eps=np.float32(1e-6), isa=isa), "np.float32 eps")
    assert_bit_identical(planned, cpufuse.rms_norm(x[None], w, eps=1e-6, isa=isa)[0], "3-D x")
    out = np.empty((rows, n + 3), np.float32)[:, :n]
    assert_bit_identical(planned, cpufuse.rms_norm(x, w, eps=1e-6, out=out, isa=isa), "strided out")
    assert_bit_identical(planned[0], cpufuse.rms_norm(x[0], w, eps=1e-6, isa=isa), "1-D x")
    check(planned, reference.rms_norm(x, 1e-6, w))


def test_row_kernel_is_taken(native_isa, rng, monkeypatch):
    """the calls compared above really reach different kernels (the plans, made after the entries are
    wrapped, hold the wrapped ones; forgotten again at the end)"""
    clear_plans()
    calls = []
    for op in ("rms_norm_rows", "rms_norm", "rms_norm_unfused"):  # the registry's entries, wrapped
        fn = _registry.kernel(op, native_isa)
        monkeypatch.setitem(_registry.table(op), native_isa, lambda *a, _fn=fn, _op=op: calls.append(_op) or _fn(*a))
    x, w = U(rng, (4, 40)), U(rng, (40,))
    cpufuse.rms_norm(x, w, eps=1e-6, isa=native_isa)
    assert calls == ["rms_norm_rows"]
    calls.clear()
    cpufuse.rms_norm(x[:, :20], w[:20], eps=1e-6, isa=native_isa)
    assert calls == ["rms_norm"]
    calls.clear()
    cpufuse.rms_norm(x, w, eps=1e-6, isa=native_isa, fused=False)
    assert calls == ["rms_norm_unfused"]
    clear_plans()


# ------------------------------------------------------------------------------------------------
# ggml tiling of weight / bias / residual (docs/semantics.md §3)

@pytest.mark.parametrize("xshape,wshape", [
    ((4, 6, 3, 64), (2, 3, 1, 32)),     # every dim tiles, the last one too
    ((4, 6, 3, 64), (1, 1, 1, 16)),
    ((4, 6, 3, 50), (4, 1, 3, 25)),
    ((12, 12, 15, 66), (3, 4, 5, 33)),  # test-backend-ops' broadcast layout
    ((5, 40), (5, 40)),
    ((5, 40), (1, 8)),
    ((5, 40), (40,)),
    ((3, 7), (1,)),
])
def test_weight_bias_tiling(isa, fused, xshape, wshape, rng):
    x = U(rng, xshape)
    w, b = U(rng, wshape), U(rng, wshape)
    y = cpufuse.rms_norm(x, w, eps=1e-6, bias=b, isa=isa, fused=fused)
    check(y, reference.rms_norm(x, 1e-6, w, b))
    # independent of reference.tile_to: an explicitly repeated weight/bias gives the same bits
    w4 = (1,) * (len(xshape) - len(wshape)) + wshape
    reps = tuple(n // m for n, m in zip(xshape, w4))
    wf, bf = np.tile(w.reshape(w4), reps), np.tile(b.reshape(w4), reps)
    assert wf.shape == xshape
    assert_bit_identical(y, cpufuse.rms_norm(x, wf, eps=1e-6, bias=bf, isa=isa, fused=fused), "explicit tile")
    # residual tiles the same way
    h, y2 = cpufuse.add_rms_norm(x, w, b, eps=1e-6, isa=isa, fused=fused)
    assert np.array_equal(h, x + wf)
    check(y2, reference.rms_norm(x, 1e-6, b, None, residual=w)[1])


# ------------------------------------------------------------------------------------------------
# docs/semantics.md §3 conformance grids

EPS_NORM = (0.0, 1e-6, 1e-4, 1e-1, 10.0)
EPS_FUSED = (0.0, 1e-6, 1e-4, 1e-1, 1.0)


def _isa_modes():
    return [(isa, f) for isa in AVAILABLE for f in fused_modes(isa)]


def _ids(kind, c, isa, f):
    return f"{kind}-{'-'.join(str(v) for v in c)}-{isa}-{'fused' if f else 'unfused'}"


RMS_CASES = [(eps, n, view) for eps in EPS_NORM for n in (64, 1025, 33, 132, 260) for view in (False, True)]


@functools.lru_cache(maxsize=1)
def _rms_data(n, view):
    rng = np.random.default_rng(7000 + n)
    x = U(rng, (3, 4, 5, n))
    return x[0:1, 0:2, 0:2, 0:n // 2] if view else x


@pytest.mark.parametrize("eps,n,view,isa_,f", [
    pytest.param(*c, isa, f, id=_ids("rms", c, isa, f)) for c in sorted(RMS_CASES, key=lambda c: (c[1], c[2]))
    for isa, f in _isa_modes()])
def test_grid_rms_norm(eps, n, view, isa_, f):
    x = _rms_data(n, view)
    assert (not x.flags.c_contiguous) == view
    y = cpufuse.rms_norm(x, eps=eps, isa=isa_, fused=f)
    check_plain(y, reference.rms_norm(x, eps), f"eps={eps} n={n} view={view}")


@pytest.mark.parametrize("isa_,f", [pytest.param(i, f, id=f"{i}-{'fused' if f else 'unfused'}") for i, f in _isa_modes()])
def test_grid_rms_norm_in_place(isa_, f):
    x = U(np.random.default_rng(5), (3, 4, 5, 64))
    ref = reference.rms_norm(x, 1e-6)
    y = cpufuse.rms_norm(x, eps=1e-6, out=x, isa=isa_, fused=f)
    assert y is x
    check_plain(x, ref)


MUL_ADD_CASES = ([(eps, n, bc, False) for eps in EPS_FUSED for n in (64, 1025) for bc in (False, True)]
                 + [(1e-6, n, "row", ma) for n in (1, 511, 1025, 8192, 16896) for ma in (False, True)])
assert len(MUL_ADD_CASES) == 30


@functools.lru_cache(maxsize=1)
def _bcast_data(n, bc, multi_add):
    rng = np.random.default_rng(9000 + n + (1 if bc is True else 0) + (2 if multi_add else 0))
    shape = (1, 1, 1, n) if bc == "row" else (3, 4, 5, n)
    ashape = (12, 12, 15, 2 * n) if bc is True else shape
    a, b, c = U(rng, ashape), U(rng, shape), U(rng, shape)
    return a, b, c


@functools.lru_cache(maxsize=1)
def _mul_add_ref(eps, n, bc, multi_add):
    a, b, c = _bcast_data(n, bc, multi_add)
    bt, ct = reference.tile_to(b, a.shape), reference.tile_to(c, a.shape)
    a2 = (a + bt) + ct
    if multi_add:
        a2 = (a2 + bt) + ct
    ref = reference.rms_norm(a2, eps, b, c)
    # forward error bound of an f32 evaluation: u = x*s*w carries a few roundings (s itself, the
    # two products), the final + c one more; 8 ulp of |u| plus 1 ulp of |c| is generous
    bound = 2.0 ** -24 * (8 * np.abs(ref - ct) + np.abs(ct))
    return a2, ref, bound


@pytest.mark.parametrize("eps,n,bc,multi_add,isa_,f", [
    pytest.param(*c, isa, f, id=_ids("mul_add", c, isa, f)) for c in MUL_ADD_CASES for isa, f in _isa_modes()])
def test_grid_rms_norm_mul_add(eps, n, bc, multi_add, isa_, f):
    """graph a' = (a + b) + c [+ b + c], out = rms_norm(a') * b + c, with b, c tiling a' (the
    broadcast cases tile every dim, including the last)"""
    a2, ref, bound = _mul_add_ref(eps, n, bc, multi_add)
    _, b, c = _bcast_data(n, bc, multi_add)
    y = cpufuse.rms_norm(a2, b, eps=eps, bias=c, isa=isa_, fused=f)
    what = f"eps={eps} n={n} broadcast={bc} multi_add={multi_add}"
    ratio = np.max(np.abs(y - ref) / bound)
    assert ratio <= 1.0, f"{what}: elementwise error {ratio:.2f}x the f32 rounding bound"
    if n == 1:
        # one element per tensor: b + c can cancel, and no f32 kernel reaches NMSE 1e-12 against
        # f64 then; check instead that the result is the f32 evaluation of docs/semantics.md §3 exactly
        assert_bit_identical(y, f32_rms_norm(a2, eps, b, c), "docs/semantics.md §3 in f32")
    else:
        check(y, ref, what)


ADD_CASES = ([(eps, n, bc) for eps in EPS_FUSED for n in (64, 1025) for bc in (False, True)]
             + [(1e-6, n, "row") for n in (1, 511, 1025, 8192, 16896)])
assert len(ADD_CASES) == 25


@functools.lru_cache(maxsize=1)
def _add_ref(eps, n, bc):
    a, b, _ = _bcast_data(n, bc, False)
    return reference.rms_norm(a, eps, residual=b)


@pytest.mark.parametrize("eps,n,bc,isa_,f", [
    pytest.param(*c, isa, f, id=_ids("add", c, isa, f)) for c in ADD_CASES for isa, f in _isa_modes()])
def test_grid_add_rms_norm(eps, n, bc, isa_, f):
    """graph out = rms_norm(a + b), b tiling a; cpufuse returns (h, y) with h = a + b"""
    a, b, _ = _bcast_data(n, bc, False)
    href, ref = _add_ref(eps, n, bc)
    h, y = cpufuse.add_rms_norm(a, b, eps=eps, isa=isa_, fused=f)
    assert_bit_identical(h, href, "h = a + b")
    check_plain(y, ref, f"eps={eps} n={n} broadcast={bc}")


# ------------------------------------------------------------------------------------------------
# edge cases (docs/semantics.md §3)

@pytest.mark.parametrize("n", [1, 8, 13, 64, 100])
def test_zero_row(isa, fused, n, rng):
    x = U(rng, (3, n))
    x[1] = 0.0
    w, b = U(rng, (n,)), U(rng, (n,))
    y = cpufuse.rms_norm(x, eps=0.0, isa=isa, fused=fused)
    assert np.isnan(y[1]).all()
    check_plain(y[[0, 2]], reference.rms_norm(x[[0, 2]], 0.0))
    y = cpufuse.rms_norm(x, w, eps=0.0, bias=b, isa=isa, fused=fused)
    assert np.isnan(y[1]).all()
    for eps in (1e-6, 2.0):
        y = cpufuse.rms_norm(x, eps=eps, isa=isa, fused=fused)
        assert np.array_equal(y[1], np.zeros(n, np.float32))
        y = cpufuse.rms_norm(x, w, eps=eps, isa=isa, fused=fused)
        assert np.array_equal(y[1], np.zeros(n, np.float32))
        y = cpufuse.rms_norm(x, w, eps=eps, bias=b, isa=isa, fused=fused)
        assert np.array_equal(y[1], b)
        h, y = cpufuse.add_rms_norm(x, -x, w, eps=eps, isa=isa, fused=fused)
        assert np.array_equal(h, np.zeros_like(x)) and np.array_equal(y, np.zeros_like(x))
    h, y = cpufuse.add_rms_norm(x, -x, eps=0.0, isa=isa, fused=fused)
    assert np.isnan(y).all()


@pytest.mark.parametrize("n", [1, 5, 8, 16, 19, 64, 1025])
def test_inf_in_row(isa, fused, n, rng):
    """ss = inf, s = 0: finite elements become +-0 (the sign of x), infinite ones NaN"""
    x = U(rng, (4, n))
    for r, sign in ((0, 1), (2, -1)):
        x[r, [0, n // 2, n - 1]] = sign * np.inf
    x[2, 0] = np.inf
    ok = [1, 3]
    for eps in (0.0, 1e-5):
        y = cpufuse.rms_norm(x, eps=eps, isa=isa, fused=fused)
        for r in (0, 2):
            inf = np.isinf(x[r])
            assert np.isnan(y[r, inf]).all()
            assert np.all(y[r, ~inf] == 0.0)
            assert np.array_equal(np.signbit(y[r, ~inf]), np.signbit(x[r, ~inf]))
        check_plain(y[ok], reference.rms_norm(x[ok], eps))


@pytest.mark.parametrize("n", [1, 5, 8, 16, 19, 64, 1025])
def test_nan_in_row(isa, fused, n, rng):
    x = U(rng, (5, n))
    for r, p in ((0, 0), (1, n // 2), (2, n - 1)):
        x[r, p] = np.nan
    w, b = U(rng, (n,)), U(rng, (n,))
    y = cpufuse.rms_norm(x, eps=1e-6, isa=isa, fused=fused)
    assert np.isnan(y[:3]).all()
    check_plain(y[3:], reference.rms_norm(x[3:], 1e-6))
    y = cpufuse.rms_norm(x, w, eps=1e-6, bias=b, isa=isa, fused=fused)
    assert np.isnan(y[:3]).all()
    terms = np.abs(reference.rms_norm(x[3:], 1e-6, w)) + np.abs(b)
    check(y[3:], reference.rms_norm(x[3:], 1e-6, w, b), terms=terms)
    h, y = cpufuse.add_rms_norm(x, x[4], eps=1e-6, isa=isa, fused=fused)
    assert np.isnan(y[:3]).all() and not np.isnan(y[3:]).any()


@pytest.mark.parametrize("n", [4, 8, 17, 64, 130])
def test_nonfinite_weight_bias_per_element(isa, fused, n, rng):
    x = U(rng, (3, n))
    x[:, 1] = 0.0  # 0 * inf weight = NaN at that element only
    w, b = U(rng, (n,)), U(rng, (n,))
    base = cpufuse.rms_norm(x, w, eps=1e-6, bias=b, isa=isa, fused=fused)
    w2, b2 = w.copy(), b.copy()
    w2[0], w2[1], w2[n - 1] = np.inf, np.inf, np.nan
    b2[2] = -np.inf
    y = cpufuse.rms_norm(x, w2, eps=1e-6, bias=b2, isa=isa, fused=fused)
    assert np.array_equal(np.isposinf(y[:, 0]) | np.isneginf(y[:, 0]), np.ones(3, bool))
    assert np.array_equal(np.sign(y[:, 0]), np.sign(x[:, 0]))
    assert np.isnan(y[:, 1]).all() and np.isnan(y[:, n - 1]).all()
    assert np.all(np.isneginf(y[:, 2]))
    rest = np.ones(n, bool)
    rest[[0, 1, 2, n - 1]] = False
    assert_bit_identical(y[:, rest], base[:, rest], "untouched elements")


@pytest.mark.parametrize("mag", [1e-15, 1e15, 4e18])
@pytest.mark.parametrize("n", [64, 1024])
def test_large_and_small_magnitudes(isa, fused, mag, n, rng):
    """docs/semantics.md §3: squares are f32 (so |x| < ~1.8e19 must work, as upstream, whose f64 sum
    of squares does not overflow), the accumulation must not overflow below that range"""
    x = (rng.choice([-1.0, 1.0], (3, n)) * mag * rng.uniform(0.5, 1.0, (3, n))).astype(np.float32)
    assert np.isfinite(x.astype(np.float32) ** 2).all()
    w = U(rng, (n,))
    check_plain(cpufuse.rms_norm(x, eps=0.0, isa=isa, fused=fused), reference.rms_norm(x, 0.0), f"|x|~{mag:g}")
    check(cpufuse.rms_norm(x, w, eps=0.0, isa=isa, fused=fused), reference.rms_norm(x, 0.0, w), f"|x|~{mag:g} weight")


# ------------------------------------------------------------------------------------------------
# aliasing, guards, inputs unchanged, empty

def test_in_place_plain(isa, fused, rng):
    for shape in [(4, 33), (2, 3, 64), (1, 1, 1, 1)]:
        x = U(rng, shape)
        expect = cpufuse.rms_norm(x, eps=1e-6, isa=isa, fused=fused)
        y = cpufuse.rms_norm(x, eps=1e-6, out=x, isa=isa, fused=fused)
        assert y is x
        assert_bit_identical(x, expect, "in place")
    base = U(rng, (6, 50))
    view = base[1::2, 4:40]
    before = base.copy()
    expect = cpufuse.rms_norm(view.copy(), eps=1e-6, isa=isa, fused=fused)
    cpufuse.rms_norm(view, eps=1e-6, out=view, isa=isa, fused=fused)
    assert_bit_identical(view, expect, "in place view")
    keep = np.ones(base.shape, bool)
    keep[1::2, 4:40] = False
    assert np.array_equal(base[keep], before[keep])


def test_add_rms_norm_h_in_place(isa, fused, rng):
    """h_out may be x itself or the residual itself (the in-place residual update)"""
    x, r, w = U(rng, (4, 70)), U(rng, (4, 70)), U(rng, (70,))
    h0, y0 = cpufuse.add_rms_norm(x, r, w, eps=1e-6, isa=isa, fused=fused)
    for which in ("x", "residual"):
        xx, rr = x.copy(), r.copy()
        hout = xx if which == "x" else rr
        yout = np.empty_like(x)
        h, y = cpufuse.add_rms_norm(xx, rr, w, eps=1e-6, out=(hout, yout), isa=isa, fused=fused)
        assert h is hout and y is yout
        assert_bit_identical(h, h0, f"h in {which}")
        assert_bit_identical(y, y0, f"y with h in {which}")


@pytest.mark.parametrize("n", [1, 3, 8, 9, 16, 17, 33, 100, 257])
def test_guard_elements(isa, fused, n, rng):
    S = np.float32(-7.25e11)
    x, r = U(rng, (2, 3, n)), U(rng, (2, 3, n))
    w, b = U(rng, (n,)), U(rng, (3, n))
    for kw in (dict(), dict(weight=w), dict(weight=w, bias=b)):
        out, buf, inside = guarded(x.shape)
        y = cpufuse.rms_norm(x, eps=1e-5, out=out, isa=isa, fused=fused, **kw)
        assert y is out
        assert_guard_intact(buf, inside)
        check(out, reference.rms_norm(x, 1e-5, kw.get("weight"), kw.get("bias")))
    hout, hbuf, hin = guarded(x.shape)
    yout, ybuf, yin = guarded(x.shape)
    cpufuse.add_rms_norm(x, r, w, eps=1e-5, bias=b, out=(hout, yout), isa=isa, fused=fused)
    assert_guard_intact(hbuf, hin)
    assert_guard_intact(ybuf, yin)
    check(yout, reference.rms_norm(x, 1e-5, w, b, residual=r)[1])
    # a C-contiguous 2-D out inside a flat buffer (a plan writes through it)
    x2 = x.reshape(-1, n)
    flat = np.full(x2.size + 48, S, np.float32)
    o2 = flat[16:16 + x2.size].reshape(x2.shape)
    assert o2.flags.c_contiguous
    cpufuse.rms_norm(x2, w, eps=1e-5, out=o2, isa=isa, fused=fused)
    assert np.all(flat[:16] == S) and np.all(flat[16 + x2.size:] == S)
    check(o2, reference.rms_norm(x2, 1e-5, w))


def test_inputs_unchanged(isa, fused, rng):
    x, r = U(rng, (2, 3, 40)), U(rng, (3, 40))
    w, b = U(rng, (40,)), U(rng, (3, 40))
    keep = [a.copy() for a in (x, r, w, b)]
    cpufuse.rms_norm(x, eps=1e-6, isa=isa, fused=fused)
    cpufuse.rms_norm(x, w, eps=1e-6, bias=b, isa=isa, fused=fused)
    cpufuse.rms_norm(x.reshape(6, 40), w, eps=1e-6, isa=isa, fused=fused)
    cpufuse.add_rms_norm(x, r, w, eps=1e-6, bias=b, isa=isa, fused=fused)
    for a, k in zip((x, r, w, b), keep):
        assert np.array_equal(a.view(np.uint32), k.view(np.uint32))


@pytest.mark.parametrize("shape", [(2, 0), (0, 8), (3, 0, 4), (2, 2, 0, 5)], ids=str)
def test_empty_sliced(isa, fused, shape):
    """empty x made by slicing (ordinary strides); the weight is the usual length-n row"""
    big = np.ones(tuple(max(s, 1) for s in shape), np.float32)
    x = big[tuple(slice(0, s) for s in shape)]
    y = cpufuse.rms_norm(x, eps=1e-6, isa=isa, fused=fused)
    assert y.shape == shape and y.dtype == np.float32
    if shape[-1]:
        w = np.ones(shape[-1], np.float32)
        assert cpufuse.rms_norm(x, w, eps=1e-6, bias=w, isa=isa, fused=fused).shape == shape
        h, y = cpufuse.add_rms_norm(x, w, w, eps=1e-6, isa=isa, fused=fused)
        assert h.shape == y.shape == shape


@pytest.mark.parametrize("shape", [(2, 0), (0, 8), (3, 0, 4), (2, 2, 0, 5)], ids=str)
def test_empty_fresh(shape):
    """empty x as numpy creates it (numpy >= 2.4 gives size-0 arrays all-zero strides):
    docs/semantics.md §1 says an empty tensor is never an error (checked on every available ISA)"""
    x = np.zeros(shape, np.float32)
    for isa in AVAILABLE:
        assert cpufuse.rms_norm(x, eps=1e-6, isa=isa).shape == shape
        if shape[-1]:
            w = np.ones(shape[-1], np.float32)
            assert cpufuse.rms_norm(x, w, eps=1e-6, bias=w, isa=isa).shape == shape
            assert cpufuse.add_rms_norm(x, w, eps=1e-6, isa=isa)[1].shape == shape


def test_empty_weight_with_empty_x():
    """docs/semantics.md §3: an empty weight is allowed with an empty x"""
    x = np.ones((3, 4), np.float32)[:, :0]
    w = np.ones(4, np.float32)[:0]
    for isa in AVAILABLE:
        assert cpufuse.rms_norm(x, w, eps=1e-6, isa=isa).shape == (3, 0)


def test_add_rms_norm_empty_rows():
    """x and residual of the same empty shape (n == 0): an empty result, not an error"""
    x = np.ones((3, 4), np.float32)[:, :0]
    r = np.ones((3, 4), np.float32)[:, :0]
    for isa in AVAILABLE:
        h, y = cpufuse.add_rms_norm(x, r, eps=1e-6, isa=isa)
        assert h.shape == y.shape == (3, 0)


# ------------------------------------------------------------------------------------------------
# strided operands, threads

def test_strided_operands(isa, fused, rng):
    """x, weight, bias, residual and out as non-contiguous views (unit last stride), some with
    negative strides, against the same data made contiguous"""
    n = 45
    xb = U(rng, (3, 5, 4, n + 9))
    x = xb[:, ::-2, :, 2:2 + n]
    wb, bb, rb = U(rng, (6, n + 3)), U(rng, (2, 3, n + 1)), U(rng, (4, 2, n + 5))
    w, b, r = wb[::3, :n][:1], bb[1, ::-1, 1:], rb[::-1, 0, 5:]
    assert w.shape == (1, n) and b.shape == (3, n) and r.shape == (4, n)
    out = np.empty((3, 3, 4, 2 * n), np.float32)[..., n:]
    hout = np.empty((3, 3, 8, n), np.float32)[:, :, ::2]
    c = np.ascontiguousarray
    y = cpufuse.rms_norm(x, w, eps=1e-5, bias=b[:1], out=out, isa=isa, fused=fused)
    assert y is out
    assert_bit_identical(y, cpufuse.rms_norm(c(x), c(w), eps=1e-5, bias=c(b[:1]), isa=isa, fused=fused))
    check(y, reference.rms_norm(x, 1e-5, w, b[:1]))
    h, y2 = cpufuse.add_rms_norm(x, r, w, eps=1e-5, out=(hout, np.empty(x.shape, np.float32)), isa=isa, fused=fused)
    hc, yc = cpufuse.add_rms_norm(c(x), c(r), c(w), eps=1e-5, isa=isa, fused=fused)
    assert_bit_identical(h, hc)
    assert_bit_identical(y2, yc)
    # a strided (4, n) bias tiling x's rows
    y3 = cpufuse.rms_norm(x, w, eps=1e-5, bias=r, isa=isa, fused=fused)
    check(y3, reference.rms_norm(x, 1e-5, w, r))


def test_threads_deterministic(isa, rng):
    from concurrent.futures import ThreadPoolExecutor
    xs = [U(rng, (3, 4, 1000)) for _ in range(8)]
    w, b = U(rng, (1000,)), U(rng, (4, 1000))
    serial = [cpufuse.rms_norm(x, w, eps=1e-6, bias=b, isa=isa) for x in xs]
    with ThreadPoolExecutor(4) as ex:
        par = list(ex.map(lambda x: cpufuse.rms_norm(x, w, eps=1e-6, bias=b, isa=isa), xs * 3))
    for i, y in enumerate(par):
        assert_bit_identical(y, serial[i % len(xs)], "threaded")
