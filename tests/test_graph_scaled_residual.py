"""A branch's residual add done where the branch is written: QMATMUL [-> SCALE] -> ADD in the matmul's
epilogue (QM_EPI 2 and 5) and WSUM [-> SCALE] -> ADD in the weighted sum (the MoE layers' residual,
granite's residual scale). The fused plan gives the bits of the unfused one (each product rounded
to f32, then times s rounded, then the add: no FMA), for every thread count; a SCALE or product that
another node reads, or a broadcasting ADD, stays a step of its own."""
import numpy as np
import pytest

import cpufuse
from cpufuse import Graph, QTensor
from cpufuse.reference import quant as qref

I32 = np.int32


@pytest.fixture(params=[i for i in cpufuse.ALL_ISAS if i != "neon"])
def isa(request):
    """every ISA this build and CPU run (neon: tests/test_neon_qemu.py), numba included"""
    if request.param not in cpufuse.available_isas():
        pytest.skip(f"{request.param}: not available in this build or on this CPU")
    return request.param


def _same_fused_unfused(g, isa, threads=(1, 2, 3), **inputs):
    pf, pu = g.compile(fusion=True, isa=isa), g.compile(fusion=False, isa=isa)
    ref = pu.run(copy=True, **inputs)
    for nth in threads:
        got = pf.run(copy=True, n_threads=nth, **inputs)
        for k, (a, b) in enumerate(zip(got, ref)):
            assert np.array_equal(a, b, equal_nan=True), f"output {k}, {nth} thread(s):\n{pf.describe()}"
    return pf, ref


def _residual(rng, shape):
    r = rng.uniform(-3, 3, shape).astype(np.float32)
    r.flat[0], r.flat[-1] = np.inf, np.nan      # carried through the add as the ADD kernel carries them
    return r


@pytest.mark.parametrize("qtype,K", [("Q4_0", 96), ("Q8_0", 64), ("Q4_K", 256), ("F32", 40)])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("s", [0.22, -1.5, 0.0])
@pytest.mark.parametrize("branch_first", [True, False])
def test_qmatmul_scale_add_epilogue(isa, rng, qtype, K, rows, s, branch_first):
    """r + s * (x . W^T) with the scale and add in the matmul's epilogue: the unfused plan's bits, for each
    weight type, decode and prompt rows, s of either sign or 0, inf and NaN in the residual"""
    N = 37
    w = qref.random_blocks(qtype, N, K, rng) if qtype != "Q4_0" else qref.make_weight("Q4_0", N, K, rng)
    if isa != "numba" and qtype != "F32":
        w = w.repack(isa=isa)
    g = Graph()
    x, r = g.input("x", (rows, K)), g.input("r", (rows, N))
    b = g.scale(g.qmatmul(x, w, name="o"), s, name="res_scale")
    g.output(g.add(b, r, name="res") if branch_first else g.add(r, b, name="res"))
    X = rng.standard_normal((rows, K)).astype(np.float32)
    R = _residual(rng, (rows, N))
    pf, (out,) = _same_fused_unfused(g, isa, x=X, r=R)
    assert "QMATMUL -> SCALE -> ADD (the residual in the epilogue)" in pf.describe()
    assert len(pf.steps) == 1
    y = cpufuse.matmul(X, w, isa=isa)
    assert np.array_equal(out, R + y * np.float32(s), equal_nan=True)


def test_qmatmul_scale_add_not_fused(rng):
    """the SCALE read by another node, or an ADD that broadcasts: the steps stay apart, with the reason"""
    K, N, rows = 64, 16, 2
    w = qref.random_blocks("Q8_0", N, K, rng)
    X = rng.standard_normal((rows, K)).astype(np.float32)
    R = rng.standard_normal((rows, N)).astype(np.float32)
    g = Graph()
    x, r = g.input("x", (rows, K)), g.input("r", (rows, N))
    b = g.scale(g.qmatmul(x, w), 0.5, name="sc")
    g.output(g.add(r, b, name="res"), b)
    pf, _ = _same_fused_unfused(g, None, x=X, r=R)
    assert "QMATMUL -> SCALE -> ADD: 'sc' is a graph output" in pf.rejected
    assert len(pf.steps) == 2 and "QMATMUL -> SCALE (the scale in the epilogue)" in pf.describe()
    g = Graph()
    x, r = g.input("x", (rows, K)), g.input("r", (N,))
    g.output(g.add(g.scale(g.qmatmul(x, w), 0.5), r, name="bc"))
    pf = g.compile()
    assert len(pf.steps) == 2 and "SCALE -> ADD" not in pf.describe().split("rejected")[0]
    assert any("broadcasts" in why for why in pf.rejected), pf.rejected


@pytest.mark.parametrize("s", [None, 0.22])
@pytest.mark.parametrize("n", [1, 5, 203])
def test_wsum_scale_add(isa, rng, s, n):
    """the weighted sum over k with the residual (and its scale) added as each element is written: the
    unfused plan's bits for every thread count, rows split in chunks"""
    k, m = 4, 70
    Y = rng.standard_normal((n, k, m)).astype(np.float32)
    W = rng.uniform(0, 1, (n, k)).astype(np.float32)
    R = _residual(rng, (n, m))
    g = Graph()
    y, w, r = g.input("y", Y.shape), g.input("w", W.shape), g.input("r", R.shape)
    b = g.wsum(y, w, name="moe_out")
    if s is not None:
        b = g.scale(b, s, name="out_scale")
    g.output(g.add(r, b, name="out"))
    pf, (out,) = _same_fused_unfused(g, isa, threads=(1, 2, 7), y=Y, w=W, r=R)
    assert ("WSUM -> SCALE -> ADD" if s is not None else "WSUM -> ADD (the residual in the sum)") in pf.describe()
    acc = Y[:, 0] * W[:, :1]
    for j in range(1, k):
        acc = acc + Y[:, j] * W[:, j:j + 1]
    if s is not None:
        acc = acc * np.float32(s)
    assert np.array_equal(out, R + acc, equal_nan=True)


def _stacked(qtype, n_exp, n_out, n_in, rng, isa):
    ws = [qref.random_blocks(qtype, n_out, n_in, rng, d_range=(1e-2, 5e-2)) for _ in range(n_exp)]
    w3 = QTensor(np.stack([w.raw for w in ws]), qtype, (n_exp, n_out, n_in))
    return w3.repack(isa=isa)


@pytest.mark.parametrize("s", [None, -0.75])
def test_routed_ffn_residual_in_down_tasks(isa, rng, s):
    """decode-sized routed FFN: gate/up, down, and the weighted sum with the layer's residual (and scale)
    done in down's tasks; routing changes between runs; every thread count gives the unfused plan's bits"""
    n_exp, N, K, k = 8, 64, 256, 4
    wg, wu, wd = (_stacked("Q8_0", n_exp, a, b, rng, isa) for a, b in ((N, K), (N, K), (K, N)))
    for n in (1, 3):
        g = Graph()
        x, r = g.input("x", (n, K)), g.input("r", (n, K))
        ids, wts = g.input("ids", (n, k), I32), g.input("w", (n, k))
        gu = g.qmatmul_id(x, wg, ids, up=wu, glu="swiglu", name="gate_up")
        y = g.qmatmul_id(g.reshape(gu, (n * k, N)), wd, g.reshape(ids, (n * k, 1)), name="down")
        b = g.wsum(g.reshape(y, (n, k, K)), wts, name="moe_out")
        if s is not None:
            b = g.scale(b, s, name="out_scale")
        g.output(g.add(b, r, name="out"))
        for step in range(3):
            X = rng.standard_normal((n, K)).astype(np.float32)
            pool = np.arange(n_exp)
            I = np.stack([rng.choice(pool, k, replace=False) for _ in range(n)]).astype(I32)
            W = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
            pf, _ = _same_fused_unfused(g, isa, threads=(1, 2, 3, 4), x=X, r=_residual(rng, (n, K)), ids=I, w=W)
        assert "-> ADD (the residual in the sum)" in pf.describe()


@pytest.mark.parametrize("qtype,K", [("Q8_0", 64), ("Q4_K", 256), ("F32", 40)])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("norm", [False, True])
def test_qmatmul_scale_epilogue(isa, rng, qtype, K, rows, norm):
    """s * (x . W^T) with the scale in the matmul's epilogue (granite's logit scale after the head, whose
    RMS_NORM prologue stays folded too): the unfused plan's bits"""
    N, s = 45, 0.125
    w = qref.random_blocks(qtype, N, K, rng)
    if isa != "numba" and qtype != "F32":
        w = w.repack(isa=isa)
    g = Graph()
    x = g.input("x", (rows, K))
    NW = rng.uniform(0.5, 1.5, K).astype(np.float32)
    h = g.mul(g.rms_norm(x, 1e-6), g.constant(NW, "nw")) if norm else x
    g.output(g.scale(g.qmatmul(h, w, act="f32" if norm else "q8", name="head"), s, name="logit_scale"))
    X = rng.standard_normal((rows, K)).astype(np.float32)
    pf = g.compile(isa=isa)
    assert len(pf.steps) == 1 and "QMATMUL -> SCALE" in pf.describe(), pf.describe()
    if not norm:   # the norm prologue rounds differently from a separate RMS_NORM; the scale does not
        _same_fused_unfused(g, isa, x=X)
    (out,) = pf.run(copy=True, x=X)
    g2 = Graph()
    x2 = g2.input("x", (rows, K))
    h2 = g2.mul(g2.rms_norm(x2, 1e-6), g2.constant(NW, "nw")) if norm else x2
    g2.output(g2.qmatmul(h2, w, act="f32" if norm else "q8"))
    (y,) = g2.compile(isa=isa).run(copy=True, x=X)
    assert np.array_equal(out, y * np.float32(s), equal_nan=True)
