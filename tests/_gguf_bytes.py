"""Write GGUF bytes by hand, valid or not, for the malformed-file tests (no gguf-py: it refuses
much of what these tests need to write).

    kv = [KV("general.architecture", STRING, "llama"), KV("x", ARRAY, (UINT32, [1, 2]))]
    ts = [T("w", (32, 2), 2, raw_bytes)]          # name, ne, ggml type id, data (offset: packed)
    data = gguf_bytes(kv, ts)

A KV or T field can be replaced by raw bytes (`raw=`) to write what no well-formed value is.
`from_file(path)` reads a valid file back into (kv, tensors, alignment) lists to mutate.
"""
import struct
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_FMT = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
        BOOL: "<B", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
_NP = {UINT8: "<u1", INT8: "<i1", UINT16: "<u2", INT16: "<i2", UINT32: "<u4", INT32: "<i4", FLOAT32: "<f4",
       BOOL: "<u1", UINT64: "<u8", INT64: "<i8", FLOAT64: "<f8"}
TYPE_SIZES = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
              10: (256, 84), 12: (256, 144), 13: (256, 176), 14: (256, 210)}


def gstr(s):
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def value_bytes(t, v):
    if t == STRING:
        return gstr(v)
    if t == ARRAY:
        et, vals = v
        out = struct.pack("<IQ", et, len(vals))
        if et == STRING:
            return out + b"".join(gstr(s) for s in vals)
        if et == ARRAY:
            return out + b"".join(value_bytes(ARRAY, x) for x in vals)
        return out + np.asarray(vals).astype(_NP[et]).tobytes()
    return struct.pack(_FMT[t], v)


@dataclass
class KV:
    key: Any
    type: int
    value: Any = None
    raw: Optional[bytes] = None      # bytes written after the key instead of (type, value)

    def to_bytes(self):
        k = gstr(self.key)
        if self.raw is not None:
            return k + self.raw
        return k + struct.pack("<I", self.type) + value_bytes(self.type, self.value)


@dataclass
class T:
    name: Any
    ne: tuple
    type: int
    data: bytes = b""
    offset: Optional[int] = None      # None: packed after the previous tensor (aligned)
    n_dims: Optional[int] = None      # None: len(ne)

    def nbytes(self):
        bs, ts = TYPE_SIZES[self.type]
        n = 1
        for d in self.ne:
            n *= d
        return n // bs * ts


@dataclass
class Layout:
    magic: bytes = b"GGUF"
    version: int = 3
    n_tensors: Optional[int] = None
    n_kv: Optional[int] = None
    alignment: int = 32
    extra: dict = field(default_factory=dict)


def gguf_bytes(kv, tensors, layout=None):
    """the bytes of a GGUF file with these keys and tensors (offsets packed and aligned unless a
    tensor gives its own); the data section holds each tensor's `data` at its offset"""
    lay = layout or Layout()
    out = bytearray(lay.magic + struct.pack("<IQQ", lay.version,
                                             len(tensors) if lay.n_tensors is None else lay.n_tensors,
                                             len(kv) if lay.n_kv is None else lay.n_kv))
    for e in kv:
        out += e.to_bytes()
    a = lay.alignment
    off, offs = 0, []
    for t in tensors:
        o = off if t.offset is None else t.offset
        offs.append(o)
        off = -(-(o + len(t.data)) // a) * a if t.offset is None else off
    for t, o in zip(tensors, offs):
        nd = len(t.ne) if t.n_dims is None else t.n_dims
        out += gstr(t.name) + struct.pack("<I", nd) + b"".join(struct.pack("<Q", d) for d in t.ne)
        out += struct.pack("<IQ", t.type, o)
    out += bytes(-len(out) % a)
    base = len(out)
    for t, o in zip(tensors, offs):
        if t.data:
            end = base + o + len(t.data)
            if len(out) < end:
                out += bytes(end - len(out))
            out[base + o:end] = t.data
    return bytes(out)


def from_file(path):
    """(kv list, tensor list, alignment) of a valid GGUF file, read with cpufuse's reader"""
    from cpufuse.llama.gguf_file import GGUFFile
    f = GGUFFile(path)
    kv = []
    for k, v in f.kv.items():
        t, et = f.value_type_id(k)
        if t == ARRAY:
            kv.append(KV(k, ARRAY, (et, v if et == STRING else np.asarray(v))))
        else:
            kv.append(KV(k, t, v))
    ts = [T(t.name, t.ne, t.type_id, bytes(t.data)) for t in f.tensors.values()]
    return kv, ts, f.alignment


def set_kv(kv, key, type_, value):
    """replace (or append) key in the kv list"""
    for i, e in enumerate(kv):
        if e.key == key:
            kv[i] = KV(key, type_, value)
            return kv
    kv.append(KV(key, type_, value))
    return kv


def del_kv(kv, key):
    return [e for e in kv if e.key != key]
