"""RoPE: ggml rope_ext (docs/semantics.md §7), with the f16 KV-cache write fused in.

`rope` checks its arguments, allocates the output, and calls the native kernel of the chosen ISA
(native/kernels/rope.inc, descriptor layout RP / RPF of cpufuse/_layouts.py) or the Numba fallback
(cpufuse/numba/rope.py). Errors: TypeError for types/dtypes, ValueError for shapes, strides and
parameters; the message names the argument, what was expected and what was received.
"""
import collections as _collections
import math
import numbers as _numbers

import numpy as np

from .. import _dispatch, _registry
from .._layouts import RP
from .binder import Binder, In, Out, Param
from .checks import _aligned, _check_aligned_out

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
I32 = np.dtype(np.int32)
_ndarray = np.ndarray

_MODES = {"norm": 0, "neox": 1, 0: 0, 2: 1}
_GGML_OTHER_MODES = {8: "MROPE", 24: "VISION", 40: "IMROPE"}


def rp_desc(T, H, D, nd, mode, compat, yf16, xs0, xs1, ys0, ys1, nco):
    """cf_rope_f32's int64 descriptor (RP of cpufuse._layouts) as a list; strides in elements"""
    return RP.pack(T=T, H=H, D=D, NDIMS=nd, MODE=mode, COMPAT=bool(compat), YF16=bool(yf16), XS0=xs0, XS1=xs1,
                   YS0=ys0, YS1=ys1, NCTX_ORIG=nco)


# ------------------------------------------------------------------------------------------------
# argument checks

def _real(v, name, positive=False):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, _numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    f = float(v)
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite, got {v!r}")
    if positive and not f > 0.0:
        raise ValueError(f"{name} must be > 0, got {v!r}")
    return f


def _int(v, name):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, _numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(v).__name__}")
    return int(v)


def _mode(mode):
    if isinstance(mode, str):
        m = _MODES.get(mode.lower())
    elif isinstance(mode, _numbers.Integral) and not isinstance(mode, (bool, np.bool_)):
        m = _MODES.get(int(mode))
        if m is None and int(mode) in _GGML_OTHER_MODES:
            raise ValueError(f"mode {int(mode)} ({_GGML_OTHER_MODES[int(mode)]}) is not supported; "
                             "expected 'norm' (0) or 'neox' (2)")
    else:
        raise TypeError(f"mode must be 'norm', 'neox', 0 or 2, got {type(mode).__name__}")
    if m is None:
        raise ValueError(f"mode must be 'norm', 'neox', 0 or 2, got {mode!r}")
    return m


RopeParams = _collections.namedtuple("RopeParams", "n_dims mode fps n_ctx_orig ggml_compat freq_factors")


def rope_params(n_dims, head_dim, mode="norm", *, freq_base=10000.0, freq_scale=1.0, ext_factor=0.0,
                attn_factor=1.0, beta_fast=32.0, beta_slow=1.0, n_ctx_orig=0, freq_factors=None,
                ggml_compat=False):
    """rope's parameters checked and normalized (the one place they are: `rope` and the graph's rope
    record both call it): RopeParams(n_dims, mode code 0 norm / 1 neox, fps = [freq_base, freq_scale,
    ext_factor, attn_factor, beta_fast, beta_slow] as floats (RPF order), n_ctx_orig, ggml_compat,
    freq_factors as a C-contiguous float32 array or None). TypeError / ValueError name the argument.
    The defaults are rope's (tests/test_rope.py checks that they agree)."""
    nd = _int(n_dims, "n_dims")
    if nd <= 0 or nd % 2 or nd > head_dim:
        raise ValueError(f"n_dims must be even, > 0 and <= head_dim = {head_dim}, got {nd}")
    m = _mode(mode)
    fps = [_real(freq_base, "freq_base", positive=True), _real(freq_scale, "freq_scale", positive=True),
           _real(ext_factor, "ext_factor"), _real(attn_factor, "attn_factor"),
           _real(beta_fast, "beta_fast"), _real(beta_slow, "beta_slow")]
    nco = _int(n_ctx_orig, "n_ctx_orig")
    if nco < 0:
        raise ValueError(f"n_ctx_orig must be >= 0, got {nco}")
    if not isinstance(ggml_compat, (bool, np.bool_)):
        raise TypeError(f"ggml_compat must be a bool, got {type(ggml_compat).__name__}")
    ff = None
    if freq_factors is not None:
        if not isinstance(freq_factors, _ndarray):
            raise TypeError(f"freq_factors must be a numpy.ndarray of float32, got {type(freq_factors).__name__}")
        if freq_factors.dtype != F32:
            raise TypeError(f"freq_factors must be float32, got {freq_factors.dtype}")
        if freq_factors.shape != (nd // 2,):
            raise ValueError(f"freq_factors must have shape ({nd // 2},) (n_dims/2), got {freq_factors.shape}")
        ff = np.ascontiguousarray(freq_factors)
    return RopeParams(nd, m, fps, nco, bool(ggml_compat), ff)


def _last_axis_ok(a, name):
    it = a.itemsize
    if a.size and a.shape[-1] > 1 and a.strides[-1] != it:
        raise ValueError(f"{name} must have a unit-stride last axis (stride {it} bytes), got stride {a.strides[-1]}")
    if any(s % it for s in a.strides):
        raise ValueError(f"{name} has strides {a.strides} that are not multiples of its item size {it}")


def _check_cache(cache, shape):
    if not isinstance(cache, (tuple, list)) or len(cache) != 2:
        raise TypeError(f"cache must be a (k_cache, pos0) pair, got {type(cache).__name__}"
                        + (f" of length {len(cache)}" if isinstance(cache, (tuple, list)) else ""))
    kc, pos0 = cache
    if not isinstance(kc, _ndarray):
        raise TypeError(f"cache: k_cache must be a numpy.ndarray of float16 or float32, got {type(kc).__name__}")
    if kc.dtype != F16 and kc.dtype != F32:
        raise TypeError(f"cache: k_cache must be float16 or float32, got {kc.dtype}")
    T, H, D = shape
    if kc.ndim != 3 or kc.shape[1:] != (H, D):
        raise ValueError(f"cache: k_cache must have shape (n_ctx, {H}, {D}) (n_ctx, n_heads, head_dim of x), "
                         f"got {kc.shape}")
    it = kc.itemsize
    if kc.size and (kc.strides[2] != it and D > 1 or kc.strides[1] != D * it and H > 1
                        or kc.strides[0] % it):
        raise ValueError(f"cache: k_cache rows must be C-contiguous (strides (*, {D * it}, {it}) bytes), "
                         f"got strides {kc.strides}")
    if not kc.flags.writeable:
        raise ValueError("cache: k_cache must be writeable, got a read-only array")
    _check_aligned_out(kc, "cache: k_cache")
    p0 = _int(pos0, "cache pos0")
    if p0 < 0:
        raise ValueError(f"cache: pos0 must be >= 0, got {p0}")
    if p0 + T > kc.shape[0]:
        raise ValueError(f"cache: pos0 + n_tokens = {p0} + {T} = {p0 + T} exceeds the context size "
                         f"n_ctx = {kc.shape[0]} of k_cache")
    return kc, p0


# ------------------------------------------------------------------------------------------------
# the declaration of its operands (binder.py) and its entries

_thr = _dispatch._threads
_ROPE = Binder("rope", (In("x", F32), In("pos", I32), In("freq_factors", F32, optional=True),
                        Out("out", F32, alias=("x",)), Out("k_cache", F16, F32)),
               (Param("n_dims"), Param("mode"), Param("freq_base"), Param("freq_scale"), Param("ext_factor"),
                Param("attn_factor"), Param("beta_fast"), Param("beta_slow"), Param("n_ctx_orig"), Param("ggml_compat"),
                Param("cache_type"), Param("pos0", key=False, passed=True)))
_fast = _ROPE.fast


def _plan(isa, shape, nd, m, compat, nco, fps, kc, n_threads):
    """the entry of a checked call with C-contiguous x and pos, no freq_factors; kc: the cache's
    k_cache (its rows are written from pos0, which each call checks against it) or None"""
    conv = _registry.convention(isa)
    fn = _registry.kernel("rope", isa, n_threads)
    T, H, D = shape
    f16 = kc is not None and kc.dtype == F16
    d = conv.desc(rp_desc(T, H, D, nd, m, compat, f16, H * D, D, H * D, D, nco))
    fp = conv.doubles(fps)
    if kc is None:
        def launch(x, pos, ff, y, k_cache, pos0, nt):
            if fn(d, x, pos, ff, fp, y, nt or _thr[0]):
                raise MemoryError("rope: could not allocate scratch memory")
        return launch, conv.arrays, (shape, None)

    row = H * D * kc.itemsize  # bytes of one token's rows in k_cache
    last = kc.shape[0] - T
    at = conv.at

    def launch(x, pos, ff, y, k_cache, pos0, nt):
        if type(pos0) is not int or not 0 <= pos0 <= last:
            return True  # the checks say what is wrong
        if fn(d, x, pos, ff, fp, at(k_cache, pos0, T, row), nt or _thr[0]):
            raise MemoryError("rope: could not allocate scratch memory")
    return launch, conv.arrays, (None, None)


# ------------------------------------------------------------------------------------------------

def rope(x, pos, *, n_dims, mode="norm", freq_base=10000.0, freq_scale=1.0, ext_factor=0.0,
         attn_factor=1.0, beta_fast=32.0, beta_slow=1.0, n_ctx_orig=0, freq_factors=None,
         ggml_compat=False, out=None, cache=None, isa=None, n_threads=None):
    """ggml rope_ext (docs/semantics.md §7) on x of shape (n_tokens, n_heads, head_dim).

    mode: "norm" / 0 rotates the adjacent pairs (x[2k], x[2k+1]) (llama); "neox" / 2 rotates
    (x[k], x[k + n_dims/2]) (qwen2, gpt-neox). Pair k of token t turns by
    theta = pos[t] * freq_scale * freq_base^(-2k/n_dims) / freq_factors[k]; dims >= n_dims pass
    through unchanged (partial rotary). YaRN (ext_factor != 0): theta mixes the interpolated and
    extrapolated angles with ramp(k) * ext_factor (corr dims from beta_fast, beta_slow, n_ctx_orig)
    and cos/sin are scaled by attn_factor * (1 + 0.1 ln(1/freq_scale)); with ext_factor == 0 they
    are scaled by attn_factor. freq_factors: float32 (n_dims/2,) (Llama 3.1 rope_freqs) or None.

    Angles. Default (ggml_compat=False), accurate: theta in float64 and cos/sin in float64, once
    per (token, pair) and shared by every head, rounded once to float32. sin/cos come from a
    float64 Cody-Waite reduction modulo pi/2 and polynomials (SIMD, no libm, ~1e-16; libm beyond
    |theta| = 1e7), the same float64 operations on every ISA and Numba, so the table is the same
    bits everywhere. ggml's own f32 chain
    (theta *= powf(base, -2/n_dims) repeated in float, cosf/sinf of a float angle) is off by up to
    ~1e-2 rad at position 131072 (docs/semantics.md §7), so float64 is the default: it is what the model
    was trained with up to f32 rounding. ggml_compat=True reproduces ggml's chain step for step
    (libm powf/logf/cosf/sinf, the YaRN mix as one FMA), to agree with llama.cpp bit for bit.
    The rotation itself is y_a = fma(x_a, C, -x_b*S), y_b = fma(x_a, S, x_b*C) (ggml's GCC
    form) on the FMA ISAs and the Numba path; the scalar ISA rounds the two products separately
    (its no-FMA baseline), which can differ by 1 ulp.

    x: float32, 3-D, unit stride on the last axis (other strides any). pos: int32 (n_tokens,),
    the absolute positions. Returns a new array, or writes `out` (same shape, float32; may be x
    itself for in place, must not otherwise overlap x) and returns it. x is never modified
    unless out is x.

    cache=(k_cache, pos0): k_cache is float16 (or float32) of shape (n_ctx, n_heads, head_dim)
    with C-contiguous rows; the rotated rows of token t go straight into k_cache[pos0 + t]
    (float16 rounded to nearest even), no f32 intermediate, and rope returns None.

    The result does not depend on n_threads (bit-identical for every thread count).
    """
    kc = p0 = None
    if cache is None or (type(cache) is tuple or type(cache) is list) and len(cache) == 2:
        if cache is not None:
            kc, p0 = cache
        r = _fast(x, pos, freq_factors, out, kc, n_dims, mode, freq_base, freq_scale, ext_factor, attn_factor,
                  beta_fast, beta_slow, n_ctx_orig, ggml_compat, type(cache), p0, isa, n_threads)
        if r is not None:
            return r[0]
    isa_arg = isa
    isa = _dispatch.resolve(isa)
    if not isinstance(x, _ndarray):
        raise TypeError(f"x must be a numpy.ndarray of float32, got {type(x).__name__}")
    if x.dtype != F32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    if x.ndim != 3:
        raise ValueError(f"x must have 3 dims (n_tokens, n_heads, head_dim), got shape {x.shape}")
    _last_axis_ok(x, "x")
    T, H, D = x.shape
    if not isinstance(pos, _ndarray):
        raise TypeError(f"pos must be a numpy.ndarray of int32, got {type(pos).__name__}")
    if pos.dtype != I32:
        raise TypeError(f"pos must be int32, got {pos.dtype}")
    if pos.shape != (T,):
        raise ValueError(f"pos must have shape ({T},) (one position per token of x), got {pos.shape}")
    nd, m, fps, nco, compat, ff = rope_params(
        n_dims, D, mode, freq_base=freq_base, freq_scale=freq_scale, ext_factor=ext_factor, attn_factor=attn_factor,
        beta_fast=beta_fast, beta_slow=beta_slow, n_ctx_orig=n_ctx_orig, freq_factors=freq_factors,
        ggml_compat=ggml_compat)
    n_th = _dispatch.threads(n_threads)

    if cache is not None and out is not None:
        raise ValueError("out and cache are exclusive (cache writes the rows into k_cache and returns None), "
                         "got both")
    ret = None
    if cache is not None:
        kc, p0 = _check_cache(cache, x.shape)
        for nm, a in (("x", x), ("pos", pos), ("freq_factors", freq_factors)):
            if a is not None and np.may_share_memory(kc, a):
                raise ValueError(f"cache: k_cache must not overlap the input {nm!r}, got an array sharing memory "
                                 f"with it")
        y = kc[p0:p0 + T]
    elif out is not None:
        if not isinstance(out, _ndarray):
            raise TypeError(f"out must be a numpy.ndarray of float32, got {type(out).__name__}")
        if out.dtype != F32:
            raise TypeError(f"out must be float32, got {out.dtype}")
        if out.shape != x.shape:
            raise ValueError(f"out must have shape {x.shape} (that of x), got {out.shape}")
        if not out.flags.writeable:
            raise ValueError("out must be writeable, got a read-only array")
        _last_axis_ok(out, "out")
        _check_aligned_out(out, "out")
        same = (out.__array_interface__["data"][0] == x.__array_interface__["data"][0]
                and out.strides == x.strides)
        if np.may_share_memory(out, x) and not same:
            raise ValueError("out must be x itself (in place) or not overlap it, got an array partially "
                             "overlapping 'x'")
        for nm, a in (("pos", pos), ("freq_factors", freq_factors)):
            if a is not None and np.may_share_memory(out, a):
                raise ValueError(f"out must not overlap the input {nm!r}, got an array sharing memory with it")
    if freq_factors is None and T and H and x.flags.c_contiguous and pos.flags.c_contiguous:
        kc, p0 = (None, None) if cache is None else (kc, cache[1])
        r = _ROPE.plan(_plan(isa, x.shape, nd, m, compat, nco, fps, kc, n_threads), x, pos, freq_factors, out, kc,
                       n_dims, mode, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow, n_ctx_orig,
                       ggml_compat, type(cache), p0, isa_arg, n_threads)
        if r is not None:
            return r[0]
    if cache is None:
        if out is None:
            out = np.empty(x.shape, F32)
        y = ret = out
    if T == 0 or H == 0:
        return ret
    posc = _aligned(np.ascontiguousarray(pos))
    x, ff = _aligned(x), _aligned(ff)
    f16 = y.dtype == F16

    conv = _registry.convention(isa)
    P = conv.operand
    it = y.itemsize
    d = conv.desc(rp_desc(T, H, D, nd, m, compat, f16, x.strides[0] // 4, x.strides[1] // 4, y.strides[0] // it,
                          y.strides[1] // it, nco))
    if _registry.kernel("rope", isa, n_threads)(d, P(x), P(posc), P(ff), conv.doubles(fps), P(y), n_th):
        raise MemoryError("rope: could not allocate scratch memory")
    return ret
