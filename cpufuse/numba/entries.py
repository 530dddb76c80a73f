"""The Numba entries of the kernel registry (cpufuse/_registry.py). Each takes the arguments of its C
kernel (native/cdef.h) in the registry's arrays convention (_registry.convention("numba")): the
descriptor as a tuple of ints, each operand as the array itself (a QTensor for a weight) and None
where the C kernel takes NULL. It calls the jitted kernels (kernels.py, rope.py, quant.py) with
their 4-D views and 1-element stand-ins for absent operands. So an op calls its kernel one way on
every ISA. Calls of at most NB_SMALL elements take the serial twins (no parallel start-up); numba's
thread count is set by the registry's lookup (_registry.kernel(op, "numba", n_threads))."""
import numpy as np

from .._layouts import FA, QM, QW, RP
from ..ops import kvquant
from . import kernels, quant
from . import rope as _rope

F32 = np.dtype(np.float32)
NB_SMALL = 1 << 15
# the stand-ins for absent optional operands (never written)
D32, D16, D1 = np.zeros((1, 1, 1, 1), F32), np.zeros((1, 1, 1, 1), np.uint16), np.zeros(1, F32)


def _pad4(a):
    return a.reshape((1,) * (4 - a.ndim) + a.shape) if a.ndim < 4 else a


def _or(a, dummy):
    return dummy if a is None else a


def _mkind(mask):
    return 0 if mask is None else 1 if mask.dtype == F32 else 2


def softmax(d, x, mask, slopes, sinks, scale, y, nth):
    mk, m4 = _mkind(mask), None if mask is None else _pad4(mask)
    (kernels.softmax_serial if y.size <= NB_SMALL else kernels.softmax)(
        _pad4(x), m4 if mk == 1 else D32, m4.view(np.uint16) if mk == 2 else D16, mk, _or(slopes, D1),
        slopes is not None, _or(sinks, D1), sinks is not None, scale, _pad4(y))
    return 0


def rms_norm(d, x, r, w, b, eps, h, y, nth):
    (kernels.rms_norm_serial if y.size <= NB_SMALL else kernels.rms_norm)(
        _pad4(x), D32 if r is None else _pad4(r), r is not None, D32 if w is None else _pad4(w), w is not None,
        D32 if b is None else _pad4(b), b is not None, eps, D32 if h is None else _pad4(h), _pad4(y))


def rms_norm_rows(rows, n, x, w, eps, y, nth):
    sh4 = (1, 1, rows, n)
    (kernels.rms_norm_serial if rows * n <= NB_SMALL else kernels.rms_norm)(
        x.reshape(sh4), D32, False, D32 if w is None else w.reshape(1, 1, 1, n), w is not None, D32, False, eps, D32,
        y.reshape(sh4))
    return 0


I8 = np.zeros((1, 1, 1, 1), np.int8)
QTYPE = {v: k for k, v in kvquant.CODE.items()}


def _codes(blocks, kv_type, D):
    """quantized rows (uint8 blocks) -> (int8 codes (..., D), f32 block scales (..., D / 32))"""
    blk = blocks.reshape(blocks.shape[:-1] + (D // 32, kvquant.QUANT[kv_type]))
    d = np.ascontiguousarray(blk[..., :2]).view(np.float16)[..., 0].astype(F32)
    if kv_type == "q8_0":
        c = np.ascontiguousarray(blk[..., 2:]).view(np.int8)
    else:
        c = (np.concatenate([blk[..., 2:] & 15, blk[..., 2:] >> 4], axis=-1).astype(np.int16) - 8).astype(np.int8)
    return c.reshape(blocks.shape[:-1] + (D,)), d


def flash_attn(d, q, k, v, mask, slopes, sinks, scale, softcap, out, nth):
    kt, vt = QTYPE[d[FA.KF16]], QTYPE[d[FA.VF16]]
    kq = kt in kvquant.QUANT
    if kq:   # int8 dots: Q as Q8_0 (docs/semantics.md §4), K's codes and scales unpacked
        qc, qd = _codes(kvquant.quantize(q, "q8_0"), "q8_0", q.shape[3])
        kc, kd = _codes(k, kt, q.shape[3])
        k = D32
    else:
        qc, qd, kc, kd = I8, D32, I8, D32
        k = k.astype(F32) if k.dtype != F32 else k
    if vt in kvquant.QUANT:
        v = kvquant.dequantize(v, vt, d[FA.DV])   # exact f32 values
    kernels.flash_attn(q, k, v.astype(F32) if v.dtype != F32 else v,
                       D32 if mask is None else mask.astype(F32), _mkind(mask), _or(slopes, D1), slopes is not None,
                       _or(sinks, D1), sinks is not None, scale, softcap, out, kq, qc, qd, kc, kd)
    return 0


def rope(d, x, pos, ff, fp, y, nth):
    _rope.rope(x, pos, ff, d[RP.NDIMS], d[RP.MODE], bool(d[RP.COMPAT]), fp, d[RP.NCTX_ORIG], y)
    return 0


def qmatmul(d, x, nw, eps, w0, w1, w2, y0, y1, y2, res, nth):
    nws, epi = d[QM.NW], d[QM.EPI]
    ws = (w0, w1, w2)[:nws]
    ys = tuple(y if y.ndim == 2 else y.reshape(1, -1) for y in (y0, y1, y2)[:1 if epi else nws])
    quant.qmatmul(x if x.ndim == 2 else x.reshape(1, -1), nw, eps, bool(d[QM.NORM]), tuple(w.gguf_bytes() for w in ws),
                  tuple(d[QM.W0 + i * QW.LEN + QW.T] for i in range(nws)), bool(d[QM.ACT]), epi, ys,
                  res if res is None or res.ndim == 2 else res.reshape(1, -1))
    return 0


def quantize_act(vtype, rows, k, x, xs, out):
    out[...] = quant.quantize_act(x, vtype)
    return 0
