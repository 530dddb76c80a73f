"""Helpers shared by the test modules (imported as `_util`; tests/ is on sys.path under pytest)."""
import os
import platform

import numpy as np
import pytest

import cpufuse
from cpufuse import _dispatch, reference

NATIVE_ISAS = tuple(i for i in cpufuse.ALL_ISAS if i != "numba")
AVAILABLE = tuple(cpufuse.available_isas())
AVAILABLE_NATIVE = tuple(i for i in AVAILABLE if i != "numba")
IS_X86 = platform.machine() in ("x86_64", "AMD64", "i386", "i686")


def skip_reason(name):
    """Why `name` cannot be tested here, or None when it can."""
    if name in AVAILABLE:
        return None
    why = _dispatch._why_unavailable(name)
    if name == "neon" and IS_X86:
        why += " (the NEON kernels are tested under qemu-user elsewhere: tests/test_neon_qemu.py, make neon-test)"
    return f"{name}: {why}"


def require_isa(name):
    why = skip_reason(name)
    if why:
        pytest.skip(why)
    return name


def best_native():
    """The best native ISA available here (None on a pure-Python install)."""
    return AVAILABLE_NATIVE[0] if AVAILABLE_NATIVE else None


def fused_modes(isa):
    """fused=True always; fused=False only means something for the native ISAs."""
    return (True, False) if isa != "numba" else (True,)



def assert_nmse(ref, out, tol, what=""):
    """docs/semantics.md §1: no NaN in either output, +-inf at the same positions, NMSE <= tol."""
    ref = np.asarray(ref, np.float64)
    out = np.asarray(out, np.float64)
    assert ref.shape == out.shape, (ref.shape, out.shape)
    assert not np.isnan(ref).any(), f"{what}: NaN in the reference"
    assert not np.isnan(out).any(), f"{what}: NaN in the output at {np.argwhere(np.isnan(out))[:5].tolist()}"
    ri, oi = np.isinf(ref), np.isinf(out)
    assert np.array_equal(ri, oi) and np.array_equal(np.sign(ref[ri]), np.sign(out[oi])), f"{what}: inf mismatch"
    fin = ~ri
    err = reference.nmse(ref[fin], out[fin]) if fin.any() else 0.0
    assert err <= tol, f"{what}: NMSE {err:.3e} > {tol:.1e}"
    return err


def max_rel_err(ref, out, floor):
    ref = np.asarray(ref, np.float64)
    out = np.asarray(out, np.float64)
    sel = np.abs(ref) >= floor
    if not sel.any():
        return 0.0
    return float(np.max(np.abs(out[sel] - ref[sel]) / np.abs(ref[sel])))


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def assert_bit_identical(a, b, what=""):
    """Equal bit for bit, NaN payloads included (compares the uint32 views)."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    assert a.shape == b.shape
    if not np.array_equal(bits(a), bits(b)):
        # NaN payload / sign differences are reported separately from value differences
        same_nan = np.array_equal(np.isnan(a), np.isnan(b))
        diff = np.argwhere(bits(a) != bits(b))
        raise AssertionError(f"{what}: not bit-identical at {len(diff)} positions, first {diff[:5].tolist()}"
                             f"; NaN positions {'agree' if same_nan else 'differ'}")


def raised(fn):
    """(type, message) of the TypeError / ValueError fn() raises, or None"""
    try:
        fn()
    except (TypeError, ValueError) as e:
        return type(e), str(e)
    return None


def guarded(shape, sentinel=np.float32(-7.25e11), pad=9):
    """An output view of `shape` inside a larger sentinel-filled buffer (pad elements on every side
    of every axis, so the view is not contiguous) -> (view, buffer, boolean mask of the view)."""
    big = tuple(s + 2 * pad for s in shape)
    buf = np.full(big, sentinel, np.float32)
    sl = tuple(slice(pad, pad + s) for s in shape)
    inside = np.zeros(big, bool)
    inside[sl] = True
    return buf[sl], buf, inside


def assert_guard_intact(buf, inside, sentinel=np.float32(-7.25e11)):
    outside = buf[~inside]
    bad = np.flatnonzero(outside != sentinel)
    assert bad.size == 0, f"{bad.size} guard elements were overwritten"


# environment for subprocesses: never inherit an ISA override from the outer run
def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("CPUFUSE_ISA",)}
    env.update(extra)
    return env
