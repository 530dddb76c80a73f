"""cpufuse.llama.gguf_file: the GGUF reader on valid files (against gguf-py's reader) and on a
corpus of malformed files generated here (tests/_gguf_bytes.py): every case raises ValueError
naming the key or tensor with what was expected and what was found, within a second, and never
crashes, hangs or allocates what the file only declares."""
import os
import random
import stat
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from _gguf_bytes import (ARRAY, BOOL, FLOAT32, FLOAT64, INT8, INT16, INT32, INT64, KV, STRING, UINT8,
                         UINT16, UINT32, UINT64, Layout, T, from_file, gguf_bytes, gstr)
from cpufuse.llama.gguf_file import MAX_ALIGNMENT, GGUFFile

gguf = pytest.importorskip("gguf")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def q4_0_bytes(n_blocks, seed=0):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_blocks, 18), dtype=np.uint8)
    raw[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw.tobytes()


def f32_bytes(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype("<f4").tobytes()


BASE_KV = [KV("general.architecture", STRING, "llama"), KV("general.name", STRING, "x")]


def base_tensors():
    return [T("a", (64, 2), 2, q4_0_bytes(4)), T("b", (8,), 0, f32_bytes(8)), T("c", (16, 3), 1, bytes(96))]


def write(tmp_path, data, name="t.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


def bad(tmp_path, data, *frags, exc=ValueError):
    """GGUFFile on `data` raises exc within a second, its message containing every fragment"""
    p = write(tmp_path, data)
    t = time.perf_counter()
    with pytest.raises(exc) as ei:
        GGUFFile(p)
    dt = time.perf_counter() - t
    assert dt < 1.0, dt
    msg = str(ei.value)
    for f in frags:
        assert f in msg, (f, msg)
    return msg


# ------------------------------------------------------------------------------------------------
# valid files

@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    from _tiny_gguf import write_tiny_gguf
    return write_tiny_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf", qtype="Q4_0",
                           extra=lambda w: (w.add_array("test.nested", [[1, 2], [3]]),
                                            w.add_array("test.floats", [0.5, -1.25]),
                                            w.add_bool("test.flag", True),
                                            w.add_int64("test.i64", -5), w.add_float64("test.f64", 0.1)))


def test_matches_gguf_py_reader(tiny_file):
    f = GGUFFile(tiny_file)
    r = gguf.GGUFReader(tiny_file)
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    assert list(f.kv) == keys
    for k in keys:
        ref = r.fields[k].contents()
        got = f.kv[k]
        if k == "test.nested":       # gguf-py flattens an array of arrays; cpufuse keeps the nesting
            got = np.concatenate(got)
        if isinstance(got, np.ndarray):
            np.testing.assert_array_equal(got, np.asarray(ref))
        else:
            assert got == ref, k
    assert f.kv["test.nested"][0].tolist() == [1, 2] and f.value_type("test.nested") == "array[array]"
    assert f.value_type("tokenizer.ggml.tokens") == "array[string]" and f.value_type("test.flag") == "bool"
    assert f.kv["test.f64"] == 0.1 and f.kv["test.i64"] == -5 and f.kv["test.flag"] is True
    assert list(f.tensors) == [t.name for t in r.tensors]
    for t in r.tensors:
        g = f.tensors[t.name]
        assert g.ne == tuple(int(x) for x in t.shape) and g.type_id == int(t.tensor_type)
        assert g.nbytes == t.n_bytes and g.file_offset == t.data_offset
        np.testing.assert_array_equal(g.data, np.asarray(t.data).reshape(-1).view(np.uint8))
        assert not g.data.flags.writeable


def test_zero_copy_views_of_one_map(tiny_file):
    f = GGUFFile(tiny_file)
    bases = {id(_root(t.data)) for t in f.tensors.values()}
    assert len(bases) == 1                       # every tensor is a view of the same mapping
    t = f.tensors["token_embd.weight"]
    assert t.data.ctypes.data % 32 == 0 and t.supported and t.shape == tuple(reversed(t.ne))


def _root(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a.base if a.base is not None else a


def test_handmade_file_every_value_type(tmp_path):
    kv = BASE_KV + [KV("u8", UINT8, 255), KV("i8", INT8, -3), KV("u16", UINT16, 65535), KV("i16", INT16, -2),
                    KV("u32", UINT32, 2 ** 32 - 1), KV("i32", INT32, -7), KV("f32", FLOAT32, 1.5),
                    KV("b", BOOL, 0), KV("s", STRING, "héllo"), KV("u64", UINT64, 2 ** 64 - 1),
                    KV("i64", INT64, -(2 ** 63)), KV("f64", FLOAT64, -2.5),
                    KV("ab", ARRAY, (BOOL, [1, 0, 1])), KV("ai16", ARRAY, (INT16, [-1, 2])),
                    KV("as", ARRAY, (STRING, ["", "x", "é"])), KV("aa", ARRAY, (ARRAY, [(UINT8, [1]), (STRING, ["s"])])),
                    KV("empty", ARRAY, (UINT32, []))]
    f = GGUFFile(write(tmp_path, gguf_bytes(kv, base_tensors())))
    assert (f.kv["u8"], f.kv["i8"], f.kv["u16"], f.kv["i16"], f.kv["u32"], f.kv["i32"]) == (255, -3, 65535, -2, 2 ** 32 - 1, -7)
    assert f.kv["f32"] == 1.5 and f.kv["b"] is False and f.kv["s"] == "héllo"
    assert f.kv["u64"] == 2 ** 64 - 1 and f.kv["i64"] == -(2 ** 63) and f.kv["f64"] == -2.5
    assert f.kv["ab"].tolist() == [True, False, True] and f.kv["ai16"].dtype == np.int16
    assert f.kv["as"] == ["", "x", "é"] and f.kv["aa"][0].tolist() == [1] and f.kv["aa"][1] == ["s"]
    assert f.kv["empty"].size == 0 and f.version == 3 and f.alignment == 32
    assert [t.type_name for t in f.tensors.values()] == ["Q4_0", "F32", "F16"]
    np.testing.assert_array_equal(f.tensors["b"].data.view("<f4"), np.frombuffer(f32_bytes(8), "<f4"))


def test_version_2_alignment_and_unsupported_type(tmp_path):
    ts = [T("a", (64, 2), 2, q4_0_bytes(4)), T("iq3s", (256, 1), 21, bytes(110)), T("odd", (3,), 0, bytes(12))]
    kv = BASE_KV + [KV("general.alignment", UINT32, 64)]
    f = GGUFFile(write(tmp_path, gguf_bytes(kv, ts, Layout(version=2, alignment=64))))
    assert f.version == 2 and f.alignment == 64 and f.data_offset % 64 == 0
    assert [t.offset % 64 for t in f.tensors.values()] == [0, 0, 0]
    q = f.tensors["iq3s"]
    assert q.type_name == "IQ3_S" and not q.supported and q.nbytes == 110  # sized and checked, not refused
    f1 = GGUFFile(write(tmp_path, gguf_bytes(BASE_KV + [KV("general.alignment", UINT32, 1)], ts, Layout(alignment=1)),
                        "a1.gguf"))
    assert f1.alignment == 1


def test_llama3_sized_vocab_parses_fast(tmp_path):
    toks = [f"tok{i}\u0120x" for i in range(128256)]
    kv = BASE_KV + [KV("tokenizer.ggml.tokens", ARRAY, (STRING, toks)),
                    KV("tokenizer.ggml.merges", ARRAY, (STRING, toks[:200000])),
                    KV("tokenizer.ggml.token_type", ARRAY, (INT32, np.ones(128256, np.int32)))]
    p = write(tmp_path, gguf_bytes(kv, base_tensors()))
    t = time.perf_counter()
    f = GGUFFile(p)
    dt = time.perf_counter() - t
    assert f.kv["tokenizer.ggml.tokens"] == toks and f.kv["tokenizer.ggml.token_type"].shape == (128256,)
    assert dt < 0.8, dt          # ~0.15 s here; gguf-py's reader takes several seconds


# ------------------------------------------------------------------------------------------------
# the malformed corpus: header

def test_header(tmp_path):
    good = gguf_bytes(BASE_KV, base_tensors())
    bad(tmp_path, b"", "truncated", "offset 0")
    bad(tmp_path, good[:10], "truncated", "offset 10")
    bad(tmp_path, b"GGML" + good[4:], "magic", "b'GGML'", "b'GGUF'")
    bad(tmp_path, gguf_bytes(BASE_KV, base_tensors(), Layout(version=1)), "version 1", "2, 3")
    bad(tmp_path, gguf_bytes(BASE_KV, base_tensors(), Layout(version=4)), "version 4")
    bad(tmp_path, b"GGUF" + struct.pack(">I", 3) + good[8:], "big-endian")
    bad(tmp_path, gguf_bytes(BASE_KV, base_tensors(), Layout(n_kv=2 ** 60)), "truncated", str(2 ** 60), "keys")
    bad(tmp_path, gguf_bytes(BASE_KV, base_tensors(), Layout(n_tensors=2 ** 63)), "truncated", str(2 ** 63),
        "tensors")
    bad(tmp_path, gguf_bytes(BASE_KV, base_tensors(), Layout(n_kv=3)))   # a third key read from the tensor infos


# ------------------------------------------------------------------------------------------------
# keys and values

def test_huge_array_declared_at_the_end_fails_fast(tmp_path):
    """the issue's case: a ~79 KB file whose last key declares a uint8 array of 2^40 elements"""
    kv = BASE_KV + [KV(f"pad.{i}", STRING, "x" * 700) for i in range(110)]
    kv.append(KV("evil", 0, raw=struct.pack("<IIQ", ARRAY, UINT8, 2 ** 40) + bytes(16)))
    data = gguf_bytes(kv, [])
    assert 75_000 < len(data) < 85_000
    msg = bad(tmp_path, data, "'evil'", str(2 ** 40), "truncated", f"offset {len(data)}")
    assert "uint8" in msg
    for et, least in ((STRING, 8), (ARRAY, 12), (UINT64, 8)):
        kv[-1] = KV("evil", 0, raw=struct.pack("<IIQ", ARRAY, et, 2 ** 61))
        bad(tmp_path, gguf_bytes(kv, []), "'evil'", str(2 ** 61), "truncated")


def test_key_and_string_lengths(tmp_path):
    bad(tmp_path, b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2 ** 63) + bytes(64), "key #0", str(2 ** 63), "truncated")
    bad(tmp_path, gguf_bytes([KV("k", 0, raw=struct.pack("<IQ", STRING, 2 ** 62) + b"abc")], []),
        "'k'", str(2 ** 62), "truncated")
    d = gguf_bytes([KV("k", 0, raw=struct.pack("<I", UINT64) + b"\x01\x02")], [])
    cut = d.index(b"k\x0a\x00\x00\x00") + 7           # 2 of the value's 8 bytes, then the file ends
    bad(tmp_path, d[:cut], "'k'", "uint64", "truncated", f"ends at offset {cut}")
    # a string array whose 3rd string runs past the end
    raw = struct.pack("<IIQ", ARRAY, STRING, 3) + gstr("a") + gstr("b") + struct.pack("<Q", 50) + b"xy"
    bad(tmp_path, gguf_bytes([KV("toks", 0, raw=raw)], []), "'toks'", "string #2 of 3", "50 bytes", "truncated")
    bad(tmp_path, gguf_bytes([KV(b"\xff\xfekey", STRING, "v")], []), "key #0", "UTF-8")
    bad(tmp_path, gguf_bytes([KV("s", STRING, b"ok\xc3(")], []), "'s'", "UTF-8")
    bad(tmp_path, gguf_bytes([KV("t", ARRAY, (STRING, ["ok", b"\xed\xa0\x80"]))], []), "'t'", "string #1", "UTF-8")


def test_types_and_duplicates(tmp_path):
    bad(tmp_path, gguf_bytes([KV("k", 0, raw=struct.pack("<I", 13))], []), "'k'", "value type 13", "0..12")
    bad(tmp_path, gguf_bytes([KV("k", 0, raw=struct.pack("<IIQ", ARRAY, 99, 1))], []), "'k'", "element type 99")
    bad(tmp_path, gguf_bytes(BASE_KV + [KV("general.name", STRING, "y")], []), "'general.name'", "twice")
    nest = (UINT8, [1])
    for _ in range(4):
        nest = (ARRAY, [nest])
    bad(tmp_path, gguf_bytes([KV("deep", ARRAY, nest)], []), "'deep'", "nested more than 4")
    # an array element type that is not ARRAY inside an array of arrays reads as the nested array's type
    raw = struct.pack("<IIQ", ARRAY, ARRAY, 1) + struct.pack("<IQ", 77, 1)
    bad(tmp_path, gguf_bytes([KV("k", 0, raw=raw)], []), "'k'", "element type 77")


@pytest.mark.parametrize("t,v,frag", [(UINT64, 32, "expected uint32"), (UINT32, 0, "power of two"),
                                      (UINT32, 48, "power of two"), (UINT32, 2 * MAX_ALIGNMENT, "power of two")])
def test_alignment_key(tmp_path, t, v, frag):
    msg = bad(tmp_path, gguf_bytes(BASE_KV + [KV("general.alignment", t, v)], base_tensors()),
              "'general.alignment'", frag)
    if t == UINT32:
        assert f"= {v}" in msg and str(MAX_ALIGNMENT) in msg


# ------------------------------------------------------------------------------------------------
# tensor infos and the data section

def test_tensor_infos(tmp_path):
    def case(ts, *frags, lay=None):
        return bad(tmp_path, gguf_bytes(BASE_KV, ts, lay), *frags)
    ts = base_tensors()
    case([T("a", (), 0, b"", n_dims=0)] + ts[1:], "'a'", "n_dims = 0", "1..4")
    case([T("a", (2, 2, 2, 2, 2), 0, bytes(128))] + ts[1:], "'a'", "n_dims = 5", "1..4")
    case([T("a", (64, 0), 2, b"")] + ts[1:], "'a'", "[64, 0]", ">= 1")
    case([T("a", (64, 2), 99, q4_0_bytes(4))] + ts[1:], "'a'", "type id 99", "not a ggml type")
    case([T("a", (64, 2), 4, q4_0_bytes(4))] + ts[1:], "'a'", "Q4_2", "removed")
    case([T("a", (48, 2), 2, q4_0_bytes(3))] + ts[1:], "'a'", "ne[0] = 48", "Q4_0 block size 32")
    case(ts + [T("a", (8,), 0, f32_bytes(8))], "'a'", "twice")
    case([T("a" * 2, (64, 2), 2, q4_0_bytes(4))] + [T(b"\x80", (8,), 0, f32_bytes(8))], "tensor info #1", "UTF-8")
    # the tensor infos end early
    data = gguf_bytes(BASE_KV, ts)
    cut = data.index(b"\x01\x00\x00\x00\x00\x00\x00\x00c") + 12        # inside tensor c's info
    bad(tmp_path, data[:cut], "truncated", "'c'", f"offset {cut}")


def test_offsets_bounds_alignment_overlap(tmp_path):
    def case(ts, *frags):
        return bad(tmp_path, gguf_bytes(BASE_KV, ts), *frags)
    a, b, c = base_tensors()
    case([a, b, T("c", (16, 3), 1, b"", offset=2 ** 64 - 1)], "'c'", str(2 ** 64 - 1), "truncated")
    case([a, b, T("c", (16, 3), 1, b"", offset=2 ** 64 - 32)], "'c'", str(2 ** 64 - 32), "truncated")
    case([a, T("b", (8,), 0, f32_bytes(8), offset=48)], "'b'", "offset 48", "alignment 32")
    case([a, T("b", (8,), 0, f32_bytes(8), offset=32)], "'a'", "'b'", "overlap", "[0, 72)", "starts at 32")
    # a Q4_0 tensor relabelled as F32 would read its neighbour's bytes: 4x the size overlaps b
    z = T("z", (1024,), 0, f32_bytes(1024))
    case([T("a", (64, 2), 0, q4_0_bytes(4)), b, c, z], "'a'", "'b'", "overlap", "[0, 512)")
    # and the last tensor relabelled runs past the end of the file
    case([a, b, T("c", (16, 3), 0, bytes(96))], "'c'", "F32", "192 bytes", "truncated")


def test_truncated_data_section(tmp_path):
    data = gguf_bytes(BASE_KV, base_tensors())
    f = GGUFFile(write(tmp_path, data))
    end = f.data_offset + f.tensors["c"].offset + f.tensors["c"].nbytes
    assert end == len(data)
    for cut in (len(data) - 1, f.data_offset + 10, f.data_offset):
        msg = bad(tmp_path, data[:cut], "truncated", "'c'" if cut > f.data_offset + 100 else "tensor",
                  f"file ends at offset {cut}")
        assert "data section" in msg


def test_non_regular_files_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    t = time.perf_counter()
    with pytest.raises(ValueError, match="FIFO"):
        GGUFFile(fifo)                       # opening a FIFO for reading would block: never opened
    assert time.perf_counter() - t < 1.0
    with pytest.raises(ValueError, match="directory"):
        GGUFFile(tmp_path)
    if os.path.exists("/dev/zero"):
        with pytest.raises(ValueError, match="character device"):
            GGUFFile("/dev/zero")
    with pytest.raises(FileNotFoundError):
        GGUFFile(tmp_path / "missing.gguf")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


# ------------------------------------------------------------------------------------------------
# fuzz: random truncations and byte changes of a real model file never crash, hang or leak an
# exception other than the documented ones

def test_mutated_files_fail_cleanly(tiny_file, tmp_path):
    from cpufuse.llama.model import Model
    data = bytearray(open(tiny_file, "rb").read())
    f = GGUFFile(tiny_file)
    header_end = f.data_offset
    rng = random.Random(1234)
    outcomes = {}
    for i in range(160):
        d = bytearray(data)
        kind = i % 4
        if kind == 0:
            d = d[:rng.randrange(0, len(d))]
        elif kind == 1:              # a random byte of the header, keys and tensor infos
            d[rng.randrange(0, header_end)] = rng.randrange(256)
        elif kind == 2:              # an 8-byte field set to a huge or wrapping value
            p = rng.randrange(0, header_end - 8)
            d[p:p + 8] = struct.pack("<Q", rng.choice([2 ** 64 - 1, 2 ** 63, 2 ** 40, 2 ** 32 + 1]))
        else:                        # a few scattered bytes
            for _ in range(4):
                d[rng.randrange(0, header_end)] ^= 1 << rng.randrange(8)
        p = tmp_path / "m.gguf"
        p.write_bytes(bytes(d))
        t = time.perf_counter()
        try:
            if i % 8 == 3:           # the whole model load on some: the hyperparameter and shape checks too
                Model.load(p, n_ctx=32)
            else:
                GGUFFile(p)
            out = "ok"
        except (ValueError, NotImplementedError) as e:
            out = type(e).__name__
            assert str(e)
        assert time.perf_counter() - t < 2.0
        outcomes[out] = outcomes.get(out, 0) + 1
    assert outcomes.get("ValueError", 0) > 80, outcomes


def test_reader_and_model_load_without_gguf_package(tiny_file):
    """`gguf` is for writing test files; loading and generating must not import it"""
    code = ("import sys; sys.modules['gguf'] = None\n"     # any `import gguf` now raises ImportError
            "import cpufuse.llama\n"
            "from cpufuse.llama import Model\n"
            "m = Model.load(sys.argv[1], n_ctx=32)\n"
            "r = m.generate('hello world', max_tokens=3, temperature=0)\n"
            "from cpufuse.llama.tokenizer import Tokenizer\n"
            "assert Tokenizer(sys.argv[1]).tokenize('hello') == m.tokenize('hello')\n"
            "print('OK', len(r.tokens))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code, tiny_file], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stderr
