"""Fused dequantize x matmul on GGUF weights: `matmul`, `matmul_multi`, `matmul_swiglu`.

y = x . dequant(W)^T, where W is a `QTensor` (the GGUF bytes, never dequantized to memory).
Two activation modes (docs/quant-design.md):
  act="q8"  : activations quantized per 32/256-element block as ggml does (Q8_0, Q8_1 or Q8_K by the
              weight's vec_dot type), integer block dot products (the default: it is what llama.cpp
              computes, and the faster mode; see README "Quantized matmul");
  act="f32" : f32 activations, exact to float64 up to the f32 summation order.
Fusions: an RMS_NORM x w prologue (norm_weight=, eps=) that normalizes and quantizes each row in
one pass; several weights sharing one activation quantization (matmul_multi, e.g. Q, K, V); gate
and up products with the SwiGLU in the epilogue (matmul_swiglu), the two products never stored.
"""
import itertools

import numpy as np

from .. import _dispatch, _registry
from .._layouts import QM
from ..ops import checks as _ops
from ..ops import binder as _binder
from ..ops.binder import Binder, In, InOut, Out, Param, Weight
from .types import ACT_QTYPES, QTensor

ffi = _binder.ffi  # (cffi's own where the extension is absent: _wptr's pointers serve the overlap tests)
F32 = np.dtype(np.float32)
ACT_MODES = ("q8", "f32")
DEFAULT_ACT = "q8"
_LAYOUT = {"gguf": 0, "p16": 1}   # QW_LAY
_ERRORS = {1: "unsupported weight type for this kernel", 2: "out of memory (scratch allocation)"}


def _check_x(x, n_in, name="x"):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of float32, got {type(x).__name__}")
    if x.dtype != F32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"{name} must have at least 1 dimension, got a 0-d array")
    if x.shape[-1] != n_in:
        raise ValueError(f"{name} must have last dimension n_in={n_in} (the weight's), got shape {x.shape}")
    return _rows(x, n_in)


def _rows(a, n):
    """a read-only input as (rows, n) with a unit-stride last axis, aligned: a view when the
    leading axes allow it, else a copy (the input is never written)"""
    a2 = a.reshape(-1, n)
    if a2.size and a2.strides[-1] != 4 and n > 1:
        a2 = np.ascontiguousarray(a2)
    if a2.shape[0] > 1 and a2.strides[0] % 4:
        a2 = np.ascontiguousarray(a2)
    return a2 if a2.flags.aligned else np.require(a2, requirements="A")   # kernels read typed floats


def _check_residual(r, shape):
    if not isinstance(r, np.ndarray):
        raise TypeError(f"residual must be a numpy.ndarray of float32, got {type(r).__name__}")
    if r.dtype != F32:
        raise TypeError(f"residual must be float32 (the output's dtype), got {r.dtype}")
    if r.shape != shape:
        raise ValueError(f"residual must have the output's shape {shape} (x's leading axes, n_out), "
                         f"got {r.shape}")
    return _rows(r, shape[-1])


def _check_w(w, name):
    if not isinstance(w, QTensor):
        raise TypeError(f"{name} must be a cpufuse.QTensor, got {type(w).__name__}")
    if w.n_expert:
        raise ValueError(f"{name} must be a 2-D QTensor (n_out, n_in), got a 3-D expert tensor {w.shape}: "
                         f"take one expert ({name}[e]) or route rows with Graph.qmatmul_id")
    return w


def _check_act(act):
    if act is None:
        return DEFAULT_ACT
    if act not in ACT_MODES:
        raise ValueError(f"act must be one of {ACT_MODES} or None, got {act!r}")
    return act


def _check_out(out, shape, name):
    _ops._check_out(out, shape, name)  # type, dtype, shape, writeable, unit-stride last axis
    n = shape[-1]
    try:
        o2 = out.view()
        o2.shape = (-1, n)  # raises instead of copying when the leading axes do not merge
    except AttributeError:
        raise ValueError(f"{name} must be viewable as (rows, {n}) without a copy (merge-able leading "
                         f"axes), got strides {out.strides}") from None
    if o2.size and ((o2.strides[-1] != 4 and n > 1) or (o2.shape[0] > 1 and o2.strides[0] % 4)):
        raise ValueError(f"{name} must have a unit-stride last axis, got strides {out.strides}")
    return o2


def _check_norm(norm_weight, eps, n_in):
    if norm_weight is None and eps is None:
        return None, 0.0, 0
    if eps is None:
        raise ValueError("eps must be given with norm_weight (the RMS_NORM epsilon, e.g. 1e-5), got eps=None")
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.floating, np.integer)):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    if not float(eps) >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if norm_weight is not None:
        if not isinstance(norm_weight, np.ndarray) or norm_weight.dtype != F32:
            raise TypeError(f"norm_weight must be a float32 numpy.ndarray, got "
                            f"{getattr(norm_weight, 'dtype', type(norm_weight).__name__)}")
        if norm_weight.shape != (n_in,):
            raise ValueError(f"norm_weight must have shape ({n_in},), got {norm_weight.shape}")
        norm_weight = np.ascontiguousarray(norm_weight)
    return norm_weight, float(eps), 1


def _no_overlap(outs, ins):
    for oname, o in outs:
        for iname, a in ins:
            if a is not None and np.may_share_memory(o, a):
                raise ValueError(f"{oname} must not share memory with an input, got an array that overlaps "
                                 f"the input {iname!r}")


def qm_desc(rows, K, xs, q8, epi, norm, ws, ys, rs=0, scale=None):
    """cf_qmatmul_f32's descriptor (QM / QW of cpufuse._layouts) as a list: rows x K activations of
    row stride xs, q8 or f32, epilogue epi (1: SwiGLU, 2: residual add of row stride rs, 5: the same
    with the product times scale first, 6: the product times scale), norm (1: the RMS_NORM prologue),
    the weights ws (QTensors) and each one's output row stride ys[i]"""
    rsc = 0 if scale is None else int(np.array(scale, np.float32).view(np.uint32))
    return QM.pack(ROWS=rows, K=K, XS=xs, ACT=1 if q8 else 0, NW=len(ws), EPI=epi, NORM=norm, RS=rs, RSC=rsc,
                   tail=[dict(T=w.type_id, N=w.shape[0], WS=w.row_bytes, YS=y, LAY=_LAYOUT[w.layout])
                         for w, y in zip(ws, ys)])


def _run(x, ws, names, act, outs, isa, n_threads, norm_weight, eps, epi, lead, residual=None, plan=None):
    """the checks, then the call (through the op's binder when the call has an entry; plan: (the
    binder's form for _plan, its Binder.plan with the call's arguments bound), or None)"""
    plain = eps is None or type(eps) is float  # a plan passes eps to the kernel as given
    n_in = ws[0].shape[1]
    for w, nm in zip(ws, names):
        _check_w(w, nm)
        if w.shape[1] != n_in:
            raise ValueError(f"{nm} has n_in={w.shape[1]}, but {names[0]} has n_in={n_in}; the weights "
                             f"must share the activation")
    x2 = _check_x(x, n_in)
    act = _check_act(act)
    nw_arr, eps_f, do_norm = _check_norm(norm_weight, eps, n_in)
    isa = _dispatch.resolve(isa)
    nth = _dispatch.threads(n_threads)
    rows = x2.shape[0]
    n_out = [w.shape[0] for w in ws] if epi == 0 else [ws[0].shape[0]]
    ys, y2 = [], []
    for i, n in enumerate(n_out):
        shape = lead + (n,)
        oname = "out" if len(n_out) == 1 else f"out[{i}]"
        o = outs[i] if outs is not None else None
        if o is None:
            o = np.empty(shape, F32)
        o2 = _check_out(o, shape, oname)
        ys.append(o)
        y2.append(o2)
    ins = [("x", x), ("norm_weight", norm_weight)] + [(nm, w.raw) for w, nm in zip(ws, names)]
    _no_overlap([(f"out[{i}]" if len(ys) > 1 else "out", o) for i, o in enumerate(ys)], ins)
    r2 = None
    if epi == 2:   # y = residual + product: out may be residual itself (each element read, then written)
        r2 = _check_residual(residual, ys[0].shape)
        _no_overlap([("residual", residual)], ins)
        _ops._check_no_overlap(ys[0], [("residual", residual)], alias_ok=residual)
    if len(ys) > 1:
        for i in range(len(ys)):
            for j in range(i):
                if np.may_share_memory(ys[i], ys[j]):
                    raise ValueError(f"out[{i}] must not overlap out[{j}], got arrays sharing memory")
    if rows == 0 or any(n == 0 for n in n_out):
        return ys
    if plan is not None and plain and len(lead) <= 1:
        form, bind = plan
        y = bind(_plan(form, ws, x.shape, act, epi, do_norm, isa, n_threads))
        if y is not None:
            return y[:len(n_out)]
    conv = _registry.convention(isa)
    P, null = conv.operand, conv.null
    d = conv.desc(qm_desc(rows, n_in, x2.strides[0] // 4 if rows > 1 else n_in, act == "q8", epi, do_norm, ws,
                          [(y2[i] if i < len(y2) else y2[0]).strides[0] // 4 if rows > 1 else w.shape[0]
                           for i, w in enumerate(ws)], r2.strides[0] // 4 if r2 is not None and rows > 1 else 0))
    for w in ws:
        _wptr(w)  # (a native entry reads a weight's bytes through the pointer kept there)
    wp = [P(w) for w in ws] + [null] * (3 - len(ws))
    yp = [P(o) for o in y2] + [null] * (3 - len(y2))
    rc = _registry.kernel("qmatmul", isa, n_threads)(d, P(x2), P(nw_arr), eps_f, wp[0], wp[1], wp[2], yp[0], yp[1],
                                                     yp[2], P(r2), nth)
    if rc:
        raise RuntimeError(f"cpufuse.matmul: the {isa} kernel failed: {_ERRORS.get(rc, rc)}")
    return ys


def _wptr(w):
    """w's bytes as seen by the kernels, made once per weight: (cffi pointer, address, end address,
    the number of its geometry (type, shape, row bytes, layout: what a binder's key holds of a weight),
    float pointer, length in floats rounded up (the overlap tests: exact for float arrays, which are
    4-byte aligned))"""
    c = w._c
    if c is None:
        b = ffi.from_buffer(w.raw)
        a = int(ffi.cast("intptr_t", b))
        g = (w.type_id, w.shape, w.row_bytes, w.layout)
        c = (b, a, a + w.nbytes, _GEOMS.setdefault(g, next(_GEOM_IDS)), ffi.cast("float *", b), -(-w.nbytes // 4))
        object.__setattr__(w, "_c", c)
    return c


_GEOMS = {}  # a weight geometry -> its number (a key holds the number: an int hashes at no cost)
_GEOM_IDS = itertools.count()  # (next() is atomic: two threads never give two geometries one number)


_SERIAL_MACS = 1 << 16  # entries, default threads: products of at most this many multiply-adds run on one thread
_thr = _dispatch._threads

_MM = Binder("matmul", (In("x", F32), Weight("w"), In("norm_weight", F32, optional=True),
                        InOut("residual", F32, optional=True), Out("out", F32, alias=("residual",))),
             (Param("act"), Param("eps", passed=True)))
_MULTI = Binder("matmul_multi", (In("x", F32), Weight("w0"), Weight("w1", optional=True), Weight("w2", optional=True),
                                 In("norm_weight", F32, optional=True), Out("out0", F32), Out("out1", F32),
                                 Out("out2", F32)),
                (Param("act"), Param("eps", passed=True), Param("out_type")))
_SWIGLU = Binder("matmul_swiglu", (In("x", F32), Weight("w_gate"), Weight("w_up"),
                                   In("norm_weight", F32, optional=True), Out("out", F32)),
                 (Param("act"), Param("eps", passed=True)))
_mm_fast, _multi_fast, _swiglu_fast = _MM.fast, _MULTI.fast, _SWIGLU.fast


def _plan(form, ws, sh, act, epi, do_norm, isa, n_threads):
    """the entry of a checked call with 1-D or 2-D x, for the binder `form` ("matmul",
    "multi" or "swiglu"; epi 2 is matmul's residual): (launch, arrays, new shapes)"""
    conv = _registry.convention(isa)
    fn, null = _registry.kernel("qmatmul", isa, n_threads), conv.null
    for w in ws:
        _wptr(w)  # (the key holds each weight's geometry from its _c)
    w0 = ws[0]
    K = w0.n_in
    nd = len(sh)
    rows = sh[0] if nd == 2 else 1
    n_out = tuple(w.n_out for w in ws) if not epi else (w0.n_out,)
    new = tuple((rows, n) if nd == 2 else (n,) for n in n_out)
    d = conv.desc(qm_desc(rows, K, K, act == "q8", epi, do_norm, ws,
                          [n_out[i if not epi else 0] for i in range(len(ws))], w0.n_out if epi == 2 else 0))
    # default thread count: one thread for a product too small to pay for waking the pool (results are
    # the same for every thread count)
    nt = n_threads or (1 if rows * K * sum(w.n_out for w in ws) <= _SERIAL_MACS else None)

    def failed(rc):
        raise RuntimeError(f"cpufuse.matmul: the {isa} kernel failed: {_ERRORS.get(rc, rc)}")

    if form == "matmul":
        def launch(x, w, nw, res, y, eps, _):
            rc = fn(d, x, nw, eps if do_norm else 0.0, w, null, null, y, null, null, res, nt or _thr[0])
            if rc:
                failed(rc)
    elif form == "multi":
        def launch(x, w0, w1, w2, nw, y0, y1, y2, eps, _):
            rc = fn(d, x, nw, eps if do_norm else 0.0, w0, w1, w2, y0, y1, y2, null, nt or _thr[0])
            if rc:
                failed(rc)
        new += (None,) * (3 - len(new))
    else:
        def launch(x, wg, wu, nw, y, eps, _):
            rc = fn(d, x, nw, eps if do_norm else 0.0, wg, wu, null, y, null, null, null, nt or _thr[0])
            if rc:
                failed(rc)
    return launch, conv.arrays, new


def matmul(x, w, *, act=None, out=None, isa=None, n_threads=None, norm_weight=None, eps=None, residual=None):
    """y = x . dequant(w)^T for a QTensor w of shape (n_out, n_in); x float32 (..., n_in).

    act: "q8" (ggml's activation quantization and integer dots; the default) or "f32".
    norm_weight, eps: fuse RMS_NORM(x) * norm_weight in front (norm_weight None with eps given:
    RMS_NORM alone); the normalized rows are quantized in the same pass and never returned.
    residual: optional float32 (..., n_out) added in the epilogue, y = residual + x . dequant(w)^T
    (bit for bit what `residual + matmul(x, w)` gives; the product is never stored); out=residual
    updates it in place.
    out: optional float32 (..., n_out) output. Returns the result."""
    r = _mm_fast(x, w, norm_weight, residual, out, act, eps, isa, n_threads)
    if r is not None:
        return r[0]
    return _run(x, (w,), ("w",), act, None if out is None else [out], isa, n_threads, norm_weight, eps,
                0 if residual is None else 2, _lead(x), residual,
                ("matmul", lambda made: _MM.plan(made, x, w, norm_weight, residual, out, act, eps, isa, n_threads)))[0]


def matmul_multi(x, ws, *, act=None, out=None, isa=None, n_threads=None, norm_weight=None, eps=None):
    """Several weights (1 to 3, e.g. Q, K and V) on one activation, quantized (and normalized) once.
    Returns a tuple of outputs, one per weight; `out` may be a sequence of preallocated outputs."""
    if not isinstance(ws, (tuple, list)) or not 1 <= len(ws) <= 3:
        raise ValueError(f"ws must be a tuple of 1 to 3 QTensors, got {type(ws).__name__}"
                         + (f" of length {len(ws)}" if isinstance(ws, (tuple, list)) else ""))
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != len(ws)):
        raise ValueError(f"out must be a sequence of {len(ws)} arrays (one per weight) or None, got "
                         + (f"{len(out)} arrays" if isinstance(out, (tuple, list)) else type(out).__name__))
    ws = tuple(ws)
    n = len(ws)
    w0, w1, w2 = ws + (None,) * (3 - n)
    o0, o1, o2 = (None,) * 3 if out is None else tuple(out) + (None,) * (3 - n)
    r = _multi_fast(x, w0, w1, w2, norm_weight, o0, o1, o2, act, eps, type(out), isa, n_threads)
    if r is not None:
        return r[:n]

    def bind(made):
        return _MULTI.plan(made, x, w0, w1, w2, norm_weight, o0, o1, o2, act, eps, type(out), isa, n_threads)
    return tuple(_run(x, ws, tuple(f"ws[{i}]" for i in range(n)), act, out, isa, n_threads, norm_weight, eps, 0,
                      _lead(x), None, ("multi", bind)))


def matmul_swiglu(x, w_gate, w_up, *, act=None, out=None, isa=None, n_threads=None, norm_weight=None, eps=None):
    """silu(x . Wg^T) * (x . Wu^T) in one kernel: both products of an output are computed together
    and combined in the epilogue; neither is stored. Wg and Wu must have the same shape."""
    r = _swiglu_fast(x, w_gate, w_up, norm_weight, out, act, eps, isa, n_threads)
    if r is not None:
        return r[0]
    _check_w(w_gate, "w_gate")
    _check_w(w_up, "w_up")
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate and w_up must have the same shape, got {w_gate.shape} and {w_up.shape}")
    return _run(x, (w_gate, w_up), ("w_gate", "w_up"), act, None if out is None else [out], isa, n_threads,
                norm_weight, eps, 1, _lead(x), None,
                ("swiglu", lambda made: _SWIGLU.plan(made, x, w_gate, w_up, norm_weight, out, act, eps, isa,
                                                     n_threads)))[0]


def matmul_geglu(x, w_gate, w_up, *, act=None, out=None, isa=None, n_threads=None, norm_weight=None, eps=None):
    """gelu(x . Wg^T) * (x . Wu^T) in one kernel (GEGLU, the tanh-form GELU of docs/semantics.md
    §5): matmul_swiglu with GELU in place of SiLU (epilogue 3). Wg and Wu must have the same shape."""
    _check_w(w_gate, "w_gate")
    _check_w(w_up, "w_up")
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate and w_up must have the same shape, got {w_gate.shape} and {w_up.shape}")
    lead = _lead(x)
    return _run(x, (w_gate, w_up), ("w_gate", "w_up"), act, None if out is None else [out], isa, n_threads,
                norm_weight, eps, 3, lead, None, None)[0]


def _lead(x):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"x must be a numpy.ndarray of float32, got {type(x).__name__}")
    if x.ndim < 1:
        raise ValueError("x must have at least 1 dimension, got a 0-d array")
    return x.shape[:-1]


def quantize_act(x, vtype, isa=None):
    """The activation blocks ggml's vec_dot would use (vtype "Q8_0", "Q8_1" or "Q8_K"), as GGUF block
    bytes of shape (rows, blocks*bytes): what the q8 mode computes with (for tests and inspection)."""
    if vtype not in ACT_QTYPES:
        raise ValueError(f"vtype must be one of {tuple(ACT_QTYPES)}, got {vtype!r}")
    _, vid, blk, nb, _ = ACT_QTYPES[vtype]
    if not isinstance(x, np.ndarray) or x.dtype != F32 or x.ndim != 2:
        raise TypeError("x must be a 2-D float32 numpy.ndarray, got "
                        + (f"{x.dtype} of shape {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__))
    if x.shape[1] % blk:
        raise ValueError(f"x: n_in={x.shape[1]} is not a multiple of the {vtype} block size {blk}")
    isa = _dispatch.resolve(isa)
    P = _registry.convention(isa).operand
    x = np.ascontiguousarray(x)
    out = np.empty((x.shape[0], x.shape[1] // blk * nb), np.uint8)
    _registry.kernel("quantize_act", isa)(vid, x.shape[0], x.shape[1], P(x), x.shape[1], P(out))
    return out
