"""The vectorized exp of each native ISA (SPEC §5.1): <= 2 ulp over [-104, 88.7] against float64,
special values, and tails that never write past the end."""
import numpy as np
import pytest

from cpufuse import _backend

F32 = np.float32
SENTINEL = F32(-12345.5)


def exp_kernel(isa, x, y=None, n=None):
    ffi, lib = _backend.ffi, _backend.lib
    x = np.ascontiguousarray(x, F32)
    if y is None:
        y = np.empty_like(x)
    n = x.size if n is None else n
    getattr(lib, f"cf_exp_f32__{isa}")(n, ffi.cast("float *", x.ctypes.data), ffi.cast("float *", y.ctypes.data))
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
    assert err[worst] <= 2.0, (f"{native_isa}: {err[worst]:.3f} ulp at x={SWEEP[worst]!r}: "
                               f"got {y[worst]!r}, exp={np.exp(np.float64(SWEEP[worst]))!r}")


def test_exact_points(native_isa):
    x = np.array([0.0, -0.0, 1.0, -1.0, np.log(2)], F32)
    y = exp_kernel(native_isa, x)
    assert y[0] == 1.0 and y[1] == 1.0
    assert np.all(ulp_error(x, y) <= 2.0)


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
            assert np.all(ulp_error(x[rest], y[rest]) <= 2.0)


def test_flush_thresholds(native_isa):
    """results just inside the range stay finite/positive where the true value is representable"""
    x = np.array([-103.0, -102.0, -87.5, 88.0, 88.7], F32)
    y = exp_kernel(native_isa, x)
    assert np.all(y > 0) and np.all(np.isfinite(y))
    assert np.all(ulp_error(x, y) <= 2.0)


@pytest.mark.parametrize("n", range(1, 41))
def test_tail_lengths_and_guard(native_isa, n):
    rng = np.random.default_rng(n)
    x = rng.uniform(-20, 20, n).astype(F32)
    buf = np.full(n + 24, SENTINEL, F32)
    out = buf[8:8 + n]
    exp_kernel(native_isa, x, out)
    assert np.all(buf[:8] == SENTINEL) and np.all(buf[8 + n:] == SENTINEL), "wrote outside [0, n)"
    assert np.all(ulp_error(x, out) <= 2.0)
    # n smaller than the array: only the first n are written
    full = np.full(n + 1, SENTINEL, F32)
    exp_kernel(native_isa, np.append(x, F32(1.0)), full, n=n)
    assert full[n] == SENTINEL
    assert np.array_equal(full[:n], out)
    # n == 0 writes nothing
    z = np.full(4, SENTINEL, F32)
    exp_kernel(native_isa, np.zeros(4, F32), z, n=0)
    assert np.all(z == SENTINEL)
