"""The vectorized exp of each native ISA (docs/semantics.md §6): <= EXP_ULP over [-104, 88.7] against float64,
special values, and tails that never write past the end; and the softmax's exp for arguments <= 0
(vf_exp_le0): <= LE0_ULP where the result is a normal float, +0 below, NaN kept."""
import numpy as np
import pytest

from cpufuse import _backend, _registry

F32 = np.float32
SENTINEL = F32(-12345.5)
# Deliberate deviation from ggml's "<= 2 ulp" exp: a degree-5 polynomial (one FMA fewer than the
# degree 6 it replaced) measures 2.25 ulp at worst, exhaustively over all floats (README). Softmax's
# bound (NMSE <= 1e-12, max relative error <= 4e-6, docs/semantics.md §2) is ~30 ulp.
# The scalar path has no FMA (two roundings per polynomial step): 2.62 ulp measured.
EXP_ULP = 2.5
EXP_ULP_SCALAR = 3.0


def exp_ulp(isa):
    return EXP_ULP_SCALAR if isa == "scalar" else EXP_ULP
# vf_exp_le0 adds the one-constant reduction: about n/60 ulp more at 2^n (measured 4.9 at -87)
LE0_ULP = 5.5


def exp_kernel(isa, x, y=None, n=None, fn="exp"):
    ffi = _backend.ffi
    x = np.ascontiguousarray(x, F32)
    if y is None:
        y = np.empty_like(x)
    n = x.size if n is None else n
    _registry.kernel(fn, isa)(n, ffi.cast("float *", x.ctypes.data), ffi.cast("float *", y.ctypes.data))
    return y


def ulp_error(x, y):
    """|y - exp(x)| in units of the spacing of the float32-rounded true value"""
    true = np.exp(x.astype(np.float64))
    ulp = np.spacing(true.astype(F32)).astype(np.float64)
    return np.abs(y.astype(np.float64) - true) / ulp


def sweep_points():
    lo, hi = -104.0, 88.7
    dense = np.linspace(lo, hi, 3_000_001).astype(F32)
    # every float32 in a few windows: around 0, the reduction boundaries near +-ln2/2, the
    # subnormal range and the flush threshold, and the top end
    windows = []
    for a in (0.0, np.log(2) / 2, -np.log(2) / 2, -87.3, -100.0, -103.972, 88.5):
        c = F32(a)
        windows.append(c + np.arange(-20000, 20001, dtype=np.int64).astype(F32) * np.spacing(c if c else F32(1e-7)))
    tiny = np.concatenate([np.array([0.0, -0.0], F32), np.geomspace(1e-38, 1e-3, 20000).astype(F32)])
    pts = np.concatenate([dense] + windows + [tiny, -tiny])
    return pts[(pts >= lo) & (pts <= hi)]


SWEEP = sweep_points()


def test_sweep_covers_range():
    assert SWEEP.min() <= -103.99 and SWEEP.max() >= 88.69 and SWEEP.size > 3_000_000


def test_accuracy_sweep(native_isa):
    y = exp_kernel(native_isa, SWEEP)
    assert not np.isnan(y).any()
    err = ulp_error(SWEEP, y)
    worst = int(np.argmax(err))
    assert err[worst] <= exp_ulp(native_isa), (f"{native_isa}: {err[worst]:.3f} ulp at x={SWEEP[worst]!r}: "
                               f"got {y[worst]!r}, exp={np.exp(np.float64(SWEEP[worst]))!r}")


def test_exact_points(native_isa):
    x = np.array([0.0, -0.0, 1.0, -1.0, np.log(2)], F32)
    y = exp_kernel(native_isa, x)
    assert y[0] == 1.0 and y[1] == 1.0
    assert np.all(ulp_error(x, y) <= exp_ulp(native_isa))


SPECIALS = np.array([-np.inf, -104.0001, -104.5, -150.0, -1e30, -3.4e38, np.nan, np.inf], F32)
SPECIAL_EXP = np.array([0, 0, 0, 0, 0, 0, np.nan, np.inf], F32)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 16, 17, 37, 64])
def test_special_values(native_isa, n):
    """-inf -> +0, x < -104 -> +0, NaN -> NaN, +inf -> +inf, in every lane position (vector body
    and tail), alone and surrounded by ordinary values"""
    for shift in range(len(SPECIALS)):
        x = np.resize(np.roll(SPECIALS, shift), n)
        e = np.resize(np.roll(SPECIAL_EXP, shift), n)
        y = exp_kernel(native_isa, x)
        assert np.array_equal(y, e, equal_nan=True), (x, y)
        assert not np.signbit(y[e == 0]).any()
    base = np.linspace(-3, 3, n).astype(F32)
    for p in range(n):
        for v, e in zip(SPECIALS, SPECIAL_EXP):
            x = base.copy()
            x[p] = v
            y = exp_kernel(native_isa, x)
            assert np.array_equal(y[p:p + 1], np.array([e]), equal_nan=True), (p, v, y[p])
            rest = np.arange(n) != p
            assert np.all(ulp_error(x[rest], y[rest]) <= exp_ulp(native_isa))


def test_flush_thresholds(native_isa):
    """results just inside the range stay finite/positive where the true value is representable"""
    x = np.array([-103.0, -102.0, -87.5, 88.0, 88.7], F32)
    y = exp_kernel(native_isa, x)
    assert np.all(y > 0) and np.all(np.isfinite(y))
    assert np.all(ulp_error(x, y) <= exp_ulp(native_isa))


@pytest.mark.parametrize("n", range(1, 41))
def test_tail_lengths_and_guard(native_isa, n):
    rng = np.random.default_rng(n)
    x = rng.uniform(-20, 20, n).astype(F32)
    buf = np.full(n + 24, SENTINEL, F32)
    out = buf[8:8 + n]
    exp_kernel(native_isa, x, out)
    assert np.all(buf[:8] == SENTINEL) and np.all(buf[8 + n:] == SENTINEL), "wrote outside [0, n)"
    assert np.all(ulp_error(x, out) <= exp_ulp(native_isa))
    # n smaller than the array: only the first n are written
    full = np.full(n + 1, SENTINEL, F32)
    exp_kernel(native_isa, np.append(x, F32(1.0)), full, n=n)
    assert full[n] == SENTINEL
    assert np.array_equal(full[:n], out)
    # n == 0 writes nothing
    z = np.full(4, SENTINEL, F32)
    exp_kernel(native_isa, np.zeros(4, F32), z, n=0)
    assert np.all(z == SENTINEL)


def test_le0_accuracy_and_specials(native_isa):
    """softmax's exp (arguments <= 0): accurate where exp(x) >= 2^-126, +0 below (no subnormals,
    docs/semantics.md §2), exp(-inf) = +0, NaN stays NaN, and the tail lanes are written like the body"""
    x = SWEEP[SWEEP <= 0]
    y = exp_kernel(native_isa, x, fn="exp_le0")
    normal = x >= np.log(np.float64(2.0) ** -126) + 0.01
    err = ulp_error(x[normal], y[normal])
    worst = int(np.argmax(err))
    assert err[worst] <= LE0_ULP, f"{native_isa}: {err[worst]:.3f} ulp at x={x[normal][worst]!r}"
    low = y[~normal]
    true_low = np.exp(x[~normal].astype(np.float64))
    assert np.all((low == 0) | (np.abs(low - true_low) <= 6 * np.spacing(F32(2.0 ** -126))))
    assert not np.signbit(low).any()
    for n in (1, 5, 8, 16, 17, 33):
        sp = np.resize(np.array([-np.inf, np.nan, 0.0, -1.0, -200.0, -1e30], F32), n)
        ys = exp_kernel(native_isa, sp, fn="exp_le0")
        special = (sp < -90) | np.isnan(sp) | (sp == 0)
        want = np.where(sp < -90, F32(0), np.where(sp == 0, F32(1), sp))
        assert np.array_equal(ys[special], want[special], equal_nan=True), (n, sp, ys)
        assert not np.signbit(ys[sp < -90]).any()
        assert np.all(ulp_error(sp[~special], ys[~special]) <= LE0_ULP)
