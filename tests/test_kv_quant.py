"""Quantized K/V caches (issue 42 item 1): flash_attn over Q8_0 / Q4_0 K and V rows on every path
(each ISA this CPU runs, Numba; rows, tiled and split strategies) against a float64 reference computed
from the dequantized cache and Q quantized to Q8_0 (docs/semantics.md §4); bit-identical for every
thread count; the quantizers' formats; the memory ratios; bad input."""
import gguf
import numpy as np
import pytest

import cpufuse
from cpufuse import reference as ref
from cpufuse.ops import kvquant
from _util import assert_bit_identical, assert_nmse

TYPES = ("q8_0", "q4_0")


def _case(rng, S=2, Hq=8, Hk=2, N=3, T=333, DK=64, DV=96):
    q = rng.uniform(-2, 2, (S, Hq, N, DK)).astype(np.float32)
    k = rng.standard_normal((S, Hk, T, DK)).astype(np.float32)
    v = rng.standard_normal((S, Hk, T, DV)).astype(np.float32)
    m = rng.uniform(-1, 1, (1, 1, N, T)).astype(np.float16)
    m[..., 40:90] = -np.inf
    m[0, 0, N - 1, 200:] = -np.inf      # a row that excludes a tail others include
    return q, k, v, m


def _expect(q, kb, kt, vb, vt, DK, DV, m=None, sinks=None, softcap=0.0):
    """float64 from the stored cache: K and V dequantized, Q as its Q8_0 values when K is quantized"""
    kd = kvquant.dequantize(kb, kt, DK) if kt in TYPES else kb.astype(np.float32)
    vd = kvquant.dequantize(vb, vt, DV) if vt in TYPES else vb.astype(np.float32)
    qd = kvquant.dequantize(kvquant.quantize(q, "q8_0"), "q8_0", DK) if kt in TYPES else q
    return ref.flash_attn(qd, kd, vd, m, 0.125, 0.0, softcap, sinks)


@pytest.mark.parametrize("kt,vt", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f16", "q4_0")])
@pytest.mark.parametrize("strategy", ["rows", "tiled", "split"])
def test_quantized_cache_matches_reference(isa, kt, vt, strategy, rng):
    q, k, v, m = _case(rng)
    kb = kvquant.quantize(k, kt) if kt in TYPES else k.astype(np.float16)
    vb = kvquant.quantize(v, vt) if vt in TYPES else v.astype(np.float16)
    sinks = rng.uniform(-2, 2, q.shape[1]).astype(np.float32)
    for mask, sk, cap in ((None, None, 0.0), (m, sinks, 0.0), (m, None, 30.0)):
        got = cpufuse.flash_attn(q, kb, vb, mask, scale=0.125, softcap=cap, sinks=sk, k_type=kt, v_type=vt, dv=96,
                                 isa=isa, strategy=strategy, chunk=128)
        assert_nmse(_expect(q, kb, kt, vb, vt, 64, 96, mask, sk, cap), got, 1e-10)


def test_quantized_cache_any_thread_count_and_batch(native_isa, rng):
    q, k, v, m = _case(rng, N=1, T=1100)
    kb, vb = kvquant.quantize(k, "q8_0"), kvquant.quantize(v, "q4_0")
    outs = [cpufuse.flash_attn(q, kb, vb, m, scale=0.125, k_type="q8_0", v_type="q4_0", dv=96, isa=native_isa,
                               n_threads=t) for t in (1, 2, 3, 7)]
    for o in outs[1:]:
        assert_bit_identical(outs[0], o, f"quantized cache {native_isa}")
    one = cpufuse.flash_attn(q[1:], kb[1:], vb[1:], m, scale=0.125, k_type="q8_0", v_type="q4_0", dv=96,
                             isa=native_isa)
    assert_bit_identical(outs[0][1:], one, "sequence 1 alone and beside sequence 0")


def test_masked_garbage_never_leaks(native_isa, rng):
    q, k, v, m = _case(rng, S=1, N=2, T=130)
    kb, vb = kvquant.quantize(k, "q8_0"), kvquant.quantize(v, "q8_0")
    kb[0, :, 40:90, :2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)   # NaN scales, excluded
    vb[0, :, 40:90, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    got = cpufuse.flash_attn(q, kb, vb, m, scale=0.125, k_type="q8_0", v_type="q8_0", dv=96, isa=native_isa)
    assert np.isfinite(got).all()
    assert_nmse(_expect(q, kb, "q8_0", vb, "q8_0", 64, 96, m), got, 1e-10)


def test_quantizers_formats(rng):
    x = rng.standard_normal((5, 128)).astype(np.float32)
    x[0, :32] = 0.0
    b4 = kvquant.quantize(x, "q4_0")
    assert b4.tobytes() == gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_0).tobytes()   # ggml's reference
    b8 = kvquant.quantize(x, "q8_0")
    xd = kvquant.dequantize(b8, "q8_0", 128)
    assert np.all(xd[0, :32] == 0)
    amax = np.abs(x.reshape(5, 4, 32)).max(-1)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    assert np.all(np.abs(xd - x).reshape(5, 4, 32) <= d[..., None] * 0.6 + 1e-6)   # half a step, and d rounded to f16
    assert np.array_equal(gguf.quants.dequantize(b4, gguf.GGMLQuantizationType.Q4_0).reshape(5, 128),
                          kvquant.dequantize(b4, "q4_0", 128))


def test_memory_ratios():
    f16 = kvquant.row_bytes("f16", 128)
    assert kvquant.row_bytes("q8_0", 128) / f16 == 34 / 64    # 53.1 %, as ggml's Q8_0 (the "53 %")
    assert kvquant.row_bytes("q4_0", 128) / f16 == 18 / 64    # 28.1 %


def test_bad_quantized_input(rng):
    q, k, v, _ = _case(rng, S=1, T=40)
    kb = kvquant.quantize(k, "q8_0")
    with pytest.raises(ValueError, match="k_type must be one of"):
        cpufuse.flash_attn(q, kb, v, scale=0.1, k_type="q5_0")
    with pytest.raises(TypeError, match="k must be uint8 blocks"):
        cpufuse.flash_attn(q, k, v, scale=0.1, k_type="q8_0")
    with pytest.raises(ValueError, match="k rows must hold 64 values as q4_0"):
        cpufuse.flash_attn(q, kb, v, scale=0.1, k_type="q4_0")
    with pytest.raises(ValueError, match="fused=False"):
        cpufuse.flash_attn(q, kb, v, scale=0.1, k_type="q8_0", fused=False)
    with pytest.raises(ValueError, match="dv must be"):
        cpufuse.flash_attn(q, kb, v, scale=0.1, k_type="q8_0", dv=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        kvquant.quantize(np.ones((2, 40), np.float32), "q8_0")


def test_cache_type_arguments_never_reuse_a_cached_binding():
    """flash_attn's cached binding does not key on k_type/v_type/dv: a call naming one is checked in full
    each time, so a float K that contradicts k_type is refused even after an identical call succeeded"""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 3, 32)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 32)).astype(np.float32)
    v = rng.standard_normal((1, 2, 5, 32)).astype(np.float32)
    a = cpufuse.flash_attn(q, k, v, scale=0.2)
    a2 = cpufuse.flash_attn(q, k, v, scale=0.2)
    assert np.array_equal(a, a2)
    np.testing.assert_array_equal(cpufuse.flash_attn(q, k, v, scale=0.2, k_type="f32", v_type="f32"), a)
    for _ in range(2):
        with pytest.raises(TypeError, match="k_type"):
            cpufuse.flash_attn(q, k, v, scale=0.2, k_type="f16")


def _blocks(x, t):
    return kvquant.quantize(x, t) if t in TYPES else x.astype(np.float16)


# q8_0 and q4_0 for K and for V separately, and both
TILED_PAIRS = [("q8_0", "f16"), ("q4_0", "f16"), ("f16", "q8_0"), ("f16", "q4_0"), ("q8_0", "q4_0"), ("q4_0", "q8_0")]


@pytest.mark.parametrize("kt,vt", TILED_PAIRS)
@pytest.mark.parametrize("N,T", [(13, 63), (9, 65), (37, 130), (64, 200), (17, 1100)])
def test_tiled_quantized_cache_matches_reference_and_rows(native_isa, kt, vt, N, T, rng):
    """The tiled strategy over a quantized cache (the int8 score GEMM on packed K codes, the V GEMM on
    dequantized rows): float64 reference at odd sizes, KV lengths on and across block boundaries, -inf
    masks (a causal diagonal, a band, a row with its own tail). With a quantized K the scores are exact
    int32 block dots, so a row's result is the same bit for bit in every tile and in the rows strategy;
    with an f16 K, in every tile of 8 rows or more. Every thread count gives the same bits."""
    Hq, Hk, DK, DV = 8, 2, 64, 96
    q = rng.uniform(-2, 2, (2, Hq, N, DK)).astype(np.float32)
    k = rng.standard_normal((2, Hk, T, DK)).astype(np.float32)
    v = rng.standard_normal((2, Hk, T, DV)).astype(np.float32)
    m = np.zeros((1, 1, N, T), np.float16)
    m[0, 0] = np.where(np.arange(T)[None, :] <= T - N + np.arange(N)[:, None], 0.0, -np.inf)   # causal at the end
    m[..., 3:T // 3] = -np.inf
    m[0, 0, 1, T // 2:] = -np.inf
    kb, vb = _blocks(k, kt), _blocks(v, vt)
    call = dict(scale=0.125, k_type=kt, v_type=vt, dv=DV, isa=native_isa)
    want = _expect(q, kb, kt, vb, vt, DK, DV, m)
    base = cpufuse.flash_attn(q, kb, vb, m, strategy="tiled", **call)
    assert_nmse(want, base, 1e-10)
    assert_nmse(_expect(q, kb, kt, vb, vt, DK, DV), cpufuse.flash_attn(q, kb, vb, strategy="tiled", **call), 1e-10)
    for nt in (2, 3):
        assert_bit_identical(base, cpufuse.flash_attn(q, kb, vb, m, strategy="tiled", n_threads=nt, **call),
                             f"tiled {kt}/{vt} {nt} threads")
    # f16 K: only tiles whose groups all hold >= 8 rows (4 heads a query) take the GEMM for every row
    tiles = [qt for qt in (64, 5, 17, 32, 40)
             if kt in TYPES or (qt >= 8 and (N % (qt // 4) == 0 or N % (qt // 4) >= 2))]
    outs = [cpufuse.flash_attn(q, kb, vb, m, strategy="tiled", q_tile=qt, **call) for qt in tiles]
    for qt, o in zip(tiles[1:], outs[1:]):
        assert_bit_identical(outs[0], o, f"tiled {kt}/{vt} q_tile={qt} against {tiles[0]}")
    if kt in TYPES:
        assert_bit_identical(base, cpufuse.flash_attn(q, kb, vb, m, strategy="rows", **call), f"rows {kt}/{vt}")


@pytest.mark.parametrize("kt,vt", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("f16", "q8_0")])
def test_tiled_masked_garbage_never_leaks(native_isa, kt, vt, rng):
    """NaN K scales and inf V scales at excluded positions of a tiled call: finite output, the reference"""
    q, k, v, m = _case(rng, S=1, N=11, T=150)
    kb, vb = _blocks(k, kt), _blocks(v, vt)
    if kt in TYPES:
        kb[0, :, 40:90, :2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    vb[0, :, 40:90, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    got = cpufuse.flash_attn(q, kb, vb, m, scale=0.125, k_type=kt, v_type=vt, dv=96, isa=native_isa,
                             strategy="tiled")
    assert np.isfinite(got).all()
    assert_nmse(_expect(q, kb, kt, vb, vt, 64, 96, m), got, 1e-10)


@pytest.mark.parametrize("kt,vt", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0"), ("q4_0", "q8_0"),
                                   ("q8_0", "f16"), ("f16", "q8_0")])
@pytest.mark.parametrize("Hq,Hk,DK,DV", [(8, 2, 64, 64), (12, 2, 96, 64), (2, 2, 128, 96), (16, 4, 32, 160)])
def test_decode_tiles_match_the_gemm_and_reference(native_isa, kt, vt, Hq, Hk, DK, DV, rng):
    """The decode tiles over a quantized cache (docs/kv.md): 4 query heads x 4 K rows of integer block dots
    (AVX-512 VNNI, AVX2; the f32 code tile elsewhere) and V rows dequantized in register tiles, on
    groups of 4, 6 (a tile of 4 and one of 2) and 1 heads, odd block counts (DK 96, 32), K codes -128 and a
    masked-out row of NaN / inf scales. Each query row's result is the tiled strategy's (the int8 GEMM on
    packed codes and the V GEMM) bit for bit; the reference; every thread count in split-KV decode."""
    N, T = 9, 700
    q = rng.uniform(-2, 2, (2, Hq, N, DK)).astype(np.float32)
    k = (rng.standard_normal((2, Hk, T, DK)) * rng.uniform(0.2, 4, DK)).astype(np.float32)
    v = rng.standard_normal((2, Hk, T, DV)).astype(np.float32)
    kb, vb = _blocks(k, kt), _blocks(v, vt)
    if kt in TYPES:
        kb[1, :, 77, 2:] = 0x80                 # codes -128 (never written by the quantizer; exact all the same)
    call = dict(scale=0.125, k_type=kt, v_type=vt, dv=DV, isa=native_isa)
    rows = cpufuse.flash_attn(q, kb, vb, strategy="rows", **call)
    assert_nmse(_expect(q, kb, kt, vb, vt, DK, DV), rows, 1e-10)
    if kt in TYPES:
        assert_bit_identical(rows, cpufuse.flash_attn(q, kb, vb, strategy="tiled", **call), f"rows/tiled {kt}/{vt}")
    # a hole in the mask: its block takes the row loops, the others the tiles
    m = np.zeros((1, 1, N, T), np.float16)
    m[..., 300:303] = -np.inf
    kb2, vb2 = kb.copy(), vb.copy()
    if kt in TYPES:
        kb2[:, :, 301, :2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    if vt in TYPES:
        vb2[:, :, 302, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    rows = cpufuse.flash_attn(q, kb2, vb2, m, strategy="rows", **call)
    assert np.isfinite(rows).all()
    assert_nmse(_expect(q, kb, kt, vb, vt, DK, DV, m), rows, 1e-10)
    one = [cpufuse.flash_attn(q[:, :, -1:], kb, vb, strategy="split", chunk=256, n_threads=nt, **call)
           for nt in (1, 2, 3)]
    assert_nmse(_expect(q[:, :, -1:], kb, kt, vb, vt, DK, DV), one[0], 1e-10)
    for nt, o in zip((2, 3), one[1:]):
        assert_bit_identical(one[0], o, f"split decode {kt}/{vt} {nt} threads")
