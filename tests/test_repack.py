"""P16 repacked weights (QTensor.repack, docs/quant-design.md "Repacked weights"): the layout round
trip, results bit-identical to the GGUF layout on every path and activation mode, and batch
invariance: a row's result does not depend on which rows share the call."""
import numpy as np
import pytest

import cpufuse
from cpufuse import _backend
from cpufuse.reference import quant as qref
from cpufuse.quant.types import QTYPES, QTensor

QUANT = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4")


def _k(qt):
    return 512 if QTYPES[qt].block_size == 256 else 96


def _bits(a):
    return a.view(np.uint32)


@pytest.mark.parametrize("qt", QUANT)
@pytest.mark.parametrize("n_out", [1, 15, 16, 17, 40])
def test_round_trip(qt, n_out, rng):
    """repack then unpack gives back the file's bytes, for any byte pattern (random blocks)"""
    w = qref.random_blocks(qt, n_out, _k(qt), rng)
    p = w.repack()
    assert p.layout == "p16" and p.shape == w.shape and p.qtype == w.qtype
    assert p.raw.shape == ((n_out + 15) // 16, 16 * w.row_bytes)
    assert p.raw.ctypes.data % 64 == 0 and not p.raw.flags.writeable
    assert np.array_equal(p.gguf_bytes(), w.raw)
    assert np.array_equal(p.dequantize().view(np.uint32), w.dequantize().view(np.uint32))
    assert p.repack() is p


@pytest.mark.parametrize("qt", ["F32", "F16", "BF16"])
def test_float_types_are_not_repacked(qt, rng):
    w = qref.make_weight(qt, 5, 64, rng)
    assert w.repack() is w


def test_numba_keeps_the_gguf_layout(rng):
    w = qref.make_weight("Q4_0", 20, 64, rng)
    assert w.repack(isa="numba") is w


@pytest.mark.parametrize("qt", QUANT)
@pytest.mark.parametrize("act", ["q8", "f32"])
def test_repacked_equals_gguf_layout(isa, qt, act, rng):
    """every op, both activation modes, odd shapes: bit-identical results, and the q8 results match
    the float64 reference of the block arithmetic"""
    K = _k(qt)
    wg, wu = qref.make_weight(qt, 37, K, rng), qref.make_weight(qt, 37, K, rng)
    wgp, wup = wg.repack(), wu.repack()
    nw = rng.standard_normal(K).astype(np.float32)
    for rows in (1, 3, 9, 19):
        x = rng.standard_normal((rows, K)).astype(np.float32)
        y = cpufuse.matmul(x, wg, act=act, isa=isa)
        assert np.array_equal(_bits(y), _bits(cpufuse.matmul(x, wgp, act=act, isa=isa)))
        ref = qref.ref_matmul_q8(x, wg) if act == "q8" else qref.ref_matmul_f32(x, wg)
        err = np.sum((y - ref) ** 2) / np.sum(ref ** 2)
        assert err < 1e-10, (rows, err)
        a = cpufuse.matmul_swiglu(x, wg, wu, act=act, isa=isa, norm_weight=nw, eps=1e-5)
        b = cpufuse.matmul_swiglu(x, wgp, wup, act=act, isa=isa, norm_weight=nw, eps=1e-5)
        assert np.array_equal(_bits(a), _bits(b))
        m1 = cpufuse.matmul_multi(x, (wg, wu), act=act, isa=isa)
        m2 = cpufuse.matmul_multi(x, (wgp, wu), act=act, isa=isa)
        assert all(np.array_equal(_bits(p), _bits(q)) for p, q in zip(m1, m2))


@pytest.mark.parametrize("qt", QUANT)
@pytest.mark.parametrize("repack", [False, True])
def test_batch_invariance(isa, qt, repack, rng):
    """a row's result is the same alone, in any batch size and position (the contract the server
    relies on), and for every thread count"""
    K = _k(qt)
    w = qref.make_weight(qt, 50, K, rng)
    if repack:
        w = w.repack()
    x = rng.standard_normal((23, K)).astype(np.float32)
    alone = np.stack([cpufuse.matmul(x[i:i + 1], w, isa=isa)[0] for i in range(len(x))])
    # 23 = 16 + 4 + 2 + 1 rows on AVX-512 (P16_MR = 8: whole groups, then the small-row tiles), 7 = 4 + 2 + 1,
    # 14 = 8 + 4 + 2, 3 = 2 + 1; on AVX2 (P16_MR = 4) 7 = 4 + 2 + 1 as well
    for lo, hi in ((0, 23), (3, 12), (5, 6), (7, 16), (0, 8), (1, 8), (4, 18), (10, 13), (2, 7)):
        for nth in (1, 3):
            y = cpufuse.matmul(x[lo:hi], w, isa=isa, n_threads=nth)
            assert np.array_equal(_bits(y), _bits(alone[lo:hi])), (lo, hi, nth)


def test_nonfinite_activations(isa, rng):
    """inf/NaN in a row give the GGUF layout's outputs, and reach no other row (q8 quantization maps
    an inf block to a non-finite scale; a NaN gets arbitrary codes, as in ggml's quantizer)"""
    w = qref.make_weight("Q4_K", 20, 256, rng)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    x[1, 7] = np.inf
    x[2, 100] = np.nan
    y = cpufuse.matmul(x, w, isa=isa)
    yp = cpufuse.matmul(x, w.repack(), isa=isa)
    assert np.array_equal(np.isnan(y), np.isnan(yp)) and np.array_equal(y[~np.isnan(y)], yp[~np.isnan(yp)])
    assert np.isfinite(y[0]).all() and np.isfinite(y[3]).all() and not np.isfinite(y[1]).all()


def test_graph_plan_reads_repacked_weights(rng):
    """a compiled plan with repacked weights gives the GGUF layout's results"""
    w = qref.make_weight("Q4_0", 48, 64, rng)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    outs = []
    for ww in (w, w.repack()):
        g = cpufuse.Graph()
        xi = g.input("x", (3, 64))
        g.output(g.qmatmul(xi, ww))
        outs.append(g.compile().run(x=x)[0])
    assert np.array_equal(_bits(outs[0]), _bits(outs[1]))


def test_repacked_is_immutable(rng):
    p = qref.make_weight("Q8_0", 16, 64, rng).repack()
    with pytest.raises(AttributeError):
        p.layout = "gguf"
    with pytest.raises(ValueError):
        p.raw[0, 0] = 1
    assert "layout=p16" in repr(p)


@pytest.mark.parametrize("qt", QUANT)
def test_amx_equals_avx512(qt, rng):
    """the amx ISA's tile GEMM gives the avx512 kernels' results bit for bit (same exact int32 block
    sums, same float chain), so a row is the same through tiles (big batches) and VNNI (decode)"""
    for name in ("amx", "avx512"):
        if name not in cpufuse.available_isas():
            from _util import skip_reason
            pytest.skip(skip_reason(name))
    # K: the tiles' block pairs (legacy) and super-blocks (K-quants) alternate between two C tile sets,
    # so an odd count of each, one and several, reaches both sets and a last set of one
    for K in (_k(qt), 288 if QTYPES[qt].block_size < 256 else 768):
        _amx_equals_avx512(qt, K, rng)


def _amx_equals_avx512(qt, K, rng):
    w = qref.make_weight(qt, 40, K, rng)
    x = rng.standard_normal((45, K)).astype(np.float32)  # 2 tiles of 16, then 8 rows on the VNNI tiles, then 5
    for ww in (w, w.repack()):
        a = cpufuse.matmul(x, ww, isa="avx512")
        b = cpufuse.matmul(x, ww, isa="amx")
        assert np.array_equal(_bits(a), _bits(b))
        assert np.array_equal(_bits(b[5]), _bits(cpufuse.matmul(x[5:6], ww, isa="amx")[0]))
        s1 = cpufuse.matmul_swiglu(x, ww, ww, isa="avx512")
        s2 = cpufuse.matmul_swiglu(x, ww, ww, isa="amx")
        assert np.array_equal(_bits(s1), _bits(s2))


def test_mxfp4_every_e8m0_scale(isa, rng):
    """MXFP4 with every E8M0 byte 0..255 among its blocks (0 and 1: subnormal scales, 255: 2^127): the
    panel tiles' column scales (VSCALEFPS on AVX-512 and AMX, else the bit form with its edge test) give
    the GGUF layout's results bit for bit, and the float64 reference's; 45 rows reach the AMX tiles"""
    from cpufuse.quant.types import QTYPES as T
    n_out, K = 32, 256
    b = qref.random_blocks("MXFP4", n_out, K, rng).raw.reshape(-1, T["MXFP4"].type_size).copy()
    b[:, 0] = rng.permutation(np.arange(b.shape[0]) % 256)
    w = QTensor(b.reshape(n_out, -1), T["MXFP4"], (n_out, K))
    x = (rng.standard_normal((45, K)) * 1e-4).astype(np.float32)   # |y| stays finite with scales up to 2^127
    y = cpufuse.matmul(x, w, isa=isa)
    assert np.array_equal(_bits(y), _bits(cpufuse.matmul(x, w.repack(), isa=isa)))
    ref = qref.ref_matmul_q8(x, w)
    assert np.isfinite(ref).all() and np.sum((y - ref) ** 2) / np.sum(ref ** 2) < 1e-10


# ------------------------------------------------------------------------------------------------
# the layout itself, against a reference written from its description (docs/quant-design.md,
# "Repacked weights"; the comment atop native/src/repack.c): per type, where every bit of a panel
# block comes from in the 16 GGUF blocks

def _p16_bit_map(qt):
    """(src, flip): panel-block bit i (byte i // 8, bit i % 8) is bit src[i] of the 16 GGUF blocks
    laid end to end (block n at byte n * type_size), xor flip[i]"""
    bb = QTYPES[qt].type_size
    src = np.full(16 * bb * 8, -1, np.int64)
    flip = np.zeros(16 * bb * 8, np.uint8)

    def put(pbyte, pbit, n, rbyte, rbit, nbits=1):
        for i in range(nbits):
            assert src[8 * pbyte + pbit + i] == -1, (qt, pbyte, pbit + i)
            src[8 * pbyte + pbit + i] = 8 * (n * bb + rbyte) + rbit + i

    def half(off, pb):                       # f16 field at off -> pb + 2n
        for n in range(16):
            for i in range(2):
                put(pb + 2 * n + i, 0, n, off + i, 0, 8)

    def chunks(off, nc, pb):                 # chunk c, byte 4n+t <- byte off + 4c + t
        for c in range(nc):
            for n in range(16):
                for t in range(4):
                    put(pb + 64 * c + 4 * n + t, 0, n, off + 4 * c + t, 0, 8)

    def qh32(off, pb):                       # Q5_0/Q5_1 element e = 16h + 4c + t -> plane (c, h), bit 4n+t
        for n in range(16):
            for c in range(4):
                for h in range(2):
                    for t in range(4):
                        e = 16 * h + 4 * c + t
                        b = 4 * n + t
                        put(pb + 16 * c + 8 * h + b // 8, b % 8, n, off + e // 8, e % 8)

    def scales_mins(pb):                     # Q4_K/Q5_K 6-bit sc/m of sub-block j (12 bytes at 4)
        def field(j, which, lo):             # (byte, bit) of bits lo..lo+1 or lo..lo+3 of sc/m j
            if j < 4:
                return 4 + j + 4 * which, lo
            if lo < 4:
                return 4 + j + 4, 4 * which + lo
            return 4 + j - 4 + 4 * which, 6 + lo - 4
        for n in range(16):
            for j in range(8):
                for which in range(2):       # 0: sc, 1: m
                    v = 128 * which + 16 * j + n
                    rb, rbit = field(j, which, 0)
                    put(pb + v % 128, 4 * which, n, rb, rbit, 4)
                    rb, rbit = field(j, which, 4)
                    put(pb + 128 + v % 64, 2 * (v // 64), n, rb, rbit, 2)

    def q5k_planes(pb, rec):                 # Q5_K qh[l] bit j = element 32j + l; j = 2g + h
        for n in range(16):
            for g in range(4):
                for c in range(8):
                    for h in range(2):
                        for t in range(4):
                            b = 4 * n + t
                            put(pb + rec * g + 512 + 16 * c + 8 * h + b // 8, b % 8, n, 16 + 4 * c + t, 2 * g + h)

    def q6k(pb):                             # records of 416 bytes per 32-element sub-block s
        for n in range(16):
            for gr in range(16):
                put(pb + 416 * (gr // 2) + 384 + 16 * (gr % 2) + n, 0, n, 192 + gr, 0, 8)
            for e in range(256):
                h, l, gq = e // 128, e % 32, (e % 128) // 32
                s, k = e // 32, e % 32
                hi, c, t = k // 16, (k % 16) // 4, k % 4
                put(pb + 416 * s + 64 * c + 4 * n + t, 4 * hi, n, 64 * h + 32 * (gq % 2) + l, 4 * (gq // 2), 4)
                put(pb + 416 * s + 256 + 64 * hi + 4 * n + t, 2 * c, n, 128 + 32 * h + l, 2 * gq, 2)

    if qt == "Q4_0":
        half(0, 0), chunks(2, 4, 32)
    elif qt == "Q4_1":
        half(0, 0), half(2, 32), chunks(4, 4, 64)
    elif qt == "Q5_0":
        half(0, 0), qh32(2, 32), chunks(6, 4, 96)
    elif qt == "Q5_1":
        half(0, 0), half(2, 32), qh32(4, 64), chunks(8, 4, 128)
    elif qt == "Q8_0":
        half(0, 0), chunks(2, 8, 32)
        flip[8 * 32 + 7::8] = 1                # codes + 128: bit 7 of every code byte
    elif qt in ("Q4_K", "Q5_K"):
        q5 = qt == "Q5_K"
        rec = 640 if q5 else 512
        half(0, 0), half(2, 32), scales_mins(64)
        for g in range(4):
            chunks((48 if q5 else 16) + 32 * g, 8, 256 + rec * g)
        if q5:
            q5k_planes(256, rec)
    elif qt == "Q6_K":
        half(208, 0), q6k(32)
    elif qt == "IQ4_NL":
        half(0, 0), chunks(2, 4, 32)
    elif qt == "MXFP4":                      # e (byte 0) of row n at panel byte n, then the nibble chunks
        for n in range(16):
            put(n, 0, n, 0, 0, 8)
        chunks(1, 4, 16)
    elif qt == "IQ4_XS":                     # ls_j: low 4 bits in scales_l (byte 4 + j//2), high 2 in scales_h
        half(0, 0), chunks(8, 32, 128)
        for n in range(16):
            for j in range(8):
                put(32 + 16 * (j & 3) + n, 4 * (j >> 2), n, 4 + j // 2, 4 * (j % 2), 4)
                put(96 + 16 * (j & 1) + n, 2 * (j >> 1), n, 2 + j // 4, 2 * (j % 4), 2)
    elif qt == "Q2_K":
        half(80, 0), half(82, 32), chunks(16, 16, 320)
        for n in range(16):
            for j in range(16):
                put(64 + 16 * j + n, 0, n, j, 0, 8)
    elif qt == "Q3_K":
        half(108, 0), chunks(32, 16, 224), chunks(0, 8, 1248)
        for n in range(16):
            for k in range(12):
                put(32 + 16 * k + n, 0, n, 96 + k, 0, 8)
    assert (src >= 0).all() and np.array_equal(np.sort(src), np.arange(src.size)), f"{qt}: not a bijection"
    return src, flip


_MAPS = {}


def ref_repack(qt, raw, n_out, p0, p1):
    """panels p0..p1-1 of the GGUF rows raw (n_out rows, or more: rows past n_out are padding, zero
    bytes in the panels) by the bit map"""
    if qt not in _MAPS:
        _MAPS[qt] = _p16_bit_map(qt)
    src, flip = _MAPS[qt]
    bb = QTYPES[qt].type_size
    nb = raw.shape[1] // bb
    rows = np.zeros((16 * p1, nb * bb), np.uint8)
    live = np.zeros(16 * p1, bool)
    m = min(n_out, 16 * p1)
    rows[:m], live[:m] = raw[:m], True
    rows, live = rows[16 * p0:], live[16 * p0:]
    np_ = p1 - p0
    blocks = rows.reshape(np_, 16, nb, bb).transpose(0, 2, 1, 3).reshape(np_, nb, 16 * bb)
    bits = np.unpackbits(blocks, axis=2, bitorder="little")
    out = bits[:, :, src] ^ flip
    out &= live.reshape(np_, 16)[:, src // (8 * bb)][:, None, :]
    return np.packbits(out, axis=2, bitorder="little").reshape(np_, nb * 16 * bb)


def ref_unrepack(qt, panels, n_out, p0, p1):
    """the inverse: GGUF rows 16*p0 .. min(16*p1, n_out) of panels p0..p1-1 of `panels` (all panels)"""
    if qt not in _MAPS:
        _MAPS[qt] = _p16_bit_map(qt)
    src, flip = _MAPS[qt]
    bb = QTYPES[qt].type_size
    np_ = p1 - p0
    nb = panels.shape[1] // (16 * bb)
    bits = np.unpackbits(panels[p0:p1].reshape(np_, nb, 16 * bb), axis=2, bitorder="little")
    rbits = np.empty_like(bits)
    rbits[:, :, src] = bits ^ flip
    blocks = np.packbits(rbits, axis=2, bitorder="little").reshape(np_, nb, 16, bb)
    rows = blocks.transpose(0, 2, 1, 3).reshape(16 * np_, nb * bb)
    return rows[:min(n_out, 16 * p1) - 16 * p0]


def _c_repack(qt, raw, n_out, K, src_stride, p0, p1):
    ffi, lib = _backend.ffi, _backend.lib
    t = QTYPES[qt]
    pb = int(lib.cf_p16_bytes(t.type_id, 16, K))
    src = np.zeros((n_out, src_stride), np.uint8)
    src[:, :raw.shape[1]] = raw
    src[:, raw.shape[1]:] = 0xA5                     # bytes between rows are not read into panels
    dst = np.full((p1 - p0 + 1) * pb, 0x5A, np.uint8)  # one panel of canary after the last
    assert lib.cf_repack_p16(t.type_id, n_out, K, ffi.from_buffer(src), src_stride,
                             ffi.from_buffer(dst, require_writable=True), p0, p1) == 0
    assert (dst[(p1 - p0) * pb:] == 0x5A).all(), "wrote past panel p1"
    return dst[:(p1 - p0) * pb].reshape(p1 - p0, pb)


def _c_unrepack(qt, panels, n_out, K, dst_stride, p0, p1):
    ffi, lib = _backend.ffi, _backend.lib
    t = QTYPES[qt]
    rb = K // t.block_size * t.type_size
    nrows = min(n_out, 16 * p1) - 16 * p0
    dst = np.full((16 * (p1 - p0) + 1, dst_stride), 0x5A, np.uint8)
    assert lib.cf_unrepack_p16(t.type_id, n_out, K, ffi.from_buffer(panels),
                               ffi.from_buffer(dst, require_writable=True), dst_stride, p0, p1) == 0
    assert (dst[:, rb:] == 0x5A).all(), "wrote between rows"
    assert (dst[nrows:] == 0x5A).all(), "wrote a padding row"
    return dst[:nrows, :rb]


@pytest.mark.skipif(_backend.lib is None, reason="native extension not built")
@pytest.mark.parametrize("qt", QUANT)
def test_layout_equals_reference(qt, rng):
    """cf_repack_p16 / cf_unrepack_p16 against the bit map above: random bytes in every bit, padding
    rows (n_out not a multiple of 16), several K, panel ranges not starting at 0, strided rows"""
    t = QTYPES[qt]
    for nbk in (1, 2, 3, 8, 37):  # 37: more than one round of panel blocks (repack.c KSPAN)
        K = nbk * t.block_size
        rb = nbk * t.type_size
        for n_out in (1, 16, 37, 64):
            raw = rng.integers(0, 256, (n_out, rb), dtype=np.uint8)
            n_p = (n_out + 15) // 16
            full = _c_repack(qt, raw, n_out, K, rb, 0, n_p)
            assert np.array_equal(full, ref_repack(qt, raw, n_out, 0, n_p)), (K, n_out)
            assert np.array_equal(_c_unrepack(qt, full, n_out, K, rb, 0, n_p), raw), (K, n_out)
            for p0, p1 in {(0, 1), (n_p - 1, n_p), (1, n_p), (1, 2)}:
                if not 0 <= p0 < p1 <= n_p:
                    continue
                for stride in (rb, rb + 7):
                    part = _c_repack(qt, raw, n_out, K, stride, p0, p1)
                    assert np.array_equal(part, full[p0:p1]), (K, n_out, p0, p1, stride)
                    back = _c_unrepack(qt, full, n_out, K, stride + 5, p0, p1)
                    assert np.array_equal(back, raw[16 * p0:min(n_out, 16 * p1)]), (K, n_out, p0, p1)
                    assert np.array_equal(back, ref_unrepack(qt, full, n_out, p0, p1))
