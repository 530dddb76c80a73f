"""cpufuse.Graph with quantized weights, RoPE and KV-cache writes: g.qmatmul / g.rope / g.cache_write;
the QKV (shared activation), gate/up + SwiGLU, RMS_NORM -> MUL prologue and ROPE -> CACHE_WRITE
fusions equal the unfused plan (bit for bit, SwiGLU to NMSE 1e-12), illegal candidates stay unfused
with a reason, C segments around the Python steps still run, cache writes always run."""
import importlib

import numpy as np
import pytest

import cpufuse
from cpufuse import Graph, GraphError
from cpufuse.reference import quant as qref
from _util import assert_nmse

NMSE = 1e-12


@pytest.fixture(params=["best", "numba"])
def qisa(request):
    """the best native ISA and numba (the quantized kernels' two implementations)"""
    if request.param == "numba":
        if "numba" not in cpufuse.available_isas():
            pytest.skip("numba is not available")
        return "numba"
    return [i for i in cpufuse.available_isas() if i != "numba"][0]


def U(rng, shape):
    return rng.uniform(-2, 2, shape).astype(np.float32)


def fused(plan):
    return [st for st in plan.steps if len(st.nodes) > 1]


def both(g, isa, exact=True, **inputs):
    pf, pu = g.compile(fusion=True, isa=isa), g.compile(fusion=False, isa=isa)
    of, ou = pf.run(copy=True, **inputs), pu.run(copy=True, **inputs)
    for k, (a, b) in enumerate(zip(of, ou)):
        assert a.shape == b.shape == g.outputs[k].shape
        if exact:
            assert np.array_equal(a, b), f"output {k} ({g.outputs[k].name}):\n{pf.describe()}"
        else:
            assert_nmse(b.astype(np.float64), a, NMSE, f"output {k}")
    assert all(len(st.nodes) == 1 for st in pu.steps) and "fused:" not in pu.describe()
    return pf, pu, of


def weights(rng, n_in, outs, qtype="Q4_0"):
    if qtype == "Q4_0":
        return [qref.make_weight("Q4_0", n, n_in, rng) for n in outs]
    return [qref.random_blocks(qtype, n, n_in, rng) for n in outs]


@pytest.mark.parametrize("act", ["q8", "f32"])
@pytest.mark.parametrize("k", [2, 3])
def test_qkv_shared_activation(qisa, rng, act, k):
    n_in, T = 256, 3
    ws = weights(rng, n_in, [256, 64, 64][:k])
    g = Graph()
    x = g.input("x", (T, n_in))
    qs = [g.qmatmul(x, w, act=act, name=f"q{i}") for i, w in enumerate(ws)]
    g.output(*qs)
    X = U(rng, (T, n_in))
    pf, pu, of = both(g, qisa, x=X)
    assert [st.note for st in fused(pf)] == [f"QMATMUL x{k} (shared activation)"], pf.describe()
    assert f"fused: QMATMUL x{k} (shared activation)" in pf.describe() and pf.rejected == []
    assert len(pf.steps) == 1 and len(pu.steps) == k
    for y, w in zip(of, ws):  # = the op itself
        assert np.array_equal(y, cpufuse.matmul(X, w, act=act, isa=qisa))


@pytest.mark.parametrize("k", [1, 3])
def test_norm_prologue_qkv(qisa, rng, k):
    n_in, T = 256, 4
    ws = weights(rng, n_in, [128, 64, 32][:k])
    g = Graph()
    x = g.input("x", (T, n_in))
    nw = g.constant(U(rng, (n_in,)), "attn_norm.weight")
    h = g.mul(g.rms_norm(x, 1e-5, name="norm"), nw, name="h")
    g.output(*[g.qmatmul(h, w, name=f"q{i}") for i, w in enumerate(ws)])
    pf, pu, _ = both(g, qisa, x=U(rng, (T, n_in)))
    note = "RMS_NORM -> MUL -> QMATMUL" + (f" x{k} (shared activation)" if k > 1 else "")
    assert [st.note for st in fused(pf)] == [note] and len(pf.steps) == 1, pf.describe()
    assert f"fused: {note}" in pf.describe() and pf.rejected == []
    assert [s.kind for s in pu.steps] == ["rms_norm", "mul"] + ["qmatmul"] * k


@pytest.mark.parametrize("K,T", [(256, 1), (1024, 1), (2304, 1), (1024, 2), (2304, 3)])
def test_decode_rows_plan_threads(rng, K, T):
    """a plan's q8 calls of 1-3 rows (decode) prepare their rows inside the region, on every thread (quant.inc,
    qm_own_task): the fused norm + QKV of three types (three activation kinds) and norm + SwiGLU, fused and
    unfused, at 1-4 threads give the bits of the 1-thread unfused plan, whose matmuls equal the op's"""
    isa = [i for i in cpufuse.available_isas() if i != "numba"][0]
    ws = [qref.make_weight("Q4_0", 96, K, rng), qref.random_blocks("Q4_K", 64, K, rng),
          qref.random_blocks("Q8_0", 48, K, rng)]
    wg, wu = qref.make_weight("Q4_0", 80, K, rng), qref.make_weight("Q4_0", 80, K, rng)
    g = Graph()
    x = g.input("x", (T, K))
    h = g.mul(g.rms_norm(x, 1e-5, name="norm"), g.constant(U(rng, (K,)), "attn_norm.weight"), name="h")
    qs = [g.qmatmul(h, w, name=f"q{i}") for i, w in enumerate(ws)]
    ff = g.mul(g.silu(g.qmatmul(h, wg, name="gate")), g.qmatmul(h, wu, name="up"), name="ff")
    g.output(h, *qs, ff)
    X = U(rng, (T, K))
    pf, pu = g.compile(fusion=True, isa=isa), g.compile(fusion=False, isa=isa)
    ref = pu.run(copy=True, n_threads=1, x=X)
    for y, w in zip(ref[1:4], ws):
        assert np.array_equal(y, cpufuse.matmul(ref[0], w, isa=isa, n_threads=1))
    for plan in (pf, pu):
        for nth in (1, 2, 3, 4):
            got = plan.run(copy=True, n_threads=nth, x=X)
            for k, (a, b) in enumerate(zip(got[1:], ref[1:])):
                assert np.array_equal(a, b), (plan.describe(), nth, k)


@pytest.mark.parametrize("kv_type", [None, "q8_0"])
@pytest.mark.parametrize("T", [1, 3])
def test_qkv_rope_kv_write_in_region(rng, T, kv_type):
    """a plan's QKV call with the K rope, the K and V cell writes and the Q rope after it (a decode step's order)
    runs those records in its task region at 1-3 rows with a team (graph.inc plan_after_of): the outputs and the
    caches are the bits of the 1-thread plan (no team), fused and unfused, at 1-4 threads"""
    isa = [i for i in cpufuse.available_isas() if i != "numba"][0]
    K, H, HKV, D = 256, 4, 2, 64
    wq, wk, wv = (qref.make_weight("Q4_0", n, K, rng) for n in (H * D, HKV * D, HKV * D))
    cdt = np.uint8 if kv_type else np.float16
    shape = (8, HKV, D // 32 * 34) if kv_type else (8, HKV, D)
    kc, vc = np.zeros(shape, cdt), np.zeros(shape, cdt)
    g = Graph()
    x = g.input("x", (T, K))
    pos, cells = g.input("pos", (T,), np.int32), g.input("cells", (T,), np.int32)
    h = g.mul(g.rms_norm(x, 1e-5), g.constant(U(rng, (K,)), "attn_norm"))
    q, k, v = (g.qmatmul(h, w) for w in (wq, wk, wv))
    kw = g.kv_write(g.rope(g.reshape(k, (T, HKV, D)), pos, D, name="rope_k"), kc, cells, kv_type=kv_type)
    vw = g.kv_write(g.reshape(v, (T, HKV, D)), vc, cells, kv_type=kv_type)
    g.output(g.rope(g.reshape(q, (T, H, D)), pos, D, name="rope_q"), kw, vw)
    X, P, C = U(rng, (T, K)), np.arange(3, 3 + T, dtype=np.int32), np.array([5, 1, 6][:T], np.int32)
    pf, pu = g.compile(fusion=True, isa=isa), g.compile(fusion=False, isa=isa)
    ref = [a.copy() for a in pf.run(copy=True, n_threads=1, x=X, pos=P, cells=C)]
    assert kc.any() and vc.any()
    for plan in (pf, pu):
        _same_bits_every_team(plan, ref, (kc, vc), x=X, pos=P, cells=C)


def _same_bits_every_team(plan, ref, caches, **inputs):
    """the plan's outputs (caches zeroed before each run) are `ref`'s bits at 1-4 threads"""
    for nth in (1, 2, 3, 4):
        for c in caches:
            c[:] = 0
        got = plan.run(copy=True, n_threads=nth, **inputs)
        for k_, (a, b) in enumerate(zip(got, ref)):
            assert np.array_equal(a, b), (plan.describe(), nth, k_)


@pytest.mark.parametrize("T", [1, 3])
def test_qk_norm_rope_kv_write_in_region(rng, T):
    """qwen3's order (QKV, the per-head Q and K RMS norms, the K rope, the K and V cell writes, the Q rope), then the
    output projection with its residual and the FFN norm after it: at 1-3 rows with a team the norms, ropes and
    writes run in the QKV call's (and the norm in the output call's) task region (graph.inc plan_after_of), and
    no buffer of those steps is shared between them (records.py _after_windows); the outputs and caches are the
    bits of the 1-thread plan, fused and unfused, at 1-4 threads"""
    from cpufuse.graph.records import _after_windows
    isa = [i for i in cpufuse.available_isas() if i != "numba"][0]
    K, H, HKV, D = 256, 4, 2, 64
    wq, wk, wv = (qref.make_weight("Q4_0", n, K, rng) for n in (H * D, HKV * D, HKV * D))
    wo = qref.make_weight("Q4_K", K, H * D, rng)
    kc, vc = np.zeros((8, HKV, D), np.float16), np.zeros((8, HKV, D), np.float16)
    g = Graph()
    x = g.input("x", (T, K))
    pos, cells = g.input("pos", (T,), np.int32), g.input("cells", (T,), np.int32)
    h = g.mul(g.rms_norm(x, 1e-5), g.constant(U(rng, (K,)), "attn_norm"))
    q, k, v = (g.qmatmul(h, w) for w in (wq, wk, wv))
    qn = g.mul(g.rms_norm(g.reshape(q, (T, H, D)), 1e-6), g.constant(U(rng, (D,)), "q_norm"))
    kn = g.mul(g.rms_norm(g.reshape(k, (T, HKV, D)), 1e-6), g.constant(U(rng, (D,)), "k_norm"))
    kw = g.kv_write(g.rope(kn, pos, D, name="rope_k"), kc, cells)
    vw = g.kv_write(g.reshape(v, (T, HKV, D)), vc, cells)
    rq = g.rope(qn, pos, D, name="rope_q")
    res = g.add(g.qmatmul(g.reshape(rq, (T, H * D)), wo), x)
    hf = g.mul(g.rms_norm(res, 1e-5), g.constant(U(rng, (K,)), "ffn_norm"))
    g.output(hf, res, kw, vw)
    X, P, C = U(rng, (T, K)), np.arange(3, 3 + T, dtype=np.int32), np.array([5, 1, 6][:T], np.int32)
    pf, pu = g.compile(fusion=True, isa=isa), g.compile(fusion=False, isa=isa)
    ref = [a.copy() for a in pf.run(copy=True, n_threads=1, x=X, pos=P, cells=C)]
    for plan in (pf, pu):
        ends = _after_windows(plan.steps)
        for i, st in enumerate(plan.steps):   # a window's steps share no buffer but the ones they pass along
            for j in range(i + 1, ends[i] + 1):
                for o in (n for n in st.outs if n is not None and n.id in plan.buffers):
                    for n in (m for m in plan.steps[j].outs if m is not None and m.id in plan.buffers):
                        assert not np.shares_memory(plan.buffers[o.id], plan.buffers[n.id]), (plan.describe(), i, j)
        assert any(e > i for i, e in enumerate(ends)), plan.describe()
        _same_bits_every_team(plan, ref, (kc, vc), x=X, pos=P, cells=C)


def test_norm_prologue_input_weight(rng):
    """the norm weight may be a run-time input (weight first in the MUL too)"""
    n_in, T = 256, 2
    (w,) = weights(rng, n_in, [64], "Q4_K")
    g = Graph()
    x, nw = g.input("x", (T, n_in)), g.input("nw", (n_in,))
    g.output(g.qmatmul(g.mul(nw, g.rms_norm(x, 1e-6)), w))
    pf, _, _ = both(g, None, x=U(rng, (T, n_in)), nw=U(rng, (n_in,)))
    assert [st.note for st in fused(pf)] == ["RMS_NORM -> MUL -> QMATMUL"], pf.describe()


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("order", ["g_u_s_m", "g_s_u_m", "u_g_s_m"])
def test_swiglu(qisa, rng, norm, order):
    n_in, n_ff, T = 256, 96, 3
    wg, wu = weights(rng, n_in, [n_ff, n_ff], "Q4_K")
    g = Graph()
    x = g.input("x", (T, n_in))
    if norm:
        x2 = g.mul(g.rms_norm(x, 1e-5), g.constant(U(rng, (n_in,)), "ffn_norm.weight"))
    else:
        x2 = x
    if order == "g_u_s_m":
        gt, up = g.qmatmul(x2, wg, name="gate"), g.qmatmul(x2, wu, name="up")
        s = g.silu(gt)
    elif order == "g_s_u_m":
        gt = g.qmatmul(x2, wg, name="gate")
        s = g.silu(gt)
        up = g.qmatmul(x2, wu, name="up")
    else:
        up, gt = g.qmatmul(x2, wu, name="up"), g.qmatmul(x2, wg, name="gate")
        s = g.silu(gt)
    g.output(g.mul(s, up, name="ffn") if order != "g_s_u_m" else g.mul(up, s, name="ffn"))
    X = U(rng, (T, n_in))
    pf, pu, (y,) = both(g, qisa, exact=False, x=X)
    note = ("RMS_NORM -> MUL -> " if norm else "") + "QMATMUL x2 -> SILU -> MUL (matmul_swiglu)"
    assert [st.note for st in fused(pf)] == [note] and len(pf.steps) == 1, pf.describe()
    assert pf.steps[0].kind == "qmatmul_swiglu" and pf.rejected == []
    if not norm:
        assert np.array_equal(y, cpufuse.matmul_swiglu(X, wg, wu, isa=qisa))


def _block(rng, n_in=256, T=5):
    Wq, Wk, Wv = weights(rng, n_in, [256, 64, 64])
    Wg, Wu = weights(rng, n_in, [n_in, n_in], "Q4_K")
    g = Graph()
    x = g.input("x", (T, n_in))
    nw = g.constant(U(rng, (n_in,)), "attn_norm")
    h = g.mul(g.rms_norm(x, 1e-5, name="norm"), nw, name="hn")
    q, k, v = g.qmatmul(h, Wq, name="q"), g.qmatmul(h, Wk, name="k"), g.qmatmul(h, Wv, name="v")
    r = g.add(q, x, name="res")
    h2 = g.mul(g.rms_norm(r, 1e-5, name="norm2"), g.constant(U(rng, (n_in,)), "ffn_norm"), name="hn2")
    gg, uu = g.qmatmul(h2, Wg, name="gate"), g.qmatmul(h2, Wu, name="up")
    y = g.add(g.mul(g.silu(gg, name="s"), uu, name="ffn"), r, name="out")
    g.output(k, v, y)
    return g, U(rng, (T, n_in))


def test_block_fused_unfused(qisa, rng):
    g, X = _block(rng)
    pf, pu, of = both(g, qisa, exact=False, x=X)
    notes = [st.note for st in fused(pf)]
    assert notes == ["RMS_NORM -> MUL -> QMATMUL x3 (shared activation)",
                     "RMS_NORM -> MUL -> QMATMUL x2 -> SILU -> MUL (matmul_swiglu)"], pf.describe()
    # the residual ADD gives its norm to the matmul prologue, and says so
    assert any("folded into the QMATMUL prologue" in r for r in pf.rejected), pf.describe()
    # k and v are bit-identical (no swiglu on their path)
    of2 = pf.run(copy=True, x=X)
    assert all(np.array_equal(a, b) for a, b in zip(of, of2))
    if qisa != "numba":  # the quantized matmuls run inside the C plan executor: one C call
        assert [k for k, _ in pf.segments] == ["c"], pf.describe()
        assert [k for k, _ in pu.segments] == ["c"], pu.describe()
        assert "the whole plan is ONE C call" in pf.describe()


@pytest.mark.parametrize("py_steps", [False, True])
def test_native_segments_around_qmatmul(monkeypatch, rng, py_steps):
    """softmax -> qmatmul -> rms_norm*w: one C call; with qmatmul forced to Python (graph.PY_STEPS),
    C segments run before and after the Python step, with the same result"""
    if py_steps:
        monkeypatch.setattr(cpufuse.graph.records, "PY_STEPS", {"qmatmul"})
    n_in, T = 64, 3
    (w,) = weights(rng, n_in, [64])
    g = Graph()
    x = g.input("x", (T, n_in))
    s = g.softmax(g.scale(x, 0.5))
    y = g.mul(g.rms_norm(g.qmatmul(s, w, act="f32"), 1e-6), g.constant(U(rng, (64,)), "w"))
    g.output(y)
    X = U(rng, (T, n_in))
    pf, pu, (yf,) = both(g, None, x=X)
    assert [k for k, _ in pf.segments] == (["c", "py", "c"] if py_steps else ["c"]), pf.describe()
    ref = cpufuse.rms_norm(cpufuse.matmul(cpufuse.softmax(X, scale=0.5), w, act="f32"),
                           g.nodes[-2].value, eps=1e-6)
    assert np.array_equal(yf, ref)


# -- illegal candidates ------------------------------------------------------------------------
def test_swiglu_gate_is_output(rng):
    n_in = 256
    wg, wu = weights(rng, n_in, [64, 64])
    g = Graph()
    x = g.input("x", (2, n_in))
    gt, up = g.qmatmul(x, wg, name="gate"), g.qmatmul(x, wu, name="up")
    g.output(g.mul(g.silu(gt), up), gt)
    pf, _, _ = both(g, None, x=U(rng, (2, n_in)))
    assert "QMATMUL x2 -> SILU -> MUL: 'gate' is a graph output" in pf.describe()
    assert [st.note for st in fused(pf)] == ["QMATMUL x2 (shared activation)", "SILU -> MUL"], pf.describe()


def test_swiglu_mixed_weight_types(qisa, rng):
    """same shape, different quant types: still one matmul_swiglu"""
    n_in = 256
    wg, wu = qref.make_weight("Q8_0", 64, n_in, rng), qref.make_weight("Q4_0", 64, n_in, rng)
    g = Graph()
    x = g.input("x", (2, n_in))
    g.output(g.mul(g.silu(g.qmatmul(x, wg)), g.qmatmul(x, wu)))
    pf, _, _ = both(g, qisa, exact=False, x=U(rng, (2, n_in)))
    assert [st.kind for st in pf.steps] == ["qmatmul_swiglu"], pf.describe()


def test_swiglu_shared_gate_up_act_differs(rng):
    n_in = 256
    wg, wu = weights(rng, n_in, [64, 64])
    g = Graph()
    x = g.input("x", (2, n_in))
    g.output(g.mul(g.silu(g.qmatmul(x, wg, name="gate")), g.qmatmul(x, wu, act="f32", name="up")))
    pf, _, _ = both(g, None, x=U(rng, (2, n_in)))
    assert "QMATMUL x2 -> SILU -> MUL: 'gate' and 'up' use different act modes" in pf.describe()
    assert fused(pf) == [], pf.describe()


def test_different_inputs_or_act_not_grouped(rng):
    n_in = 256
    w1, w2 = weights(rng, n_in, [64, 64])
    g = Graph()
    x, z = g.input("x", (2, n_in)), g.input("z", (2, n_in))
    g.output(g.qmatmul(x, w1), g.qmatmul(z, w2), g.qmatmul(x, w1, act="f32"), g.qmatmul(x, w2, act="f32"))
    pf, _, _ = both(g, None, x=U(rng, (2, n_in)), z=U(rng, (2, n_in)))
    assert [st.note for st in fused(pf)] == ["QMATMUL x2 (shared activation)"], pf.describe()
    assert len(pf.steps) == 3


def test_norm_mul_with_extra_consumer(rng):
    n_in = 256
    w1, w2 = weights(rng, n_in, [64, 64])
    g = Graph()
    x = g.input("x", (2, n_in))
    h = g.mul(g.rms_norm(x, 1e-5), g.constant(U(rng, (n_in,)), "nw"), name="h")
    g.output(g.qmatmul(h, w1), g.qmatmul(h, w2), g.scale(h, 2.0))
    pf, _, _ = both(g, None, x=U(rng, (2, n_in)))
    assert [st.note for st in fused(pf)] == ["RMS_NORM -> MUL", "QMATMUL x2 (shared activation)"], pf.describe()
    g = Graph()
    x = g.input("x", (2, n_in))
    h = g.mul(g.rms_norm(x, 1e-5), g.constant(U(rng, (n_in,)), "nw"), name="h")
    g.output(g.qmatmul(h, w1), g.qmatmul(h, w2), h)
    pf, _, _ = both(g, None, x=U(rng, (2, n_in)))
    assert "RMS_NORM -> MUL -> QMATMUL: 'h' is a graph output" in pf.describe()


def test_norm_weight_computed_node(rng):
    n_in = 256
    (w,) = weights(rng, n_in, [64])
    g = Graph()
    x = g.input("x", (2, n_in))
    nw = g.scale(g.constant(U(rng, (n_in,)), "nw0"), 2.0, name="nw")
    g.output(g.qmatmul(g.mul(g.rms_norm(x, 1e-5), nw), w))
    pf, _, _ = both(g, None, x=U(rng, (2, n_in)))
    assert "the norm weight 'nw' must be a float32 const or input node" in pf.describe()
    assert [st.note for st in fused(pf)] == ["RMS_NORM -> MUL"], pf.describe()


def test_qmatmul_errors(rng):
    (w,) = weights(rng, 256, [64])
    g = Graph()
    x = g.input("x", (2, 128))
    with pytest.raises(GraphError, match="qmatmul 'qq'.*n_in=256"):
        g.qmatmul(x, w, name="qq")
    with pytest.raises(GraphError, match="qmatmul 'qq'.*QTensor"):
        g.qmatmul(x, np.zeros((64, 128), np.float32), name="qq")
    x2 = g.input("x2", (2, 256))
    with pytest.raises(GraphError, match="qmatmul 'qq'.*act"):
        g.qmatmul(x2, w, act="int8", name="qq")
    with pytest.raises(GraphError, match="qmatmul 'qq'.*float32"):
        g.qmatmul(g.input("h", (2, 256), np.float16), w, name="qq")
    y = g.qmatmul(g.input("x3", (4, 2, 256)), w)
    assert y.shape == (4, 2, 64)


# -- cache writes and rope ---------------------------------------------------------------------
@pytest.mark.parametrize("cdt", [np.float16, np.float32])
def test_cache_write_side_effect(qisa, rng, cdt):
    T, H, D, n_ctx = 3, 2, 64, 8
    cache = np.zeros((n_ctx, H, D), cdt)
    g = Graph()
    x = g.input("x", (T, H * D))
    p0 = g.input("pos0", (1,), np.int32)
    k = g.reshape(g.scale(x, 0.5), (T, H, D))
    g.cache_write(k, cache, p0, name="kc")   # not an output: still runs
    g.output(g.scale(x, 3.0, name="other"))
    X = U(rng, (T, H * D))
    for fusion in (True, False):
        cache[:] = 0
        plan = g.compile(fusion=fusion, isa=qisa)
        plan.run(x=X, pos0=np.array([2], np.int32))
        plan.run(x=X + 1, pos0=np.array([5], np.int32))
        want = np.zeros_like(cache)
        want[2:5] = (X * 0.5).reshape(T, H, D).astype(cdt)
        want[5:8] = ((X + 1) * np.float32(0.5)).reshape(T, H, D).astype(cdt)
        assert np.array_equal(cache, want)
        with pytest.raises(GraphError, match="'kc'.*n_ctx=8"):
            plan.run(x=X, pos0=np.array([6], np.int32))


def test_cache_write_as_output_and_downstream(rng):
    T, H, D, n_ctx = 2, 1, 32, 4
    cache = np.zeros((n_ctx, H, D), np.float32)
    g = Graph()
    x, p0 = g.input("x", (T, H, D)), g.input("p0", (1,), np.int32)
    kc = g.cache_write(x, cache, p0)
    tot = g.scale(g.contiguous(g.permute(kc, (1, 0, 2))), 2.0)
    g.output(kc, tot)
    X = U(rng, (T, H, D))
    c, t = g.compile().run(x=X, p0=np.array([1], np.int32))
    assert np.shares_memory(c, cache) and np.array_equal(cache[1:3], X) and not cache[0].any()
    assert np.array_equal(t, 2 * cache.transpose(1, 0, 2))


def test_cache_write_only_graph_and_errors(rng):
    cache = np.zeros((4, 1, 32), np.float16)
    g = Graph()
    x, p0 = g.input("x", (2, 1, 32)), g.input("p0", (1,), np.int32)
    g.cache_write(x, cache, p0)
    X = U(rng, (2, 1, 32))
    g.compile().run(x=X, p0=np.array([0], np.int32))
    assert np.array_equal(cache[:2], X.astype(np.float16))
    with pytest.raises(GraphError, match="'cw'.*int32 input node of shape \\(1,\\)"):
        g.cache_write(x, cache, g.input("p1", (2,), np.int32), name="cw")
    with pytest.raises(GraphError, match="'cw'.*does not hold rows"):
        g.cache_write(x, np.zeros((4, 2, 32), np.float16), p0, name="cw")
    with pytest.raises(GraphError, match="'cw'.*C-contiguous"):
        g.cache_write(x, np.zeros((4, 1, 64), np.float16)[..., ::2], p0, name="cw")
    with pytest.raises(GraphError, match="'cw'.*float16 or float32"):
        g.cache_write(x, np.zeros((4, 1, 32), np.float64), p0, name="cw")


def _rope_graph(cache, T=3, H=2, D=64, n_dims=64, **kw):
    g = Graph()
    x = g.input("x", (T, H * D))
    pos, p0 = g.input("pos", (T,), np.int32), g.input("pos0", (1,), np.int32)
    k = g.rope(g.reshape(g.scale(x, 1.0), (T, H, D)), pos, n_dims, name="rope_k", **kw)
    g.cache_write(k, cache, p0, name="k_cache")
    q = g.rope(g.reshape(g.scale(x, -1.0), (T, H, D)), pos, n_dims, name="rope_q", **kw)
    g.output(q)
    return g


def _fake_rope(x, pos, *, n_dims, mode="norm", freq_base=10000.0, out=None, cache=None, isa=None,
               n_threads=None):
    """numpy stand-in with cpufuse.rope's signature (ggml 'norm' mode: adjacent pairs)"""
    x = np.asarray(x, np.float32)
    theta = pos[:, None].astype(np.float32) * np.float32(freq_base) ** (
        -np.arange(0, n_dims, 2, dtype=np.float32) / np.float32(n_dims))
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    y = x.copy()
    a, b = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
    y[..., 0:n_dims:2], y[..., 1:n_dims:2] = a * c - b * s, a * s + b * c
    if cache is not None:
        arr, p0 = cache
        arr[p0:p0 + len(x)] = y
        return None
    if out is None:
        return y
    out[...] = y
    return out


def _check_rope(g, cache, rng, T=3, H=2, D=64):
    X = U(rng, (T, H * D))
    pos = np.arange(4, 4 + T, dtype=np.int32)
    pf, pu = g.compile(fusion=True), g.compile(fusion=False)
    assert [st.note for st in fused(pf)] == ["ROPE -> CACHE_WRITE"] and pf.rejected == [], pf.describe()
    assert "fused: ROPE -> CACHE_WRITE" in pf.describe()
    cache[:] = 0
    (qf,) = pf.run(copy=True, x=X, pos=pos, pos0=np.array([4], np.int32))
    cf = cache.copy()
    cache[:] = 0
    (qu,) = pu.run(copy=True, x=X, pos=pos, pos0=np.array([4], np.int32))
    assert np.array_equal(qf, qu) and np.array_equal(cf, cache)
    assert cf[4:4 + T].any() and not cf[:4].any()
    return qf, cf


@pytest.mark.parametrize("cdt", [np.float16, np.float32])
def test_rope_cache_wiring_with_stand_in(monkeypatch, rng, cdt):
    """the plan's Python rope steps call cpufuse.ops.rope.rope with its signature: wired to a numpy
    stand-in, the fused and unfused plans agree"""
    monkeypatch.setattr(importlib.import_module("cpufuse.ops.rope"), "rope", _fake_rope)  # what plans call
    monkeypatch.setattr(cpufuse.graph.records, "PY_STEPS", {"rope", "rope_cache"})  # not the C records
    cache = np.zeros((8, 2, 64), cdt)
    qf, cf = _check_rope(_rope_graph(cache, freq_base=500.0), cache, rng)


@pytest.mark.parametrize("cdt", [np.float16, np.float32])
@pytest.mark.parametrize("mode,n_dims", [("norm", 64), ("neox", 32)])
def test_rope_cache_fused(rng, cdt, mode, n_dims):
    cache = np.zeros((8, 2, 64), cdt)
    _check_rope(_rope_graph(cache, n_dims=n_dims, mode=mode), cache, rng)


def test_rope_errors():
    g = Graph()
    x = g.input("x", (3, 2, 64))
    with pytest.raises(GraphError, match="rope 'r'.*pos must be an int32 input"):
        g.rope(x, g.input("p", (3,), np.float32), 64, name="r")
    pos = g.input("pos", (3,), np.int32)
    with pytest.raises(GraphError, match="rope 'r'.*n_dims"):
        g.rope(x, pos, 65, name="r")
    with pytest.raises(GraphError, match="rope 'r'.*cache="):
        g.rope(x, pos, 64, name="r", cache=None)
    with pytest.raises(GraphError, match="rope 'r'.*n_tokens, n_heads, head_dim"):
        g.rope(g.input("x2", (3, 128)), pos, 64, name="r")


def test_rope_with_other_consumer_not_fused(monkeypatch, rng):
    monkeypatch.setattr(importlib.import_module("cpufuse.ops.rope"), "rope", _fake_rope)  # what plans call
    monkeypatch.setattr(cpufuse.graph.records, "PY_STEPS", {"rope", "rope_cache"})
    cache = np.zeros((8, 2, 64), np.float32)
    g = Graph()
    x = g.input("x", (3, 2, 64))
    pos, p0 = g.input("pos", (3,), np.int32), g.input("pos0", (1,), np.int32)
    k = g.rope(x, pos, 64, name="rk")
    g.cache_write(k, cache, p0)
    g.output(k)
    pf = g.compile()
    assert "ROPE -> CACHE_WRITE: 'rk' is a graph output" in pf.describe()
    (y,) = pf.run(x=U(rng, (3, 2, 64)), pos=np.arange(3, dtype=np.int32), pos0=np.array([0], np.int32))
    assert np.array_equal(cache[:3], y)


# -- a whole llama decoder step inside the C plan executor ---------------------------------------
ALL_PY = {"qmatmul", "qmatmul_swiglu", "rope", "rope_cache", "cache_write"}


def _layer_weights(rng, d, n_ff, H, Hkv, D):
    wq, wo = qref.make_weight("Q4_0", H * D, d, rng), qref.make_weight("Q8_0", d, H * D, rng)
    wk, wv = qref.make_weight("Q8_0", Hkv * D, d, rng), qref.make_weight("Q4_0", Hkv * D, d, rng)
    wg, wu = qref.make_weight("Q4_0", n_ff, d, rng), qref.make_weight("Q8_0", n_ff, d, rng)
    wd = qref.make_weight("Q4_0", d, n_ff, rng)
    an, fn = (1 + 0.1 * U(rng, (d,))).astype(np.float32), (1 + 0.1 * U(rng, (d,))).astype(np.float32)
    return dict(q=wq, k=wk, v=wv, o=wo, gate=wg, up=wu, down=wd, attn_norm=an, ffn_norm=fn)


def _decoder_graph(layers, caches, T, d, H, Hkv, D, n_ctx, act_down="f32", freq_base=10000.0):
    """llama decoder layers for T tokens: RMS_NORM*w -> Q,K,V; ROPE(q), ROPE(k) -> K cache, V -> V
    cache; flash_attn over the caches (views, f16, masked); O; residual; RMS_NORM*w -> gate/up
    SwiGLU -> down; residual. (act_down="f32" keeps fused vs unfused within NMSE 1e-12: the
    SwiGLU epilogue differs from SILU, MUL by ulps, which q8 codes could amplify.)"""
    g = Graph()
    x = g.input("x", (T, d))
    pos, p0 = g.input("pos", (T,), np.int32), g.input("pos0", (1,), np.int32)
    mask = g.input("mask", (1, 1, T, n_ctx), np.float16)
    for i, (W, (kc, vc)) in enumerate(zip(layers, caches)):
        h = g.mul(g.rms_norm(x, 1e-5, name=f"l{i}.norm"), g.constant(W["attn_norm"], f"l{i}.attn_norm"))
        q, k, v = (g.qmatmul(h, W[n], name=f"l{i}.{n}") for n in "qkv")
        kr = g.rope(g.reshape(k, (T, Hkv, D)), pos, D, name=f"l{i}.rope_k", freq_base=freq_base)
        kcw = g.cache_write(kr, kc, p0, name=f"l{i}.k_cache")
        vcw = g.cache_write(g.reshape(v, (T, Hkv, D)), vc, p0, name=f"l{i}.v_cache")
        qr = g.rope(g.reshape(q, (T, H, D)), pos, D, name=f"l{i}.rope_q", freq_base=freq_base)
        Q = g.permute(g.reshape(qr, (1, T, H, D)), (0, 2, 1, 3))
        K = g.permute(g.reshape(kcw, (1, n_ctx, Hkv, D)), (0, 2, 1, 3))
        V = g.permute(g.reshape(vcw, (1, n_ctx, Hkv, D)), (0, 2, 1, 3))
        a = g.flash_attn(Q, K, V, mask, scale=1.0 / np.sqrt(D), name=f"l{i}.attn")
        o = g.qmatmul(g.reshape(a, (T, H * D)), W["o"], name=f"l{i}.o")
        r = g.add(o, x, name=f"l{i}.res")
        h2 = g.mul(g.rms_norm(r, 1e-5, name=f"l{i}.norm2"), g.constant(W["ffn_norm"], f"l{i}.ffn_norm"))
        gt, up = g.qmatmul(h2, W["gate"], name=f"l{i}.gate"), g.qmatmul(h2, W["up"], name=f"l{i}.up")
        f = g.mul(g.silu(gt), up, name=f"l{i}.ffn")
        x = g.add(g.qmatmul(f, W["down"], act=act_down, name=f"l{i}.down"), r, name=f"l{i}.out")
    g.output(x)
    return g


def _decode_inputs(rng, T, d, n_ctx, p0):
    mask = np.full((1, 1, T, n_ctx), -np.inf, np.float16)
    for t in range(T):
        mask[0, 0, t, :p0 + t + 1] = 0
    return dict(x=U(rng, (T, d)), pos=np.arange(p0, p0 + T, dtype=np.int32),
                pos0=np.array([p0], np.int32), mask=mask)


def _run_variant(monkeypatch, layers, T, dims, fusion, isa, steps_inputs, py_steps=False):
    """a fresh graph on fresh zero caches; runs the inputs in order; (plan, outputs, caches)"""
    d, H, Hkv, D, n_ctx = dims
    caches = [(np.zeros((n_ctx, Hkv, D), np.float16), np.zeros((n_ctx, Hkv, D), np.float16)) for _ in layers]
    with monkeypatch.context() as m:
        m.setattr(cpufuse.graph.records, "PY_STEPS", set(ALL_PY) if py_steps else set())
        plan = _decoder_graph(layers, caches, T, d, H, Hkv, D, n_ctx).compile(fusion=fusion, isa=isa)
    outs = [plan.run(copy=True, **inp)[0] for inp in steps_inputs]
    return plan, outs, caches


@pytest.mark.parametrize("T", [1, 3])
def test_decoder_layer_one_c_segment(monkeypatch, rng, T):
    isa = [i for i in cpufuse.available_isas() if i != "numba"][0]
    d, H, Hkv, D, n_ctx, n_ff = 128, 4, 2, 32, 16, 256
    dims = (d, H, Hkv, D, n_ctx)
    layers = [_layer_weights(rng, d, n_ff, H, Hkv, D)]
    inputs = [_decode_inputs(rng, T, d, n_ctx, p0) for p0 in (0, T, 2 * T)]  # three decode steps
    pf, of, cf = _run_variant(monkeypatch, layers, T, dims, True, isa, inputs)
    pu, ou, cu = _run_variant(monkeypatch, layers, T, dims, False, isa, inputs)
    pfp, ofp, cfp = _run_variant(monkeypatch, layers, T, dims, True, isa, inputs, py_steps=True)
    pup, oup, cup = _run_variant(monkeypatch, layers, T, dims, False, isa, inputs, py_steps=True)
    # the whole layer is one C call, fused or not; the Python-step versions split it
    assert [k for k, _ in pf.segments] == ["c"], pf.describe()
    assert [k for k, _ in pu.segments] == ["c"], pu.describe()
    assert "the whole plan is ONE C call" in pf.describe()
    assert [k for k, _ in pfp.segments] == ["py"] * 4 + ["c"] + ["py"] * 3, pfp.describe()
    notes = [st.note for st in fused(pf)]
    assert notes == ["RMS_NORM -> MUL -> QMATMUL x3 (shared activation)", "ROPE -> CACHE_WRITE",
                     "QMATMUL -> ADD (the residual in the epilogue)",
                     "RMS_NORM -> MUL -> QMATMUL x2 -> SILU -> MUL (matmul_swiglu)",
                     "QMATMUL -> ADD (the residual in the epilogue)"], pf.describe()
    # C records = the Python steps, bit for bit (outputs and both caches), fused and unfused
    for a, b in ((of, ofp), (ou, oup)):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    for a, b in ((cf, cfp), (cu, cup), (cf, cu)):  # the caches are written before the SwiGLU
        assert all(np.array_equal(x, y) for ka, kb in zip(a, b) for x, y in zip(ka, kb))
    assert cf[0][0][:3 * T].any() and not cf[0][0][3 * T:].any()
    # fused vs unfused: the SwiGLU epilogue differs by ulps
    for x, y in zip(of, ou):
        assert_nmse(y.astype(np.float64), x, NMSE, "fused vs unfused")


def test_decoder_30_layers_one_c_call_numba_agrees(monkeypatch, rng):
    """a tiny 30-layer decode step: one C call on the native ISA; numba (no C executor) runs the
    same plan as Python steps and agrees"""
    d, H, Hkv, D, n_ctx, n_ff = 64, 4, 2, 16, 8, 128
    dims = (d, H, Hkv, D, n_ctx)
    layers = [_layer_weights(rng, d, n_ff, H, Hkv, D) for _ in range(30)]
    for W in layers:  # keep activations O(1) through 30 residual layers
        W["attn_norm"] *= np.float32(0.05)
        W["ffn_norm"] *= np.float32(0.05)
    inputs = [_decode_inputs(rng, 1, d, n_ctx, p0) for p0 in range(3)]
    isa = [i for i in cpufuse.available_isas() if i != "numba"][0]
    pn, on, cn = _run_variant(monkeypatch, layers, 1, dims, True, isa, inputs)
    assert [k for k, _ in pn.segments] == ["c"], pn.describe()
    _, op, _ = _run_variant(monkeypatch, layers, 1, dims, True, isa, inputs, py_steps=True)
    assert all(np.array_equal(x, y) for x, y in zip(on, op))
    if "numba" not in cpufuse.available_isas():
        pytest.skip("numba is not available")
    pb, ob, cb = _run_variant(monkeypatch, layers, 1, dims, True, "numba", inputs)
    assert all(k == "py" for k, _ in pb.segments) and "no C plan executor" in pb.describe()
    for x, y in zip(on, ob):
        assert_nmse(x.astype(np.float64), y, 1e-6, "numba vs native")
    for a, b in zip(cn, cb):
        for x, y in zip(a, b):
            assert_nmse(x.astype(np.float64), y.astype(np.float64), 1e-5, "caches")


def test_c_cache_rows_checked(rng):
    """pos0 out of range in a C segment: the same GraphError as the Python step, nothing written"""
    T, H, D, n_ctx = 2, 2, 32, 4
    kc, vc = np.zeros((n_ctx, H, D), np.float16), np.zeros((n_ctx, H, D), np.float32)
    g = Graph()
    x = g.input("x", (T, H, D))
    pos, p0 = g.input("pos", (T,), np.int32), g.input("pos0", (1,), np.int32)
    g.cache_write(g.rope(x, pos, D, name="rk"), kc, p0, name="kc")
    g.cache_write(g.scale(x, 2.0), vc, p0, name="vc")
    plan = g.compile()
    if plan.native:
        assert [k for k, _ in plan.segments] == ["c"], plan.describe()
    X = U(rng, (T, H, D))
    for bad in (3, -1):
        with pytest.raises(GraphError, match="'kc'.*n_ctx=4"):
            plan.run(x=X, pos=np.arange(2, dtype=np.int32), pos0=np.array([bad], np.int32))
    assert not kc.any() and not vc.any()
    plan.run(x=X, pos=np.arange(2, dtype=np.int32), pos0=np.array([2], np.int32))
    assert np.array_equal(vc[2:], 2 * X) and kc[2:].any() and not kc[:2].any()


def test_qmatmul_view_falls_back_to_python(rng):
    """a qmatmul input whose leading axes do not merge runs as a Python step between C segments"""
    (w,) = weights(rng, 64, [32])
    X = U(rng, (4, 2, 64))
    ref = 2 * cpufuse.matmul(np.ascontiguousarray((X * 0.5).transpose(1, 0, 2)), w)
    for tail, segs in (("add", ["c", "py", "c"]), ("scale", ["c", "py"])):   # y + y: a C step after it;
        g = Graph()                                                            # a SCALE: in the Python step
        x = g.input("x", (4, 2, 64))
        y = g.qmatmul(g.permute(g.scale(x, 0.5), (1, 0, 2)), w, name="qv")
        g.output(g.add(y, y) if tail == "add" else g.scale(y, 2.0))
        plan = g.compile()
        if plan.native:
            assert [k for k, _ in plan.segments] == segs, plan.describe()
        (out,) = plan.run(x=X)
        assert np.array_equal(out, ref), tail


@pytest.mark.parametrize("kw", [dict(), dict(mode="neox", n_dims=32), dict(ggml_compat=True, freq_base=500.0),
                                dict(ext_factor=1.0, freq_scale=0.25, n_ctx_orig=64, attn_factor=0.9),
                                dict(freq_factors=True, n_dims=48)])
@pytest.mark.parametrize("cdt", [np.float16, np.float32])
def test_rope_c_record_equals_python_step(monkeypatch, rng, kw, cdt):
    """OP_ROPE (strided view input, every rope_ext parameter) = cpufuse.rope from a Python step"""
    kw = dict(kw)
    n_dims = kw.pop("n_dims", 64)
    if kw.pop("freq_factors", False):
        kw["freq_factors"] = rng.uniform(0.5, 4.0, n_dims // 2).astype(np.float32)
    T, H, D = 3, 2, 64
    X = U(rng, (H, T, D))
    inp = dict(x=X, pos=np.array([7, 100, 5000], np.int32), pos0=np.array([1], np.int32))
    res = []
    for py in (False, True):
        monkeypatch.setattr(cpufuse.graph.records, "PY_STEPS", {"rope", "rope_cache"} if py else set())
        cache = np.zeros((6, H, D), cdt)
        g = Graph()
        x = g.input("x", (H, T, D))
        pos, p0 = g.input("pos", (T,), np.int32), g.input("pos0", (1,), np.int32)
        xv = g.permute(x, (1, 0, 2))  # (T, H, D) with token stride D, head stride T*D
        g.cache_write(g.rope(xv, pos, n_dims, name="rk", **kw), cache, p0, name="kc")
        g.output(g.rope(xv, pos, n_dims, name="rq", **kw))
        plan = g.compile()
        if plan.native:
            assert [k for k, _ in plan.segments] == (["py", "py"] if py else ["c"]), plan.describe()
        (q,) = plan.run(copy=True, **inp)
        res.append((q, cache))
    (qc, cc), (qp, cp) = res
    assert np.array_equal(qc, qp) and np.array_equal(cc, cp)
    assert np.array_equal(cc[1:4], qc.astype(cdt)) and not cc[0].any() and not cc[4:].any()


def test_decode_wide_chunks_and_tails(rng):
    """a one-row q8 plan call wide enough for the 64-row chunks ends in 16-row chunks (about one a thread;
    CPUFUSE_QM_TAILS sets how many, read once per process): every thread count gives the one-thread bits,
    a row count that is not a multiple of 16 included"""
    isa = [i for i in cpufuse.available_isas() if i != "numba"][0]
    K = 512
    ws = [qref.make_weight("Q4_0", 1040, K, rng).repack(isa=isa),
          qref.random_blocks("Q8_0", 1000, K, rng).repack(isa=isa)]
    g = Graph()
    x = g.input("x", (1, K))
    g.output(*[g.qmatmul(x, w, name=f"w{i}") for i, w in enumerate(ws)])
    X = U(rng, (1, K))
    plan = g.compile(isa=isa)
    ref = plan.run(copy=True, n_threads=1, x=X)
    for y, w in zip(ref, ws):
        assert np.array_equal(y, cpufuse.matmul(X, w, isa=isa, n_threads=1))
    for nth in (2, 3, 4, 7):
        for a, b in zip(plan.run(copy=True, n_threads=nth, x=X), ref):
            assert np.array_equal(a, b), nth


@pytest.mark.parametrize("tails", ["0", "3"])
def test_decode_tails_knob(tails):
    """the decode chunk tests above, again in a process with CPUFUSE_QM_TAILS set"""
    import subprocess
    import sys
    from _util import clean_env
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                        "decode_wide_chunks or decode_rows_plan_threads", __file__],
                       env=clean_env(CPUFUSE_QM_TAILS=tails), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout, r.stdout[-2000:]
