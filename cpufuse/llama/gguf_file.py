"""cpufuse's own GGUF reader: a GGUF file is untrusted input.

    f = GGUFFile("model.gguf")
    f.kv["general.architecture"]            # 'llama'   (every key, parsed; see below)
    f.value_type("llama.block_count")        # 'uint32'
    t = f.tensors["blk.0.attn_q.weight"]     # GGUFTensor
    t.ne, t.shape, t.type_name, t.nbytes     # (576, 576), (576, 576), 'Q4_1', 207360
    t.data                                   # read-only uint8 view of the file, zero-copy

The whole file is mapped once (a read-only mmap); every tensor's `data` is a numpy view of it.
Nothing is mapped or viewed before the layout has been checked:

* header: magic "GGUF", version 2 or 3 (little-endian), tensor and key counts;
* keys: every declared length (a key, a string, an array's element count) is checked against the
  bytes left in the file before anything is allocated or looped over, so memory and time stay
  proportional to the bytes actually read; duplicate keys are refused; strings must be UTF-8;
  arrays may nest (at most `MAX_ARRAY_DEPTH` levels);
* `general.alignment`: uint32, a power of two in [1, `MAX_ALIGNMENT`] (default 32);
* tensor infos: a unique UTF-8 name, 1 to 4 dims each >= 1 (a dim of 0 is refused: no weight is
  empty, and an empty tensor would have no bytes to check), a known ggml type, ne[0] a multiple of
  the type's block size; then, against the file: the offset aligned to `general.alignment`, offset +
  size within the data section (Python ints: no wrap-around), and no two tensors sharing a byte.

Every violation raises ValueError naming the key or tensor, what was expected and what was found;
a file that ends too early says "truncated" and the offset where it ends. A path that is not a
regular file (a FIFO, a device, a directory) is refused before it is opened (opening a FIFO would
block), and again after (fstat of the opened file).

Values: integers -> int, floats -> float, bool -> bool, string -> str; arrays of numbers or bools
-> a numpy array (a copy, native byte order), arrays of strings -> list of str, nested arrays -> a
list of such values.

A tensor whose type cpufuse cannot compute (Q2_K, IQ*, ...) still loads here when its size is
known (`GGUFTensor.supported` is False); the model refuses it only where it needs that weight.
The mapping stays valid while any view of it is alive; truncating or rewriting the file while it
is mapped changes or invalidates the views (a property of memory mapping).
"""
from __future__ import annotations

import mmap
import os
import stat
import struct

import numpy as np

from cpufuse.quant.types import ACT_QTYPES, QTYPES

__all__ = ["GGUFFile", "GGUFTensor", "GGUF_MAGIC", "DEFAULT_ALIGNMENT", "MAX_ALIGNMENT", "MAX_DIMS",
           "VALUE_TYPES", "GGML_TYPES"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 20        # 1 MiB: far above any writer's choice (32, 64, a 4 KiB page)
MAX_DIMS = 4                   # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4            # arrays of arrays of ... (llama.cpp reads none; gguf-py any)

# GGUF value types: id -> (name, struct format, numpy dtype); STRING and ARRAY have no fixed size
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, \
    T_UINT64, T_INT64, T_FLOAT64 = range(13)
VALUE_TYPES = {
    T_UINT8: ("uint8", "<B", "<u1"), T_INT8: ("int8", "<b", "<i1"), T_UINT16: ("uint16", "<H", "<u2"),
    T_INT16: ("int16", "<h", "<i2"), T_UINT32: ("uint32", "<I", "<u4"), T_INT32: ("int32", "<i", "<i4"),
    T_FLOAT32: ("float32", "<f", "<f4"), T_BOOL: ("bool", "<B", "<u1"), T_STRING: ("string", None, None),
    T_ARRAY: ("array", None, None), T_UINT64: ("uint64", "<Q", "<u8"), T_INT64: ("int64", "<q", "<i8"),
    T_FLOAT64: ("float64", "<d", "<f8"),
}
_SCALAR = {k: struct.Struct(v[1]) for k, v in VALUE_TYPES.items() if v[1]}
_DTYPE = {k: np.dtype(v[2]) for k, v in VALUE_TYPES.items() if v[2]}
_INT_TYPES = frozenset((T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_UINT64, T_INT64))
_FLOAT_TYPES = frozenset((T_FLOAT32, T_FLOAT64))
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")      # magic, version, n_tensors, n_kv

# ggml tensor types: id -> (name, elements per block, bytes per block). cpufuse's own table
# (cpufuse.quant.types: the weight types it computes and the activation types), plus the sizes of
# the others that GGUF files carry (ggml's type traits), so that such a tensor can still be sized
# and bounds-checked.
GGML_TYPES = {t.type_id: (t.name, t.block_size, t.type_size) for t in QTYPES.values()}
_SUPPORTED_IDS = frozenset(GGML_TYPES)
GGML_TYPES.update({t.type_id: (t.name, t.block_size, t.type_size) for t in ACT_QTYPES.values()})   # Q8_1, Q8_K
GGML_TYPES.update({
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4),
    27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
})
# ids ggml once used (removed file types) or that this reader cannot size
_UNSIZED = {4: "Q4_2 (removed from ggml)", 5: "Q4_3 (removed from ggml)", 31: "Q4_0_4_4 (removed)",
            32: "Q4_0_4_8 (removed)", 33: "Q4_0_8_8 (removed)", 36: "IQ4_NL_4_4 (removed)",
            37: "IQ4_NL_4_8 (removed)", 38: "IQ4_NL_8_8 (removed)", 42: "Q2_0 (size unknown to this reader)"}


def _type_name(t, et=None):
    n = VALUE_TYPES[t][0]
    return f"array[{VALUE_TYPES[et][0] if et in VALUE_TYPES else et}]" if t == T_ARRAY else n


class GGUFTensor:
    """One tensor of a GGUFFile: name, ne (ggml order: ne[0] is the row length), shape (numpy
    order, reversed ne), ggml type (type_id, type_name), offset (from the data section's start),
    nbytes, and data: a read-only flat uint8 view of its bytes in the mapped file."""
    __slots__ = ("name", "ne", "type_id", "type_name", "block_size", "type_size", "offset", "file_offset",
                 "nbytes", "n_elements", "data")

    @property
    def shape(self):
        return tuple(reversed(self.ne))

    @property
    def n_dims(self):
        return len(self.ne)

    @property
    def supported(self):
        """whether cpufuse's kernels compute this type (cpufuse.quant.types)"""
        return self.type_id in _SUPPORTED_IDS

    @property
    def tensor_type(self):          # gguf-py's name for the type id
        return self.type_id

    def __repr__(self):
        return (f"GGUFTensor({self.name!r}, ne={self.ne}, {self.type_name}, offset={self.offset}, "
                f"{self.nbytes} bytes)")


class _Cursor:
    """Bounds-checked little-endian reads from the mapped header region."""
    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf, end):
        self.buf, self.pos, self.end = buf, 0, end

    def need(self, n, what):
        if n > self.end - self.pos:
            raise ValueError(f"GGUF truncated: {what} needs {n} bytes at offset {self.pos}, but the file "
                             f"ends at offset {self.end}")

    def u32(self, what):
        self.need(4, what)
        v = _U32.unpack_from(self.buf, self.pos)[0]
        self.pos += 4
        return v

    def u64(self, what):
        self.need(8, what)
        v = _U64.unpack_from(self.buf, self.pos)[0]
        self.pos += 8
        return v

    def string(self, what):
        n = self.u64(what + " (its length)")
        if n > self.end - self.pos:
            raise ValueError(f"GGUF truncated: {what} declares a string of {n} bytes at offset {self.pos}, "
                             f"but the file ends at offset {self.end}")
        p = self.pos
        self.pos = p + n
        try:
            return self.buf[p:p + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"GGUF: {what} is not valid UTF-8 ({e.reason} at byte {e.start} of the "
                             f"string at offset {p})") from None


class GGUFFile:
    """A GGUF file, parsed and checked (see the module docstring). Attributes: path, version,
    file_size, alignment, data_offset (where the data section starts), kv (key -> value, in file
    order), tensors (name -> GGUFTensor, in file order), parts (the part files: [self] unless split).

    split=True: a file with split.count > 1 is the first part of a split GGUF, and the other parts'
    tensors join its own (cpufuse.llama.gguf_split, every part checked); False reads this file
    alone."""

    def __init__(self, path, split=True):
        path = os.fspath(path)
        self.path = path
        self.parts = [self]
        st = os.stat(path)        # FileNotFoundError as usual; checked before open (a FIFO blocks open)
        _check_regular(st, path)
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags)
        try:
            fst = os.fstat(fd)
            _check_regular(fst, path)
            if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
                raise ValueError(f"GGUF {path}: the file was replaced while it was being opened")
            size = fst.st_size
            if size < _HEADER.size:
                raise ValueError(f"GGUF truncated: the header needs {_HEADER.size} bytes, but the file ends at "
                                 f"offset {size}")
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.file_size = size
        self._mm = mm
        self._parse(mm, size)
        if split and "split.count" in self.kv:
            from .gguf_split import join
            join(self)

    # ---------------------------------------------------------------------------------- parsing
    def _parse(self, mm, size):
        magic, version, n_tensors, n_kv = _HEADER.unpack_from(mm, 0)
        if magic != GGUF_MAGIC:
            raise ValueError(f"not a GGUF file: magic {magic!r} at offset 0, expected {GGUF_MAGIC!r}")
        if version not in SUPPORTED_VERSIONS:
            if version & 0xFFFF == 0 and (version >> 24) in SUPPORTED_VERSIONS:
                raise ValueError(f"GGUF version field {version:#010x}: a big-endian GGUF, which is not "
                                 "supported (expected a little-endian file)")
            raise ValueError(f"GGUF version {version} is not supported (expected one of "
                             f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
        self.version = version
        c = _Cursor(mm, size)
        c.pos = _HEADER.size
        # the smallest key/value is 13 bytes (empty key, type, one byte), the smallest tensor info 32
        if n_kv * 13 > size - c.pos:
            raise ValueError(f"GGUF truncated: the header declares {n_kv} keys, which need at least "
                             f"{n_kv * 13} bytes from offset {c.pos}, but the file ends at offset {size}")
        if n_tensors * 32 > size - c.pos:
            raise ValueError(f"GGUF truncated: the header declares {n_tensors} tensors, whose infos need at "
                             f"least {n_tensors * 32} bytes from offset {c.pos}, but the file ends at offset {size}")
        kv, types = {}, {}
        for i in range(n_kv):
            key = c.string(f"key #{i}")
            if key in kv:
                raise ValueError(f"GGUF key {key!r} appears twice (key #{i} repeats an earlier key)")
            t = c.u32(f"key {key!r}: its value type")
            if t not in VALUE_TYPES:
                raise ValueError(f"GGUF key {key!r}: value type {t} is not a GGUF type (expected 0..12)")
            if t == T_ARRAY:
                kv[key], et = self._array(c, key, 0)
                types[key] = (t, et)
            else:
                kv[key] = self._scalar(c, t, f"key {key!r}")
                types[key] = (t, None)
        self.kv, self._types = kv, types

        align = DEFAULT_ALIGNMENT
        if "general.alignment" in kv:
            t = types["general.alignment"][0]
            align = kv["general.alignment"]
            if t != T_UINT32:
                raise ValueError(f"GGUF key 'general.alignment': type {_type_name(*types['general.alignment'])}, "
                                 "expected uint32")
            if not (1 <= align <= MAX_ALIGNMENT and align & (align - 1) == 0):
                raise ValueError(f"GGUF key 'general.alignment' = {align}: expected a power of two in "
                                 f"[1, {MAX_ALIGNMENT}]")
        self.alignment = align

        infos = []
        names = set()
        for i in range(n_tensors):
            name = c.string(f"tensor info #{i}: the name")
            if name in names:
                raise ValueError(f"GGUF tensor {name!r} appears twice (tensor info #{i} repeats an earlier name)")
            names.add(name)
            what = f"tensor {name!r}"
            nd = c.u32(what + ": n_dims")
            if not 1 <= nd <= MAX_DIMS:
                raise ValueError(f"GGUF {what}: n_dims = {nd}, expected 1..{MAX_DIMS}")
            c.need(8 * nd, what + ": its dims")
            ne = struct.unpack_from(f"<{nd}Q", mm, c.pos)
            c.pos += 8 * nd
            if min(ne) < 1:
                raise ValueError(f"GGUF {what}: dims ne = {list(ne)}, every dim must be >= 1")
            tid = c.u32(what + ": type")
            off = c.u64(what + ": offset")
            infos.append((name, ne, tid, off))

        data_offset = -(-c.pos // align) * align
        self.data_offset = data_offset
        data_size = size - data_offset
        tensors = {}
        spans = []
        for name, ne, tid, off in infos:
            t = self._tensor(name, ne, tid, off, data_size)
            tensors[name] = t
            spans.append((off, off + t.nbytes, name))
        spans.sort()
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise ValueError(f"GGUF tensors {an!r} and {bn!r} overlap: {an!r} spans bytes [{a0}, {a1}) of "
                                 f"the data section and {bn!r} starts at {b0}, expected >= {a1}")
        if tensors:
            base = np.frombuffer(self._mm, dtype=np.uint8)
            for t in tensors.values():
                t.data = base[t.file_offset:t.file_offset + t.nbytes]
        self.tensors = tensors

    def _scalar(self, c, t, what):
        if t == T_STRING:
            return c.string(what)
        s = _SCALAR[t]
        c.need(s.size, f"{what} ({VALUE_TYPES[t][0]})")
        v = s.unpack_from(c.buf, c.pos)[0]
        c.pos += s.size
        return bool(v) if t == T_BOOL else v

    def _array(self, c, key, depth):
        """(value, element type) of the array at the cursor"""
        what = f"key {key!r}"
        et = c.u32(what + ": its array element type")
        n = c.u64(what + ": its array length")
        if et not in VALUE_TYPES:
            raise ValueError(f"GGUF {what}: array element type {et} is not a GGUF type (expected 0..12)")
        left = c.end - c.pos
        if et == T_STRING or et == T_ARRAY:
            least = 8 if et == T_STRING else 12
            if n * least > left:
                raise ValueError(f"GGUF truncated: {what} declares an array of {n} {VALUE_TYPES[et][0]}s, which "
                                 f"needs at least {n * least} bytes from offset {c.pos}, but the file ends at "
                                 f"offset {c.end} ({left} bytes left)")
            if et == T_STRING:
                return _read_strings(c, n, what), et
            if depth + 1 >= MAX_ARRAY_DEPTH:
                raise ValueError(f"GGUF {what}: arrays nested more than {MAX_ARRAY_DEPTH} deep")
            # each element is itself an array: element type, length, data
            return [self._array(c, key, depth + 1)[0] for _ in range(n)], et
        dt = _DTYPE[et]
        nb = n * dt.itemsize
        if nb > left:
            raise ValueError(f"GGUF truncated: {what} declares an array of {n} {VALUE_TYPES[et][0]} elements "
                             f"({nb} bytes) at offset {c.pos}, but the file ends at offset {c.end} "
                             f"({left} bytes left)")
        a = np.frombuffer(c.buf, dtype=dt, count=n, offset=c.pos)
        c.pos += nb
        a = a != 0 if et == T_BOOL else a.astype(dt.newbyteorder("="))   # a copy, native order
        return a, et

    def _tensor(self, name, ne, tid, off, data_size):
        what = f"tensor {name!r}"
        ty = GGML_TYPES.get(tid)
        if ty is None:
            if tid in _UNSIZED:
                raise ValueError(f"GGUF {what}: ggml type id {tid} = {_UNSIZED[tid]}: its block size is not known, "
                                 "so its bytes cannot be checked")
            raise ValueError(f"GGUF {what}: type id {tid} is not a ggml type (known: {sorted(GGML_TYPES)})")
        tname, bs, ts = ty
        if ne[0] % bs:
            raise ValueError(f"GGUF {what}: ne[0] = {ne[0]} is not a multiple of the {tname} block size {bs} "
                             f"(dims ne = {list(ne)})")
        n_el = 1
        for d in ne:
            n_el *= d
        nbytes = n_el // bs * ts
        end = off + nbytes
        if end > data_size:
            raise ValueError(f"GGUF truncated: {what} ({tname}, ne = {list(ne)}, {nbytes} bytes) spans bytes "
                             f"[{off}, {end}) of the data section, but the data section has {max(data_size, 0)} "
                             f"bytes (it starts at offset {self.data_offset}; the file ends at offset "
                             f"{self.file_size})")
        if off % self.alignment:
            raise ValueError(f"GGUF {what}: offset {off} is not a multiple of the alignment {self.alignment} "
                             "(general.alignment)")
        t = GGUFTensor()
        t.name, t.ne, t.type_id, t.type_name, t.block_size, t.type_size = name, tuple(ne), tid, tname, bs, ts
        t.offset, t.file_offset, t.nbytes, t.n_elements, t.data = off, self.data_offset + off, nbytes, n_el, None
        return t

    # ----------------------------------------------------------------------------------- access
    def release(self, arr):
        """Drop the pages wholly inside `arr` (a view of this file's mapping, e.g. a weight that was
        just repacked into its own memory) from the process's resident memory (madvise DONTNEED;
        they stay in the page cache and fault back in if read again). No-op elsewhere."""
        if len(self.parts) > 1:
            for p in self.parts:
                p._release(arr)      # a no-op unless arr lies in its mapping
            return
        self._release(arr)

    def _release(self, arr):
        if not hasattr(self._mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        base = np.frombuffer(self._mm, dtype=np.uint8).ctypes.data
        a = arr.ctypes.data - base
        if a < 0 or a + arr.nbytes > len(self._mm):
            return
        page = mmap.PAGESIZE
        lo, hi = -(-a // page) * page, (a + arr.nbytes) // page * page
        if hi > lo:
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def get(self, key, default=None):
        return self.kv.get(key, default)

    def __contains__(self, key):
        return key in self.kv

    def value_type(self, key):
        """the GGUF type of a key's value, as a string: 'uint32', 'string', 'array[string]', ..."""
        return _type_name(*self._types[key])

    def value_type_id(self, key):
        """(type id, element type id or None) of a key's value"""
        return self._types[key]

    def is_int(self, key):
        return self._types[key][0] in _INT_TYPES

    def is_number(self, key):
        return self._types[key][0] in _INT_TYPES or self._types[key][0] in _FLOAT_TYPES

    def __repr__(self):
        return (f"GGUFFile({os.path.basename(self.path)!r}, v{self.version}, {len(self.kv)} keys, "
                f"{len(self.tensors)} tensors, {self.file_size} bytes"
                f"{f', {len(self.parts)} parts' if len(self.parts) > 1 else ''})")


def _read_strings(c, n, what):
    """n length-prefixed UTF-8 strings at the cursor, each length checked before it is read"""
    buf, pos, end = c.buf, c.pos, c.end
    unpack = _U64.unpack_from
    out = [None] * n
    i = 0
    try:
        for i in range(n):
            if pos + 8 > end:
                raise ValueError(f"GGUF truncated: {what}: string #{i} of {n} needs its 8-byte length at offset "
                                 f"{pos}, but the file ends at offset {end}")
            k = unpack(buf, pos)[0]
            pos += 8
            if k > end - pos:
                raise ValueError(f"GGUF truncated: {what}: string #{i} of {n} declares {k} bytes at offset {pos}, "
                                 f"but the file ends at offset {end}")
            out[i] = buf[pos:pos + k].decode("utf-8")
            pos += k
    except UnicodeDecodeError as e:
        raise ValueError(f"GGUF: {what}: string #{i} of {n} (at offset {pos}) is not valid UTF-8 "
                         f"({e.reason} at byte {e.start})") from None
    c.pos = pos
    return out


def _check_regular(st, path):
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
                else "a character device" if stat.S_ISCHR(st.st_mode) else "a block device"
                if stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise ValueError(f"GGUF {path}: expected a regular file, found {kind}")
