"""softmax (ggml soft_max_ext): the checks, which make a call plan (checks.py, "call plans"), and the call."""
import math

import numpy as np

from .. import _dispatch
from .._layouts import SM
from .checks import (
    F32, _NULL, _T_CHAR, _T_F32, _aligned, _cast, _check_f32, _check_mask_sinks, _check_no_overlap,
    _check_out, _desc, _empty, _fb, _geom4, _ctx_get, _kernel, _nb_dummies, _nb_small, _pad4, _ptr, _real,
    _new_plans, _remember, _rows_geom, _slopes, _thr)

_PLANS = _new_plans()  # call signature -> plan (checks.py, "call plans")


def softmax_desc(xg, yg, mg, mkind):
    """cf_softmax_f32's descriptor (SM of cpufuse._layouts) from (shape, strides) geometries"""
    (S, H, R, C), xs = xg
    ys = yg[1]
    (MS, MH, _, _), (MS0, MS1, MS2, _) = mg if mg else ((1, 1, 0, 0), (0, 0, 0, 0))
    return SM.pack(S=S, H=H, R=R, C=C, XS0=xs[0], XS1=xs[1], XS2=xs[2], YS0=ys[0], YS1=ys[1], YS2=ys[2],
                   MS=MS, MH=MH, MS0=MS0, MS1=MS1, MS2=MS2, MKIND=mkind if mg else 0)



# ------------------------------------------------------------------------------------------------
# softmax

def softmax(x, mask=None, *, scale=1.0, max_bias=0.0, sinks=None, out=None, isa=None, fused=True,
            n_threads=None):
    """ggml soft_max_ext (docs/semantics.md §2): softmax(x*scale + slope*mask) over the last axis, with sinks.

    x: float32, 1-4 dims (S, H, R, C), last axis unit-stride. mask: float32 or float16 with shape
    (mS, mH, mR, C) (fewer dims are left-padded), mR >= R, H % mH == 0, S % mS == 0: heads and
    sequences tile by modulo, row r uses mask row r. max_bias > 0 applies ALiBi slopes (needs a
    mask). sinks: float32 (H,), one logit per head that joins the denominator only. out may be x
    (in place). A fully masked row without sinks is NaN (as upstream and PyTorch).
    fused=False runs the separate-pass chain ggml uses (for benchmarks and equivalence tests).
    """
    try:
        key = (x.shape, x.dtype, None if mask is None else (mask.shape, mask.dtype), sinks is None, type(scale),
               type(max_bias), max_bias, None if out is None else True if out is x else (out.shape, out.dtype),
               isa or _ctx_get() or _dispatch.DEFAULT, type(n_threads), n_threads, fused)
        run = _PLANS.get(key)
    except (AttributeError, TypeError):  # not arrays, or an unhashable parameter: the checks say which
        key = run = None
    if run is not None:
        y = run(x, mask, scale, out)
        if y is not None:
            return y
    return _softmax(x, mask, scale, max_bias, sinks, out, isa, fused, n_threads, key)


def _plan(isa, fused, sh, mk, n_threads):
    """the plan of a checked call with C-contiguous rows (1-D or 2-D x; mask None or x's shape, f32
    (mk 1) or f16 (mk 2)), no sinks and no ALiBi: run(x, mask, scale, out) -> result, or None where
    the operands do not bind"""
    nt = n_threads
    if isa == "numba":
        if mk:
            return None
        sh4 = (1, 1, sh[0] if len(sh) == 2 else 1, sh[-1])
        nb = _nb_small("softmax", sh4[2] * sh4[3], nt)
        d32, d16, d1 = _nb_dummies()

        def run(x, mask, scale, out):
            y = _empty(sh, F32) if out is None else out
            xf, yf = x.flags, y.flags
            if not (xf.c_contiguous and xf.aligned and yf.c_contiguous and yf.behaved and (
                    y is x or out is None or not np.may_share_memory(y, x))):
                return None
            nb(x.reshape(sh4), d32, d16, 0, d1, False, d1, False, scale, y.reshape(sh4))
            return y
        return run

    fn = _kernel("softmax" if fused else "softmax_unfused", isa)
    g = _rows_geom(sh[0] if len(sh) == 2 else 1, sh[-1])
    dp = _desc(softmax_desc(g, g, g if mk else None, mk))

    def run(x, mask, scale, out):
        if not x.flags.aligned:
            return None
        try:
            xb = _fb(_T_F32, x)
            if out is None:
                y = _empty(sh, F32)
                yb = _fb(_T_F32, y)
            else:
                y = out
                if not y.flags.behaved:  # aligned and writeable
                    return None
                yb = _fb(_T_F32, y)
                n = len(xb)
                if y is not x and -n < (yb + 0) - xb < n:  # no shared byte
                    return None
            mb = _NULL
            if mk:  # the mask: aligned, sharing no byte with the output
                if not mask.flags.aligned:
                    return None
                mb = _fb(_T_CHAR, mask)
                if -mask.nbytes < (mb + 0) - _cast("char *", yb) < y.nbytes:
                    return None
        except (ValueError, TypeError, BufferError):
            return None  # not C-contiguous, read-only, or pointers cffi cannot compare
        if fn(dp, xb, mb, _NULL, _NULL, scale, yb, nt or _thr[0]):
            raise MemoryError("softmax: could not allocate scratch memory")
        return y
    return run


def _softmax(x, mask, scale, max_bias, sinks, out, isa, fused, n_threads, key):
    """the checks, then the call (through a plan when the call has one)"""
    isa = _dispatch.resolve(isa)
    _check_f32(x, "x")
    xg = _geom4(x)
    S, H, R, C = xg[0]
    plain = type(scale) is float  # a plan passes scale to the kernel as given
    scale, max_bias = _real(scale, "scale"), _real(max_bias, "max_bias")
    if not math.isfinite(max_bias):
        raise ValueError(f"max_bias must be finite, got {max_bias}")
    m4, mkind, sinks = _check_mask_sinks(mask, max_bias, sinks, S, H, R, C, True, "x")
    n_th = _dispatch.threads(n_threads)
    if out is not None:
        _check_out(out, x.shape)
        _check_no_overlap(out, (("x", x), ("mask", mask), ("sinks", sinks)), alias_ok=x)
    sh = x.shape
    if (plain and sinks is None and max_bias == 0.0 and 0 < len(sh) <= 2 and x.size
            and (mask is None or mask.shape == sh and len(sh) == 2)):
        run = _remember(_PLANS, key, _plan(isa, fused, sh, mkind, n_threads))
        y = run(x, mask, scale, out) if run is not None else None
        if y is not None:
            return y
    if out is None:
        out = np.empty(x.shape, F32)
    if not x.flags.aligned:   # (out is then not x: out is aligned)
        x = _aligned(x)
        xg = _geom4(x)
    if mask is not None and not mask.flags.aligned:
        mask = _aligned(mask)
        m4 = _pad4(mask)
    if out.size == 0:
        return out
    slopes = _slopes(H, max_bias) if (mask is not None and max_bias > 0.0) else None

    if isa == "numba":
        x4, y4 = _pad4(x), _pad4(out)
        d32, d16, d1 = _nb_dummies()
        _nb_small("softmax", out.size, n_threads)(
            x4, m4 if mkind == 1 else d32, m4.view(np.uint16) if mkind == 2 else d16, mkind,
            slopes if slopes is not None else d1, slopes is not None,
            sinks if sinks is not None else d1, sinks is not None, scale, y4)
        return out

    dp = _desc(softmax_desc(xg, _geom4(out), _geom4(mask) if mask is not None else None, mkind))
    fn = _kernel("softmax" if fused else "softmax_unfused", isa)
    rc = fn(dp, _ptr(x), _ptr(mask) if m4 is not None else _NULL,
            _fb(_T_F32, slopes) if slopes is not None else _NULL,
            _fb(_T_F32, sinks) if sinks is not None else _NULL,
            scale, _ptr(out, writable=True), n_th)
    if rc:
        raise MemoryError("softmax: could not allocate scratch memory")
    return out
