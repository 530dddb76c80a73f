"""softmax (ggml soft_max_ext): checks, the lean path and the call."""
import math

import numpy as np

from .. import _dispatch, _registry
from .._layouts import SM
from .checks import (
    F16, F32, _MAXT, _NULL, _T_CHAR, _T_F32, _aligned, _cast, _check_f32, _check_mask_sinks,
    _check_no_overlap, _check_out, _ctx_get, _desc, _empty, _fb, _geom4, _kernel, _lean_desc, _lean_fn,
    _nb_dummies, _nb_small, _ndarray, _pad4, _ptr, _real, _rows_geom, _slopes, _thr)

_SM_FN = _registry.table("softmax")
_SM_DESCS = {}  # lean-path descriptors (cffi int64 arrays, read-only) by shape


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
    # lean path: 1-D/2-D C-contiguous rows, no mask/sinks/ALiBi, out None, x itself or a C-contiguous
    # array that shares no byte with x; one cached descriptor per shape. Anything else, and every
    # error, goes the long way.
    if ((mask is None or type(mask) is _ndarray) and sinks is None and type(x) is _ndarray and type(scale) is float
            and type(max_bias) is float
            and max_bias == 0.0 and fused is True and (n_threads is None or type(n_threads) is int
                                                                 and 0 < n_threads <= _MAXT)):
        fn = _lean_fn(_SM_FN, isa)
        sh = x.shape
        mk = 0 if mask is None else 1 if mask.dtype is F32 else 2 if mask.dtype is F16 else 3
        if mk and (mk == 3 or mask.shape != sh or len(sh) != 2):  # lean masks: (R, C) like x, f32/f16
            fn = None
        key = (sh, mk) if mk else sh
        dp = _SM_DESCS.get(key)
        if dp is None and fn is not None and 0 < len(sh) <= 2 and x.size:
            dp = _lean_desc(_SM_DESCS, sh, lambda r, n: softmax_desc(_rows_geom(r, n), _rows_geom(r, n),
                                                                     _rows_geom(r, n) if mk else None, mk), key)
        if dp is not None and fn is not None and x.dtype is F32 and x.flags.aligned:
            y = _empty(sh, F32) if out is None else out if (
                type(out) is _ndarray and out.dtype is F32 and out.shape == sh and out.flags.behaved) else None
            if y is not None:
                try:
                    xb = _fb(_T_F32, x)
                    yb = xb if y is x else _fb(_T_F32, y)
                except (ValueError, TypeError, BufferError):
                    yb = None  # not C-contiguous
                if yb is not None:
                    n = len(xb)
                    try:
                        ok = y is x or out is None or not -n < (yb + 0) - xb < n  # no shared byte
                    except ValueError:
                        ok = False
                    mb = _NULL
                    if ok and mk:  # the mask: C-contiguous, aligned, sharing no byte with the output
                        try:
                            if not mask.flags.aligned:
                                raise ValueError
                            mb = _fb(_T_CHAR, mask)
                            ok = not -mask.nbytes < (mb + 0) - _cast("char *", yb) < y.nbytes
                        except (ValueError, TypeError, BufferError):
                            ok = False
                    if ok:
                        if fn(dp, xb, mb, _NULL, _NULL, scale, yb, n_threads or _thr[0]):
                            raise MemoryError("softmax: could not allocate scratch memory")
                        return y
        elif (fn is None and not mk and (isa or _ctx_get() or _dispatch.DEFAULT) == "numba" and x.dtype is F32
              and 0 < len(sh) <= 2
              and x.flags.c_contiguous):
            y = _empty(sh, F32) if out is None else out if (
                type(out) is _ndarray and out.dtype is F32 and out.shape == sh and out.flags.behaved
                and out.flags.c_contiguous and (out is x or not np.may_share_memory(out, x))) else None
            if y is not None and x.size:
                sh4 = (1, 1, x.size // sh[-1], sh[-1])
                d32, d16, d1 = _nb_dummies()
                _nb_small("softmax", x.size, n_threads)(
                    x.reshape(sh4), d32, d16, 0, d1, False, d1, False, scale, y.reshape(sh4))
                return y
    isa = _dispatch.resolve(isa)
    _check_f32(x, "x")
    xg = _geom4(x)
    S, H, R, C = xg[0]
    scale, max_bias = _real(scale, "scale"), _real(max_bias, "max_bias")
    if not math.isfinite(max_bias):
        raise ValueError(f"max_bias must be finite, got {max_bias}")
    m4, mkind, sinks = _check_mask_sinks(mask, max_bias, sinks, S, H, R, C, True, "x")
    if out is None:
        out = np.empty(x.shape, F32)
    else:
        _check_out(out, x.shape)
        _check_no_overlap(out, (("x", x), ("mask", mask), ("sinks", sinks)), alias_ok=x)
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
            scale, _ptr(out, writable=True), _dispatch.threads(n_threads))
    if rc:
        raise MemoryError("softmax: could not allocate scratch memory")
    return out
