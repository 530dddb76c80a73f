"""P16 repacked weights (QTensor.repack, docs/quant-design.md "Repacked weights"): the layout round
trip, results bit-identical to the GGUF layout on every path and activation mode, and batch
invariance: a row's result does not depend on which rows share the call."""
import numpy as np
import pytest

import cpufuse
from cpufuse.reference import quant as qref
from cpufuse.quant.types import QTensor

QUANT = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def _k(qt):
    return 512 if qt.endswith("K") else 96


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
    for lo, hi in ((0, 23), (3, 12), (5, 6), (7, 16), (0, 8)):
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
    K = _k(qt)
    w = qref.make_weight(qt, 40, K, rng)
    x = rng.standard_normal((37, K)).astype(np.float32)
    for ww in (w, w.repack()):
        a = cpufuse.matmul(x, ww, isa="avx512")
        b = cpufuse.matmul(x, ww, isa="amx")
        assert np.array_equal(_bits(a), _bits(b))
        assert np.array_equal(_bits(b[5]), _bits(cpufuse.matmul(x[5:6], ww, isa="amx")[0]))
        s1 = cpufuse.matmul_swiglu(x, ww, ww, isa="avx512")
        s2 = cpufuse.matmul_swiglu(x, ww, ww, isa="amx")
        assert np.array_equal(_bits(s1), _bits(s2))
