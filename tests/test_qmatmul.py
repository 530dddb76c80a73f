"""cpufuse.matmul / matmul_multi / matmul_swiglu on GGUF weights, every path against float64.

f32 mode: float64 x @ dequant(W)^T, NMSE <= 1e-10.
q8 mode: float64 of ggml's integer block arithmetic on the quantized activations (cpufuse.reference.quant),
NMSE <= 1e-10; and its overall error against the f32 result is stated (and bounded) separately.
"""
import numpy as np
import pytest

import cpufuse
from cpufuse.reference import quant as qref
from cpufuse.quant.types import QTYPES, SUPPORTED, QTensor
from _util import assert_nmse

TOL = 1e-10
QUANT = tuple(t for t in SUPPORTED if t.startswith("Q"))
FLOATS = ("F32", "F16", "BF16")


def _block(t):
    return QTYPES[t].block_size


def _weight(t, n_out, n_in, rng, kind="random"):
    if t in FLOATS or kind == "quantized":
        return qref.make_weight(t, n_out, n_in, rng)
    return qref.random_blocks(t, n_out, n_in, rng)


def _check(x, w, y, act, what):
    ref = qref.ref_matmul_q8(x, w) if act == "q8" else qref.ref_matmul_f32(x, w)
    assert_nmse(ref, y, TOL, what)


@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("qtype", SUPPORTED)
def test_types_shapes(isa, qtype, act, rng):
    b = _block(qtype)
    for nblk, n_out, rows in [(1, 1, 1), (3, 7, 3), (2, 33, 17), (1, 5, 4), (6, 8, 5)]:
        n_in = nblk * max(b, 32) if b > 1 else 37 * nblk  # float weights: odd n_in (no block)
        w = _weight(qtype, n_out, n_in, rng)
        x = rng.standard_normal((rows, n_in)).astype(np.float32)
        x0 = x.copy()
        y = cpufuse.matmul(x, w, act=act, isa=isa)
        assert y.shape == (rows, n_out) and y.dtype == np.float32
        _check(x, w, y, act, f"{isa} {qtype} {act} n_in={n_in} n_out={n_out} rows={rows}")
        assert np.array_equal(x, x0)


@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_prefill_512_rows(isa, qtype, act, rng):
    n_in = 2 * max(_block(qtype), 32) if qtype.endswith("K") else 96
    w = _weight(qtype, 33, n_in, rng, kind="quantized")
    x = rng.standard_normal((512, n_in)).astype(np.float32)
    _check(x, w, cpufuse.matmul(x, w, act=act, isa=isa), act, f"{isa} {qtype} {act} 512 rows")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16"])
def test_noncontiguous_x_and_out(isa, qtype, rng):
    n_in = 256 if qtype.endswith("K") else 64
    w = _weight(qtype, 9, n_in, rng)
    big = rng.standard_normal((7, 2 * n_in + 3)).astype(np.float32)
    x = big[::2, 3:3 + n_in]  # strided rows, offset start
    assert not x.flags.c_contiguous
    out = np.full((4, 20), np.nan, np.float32)
    y = cpufuse.matmul(x, w, act="q8", isa=isa, out=out[:, 5:14])
    assert y.base is out or np.shares_memory(y, out)
    _check(x, w, out[:, 5:14], "q8", f"{isa} {qtype} strided")
    assert np.isnan(out[:, :5]).all() and np.isnan(out[:, 14:]).all()
    # 3-D activations, batch dims kept
    x3 = rng.standard_normal((2, 3, n_in)).astype(np.float32)
    y3 = cpufuse.matmul(x3, w, act="f32", isa=isa)
    assert y3.shape == (2, 3, 9)
    _check(x3.reshape(6, n_in), w, y3.reshape(6, 9), "f32", f"{isa} {qtype} 3-D")


@pytest.mark.parametrize("act", ["f32", "q8"])
def test_threads_bit_identical(isa, act, rng):
    for qtype, rows in [("Q4_K", 1), ("Q4_1", 5), ("Q8_0", 33), ("IQ4_NL", 3), ("IQ4_XS", 1), ("Q2_K", 6),
                        ("Q3_K", 9), ("MXFP4", 4)]:
        n_in = 512 if _block(qtype) == 256 else 160
        w = _weight(qtype, 70, n_in, rng)
        x = rng.standard_normal((rows, n_in)).astype(np.float32)
        ys = [cpufuse.matmul(x, w, act=act, isa=isa, n_threads=n) for n in (1, 2, 3, 5)]
        for y in ys[1:]:
            assert np.array_equal(ys[0].view(np.uint32), y.view(np.uint32))


@pytest.mark.parametrize("qtype", FLOATS)
def test_float_weights_rows_split_over_threads(isa, qtype, rng):
    """float weights with fewer column chunks than threads (a MoE router: 32 outputs) also split their
    rows over the team; every output equals the same row's alone, bit for bit, at every thread count"""
    for n_in, n_out, rows in [(1024, 32, 100), (37, 5, 64), (80, 70, 33)]:
        w = _weight(qtype, n_out, n_in, rng)
        x = rng.standard_normal((rows, n_in)).astype(np.float32)
        ys = [cpufuse.matmul(x, w, isa=isa, n_threads=n) for n in (1, 2, 3, 16)]
        for y in ys[1:]:
            assert np.array_equal(ys[0].view(np.uint32), y.view(np.uint32)), (qtype, n_in, n_out)
        for i in (0, 31, rows - 1):
            assert np.array_equal(cpufuse.matmul(x[i], w, isa=isa).view(np.uint32), ys[0][i].view(np.uint32))
        _check(x, w, ys[0], "f32", f"{isa} {qtype} rows split")


@pytest.mark.parametrize("qtype", FLOATS)
def test_float_weights_few_rows_narrow_chunks(isa, qtype, rng):
    """float weights at fewer than 32 rows whose columns make fewer chunks than threads (a MoE router at
    decode: 1 row, 32 outputs) split their columns in chunks of 4 or more, about one a thread; every
    output equals the same row's in a 1-thread call and alone, bit for bit"""
    for n_in, n_out, rows in [(1024, 32, 1), (1024, 32, 3), (37, 5, 1), (64, 13, 2), (80, 70, 31), (96, 64, 1)]:
        w = _weight(qtype, n_out, n_in, rng)
        x = rng.standard_normal((rows, n_in)).astype(np.float32)
        ys = [cpufuse.matmul(x, w, isa=isa, n_threads=n) for n in (1, 2, 3, 4, 7, 16)]
        for y in ys[1:]:
            assert np.array_equal(ys[0].view(np.uint32), y.view(np.uint32)), (qtype, n_in, n_out, rows)
        for i in range(rows):
            assert np.array_equal(cpufuse.matmul(x[i], w, isa=isa).view(np.uint32), ys[0][i].view(np.uint32))
        _check(x, w, ys[0], "f32", f"{isa} {qtype} narrow chunks")


@pytest.mark.parametrize("qtype", QUANT)
def test_decode_row_equals_batch_row(isa, qtype, rng):
    """One activation row runs the decode tile (several panels per pass, wide chunks when there are
    enough of them, then narrow ones at the end); every output equals the same row's inside a
    multi-row call (the prompt tiles) bit for bit, for either weight layout and every thread count,
    and the q8 reference."""
    n_in = 2 * max(_block(qtype), 32)
    for n_out in (16, 48, 64, 130, 272, 520, 1000):
        w = _weight(qtype, n_out, n_in, rng)
        x = rng.standard_normal((9, n_in)).astype(np.float32)
        for wl in (w, w.repack(isa=isa)):
            ys = cpufuse.matmul(x, wl, isa=isa)
            for i in (0, 5, 8):
                for nth in (1, 2, 3, 7):
                    y1 = cpufuse.matmul(x[i], wl, isa=isa, n_threads=nth)
                    assert np.array_equal(y1.view(np.uint32), ys[i].view(np.uint32)), (qtype, n_out, i, nth, wl.layout)
        _check(x[:1], w, cpufuse.matmul(x[0], w, isa=isa)[None], "q8", f"{isa} {qtype} decode n_out={n_out}")


def test_q4k_decode_pass(isa, rng):
    """The one-row Q4_K pass (P16_NP panels at a time, prefetching one super-block ahead in each panel
    and, at the last super-block, into the next pass's panels or past the weight's end): K of 1-3
    super-blocks, N a multiple of the 4-panel pass or not, repacked and GGUF layout, 1 and 3 threads;
    against the q8 float64 reference, and bit for bit the row's result inside a 5-row call."""
    for n_in in (256, 512, 768):
        for n_out in (16, 64, 85, 200):
            w = _weight("Q4_K", n_out, n_in, rng)
            x = rng.standard_normal((5, n_in)).astype(np.float32)
            for wl in (w, w.repack(isa=isa)):
                ys = cpufuse.matmul(x, wl, isa=isa)
                for nth in (1, 3):
                    y1 = cpufuse.matmul(x[3], wl, isa=isa, n_threads=nth)
                    assert np.array_equal(y1.view(np.uint32), ys[3].view(np.uint32)), (n_in, n_out, nth, wl.layout)
                _check(x[3:4], w, y1[None], "q8", f"{isa} Q4_K decode n_in={n_in} n_out={n_out} {wl.layout}")


@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_decode_prep_split_over_threads(isa, qtype, act, rng):
    """With 1-3 rows and several threads, each row's RMS norm and activation quantization is split
    over the team in 256-element parts; the results equal one thread's and the rows' results inside
    a 6-row call (whole rows per thread) bit for bit, with and without the norm prologue."""
    for n_in in (1024, 2304):   # >= 512 elements per thread at 2 threads: the split path
        w = _weight(qtype, 40, n_in, rng)
        x = (rng.standard_normal((6, n_in)) * rng.uniform(0.1, 10, (6, 1))).astype(np.float32)
        g = rng.uniform(0.5, 1.5, n_in).astype(np.float32)
        for kw in ({}, {"norm_weight": g, "eps": 1e-5}):
            ref = cpufuse.matmul(x, w, act=act, isa=isa, n_threads=2, **kw)
            for rows in (1, 2, 3):
                for nth in (1, 2, 3):
                    y = cpufuse.matmul(x[:rows], w, act=act, isa=isa, n_threads=nth, **kw)
                    assert np.array_equal(y.view(np.uint32), ref[:rows].view(np.uint32)), (n_in, kw.keys(), rows, nth)


def test_q8_error_against_f32_is_activation_quantization(rng):
    """The q8 mode's error against exact f32 math is the activation quantization's (docs/semantics.md §8
    4.7: NMSE ~ c_B^2 / 193548; about 3e-5 for N(0,1) activations), nothing more."""
    for qtype in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"):
        w = qref.make_weight(qtype, 64, 1024, rng)
        x = rng.standard_normal((8, 1024)).astype(np.float32)
        err = assert_nmse(qref.ref_matmul_f32(x, w), cpufuse.matmul(x, w, act="q8"), 2e-4, qtype)
        assert err > 1e-7  # it really is the q8 path


@pytest.mark.parametrize("act", ["f32", "q8"])
def test_norm_prologue_equals_unfused(isa, act, rng):
    """RMS_NORM x w fused in front of the quantization equals cpufuse.rms_norm then matmul."""
    for qtype in ("Q4_1", "Q6_K"):
        n_in = 512 if qtype.endswith("K") else 576
        w = _weight(qtype, 13, n_in, rng)
        g = rng.uniform(0.5, 1.5, n_in).astype(np.float32)
        x = rng.standard_normal((3, n_in)).astype(np.float32) * 3
        xn = cpufuse.rms_norm(x, g, eps=1e-5, isa=isa)
        y_unfused = cpufuse.matmul(xn, w, act=act, isa=isa)
        y = cpufuse.matmul(x, w, act=act, isa=isa, norm_weight=g, eps=1e-5)
        if isa == "numba":  # Numba's rms_norm may round its scale differently from the C kernel
            assert_nmse(y_unfused, y, 1e-10, f"{isa} {qtype}")
        else:
            assert np.array_equal(y, y_unfused), f"{isa} {qtype} {act}"


@pytest.mark.parametrize("act", ["f32", "q8"])
def test_swiglu_epilogue_equals_unfused(isa, act, rng):
    for qtype, rows in [("Q4_0", 1), ("Q4_K", 3), ("Q8_0", 6), ("F16", 2), ("Q8_0/Q4_1", 5), ("Q4_K/Q6_K", 4),
                        ("Q4_0/F16", 3)]:
        tg, tu = (qtype.split("/") * 2)[:2]
        n_in = 256 if qtype.endswith("K") or "K/" in qtype else 64
        wg, wu = _weight(tg, 11, n_in, rng), _weight(tu, 11, n_in, rng)
        x = rng.standard_normal((rows, n_in)).astype(np.float32)
        g = cpufuse.matmul(x, wg, act=act, isa=isa)
        u = cpufuse.matmul(x, wu, act=act, isa=isa)
        ref = (g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64)))) * u
        y = cpufuse.matmul_swiglu(x, wg, wu, act=act, isa=isa)
        assert_nmse(ref, y, 1e-12, f"{isa} {qtype} swiglu")
        if isa != "numba":  # the epilogue is the graph's SwiGLU kernel: equal to the unfused chain
            from cpufuse import _registry
            from cpufuse._backend import ffi
            u2 = np.empty_like(g)
            _registry.kernel("swiglu", isa)(g.size, ffi.from_buffer("float[]", g), ffi.from_buffer("float[]", u),
                                                  g.size, ffi.from_buffer("float[]", u2))
            assert np.array_equal(y, u2), f"{isa} {qtype} swiglu epilogue != cf_swiglu_f32"


@pytest.mark.parametrize("act", ["f32", "q8"])
def test_multi_shares_activation(isa, act, rng):
    """Q, K, V on one activation (one quantization); mixed types with one vec_dot type, and
    mixed vec_dot types (each quantized once)."""
    for types in (("Q4_K", "Q4_K", "Q6_K"), ("Q4_0", "Q8_0", "Q4_1")):
        n_in = 512
        ws = [_weight(t, n, n_in, rng) for t, n in zip(types, (24, 8, 8))]
        x = rng.standard_normal((5, n_in)).astype(np.float32)
        ys = cpufuse.matmul_multi(x, ws, act=act, isa=isa)
        for w, y in zip(ws, ys):
            assert np.array_equal(y, cpufuse.matmul(x, w, act=act, isa=isa))


def test_quantize_act_matches_reference(isa, rng):
    for vtype, k in (("Q8_0", 96), ("Q8_1", 96), ("Q8_K", 512)):
        x = rng.standard_normal((3, k)).astype(np.float32)
        x[1, :32] = 0.0
        x[2, 5] = 40.0
        ref = qref.quantize_act(x, vtype)
        got = cpufuse.quant.matmul.quantize_act(x, vtype, isa=isa)
        assert np.array_equal(ref, got), vtype


def test_memmap_weight(tmp_path, rng):
    w = qref.make_weight("Q4_0", 16, 64, rng)
    p = tmp_path / "w.bin"
    w.raw.tofile(p)
    mm = np.memmap(p, dtype=np.uint8, mode="r", shape=w.raw.shape)
    wm = QTensor(mm, "Q4_0", (16, 64))
    x = rng.standard_normal((2, 64)).astype(np.float32)
    assert np.array_equal(cpufuse.matmul(x, wm), cpufuse.matmul(x, w))


def test_errors(rng):
    w = qref.make_weight("Q4_0", 8, 64, rng)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    with pytest.raises(TypeError, match="x must be float32"):
        cpufuse.matmul(x.astype(np.float64), w)
    with pytest.raises(TypeError, match="w must be a cpufuse.QTensor"):
        cpufuse.matmul(x, w.dequantize())
    with pytest.raises(ValueError, match="n_in=64"):
        cpufuse.matmul(x[:, :32], w)
    with pytest.raises(ValueError, match="act must be one of"):
        cpufuse.matmul(x, w, act="int4")
    with pytest.raises(ValueError, match="out must have shape"):
        cpufuse.matmul(x, w, out=np.empty((2, 9), np.float32))
    with pytest.raises(TypeError, match="out must be float32"):
        cpufuse.matmul(x, w, out=np.empty((2, 8), np.float64))
    with pytest.raises(ValueError, match="overlaps the input"):
        buf = np.zeros((2, 64), np.float32)
        cpufuse.matmul(buf, w, out=buf[:, :8])
    with pytest.raises(ValueError, match="eps must be given"):
        cpufuse.matmul(x, w, norm_weight=np.ones(64, np.float32))
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        cpufuse.matmul(x, w, norm_weight=np.ones(63, np.float32), eps=1e-5)
    with pytest.raises(ValueError, match="same shape"):
        cpufuse.matmul_swiglu(x, w, qref.make_weight("Q4_0", 9, 64, rng))
    with pytest.raises(ValueError, match="n_in"):
        cpufuse.matmul_multi(x, (w, qref.make_weight("Q4_0", 8, 96, rng)))
    with pytest.raises(ValueError, match="ws must be a tuple of 1 to 3"):
        cpufuse.matmul_multi(x, (w,) * 4)
    with pytest.raises(ValueError, match="isa"):
        cpufuse.matmul(x, w, isa="sse9")
    # truncated buffer / wrong block count: QTensor refuses it up front
    with pytest.raises(ValueError):
        QTensor(w.raw.reshape(-1)[:-1], "Q4_0", (8, 64))
    with pytest.raises(ValueError):
        QTensor(w.raw, "Q4_0", (8, 48))
    with pytest.raises(NotImplementedError, match="IQ3_S"):
        QTensor(w.raw, "IQ3_S", (8, 64))
    with pytest.raises(ValueError, match="n_in=64 is not a multiple of the Q3_K block size 256"):
        QTensor(w.raw, "Q3_K", (8, 64))


def test_empty(rng):
    w = qref.make_weight("Q8_0", 8, 64, rng)
    y = cpufuse.matmul(np.empty((0, 64), np.float32), w)
    assert y.shape == (0, 8)
