"""Strategies and checks shared by the property tests (tests/test_props_*.py).

Arrays are drawn as (seed, shape, special values) and built with numpy, so large rows stay cheap;
`place` puts a value array into a larger sentinel-filled buffer as a view with an offset, per-axis
steps (negative too) and a permuted memory order, and returns what is needed to check that nothing
outside the view was written and that inputs were not modified.
"""
import re

import numpy as np
import pytest

hyp = pytest.importorskip("hypothesis")
from hypothesis import strategies as st  # noqa: E402

import cpufuse  # noqa: E402
from cpufuse import reference  # noqa: E402

AVAILABLE = tuple(cpufuse.available_isas())
F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
SENTINEL = -7.25e11
FLT_MIN = float(np.finfo(np.float32).tiny)

# sizes that straddle every vector width (8, 16 floats) and the 32/64 tiles
EDGE_DIMS = (0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33)
ROW_LENS = EDGE_DIMS + (63, 64, 65, 127, 129, 255, 257, 511, 1023, 1025, 2047, 3001)


def dim(max_small=20, edge=EDGE_DIMS):
    return st.one_of(st.sampled_from(edge), st.integers(0, max_small))


def row_len():
    """mostly short rows, sometimes a few thousand"""
    return st.one_of(st.integers(0, 40), st.sampled_from(ROW_LENS))


paths = st.tuples(st.sampled_from(AVAILABLE), st.sampled_from((1, 2, 3)))


def cap_leading(shape, limit=6000):
    """shrink leading dims (not the last) so the array stays small on average"""
    shape = list(shape)
    for i in range(len(shape) - 1):
        while np.prod(shape, dtype=np.int64) > limit and shape[i] > 1:
            shape[i] = max(1, shape[i] // 2)
    return tuple(shape)


SPECIAL_KINDS = ("nan", "inf", "-inf", "sub", "zero", "huge")


@st.composite
def values(draw, shape, dtype=F32, mag=(1.0,), specials=SPECIAL_KINDS, huge=1e30, p_special=0.3):
    """float values of `shape`: N(0, 1) * a drawn magnitude, with a few drawn special values"""
    seed = draw(st.integers(0, 2**32 - 1))
    m = draw(st.sampled_from(mag))
    use = specials and draw(st.integers(0, 9)) < round(10 * p_special)
    kinds = draw(st.sets(st.sampled_from(specials), min_size=1, max_size=3)) if use else set()
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(shape) * m).astype(dtype)
    n = a.size
    for k in sorted(kinds):
        if not n:
            break
        idx = rng.integers(0, n, int(rng.integers(1, 4)))
        v = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "sub": 1e-40 if dtype == F32 else 3e-6,
             "zero": 0.0, "huge": huge}[k]
        sgn = rng.choice([-1.0, 1.0], idx.size) if k in ("sub", "huge") else 1.0
        a.reshape(-1)[idx] = np.asarray(v * sgn).astype(dtype)
    return a


@st.composite
def layouts(draw, ndim, unit_last=None):
    """(perm, steps, offsets): memory order, per-axis step and start offset of a view.
    unit_last True: the last axis stays innermost with step 1; False: it is not unit-stride;
    None: mostly unit (about 1 in 8 not)."""
    if ndim == 0:
        return (), (), ()
    if unit_last is None:
        unit_last = draw(st.integers(0, 7)) > 0
    kind = draw(st.sampled_from(("contig", "contig", "view", "perm")))
    if kind == "contig" and unit_last:
        return tuple(range(ndim)), (1,) * ndim, (0,) * ndim
    lead = list(range(ndim - 1))
    if kind == "perm":
        lead = list(draw(st.permutations(lead)))
    steps = [draw(st.sampled_from((1, 1, 2, 3, -1, -2))) for _ in range(ndim - 1)]
    if unit_last:
        perm = lead + [ndim - 1]
        steps.append(1)
    else:
        how = draw(st.sampled_from(("step", "perm", "neg")))
        if how == "perm" and ndim > 1:
            perm = [ndim - 1] + lead
            steps.append(1)
        else:
            perm = lead + [ndim - 1]
            steps.append(2 if how == "step" else -1)
    offs = tuple(draw(st.integers(0, 2)) for _ in range(ndim))
    return tuple(perm), tuple(steps), offs


def place(v, layout, fill=None, writeable=True):
    """A view equal to `v` laid out as `layout` in a larger buffer filled with `fill`
    -> (view, buffer, boolean mask of the view's elements in the buffer)."""
    perm, steps, offs = layout
    if fill is None:
        fill = SENTINEL if v.dtype != F16 else -1234.5
    if v.ndim == 0:
        b = v.copy()
        return b, b, np.ones((), bool)
    phys = []
    for ax, s, o in zip(perm, [steps[a] for a in perm], [offs[a] for a in perm]):
        n = v.shape[ax]
        phys.append(max(n * abs(s), 1) + 2 * o)
    buf = np.full(phys, fill, v.dtype)
    inside = np.zeros(phys, bool)
    sl = []
    for ax, o in zip(perm, [offs[a] for a in perm]):
        s, n = steps[ax], v.shape[ax]
        if n == 0:
            sl.append(slice(o, o))
        elif s > 0:
            sl.append(slice(o, o + n * s, s))
        else:
            start = o + n * abs(s) - 1
            sl.append(slice(start, (start - n * abs(s)) if start - n * abs(s) >= 0 else None, s))
    inv = np.argsort(perm)
    view = buf[tuple(sl)].transpose(inv)
    inside[tuple(sl)] = True
    assert view.shape == v.shape, (view.shape, v.shape, layout)
    view[...] = v
    if not writeable:
        view.flags.writeable = False
        buf.flags.writeable = False
    return view, buf, inside


@st.composite
def placed(draw, v, unit_last=None):
    return place(v, draw(layouts(v.ndim, unit_last)))


def bad_last(a):
    """the documented unit-stride rule: a non-empty array whose last axis (longer than 1) is not
    unit-stride is refused"""
    return a.size > 0 and a.ndim > 0 and a.shape[-1] > 1 and a.strides[-1] != a.itemsize


class Snapshot:
    """bit copies of input buffers, to check they were not modified"""

    def __init__(self, *arrays):
        self.items = [(a, a.copy()) for a in arrays if isinstance(a, np.ndarray)]

    def check(self, *skip):
        for a, c in self.items:
            if any(a is b for b in skip):
                continue
            assert a.shape == c.shape and np.array_equal(a.view(np.uint8), c.view(np.uint8)), \
                "an input (or the buffer around it) was modified"


def guard_ok(buf, inside, fill=SENTINEL):
    bad = np.flatnonzero(buf[~inside] != np.asarray(fill, buf.dtype))
    assert bad.size == 0, f"{bad.size} elements outside the output view were written"


def names_arg(msg, name):
    return re.search(r"(?<![A-Za-z_])" + re.escape(name) + r"(?![A-Za-z_])", msg) is not None


def expect_error(call, errors):
    """errors: list of (exception type, argument name); the call must raise one of them, and the
    message must name the argument"""
    with pytest.raises((TypeError, ValueError)) as ei:
        call()
    msg = str(ei.value)
    ok = [(t, n) for t, n in errors if isinstance(ei.value, t) and names_arg(msg, n)]
    assert ok, f"raised {type(ei.value).__name__}({msg!r}); expected one of {[(t.__name__, n) for t, n in errors]}"


def refused(call, errs, snap, *kept):
    """the call must raise one of errs (expect_error) and leave every input and output untouched;
    kept: (array, its copy before the call) pairs checked too"""
    expect_error(call, errs)
    snap.check()
    for a, c in kept:
        assert np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(c).view(np.uint8)), \
            "a refused call modified an argument"


def assert_matches(ref, out, tol, what=""):
    """NaN exactly where the reference is NaN; elsewhere docs/semantics.md §1 (inf at the same places with the
    same sign, NMSE <= tol over the finite elements)."""
    ref = np.asarray(ref, np.float64)
    out = np.asarray(out, np.float64)
    assert ref.shape == out.shape, (ref.shape, out.shape)
    rn, on = np.isnan(ref), np.isnan(out)
    assert np.array_equal(rn, on), (f"{what}: NaN positions differ: reference NaN at "
                                    f"{np.argwhere(rn & ~on)[:5].tolist()} not in output; output NaN at "
                                    f"{np.argwhere(on & ~rn)[:5].tolist()} not in reference")
    keep = ~rn
    r, o = ref[keep], out[keep]
    ri, oi = np.isinf(r), np.isinf(o)
    assert np.array_equal(ri, oi) and np.array_equal(np.sign(r[ri]), np.sign(o[oi])), f"{what}: inf mismatch"
    fin = ~ri
    r, o = r[fin], o[fin]
    # float32 has no relative precision below FLT_MIN: subnormal results are compared absolutely
    sub = (np.abs(r) < FLT_MIN) & (np.abs(o - r) < FLT_MIN)
    o = np.where(sub, r, o)
    err = reference.nmse(r, o) if r.size else 0.0
    assert err <= tol, f"{what}: NMSE {err:.3e} > {tol:.1e}"
    return err
