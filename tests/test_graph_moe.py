"""Weights as data that can be indexed: 3-D QTensors (views and repacking per expert), the routed
matmul g.qmatmul_id (ggml's mul_mat_id) against float64 for random routings, bit-identical across
thread counts and to each row run alone; top-k, take, sigmoid and the weighted sum over k against
float64, -inf and NaN included."""
import subprocess
import sys

import numpy as np
import pytest

import cpufuse
from cpufuse import Graph, GraphError, QTensor
from cpufuse.reference import moe as mref
from cpufuse.reference import quant as qref
from cpufuse.quant.matmul import matmul_geglu as _geglu
from _util import assert_nmse, clean_env

I32 = np.int32


def _isas():
    native = [i for i in cpufuse.available_isas() if i != "numba"]
    return native + (["numba"] if "numba" in cpufuse.available_isas() else [])


@pytest.fixture(params=[i for i in cpufuse.ALL_ISAS if i != "neon"])
def qisa(request):
    """every ISA this build and CPU run (neon: tests/test_neon_qemu.py), numba included"""
    if request.param not in cpufuse.available_isas():
        pytest.skip(f"{request.param}: not available in this build or on this CPU")
    return request.param


def stacked(qtype, n_exp, n_out, n_in, rng):
    """a 3-D QTensor of random valid blocks, one slab per expert"""
    ws = [qref.random_blocks(qtype, n_out, n_in, rng, d_range=(1e-2, 5e-2)) for _ in range(n_exp)]
    raw = np.stack([w.raw for w in ws])
    return QTensor(raw, qtype, (n_exp, n_out, n_in)), ws


# -- QTensor with an expert dimension ------------------------------------------------------------
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "F32", "MXFP4"])
def test_qtensor_3d_views_and_repack(rng, qtype):
    w3, ws = stacked(qtype, 5, 40, 256, rng)
    assert w3.shape == (5, 40, 256) and w3.n_expert == 5 and len(w3) == 5 and (w3.n_out, w3.n_in) == (40, 256)
    assert w3.nbytes == 5 * ws[0].nbytes
    deq = w3.dequantize()
    assert deq.shape == (5, 40, 256)
    for e in range(5):
        v = w3[e]
        assert v is w3.expert(e) is w3[e - 5] and v.shape == (40, 256) and v.n_expert == 0
        assert np.array_equal(v.raw, ws[e].raw) and np.shares_memory(v.raw, w3.raw)
        assert np.array_equal(deq[e], ws[e].dequantize())
    r3 = w3.repack()
    if qtype == "F32" or "numba" == cpufuse.available_isas()[0]:
        assert r3 is w3
        return
    assert r3.layout == "p16" and r3.shape == w3.shape and r3.n_expert == 5
    assert np.array_equal(r3.gguf_bytes(), w3.raw)
    for e in range(5):
        p2 = ws[e].repack()
        assert r3[e].layout == "p16" and r3[e].shape == (40, 256)
        assert np.array_equal(r3[e].raw, p2.raw), "expert slab repacked as its 2-D weight"
        assert r3[e].raw.ctypes.data % 64 == 0
        assert np.array_equal(r3[e].dequantize(), deq[e])
    x = rng.standard_normal((3, 256)).astype(np.float32)
    assert np.array_equal(cpufuse.matmul(x, r3[2]), cpufuse.matmul(x, ws[2]))


def test_qtensor_3d_errors(rng):
    w3, ws = stacked("Q8_0", 3, 16, 64, rng)
    with pytest.raises(ValueError, match="needs"):
        QTensor(w3.raw, "Q8_0", (4, 16, 64))
    with pytest.raises(ValueError, match="positive"):
        QTensor(w3.raw, "Q8_0", (0, 16, 64))
    with pytest.raises(ValueError, match="shape must be"):
        QTensor(w3.raw, "Q8_0", (1, 3, 16, 64))
    with pytest.raises(IndexError, match="out of range"):
        w3.expert(3)
    with pytest.raises(TypeError, match="int"):
        w3.expert(1.0)
    with pytest.raises(TypeError, match="no expert"):
        ws[0].expert(0)
    with pytest.raises(ValueError, match="3-D expert tensor"):
        cpufuse.matmul(np.zeros((1, 64), np.float32), w3)
    g = Graph()
    x = g.input("x", (2, 64))
    with pytest.raises(GraphError, match="3-D expert tensor"):
        g.qmatmul(x, w3)
    ids = g.input("ids", (2, 2), I32)
    with pytest.raises(GraphError, match="3-D cpufuse.QTensor"):
        g.qmatmul_id(x, ws[0], ids)
    with pytest.raises(GraphError, match="ids must be"):
        g.qmatmul_id(x, w3, g.input("bad", (3, 2), I32))
    with pytest.raises(GraphError, match="x 'x2' must be"):
        g.qmatmul_id(g.input("x2", (2, 32)), w3, ids)
    with pytest.raises(GraphError, match="glu"):
        g.qmatmul_id(x, w3, ids, up=w3, glu="relu")


# -- the routed matmul ---------------------------------------------------------------------------
def routed_plan(w, n, k, act="q8", up=None, glu="swiglu", isa=None):
    g = Graph()
    x = g.input("x", (n, w.n_in))
    ids = g.input("ids", (n, k), I32)
    g.output(g.qmatmul_id(x, w, ids, act=act, up=up, glu=glu, name="moe"))
    return g.compile(isa=isa)


def routing(rng, n, k, n_exp, skip=()):
    """k distinct experts per row, never one of skip (experts that get zero rows)"""
    pool = np.array([e for e in range(n_exp) if e not in skip])
    return np.stack([rng.choice(pool, k, replace=False) for _ in range(n)]).astype(I32)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "F16", "MXFP4"])
@pytest.mark.parametrize("repack", [False, True])
def test_qmatmul_id_against_float64(qisa, rng, qtype, repack):
    n_exp, N, K, k = 6, 48, 256, 2
    w0, _ = stacked(qtype, n_exp, N, K, rng)
    w = w0.repack(isa=qisa) if repack else w0
    for n in (1, 3, 37):       # decode, a few rows, odd prompt rows (P16 and AMX tiles and their tails)
        X = rng.standard_normal((n, K)).astype(np.float32)
        ids = routing(rng, n, k, n_exp, skip=(1, 4))
        for act in ("q8", "f32"):
            ref = mref.ref_matmul_id(X, w0, ids, act=act)   # the GGUF bytes
            outs = []
            plan = routed_plan(w, n, k, act=act, isa=qisa)
            for nth in (1, 3, 4):
                (y,) = plan.run(copy=True, n_threads=nth, x=X, ids=ids)
                outs.append(y)
            assert y.shape == (n, k, N)
            for o in outs[1:]:
                assert np.array_equal(o, outs[0]), f"{qtype} n={n} {act}: differs across thread counts"
            assert_nmse(ref, outs[0], 1e-10 if act == "f32" or qtype == "F16" else 1e-9, f"{qtype} n={n} {act}")
            # each row equals the row run alone through cpufuse.matmul (batch invariance)
            for r in (0, n - 1):
                for j in range(k):
                    alone = cpufuse.matmul(X[r:r + 1], w[int(ids[r, j])], act=act, isa=qisa)[0]
                    assert np.array_equal(outs[0][r, j], alone), (qtype, n, act, r, j)


def test_qmatmul_id_row_independent_of_batch(qisa, rng):
    """a row's result does not depend on the other rows routed with it (the serving contract)"""
    w, _ = stacked("Q4_K", 8, 64, 512, rng)
    w = w.repack(isa=qisa)
    X = rng.standard_normal((40, 512)).astype(np.float32)
    ids = routing(rng, 40, 4, 8)
    (big,) = routed_plan(w, 40, 4, isa=qisa).run(copy=True, x=X, ids=ids)
    for r in (0, 17, 39):
        (one,) = routed_plan(w, 1, 4, isa=qisa).run(copy=True, x=X[r:r + 1], ids=ids[r:r + 1])
        assert np.array_equal(one[0], big[r])
    # repeated experts in a row, every row on one expert, then all rows on distinct ones
    for ids2 in (np.zeros((40, 4), I32), np.tile(np.array([[3, 3, 5, 3]], I32), (40, 1))):
        (y,) = routed_plan(w, 40, 4, isa=qisa).run(copy=True, x=X, ids=ids2)
        assert np.array_equal(y[:, 0], cpufuse.matmul(X, w[int(ids2[0, 0])], isa=qisa))


@pytest.mark.parametrize("glu", ["swiglu", "geglu"])
def test_qmatmul_id_gate_up(qisa, rng, glu):
    n_exp, N, K, k, n = 4, 32, 256, 2, 9
    wg, _ = stacked("Q8_0", n_exp, N, K, rng)
    wu, _ = stacked("Q8_0", n_exp, N, K, rng)
    X = rng.standard_normal((n, K)).astype(np.float32)
    ids = routing(rng, n, k, n_exp)
    (y,) = routed_plan(wg, n, k, up=wu, glu=glu, isa=qisa).run(copy=True, x=X, ids=ids)
    assert_nmse(mref.ref_matmul_id(X, wg, ids, up=wu, glu=glu), y, 1e-9, glu)
    fn = cpufuse.matmul_swiglu if glu == "swiglu" else _geglu
    for r in (0, n - 1):
        for j in range(k):
            e = int(ids[r, j])
            assert np.array_equal(y[r, j], fn(X[r:r + 1], wg[e], wu[e], isa=qisa)[0])


def test_qmatmul_id_decode_threads(qisa, rng):
    """decode: each expert is chunked for its share of the threads (wide chunks of 4 panels a pass once
    the k experts together give each thread two), which changes no result; gate/up and down shapes"""
    n_exp, N, K, k = 8, 256, 256, 4
    wg, _ = stacked("Q8_0", n_exp, N, K, rng)
    wu, _ = stacked("Q8_0", n_exp, N, K, rng)
    wg, wu = wg.repack(isa=qisa), wu.repack(isa=qisa)
    for n in (1, 2):
        X = rng.standard_normal((n, K)).astype(np.float32)
        ids = routing(rng, n, k, n_exp)
        for up in (None, wu):
            plan = routed_plan(wg, n, k, up=up, isa=qisa)
            outs = [plan.run(copy=True, n_threads=nth, x=X, ids=ids)[0] for nth in (1, 2, 5, 8, 16)]
            for o in outs[1:]:
                assert np.array_equal(o, outs[0]), f"n={n} up={up is not None}: differs across thread counts"
            for r in range(n):
                for j in range(k):
                    e = int(ids[r, j])
                    alone = (cpufuse.matmul(X[r:r + 1], wg[e], isa=qisa) if up is None else
                             cpufuse.matmul_swiglu(X[r:r + 1], wg[e], wu[e], isa=qisa))[0]
                    assert np.array_equal(outs[0][r, j], alone), (n, r, j)


def test_qmatmul_id_hinted_chain(qisa, rng):
    """decode in a plan: gate/up then down on the same ids, then a dense matmul, the calls that publish
    prefetch hints for each other (qmoe.inc); no result depends on the thread count, and each (token,
    slot) row is the matmul of that row alone"""
    n_exp, N, K, k = 8, 64, 256, 4
    wg, wu, wd = (stacked("Q8_0", n_exp, a, b, rng)[0].repack(isa=qisa) for a, b in ((N, K), (N, K), (K, N)))
    wo = stacked("Q8_0", 1, N, K, rng)[0][0].repack(isa=qisa)   # a dense (N, K) weight: the next QMM
    for n in (1, 2):
        g = Graph()
        x = g.input("x", (n, K))
        ids = g.input("ids", (n, k), I32)
        gu = g.qmatmul_id(x, wg, ids, up=wu, glu="swiglu", name="gate_up")
        y = g.qmatmul_id(g.reshape(gu, (n * k, N)), wd, g.reshape(ids, (n * k, 1)), name="down")
        g.output(y)
        g.output(g.qmatmul(g.reshape(y, (n * k, K)), wo, name="dense"))
        plan = g.compile(isa=qisa)
        X = rng.standard_normal((n, K)).astype(np.float32)
        I = routing(rng, n, k, n_exp)
        res = [plan.run(copy=True, n_threads=nth, x=X, ids=I) for nth in (1, 2, 3, 8)]
        for r in res[1:]:
            for a, b in zip(r, res[0]):
                assert np.array_equal(a, b), f"n={n}: differs across thread counts"
        for r in range(n):
            for j in range(k):
                e = int(I[r, j])
                h = cpufuse.matmul_swiglu(X[r:r + 1], wg[e], wu[e], isa=qisa)
                d = cpufuse.matmul(h, wd[e], isa=qisa)
                y0, y1 = res[0][0].reshape(n * k, K), res[0][1].reshape(n * k, N)
                assert np.array_equal(y0[r * k + j], d[0]), (n, r, j)
                assert np.array_equal(y1[r * k + j], cpufuse.matmul(d, wo, isa=qisa)[0]), (n, r, j)


def test_qmatmul_id_decode_own_rows_and_fused_wsum(qisa, rng):
    """decode-sized calls (up to 16 routed rows): each thread quantizes its tasks' rows itself, and the down
    projection sums the k slots in its tasks (the WSUM right after it); routing and x change between runs of
    one plan (a thread's kept rows must not be reused), a row may repeat an expert, and every thread count
    gives the bits of each row run alone and of the slot-order sum"""
    n_exp, N, K, k = 8, 64, 256, 4
    wg, wu, wd = (stacked("Q8_0", n_exp, a, b, rng)[0].repack(isa=qisa) for a, b in ((N, K), (N, K), (K, N)))
    for n in (1, 3, 5):     # 4 and 12 routed rows: own rows and the fused sum; 20: the general path
        g = Graph()
        x = g.input("x", (n, K))
        ids = g.input("ids", (n, k), I32)
        wts = g.input("w", (n, k))
        gu = g.qmatmul_id(x, wg, ids, up=wu, glu="swiglu", name="gate_up")
        y = g.qmatmul_id(g.reshape(gu, (n * k, N)), wd, g.reshape(ids, (n * k, 1)), name="down")
        g.output(y)
        g.output(g.wsum(g.reshape(y, (n, k, K)), wts, name="moe_out"))
        plan = g.compile(isa=qisa)
        for step in range(3):
            X = rng.standard_normal((n, K)).astype(np.float32)
            I = routing(rng, n, k, n_exp) if step < 2 else np.tile(np.array([[3, 3, 5, 3]], I32), (n, 1))
            W = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
            res = [plan.run(copy=True, n_threads=nth, x=X, ids=I, w=W) for nth in (1, 2, 3, 4)]
            for r in res[1:]:
                for a, b in zip(r, res[0]):
                    assert np.array_equal(a, b), f"n={n} step={step}: differs across thread counts"
            yd = res[0][0].reshape(n, k, K)
            for r in range(n):
                for j in range(k):
                    e = int(I[r, j])
                    h = cpufuse.matmul_swiglu(X[r:r + 1], wg[e], wu[e], isa=qisa)
                    assert np.array_equal(yd[r, j], cpufuse.matmul(h, wd[e], isa=qisa)[0]), (n, step, r, j)
            acc = yd[:, 0] * W[:, 0:1]
            for j in range(1, k):
                acc = acc + yd[:, j] * W[:, j:j + 1]
            assert np.array_equal(res[0][1], acc), f"n={n} step={step}: the weighted sum"


def test_qmatmul_id_bad_ids(qisa, rng):
    w, _ = stacked("Q8_0", 3, 16, 64, rng)
    p = routed_plan(w, 2, 2, isa=qisa)
    X = rng.standard_normal((2, 64)).astype(np.float32)
    for bad in ([[0, 3], [1, 2]], [[-1, 0], [1, 2]]):
        with pytest.raises(GraphError, match=r"ids of 'ids' must be in \[0, 3\)"):
            p.run(x=X, ids=np.array(bad, I32))


def test_qmatmul_id_dynamic_rows(rng):
    """a DynamicPlan: the number of rows (and so each expert's) is a size, the program patched per run"""
    from cpufuse.graph import DynamicPlan
    w, _ = stacked("Q4_0", 5, 32, 128, rng)

    def build(T):
        g = Graph()
        x = g.input("x", (T, 128))
        ids = g.input("ids", (T, 2), I32)
        g.output(g.qmatmul_id(x, w, ids))
        return g

    dp = DynamicPlan(build, {"T": 16})
    for n in (1, 5, 16):
        X = rng.standard_normal((n, 128)).astype(np.float32)
        ids = routing(rng, n, 2, 5)
        (y,) = dp.run({"T": n}, copy=True, x=X, ids=ids)
        (want,) = routed_plan(w, n, 2).run(copy=True, x=X, ids=ids)
        assert np.array_equal(y, want)


# -- gating ops ----------------------------------------------------------------------------------
def gate_plan(shape, k, isa):
    g = Graph()
    x = g.input("x", shape)
    ids = g.topk(x, k, name="ids")
    g.output(ids, g.take(x, ids, name="vals"), g.sigmoid(x, name="sig"))
    return g.compile(isa=isa)


@pytest.mark.parametrize("isa", _isas())
def test_topk_take_sigmoid(isa, rng):
    X = rng.standard_normal((7, 33)).astype(np.float32)
    X[0, 5] = X[0, 9] = X[0, 20] = 3.0          # exact ties: lower index first
    X[1, :] = -np.inf
    X[1, 30] = np.nan
    X[1, 4] = 0.0                                 # one finite value, then -inf by index, NaN last
    X[2, ::2] = np.nan                            # NaN ranks below every number
    X[3, 0], X[3, 1] = -0.0, 0.0                  # -0 == +0: a tie
    X[3, 2:] = -1.0
    X[4, 3] = np.inf
    X[5, :] = np.nan                              # all NaN: by index
    X[6, 10] = 80.0
    X[6, 11] = -120.0                             # sigmoid saturates to 1 and 0
    k = 5
    ids, vals, sig = gate_plan(X.shape, k, isa).run(copy=True, x=X)
    want = mref.ref_topk(X, k)
    assert ids.dtype == I32 and np.array_equal(ids, want), (ids, want)
    assert ids[0, :3].tolist() == [5, 9, 20] and ids[1].tolist() == [4, 0, 1, 2, 3]
    assert ids[2].tolist()[:3] == sorted(ids[2].tolist()[:3], key=lambda i: -X[2, i])
    assert ids[3, :2].tolist() == [0, 1] and ids[4, 0] == 3 and ids[5].tolist() == [0, 1, 2, 3, 4]
    assert np.array_equal(vals, np.take_along_axis(X, want, -1), equal_nan=True)
    ref = mref.ref_sigmoid(X)
    assert np.array_equal(np.isnan(sig), np.isnan(X))
    ok = ~np.isnan(X)
    assert np.allclose(sig[ok], ref[ok], rtol=1e-6, atol=1.2e-38), np.abs(sig[ok] - ref[ok]).max()
    assert sig[6, 10] == 1.0 and sig[6, 11] == 0.0 and sig[1, 0] == 0.0 and sig[4, 3] == 1.0


@pytest.mark.parametrize("isa", _isas())
def test_topk_batched_and_k_equals_c(isa, rng):
    X = rng.standard_normal((2, 3, 16)).astype(np.float32)
    g = Graph()
    x = g.input("x", X.shape)
    g.output(g.topk(x, 16))
    (ids,) = g.compile(isa=isa).run(copy=True, x=X)
    assert np.array_equal(ids, np.argsort(-X, axis=-1, kind="stable"))


@pytest.mark.parametrize("isa", _isas())
def test_take_bad_index(isa, rng):
    g = Graph()
    x = g.input("x", (2, 8))
    idx = g.input("idx", (2, 3), I32)
    g.output(g.take(x, idx))
    with pytest.raises(GraphError, match=r"must be in \[0, 8\)"):
        g.compile(isa=isa).run(x=np.zeros((2, 8), np.float32), idx=np.array([[0, 1, 8], [0, 0, 0]], I32))


@pytest.mark.parametrize("isa", _isas())
def test_wsum_slot_order(isa, rng):
    n, k, m = 5, 4, 37
    Y = rng.standard_normal((n, k, m)).astype(np.float32)
    W = rng.uniform(0, 1, (n, k)).astype(np.float32)
    g = Graph()
    y, w = g.input("y", Y.shape), g.input("w", W.shape)
    g.output(g.wsum(y, w))
    (out,) = g.compile(isa=isa).run(copy=True, y=Y, w=W)
    acc = Y[:, 0] * W[:, :1]
    for j in range(1, k):
        acc = acc + Y[:, j] * W[:, j:j + 1]
    assert np.array_equal(out, acc), "f32 products added in slot order"
    assert_nmse(mref.ref_wsum(Y, W), out, 1e-12)
    with pytest.raises(GraphError, match="wsum"):
        g.wsum(y, g.input("w2", (n, k + 1)))


@pytest.mark.parametrize("isa", _isas())
def test_topk_wsum_threads(isa, rng):
    """top-k and the weighted sum over a prompt's rows split in row chunks: the same for every thread count"""
    n, c, k, m = 203, 33, 5, 70
    X = rng.standard_normal((n, c)).astype(np.float32)
    Y = rng.standard_normal((n, k, m)).astype(np.float32)
    W = rng.uniform(0, 1, (n, k)).astype(np.float32)
    g = Graph()
    x, y, w = g.input("x", X.shape), g.input("y", Y.shape), g.input("w", W.shape)
    g.output(g.topk(x, k), g.wsum(y, w))
    p = g.compile(isa=isa)
    acc = Y[:, 0] * W[:, :1]
    for j in range(1, k):
        acc = acc + Y[:, j] * W[:, j:j + 1]
    for nth in (1, 2, 7):
        ids, out = p.run(copy=True, n_threads=nth, x=X, y=Y, w=W)
        assert np.array_equal(ids, mref.ref_topk(X, k)), nth
        assert np.array_equal(out, acc), nth


def test_gating_errors():
    g = Graph()
    x = g.input("x", (2, 8))
    for k in (0, 9, 2.0, True):
        with pytest.raises(GraphError, match="k must be"):
            g.topk(x, k)
    with pytest.raises(GraphError, match="idx must be"):
        g.take(x, g.input("i", (3, 2), I32))
    with pytest.raises(GraphError, match="float32"):
        g.sigmoid(g.input("i2", (2,), I32))


def test_moe_block(qisa, rng):
    """router -> softmax -> top-k -> take -> gate/up + SwiGLU per expert -> down per expert -> weighted
    sum, one plan, equal to the same ops composed from cpufuse calls row by row"""
    n, D, F, E, k = 6, 256, 64, 8, 3
    router = qref.random_blocks("F32", E, D, rng)
    wg, _ = stacked("Q8_0", E, F, D, rng)
    wu, _ = stacked("Q8_0", E, F, D, rng)
    wd, _ = stacked("Q4_0", E, D, F, rng)
    X = rng.standard_normal((n, D)).astype(np.float32)
    g = Graph()
    x = g.input("x", (n, D))
    probs = g.softmax(g.qmatmul(x, router, act="f32"))
    ids = g.topk(probs, k)
    h = g.qmatmul_id(x, wg, ids, up=wu)                                            # (n, k, F)
    y = g.qmatmul_id(g.reshape(h, (n * k, F)), wd, g.reshape(ids, (n * k, 1)))    # (n * k, 1, D)
    g.output(g.wsum(g.reshape(y, (n, k, D)), g.take(probs, ids)), ids)
    out, got_ids = g.compile(isa=qisa).run(copy=True, x=X)
    pr = cpufuse.softmax(cpufuse.matmul(X, router, act="f32", isa=qisa), isa=qisa)
    assert np.array_equal(got_ids, mref.ref_topk(pr, k))
    want = np.zeros((n, D), np.float32)
    for r in range(n):
        for j in range(k):
            e = int(got_ids[r, j])
            hj = cpufuse.matmul_swiglu(X[r:r + 1], wg[e], wu[e], isa=qisa)
            t = cpufuse.matmul(hj, wd[e], isa=qisa)[0] * pr[r, e]
            want[r] = t if j == 0 else want[r] + t
    assert np.array_equal(out, want)


# -- gpt-oss's fused routed FFN: biases and swiglu_oai in the epilogue ----------------------------
@pytest.mark.parametrize("qtype,act", [("Q8_0", "q8"), ("MXFP4", "q8"), ("Q8_0", "f32"), ("F32", "q8")])
def test_qmatmul_id_swiglu_oai_biases(qisa, rng, qtype, act):
    """qmatmul_id(up=, glu="swiglu_oai", bias=, up_bias=) is bit for bit qmatmul_id, qmatmul_id, add_id,
    add_id, swiglu_oai; qmatmul_id(bias=) is qmatmul_id then add_id (down's bias); every thread count,
    prompt and decode shapes"""
    n_exp, N, K, k = 6, 96, 64, 3
    wg, wu = (stacked(qtype, n_exp, N, K, rng)[0] for _ in range(2))
    wd = stacked(qtype, n_exp, K, N, rng)[0]
    if qisa != "numba" and qtype != "F32":
        wg, wu, wd = wg.repack(isa=qisa), wu.repack(isa=qisa), wd.repack(isa=qisa)
    bg, bu = (rng.standard_normal((n_exp, N)).astype(np.float32) * 4 for _ in range(2))
    bd = rng.standard_normal((n_exp, K)).astype(np.float32)
    for n in (1, 2, 37):
        plans = []
        for fused in (True, False):
            g = Graph()
            x = g.input("x", (n, K))
            ids = g.input("ids", (n, k), I32)
            cg, cu, cd = g.constant(bg, "bg"), g.constant(bu, "bu"), g.constant(bd, "bd")
            if fused:
                a = g.qmatmul_id(x, wg, ids, act=act, up=wu, glu="swiglu_oai", bias=cg, up_bias=cu)
            else:
                a = g.swiglu_oai(g.add_id(g.qmatmul_id(x, wg, ids, act=act), cg, ids),
                                 g.add_id(g.qmatmul_id(x, wu, ids, act=act), cu, ids))
            g.output(a)
            ids1 = g.reshape(ids, (n * k, 1))
            a2 = g.reshape(a, (n * k, N))
            g.output(g.qmatmul_id(a2, wd, ids1, act=act, bias=cd) if fused else
                     g.add_id(g.qmatmul_id(a2, wd, ids1, act=act), cd, ids1))
            plans.append(g.compile(isa=qisa))
        X = (rng.standard_normal((n, K)) * 3).astype(np.float32)
        I = routing(rng, n, k, n_exp)
        ref = plans[1].run(copy=True, x=X, ids=I)
        assert np.abs(ref[0]).max() > 7 * 0.5 and np.isfinite(ref[1]).all()   # the clamps are reached
        for nth in (1, 2, 5):
            got = plans[0].run(copy=True, n_threads=nth, x=X, ids=I)
            for a, b in zip(got, ref):
                assert np.array_equal(a, b), f"n={n} threads={nth}: the fused routed FFN differs"


def test_qmatmul_id_bias_checks(rng):
    w, _ = stacked("Q8_0", 3, 16, 64, rng)
    g = Graph()
    x = g.input("x", (2, 64))
    ids = g.input("ids", (2, 2), I32)
    b = g.constant(np.zeros((3, 16), np.float32), "b")
    with pytest.raises(GraphError, match=r"bias must be a float32 node \(3, 16\)"):
        g.qmatmul_id(x, w, ids, bias=g.constant(np.zeros((3, 15), np.float32), "b2"))
    with pytest.raises(GraphError, match="up_bias needs up"):
        g.qmatmul_id(x, w, ids, up_bias=b)
    with pytest.raises(GraphError, match="biases with up= need glu='swiglu_oai'"):
        g.qmatmul_id(x, w, ids, up=w, bias=b)
    with pytest.raises(GraphError, match="glu must be"):
        g.qmatmul_id(x, w, ids, up=w, glu="oai")


@pytest.mark.parametrize("knob", ["CPUFUSE_MOE_GROUP=1", "CPUFUSE_MOE_GROUP=3", "CPUFUSE_MOE_SUMPAD=1",
                                  "CPUFUSE_MOE_TAIL=2", "CPUFUSE_MOE_TAIL=256"])
def test_qmatmul_id_decode_task_groups(knob):
    """A/B knobs of qmoe.inc, read once per process: CPUFUSE_MOE_GROUP (default 4), decode-sized routed calls whose
    tasks take one or several consecutive chunks of one expert; CPUFUSE_MOE_SUMPAD=1, the weighted sum's counters
    one to a cache line; CPUFUSE_MOE_TAIL=N, the region's last N experts one chunk a task (256: every expert).
    Each gives the same bits: the decode tests above, run again in a process with the knob
    set (each checks every thread count against the rows' own matmuls)"""
    tests = [f"{__file__}::{t}" for t in ("test_qmatmul_id_decode_threads", "test_qmatmul_id_hinted_chain",
                                           "test_qmatmul_id_decode_own_rows_and_fused_wsum")]
    name, _, val = knob.partition("=")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                       env=clean_env(**{name: val}), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout, r.stdout[-2000:]
