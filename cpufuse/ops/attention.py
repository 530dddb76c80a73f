"""Public ops: argument checking, output allocation, and the call into the chosen path.

Every check raises TypeError (wrong type/dtype) or ValueError (shape, stride, parameter) naming the
argument. The common decode/prefill call of rms_norm (2-D contiguous x, 1-D weight) takes a lean
path with a single cffi call; everything else builds an int64 descriptor of shapes and strides.
"""
import functools
import math
import numbers as _numbers

import numpy as np

from .. import _backend, _dispatch, _registry
from ..reference.ops import alibi_slopes as _alibi_slopes_f32

ffi, lib = _backend.ffi, _backend.lib
F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
I64 = np.dtype(np.int64)
_ndarray = np.ndarray
_threads = _dispatch.threads
_ctx_get = _dispatch._ctx.get
_empty = np.empty

# cffi types resolved once
if ffi is not None:
    _T_F32 = ffi.typeof("float[]")
    _T_I64 = ffi.typeof("int64_t[]")
    _T_CHAR = ffi.typeof("char[]")
    _fb = ffi.from_buffer
    _cast = ffi.cast
    _new = ffi.new
    _NULL = ffi.NULL

# lean-path kernels by ISA name (the registry's tables: native ISAs usable here, and numba once loaded)
_RMS_ROWS = _registry.table("rms_norm_rows")
_RMS_FN = _registry.table("rms_norm")
_SM_FN = _registry.table("softmax")
_FA_FN = _registry.table("flash_attn")
_kernel = _registry.kernel
_thr = _dispatch._threads  # [default thread count]
_MAXT = _dispatch.MAX_THREADS  # a larger n_threads goes the long way, which refuses it
_NB_SMALL = 1 << 15  # calls of at most this many elements take the serial Numba kernels (no parallel start-up)


def _lean_fn(table, isa):
    """the native kernel of a lean path: table[isa or the ISA in force], or None (numba, an unknown
    name: the long way resolves and checks it)"""
    i = isa or _ctx_get() or _dispatch.DEFAULT
    return None if i == "numba" else table.get(i)
_SM_DESCS, _RN_DESCS, _FA_LEAN = {}, {}, {}  # lean-path descriptors (cffi int64 arrays, read-only) by shape


def _lean_desc(cache, sh, build, key=None):
    """the descriptor for a C-contiguous array of shape sh (1-D or 2-D): build(rows, n), cached
    under key (default: sh)"""
    if len(cache) >= 256:
        cache.clear()
    d = cache[sh if key is None else key] = _desc(build(sh[0] if len(sh) == 2 else 1, sh[-1]))
    return d


def _rows_geom(rows, n):
    """the 4-D geometry of a C-contiguous (rows, n) array"""
    return (1, 1, rows, n), [0, 0, n, 1]


# Overlap tests of the lean paths, on from_buffer pointers of C-contiguous operands: the float ranges
# [a, a + na) and [b, b + nb) share a byte iff -nb < (b + 0) - a < na. cffi refuses (ValueError) to
# subtract pointers that are not a whole number of floats apart; such a call goes the long way.
# An f16 mask is compared in bytes, on char pointers.


def _nb_small(op, n, n_threads):
    """the Numba kernel of op for a call of n elements: its serial twin when n is small (no parallel
    start-up), with numba's thread count set for this call"""
    return _kernel(op + "_serial" if n <= _NB_SMALL else op, "numba", n_threads)


@functools.lru_cache(maxsize=1)
def _nb_dummies():
    """the 1-element stand-ins for absent optional operands of the Numba kernels (never written)"""
    return np.zeros((1, 1, 1, 1), F32), np.zeros((1, 1, 1, 1), np.uint16), np.zeros(1, F32)


@functools.lru_cache(maxsize=256)
def _slopes(n_head, max_bias):
    s = _alibi_slopes_f32(n_head, max_bias)
    if s is not None:
        s.setflags(write=False)
    return s


# ------------------------------------------------------------------------------------------------
# argument checks

def _check_f32(a, name, ndim_max=4):
    if type(a) is not _ndarray and not isinstance(a, _ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of float32, got {type(a).__name__}")
    if a.dtype != F32:
        raise TypeError(f"{name} must be float32, got {a.dtype}")
    if a.ndim == 0:
        raise ValueError(f"{name} must have at least 1 dimension, got a 0-d array")
    if a.ndim > ndim_max:
        raise ValueError(f"{name} must have at most {ndim_max} dimensions, got {a.ndim}")
    _check_last_axis(a, name)


def _aligned(a):
    """a itself, or an aligned copy of a whose address (or a stride) is not a multiple of its item
    size: the kernels read elements through typed pointers, undefined behaviour when misaligned.
    Misaligned arrays come only from views of byte buffers (np.frombuffer with an offset, .view of
    a uint8 slice); the copy costs what reading them would."""
    return a if a is None or a.flags.aligned else np.require(a, requirements="A")


def _check_aligned_out(out, name):
    if not out.flags.aligned:
        raise ValueError(f"{name} must be aligned to its {out.itemsize}-byte items (address and strides), got "
                         f"address {out.ctypes.data:#x} and strides {out.strides}; outputs are written in "
                         "place, so a misaligned one cannot be copied")


def _check_last_axis(a, name):
    if a.size == 0:  # numpy gives empty arrays arbitrary strides; nothing is read
        return
    st, it = a.strides, a.itemsize
    if st[-1] != it and a.shape[-1] > 1:
        raise ValueError(f"{name} must have a unit-stride last axis (stride {it} bytes), "
                         f"got stride {st[-1]}")
    for s in st:
        if s % it:
            raise ValueError(f"{name} must have strides that are multiples of its item size {it} bytes, "
                             f"got strides {st}")


def _pad4(a):
    return a.reshape((1,) * (4 - a.ndim) + a.shape) if a.ndim < 4 else a


def _geom4(a):
    """(shape, element strides) of `a` left-padded to 4-D, without making a view"""
    pad = 4 - a.ndim
    it = a.itemsize
    return (1,) * pad + a.shape, [0] * pad + [s // it for s in a.strides]


def _ptr(a, writable=False):
    """cffi pointer to a's first element (any strides)."""
    if a.flags.c_contiguous:
        t = _T_F32 if a.dtype == F32 else _T_CHAR
        return _fb(t, a, require_writable=writable) if writable else _fb(t, a)
    return _cast("void *", a.ctypes.data)


def _desc(vals):
    return _new(_T_I64, vals)


# Descriptor builders (layouts: native/kernels/common.h, flash_attn.inc). Each operand is given as
# its geometry: (4-D shape, 4-D element strides), as _geom4 returns; the graph planner uses these too.
def softmax_desc(xg, yg, mg, mkind):
    (S, H, R, C), xs = xg
    ys = yg[1]
    md = [mg[0][0], mg[0][1], mg[1][0], mg[1][1], mg[1][2], mkind] if mg else [1, 1, 0, 0, 0, 0]
    return [S, H, R, C, xs[0], xs[1], xs[2], ys[0], ys[1], ys[2]] + md


def rms_desc(xg, yg, hg, rg, wg, bg):
    def tile(g):
        return [1, 1, 1, 0, 0, 0] if g is None else [g[0][0], g[0][1], g[0][2], g[1][0], g[1][1], g[1][2]]
    xs, ys = xg[1], yg[1]
    hs = hg[1] if hg is not None else [0, 0, 0]
    return list(xg[0]) + [xs[0], xs[1], xs[2], ys[0], ys[1], ys[2], hs[0], hs[1], hs[2]] + tile(rg) + tile(wg) + tile(bg)


def fa_desc(qg, kg, vg, og, mg, mkind, kf16, vf16, strategy, chunk, q_tile):
    (S, Hq, N, DK), qs = qg
    (_, Hk, T, _), ks = kg
    (_, Hv, _, DV), vs = vg
    os_ = og[1]
    md = [mg[0][0], mg[0][1], mg[1][0], mg[1][1], mg[1][2], mkind] if mg else [1, 1, 0, 0, 0, 0]
    return ([S, Hq, N, DK, Hk, Hv, T, DV, qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
             int(kf16), int(vf16)] + md + [os_[0], os_[1], os_[2], STRATEGIES[strategy], chunk, q_tile])


def _check_out(out, shape, name="out"):
    if type(out) is not _ndarray and not isinstance(out, _ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of float32, got {type(out).__name__}")
    if out.dtype != F32:
        raise TypeError(f"{name} must be float32, got {out.dtype}")
    if out.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {out.shape}")
    if not out.flags.writeable:
        raise ValueError(f"{name} must be writeable, got a read-only array")
    _check_last_axis(out, name)
    _check_aligned_out(out, name)


def _same_view(a, b):
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.strides == b.strides and a.shape == b.shape)


def _check_no_overlap(out, others, alias_ok=None, name="out"):
    """out must not share memory with any input, except exactly aliasing `alias_ok` (in place)."""
    for arg_name, a in others:
        if a is None or not np.may_share_memory(out, a):
            continue
        if alias_ok is not None and a is alias_ok and _same_view(out, a):
            continue
        raise ValueError(f"{name} must not overlap the input {arg_name!r}, got an array sharing memory with it"
                         + ("; only exact in-place aliasing of x is allowed" if alias_ok is not None
                            else "; this op does not allow an output to alias its inputs"))


def _real(v, name):
    if type(v) is float:  # the common case, first
        return v
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, _numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    return float(v)


def _check_eps(eps):
    e = _real(eps, "eps")
    if not e >= 0.0:  # also rejects NaN
        raise ValueError(f"eps must be >= 0 (SPEC 2.1), got {eps!r}")
    return e


def _check_tiled(a, name, xshape):
    """weight / bias / residual: float32, every x dim a multiple of the operand's (ggml tiling)."""
    _check_f32(a, name)
    if a.ndim > len(xshape):
        raise ValueError(f"{name} must have at most {len(xshape)} dims (those of x, shape {xshape}), "
                         f"got {a.ndim} (shape {a.shape})")
    ash = (1,) * (len(xshape) - a.ndim) + a.shape
    for i, (n, m) in enumerate(zip(xshape, ash)):
        if (m == 0 and n != 0) or (m != 0 and n % m):
            raise ValueError(f"{name} shape {a.shape} cannot tile x shape {xshape}: dim {i - len(xshape)} "
                             f"of x ({n}) must be a multiple of {name}'s ({m})")
    if ash[-1] != xshape[-1] and ash[-1] != 0:
        # dim-0 tiling (SPEC 2.3): expand the row once; the kernels index rows by modulo
        a = np.tile(a.reshape(ash), (1,) * (len(ash) - 1) + (xshape[-1] // ash[-1],))
    return _pad4(_aligned(a))


def _check_mask_sinks(mask, max_bias, sinks, S, H, rows, cols, exact_cols, who):
    """mask (None or checked by _check_mask), ALiBi needing a mask, sinks (one per head):
    returns (4-D mask or None, mask kind 0/1/2, contiguous sinks or None)"""
    m4, mkind = _check_mask(mask, S, H, rows, cols, exact_cols, who) if mask is not None else (None, 0)
    if mask is None and max_bias > 0.0:
        raise ValueError(f"max_bias > 0 (ALiBi) requires a mask, got max_bias={max_bias} and mask=None")
    return m4, mkind, (_check_sinks(sinks, H) if sinks is not None else None)


def _check_mask(mask, S, H, rows, cols, exact_cols, who):
    """soft_max_ext / flash_attn_ext mask: f32 or f16, (mS, mH, mR, mC) left-padded, mR >= rows,
    columns == cols (softmax) or >= cols (attention: the first T are used), heads and sequences
    dividing the input's. Returns (4-D view, kind: 1 f32, 2 f16)."""
    if not isinstance(mask, _ndarray):
        raise TypeError(f"mask must be a numpy.ndarray of float16 or float32, got {type(mask).__name__}")
    if mask.dtype == F32:
        kind = 1
    elif mask.dtype == F16:
        kind = 2
    else:
        raise TypeError(f"mask must be float16 or float32, got {mask.dtype}")
    if mask.ndim == 0 or mask.ndim > 4:
        raise ValueError(f"mask must have 1-4 dims, got {mask.ndim}")
    _check_last_axis(mask, "mask")
    m4 = _pad4(mask)
    mS, mH, mR, mC = m4.shape
    if (mC != cols) if exact_cols else (mC < cols):
        raise ValueError(f"mask must have {'' if exact_cols else 'at least '}{cols} columns "
                         f"({who}'s {'last dim' if exact_cols else 'KV length T'}), got {mC}")
    if mR < rows:
        raise ValueError(f"mask must have at least {rows} rows ({who}'s {'rows' if exact_cols else 'queries N'}), "
                         f"got {mR}")
    if mH == 0 or H % mH or mS == 0 or S % mS:
        raise ValueError(f"mask heads/sequences ({mH}, {mS}) must divide {who}'s ({H}, {S})")
    return m4, kind


def _check_sinks(sinks, H):
    """one float32 sink logit per (query) head"""
    if not isinstance(sinks, _ndarray) or sinks.dtype != F32:
        raise TypeError(f"sinks must be a float32 numpy.ndarray, got {getattr(sinks, 'dtype', type(sinks).__name__)}")
    if sinks.shape != (H,):
        raise ValueError(f"sinks must have shape ({H},) (one per head), got {sinks.shape}")
    return _aligned(np.ascontiguousarray(sinks))


# ------------------------------------------------------------------------------------------------
# softmax

def softmax(x, mask=None, *, scale=1.0, max_bias=0.0, sinks=None, out=None, isa=None, fused=True,
            n_threads=None):
    """ggml soft_max_ext (SPEC §1): softmax(x*scale + slope*mask) over the last axis, with sinks.

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


# ------------------------------------------------------------------------------------------------
# rms_norm

def rms_norm(x, weight=None, *, eps, bias=None, out=None, isa=None, fused=True, n_threads=None):
    """ggml RMS_NORM (+MUL, +MUL+ADD) fused (SPEC §2): y = (x * s) * weight + bias per row, with
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
    """The pre-norm residual pattern (SPEC §2.1, §4.4): h = x + residual, y = rms_norm(h) * weight
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


# ------------------------------------------------------------------------------------------------
# flash attention

STRATEGIES = {"rows": 1, "tiled": 2, "split": 3}
_FA_DESCS = {}  # flash_attn descriptors (cffi int64 arrays, read-only to the kernels) by geometry
DEFAULT_SPLIT_CHUNK = 256  # KV columns per split-KV chunk: fixed, so results never depend on threads


_INF = float("inf")


def _cgeom(shape):
    """(shape, element strides) of a C-contiguous 4-D array"""
    S, H, R, C = shape
    return shape, [H * R * C, R * C, C, 1]


def _fa_lean_desc(key):
    """(descriptor, output shape) for C-contiguous q, k, v of the lean path, or None where the long
    way must check (or refuse) the shapes"""
    (qs, ks, kf16, vs, vf16) = key
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return None
    S, Hq, N, DK = qs
    Sk, Hk, T, DKk = ks
    Sv, Hv, Tv, DV = vs
    if not (Sk == S == Sv and DKk == DK and Tv == T and Hk and Hv and not Hq % Hk and not Hq % Hv
            and S * Hq * N * DK * T * DV > 0):
        return None
    oshape = (S, N, Hq, DV)
    og = (oshape, [N * Hq * DV, Hq * DV, DV, 1])
    if len(_FA_LEAN) >= 256:
        _FA_LEAN.clear()
    ent = _FA_LEAN[key] = (_desc(fa_desc(_cgeom(qs), _cgeom(ks), _cgeom(vs), og, None, 0, kf16, vf16,
                                         choose_strategy(N, T), DEFAULT_SPLIT_CHUNK, 64)), oshape)
    return ent


def _check_kv(a, name):
    if not isinstance(a, _ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of float16 or float32, got {type(a).__name__}")
    if a.dtype != F32 and a.dtype != F16:
        raise TypeError(f"{name} must be float16 or float32, got {a.dtype}")
    if a.ndim != 4:
        raise ValueError(f"{name} must be 4-D (S, H, T, D), got shape {a.shape}")
    _check_last_axis(a, name)


SPLIT_MIN_T = 512  # one query over at least this many KV positions: split-KV
TILED_MIN_N = 8    # at least this many query rows: tiled blocks (also read by the plans' attn_seqs in C)


def choose_strategy(N, T):
    """Auto strategy (SPEC 3.4-3.6): split-KV for one query over a long KV, tiled GEMM blocks when
    there are enough query rows to share a K/V block, per-row online softmax otherwise."""
    if N == 1 and T >= SPLIT_MIN_T:
        return "split"
    if N >= TILED_MIN_N:
        return "tiled"
    return "rows"


def flash_attn(q, k, v, mask=None, *, scale, max_bias=0.0, softcap=0.0, sinks=None, out=None,
               isa=None, strategy=None, chunk=DEFAULT_SPLIT_CHUNK, q_tile=64, fused=True,
               ggml_compat=False, n_threads=None):
    """ggml flash_attn_ext (SPEC §3): softmax(q·kᵀ·scale [softcap] + slope·mask)·v per query row.

    q: float32 (S, Hq, N, DK); k: float16/float32 (S, Hk, T, DK); v: float16/float32 (S, Hv, T, DV);
    Hq % Hk == Hq % Hv == 0 (GQA: head h reads K head h // (Hq/Hk)). mask: float16 (or float32,
    used as given) (mS, mH, mN, Tm) with mN >= N, Tm >= T, heads/sequences tiled by modulo; a -inf
    entry excludes that KV position (its K/V are never read). sinks: float32 (Hq,). Returns float32
    (S, N, Hq, DV), ggml's permuted layout. Strided q/k/v with unit-stride rows are read in place.
    strategy: None (auto), "rows", "tiled" or "split"; chunk: split-KV chunk (fixed, deterministic).
    fused=False runs the unfused chain (score matrix, softmax, matmul). ggml_compat=True rounds Q
    to f16 when K is f16, as upstream's reference path does.
    """
    # lean path: C-contiguous 4-D q, k, v (f32 or f16) and out (new, or sharing no byte with them: exact
    # pointer-range tests, conservative by one element for f16), no mask/sinks/ALiBi, default strategy,
    # chunk and q_tile; one cached descriptor per shape. Anything else, and every error, goes the long way.
    if (mask is None and sinks is None and type(q) is _ndarray and type(k) is _ndarray and type(v) is _ndarray
            and type(scale) is float and type(softcap) is float and type(max_bias) is float and max_bias == 0.0
            and strategy is None and chunk is DEFAULT_SPLIT_CHUNK and type(q_tile) is int and q_tile == 64
            and fused is True and ggml_compat is False and -_INF < scale < _INF and -_INF < softcap < _INF
            and (n_threads is None or type(n_threads) is int and 0 < n_threads <= _MAXT)):
        fn = _lean_fn(_FA_FN, isa)
        kd, vd = k.dtype, v.dtype
        key = (q.shape, k.shape, kd is F16, v.shape, vd is F16)
        dp = _FA_LEAN.get(key)
        if dp is None and fn is not None and (kd is F32 or kd is F16) and (vd is F32 or vd is F16):
            dp = _fa_lean_desc(key)
        if (dp is not None and fn is not None and q.dtype is F32 and (kd is F32 or kd is F16) and (vd is F32 or vd is F16)
                and q.flags.aligned and k.flags.aligned and v.flags.aligned):
            oshape = dp[1]
            o = _empty(oshape, F32) if out is None else out if (
                type(out) is _ndarray and out.dtype is F32 and out.shape == oshape and out.flags.behaved) else None
            if o is not None:
                try:
                    qb, kb, vb, ob = _fb(_T_F32, q), _fb(_T_F32, k), _fb(_T_F32, v), _fb(_T_F32, o)
                except (ValueError, TypeError, BufferError):
                    qb = None  # not C-contiguous
                if qb is not None:
                    L, o0 = len(ob), ob + 0
                    try:
                        ok = out is None or not (-L < o0 - qb < len(qb) or -L < o0 - kb <= len(kb)
                                                 or -L < o0 - vb <= len(vb))
                    except ValueError:
                        ok = False
                    if ok:
                        if fn(dp[0], qb, kb, vb, _NULL, _NULL, _NULL, scale, softcap, ob, n_threads or _thr[0]):
                            raise MemoryError("flash_attn: could not allocate scratch memory")
                        return o
    isa = _dispatch.resolve(isa)
    _check_f32(q, "q")
    if q.ndim != 4:
        raise ValueError(f"q must be 4-D (S, Hq, N, DK), got shape {q.shape}")
    _check_kv(k, "k")
    _check_kv(v, "v")
    S, Hq, N, DK = q.shape
    Sk, Hk, T, DKk = k.shape
    Sv, Hv, Tv, DV = v.shape
    if Sk != S or Sv != S:
        raise ValueError(f"k and v must have q's sequence count S={S}, got k {Sk}, v {Sv}")
    if DKk != DK:
        raise ValueError(f"k must have q's head size DK={DK} in its last dim, got {DKk} (k shape {k.shape})")
    if Tv != T:
        raise ValueError(f"v must have k's KV length T={T}, got {Tv}")
    if Hk == 0 or Hq % Hk or Hv == 0 or Hq % Hv:
        raise ValueError(f"q heads must be a multiple of k heads and v heads (GQA), got q {Hq}, k {Hk}, v {Hv}")
    scale, max_bias, softcap = _real(scale, "scale"), _real(max_bias, "max_bias"), _real(softcap, "softcap")
    for nm, val in (("scale", scale), ("max_bias", max_bias), ("softcap", softcap)):
        if not math.isfinite(val):
            raise ValueError(f"{nm} must be finite, got {val}")
    m4, mkind, sinks = _check_mask_sinks(mask, max_bias, sinks, S, Hq, N, T, False, "q")
    if strategy is None or strategy == "auto":
        strategy = choose_strategy(N, T)
    elif strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of auto, {', '.join(STRATEGIES)}; got {strategy!r}")
    chunk, q_tile = int(chunk), int(q_tile)
    for nm, val in (("chunk", chunk), ("q_tile", q_tile)):
        if val < 1:
            raise ValueError(f"{nm} must be >= 1, got {val}")
    oshape = (S, N, Hq, DV)
    if out is None:
        out = np.empty(oshape, F32)
    else:
        _check_out(out, oshape)
        _check_no_overlap(out, (("q", q), ("k", k), ("v", v), ("mask", mask), ("sinks", sinks)))
    if out.size == 0:
        return out
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    if m4 is not None and not m4.flags.aligned:
        m4 = _aligned(m4)
    if ggml_compat and k.dtype == F16:
        q = q.astype(F16).astype(F32)
    slopes = _slopes(Hq, max_bias) if (mask is not None and max_bias > 0.0) else None

    if isa == "numba":
        dummy = np.zeros(1, F32)
        mf = m4.astype(F32) if m4 is not None else np.zeros((1, 1, 1, 1), F32)
        _kernel("flash_attn", "numba", n_threads)(q, k.astype(F32) if k.dtype == F16 else k, v.astype(F32) if v.dtype == F16 else v,
                         mf, mkind, slopes if slopes is not None else dummy, slopes is not None,
                         sinks if sinks is not None else dummy, sinks is not None, scale, softcap, out)
        return out

    # the descriptor depends only on geometry and options: decode calls repeat it, so it is cached
    key = (q.shape, q.strides, k.shape, k.strides, k.dtype.char, v.shape, v.strides, v.dtype.char, out.strides,
           None if m4 is None else (m4.shape, m4.strides, mkind), strategy, chunk, q_tile)
    dp = _FA_DESCS.get(key)
    if dp is None:
        dp = _desc(fa_desc(_geom4(q), _geom4(k), _geom4(v), _geom4(out), _geom4(m4) if m4 is not None else None,
                           mkind, k.dtype == F16, v.dtype == F16, strategy, chunk, q_tile))
        if len(_FA_DESCS) >= 256:
            _FA_DESCS.clear()
        _FA_DESCS[key] = dp
    fn = _kernel("flash_attn" if fused else "flash_attn_unfused", isa)
    rc = fn(dp, _ptr(q), _ptr(k), _ptr(v), _ptr(m4) if m4 is not None else _NULL,
            _fb(_T_F32, slopes) if slopes is not None else _NULL,
            _fb(_T_F32, sinks) if sinks is not None else _NULL, scale, softcap, _ptr(out, writable=True),
            _dispatch.threads(n_threads))
    if rc != 0:
        raise MemoryError("flash_attn: could not allocate scratch memory")
    return out
