"""rms_norm and add_rms_norm (ggml RMS_NORM [-> MUL [-> ADD]], and the pre-norm residual
pattern): checks, the lean paths and the call."""
import numpy as np

from .. import _dispatch, _registry
from .._layouts import RN
from .checks import (
    F32, _MAXT, _NULL, _T_F32, _aligned, _check_eps, _check_f32, _check_no_overlap, _check_out,
    _check_tiled, _ctx_get, _desc, _empty, _fb, _geom4, _kernel, _lean_desc, _lean_fn, _nb_dummies,
    _nb_small, _ndarray, _pad4, _ptr, _rows_geom, _same_view, _thr)

_RMS_ROWS = _registry.table("rms_norm_rows")
_RMS_FN = _registry.table("rms_norm")
_RN_DESCS = {}  # lean-path descriptors (cffi int64 arrays, read-only) by shape


def rms_desc(xg, yg, hg, rg, wg, bg):
    """cf_rms_norm_f32's descriptor (RN of cpufuse._layouts) from (shape, strides) geometries; the
    residual, weight and bias tile x by modulo over dims 3..1"""
    v = {}
    for p, g in (("R", rg), ("W", wg), ("B", bg)):
        (d3, d2, d1, _), (s3, s2, s1, _) = g if g is not None else ((1, 1, 1, 0), (0, 0, 0, 0))
        v.update({f"{p}3": d3, f"{p}2": d2, f"{p}1": d1, f"{p}S3": s3, f"{p}S2": s2, f"{p}S1": s1})
    (n3, n2, n1, n0), xs = xg
    ys = yg[1]
    hs = hg[1] if hg is not None else (0, 0, 0)
    return RN.pack(N3=n3, N2=n2, N1=n1, N0=n0, XS3=xs[0], XS2=xs[1], XS1=xs[2], YS3=ys[0], YS2=ys[1], YS1=ys[2],
                   HS3=hs[0], HS2=hs[1], HS1=hs[2], **v)



# ------------------------------------------------------------------------------------------------
# rms_norm

def rms_norm(x, weight=None, *, eps, bias=None, out=None, isa=None, fused=True, n_threads=None):
    """ggml RMS_NORM (+MUL, +MUL+ADD) fused (docs/semantics.md §3): y = (x * s) * weight + bias per row, with
    s = 1/sqrt(mean(x^2) + eps). weight and bias tile x by modulo in every dim (ggml_can_repeat),
    including the last when it divides the row length. The fused result is bit-identical to
    RMS_NORM followed by MUL (and ADD). out may be x only without weight and bias.
    fused=False runs the unfused chain (norm = sum of squares + copy + scale, then MUL, then ADD).
    """
    # lean path: the decode/prefill call, 1-D/2-D C-contiguous x with a 1-D row weight. Contiguity
    # is checked by from_buffer (it refuses a non-C-contiguous buffer), overlap by the kernel (return
    # code; np.may_share_memory on the Numba path); anything unusual goes the long way.
    if (type(x) is _ndarray and type(weight) is _ndarray and bias is None and fused is True and type(eps) is float
            and (n_threads is None or type(n_threads) is int and 0 < n_threads <= _MAXT)):
        sh = x.shape
        if (x.dtype is F32 and weight.dtype is F32 and 0 < len(sh) <= 2 and weight.shape == sh[-1:]
                and sh[-1] > 0 and eps >= 0.0 and x.flags.aligned and weight.flags.aligned):
            y = _empty(sh, F32) if out is None else out if (
                type(out) is _ndarray and out.dtype is F32 and out.shape == sh and out.flags.behaved) else None
            if y is not None:
                isa_ = isa or _ctx_get() or _dispatch.DEFAULT
                fn = _RMS_ROWS.get(isa_)
                n = sh[-1]
                if fn is not None:
                    try:
                        rc = fn(x.size // n, n, _fb(_T_F32, x), _fb(_T_F32, weight), eps, _fb(_T_F32, y),
                                n_threads or _thr[0])
                    except (ValueError, TypeError, BufferError):
                        rc = -1  # not C-contiguous: the general path says which
                    if rc == 0:
                        return y
                elif isa_ == "numba" and x.flags.c_contiguous and weight.flags.c_contiguous and (
                        out is None or y.flags.c_contiguous and not np.may_share_memory(y, x)
                        and not np.may_share_memory(y, weight)):
                    sh4 = (1, 1, x.size // n, n)
                    d = _nb_dummies()[0]
                    _nb_small("rms_norm", x.size, n_threads)(
                        x.reshape(sh4), d, False, weight.reshape(1, 1, 1, n), True, d, False, eps, d, y.reshape(sh4))
                    return y
    return _rms_norm_general(x, None, weight, eps, bias, out, _dispatch.resolve(isa), fused, n_threads)


def add_rms_norm(x, residual, weight=None, *, eps, bias=None, out=None, isa=None, fused=True, n_threads=None):
    """The pre-norm residual pattern (docs/semantics.md §3, §5): h = x + residual, y = rms_norm(h) * weight
    (+ bias), computed with one sweep that writes h and sums its squares, then one that writes y.
    Returns (h, y). residual, weight and bias tile x by modulo (ggml_can_repeat).
    out: optional (h_out, y_out); h_out may be x or residual itself (in-place residual update).
    """
    # lean path: 1-D/2-D C-contiguous x and residual of one shape, a 1-D row weight, outputs new or
    # C-contiguous, h_out = x or residual exactly or sharing no byte with them (y_out shares none with
    # anything): exact pointer-range tests. Anything else, and every error, goes the long way.
    if (type(x) is _ndarray and type(residual) is _ndarray and type(weight) is _ndarray and bias is None
            and fused is True and type(eps) is float and (n_threads is None or type(n_threads) is int and 0 < n_threads <= _MAXT)):
        fn = _lean_fn(_RMS_FN, isa)
        sh = x.shape
        dp = _RN_DESCS.get(sh)
        if dp is None and fn is not None and 0 < len(sh) <= 2 and x.size:
            dp = _lean_desc(_RN_DESCS, sh, lambda r, n: rms_desc(_rows_geom(r, n), _rows_geom(r, n), _rows_geom(r, n),
                                                                 _rows_geom(r, n), ((1, 1, 1, n), [0, 0, 0, 1]), None))
        if (dp is not None and fn is not None and x.dtype is F32 and residual.dtype is F32 and weight.dtype is F32
                and residual.shape == sh and weight.shape == sh[-1:] and eps >= 0.0
                and x.flags.aligned and residual.flags.aligned and weight.flags.aligned):
            if out is None:
                h, y = _empty(sh, F32), _empty(sh, F32)
            elif type(out) is tuple and len(out) == 2:
                h, y = out
                if not (type(h) is _ndarray and type(y) is _ndarray and h.dtype is F32 and y.dtype is F32
                        and h.shape == sh and y.shape == sh and h.flags.behaved and y.flags.behaved):
                    h = None
            else:
                h = None
            if h is not None:
                try:
                    xb, rb, wb, hb, yb = (_fb(_T_F32, x), _fb(_T_F32, residual), _fb(_T_F32, weight), _fb(_T_F32, h),
                                          _fb(_T_F32, y))
                except (ValueError, TypeError, BufferError):
                    xb = None  # not C-contiguous
                if xb is not None:
                    L, n = len(xb), sh[-1]
                    y0, h0 = yb + 0, hb + 0
                    try:
                        ok = out is None or not (
                            -L < y0 - xb < L or -L < y0 - rb < L or -L < y0 - wb < n or -L < y0 - hb < L
                            or -L < h0 - wb < n or h is not x and -L < h0 - xb < L
                            or h is not residual and -L < h0 - rb < L)
                    except ValueError:
                        ok = False
                    if ok:
                        fn(dp, xb, rb, wb, _NULL, eps, hb, yb, n_threads or _thr[0])
                        return h, y
    if not isinstance(residual, _ndarray):
        raise TypeError(f"residual must be a numpy.ndarray of float32, got {type(residual).__name__}")
    return _rms_norm_general(x, residual, weight, eps, bias, out, _dispatch.resolve(isa), fused, n_threads)


def _rms_norm_general(x, residual, weight, eps, bias, out, isa, fused, n_threads=None):
    _check_f32(x, "x")
    eps = _check_eps(eps)
    shape = x.shape
    x4 = _pad4(_aligned(x))
    w4 = _check_tiled(weight, "weight", shape) if weight is not None else None
    if bias is not None:
        if weight is None:
            raise ValueError("bias requires a weight (RMS_NORM+MUL+ADD; there is no RMS_NORM+ADD fusion), "
                             "got bias with weight=None")
        b4 = _check_tiled(bias, "bias", shape)
    else:
        b4 = None
    r4 = _check_tiled(residual, "residual", shape) if residual is not None else None
    if residual is not None:
        if out is None:
            h_out, y_out = np.empty(shape, F32), np.empty(shape, F32)
        else:
            if not isinstance(out, tuple) or len(out) != 2:
                raise TypeError("out must be a tuple (h_out, y_out) for add_rms_norm, got "
                                + (f"a tuple of length {len(out)}" if isinstance(out, tuple) else type(out).__name__))
            h_out, y_out = out
            _check_out(h_out, shape, "out[0] (h)")
            _check_out(y_out, shape, "out[1] (y)")
            _check_no_overlap(y_out, (("x", x), ("residual", residual), ("weight", weight),
                                      ("bias", bias), ("out[0]", h_out)), name="out[1] (y)")
            for nm, a in (("weight", weight), ("bias", bias)):
                _check_no_overlap(h_out, ((nm, a),), name="out[0] (h)")
            for nm, a in (("x", x), ("residual", residual)):
                if a is not None and np.may_share_memory(h_out, a) and not (
                        _same_view(h_out, a) and a.shape == shape):
                    raise ValueError(f"out[0] (h) must be {nm!r} itself (in place) or not overlap it, got an "
                                     f"array partially overlapping {nm!r}")
    else:
        h_out = None
        if out is None:
            y_out = np.empty(shape, F32)
        else:
            y_out = out
            _check_out(y_out, shape)
            _check_no_overlap(y_out, (("x", x), ("weight", weight), ("bias", bias)),
                              alias_ok=x if (weight is None and bias is None) else None)
    if x.size == 0:
        return (h_out, y_out) if residual is not None else y_out
    y4 = _pad4(y_out)
    h4 = _pad4(h_out) if h_out is not None else None

    if isa == "numba":
        dummy = _nb_dummies()[0]  # never written: h is written only with a residual
        _nb_small("rms_norm", x.size, n_threads)(
            x4, r4 if r4 is not None else dummy, r4 is not None, w4 if w4 is not None else dummy, w4 is not None,
            b4 if b4 is not None else dummy, b4 is not None, eps, h4 if h4 is not None else dummy, y4)
    else:
        g = lambda a: _geom4(a) if a is not None else None  # noqa: E731
        dp = _desc(rms_desc(_geom4(x4), _geom4(y4), g(h4), g(r4), g(w4), g(b4)))
        fn = _kernel("rms_norm" if fused else "rms_norm_unfused", isa)
        fn(dp, _ptr(x4), _ptr(r4) if r4 is not None else _NULL,
           _ptr(w4) if w4 is not None else _NULL, _ptr(b4) if b4 is not None else _NULL, eps,
           _ptr(h4, writable=True) if h4 is not None else _NULL, _ptr(y4, writable=True),
           _dispatch.threads(n_threads))
    return (h_out, y_out) if residual is not None else y_out
