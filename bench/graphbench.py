"""The graph and dispatch sections: the llama decoder block as a compiled plan, fused and unfused,
against numpy, and the per-node dispatch cost of a plan (rows: bench/cases.py; bench/README.md).
"""
import functools
import zlib

import numpy as np

import cpufuse
from cpufuse import reference as ref
from cpufuse.reference import block as blocks

from . import threads
from .cases import Section, Unavailable, Variant
from .ops import all_core, all_core_name, times

CONFIGS = {"SmolLM2-135M": blocks.SMOLLM2_135M, "Llama-7B": blocks.LLAMA_7B}


_weights = {}


def weights(model):
    """one model's weights at a time (Llama-7B's are ~810 MB)"""
    if model not in _weights:
        _weights.clear()
        _weights[model] = blocks.make_weights(CONFIGS[model], np.random.default_rng(zlib.crc32(model.encode())))
    return _weights[model]


def release():
    _weights.clear()


def make_inputs(case):
    cfg = CONFIGS[case.model]
    W = weights(case.model)
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    inp = blocks.make_inputs(cfg, case.n_tok, case.n_past, rng)
    return {"cfg": cfg, "W": W, "inp": inp}


def reference(case, d):
    return blocks.numpy_block(d["cfg"], d["W"], dtype=np.float64, **d["inp"])


def matmul_shapes(cfg, n_tok):
    """(name, rows, K, weight key) of the block's matmuls"""
    d, H, hd, f = cfg["d"], cfg["n_head"], cfg["head_dim"], cfg["ffn"]
    return [("q", n_tok, d, "wq"), ("k", n_tok, d, "wk"), ("v", n_tok, d, "wv"), ("attn_out", n_tok, H * hd, "wo"),
            ("gate", n_tok, d, "wg"), ("up", n_tok, d, "wu"), ("down", n_tok, f, "wd")]


def matmul_flops(case):
    cfg = CONFIGS[case.model]
    W = weights(case.model)
    return sum(2 * m * k * W[w].shape[1] for _, m, k, w in matmul_shapes(cfg, case.n_tok))


def work(case, d):
    return {"bytes": sum(a.nbytes for a in d["W"].values()), "flops": matmul_flops(case)}


def _matmul_graph(cfg, W, n_tok):
    g = cpufuse.Graph()
    ins, outs = {}, []
    for name, m, k, w in matmul_shapes(cfg, n_tok):
        a = g.input(f"a_{name}", (m, k))
        ins[f"a_{name}"] = np.random.default_rng(k).standard_normal((m, k), dtype=np.float32)
        outs.append(g.matmul(a, g.constant(W[w], w), name=name))
    g.output(*outs)
    return g, ins


def build(case, v, d, nth):
    cfg, W, inp = d["cfg"], d["W"], d["inp"]
    if v.kind == "user":
        fn = functools.partial(blocks.numpy_block, cfg, W, **inp)
        return fn, fn
    if v.kind == "cpufuse":
        plan = blocks.build_graph(cfg, W, case.n_tok, case.n_past).compile(fusion=v.fused, isa=v.isa)
        fn = functools.partial(plan.run, n_threads=nth, **inp)
        return fn, lambda: fn()[0]
    if v.kind == "baseline":
        if v.name.startswith("matmuls plan"):
            g, ins = _matmul_graph(cfg, W, case.n_tok)
            plan = g.compile(isa=v.isa)
            fn = functools.partial(plan.run, n_threads=nth, **ins)
            return fn, fn
        pairs = []
        for name, m, k, w in matmul_shapes(cfg, case.n_tok):
            a = np.random.default_rng(k).standard_normal((m, k), dtype=np.float32)
            pairs.append((a, W[w], np.empty((m, W[w].shape[1]), np.float32)))
        mm = np.matmul

        def fn():
            for a, b, o in pairs:
                mm(a, b, out=o)
        return fn, fn
    raise Unavailable(f"no {v.name} column for the block")


# ------------------------------------------------------------------------------------------------
# Dispatch overhead: a plan of many tiny nodes vs the same chain called from Python

def dispatch_inputs(case):
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    x = rng.standard_normal((1, case.width), dtype=np.float32)
    if case.chain == "scale_add":
        c = (0.01 * rng.standard_normal((1, case.width))).astype(np.float32)
        return {"x": x, "c": c, "w": None}
    w = (1.0 + 0.1 * rng.standard_normal(case.width)).astype(np.float32)
    return {"x": x, "c": None, "w": w}


def dispatch_reference(case, d):
    y = d["x"].astype(np.float64)
    if case.chain == "scale_add":
        c = d["c"].astype(np.float64)
        for i in range(case.n_nodes):
            y = y * 0.999 if i % 2 == 0 else y + c
        return y
    for _ in range(case.n_nodes // 2):
        y = ref.rms_norm(y.astype(np.float32), 1e-6, weight=d["w"])
    return y


def dispatch_kernel_calls(case, fused):
    return case.n_nodes // 2 if (case.chain == "rms_norm" and fused) else case.n_nodes


def dispatch_build(case, v, d, nth):
    x, c, w = d["x"], d["c"], d["w"]
    if v.kind == "cpufuse":
        g = cpufuse.Graph()
        y = g.input("x", x.shape)
        if case.chain == "scale_add":
            cn = g.constant(c, "c")
            for i in range(case.n_nodes):
                y = g.scale(y, 0.999) if i % 2 == 0 else g.add(y, cn)
        else:
            wn = g.constant(w, "w")
            for _ in range(case.n_nodes // 2):
                y = g.mul(g.rms_norm(y, 1e-6), wn)
        g.output(y)
        plan = g.compile(fusion=v.fused, isa=v.isa)
        fn = functools.partial(plan.run, n_threads=nth, x=x)
        return fn, lambda: fn()[0]
    # Python per-op calls into preallocated buffers (what the plan saves): numpy ufuncs, or cpufuse
    bufs = [np.empty_like(x), np.empty_like(x)]
    if case.chain == "scale_add":
        mul, add, s = np.multiply, np.add, np.float32(0.999)
        calls = []
        src = x
        for i in range(case.n_nodes):
            dst = bufs[i % 2]
            calls.append((mul, src, s, dst) if i % 2 == 0 else (add, src, c, dst))
            src = dst

        def fn():
            for f, a, b, o in calls:
                f(a, b, out=o)
            return o
    else:
        rms = cpufuse.rms_norm
        pairs = []
        src = x
        for i in range(case.n_nodes // 2):
            dst = bufs[i % 2]
            pairs.append((src, dst))
            src = dst

        def fn():
            for a, o in pairs:
                rms(a, w, eps=1e-6, out=o, n_threads=1)
            return o
    return fn, fn


class GraphSection(Section):
    key, title, unit = "graph", "llama decoder block (graph)", "ms"
    settle_s = 0.2  # after an all-core column, let OpenBLAS's spinning workers sleep (threads.settle_s)
    intro = ("`cpufuse/reference/block.py` pre-norm block (rms_norm·w, q/k/v matmuls, KV-cache concat, flash_attn "
             "with a causal f16 mask, o matmul, residual, rms_norm·w, SwiGLU FFN, residual), f32 weights and cache. "
             "plan = `build_graph(...).compile()` (fusion=False for unfused); numpy = `block.numpy_block` (f32). "
             "matmuls = the block's 7 matmuls alone: as a cpufuse plan and as `np.matmul(..., out=)`. non-matmul "
             "share = (block − matmuls) / block with the same thread count.")
    derived_cols = [("weights MB", "mb", "g"), ("matmul GFLOP", "matmul_gflop", "g"),
                    ("matmul GFLOP/s (plan, 1 thr)", "matmul_plan_gflops", "g"),
                    ("non-matmul numpy", "share_numpy", "pct"), ("non-matmul plan unfused", "share_plan unfused", "pct"),
                    ("non-matmul plan fused", "share_plan fused", "pct"), ("fusion gain", "fusion_gain", "x"),
                    ("user gain", "user_gain", "x"), ("all-core speedup", "all_core_speedup", "x")]

    def __init__(self, peers, all_core):
        b = cpufuse.available_isas()[0]
        vs = [Variant("numpy", "user", tol=1e-6), Variant("plan unfused", "cpufuse", b, fused=False),
              Variant("plan fused", "cpufuse", b)]
        if all_core:
            vs.append(Variant(all_core_name("plan fused"), "cpufuse", b, nth=threads.ALL))
        vs += [Variant("matmuls plan", "baseline", b), Variant("matmuls numpy", "baseline")]
        if all_core:
            vs.append(Variant(all_core_name("matmuls plan"), "baseline", b, nth=threads.ALL))
        self.vlist = vs

    inputs = staticmethod(make_inputs)
    reference = staticmethod(reference)
    work = staticmethod(work)
    release = staticmethod(release)   # the block weights (Llama-7B's: ~810 MB), after the section

    def build(self, case, v, inp):
        return build(case, v, inp, threads.resolve(v.nth))

    def derived(self, case, res, env):
        t = times(res)
        d = {"mb": env["work"]["bytes"] / 1e6, "matmul_gflop": matmul_flops(case) / 1e9}
        base1, basen = t.get("matmuls plan"), t.get("matmuls numpy")
        basea = next((v for k, v in t.items() if k.startswith("matmuls plan ×")), None)
        for k, v in t.items():
            mm = basen if k == "numpy" else (basea if res[k]["n_threads"] > 1 else base1)
            if res[k]["kind"] != "baseline" and mm:
                d[f"share_{k}"] = 100 * (v - mm) / v
        if base1:
            d["matmul_plan_gflops"] = matmul_flops(case) / base1
        if "plan unfused" in t and "plan fused" in t:
            d["fusion_gain"] = t["plan unfused"] / t["plan fused"]
        if "numpy" in t and "plan fused" in t:
            d["user_gain"] = t["numpy"] / t["plan fused"]
        k, ra = all_core(res)
        if k and "plan fused" in t:
            d["all_core_speedup"] = t["plan fused"] / ra["median_ns"]
        return d


class DispatchSection(Section):
    key, title = "dispatch", "per-node dispatch overhead"
    intro = ("A chain of tiny nodes compiled into one plan (one C call runs every kernel) vs the same chain as Python "
             "calls into preallocated buffers (`np.multiply/np.add(..., out=)` for scale/add; `cpufuse.rms_norm(x, w, "
             "out=)` for rms_norm·w, which the fused plan runs as 50 kernels).")
    derived_cols = [("ns / node, plan fused", "ns_node_plan fused", "g"), ("plan unfused", "ns_node_plan unfused", "g"),
                    ("Python per-op", "ns_node_Python per-op", "g"), ("ns / kernel call, plan fused", "ns_call_plan fused", "g"),
                    ("plan unfused", "ns_call_plan unfused", "g"), ("Python per-op", "ns_call_Python per-op", "g"),
                    ("Python / plan fused", "python_over_plan", "x")]

    def __init__(self, peers, all_core):
        b = cpufuse.available_isas()[0]
        self.vlist = [Variant("plan fused", "cpufuse", b), Variant("plan unfused", "cpufuse", b, fused=False),
                      Variant("Python per-op", "user", tol=1e-10)]

    inputs = staticmethod(dispatch_inputs)
    reference = staticmethod(dispatch_reference)

    def build(self, case, v, inp):
        return dispatch_build(case, v, inp, threads.resolve(v.nth))

    def derived(self, case, res, env):
        t = times(res)
        d = {f"ns_node_{k}": v / case.n_nodes for k, v in t.items()}
        calls = {"plan fused": dispatch_kernel_calls(case, True), "plan unfused": dispatch_kernel_calls(case, False),
                 "Python per-op": case.n_nodes if case.chain == "scale_add" else case.n_nodes // 2}
        d.update({f"ns_call_{k}": v / calls[k] for k, v in t.items() if k in calls})
        if "plan fused" in t and "Python per-op" in t:
            d["python_over_plan"] = t["Python per-op"] / t["plan fused"]
        return d
