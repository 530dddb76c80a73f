"""Argument checks shared by the public ops (cpufuse.softmax, rms_norm, add_rms_norm, flash_attn,
rope), and the plumbing they share: operand geometry, ALiBi slopes, the registry's lookup. Every
check raises TypeError (wrong type/dtype) or ValueError (shape, stride, parameter) naming the
argument, what was expected and what was received."""
import functools
import numbers as _numbers

import numpy as np

from .. import _dispatch, _registry
from . import binder as _binder
from ..reference.ops import alibi_slopes as _alibi_slopes_f32

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
_ndarray = np.ndarray

# the registry's lookup (every module's kernel tables are the registry's dicts)
_kernel = _registry.kernel
_thr = _dispatch._threads  # [default thread count]


# Each public op declares its operands once to a Binder (binder.py), which keys, checks and caches
# the op's calls; clear_plans forgets every op's entries.
clear_plans = _binder.clear_plans


def _rows_geom(rows, n):
    """the 4-D geometry of a C-contiguous (rows, n) array"""
    return (1, 1, rows, n), [0, 0, n, 1]


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
        raise ValueError(f"eps must be >= 0 (docs/semantics.md §3), got {eps!r}")
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
        # dim-0 tiling (docs/semantics.md §3): expand the row once; the kernels index rows by modulo
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
