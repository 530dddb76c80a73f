"""GGUF weight types: the type table, `QTensor` (a weight's raw GGUF bytes plus its type), and
pure-numpy unpacking and dequantization of every supported type (docs/semantics.md §8).

Dequantization is bit-identical to `gguf.quants.dequantize`: the same float32 operations in the
same order (e.g. Q4_1 x = f32(f32(q*d) + m); K-quants x = f32(f32(d*sc)*q - f32(dmin*m))).
All multi-byte fields are read little-endian, whatever the host.
"""
import numbers
from collections import namedtuple

import numpy as np

__all__ = ["QType", "QTYPES", "ACT_QTYPES", "CODE_OFFSET", "SUPPORTED", "resolve_qtype", "QTensor", "unpack_blocks",
           "dequantize"]

QType = namedtuple("QType", "name type_id block_size type_size vec_dot_type")
QType.__doc__ = """One supported ggml type: name, ggml/GGUF id, elements per block, bytes per block,
and the activation type its CPU vec_dot uses ("Q8_0", "Q8_1", "Q8_K"; None for float types)."""

_TABLE = (
    QType("F32", 0, 1, 4, None),
    QType("F16", 1, 1, 2, None),
    QType("BF16", 30, 1, 2, None),
    QType("Q4_0", 2, 32, 18, "Q8_0"),
    QType("Q4_1", 3, 32, 20, "Q8_1"),
    QType("Q5_0", 6, 32, 22, "Q8_0"),
    QType("Q5_1", 7, 32, 24, "Q8_1"),
    QType("Q8_0", 8, 32, 34, "Q8_0"),
    QType("Q4_K", 12, 256, 144, "Q8_K"),
    QType("Q5_K", 13, 256, 176, "Q8_K"),
    QType("Q6_K", 14, 256, 210, "Q8_K"),
    QType("Q2_K", 10, 256, 84, "Q8_K"),
    QType("Q3_K", 11, 256, 110, "Q8_K"),
    QType("IQ4_NL", 20, 32, 18, "Q8_0"),
    QType("IQ4_XS", 23, 256, 136, "Q8_K"),
    QType("MXFP4", 39, 32, 17, "Q8_0"),
)
# the activation block types of the vec_dots (what act="q8" quantizes x to; not weight types here)
ACT_QTYPES = {t.name: t for t in (QType("Q8_0", 8, 32, 34, None), QType("Q8_1", 9, 32, 36, None),
                                  QType("Q8_K", 15, 256, 292, None))}
# The one table of block facts: the C kernels read it from native/kernels/qtypes.h, generated from
# _TABLE, ACT_QTYPES and CODE_OFFSET below (`python cpufuse/quant/types.py`; tests/test_layouts.py
# fails when the header is stale), and cpufuse.numba.quant from this module.
QTYPES = {t.name: t for t in _TABLE}          # by name
_BY_ID = {t.type_id: t for t in _TABLE}
SUPPORTED = tuple(t.name for t in _TABLE)

# ggml types (past and present) that cpufuse does not support, by id
_UNSUPPORTED = {
    4: "Q4_2", 5: "Q4_3", 9: "Q8_1", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS",
    18: "IQ3_XXS", 19: "IQ1_S", 21: "IQ3_S", 22: "IQ2_S", 24: "I8",
    25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 31: "Q4_0_4_4", 32: "Q4_0_4_8",
    33: "Q4_0_8_8", 34: "TQ1_0", 35: "TQ2_0", 36: "IQ4_NL_4_4", 37: "IQ4_NL_4_8", 38: "IQ4_NL_8_8",
    40: "NVFP4", 41: "Q1_0", 42: "Q2_0",
}
_UNSUPPORTED_NAMES = {n: i for i, n in _UNSUPPORTED.items()}

# The code offset of the types whose block stores unsigned codes c for the signed values c - offset
# (0, i.e. absent, for the others: signed codes, codes with a min, table lookups, Q3_K's hmask).
CODE_OFFSET = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32}


def _unsupported(name, type_id):
    return NotImplementedError(
        f"qtype: ggml type {name} (id {type_id}) is not supported; supported: {', '.join(SUPPORTED)}")


def resolve_qtype(qtype):
    """The QType entry for `qtype`: a name (case-insensitive, e.g. "q4_k"), a ggml type id, a
    `gguf.GGMLQuantizationType` member (or any enum with .name/.value), or a QType.
    Known but unsupported ggml types raise NotImplementedError; anything else TypeError/ValueError."""
    if isinstance(qtype, QType):
        if QTYPES.get(qtype.name) != qtype:
            raise ValueError(f"qtype: {qtype!r} is not an entry of the cpufuse type table")
        return qtype
    if isinstance(qtype, str):
        key = qtype.strip().upper()
        if key in QTYPES:
            return QTYPES[key]
        if key in _UNSUPPORTED_NAMES:
            raise _unsupported(key, _UNSUPPORTED_NAMES[key])
        raise ValueError(f"qtype: unknown ggml type name {qtype!r}; supported: {', '.join(SUPPORTED)}")
    if isinstance(qtype, bool):
        raise TypeError("qtype must be a type name, a ggml type id or a GGMLQuantizationType, got bool")
    value = getattr(qtype, "value", None)
    if hasattr(qtype, "name") and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        qtype = value                       # an enum member (gguf.GGMLQuantizationType is an IntEnum)
    if isinstance(qtype, numbers.Integral):
        i = int(qtype)
        if i in _BY_ID:
            return _BY_ID[i]
        if i in _UNSUPPORTED:
            raise _unsupported(_UNSUPPORTED[i], i)
        raise ValueError(f"qtype: {i} is not a ggml type id; supported: "
                         + ", ".join(f"{t.name}={t.type_id}" for t in _TABLE))
    raise TypeError("qtype must be a type name (str), a ggml type id (int) or a GGMLQuantizationType, "
                    f"got {type(qtype).__name__}")


# ------------------------------------------------------------------------------------------------
# raw bytes

# dtypes accepted for `raw` besides uint8, per float type
_FLOAT_RAW_DTYPES = {"F32": (np.dtype(np.float32),), "F16": (np.dtype(np.float16), np.dtype(np.uint16)),
                     "BF16": (np.dtype(np.uint16),)}
_U8 = np.dtype(np.uint8)


def _check_shape(shape):
    """(n_expert, n_out, n_in): n_expert 0 for a 2-D shape (n_out, n_in), else its leading dimension"""
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"shape must be a tuple (n_out, n_in) or (n_expert, n_out, n_in) of ints, got "
                        f"{type(shape).__name__}")
    if len(shape) not in (2, 3):
        raise ValueError(f"shape must be (n_out, n_in) or (n_expert, n_out, n_in), got {len(shape)} values: "
                         f"{tuple(shape)!r}")
    for v in shape:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"shape must be a tuple (n_out, n_in) or (n_expert, n_out, n_in) of ints, got "
                            f"{tuple(shape)!r}")
    dims = tuple(int(v) for v in shape)
    if min(dims) <= 0:
        raise ValueError(f"shape: every dimension must be positive, got {dims}")
    return (0,) + dims if len(dims) == 2 else dims


def _check_raw(raw, t):
    """raw's dtype must suit type t; returns raw as a flat uint8 view (no copy; raw C-contiguous)"""
    if not isinstance(raw, np.ndarray):
        raise TypeError(f"raw must be a numpy.ndarray of the tensor's GGUF bytes, got {type(raw).__name__}")
    ok = (_U8,) + _FLOAT_RAW_DTYPES.get(t.name, ())
    if raw.dtype not in ok:
        raise TypeError(f"raw: dtype {raw.dtype} does not fit a {t.name} tensor; expected "
                        + " or ".join(str(d) for d in ok))
    if not raw.flags.c_contiguous:
        raise ValueError(f"raw must be C-contiguous (got shape {raw.shape}, strides {raw.strides}); "
                         "QTensor never copies, pass np.ascontiguousarray(raw) if a copy is acceptable")
    return raw.reshape(-1).view(dtype=_U8, type=np.ndarray)


def _row_bytes(t, n_in):
    if isinstance(n_in, bool) or not isinstance(n_in, numbers.Integral):
        raise TypeError(f"n_in must be an int, got {type(n_in).__name__}")
    n_in = int(n_in)
    if n_in <= 0:
        raise ValueError(f"n_in must be positive, got {n_in}")
    if n_in % t.block_size:
        raise ValueError(f"shape: n_in={n_in} is not a multiple of the {t.name} block size {t.block_size}")
    return n_in // t.block_size * t.type_size


# ------------------------------------------------------------------------------------------------
# unpacking (bytes -> codes and scales) and dequantization

def _h2f(b, off):
    """f16 field at byte offset `off` of every block (last axis) -> float32, exact"""
    u = b[..., off].astype(np.uint16) | (b[..., off + 1].astype(np.uint16) << np.uint16(8))
    return u.view(np.float16).astype(np.float32)


def _u32(b, off):
    u = b[..., off].astype(np.uint32)
    for k in range(1, 4):
        u |= b[..., off + k].astype(np.uint32) << np.uint32(8 * k)
    return u


def _nibbles(qs):
    """(..., 16) bytes -> (..., 32) codes: low nibbles first, then high nibbles (Q4_0 order)"""
    return np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)


# IQ4_NL / IQ4_XS: a 4-bit code is an index into this table (ggml's kvalues_iq4nl)
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
# MXFP4: a 4-bit code (E2M1) indexes the doubled E2M1 values, scaled by half the E8M0 scale
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def e8m0_half(e):
    """E8M0 exponent bytes -> float32 2^(e - 128) (exact: subnormal for e < 2), ggml's
    e8m0_to_fp32_half"""
    e = np.asarray(e, np.uint8).astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)

_BIT32 = np.arange(32, dtype=np.uint32)
_BIT8 = np.arange(8, dtype=np.uint8)


def _high_bits32(b, off):
    """Q5_0/Q5_1 qh (uint32 at off): bit e of it, for e = 0..31, as uint8 (..., 32)"""
    return ((_u32(b, off)[..., None] >> _BIT32) & np.uint32(1)).astype(np.uint8)


def _scale_min_k4(s):
    """(..., 12) packed bytes -> (sc, m), each (..., 8) uint8 in 0..63 (docs/semantics.md §8)"""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & np.uint8(63), (hi & np.uint8(15)) | ((lo >> np.uint8(6)) << np.uint8(4))], axis=-1)
    m = np.concatenate([mid & np.uint8(63), (hi >> np.uint8(4)) | ((mid >> np.uint8(6)) << np.uint8(4))], axis=-1)
    return sc, m


def unpack_blocks(raw, qtype, n_in):
    """Unpack quantized rows into integer codes and float32 scales, without arithmetic.

    raw: the GGUF bytes of whole rows (any array accepted by QTensor, or a 2-D uint8 array of shape
    (rows, row_bytes)); returns a dict of arrays with leading axes (rows, n_blocks):
      Q4_0, Q5_0, Q8_0: q int8 (..., 32) signed codes (q-8 for Q4_0, q-16 for Q5_0), d float32
      Q4_1, Q5_1:       q uint8 (..., 32) in 0..15 / 0..31, d, m float32
      Q4_K, Q5_K:       q uint8 (..., 8, 32), sc, m uint8 (..., 8) in 0..63, d, dmin float32
      Q6_K:             q int8 (..., 16, 16) in -32..31, sc int8 (..., 16), d float32
      Q2_K:             q uint8 (..., 16, 16) in 0..3, sc, m uint8 (..., 16) in 0..15, d, dmin float32
      Q3_K:             q int8 (..., 16, 16) in -4..3, sc int8 (..., 16) in -32..31, d float32
      IQ4_NL:           q int8 (..., 32) the table values (KVALUES_IQ4NL), d float32
      IQ4_XS:           q int8 (..., 8, 32) table values, sc int8 (..., 8) in -32..31, d float32
      MXFP4:            q int8 (..., 32) the table values (KVALUES_MXFP4), d float32 2^(e - 128)
    Float types have no blocks: ValueError.
    """
    t = resolve_qtype(qtype)
    if t.block_size == 1:
        raise ValueError(f"qtype: {t.name} is a float type, it has no quantized blocks to unpack")
    rb = _row_bytes(t, n_in)
    flat = _check_raw(np.ascontiguousarray(raw), t)
    if flat.size % rb:
        raise ValueError(f"raw: {flat.size} bytes is not a whole number of {t.name} rows of n_in={n_in} "
                         f"({rb} bytes each)")
    b = flat.reshape(flat.size // rb, rb // t.type_size, t.type_size)
    n = t.name
    if n in ("Q4_0", "Q5_0"):
        q = _nibbles(b[..., -16:])
        if n == "Q5_0":
            q = q | (_high_bits32(b, 2) << np.uint8(4))
        return {"q": (q.astype(np.int16) - CODE_OFFSET[n]).astype(np.int8), "d": _h2f(b, 0)}
    if n in ("Q4_1", "Q5_1"):
        q = _nibbles(b[..., -16:])
        if n == "Q5_1":
            q = q | (_high_bits32(b, 4) << np.uint8(4))
        return {"q": q, "d": _h2f(b, 0), "m": _h2f(b, 2)}
    if n == "Q8_0":
        return {"q": b[..., 2:34].view(np.int8).copy(), "d": _h2f(b, 0)}
    if n in ("Q4_K", "Q5_K"):
        sc, m = _scale_min_k4(b[..., 4:16])
        qs = b[..., -128:].reshape(b.shape[:2] + (4, 32))
        q = np.stack([qs & np.uint8(15), qs >> np.uint8(4)], axis=-2).reshape(b.shape[:2] + (8, 32))
        if n == "Q5_K":   # 5th bit of sub-block s, element l: bit s of qh[l]
            qh = b[..., 16:48]
            q = q | (((qh[..., None, :] >> _BIT8[:, None]) & np.uint8(1)) << np.uint8(4))
        return {"q": q, "sc": sc, "m": m, "d": _h2f(b, 0), "dmin": _h2f(b, 2)}
    if n == "Q6_K":
        lead = b.shape[:2]
        ql = b[..., 0:128].reshape(lead + (2, 2, 32))      # [half, g mod 2, l]
        low = np.stack([ql & np.uint8(15), ql >> np.uint8(4)], axis=-3).reshape(lead + (2, 4, 32))  # [half, g, l]
        qh = b[..., 128:192].reshape(lead + (2, 1, 32))
        high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & np.uint8(3)
        q = ((low | (high << np.uint8(4))).astype(np.int16) - CODE_OFFSET[n]).astype(np.int8)
        return {"q": q.reshape(lead + (16, 16)), "sc": b[..., 192:208].view(np.int8).copy(), "d": _h2f(b, 208)}
    lead = b.shape[:2]
    if n in ("Q2_K", "Q3_K"):  # element 128h + 32g + l: bits 2g of qs[32h + l]; 16-element sub-blocks
        qo = 16 if n == "Q2_K" else 32
        qs = b[..., qo:qo + 64].reshape(lead + (2, 1, 32))
        q = (qs >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & np.uint8(3)    # [h, g, l]
        q = q.reshape(lead + (16, 16))
        if n == "Q2_K":
            s = b[..., 0:16]
            return {"q": q, "sc": s & np.uint8(15), "m": s >> np.uint8(4), "d": _h2f(b, 80), "dmin": _h2f(b, 82)}
        hm = b[..., 0:32]                                   # bit j of hmask[l]: element 32j + l
        hb = ((hm[..., None, :] >> _BIT8[:, None]) & np.uint8(1)).reshape(lead + (16, 16))
        q = (q.astype(np.int16) - 4 * (1 - hb.astype(np.int16))).astype(np.int8)
        s = b[..., 96:108]
        lo = np.concatenate([s[..., 0:8] & np.uint8(15), s[..., 0:8] >> np.uint8(4)], axis=-1)
        hi = (s[..., None, 8:12] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & np.uint8(3)   # [k, i]: j = 4k + i
        sc = (lo | (hi.reshape(lead + (16,)) << np.uint8(4))).astype(np.int16) - 32
        return {"q": q, "sc": sc.astype(np.int8), "d": _h2f(b, 108)}
    if n == "IQ4_NL":
        return {"q": KVALUES_IQ4NL[_nibbles(b[..., 2:18])], "d": _h2f(b, 0)}
    if n == "MXFP4":
        return {"q": KVALUES_MXFP4[_nibbles(b[..., 1:17])], "d": e8m0_half(b[..., 0])}
    if n == "IQ4_XS":
        qs = b[..., 8:136].reshape(lead + (8, 16))
        q = KVALUES_IQ4NL[_nibbles(qs)]
        sh = b[..., 2].astype(np.uint16) | (b[..., 3].astype(np.uint16) << np.uint16(8))
        hi = ((sh[..., None] >> (2 * np.arange(8, dtype=np.uint16))) & np.uint16(3)).astype(np.uint8)
        sl = b[..., 4:8]
        lo = np.stack([sl & np.uint8(15), sl >> np.uint8(4)], axis=-1).reshape(lead + (8,))
        sc = (lo | (hi << np.uint8(4))).astype(np.int16) - 32
        return {"q": q, "sc": sc.astype(np.int8), "d": _h2f(b, 0)}
    raise AssertionError(n)  # pragma: no cover


def dequantize(raw, qtype, n_in):
    """Dequantize whole rows of GGUF bytes to a new float32 array (rows, n_in), bit-identical to
    gguf.quants.dequantize. raw: as for QTensor, or any array of whole rows (copied if needed)."""
    t = resolve_qtype(qtype)
    rb = _row_bytes(t, n_in)
    n_in = int(n_in)
    if t.block_size == 1:
        flat = _check_raw(np.ascontiguousarray(raw), t)
        if flat.size % rb:
            raise ValueError(f"raw: {flat.size} bytes is not a whole number of {t.name} rows of n_in={n_in} "
                             f"({rb} bytes each)")
        if t.name == "F32":
            out = flat.view("<f4").astype(np.float32)          # a copy, native order
        elif t.name == "F16":
            out = flat.view("<f2").astype(np.float32)
        else:  # BF16: the upper half of a float32
            out = (flat.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
        return out.reshape(-1, n_in)
    f = unpack_blocks(raw, t, n_in)
    with np.errstate(invalid="ignore", over="ignore"):      # any byte pattern decodes, inf/NaN d too
        x = _dequant_fields(t.name, f)
    return x.reshape(x.shape[0], n_in)


def _dequant_fields(n, f):
    d = f["d"]
    if n in ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "MXFP4"):
        x = f["q"].astype(np.float32) * d[..., None]
    elif n in ("Q4_1", "Q5_1"):
        x = d[..., None] * f["q"].astype(np.float32) + f["m"][..., None]
    elif n in ("Q4_K", "Q5_K"):
        a = d[..., None] * f["sc"].astype(np.float32)
        b = f["dmin"][..., None] * f["m"].astype(np.float32)
        x = a[..., None] * f["q"].astype(np.float32) - b[..., None]
    elif n == "Q2_K":  # f32(f32(d*sc)*q - f32(dmin*m)), 16-element sub-blocks
        a = d[..., None] * f["sc"].astype(np.float32)
        b = f["dmin"][..., None] * f["m"].astype(np.float32)
        x = a[..., None] * f["q"].astype(np.float32) - b[..., None]
    else:  # Q6_K, Q3_K, IQ4_XS: f32(d*sc) * q
        a = d[..., None] * f["sc"].astype(np.float32)
        x = a[..., None] * f["q"].astype(np.float32)
    return x


# ------------------------------------------------------------------------------------------------

class QTensor:
    """A weight matrix (n_out, n_in), or a stack of n_expert of them (n_expert, n_out, n_in), held
    as its GGUF bytes, without copying them.

    raw: the bytes as a C-contiguous numpy array of any shape: uint8 for every type, or float32
    (F32), float16/uint16 (F16), uint16 (BF16), e.g. `gguf.GGUFReader(path).tensors[i].data`
    (a memmap works). qtype: anything `resolve_qtype` accepts. shape: (n_out, n_in) or
    (n_expert, n_out, n_in), numpy order. `.raw` is a read-only uint8 view of the caller's buffer,
    (n_out, row_bytes) or (n_expert, n_out, row_bytes); the caller's array and its flags are left
    untouched. A 3-D tensor (n_expert > 0; 0 for a 2-D one) is a stack of contiguous 2-D slabs,
    expert e's being `qt[e]` (`qt.expert(e)`), a 2-D QTensor over the same bytes; `repack` lays out
    each slab as a 2-D weight would be, and the result still indexes per expert.
    """
    __slots__ = ("raw", "qtype", "type_id", "shape", "n_out", "n_in", "block_size", "type_size",
                 "row_bytes", "nbytes", "vec_dot_type", "layout", "_c", "n_expert", "_experts")

    def __init__(self, raw, qtype, shape):
        t = resolve_qtype(qtype)
        n_exp, n_out, n_in = _check_shape(shape)
        row_bytes = _row_bytes(t, n_in)
        flat = _check_raw(raw, t)
        want = max(n_exp, 1) * n_out * row_bytes
        if flat.size != want:
            sh = (n_exp, n_out, n_in) if n_exp else (n_out, n_in)
            raise ValueError(f"raw: a {t.name} tensor of shape {sh} needs {want} bytes "
                             f"({max(n_exp, 1) * n_out} rows x {row_bytes}), got {flat.size} bytes (raw shape "
                             f"{raw.shape}, dtype {raw.dtype})")
        v = flat.reshape(((n_exp,) if n_exp else ()) + (n_out, row_bytes))
        v.flags.writeable = False                # on our view only
        self._set(raw=v, qtype=t.name, type_id=t.type_id, shape=((n_exp,) if n_exp else ()) + (n_out, n_in),
                  n_out=n_out, n_in=n_in, block_size=t.block_size, type_size=t.type_size, row_bytes=row_bytes,
                  nbytes=want, vec_dot_type=t.vec_dot_type, layout="gguf", n_expert=n_exp, _experts=None,
                  _c=None)  # _c: raw as the kernels see it (pointers, span, geometry number): quant.matmul._wptr

    def _set(self, **fields):
        for k, v in fields.items():
            object.__setattr__(self, k, v)

    def _like(self, **fields):
        """a new QTensor with this one's fields but `fields` (no cached views)"""
        q = object.__new__(QTensor)
        q._set(**{k: getattr(self, k) for k in QTensor.__slots__})
        q._set(_c=None, _experts=None, **fields)
        return q

    def __setattr__(self, name, value):
        raise AttributeError(f"QTensor is immutable (cannot set {name!r})")

    def __delattr__(self, name):
        raise AttributeError(f"QTensor is immutable (cannot delete {name!r})")

    def expert(self, e):
        """expert e's weight of a 3-D tensor: a 2-D QTensor (n_out, n_in) over the same bytes (GGUF rows
        or P16 panels), made once per expert (the same object on every call)"""
        if not self.n_expert:
            raise TypeError(f"expert: a 2-D QTensor {self.shape} has no expert dimension")
        if isinstance(e, (bool, np.bool_)) or not isinstance(e, numbers.Integral):
            raise TypeError(f"expert index must be an int, got {type(e).__name__}")
        e = int(e)
        if not -self.n_expert <= e < self.n_expert:
            raise IndexError(f"expert index {e} is out of range for {self.n_expert} experts")
        e %= self.n_expert
        if self._experts is None:
            self._set(_experts=[None] * self.n_expert)
        if self._experts[e] is None:
            if self.layout == "gguf":
                raw, nb = self.raw[e], self.n_out * self.row_bytes
            else:   # a slab of P16 panels, at the start of expert e's (64-byte aligned) stride
                nb = self.nbytes // self.n_expert
                n_panels = (self.n_out + PANEL - 1) // PANEL
                raw = self.raw[e, :nb].reshape(n_panels, nb // n_panels)
            self._experts[e] = self._like(raw=raw, shape=(self.n_out, self.n_in), nbytes=nb, n_expert=0)
        return self._experts[e]

    def __getitem__(self, e):
        return self.expert(e)

    def __len__(self):
        if not self.n_expert:
            raise TypeError("len() of a 2-D QTensor (it has no expert dimension)")
        return self.n_expert

    def dequantize(self):
        """A new float32 array (n_out, n_in), or (n_expert, n_out, n_in), bit-identical to
        gguf.quants.dequantize."""
        if self.n_expert:
            return np.stack([self.expert(e).dequantize() for e in range(self.n_expert)])
        return dequantize(self.gguf_bytes(), self.qtype, self.n_in)

    def gguf_bytes(self):
        """The weight's GGUF rows, (n_out, row_bytes) uint8 (a 3-D tensor: (n_expert, n_out, row_bytes)):
        `raw` itself for the GGUF layout, a new array unpacked from the panels for a repacked tensor."""
        if self.layout == "gguf":
            return self.raw
        if self.n_expert:
            return np.stack([self.expert(e).gguf_bytes() for e in range(self.n_expert)])
        from .. import _backend
        out = np.empty((self.n_out, self.row_bytes), np.uint8)
        ffi, lib = _backend.ffi, _backend.lib
        n_panels = (self.n_out + PANEL - 1) // PANEL
        rc = lib.cf_unrepack_p16(self.type_id, self.n_out, self.n_in, ffi.from_buffer(self.raw),
                                 ffi.from_buffer(out, require_writable=True), self.row_bytes, 0, n_panels)
        if rc:  # pragma: no cover - every repacked type is known to the C side
            raise RuntimeError(f"cf_unrepack_p16 failed for {self.qtype}")
        return out

    def repack(self, isa=None):
        """This weight laid out for the kernels that will read it: for the native ISAs (scalar, avx2,
        avx512, neon) a new QTensor in the P16 panel layout (docs/quant-design.md): 16 rows
        interleaved per block, scales side by side, codes grouped for 16-lane int8 dots. The panel
        kernels then run without repacking on every call; results are bit-identical to the GGUF
        layout's on every path. Returns self when there is nothing to gain: float types (F32, F16,
        BF16), an already repacked tensor, isa="numba" (Numba reads GGUF rows), or no native
        extension. isa: None = the ISA in force (cpufuse.use_isa, CPUFUSE_ISA, else the best).
        A 3-D tensor repacks each expert's slab as its 2-D weight, into one buffer (n_expert, stride)
        whose rows start 64-byte aligned; `.expert(e)` of the result is expert e's repacked weight."""
        from .. import _backend, _dispatch, _pages
        isa = _dispatch.resolve(isa)
        if (self.layout != "gguf" or self.block_size == 1 or isa == "numba" or _backend.lib is None):
            return self
        ffi, lib = _backend.ffi, _backend.lib
        nbytes = int(lib.cf_p16_bytes(self.type_id, self.n_out, self.n_in))
        n_panels = (self.n_out + PANEL - 1) // PANEL
        n_e = max(self.n_expert, 1)
        stride = (nbytes + 63) // 64 * 64
        buf = _pages.empty(stride * n_e).reshape(n_e, stride)   # 64-byte aligned, on huge pages
        for e in range(n_e):
            src = self.raw[e] if self.n_expert else self.raw
            rc = lib.cf_repack_p16(self.type_id, self.n_out, self.n_in, ffi.from_buffer(src), self.row_bytes,
                                   ffi.from_buffer(buf[e], require_writable=True), 0, n_panels)
            if rc:  # pragma: no cover
                raise RuntimeError(f"cf_repack_p16 failed for {self.qtype}")
        buf.flags.writeable = False
        raw = buf if self.n_expert else buf[0, :nbytes].reshape(n_panels, nbytes // n_panels)
        return self._like(raw=raw, layout="p16", nbytes=nbytes * n_e)

    def __repr__(self):
        lay = "" if self.layout == "gguf" else f", layout={self.layout}"
        return (f"QTensor({self.qtype}, shape={self.shape}, {self.nbytes} bytes, "
                f"vec_dot_type={self.vec_dot_type}{lay})")


PANEL = 16  # weight rows per panel of the P16 layout


# ------------------------------------------------------------------------------------------------
# the C table: native/kernels/qtypes.h is GENERATED from _TABLE, ACT_QTYPES and CODE_OFFSET and
# checked in (tests/test_layouts.py fails when it is stale). After editing them:
#
#     python cpufuse/quant/types.py          # rewrites native/kernels/qtypes.h

HEADER = "qtypes.h"


def _wrap(head, items, sep, tail, cont=""):
    """head items... tail as lines of at most 110 characters, continued lines indented under the first item"""
    lines, cur = [], head
    for i, it in enumerate(items):
        piece = it + (sep.rstrip() if i + 1 < len(items) else tail)
        if cur.strip() and len(cur) + len(piece) + len(cont) > 110 and cur != head:
            lines.append(cur.rstrip() + cont)
            cur = " " * len(head)
        cur += piece + (" " if i + 1 < len(items) else "")
    return lines + [cur]


def _c_switch(fn, ret, doc, value, default):
    """a C function of a type id: one case line per distinct value of value(t) over the table"""
    by = {}
    for t in _TABLE:
        v = value(t)
        if v != default:
            by.setdefault(v, []).append(t.name)
    out = [f"/* {doc} */", f"CF_QT_FN {ret} {fn}(int64_t t) {{", "  switch (t) {"]
    for v, names in by.items():
        out.append("    " + " ".join(f"case GT_{n}:" for n in names) + f" return {v};")
    out += [f"    default: return {default};", "  }", "}"]
    return out


def generate():
    """the text of native/kernels/qtypes.h"""
    quant = [t for t in _TABLE if t.block_size > 1]
    blocks = list(_TABLE) + [t for n, t in ACT_QTYPES.items() if n not in QTYPES]

    def enum(prefix, rows):
        return _wrap("enum { ", [f"{prefix}{n} = {v}" for n, v in rows], ", ", " };")

    out = ["/* GENERATED by `python cpufuse/quant/types.py` from its type table (_TABLE, ACT_QTYPES,",
           " * CODE_OFFSET): the facts of the ggml block types that the C kernels and native/src/repack.c read.",
           " * Do not edit: change the table there and run the generator (tests/test_layouts.py checks",
           " * that this file is up to date). */",
           "#ifndef CF_QTYPES_H", "#define CF_QTYPES_H", "#include <stdint.h>", "",
           "/* the weight types by ggml / GGUF type id */",
           *enum("GT_", [(t.name, t.type_id) for t in _TABLE]),
           "/* the activation types of the vec_dots (what q8 mode quantizes x to), by ggml id; QA_F32: f32 */",
           *enum("QA_", [("F32", 0)] + [(n, t.type_id) for n, t in ACT_QTYPES.items()]),
           "/* elements (QK_) and bytes (QB_) per block, of every type above */",
           *enum("QK_", [(t.name, t.block_size) for t in blocks]),
           *enum("QB_", [(t.name, t.type_size) for t in blocks]),
           "/* X(T) for every quantized weight type T, in the table's order */",
           *_wrap("#define CF_QUANT_TYPES(X) ", [f"X({t.name})" for t in quant], " ", "", " \\"),
           "/* IQ4_NL / IQ4_XS: a 4-bit code indexes this table (KVALUES_IQ4NL), and its unsigned form v + 128 */",
           *_wrap("#define CF_KV_IQ4NL {", [str(int(v)) for v in KVALUES_IQ4NL], ", ", "}", " \\"),
           *_wrap("#define CF_KV_IQ4NL_U8 {", [str(int(v) + 128) for v in KVALUES_IQ4NL], ", ", "}", " \\"),
           "/* MXFP4: a 4-bit code indexes this table (KVALUES_MXFP4), and its unsigned form v + 128 */",
           *_wrap("#define CF_KV_MXFP4 {", [str(int(v)) for v in KVALUES_MXFP4], ", ", "}", " \\"),
           *_wrap("#define CF_KV_MXFP4_U8 {", [str(int(v) + 128) for v in KVALUES_MXFP4], ", ", "}", " \\"), "",
           "#if defined(__GNUC__)",
           "#define CF_QT_FN static inline __attribute__((always_inline))",
           "#else",
           "#define CF_QT_FN static inline",
           "#endif"]
    out += _c_switch("cf_qtype_block", "int", "elements per block: 1 for the float types, 0 for a type not "
                     "in the table", lambda t: t.block_size, 0)
    out += _c_switch("cf_qtype_bytes", "int64_t", "bytes per block (0: not in the table)", lambda t: t.type_size, 0)
    out += _c_switch("cf_qtype_act", "int", "the activation type of a weight type's vec_dot (QA_F32 for the "
                     "float types)", lambda t: f"QA_{t.vec_dot_type}" if t.vec_dot_type else "QA_F32", "QA_F32")
    out += _c_switch("cf_qtype_code_offset", "int", "CODE_OFFSET: a block stores the signed value v as the "
                     "code v + offset",
                     lambda t: CODE_OFFSET.get(t.name, 0), 0)
    out += ["", "#endif"]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import os
    import sys
    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "native", "kernels", HEADER)
    _text = generate()
    if not os.path.exists(_path) or open(_path).read() != _text:
        with open(_path, "w") as f:
            f.write(_text)
        print(f"wrote {_path}", file=sys.stderr)
