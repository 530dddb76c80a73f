"""cpufuse.softmax vs the float64 oracle (docs/semantics.md §2, §1): accuracy on every ISA, fused and unfused,
edge cases, ALiBi, mask broadcasting, strides, aliasing, guards, and ggml's test-backend-ops grid."""
import functools

import numpy as np
import pytest

import cpufuse
from cpufuse import reference
from _util import (AVAILABLE, assert_bit_identical, assert_guard_intact, assert_nmse,
                   best_native, fused_modes, guarded, max_rel_err)

NMSE_TOL = 1e-12
REL_TOL = 4e-6
REL_FLOOR = 1e-30
SIZES = (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1023, 1024, 1025, 4097)
VECTOR_ISAS = ("avx512", "avx2", "neon")


def check(y, ref, what=""):
    assert y.dtype == np.float32
    assert_nmse(ref, y, NMSE_TOL, what)
    rel = max_rel_err(ref, y, REL_FLOOR)
    assert rel <= REL_TOL, f"{what}: max relative error {rel:.3e} > {REL_TOL:.0e}"


def make_mask(rng, shape, dtype, p_inf=0.25):
    """uniform [-2, 2] with -inf at ~p_inf of the positions; every row keeps >= 1 finite entry."""
    m = rng.uniform(-2, 2, shape).astype(np.float32)
    m[rng.random(shape) < p_inf] = -np.inf
    m[..., rng.integers(0, shape[-1])] = np.float32(rng.uniform(-2, 2))
    return m.astype(dtype)


@pytest.fixture(params=[True, False], ids=["fused", "unfused"])
def fused(request, isa):
    if not request.param and isa == "numba":
        pytest.skip("numba: fused=False is ignored (there is no separate-pass chain)")
    return request.param


# ------------------------------------------------------------------------------------------------
# accuracy over row lengths

@pytest.mark.parametrize("variant", ["plain", "mask_f32", "mask_f16_sinks", "scaled_mask_f32_sinks"])
@pytest.mark.parametrize("C", SIZES)
def test_sizes(isa, fused, C, variant, rng):
    R, H = 3, 2
    x = (rng.standard_normal((1, H, R, C)) * 4).astype(np.float32)
    mask = sinks = None
    scale = 1.0
    if variant != "plain":
        mask = make_mask(rng, (1, H, R, C), np.float16 if "f16" in variant else np.float32)
    if "sinks" in variant:
        sinks = rng.standard_normal(H).astype(np.float32)
    if variant.startswith("scaled"):
        scale = 0.125
    y = cpufuse.softmax(x, mask, scale=scale, sinks=sinks, isa=isa, fused=fused)
    assert y.shape == x.shape
    check(y, reference.softmax(x, mask, scale=scale, sinks=sinks), f"{isa} C={C} {variant}")
    if sinks is None:
        np.testing.assert_allclose(y.astype(np.float64).sum(-1), 1.0, rtol=0, atol=1e-5)


@pytest.mark.parametrize("C", [200001, 643251])
def test_long_rows(isa, fused, C, rng):
    if isa not in VECTOR_ISAS:
        pytest.skip(f"{isa}: long rows only on the vectorized ISAs (kept fast)")
    x = rng.uniform(-1, 1, (1, C)).astype(np.float32)
    mask = make_mask(rng, (1, C), np.float16) if C == 200001 else None
    y = cpufuse.softmax(x, mask, scale=3.0, isa=isa, fused=fused)
    check(y, reference.softmax(x, mask, scale=3.0), f"{isa} C={C}")


@pytest.mark.parametrize("C", SIZES)
def test_fused_unfused_bit_identical(native_isa, C, rng):
    """docs/semantics.md §5: fused and the separate-pass chain are the same arithmetic; here bit-identical."""
    x = (rng.standard_normal((2, 3, 2, C)) * 5).astype(np.float32)
    for mask, sinks, mb in [(None, None, 0.0),
                            (make_mask(rng, (2, 3, 2, C), np.float32), rng.standard_normal(3).astype(np.float32), 0.0),
                            (make_mask(rng, (1, 1, 2, C), np.float16), None, 8.0)]:
        a = cpufuse.softmax(x, mask, scale=0.3, max_bias=mb, sinks=sinks, isa=native_isa, fused=True)
        b = cpufuse.softmax(x, mask, scale=0.3, max_bias=mb, sinks=sinks, isa=native_isa, fused=False)
        assert_nmse(a, b, NMSE_TOL)
        assert_bit_identical(a, b, f"{native_isa} C={C}")


def test_isas_agree(rng):
    """All available paths give the same answer to within the accuracy bound of each."""
    x = (rng.standard_normal((2, 4, 3, 333)) * 3).astype(np.float32)
    mask = make_mask(rng, (1, 4, 3, 333), np.float16)
    sinks = rng.standard_normal(4).astype(np.float32)
    ref = reference.softmax(x, mask, scale=0.7, max_bias=8.0, sinks=sinks)
    for isa in AVAILABLE:
        check(cpufuse.softmax(x, mask, scale=0.7, max_bias=8.0, sinks=sinks, isa=isa), ref, isa)


# ------------------------------------------------------------------------------------------------
# masks, edge cases (docs/semantics.md §2)

@pytest.mark.parametrize("mdtype", [np.float32, np.float16])
def test_causal_mask(isa, fused, mdtype, rng):
    R, C = 37, 37
    x = rng.standard_normal((2, 4, R, C)).astype(np.float32)
    mask = np.triu(np.full((R, C), -np.inf, np.float32), 1).astype(mdtype)
    y = cpufuse.softmax(x, mask, scale=0.5, isa=isa, fused=fused)
    check(y, reference.softmax(x, mask, scale=0.5))
    assert np.all(y[..., np.triu(np.ones((R, C), bool), 1)] == 0.0)
    np.testing.assert_allclose(y[..., 0, 0], 1.0, rtol=0, atol=1e-7)


@pytest.mark.parametrize("mdtype", [np.float32, np.float16])
@pytest.mark.parametrize("C", [1, 8, 13, 64, 100])
def test_fully_masked_row(isa, fused, mdtype, C, rng):
    """all z = -inf: NaN without sinks; zeros with a finite sink; NaN with a -inf sink. Other rows
    of the same call are unaffected."""
    H, R = 2, 3
    x = rng.standard_normal((1, H, R, C)).astype(np.float32)
    mask = rng.uniform(-1, 1, (1, H, R, C)).astype(np.float32)
    mask[0, :, 1, :] = -np.inf  # row 1 of every head fully masked
    mask = mask.astype(mdtype)
    ok = np.array([0, 2])

    y = cpufuse.softmax(x, mask, isa=isa, fused=fused)
    assert np.isnan(y[0, :, 1]).all()
    check(y[0][:, ok], reference.softmax(x, mask)[0][:, ok])

    sinks = np.array([0.5, -3.0], np.float32)
    y = cpufuse.softmax(x, mask, sinks=sinks, isa=isa, fused=fused)
    assert np.array_equal(y[0, :, 1], np.zeros((H, C), np.float32))
    check(y[0][:, ok], reference.softmax(x, mask, sinks=sinks)[0][:, ok])

    sinks = np.array([-np.inf, 1.0], np.float32)
    y = cpufuse.softmax(x, mask, sinks=sinks, isa=isa, fused=fused)
    assert np.isnan(y[0, 0, 1]).all()
    assert np.array_equal(y[0, 1, 1], np.zeros(C, np.float32))
    check(y[0][:, ok], reference.softmax(x, mask, sinks=sinks)[0][:, ok])


def test_f16_mask_special_values(isa, fused, rng):
    """binary16 subnormals, the extremes +-65504, -0 and -inf are widened exactly"""
    C = 29
    vals = np.array([6e-8, -6e-8, 3e-5, 65504, -65504, -0.0, 0.0, -np.inf, 1e-7, -2.5e-6], np.float16)
    mask = np.resize(vals, (3, C)).astype(np.float16)
    mask[1] = np.roll(mask[1], 3)
    mask[2] = np.roll(mask[2], 7)
    x = rng.standard_normal((3, C)).astype(np.float32)
    for scale in (1.0, 0.01):
        y = cpufuse.softmax(x, mask, scale=scale, isa=isa, fused=fused)
        # with |m| up to 65504 the f32 rounding of the logits z (docs/semantics.md §2 step 1) dominates: the
        # oracle takes z = fl(fl(x*scale) + m) and does the rest in f64
        z = (x * np.float32(scale)) + mask.astype(np.float32)
        check(y, reference.softmax(z))
        # identical to the f32 mask holding the same (exactly widened) values
        assert_bit_identical(y, cpufuse.softmax(x, mask.astype(np.float32), scale=scale, isa=isa, fused=fused))


@pytest.mark.parametrize("C", [1, 5, 8, 16, 17, 40, 1025])
@pytest.mark.parametrize("bad", ["nan", "posinf", "mask_nan"])
def test_nonfinite_poisons_row(isa, fused, C, bad, rng):
    """NaN in x or in the mask, or +inf in x, makes that row (and only that row) NaN, wherever in
    the row it sits (first element, body, SIMD tail, last element)."""
    positions = sorted({0, C // 2, C - 1, max(C - 3, 0)})
    R = len(positions) + 1  # the last row stays clean
    x = rng.standard_normal((R, C)).astype(np.float32)
    mask = rng.uniform(-1, 1, (R, C)).astype(np.float32)
    for r, p in enumerate(positions):
        if bad == "nan":
            x[r, p] = np.nan
        elif bad == "posinf":
            x[r, p] = np.inf
        else:
            mask[r, p] = np.nan
    for m in (mask, mask.astype(np.float16)):
        y = cpufuse.softmax(x, m, isa=isa, fused=fused)
        assert np.isnan(y[:-1]).all(), f"rows with {bad} not all NaN: {np.isnan(y[:-1]).sum(1)}"
        check(y[-1], reference.softmax(x[-1:], m[-1:])[0])


def test_nan_with_sinks_and_neg_inf_entries(isa, fused, rng):
    x = rng.standard_normal((3, 50)).astype(np.float32)
    x[0, 10] = np.nan
    x[1, :25] = -np.inf  # -inf entries (not all): exactly 0 there
    sinks = np.array([2.0], np.float32)
    y = cpufuse.softmax(x[None], sinks=sinks, isa=isa, fused=fused)[0]
    assert np.isnan(y[0]).all()
    assert np.array_equal(y[1, :25], np.zeros(25, np.float32))
    check(y[1:], reference.softmax(x[None], sinks=sinks)[0, 1:])


def test_sinks(isa, fused, rng):
    H, R, C = 5, 4, 77
    x = rng.standard_normal((2, H, R, C)).astype(np.float32)
    mask = make_mask(rng, (2, 1, R, C), np.float32)
    sinks = np.array([-np.inf, -2.0, 0.0, 3.5, 40.0], np.float32)
    for m in (None, mask):
        y = cpufuse.softmax(x, m, scale=0.9, sinks=sinks, isa=isa, fused=fused)
        ref = reference.softmax(x, m, scale=0.9, sinks=sinks)
        check(y, ref)
        s = y.astype(np.float64).sum(-1)
        assert np.all(s <= 1 + 1e-5)
        # a -inf sink contributes nothing: rows sum to 1; a huge sink takes almost all the mass
        np.testing.assert_allclose(s[:, 0], 1.0, atol=1e-5)
        assert np.all(s[:, 4] < 1e-10)
    # -inf sink is the same as no sink
    y0 = cpufuse.softmax(x[:, :1], mask[:, :1], sinks=sinks[:1], isa=isa, fused=fused)
    y1 = cpufuse.softmax(x[:, :1], mask[:, :1], isa=isa, fused=fused)
    assert_nmse(y1, y0, 1e-14)


@pytest.mark.parametrize("mag", [30.0, 200.0, 1e30, 3e38])
def test_large_logits(isa, fused, mag, rng):
    """the max is subtracted first, so large logits never overflow; z - M may reach -inf"""
    x = (rng.uniform(-1, 1, (4, 77)) * mag).astype(np.float32)
    y = cpufuse.softmax(x, isa=isa, fused=fused)
    check(y, reference.softmax(x))
    assert np.all(y[np.arange(4), x.argmax(1)] > 0)


def test_scale_does_not_touch_mask_or_sinks(isa, fused, rng):
    x = rng.standard_normal((1, 2, 3, 20)).astype(np.float32)
    mask = rng.uniform(-3, 3, (1, 1, 3, 20)).astype(np.float32)
    sinks = np.array([1.0, -1.0], np.float32)
    for scale in (0.0, -1.5, 10.0):
        y = cpufuse.softmax(x, mask, scale=scale, sinks=sinks, isa=isa, fused=fused)
        check(y, reference.softmax(x, mask, scale=scale, sinks=sinks))
    # scale 0: only the mask and the sink decide
    y = cpufuse.softmax(x, mask, scale=0.0, isa=isa, fused=fused)
    check(y, reference.softmax(np.zeros_like(x), mask))


# ------------------------------------------------------------------------------------------------
# ALiBi (docs/semantics.md §2)

def spec_slopes(n_head):
    """the docs/semantics.md §2 examples for max_bias = 8, exactly"""
    if n_head == 32:
        return 2.0 ** (-(np.arange(32) + 1) / 4)
    if n_head == 12:
        return np.array([2.0 ** -(h + 1) for h in range(8)] + [2.0 ** -(0.5 + k) for k in range(4)])
    raise ValueError(n_head)


@pytest.mark.parametrize("H", [12, 32])
def test_alibi_reference_slopes_match_spec(H):
    s = reference.alibi_slopes(H, 8.0)
    assert s.dtype == np.float32 and s.shape == (H,)
    np.testing.assert_allclose(s.astype(np.float64), spec_slopes(H), rtol=1e-6)
    assert reference.alibi_slopes(H, 0.0) is None


@pytest.mark.parametrize("H", [12, 32])
def test_alibi_slopes_used_by_kernel(isa, fused, H):
    """Recover each head's slope from the kernel output: x = 0, mask row [0, -K_h] gives
    y0 / y1 = exp(slope_h * K_h); K_h is chosen so that slope_h * K_h ~ 12."""
    exp_s = spec_slopes(H)
    K = (12.0 / exp_s).astype(np.float32)
    mask = np.zeros((1, H, 1, 2), np.float32)
    mask[0, :, 0, 1] = -K
    x = np.zeros((1, H, 1, 2), np.float32)
    y = cpufuse.softmax(x, mask, max_bias=8.0, isa=isa, fused=fused).astype(np.float64)
    est = np.log(y[0, :, 0, 0] / y[0, :, 0, 1]) / K.astype(np.float64)
    np.testing.assert_allclose(est, exp_s, rtol=2e-5)
    # max_bias = 0: slope 1, the mask is still added
    y = cpufuse.softmax(x, mask, max_bias=0.0, isa=isa, fused=fused).astype(np.float64)
    np.testing.assert_allclose(y[0, :, 0, 1], np.exp(-K.astype(np.float64)) / (1 + np.exp(-K.astype(np.float64))),
                               rtol=1e-5, atol=1e-37)


@pytest.mark.parametrize("H", [12, 32])
@pytest.mark.parametrize("mdtype", [np.float32, np.float16])
def test_alibi_vs_reference(isa, fused, H, mdtype, rng):
    R, C = 3, 70
    x = rng.standard_normal((2, H, R, C)).astype(np.float32)
    mask = make_mask(rng, (1, 1, R, C), mdtype)  # -inf entries: slope * -inf = -inf
    sinks = rng.standard_normal(H).astype(np.float32)
    for sk in (None, sinks):
        y = cpufuse.softmax(x, mask, scale=0.25, max_bias=8.0, sinks=sk, isa=isa, fused=fused)
        check(y, reference.softmax(x, mask, scale=0.25, max_bias=8.0, sinks=sk))


# ------------------------------------------------------------------------------------------------
# mask broadcasting (heads and sequences by modulo, rows direct)

@pytest.mark.parametrize("xshape,mshape", [
    ((3, 3, 5, 19), (3, 1, 5, 19)),
    ((3, 2, 5, 19), (1, 1, 5, 19)),
    ((4, 6, 3, 24), (2, 3, 3, 24)),   # modulo tiling that numpy broadcasting would reject
    ((2, 4, 3, 24), (2, 4, 3, 24)),
    ((2, 4, 3, 9), (3, 9)),           # fewer mask dims are left-padded
    ((3, 9), (7, 9)),                 # more mask rows than x rows: the extra rows are ignored
    ((2, 2, 3, 33), (1, 2, 8, 33)),
])
@pytest.mark.parametrize("mdtype", [np.float32, np.float16])
def test_mask_broadcast(isa, fused, xshape, mshape, mdtype, rng):
    x = rng.standard_normal(xshape).astype(np.float32)
    mask = make_mask(rng, mshape, mdtype)
    y = cpufuse.softmax(x, mask, scale=0.5, isa=isa, fused=fused)
    ref = reference.softmax(x, mask, scale=0.5)
    check(y, ref)
    # independently of reference.tile_mask: row (s, h, r) uses mask[s % mS, h % mH, r]
    x4 = x.reshape((1,) * (4 - x.ndim) + x.shape)
    m4 = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    y4 = y.reshape(x4.shape)
    S, H, R, C = x4.shape
    for s in range(S):
        for h in range(H):
            one = cpufuse.softmax(x4[s, h], m4[s % m4.shape[0], h % m4.shape[1], :R], scale=0.5, isa=isa, fused=fused)
            assert_nmse(one, y4[s, h], 1e-14)


# ------------------------------------------------------------------------------------------------
# layout: strided views, in place, guard elements, inputs untouched, empty

def test_strided_views(isa, fused, rng):
    S, H, R, C = 2, 3, 4, 45
    base = rng.standard_normal((S, H, R, C + 11)).astype(np.float32)
    x_cols = base[..., 3:3 + C]  # column-sliced view: rows strided, last axis unit stride
    heads = rng.standard_normal((S, R, H, C)).astype(np.float32)
    x_t = heads.transpose(0, 2, 1, 3)  # (S, H, R, C) view with permuted outer strides
    mbase = rng.uniform(-1, 1, (S, 1, R + 2, C + 5)).astype(np.float32)
    mbase[mbase > 0.8] = -np.inf
    m_view = mbase[:, :, 1:R + 1, 2:2 + C]
    sinks = rng.standard_normal(H).astype(np.float32)
    for x in (x_cols, x_t, x_t[:, ::-1], x_cols[:, :, ::2]):
        assert not x.flags.c_contiguous and x.strides[-1] == 4
        for mask in (None, m_view, m_view.astype(np.float16), m_view[:, :, ::-1],
                     np.zeros((S, 2, R, 2 * C), np.float16)[:, ::-2, :, ::1][..., C:]):
            y = cpufuse.softmax(x, mask, sinks=sinks, isa=isa, fused=fused)
            assert y.flags.c_contiguous and y.shape == x.shape
            ref = reference.softmax(x, mask, sinks=sinks)
            check(y, ref)
            yc = cpufuse.softmax(np.ascontiguousarray(x), None if mask is None else np.ascontiguousarray(mask),
                                 sinks=sinks, isa=isa, fused=fused)
            assert_bit_identical(y, yc, "strided vs contiguous")


def test_in_place(isa, fused, rng):
    for shape in [(1, 3, 4, 100), (5, 17), (2, 2, 2, 8)]:
        x = (rng.standard_normal(shape) * 3).astype(np.float32)
        mask = make_mask(rng, (1, 1) + shape[-2:] if len(shape) == 4 else shape, np.float32)
        sinks = rng.standard_normal(shape[1] if len(shape) == 4 else 1).astype(np.float32)
        expect = cpufuse.softmax(x, mask, scale=0.5, sinks=sinks, isa=isa, fused=fused)
        y = cpufuse.softmax(x, mask, scale=0.5, sinks=sinks, out=x, isa=isa, fused=fused)
        assert y is x
        assert_bit_identical(x, expect, "in place")
    # in place on a strided view
    base = rng.standard_normal((6, 40)).astype(np.float32)
    view = base[::2, 5:30]
    expect = cpufuse.softmax(view.copy(), isa=isa, fused=fused)
    before = base.copy()
    cpufuse.softmax(view, out=view, isa=isa, fused=fused)
    assert_bit_identical(view, expect)
    untouched = np.ones(base.shape, bool)
    untouched[::2, 5:30] = False
    assert np.array_equal(base[untouched], before[untouched])


@pytest.mark.parametrize("C", [1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 65, 100, 257])
def test_guard_elements(isa, fused, C, rng):
    R, H = 3, 2
    x = rng.standard_normal((1, H, R, C)).astype(np.float32)
    mask = make_mask(rng, (1, 1, R, C), np.float16)
    sinks = rng.standard_normal(H).astype(np.float32)
    out, buf, inside = guarded((1, H, R, C))
    y = cpufuse.softmax(x, mask, sinks=sinks, out=out, isa=isa, fused=fused)
    assert y is out
    assert_guard_intact(buf, inside)
    check(out, reference.softmax(x, mask, sinks=sinks))
    # contiguous 1-D out inside a bigger buffer
    flat = np.full(C + 32, np.float32(-7.25e11), np.float32)
    o1 = flat[16:16 + C]
    cpufuse.softmax(x[0, 0, 0], out=o1, isa=isa, fused=fused)
    assert np.all(flat[:16] == np.float32(-7.25e11)) and np.all(flat[16 + C:] == np.float32(-7.25e11))
    check(o1, reference.softmax(x[0, 0, 0]))


def test_inputs_unchanged(isa, fused, rng):
    x = rng.standard_normal((2, 3, 4, 50)).astype(np.float32)
    mask = make_mask(rng, (2, 1, 6, 50), np.float16)
    mask32 = make_mask(rng, (1, 3, 4, 50), np.float32)
    sinks = rng.standard_normal(3).astype(np.float32)
    xs, ms, m32s, ss = x.copy(), mask.copy(), mask32.copy(), sinks.copy()
    for m in (mask, mask32):
        cpufuse.softmax(x, m, scale=0.3, max_bias=8.0, sinks=sinks, isa=isa, fused=fused)
    assert np.array_equal(x.view(np.uint32), xs.view(np.uint32))
    assert np.array_equal(mask.view(np.uint16), ms.view(np.uint16))
    assert np.array_equal(mask32.view(np.uint32), m32s.view(np.uint32))
    assert np.array_equal(sinks.view(np.uint32), ss.view(np.uint32))


@pytest.mark.parametrize("shape", [(2, 0), (0, 8), (1, 0, 2, 4), (2, 3, 0, 5), (0,)], ids=str)
def test_empty_sliced(isa, fused, shape):
    """empty inputs made by slicing a non-empty array (ordinary strides), with and without a mask"""
    big = np.ones(tuple(max(s, 1) for s in shape), np.float32)
    x = big[tuple(slice(0, s) for s in shape)]
    assert x.size == 0 and x.strides[-1] == 4
    y = cpufuse.softmax(x, isa=isa, fused=fused)
    assert y.shape == shape and y.dtype == np.float32
    if len(shape) >= 2:
        mbig = np.zeros((3, max(shape[-1], 1)), np.float32)
        m = mbig[:, :shape[-1]]  # 3 >= R rows, C columns
        y = cpufuse.softmax(x, m, isa=isa, fused=fused)
        assert y.shape == shape


@pytest.mark.parametrize("shape", [(2, 0), (0, 8), (1, 0, 2, 4), (2, 3, 0, 5), (0,)], ids=str)
def test_empty_fresh(shape):
    """empty inputs as numpy creates them (numpy >= 2.4 gives size-0 arrays all-zero strides):
    docs/semantics.md §1 says empty tensors are never an error (checked on every available ISA)"""
    x = np.zeros(shape, np.float32)
    for isa in AVAILABLE:
        y = cpufuse.softmax(x, isa=isa)
        assert y.shape == shape and y.dtype == np.float32
        out = np.empty(shape, np.float32)
        assert cpufuse.softmax(x, out=out, isa=isa) is out


# ------------------------------------------------------------------------------------------------
# more behaviour: extreme ALiBi, NaN sink, fused=False on numba, threads

def test_alibi_slope_underflow(isa, fused, rng):
    """docs/semantics.md §2: a huge max_bias makes slope(h) 0 in f32; then 0 * -inf = NaN (IEEE, as upstream)
    and a finite mask contributes nothing"""
    x = rng.standard_normal((1, 1, 2, 24)).astype(np.float32)
    mask = rng.uniform(-1, 1, (1, 1, 2, 24)).astype(np.float32)
    mask[0, 0, 1, 5] = -np.inf
    with np.errstate(divide="ignore"):  # the f32 slope formula overflows its unused branch
        assert reference.alibi_slopes(1, 1000.0)[0] == 0.0
        y = cpufuse.softmax(x, mask, max_bias=1000.0, isa=isa, fused=fused)
    check(y[0, 0, 0], reference.softmax(x[0, 0, 0]))
    assert np.isnan(y[0, 0, 1]).all()


def test_nan_sink(isa, fused, rng):
    x = rng.standard_normal((1, 2, 3, 20)).astype(np.float32)
    sinks = np.array([np.nan, 0.5], np.float32)
    y = cpufuse.softmax(x, sinks=sinks, isa=isa, fused=fused)
    assert np.isnan(y[0, 0]).all()
    check(y[0, 1], reference.softmax(x, sinks=sinks)[0, 1])


def test_numba_ignores_fused_false(rng):
    if "numba" not in AVAILABLE:
        pytest.skip("numba: not installed")
    x = rng.standard_normal((3, 4, 50)).astype(np.float32)
    m = make_mask(rng, (4, 50), np.float16)
    assert_bit_identical(cpufuse.softmax(x, m, isa="numba", fused=False), cpufuse.softmax(x, m, isa="numba"))


def test_threads_deterministic(isa, rng):
    """concurrent calls (cffi releases the GIL) give the same bits as serial ones"""
    from concurrent.futures import ThreadPoolExecutor
    xs = [(rng.standard_normal((2, 3, 4, 300)) * 3).astype(np.float32) for _ in range(8)]
    m = make_mask(rng, (1, 3, 4, 300), np.float16)
    sinks = rng.standard_normal(3).astype(np.float32)
    serial = [cpufuse.softmax(x, m, scale=0.5, max_bias=8.0, sinks=sinks, isa=isa) for x in xs]
    with ThreadPoolExecutor(4) as ex:
        par = list(ex.map(lambda x: cpufuse.softmax(x, m, scale=0.5, max_bias=8.0, sinks=sinks, isa=isa), xs * 3))
    for i, y in enumerate(par):
        assert_bit_identical(y, serial[i % len(xs)], "threaded")


# ------------------------------------------------------------------------------------------------
# docs/semantics.md §2 conformance grid (212 cases)

def _grid_cases():
    cases = []  # (id, ne=(C,R,H0,S0), rep=(rH,rS), mask, sinks, mdtype, scale, max_bias, inplace)
    for mask in (False, True):
        for sinks in (False, True):
            for mb in ((0.0, 8.0) if mask else (0.0,)):
                for scale in (1.0, 0.1):
                    for C in (16, 1024):
                        for R in (16, 1024):
                            if mask:
                                for md in ("f32", "f16"):
                                    shapes = [((C, R, 1, 1), (1, 1)), ((C - 1, R - 1, 1, 1), (1, 1))]
                                    if C <= 32 and R <= 32:
                                        shapes += [((C, R, 1, 3), (3, 1)), ((C - 1, R - 1, 1, 1), (2, 3))]
                                    for ne, rep in shapes:
                                        cases.append(("A", ne, rep, True, sinks, md, scale, mb, False))
                            else:
                                for ne in ((C, R, 1, 1), (C - 1, R - 1, 1, 1)):
                                    cases.append(("A", ne, (1, 1), False, sinks, None, scale, mb, False))
    for mask in (False, True):
        for sinks in (False, True):
            for md in ("f32", "f16"):
                cases.append(("B", (16, 2, 32, 1), (1, 1), mask, sinks, md if mask else None, 0.1, 0.0, True))
    for ne, mask, sinks, md, scale, mb in [
            ((16, 2, 32, 1), True, True, "f32", 0.1, 0.0),
            ((16, 2, 32, 1), True, False, "f16", 0.1, 0.0),
            ((16, 2, 32, 1), False, True, None, 0.1, 0.0),
            ((32, 2, 32, 1), True, True, "f32", 0.1, 0.0),
            ((32, 2, 32, 1), True, False, "f16", 0.1, 0.0),
            ((32, 2, 32, 1), True, True, "f32", 0.1, 8.0),
            ((32, 2, 32, 1), True, True, "f16", 0.1, 8.0),
            ((200001, 2, 3, 1), True, True, "f32", 0.1, 8.0),
            ((200001, 2, 3, 1), True, True, "f16", 0.1, 8.0),
            ((200000, 1, 1, 1), False, False, None, 1.0, 0.0),
            ((200000, 4, 1, 1), False, False, None, 1.0, 0.0),
            ((643251, 3, 1, 1), False, False, None, 1.0, 0.0)]:
        cases.append(("C", ne, (1, 1), mask, sinks, md, scale, mb, False))
    return cases


GRID = _grid_cases()
assert len(GRID) == 212 and sum(c[0] == "A" for c in GRID) == 192 and sum(c[0] == "B" for c in GRID) == 8


def _case_id(i, c):
    g, ne, rep, mask, sinks, md, scale, mb, inpl = c
    return (f"{g}{i}-ne{'x'.join(map(str, ne))}-rep{rep[0]}x{rep[1]}-{'mask_' + md if mask else 'nomask'}"
            f"-{'sinks' if sinks else 'nosinks'}-s{scale}-mb{mb:g}")


def _grid_params():
    """case-major order, so consecutive tests share the cached data and reference"""
    params = []
    for i, c in enumerate(GRID):
        huge = c[1][0] >= 200000
        if huge:
            isas = [best_native() or "numba"]
        else:
            isas = list(AVAILABLE)
        for isa in isas:
            for f in fused_modes(isa):
                params.append(pytest.param(i, isa, f, id=f"{_case_id(i, c)}-{isa}-{'fused' if f else 'unfused'}"))
    return params


@functools.lru_cache(maxsize=1)
def _grid_data(i):
    g, (C, R, H0, S0), (rH, rS), mask, sinks, md, scale, mb, inpl = GRID[i]
    rng = np.random.default_rng(1000 + i)
    x = rng.uniform(-1, 1, (S0 * rS, H0 * rH, R, C)).astype(np.float32)
    m = None
    if mask:
        m = rng.uniform(-1, 1, (S0, H0, R, C)).astype(np.float32)
        if md == "f16":
            m = m.astype(np.float16)
    sk = rng.uniform(-1, 1, H0 * rH).astype(np.float32) if sinks else None
    ref = reference.softmax(x, m, scale=scale, max_bias=mb, sinks=sk)
    return x, m, sk, ref


@pytest.mark.parametrize("i,grid_isa,grid_fused", _grid_params())
def test_conformance_grid(i, grid_isa, grid_fused):
    g, ne, rep, mask, sinks, md, scale, mb, inpl = GRID[i]
    x, m, sk, ref = _grid_data(i)
    if inpl:
        xc = x.copy()
        y = cpufuse.softmax(xc, m, scale=scale, max_bias=mb, sinks=sk, out=xc, isa=grid_isa, fused=grid_fused)
        assert y is xc
    else:
        y = cpufuse.softmax(x, m, scale=scale, max_bias=mb, sinks=sk, isa=grid_isa, fused=grid_fused)
    check(y, ref, _case_id(i, GRID[i]))
    if not grid_fused:
        yf = cpufuse.softmax(x, m, scale=scale, max_bias=mb, sinks=sk, isa=grid_isa, fused=True)
        assert_bit_identical(yf, y, "fused vs unfused")


def test_grid_covers_default_and_scalar():
    isas = {p.values[1] for p in _grid_params()}
    assert cpufuse.available_isas()[0] in isas
    if "scalar" in AVAILABLE:
        assert "scalar" in isas
