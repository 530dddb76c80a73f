"""softmax (ggml soft_max_ext): the declaration of its operands (binder.py), the checks, which make its
entries, and the call."""
import math

import numpy as np

from .. import _dispatch, _registry
from .._layouts import SM
from .binder import Binder, In, Out, Param
from .checks import (
    F16, F32, _aligned, _check_f32, _check_mask_sinks, _check_no_overlap, _check_out, _geom4, _kernel, _real,
    _rows_geom, _slopes, _thr)


def softmax_desc(xg, yg, mg, mkind):
    """cf_softmax_f32's descriptor (SM of cpufuse._layouts) from (shape, strides) geometries"""
    (S, H, R, C), xs = xg
    ys = yg[1]
    (MS, MH, _, _), (MS0, MS1, MS2, _) = mg if mg else ((1, 1, 0, 0), (0, 0, 0, 0))
    return SM.pack(S=S, H=H, R=R, C=C, XS0=xs[0], XS1=xs[1], XS2=xs[2], YS0=ys[0], YS1=ys[1], YS2=ys[2],
                   MS=MS, MH=MH, MS0=MS0, MS1=MS1, MS2=MS2, MKIND=mkind if mg else 0)



# ------------------------------------------------------------------------------------------------
# softmax

_SM = Binder("softmax", (In("x", F32), In("mask", F32, F16, optional=True), In("sinks", F32, optional=True),
                         Out("out", F32, alias=("x",))),
             (Param("scale", key=False, passed=True), Param("max_bias"), Param("fused")))
_fast = _SM.fast


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
    r = _fast(x, mask, sinks, out, scale, max_bias, fused, isa, n_threads)
    if r is not None:
        return r[0]
    return _softmax(x, mask, scale, max_bias, sinks, out, isa, fused, n_threads)


def _plan(isa, fused, sh, mk, n_threads):
    """the entry of a checked call with C-contiguous rows (1-D or 2-D x; mask None or x's shape, f32
    (mk 1) or f16 (mk 2)), no sinks and no ALiBi: (launch, arrays, new shapes)"""
    conv = _registry.convention(isa)
    fn = _kernel("softmax" if fused else "softmax_unfused", isa, n_threads)
    g = _rows_geom(sh[0] if len(sh) == 2 else 1, sh[-1])
    dp, null = conv.desc(softmax_desc(g, g, g if mk else None, mk)), conv.null

    def launch(x, mask, sinks, y, scale, nt):
        if fn(dp, x, mask, null, sinks, scale, y, nt or _thr[0]):
            raise MemoryError("softmax: could not allocate scratch memory")
    return launch, conv.arrays, (sh,)


def _softmax(x, mask, scale, max_bias, sinks, out, isa_arg, fused, n_threads):
    """the checks, then the call (through the binder when the call has an entry)"""
    isa = _dispatch.resolve(isa_arg)
    _check_f32(x, "x")
    xg = _geom4(x)
    S, H, R, C = xg[0]
    plain = type(scale) is float  # a plan passes scale to the kernel as given
    scale, max_bias = _real(scale, "scale"), _real(max_bias, "max_bias")
    if not math.isfinite(max_bias):
        raise ValueError(f"max_bias must be finite, got {max_bias}")
    _, mkind, sinks = _check_mask_sinks(mask, max_bias, sinks, S, H, R, C, True, "x")
    n_th = _dispatch.threads(n_threads)
    if out is not None:
        _check_out(out, x.shape)
        _check_no_overlap(out, (("x", x), ("mask", mask), ("sinks", sinks)), alias_ok=x)
    sh = x.shape
    if (plain and sinks is None and max_bias == 0.0 and 0 < len(sh) <= 2 and x.size
            and (mask is None or mask.shape == sh and len(sh) == 2)):
        r = _SM.plan(_plan(isa, fused, sh, mkind, n_threads), x, mask, sinks, out, scale, max_bias, fused, isa_arg,
                     n_threads)
        if r is not None:
            return r[0]
    if out is None:
        out = np.empty(x.shape, F32)
    if not x.flags.aligned:   # (out is then not x: out is aligned)
        x = _aligned(x)
        xg = _geom4(x)
    if mask is not None and not mask.flags.aligned:
        mask = _aligned(mask)
    if out.size == 0:
        return out
    slopes = _slopes(H, max_bias) if (mask is not None and max_bias > 0.0) else None

    conv = _registry.convention(isa)
    P = conv.operand
    dp = conv.desc(softmax_desc(xg, _geom4(out), _geom4(mask) if mask is not None else None, mkind))
    if _kernel("softmax" if fused else "softmax_unfused", isa, n_threads)(dp, P(x), P(mask), P(slopes), P(sinks), scale,
                                                                          P(out), n_th):
        raise MemoryError("softmax: could not allocate scratch memory")
    return out
