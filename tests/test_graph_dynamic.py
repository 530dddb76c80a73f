"""Graph ops for batches that mix sequences (kv_write, attn_seqs, gather_rows) and DynamicPlan:
a plan compiled once at a capacity and run at any size gives what a plan compiled for that exact
size gives, bit for bit; attn_seqs gives each sequence what it gets alone."""
import numpy as np
import pytest

import cpufuse
from cpufuse.reference import quant as qref
from cpufuse.graph import DynamicPlan, Graph, GraphError

H, HKV, D, NCELL = 4, 2, 16, 128


def _caches():
    return np.zeros((NCELL, HKV, D), np.float16), np.zeros((NCELL, HKV, D), np.float16)


def _alone(isa, q, kc, vc, cell0, pos0, scale):
    """flash_attn of one sequence's rows q (nr, H, D) at positions pos0.. over its cells"""
    nr = q.shape[0]
    T = pos0 + nr
    m = None
    if nr > 1:
        m = np.zeros((1, 1, nr, T), np.float16)
        m[0, 0][np.arange(T)[None, :] > pos0 + np.arange(nr)[:, None]] = -np.inf
    return cpufuse.flash_attn(q.transpose(1, 0, 2)[None], kc[cell0:cell0 + T].transpose(1, 0, 2)[None],
                              vc[cell0:cell0 + T].transpose(1, 0, 2)[None], m, scale=scale, isa=isa)[0]


def test_attn_seqs_is_each_sequence_alone(isa, rng):
    kc, vc = _caches()
    n = 12
    g = Graph()
    q, k, v = g.input("q", (n, H, D)), g.input("k", (n, HKV, D)), g.input("v", (n, HKV, D))
    cells, seqs = g.input("cells", (n,), np.int32), g.input("seqs", (4, 4), np.int32)
    idx = g.input("idx", (3,), np.int32)
    kw, vw = g.kv_write(k, kc, cells), g.kv_write(v, vc, cells)
    a = g.attn_seqs(q, kw, vw, seqs, scale=0.25)
    g.output(a, g.gather_rows(g.reshape(a, (n, H * D)), idx))
    plan = g.compile(isa=isa)
    kc[:9] = rng.standard_normal((9, HKV, D))        # sequence A: 9 cached tokens at cells 0..
    vc[:9] = rng.standard_normal((9, HKV, D))
    Q = rng.standard_normal((n, H, D)).astype(np.float32)
    K = rng.standard_normal((n, HKV, D)).astype(np.float32)
    V = rng.standard_normal((n, HKV, D)).astype(np.float32)
    # batch: A decodes 1 token (pos 9), B prefills 8 tokens (pos 0..7, cells 64..), C 3 tokens at pos 4..6
    # (cells 100.. with 4 cached)
    kc[100:104] = rng.standard_normal((4, HKV, D))
    vc[100:104] = rng.standard_normal((4, HKV, D))
    C = np.array([9] + list(range(64, 72)) + [104, 105, 106], np.int32)
    S = np.array([[0, 0, 1, 9], [64, 1, 8, 0], [100, 9, 3, 4], [0, 0, 0, 0]], np.int32)
    A, O = plan.run(q=Q, k=K, v=V, cells=C, seqs=S, idx=np.array([0, 8, 11], np.int32), copy=True)
    assert np.array_equal(kc[C], K.astype(np.float16)) and np.array_equal(vc[C], V.astype(np.float16))
    for cell0, r0, nr, pos0 in S[:3]:
        assert np.array_equal(A[r0:r0 + nr], _alone(isa, Q[r0:r0 + nr], kc, vc, cell0, pos0, 0.25))
    assert np.array_equal(O, A.reshape(n, -1)[[0, 8, 11]])


@pytest.mark.parametrize("bad", ["cell", "group", "idx"])
def test_index_inputs_checked(bad, rng):
    kc, vc = _caches()
    n = 2
    g = Graph()
    q, k = g.input("q", (n, H, D)), g.input("k", (n, HKV, D))
    cells, seqs, idx = g.input("cells", (n,), np.int32), g.input("seqs", (1, 4), np.int32), g.input("idx", (1,), np.int32)
    a = g.attn_seqs(q, g.kv_write(k, kc, cells), g.kv_write(k, vc, cells), seqs, scale=1.0)
    g.output(g.gather_rows(g.reshape(a, (n, H * D)), idx))
    plan = g.compile()
    args = dict(q=np.zeros((n, H, D), np.float32), k=np.zeros((n, HKV, D), np.float32),
                cells=np.array([0, 1], np.int32), seqs=np.array([[0, 0, 2, 0]], np.int32), idx=np.array([1], np.int32))
    plan.run(**args)
    if bad == "cell":
        args["cells"] = np.array([0, NCELL], np.int32)
    elif bad == "group":
        args["seqs"] = np.array([[NCELL - 1, 0, 2, 0]], np.int32)
    else:
        args["idx"] = np.array([-1], np.int32)
    with pytest.raises(GraphError, match={"cell": "cells", "group": "group", "idx": "indices"}[bad]):
        plan.run(**args)


def _decoder_block(wq, wk, wv, wo, nw, kc, vc):
    E = wq.n_in

    def build(n, m):
        g = Graph()
        x, pos = g.input("x", (n, E)), g.input("pos", (n,), np.int32)
        cells, seqs, idx = g.input("cells", (n,), np.int32), g.input("seqs", (4, 4), np.int32), g.input("idx", (m,), np.int32)
        h = g.mul(g.rms_norm(x, 1e-5), g.constant(nw))
        q, k, v = g.qmatmul(h, wq), g.qmatmul(h, wk), g.qmatmul(h, wv)
        qr = g.rope(g.reshape(q, (n, H, D)), pos, D, mode="neox", freq_base=1e4)
        kr = g.rope(g.reshape(k, (n, HKV, D)), pos, D, mode="neox", freq_base=1e4)
        a = g.attn_seqs(qr, g.kv_write(kr, kc, cells), g.kv_write(g.reshape(v, (n, HKV, D)), vc, cells), seqs, scale=0.25)
        g.output(g.gather_rows(g.add(x, g.qmatmul(g.reshape(a, (n, H * D)), wo)), idx))
        return g
    return build


@pytest.mark.parametrize("repack", [False, True])
def test_dynamic_plan_equals_exact_plans(isa, repack, rng):
    E = 64
    ws = [qref.make_weight(t, n, k, rng) for t, n, k in (("Q4_0", H * D, E), ("Q8_0", HKV * D, E), ("Q4_1", HKV * D, E),
                                                        ("Q5_0", E, H * D))]
    if repack:
        ws = [w.repack() for w in ws]
    nw = rng.standard_normal(E).astype(np.float32)
    kc, vc = _caches()
    build = _decoder_block(*ws, nw, kc, vc)
    dp = DynamicPlan(build, {"n": 24, "m": 6}, isa=isa)
    for n, m in ((24, 6), (1, 1), (7, 3), (13, 6)):
        x = rng.standard_normal((n, E)).astype(np.float32)
        args = dict(x=x, pos=np.arange(n, dtype=np.int32), cells=np.arange(n, dtype=np.int32) + 3,
                    seqs=np.array([[3, 0, n, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], np.int32),
                    idx=rng.integers(0, n, m).astype(np.int32))
        kc[:] = 0
        vc[:] = 0
        (y,) = dp.run({"n": n, "m": m}, copy=True, **args)
        k1, v1 = kc.copy(), vc.copy()
        kc[:] = 0
        vc[:] = 0
        (y2,) = build(n, m).compile(isa=isa).run(copy=True, **args)
        assert np.array_equal(y.view(np.uint32), y2.view(np.uint32)), (n, m)
        assert np.array_equal(k1, kc) and np.array_equal(v1, vc)


def test_dynamic_plan_bind_reads_the_arrays_at_each_call(rng):
    """bind(sizes, **inputs) checks once; each call of the bound plan reads the arrays' contents then
    and equals run() on the same values, bit for bit"""
    E, n, m = 64, 3, 2
    ws = [qref.make_weight(t, n_out, E if i < 3 else H * D, rng).repack()
          for i, (t, n_out) in enumerate((("Q4_0", H * D), ("Q8_0", HKV * D), ("Q4_1", HKV * D), ("Q5_0", E)))]
    kc, vc = _caches()
    dp = DynamicPlan(_decoder_block(*ws, rng.standard_normal(E).astype(np.float32), kc, vc), {"n": 8, "m": 4})
    args = dict(x=np.zeros((n, E), np.float32), pos=np.arange(n, dtype=np.int32), cells=np.arange(n, dtype=np.int32),
                seqs=np.array([[0, 0, n, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], np.int32),
                idx=np.array([2, 0], np.int32))
    step = dp.bind({"n": n, "m": m}, **args)
    for _ in range(3):
        args["x"][:] = rng.standard_normal((n, E))
        (y,) = step(copy=True)
        (y2,) = dp.run({"n": n, "m": m}, copy=True, **args)
        assert y.shape == (m, E) and np.array_equal(y.view(np.uint32), y2.view(np.uint32))
    with pytest.raises(GraphError, match="input 'idx' must be a int32 array of shape"):
        dp.bind({"n": n, "m": m}, **{**args, "idx": np.zeros(3, np.int32)})


def test_bound_plan_writes_into_out(rng):
    """bind(...)(out=(a,)): the outputs land in the caller's arrays, bit for bit what the plan's own buffer
    gets; at the capacities the kernels write them straight (the array is left untouched by later runs
    without out, whose results are right: the pointers went back), below them and where an out array
    overlaps an input they are copied in; a bad out is a TypeError / ValueError naming it"""
    E = 64
    ws = [qref.make_weight(t, n_out, E if i < 3 else H * D, rng).repack()
          for i, (t, n_out) in enumerate((("Q4_0", H * D), ("Q8_0", HKV * D), ("Q4_1", HKV * D), ("Q5_0", E)))]
    kc, vc = _caches()
    dp = DynamicPlan(_decoder_block(*ws, rng.standard_normal(E).astype(np.float32), kc, vc), {"n": 4, "m": 2})
    for n, m in ((4, 2), (3, 1)):
        args = dict(x=np.zeros((n, E), np.float32), pos=np.arange(n, dtype=np.int32),
                    cells=np.arange(n, dtype=np.int32),
                    seqs=np.array([[0, 0, n, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], np.int32),
                    idx=np.arange(m, dtype=np.int32)[::-1].copy())
        step = dp.bind({"n": n, "m": m}, **args)
        outs = []
        for _ in range(3):
            args["x"][:] = rng.standard_normal((n, E))
            a = np.full((m, E), np.nan, np.float32)
            (got,) = step(out=(a,))
            assert got is a
            (want,) = step(copy=True)
            assert np.array_equal(a.view(np.uint32), want.view(np.uint32))
            outs.append((a, want))
        for a, want in outs:   # later runs wrote the plan's buffer, not an earlier out array
            assert np.array_equal(a.view(np.uint32), want.view(np.uint32))
        (y,) = step(out=(None,))
        assert y.shape == (m, E) and np.array_equal(y, outs[-1][1])
        if (n, m) == (4, 2):   # at the capacities the kernels wrote the out array, not the plan's buffer
            kept = y.copy()
            args["x"][:] = rng.standard_normal((n, E))
            step(out=(np.empty((m, E), np.float32),))
            assert np.array_equal(y, kept)
    # an out array that is an input's memory: copied in after the run, so the run read x intact
    n, m = 4, 2
    big = np.zeros((n, E), np.float32)
    args = dict(x=big, pos=np.arange(n, dtype=np.int32), cells=np.arange(n, dtype=np.int32),
                seqs=np.array([[0, 0, n, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], np.int32),
                idx=np.array([1, 3], np.int32))
    step = dp.bind({"n": n, "m": m}, **args)
    big[:] = rng.standard_normal((n, E))
    (want,) = step(copy=True)
    (got,) = step(out=(big[:m],))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(TypeError, match="out must be a tuple of 1 arrays"):
        step(out=np.zeros((m, E), np.float32))
    with pytest.raises(ValueError, match=r"out\[0\] must be a float32 array of shape \(2, 64\)"):
        step(out=(np.zeros((m, E), np.float64),))
    with pytest.raises(ValueError, match=r"out\[0\] must be a C-contiguous"):
        step(out=(np.zeros((E, m), np.float32).T,))


def test_plan_run_out_with_python_steps(rng):
    """Plan.run(out=...) where the plan is not one C call (Numba): the outputs are copied into out"""
    g = Graph()
    x = g.input("x", (3, 8))
    g.output(g.softmax(x))
    X = rng.standard_normal((3, 8)).astype(np.float32)
    for isa in ("numba", None):
        plan = g.compile(isa=isa)
        a = np.empty((3, 8), np.float32)
        (got,) = plan.run(x=X, out=(a,))
        assert got is a and np.array_equal(a, plan.run(x=X, copy=True)[0])


def test_dynamic_plan_sizes_and_inputs_checked(rng):
    ws = [qref.make_weight("Q4_0", n, k, rng) for n, k in ((H * D, 64), (HKV * D, 64), (HKV * D, 64), (64, H * D))]
    kc, vc = _caches()
    dp = DynamicPlan(_decoder_block(*ws, np.ones(64, np.float32), kc, vc), {"n": 8, "m": 2})
    with pytest.raises(GraphError, match="size 'n' must be an int in"):
        dp.run({"n": 9, "m": 1})
    with pytest.raises(GraphError, match="input 'x' must be a float32 array of shape"):
        dp.run({"n": 4, "m": 1}, x=np.zeros((5, 64), np.float32), pos=np.zeros(4, np.int32),
               cells=np.zeros(4, np.int32), seqs=np.zeros((4, 4), np.int32), idx=np.zeros(1, np.int32))


def test_dynamic_plan_refuses_a_size_dependent_program():
    """flash_attn's strategy is baked into its descriptor and changes with the rows: refused unless it
    is the same at every size from 1 row to the capacity"""
    def build_t(t):
        def build(n):
            g = Graph()
            q = g.input("q", (1, 1, n, 16))
            kv = g.input("kv", (1, 1, t, 16))
            g.output(g.flash_attn(q, kv, kv, scale=1.0))
            return g
        return build
    DynamicPlan(build_t(100), {"n": 7})            # rows strategy at 1..7 rows: fine
    with pytest.raises(GraphError, match="not affine"):
        DynamicPlan(build_t(100), {"n": 9})        # 8, 9 rows: rows -> tiled
    with pytest.raises(GraphError, match="not affine"):
        DynamicPlan(build_t(600), {"n": 4})        # one row over 600 keys: split-KV


def test_dim_is_affine():
    """ir.Dim: sizes computed from dynamic dimensions keep their slopes; what is not affine is refused"""
    from cpufuse.graph.ir import Dim, at
    n, m = Dim.var("n", 512), Dim.var("m", 8)
    caps = {"n": 512, "m": 8}
    e = (n * 64 + 3) - m * 2 + 2 * n // 2
    assert int(e) == 512 * 64 + 3 - 16 + 512 and e.coef == {"n": 65, "m": -2}
    assert at(e, {"n": 37, "m": 1}, caps) == 37 * 64 + 3 - 2 + 37
    assert not isinstance(n - n, Dim) and n - n == 0 and repr(n) == "512"
    for bad in (lambda: n * m, lambda: n / 2, lambda: float(n), lambda: (n + 1) // 2):
        with pytest.raises(GraphError, match="not affine"):
            bad()

@pytest.mark.parametrize("kt", ["q8_0", "q4_0"])
def test_quantized_kv_write_and_attn_seqs(isa, kt, rng):
    """kv_write into q8_0 / q4_0 cells writes kvquant.quantize's bytes (C and Numba: ties, zeros, a
    block of one sign, outliers); attn_seqs reads them as flash_attn(k_type=, v_type=) of each sequence"""
    from cpufuse.ops import kvquant
    Dq, n = 64, 6
    rb = kvquant.row_bytes(kt, Dq)
    kc, vc = np.zeros((NCELL, HKV, rb), np.uint8), np.zeros((NCELL, HKV, rb), np.uint8)
    g = Graph()
    q, k, v = g.input("q", (n, H, Dq)), g.input("k", (n, HKV, Dq)), g.input("v", (n, HKV, Dq))
    cells, seqs = g.input("cells", (n,), np.int32), g.input("seqs", (2, 4), np.int32)
    kw, vw = g.kv_write(k, kc, cells, kv_type=kt), g.kv_write(v, vc, cells, kv_type=kt)
    g.output(g.attn_seqs(q, kw, vw, seqs, scale=0.125))
    plan = g.compile(isa=isa)
    K = rng.standard_normal((n, HKV, Dq)).astype(np.float32)
    K[0, 0, :32] = 0.0
    K[1, 0, :32] = np.abs(K[1, 0, :32])
    K[2, 1, 5] = 40.0                                   # an outlier (Qwen's K has them)
    K[3, 0, :32] = np.round(K[3, 0, :32] * 4) / 4       # exact quarter steps: rounding ties
    V = rng.standard_normal((n, HKV, Dq)).astype(np.float32)
    Q = rng.standard_normal((n, H, Dq)).astype(np.float32)
    C = np.array([0, 1, 2, 64, 65, 66], np.int32)
    S = np.array([[0, 0, 3, 0], [64, 3, 3, 0]], np.int32)
    (A,) = plan.run(q=Q, k=K, v=V, cells=C, seqs=S, copy=True)
    assert np.array_equal(kc[C], kvquant.quantize(K, kt)) and np.array_equal(vc[C], kvquant.quantize(V, kt))
    m = np.zeros((1, 1, 3, 3), np.float16)
    m[0, 0][np.triu_indices(3, 1)] = -np.inf
    for c0, r0 in ((0, 0), (64, 3)):
        want = cpufuse.flash_attn(Q[r0:r0 + 3].transpose(1, 0, 2)[None], kc[c0:c0 + 3].transpose(1, 0, 2)[None],
                                  vc[c0:c0 + 3].transpose(1, 0, 2)[None], m, scale=0.125, isa=isa, k_type=kt,
                                  v_type=kt)[0]
        assert np.array_equal(A[r0:r0 + 3], want)


@pytest.mark.parametrize("kt", [None, "f16", "q8_0", "q4_0"])
def test_kv_write_prompt_rows_over_threads(isa, kt, rng):
    """a prompt's kv_write runs in chunks over the team when its cells are distinct: the same cache bytes
    at 1, 2 and 3 threads as each row written alone (kvquant.quantize's / float16's); cells that repeat
    (a ring's prompt) stay in row order, the later row winning"""
    from cpufuse.ops import kvquant
    n, hk, d, ncell = 700, 2, 64, 1500
    src = rng.standard_normal((n, hk, d)).astype(np.float32)
    for cells in (rng.permutation(ncell)[:n].astype(np.int32), (np.arange(n) % 300).astype(np.int32)):
        caches = []
        for t in (1, 2, 3):
            if kt in ("q8_0", "q4_0"):
                cache = np.zeros((ncell, hk, kvquant.row_bytes(kt, d)), np.uint8)
            else:
                cache = np.zeros((ncell, hk, d), np.float16 if kt == "f16" else np.float32)
            g = Graph()
            k, c = g.input("k", src.shape), g.input("cells", (n,), np.int32)
            g.output(g.kv_write(k, cache, c, kv_type=kt if kt in ("q8_0", "q4_0") else None))
            g.compile(isa=isa).run(n_threads=t, k=src, cells=cells)
            caches.append(cache)
        last = {int(c): i for i, c in enumerate(cells)}          # the later row of a repeated cell
        rows = np.array(sorted(last)), np.array([last[c] for c in sorted(last)])
        want = kvquant.quantize(src[rows[1]], kt) if kt in ("q8_0", "q4_0") else src[rows[1]].astype(caches[0].dtype)
        for cache in caches:
            assert np.array_equal(cache[rows[0]], want)
            assert np.array_equal(cache, caches[0])
