"""cpufuse.quant.types (type table, QTensor, numpy dequantization) and cpufuse.reference.quant (activation
quantizers, weight makers, float64 matmul references), checked against gguf-py and against
independent scalar re-implementations of the rules in docs/quant-design.md."""
import struct
import warnings

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from cpufuse.quant import types as qtypes  # noqa: E402
from cpufuse.reference import quant as qref  # noqa: E402
from cpufuse.quant.types import QTensor, resolve_qtype  # noqa: E402

G = gguf.GGMLQuantizationType
f32 = np.float32
ALL = qtypes.SUPPORTED
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
KQUANTS = ("Q4_K", "Q5_K", "Q6_K")


def bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype == np.float32 and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def nmse(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.sum((a - ref) ** 2) / max(np.sum(ref ** 2), 1e-300))


def q4k_bytes(rng, n_out=2, n_in=512):
    return qref.random_blocks("Q4_K", n_out, n_in, rng).raw.copy()


# ------------------------------------------------------------------------------------------------
# type table and resolve_qtype

def test_table_matches_gguf():
    vdt = {"F32": None, "F16": None, "BF16": None, "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0",
           "Q4_1": "Q8_1", "Q5_1": "Q8_1", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K",
           "Q2_K": "Q8_K", "Q3_K": "Q8_K", "IQ4_NL": "Q8_0", "IQ4_XS": "Q8_K", "MXFP4": "Q8_0"}
    assert set(ALL) == set(vdt)
    for name in ALL:
        t = qtypes.QTYPES[name]
        assert t.type_id == G[name].value
        assert (t.block_size, t.type_size) == gguf.GGML_QUANT_SIZES[G[name]]
        assert t.vec_dot_type == vdt[name]


@pytest.mark.parametrize("spec", ["q4_k", "Q4_K", " Q4_k ", 12, np.int64(12), G.Q4_K])
def test_resolve_forms(spec):
    assert resolve_qtype(spec) is qtypes.QTYPES["Q4_K"]


def test_resolve_every_supported_by_each_form():
    for name in ALL:
        t = qtypes.QTYPES[name]
        assert resolve_qtype(name.lower()) is t is resolve_qtype(t.type_id) is resolve_qtype(G[name]) is resolve_qtype(t)


@pytest.mark.parametrize("spec,name", [("IQ3_S", "IQ3_S"), ("iq2_xs", "IQ2_XS"), ("TQ1_0", "TQ1_0"),
                                       ("NVFP4", "NVFP4"), ("Q8_1", "Q8_1"), ("q8_k", "Q8_K"), (19, "IQ1_S"),
                                       (G.IQ2_XXS, "IQ2_XXS"), (G.Q8_K, "Q8_K")])
def test_resolve_unsupported_names_the_type(spec, name):
    with pytest.raises(NotImplementedError, match=name):
        resolve_qtype(spec)


def test_every_other_gguf_type_is_not_implemented():
    for member in G:
        if member.name in ALL:
            continue
        with pytest.raises(NotImplementedError, match=member.name):
            resolve_qtype(member)
        with pytest.raises(NotImplementedError, match=member.name):
            resolve_qtype(member.name)


@pytest.mark.parametrize("spec,exc", [("Q9_9", ValueError), ("", ValueError), (999, ValueError), (-1, ValueError),
                                      (3.5, TypeError), (None, TypeError), (True, TypeError), (b"Q4_0", TypeError),
                                      ([2], TypeError)])
def test_resolve_garbage(spec, exc):
    with pytest.raises(exc, match="qtype"):
        resolve_qtype(spec)


# ------------------------------------------------------------------------------------------------
# dequantization: bit-identical to gguf.quants.dequantize

def _source(name, source, n_out, n_in, rng):
    if source == "random":
        return qref.random_blocks(name, n_out, n_in, rng)
    w = (rng.standard_normal((n_out, n_in)) * rng.uniform(0.01, 10, (n_out, 1))).astype(np.float32)
    return qref.quantize_weight(w, name)      # gguf.quants.quantize for float/legacy, ours for K


@pytest.mark.parametrize("source", ["quantize", "random"])
@pytest.mark.parametrize("n_out", [1, 7, 33])
@pytest.mark.parametrize("n_blocks", [1, 2, 3])
@pytest.mark.parametrize("name", ALL)
def test_dequantize_bit_identical_to_gguf(name, n_blocks, n_out, source, rng):
    t = qtypes.QTYPES[name]
    n_in = n_blocks * (t.block_size if t.block_size > 1 else 32)
    qt = _source(name, source, n_out, n_in, rng)
    ref = np.asarray(gguf_dequantize(qt.raw, G[name]))
    got = qt.dequantize()
    assert bits_equal(got, ref)
    assert bits_equal(qtypes.dequantize(qt.raw, name, n_in), ref)
    assert not np.shares_memory(got, qt.raw)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # gguf warns on inf*0; cpufuse must not
@pytest.mark.parametrize("name", ALL)
def test_dequantize_arbitrary_bytes(name, rng):
    """any byte pattern (inf/NaN/subnormal scales included) dequantizes exactly as gguf does"""
    t = qtypes.QTYPES[name]
    n_in = 2 * t.block_size if t.block_size > 1 else 64
    raw = rng.integers(0, 256, (40, n_in // t.block_size * t.type_size), dtype=np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = qtypes.dequantize(raw, name, n_in)
    assert bits_equal(got, np.asarray(gguf_dequantize(raw, G[name])))


@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_dequantize_half_bit_patterns(name, rng):
    """every kind of 16-bit pattern (subnormal, inf, NaN payloads) converts as gguf does"""
    bits = rng.integers(0, 1 << 16, (5, 4096), dtype=np.uint16)
    bits[0, :8] = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E01, 0x7F80, 0xFF81, 0x0001]
    qt = QTensor(bits, name, bits.shape)
    assert bits_equal(qt.dequantize(), np.asarray(gguf_dequantize(qt.raw, G[name])))


def test_dequantize_f32_keeps_bits(rng):
    u = rng.integers(0, 1 << 32, (3, 64), dtype=np.uint32)
    u[0, :3] = [0x7FC00001, 0xFF800000, 0x00000001]
    raw = u.view(np.uint8).reshape(3, 256)
    assert np.array_equal(QTensor(raw, "F32", (3, 64)).dequantize().view(np.uint32), u)


def test_unpack_blocks_fields(rng):
    qt = qref.random_blocks("Q4_K", 3, 512, rng)
    f = qtypes.unpack_blocks(qt.raw, "Q4_K", 512)
    assert f["q"].shape == (3, 2, 8, 32) and f["sc"].shape == f["m"].shape == (3, 2, 8)
    assert f["d"].shape == f["dmin"].shape == (3, 2) and f["d"].dtype == np.float32
    assert f["q"].max() <= 15 and f["sc"].max() <= 63 and f["m"].max() <= 63
    with pytest.raises(ValueError, match="float type"):
        qtypes.unpack_blocks(np.zeros((2, 8), np.uint8), "F16", 4)
    with pytest.raises(ValueError, match="n_in must be positive"):
        qtypes.dequantize(qt.raw, "Q4_K", 0)
    with pytest.raises(TypeError, match="n_in must be an int"):
        qtypes.dequantize(qt.raw, "Q4_K", 512.0)
    with pytest.raises(ValueError, match="not a whole number of Q4_K rows"):
        qtypes.dequantize(qt.raw, "Q4_K", 1280)


# ------------------------------------------------------------------------------------------------
# QTensor

def test_qtensor_attributes(rng):
    raw = q4k_bytes(rng, 3, 768)
    qt = QTensor(raw, "q4_k", (3, 768))
    assert (qt.qtype, qt.type_id, qt.shape, qt.n_out, qt.n_in) == ("Q4_K", 12, (3, 768), 3, 768)
    assert (qt.block_size, qt.type_size, qt.row_bytes, qt.nbytes, qt.vec_dot_type) == (256, 144, 432, 1296, "Q8_K")
    assert qt.raw.dtype == np.uint8 and qt.raw.shape == (3, 432)
    assert "Q4_K" in repr(qt) and "(3, 768)" in repr(qt)
    assert QTensor(raw, G.Q4_K, [3, 768]).shape == (3, 768)


@pytest.mark.parametrize("name,dtype", [("F32", np.float32), ("F32", np.uint8), ("F16", np.float16),
                                        ("F16", np.uint16), ("F16", np.uint8), ("BF16", np.uint16), ("BF16", np.uint8)])
def test_qtensor_float_raw_dtypes(name, dtype, rng):
    vals = rng.standard_normal((5, 48)).astype(np.float32)
    raw = qref.quantize_weight(vals, name).raw                           # uint8 (5, row_bytes)
    typed = raw.view(dtype) if np.dtype(dtype).itemsize > 1 else raw.copy()
    qt = QTensor(typed, name, (5, 48))
    assert np.shares_memory(qt.raw, typed)
    assert bits_equal(qt.dequantize(), np.asarray(gguf_dequantize(raw, G[name])))


def test_qtensor_any_raw_shape(rng):
    raw = q4k_bytes(rng, 4, 512)                                         # (4, 288)
    ref = QTensor(raw, "Q4_K", (4, 512)).dequantize()
    for view in (raw.reshape(-1), raw.reshape(2, 576), raw.reshape(2, 2, 288), raw.reshape(8, 144)):
        qt = QTensor(view, "Q4_K", (4, 512))
        assert qt.raw.shape == (4, 288) and np.shares_memory(qt.raw, raw)
        assert bits_equal(qt.dequantize(), ref)


def test_qtensor_wrong_block_count(rng):
    raw = q4k_bytes(rng, 4, 512)                                         # 1152 bytes
    with pytest.raises(ValueError, match=r"raw: .*needs 1728 bytes.*got 1152 bytes"):
        QTensor(raw, "Q4_K", (4, 768))
    with pytest.raises(ValueError, match=r"needs 576 bytes.*got 1152"):
        QTensor(raw, "Q4_K", (2, 512))


def test_qtensor_n_in_not_multiple_of_block():
    with pytest.raises(ValueError, match=r"^shape: n_in=100 is not a multiple of the Q4_K block size 256$"):
        QTensor(np.zeros(144, np.uint8), "Q4_K", (1, 100))
    with pytest.raises(ValueError, match="n_in=48 is not a multiple of the Q8_0 block size 32"):
        QTensor(np.zeros(51, np.uint8), "Q8_0", (1, 48))


def test_qtensor_truncated_buffer(rng):
    raw = q4k_bytes(rng, 4, 512).reshape(-1)
    with pytest.raises(ValueError, match=r"needs 1152 bytes.*got 1151 bytes"):
        QTensor(raw[:-1], "Q4_K", (4, 512))
    with pytest.raises(ValueError, match=r"needs 1152 bytes.*got 0 bytes"):
        QTensor(raw[:0], "Q4_K", (4, 512))


@pytest.mark.parametrize("name,dtype", [("F32", np.float64), ("F32", np.float16), ("Q4_0", np.float32),
                                        ("Q8_0", np.int8), ("BF16", np.float16), ("F16", np.int16),
                                        ("Q6_K", np.uint16)])
def test_qtensor_wrong_dtype(name, dtype):
    with pytest.raises(TypeError, match=r"raw: dtype"):
        QTensor(np.zeros(4096, dtype), name, (1, 256))


def test_qtensor_raw_not_an_array():
    with pytest.raises(TypeError, match="raw must be a numpy.ndarray"):
        QTensor(bytes(144), "Q4_K", (1, 256))


def test_qtensor_non_contiguous(rng):
    big = qref.random_blocks("Q4_0", 8, 64, rng).raw                   # (8, 36)
    with pytest.raises(ValueError, match="raw must be C-contiguous"):
        QTensor(big[::2], "Q4_0", (4, 64))
    with pytest.raises(ValueError, match="C-contiguous"):
        QTensor(np.asfortranarray(big), "Q4_0", (8, 64))


@pytest.mark.parametrize("name", ["IQ3_S", "TQ2_0", "IQ1_M", "q8_k"])
def test_qtensor_unsupported_type(name):
    with pytest.raises(NotImplementedError, match=name.upper()):
        QTensor(np.zeros(1024, np.uint8), name, (1, 256))


@pytest.mark.parametrize("shape,exc", [((256,), ValueError), ((1, 2, 256), ValueError), ((0, 256), ValueError),
                                       ((-1, 256), ValueError), ((1, 0), ValueError), ((1.0, 256), TypeError),
                                       ((True, 256), TypeError), ("ab", TypeError), (None, TypeError),
                                       (256, TypeError), ((np.int64(1), np.int64(256)), None)])
def test_qtensor_bad_shape(shape, exc):
    raw = np.zeros(144, np.uint8)
    if exc is None:
        assert QTensor(raw, "Q4_K", shape).shape == (1, 256)
        return
    with pytest.raises(exc, match="shape"):
        QTensor(raw, "Q4_K", shape)


def test_qtensor_no_copy_and_inputs_untouched(rng):
    raw = q4k_bytes(rng, 3, 256)
    before = raw.copy()
    qt = QTensor(raw, "Q4_K", (3, 256))
    assert np.shares_memory(qt.raw, raw)
    assert raw.flags.writeable and not qt.raw.flags.writeable          # only our view is read-only
    with pytest.raises(ValueError):
        qt.raw[0, 0] = 1
    qt.dequantize()
    qtypes.dequantize(raw, "Q4_K", 256)
    qref.ref_matmul_q8(rng.standard_normal((2, 256)).astype(f32), qt)
    assert np.array_equal(raw, before)
    with pytest.raises(AttributeError):
        qt.n_in = 5
    with pytest.raises(AttributeError):
        del qt.raw


def test_qtensor_on_memmap(tmp_path, rng):
    qt0 = qref.random_blocks("Q6_K", 5, 512, rng)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 16 + qt0.raw.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=16, shape=qt0.raw.shape)
    qt = QTensor(mm, "Q6_K", (5, 512))
    assert np.shares_memory(qt.raw, mm)
    assert bits_equal(qt.dequantize(), qt0.dequantize())
    assert type(qt.dequantize()) is np.ndarray


def test_qtensor_from_gguf_file(tmp_path, rng):
    """the arrays GGUFReader returns go straight into QTensor, without a copy"""
    path = tmp_path / "t.gguf"
    tensors = {"w_q4k": qref.random_blocks("Q4_K", 3, 512, rng), "w_q8": qref.random_blocks("Q8_0", 5, 64, rng),
               "w_f16": qref.random_blocks("F16", 2, 8, rng), "w_bf16": qref.random_blocks("BF16", 3, 4, rng),
               "w_f32": qref.random_blocks("F32", 2, 6, rng)}
    wr = gguf.GGUFWriter(str(path), "test")
    for name, qt in tensors.items():
        raw = qt.raw
        if qt.qtype == "F32":
            raw = raw.view(np.float32)
        elif qt.qtype == "F16":
            raw = raw.view(np.float16)
        wr.add_tensor(name, np.ascontiguousarray(raw), raw_dtype=G(qt.type_id))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    for t in gguf.GGUFReader(str(path)).tensors:
        want = tensors[t.name]
        qt = QTensor(t.data, t.tensor_type, tuple(int(v) for v in reversed(t.shape)))
        assert qt.shape == want.shape and np.shares_memory(qt.raw, t.data)
        assert bits_equal(qt.dequantize(), want.dequantize())


# ------------------------------------------------------------------------------------------------
# activation quantizers: independent scalar versions of docs/quant-design.md

def scalar_q8_0_block(xb):
    amax = f32(0)
    for v in xb:
        amax = max(amax, abs(f32(v)))
    d = f32(amax / f32(127))
    iden = f32(f32(127) / amax) if amax != 0 else f32(0)
    q = [max(-127, min(127, round(float(f32(f32(v) * iden))))) for v in xb]      # round(): ties to even
    return q, d


def scalar_quantize_act(x, vtype):
    out = bytearray()
    for row in x:
        if vtype == "Q8_K":
            for b in range(0, len(row), 256):
                xb = row[b:b + 256]
                amax, mx = 0.0, f32(0)
                for v in xb:
                    if abs(float(v)) > amax:                 # strict: first on ties
                        amax, mx = abs(float(v)), f32(v)
                if amax == 0:
                    out += struct.pack("<f", 0.0) + bytes(256) + bytes(32)
                    continue
                iscale = f32(f32(-127) / mx)
                q = [min(127, round(float(f32(iscale * f32(v))))) for v in xb]
                d = f32(f32(1) / iscale)
                out += struct.pack("<f", float(d)) + struct.pack("<256b", *q)
                out += struct.pack("<16h", *[sum(q[16 * j:16 * j + 16]) for j in range(16)])
        else:
            for b in range(0, len(row), 32):
                q, d = scalar_q8_0_block(row[b:b + 32])
                out += struct.pack("<e", float(d))
                if vtype == "Q8_1":
                    out += struct.pack("<e", float(f32(d * f32(sum(q)))))
                out += struct.pack("<32b", *q)
    return np.frombuffer(bytes(out), np.uint8).reshape(len(x), -1)


def _act_data(rng, K):
    x = (rng.standard_normal((4, K)) * rng.uniform(1e-3, 30, (4, 1))).astype(f32)
    x[1, :32] = 0                                         # an all-zero Q8_0 block
    x[2] = np.round(x[2] * 2) / 2                         # many exact halves
    x[3, 3::7] = -x[3, 3::7]
    return x


@pytest.mark.parametrize("vtype", ["Q8_0", "Q8_1", "Q8_K"])
def test_quantize_act_matches_scalar_rules(vtype, rng):
    K = 512
    x = _act_data(rng, K)
    x[1, :256] = 0                                        # an all-zero Q8_K block
    got = qref.quantize_act(x, vtype)
    B, nbytes = qref.ACT_TYPES[vtype]
    assert got.dtype == np.uint8 and got.shape == (4, K // B * nbytes)
    assert np.array_equal(got, scalar_quantize_act(x, vtype))
    assert np.array_equal(qref.quantize_act(x[2], vtype), got[2])      # 1-D row


@pytest.mark.parametrize("vtype", ["Q8_0", "Q8_1", "Q8_K"])
def test_quantize_act_round_trip(vtype, rng):
    K = 768
    x = _act_data(rng, K)
    codes, d, s, bsums = qref.decode_act(qref.quantize_act(x, vtype), vtype, K)
    B = qref.ACT_TYPES[vtype][0]
    assert codes.dtype == np.int8 and codes.shape == x.shape and d.shape == (4, K // B)
    assert np.abs(codes.astype(int)).max() <= 127
    back = codes.reshape(4, -1, B).astype(np.float64) * d[..., None]
    err = np.abs(back - x.reshape(4, -1, B))
    # Q8_0/Q8_1 store f16(d) while the codes use the exact d: up to 127 codes times its rounding
    slack = 0.5 + (127 * 2.0 ** -11 if vtype != "Q8_K" else 1e-5)
    assert np.all(err <= slack * np.abs(d)[..., None] + 1e-30)
    assert (s is not None) == (vtype == "Q8_1") and (bsums is not None) == (vtype == "Q8_K")
    if vtype == "Q8_K":
        assert bsums.shape == (4, K // 256, 16) and bsums.dtype == np.int16
        assert np.array_equal(bsums, codes.reshape(4, -1, 16, 16).astype(np.int64).sum(-1))
    if vtype == "Q8_1":
        d_exact = np.abs(x.reshape(4, -1, 32)).max(-1) / f32(127)
        want = (d_exact * codes.reshape(4, -1, 32).sum(-1).astype(f32)).astype(np.float16).astype(f32)
        assert np.array_equal(s, want)


def test_q8k_sign_of_d():
    x = np.zeros((4, 256), f32)
    x[0, 5], x[0, 9] = 3.0, -1.0                          # max > 0 -> d < 0
    x[1, 5], x[1, 9] = -3.0, 1.0                          # max < 0 -> d > 0
    x[2, 3], x[2, 10] = 2.0, -2.0                         # tie on |x|: the first (+2) wins
    x[3, 3], x[3, 10] = -2.0, 2.0
    codes, d, _, _ = qref.decode_act(qref.quantize_act(x, "Q8_K"), "Q8_K", 256)
    assert d[0, 0] < 0 and d[1, 0] > 0 and d[2, 0] < 0 and d[3, 0] > 0
    assert codes[0, 5] == -127 and codes[1, 5] == -127 and codes[2, 3] == -127 and codes[3, 3] == -127
    assert codes[2, 10] == 127 and codes[3, 10] == 127


@pytest.mark.parametrize("vtype", ["Q8_0", "Q8_1", "Q8_K"])
def test_all_zero_blocks(vtype):
    x = np.zeros((2, 512), f32)
    x[1, 300] = 1.0
    codes, d, s, bsums = qref.decode_act(qref.quantize_act(x, vtype), vtype, 512)
    assert np.all(codes[0] == 0) and np.all(d[0] == 0) and not np.signbit(d[0]).any()
    B = qref.ACT_TYPES[vtype][0]
    assert list(np.flatnonzero(d[1])) == [300 // B]         # row 1: only the block holding x[300]
    if s is not None:
        assert np.all(s[0] == 0)
    if bsums is not None:
        assert np.all(bsums[0] == 0)


def test_ties_round_half_to_even():
    ties = [2.5, -0.5, 3.5, 1.5, -2.5, 0.5, -1.5, 4.5, 126.5, -126.5]
    # Q8_0: amax = 127 gives id = 127/127 = 1 exactly
    x = np.zeros(32, f32)
    x[0] = 127
    x[1:1 + len(ties)] = ties
    codes, d, _, _ = qref.decode_act(qref.quantize_act(x[None], "Q8_0"), "Q8_0", 32)
    assert list(codes[0, 1:1 + len(ties)]) == [2, 0, 4, 2, -2, 0, -2, 4, 126, -126]
    assert d[0, 0] == 1
    # Q8_K: max = -127 gives iscale = -127/-127 = 1
    xk = np.zeros(256, f32)
    xk[0] = -127
    xk[1:1 + len(ties)] = ties
    codes, d, _, _ = qref.decode_act(qref.quantize_act(xk[None], "Q8_K"), "Q8_K", 256)
    assert list(codes[0, 1:1 + len(ties)]) == [2, 0, 4, 2, -2, 0, -2, 4, 126, -126]
    assert d[0, 0] == 1


def test_q8_0_uses_127_over_amax():
    """id = f32(127/amax), not f32(1/d): find an element where the two give different codes"""
    rng = np.random.default_rng(1)
    for amax in rng.uniform(0.5, 2, 4000).astype(f32):
        id1, id2 = f32(127) / amax, f32(1) / (amax / f32(127))
        if id1 == id2:
            continue
        for k in range(1, 127):
            v = f32((k + 0.5) / float(id1))
            for _ in range(8):
                if np.rint(v * id1) != np.rint(v * id2) and abs(v) < amax:
                    x = np.zeros((1, 32), f32)
                    x[0, 0], x[0, 1] = amax, v
                    codes, _, _, _ = qref.decode_act(qref.quantize_act(x, "Q8_0"), "Q8_0", 32)
                    assert codes[0, 1] == np.rint(v * id1) != np.rint(v * id2)
                    return
                v = np.nextafter(v, f32(np.inf))
    pytest.fail("no discriminating case found")


def test_quantize_act_errors():
    with pytest.raises(ValueError, match="vtype"):
        qref.quantize_act(np.zeros((1, 32), f32), "Q4_0")
    with pytest.raises(TypeError, match="x must be float32"):
        qref.quantize_act(np.zeros((1, 32)), "Q8_0")
    with pytest.raises(ValueError, match="K=48 is not a multiple of the Q8_0 block size 32"):
        qref.quantize_act(np.zeros((1, 48), f32), "Q8_0")
    with pytest.raises(ValueError, match="K"):
        qref.decode_act(np.zeros((1, 34), np.uint8), "Q8_0", 48)
    with pytest.raises(ValueError, match="blocks"):
        qref.decode_act(np.zeros((1, 35), np.uint8), "Q8_0", 32)


# ------------------------------------------------------------------------------------------------
# weight makers

@pytest.mark.parametrize("name,limit", [("Q4_K", 1e-2), ("Q5_K", 3e-3), ("Q6_K", 1e-3)])
def test_kquant_quantizer_accuracy(name, limit, rng):
    w = rng.standard_normal((16, 1024)).astype(f32)
    e = nmse(qref.quantize_weight(w, name).dequantize(), w)
    assert e < limit, e
    w[3] *= 1e-3                                          # rows of very different scale
    w[5, :256] = 0
    w[6] = np.abs(w[6])                                   # all-positive sub-blocks (min = 0)
    wd = qref.quantize_weight(w, name).dequantize()
    assert np.all(wd[5, :256] == 0)
    for r in (3, 6):
        assert nmse(wd[r], w[r]) < limit


@pytest.mark.parametrize("name", ALL)
def test_make_weight_kinds(name, rng):
    for kind in ("normal", "uniform", "t3"):
        qt = qref.make_weight(name, 3, 256, rng, kind=kind)
        assert qt.shape == (3, 256) and qt.qtype == name and np.all(np.isfinite(qt.dequantize()))
    assert np.all(qref.make_weight(name, 2, 256, rng, kind="zeros").dequantize() == 0)
    with pytest.raises(ValueError, match="kind"):
        qref.make_weight(name, 2, 256, rng, kind="cauchy")


def test_random_blocks_edge_cases(rng):
    f = qtypes.unpack_blocks(qref.random_blocks("Q4_K", 2, 512, rng).raw, "Q4_K", 512)
    assert np.all(f["sc"][0, 0] == 63) and np.all(f["m"][0, 0] == 63) and np.all(f["q"][0, 0] == 15)
    assert f["d"][0, 1] == 0 and f["dmin"][0, 1] == 0
    f = qtypes.unpack_blocks(qref.random_blocks("Q5_K", 1, 256, rng).raw, "Q5_K", 256)
    assert np.all(f["q"][0, 0] == 31) and np.all(f["sc"][0, 0] == 63)
    f = qtypes.unpack_blocks(qref.random_blocks("Q6_K", 2, 256, rng).raw, "Q6_K", 256)
    assert f["sc"][0, 0].min() == -128 and f["sc"][0, 0].max() == 127
    assert f["q"][0, 0].min() == -32 and f["q"][0, 0].max() == 31 and f["d"][1, 0] == 0
    f = qtypes.unpack_blocks(qref.random_blocks("Q8_0", 4, 64, rng).raw, "Q8_0", 64)
    assert f["q"].min() == -127 and f["q"].max() == 127
    for name in KQUANTS + LEGACY:
        d = qtypes.unpack_blocks(qref.random_blocks(name, 9, 512, rng).raw, name, 512)["d"]
        mag = np.abs(d.reshape(-1))
        assert mag[1] == 0 and np.all((mag[2:] >= 9e-4) & (mag[2:] <= 1.1e-2))


# ------------------------------------------------------------------------------------------------
# float64 matmul references

def _dequant_act(x, vtype):
    K = x.shape[1]
    codes, d, s, _ = qref.decode_act(qref.quantize_act(x, vtype), vtype, K)
    B = qref.ACT_TYPES[vtype][0]
    return (codes.reshape(len(x), -1, B).astype(np.float64) * d[..., None]).reshape(len(x), K), s


@pytest.mark.parametrize("source", ["quantize", "random"])
@pytest.mark.parametrize("name", ALL)
def test_ref_matmul_q8_equals_float64_of_quantized(name, source, rng):
    """q8 mode = float64 dequant(W) . dequant(quant(x)), except Q8_1's min term, which uses s_a"""
    n_out, K = 7, 512
    qt = _source(name, source, n_out, K, rng)
    x = rng.standard_normal((5, K)).astype(f32)
    y = qref.ref_matmul_q8(x, qt)
    yf = qref.ref_matmul_f32(x, qt)
    assert y.shape == yf.shape == (5, n_out) and y.dtype == np.float64
    assert np.allclose(yf, x.astype(np.float64) @ qt.dequantize().astype(np.float64).T, rtol=0, atol=0)
    if qt.vec_dot_type is None:
        assert np.array_equal(y, yf)
        return
    xa, s = _dequant_act(x, qt.vec_dot_type)
    wd = qt.dequantize().astype(np.float64)
    if name in ("Q4_1", "Q5_1"):
        m = qtypes.unpack_blocks(qt.raw, name, K)["m"].astype(np.float64)       # (n_out, nb)
        wd = wd - np.repeat(m, 32, axis=1)
        want = xa @ wd.T + s.astype(np.float64) @ m.T
    else:
        want = xa @ wd.T
    assert nmse(y, want) < 1e-24
    assert nmse(y, yf) < 1e-3
    y1 = qref.ref_matmul_q8(x[2], qt)                                                # 1-D x
    assert y1.shape == (n_out,) and np.allclose(y1, y[2], rtol=1e-13, atol=0)


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_ref_matmul_q8_by_loops(name, rng):
    """the block formulas of docs/quant-design.md, written out with Python loops"""
    K = 512
    qt = qref.random_blocks(name, 2, K, rng)
    x = rng.standard_normal((2, K)).astype(f32)
    v = qt.vec_dot_type
    codes, d_a, s_a, bsums = qref.decode_act(qref.quantize_act(x, v), v, K)
    w = qtypes.unpack_blocks(qt.raw, name, K)
    y = np.zeros((2, 2))
    for r in range(2):
        for o in range(2):
            acc = 0.0
            for b in range(K // qt.block_size):
                if name == "Q4_1":
                    I = int(np.dot(w["q"][o, b].astype(int), codes[r, 32 * b:32 * b + 32].astype(int)))
                    acc += float(w["d"][o, b]) * float(d_a[r, b]) * I + float(w["m"][o, b]) * float(s_a[r, b])
                    continue
                a = codes[r, 256 * b:256 * b + 256].astype(int)
                if name == "Q6_K":
                    S = sum(int(w["sc"][o, b, j]) * int(np.dot(w["q"][o, b, j].astype(int), a[16 * j:16 * j + 16]))
                            for j in range(16))
                    acc += float(d_a[r, b]) * float(w["d"][o, b]) * S
                else:
                    S = sum(int(w["sc"][o, b, j]) * int(np.dot(w["q"][o, b, j].astype(int), a[32 * j:32 * j + 32]))
                            for j in range(8))
                    Mn = sum(int(w["m"][o, b, j]) * (int(bsums[r, b, 2 * j]) + int(bsums[r, b, 2 * j + 1]))
                             for j in range(8))
                    acc += float(d_a[r, b]) * (float(w["d"][o, b]) * S - float(w["dmin"][o, b]) * Mn)
            y[r, o] = acc
    assert np.allclose(qref.ref_matmul_q8(x, qt), y, rtol=1e-12, atol=1e-300)


def test_ref_matmul_errors(rng):
    qt = qref.random_blocks("Q4_0", 2, 64, rng)
    with pytest.raises(ValueError, match=r"x: expected shape \(rows, 64\)"):
        qref.ref_matmul_q8(np.zeros((1, 32), f32), qt)
    with pytest.raises(TypeError, match="x must be float32"):
        qref.ref_matmul_q8(np.zeros((1, 64)), qt)
    with pytest.raises(TypeError, match="qt must be a QTensor"):
        qref.ref_matmul_f32(np.zeros((1, 64), f32), qt.raw)


def test_mxfp4_every_exponent_and_code_bit_identical_to_gguf():
    """MXFP4: every E8M0 byte (0 and 1 give subnormal scales, 255 gives 2^127) with every code in
    both nibbles decodes as gguf-py does, bit for bit; the values are table * 2^(e - 128) exactly"""
    e = np.repeat(np.arange(256, dtype=np.uint8), 2)
    qs = np.zeros((512, 16), np.uint8)
    codes = np.arange(16, dtype=np.uint8)
    qs[0::2] = codes | (codes[::-1] << np.uint8(4))
    qs[1::2] = codes[::-1] | (codes << np.uint8(4))
    raw = np.concatenate([e[:, None], qs], axis=1).reshape(16, -1)
    ours = qtypes.dequantize(raw, "MXFP4", 32 * 32)
    ref = gguf_dequantize(raw, G.MXFP4).reshape(ours.shape)
    assert bits_equal(ours, ref)
    kv = qtypes.KVALUES_MXFP4.astype(np.float64)
    blk = ours.reshape(512, 32)
    for b in (0, 1, 2, 3, 256, 510, 511):   # f32 of the exact value (inf past 2^128 at e = 255)
        want = np.concatenate([kv[qs[b] & 15], kv[qs[b] >> 4]]) * 2.0 ** (int(e[b]) - 128)
        with np.errstate(over="ignore"):
            assert np.array_equal(blk[b], want.astype(np.float32)), b
    assert qtypes.e8m0_half(0) == np.float32(2.0 ** -128) and qtypes.e8m0_half(255) == np.float32(2.0 ** 127)


def test_mxfp4_quantize_roundtrip():
    """gguf-py's MXFP4 quantizer's output (the test files' weights) decodes back within the format's
    error: nearest table value at scale 2^(floor(log2 max) - 2)"""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    qt = qref.quantize_weight(w, "MXFP4")
    assert qt.qtype == "MXFP4" and qt.raw.shape == (4, 34)
    back = qtypes.dequantize(qt.raw, "MXFP4", 64)
    assert bits_equal(back, gguf_dequantize(qt.raw, G.MXFP4).reshape(4, 64))
    assert nmse(back, w) < 0.02
