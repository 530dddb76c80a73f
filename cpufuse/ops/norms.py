"""rms_norm and add_rms_norm (ggml RMS_NORM [-> MUL [-> ADD]], and the pre-norm residual
pattern): the declarations of their operands (binder.py), the checks, which make their entries, and the
call."""
import numpy as np

from .. import _dispatch, _registry
from .._layouts import RN
from .binder import Binder, In, Out, Param
from .checks import (
    F32, _aligned, _check_eps, _check_f32, _check_no_overlap, _check_out, _check_tiled, _geom4, _kernel, _ndarray,
    _pad4, _rows_geom, _same_view, _thr)


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

_RN = Binder("rms_norm", (In("x", F32), In("weight", F32, optional=True), In("bias", F32, optional=True),
                          Out("out", F32, alias=("x",))),
             (Param("eps", passed=True), Param("fused")))
_ADD = Binder("add_rms_norm", (In("x", F32), In("residual", F32), In("weight", F32, optional=True),
                               In("bias", F32, optional=True), Out("h", F32, alias=("x", "residual")), Out("y", F32)),
              (Param("eps", passed=True), Param("fused"), Param("out_type")))
_rn_fast, _add_fast = _RN.fast, _ADD.fast


def rms_norm(x, weight=None, *, eps, bias=None, out=None, isa=None, fused=True, n_threads=None):
    """ggml RMS_NORM (+MUL, +MUL+ADD) fused (docs/semantics.md §3): y = (x * s) * weight + bias per row, with
    s = 1/sqrt(mean(x^2) + eps). weight and bias tile x by modulo in every dim (ggml_can_repeat),
    including the last when it divides the row length. The fused result is bit-identical to
    RMS_NORM followed by MUL (and ADD). out may be x only without weight and bias.
    fused=False runs the unfused chain (norm = sum of squares + copy + scale, then MUL, then ADD).
    """
    r = _rn_fast(x, weight, bias, out, eps, fused, isa, n_threads)
    if r is not None:
        return r[0]
    return _rms_norm_general(x, None, weight, eps, bias, out, isa, fused, n_threads)


def _plan_rows(isa, sh, n_threads):
    """rms_norm's entry for C-contiguous 1-D/2-D x with a 1-D row weight, fused, no bias"""
    n = sh[-1]
    rows = sh[0] if len(sh) == 2 else 1
    fn = _kernel("rms_norm_rows", isa, n_threads)

    def launch(x, weight, bias, y, eps, nt):
        return fn(rows, n, x, weight, eps, y, nt or _thr[0])  # (a native entry also tests the overlaps: 1 or 2)
    return launch, _registry.convention(isa).arrays, (sh,)


def add_rms_norm(x, residual, weight=None, *, eps, bias=None, out=None, isa=None, fused=True, n_threads=None):
    """The pre-norm residual pattern (docs/semantics.md §3, §5): h = x + residual, y = rms_norm(h) * weight
    (+ bias), computed with one sweep that writes h and sums its squares, then one that writes y.
    Returns (h, y). residual, weight and bias tile x by modulo (ggml_can_repeat).
    out: optional (h_out, y_out); h_out may be x or residual itself (in-place residual update).
    """
    if out is None or type(out) is tuple and len(out) == 2:
        h, y = out or (None, None)
        r = _add_fast(x, residual, weight, bias, h, y, eps, fused, type(out), isa, n_threads)
        if r is not None:
            return r
    if not isinstance(residual, _ndarray):
        raise TypeError(f"residual must be a numpy.ndarray of float32, got {type(residual).__name__}")
    return _rms_norm_general(x, residual, weight, eps, bias, out, isa, fused, n_threads)


def _plan_add(isa, sh, n_threads):
    """add_rms_norm's entry for C-contiguous 1-D/2-D x and residual of one shape with a 1-D row weight,
    fused, no bias"""
    conv = _registry.convention(isa)
    fn = _kernel("rms_norm", isa, n_threads)
    n = sh[-1]
    g = _rows_geom(sh[0] if len(sh) == 2 else 1, n)
    dp = conv.desc(rms_desc(g, g, g, g, ((1, 1, 1, n), [0, 0, 0, 1]), None))

    def launch(x, residual, weight, bias, h, y, eps, nt):
        fn(dp, x, residual, weight, bias, eps, h, y, nt or _thr[0])
    return launch, conv.arrays, (sh, sh)


def _rms_norm_general(x, residual, weight, eps, bias, out, isa_arg, fused, n_threads):
    """the checks of both ops, then the call (through the binder when the call has an entry)"""
    isa = _dispatch.resolve(isa_arg)
    _check_f32(x, "x")
    plain = type(eps) is float  # an entry passes eps to the kernel as given
    eps_arg, eps = eps, _check_eps(eps)
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
        if out is not None:
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
        if out is not None:
            y_out = out
            _check_out(y_out, shape)
            _check_no_overlap(y_out, (("x", x), ("weight", weight), ("bias", bias)),
                              alias_ok=x if (weight is None and bias is None) else None)
    n_th = _dispatch.threads(n_threads)
    if (plain and fused and bias is None and weight is not None and weight.shape == shape[-1:] and 0 < len(shape) <= 2
            and x.size and (residual is None or residual.shape == shape)):
        if residual is None:
            r = _RN.plan(_plan_rows(isa, shape, n_threads), x, weight, bias, out, eps_arg, fused, isa_arg, n_threads)
            if r is not None:
                return r[0]
        else:
            h, y = out or (None, None)
            r = _ADD.plan(_plan_add(isa, shape, n_threads), x, residual, weight, bias, h, y, eps_arg, fused, type(out),
                          isa_arg, n_threads)
            if r is not None:
                return r
    if out is None:
        y_out = np.empty(shape, F32)
        if residual is not None:
            h_out = np.empty(shape, F32)
    if x.size == 0:
        return (h_out, y_out) if residual is not None else y_out
    y4 = _pad4(y_out)
    h4 = _pad4(h_out) if h_out is not None else None

    conv = _registry.convention(isa)
    P = conv.operand
    g = lambda a: _geom4(a) if a is not None else None  # noqa: E731
    dp = conv.desc(rms_desc(_geom4(x4), _geom4(y4), g(h4), g(r4), g(w4), g(b4)))
    _kernel("rms_norm" if fused else "rms_norm_unfused", isa, n_threads)(dp, P(x4), P(r4), P(w4), P(b4), eps, P(h4),
                                                                         P(y4), n_th)
    return (h_out, y_out) if residual is not None else y_out
