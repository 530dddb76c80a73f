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
from .cases import Section, Variant
from .ops import all_core, all_core_name, times

CONFIGS = {"SmolLM2-135M": blocks.SMOLLM2_135M, "Llama-7B": blocks.LLAMA_7B}
_weights = {}


def weights(model):
    """one model's weights at a time (Llama-7B's are ~810 MB)"""
    if model not in _weights:
        _weights.clear()
        _weights[model] = blocks.make_weights(CONFIGS[model], np.random.default_rng(zlib.crc32(model.encode())))
    return _weights[model]


def matmuls(case):
    """(rows, K, weight key) of the block's 7 matmuls: q, k, v, o, gate, up, down"""
    cfg = CONFIGS[case.model]
    d, f = cfg["d"], cfg["ffn"]
    return [(case.n_tok, k, w) for k, w in ((d, "wq"), (d, "wk"), (d, "wv"), (cfg["n_head"] * cfg["head_dim"], "wo"),
                                            (d, "wg"), (d, "wu"), (f, "wd"))]


def matmul_flops(case):
    W = weights(case.model)
    return sum(2 * m * k * W[w].shape[1] for m, k, w in matmuls(case))


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
        b, V = cpufuse.available_isas()[0], Variant
        nth = (1, threads.ALL) if all_core else (1,)
        self.vlist = [V("numpy", "user", tol=1e-6), V("plan unfused", "cpufuse", b, fused=False)]
        self.vlist += [V("plan fused" if n == 1 else all_core_name("plan fused"), "cpufuse", b, nth=n) for n in nth]
        self.vlist += [V("matmuls plan", "baseline", b), V("matmuls numpy", "baseline")]
        self.vlist += [V(all_core_name("matmuls plan"), "baseline", b, nth=threads.ALL)] if all_core else []

    def inputs(self, case):
        rng = np.random.default_rng(zlib.crc32(case.name.encode()))
        cfg = CONFIGS[case.model]
        return {"cfg": cfg, "W": weights(case.model), "inp": blocks.make_inputs(cfg, case.n_tok, case.n_past, rng)}

    def reference(self, case, d):
        return blocks.numpy_block(d["cfg"], d["W"], dtype=np.float64, **d["inp"])

    def work(self, case, d):
        return {"bytes": sum(a.nbytes for a in d["W"].values()), "flops": matmul_flops(case)}

    def release(self):   # the block weights (Llama-7B's: ~810 MB), after the section
        _weights.clear()

    def build(self, case, v, d):
        cfg, W, inp, nth = d["cfg"], d["W"], d["inp"], threads.resolve(v.nth)
        if v.kind == "user":
            fn = functools.partial(blocks.numpy_block, cfg, W, **inp)
            return fn, fn
        if v.kind == "cpufuse":
            plan = blocks.build_graph(cfg, W, case.n_tok, case.n_past).compile(fusion=v.fused, isa=v.isa)
            fn = functools.partial(plan.run, n_threads=nth, **inp)
            return fn, lambda: fn()[0]
        ins = {f"a{i}": np.random.default_rng(k).standard_normal((m, k), dtype=np.float32)
               for i, (m, k, _) in enumerate(matmuls(case))}
        if v.name.startswith("matmuls plan"):   # the matmuls alone, as a plan and as np.matmul(out=)
            g = cpufuse.Graph()
            g.output(*[g.matmul(g.input(f"a{i}", (m, k)), g.constant(W[w], w), name=f"m{i}")
                       for i, (m, k, w) in enumerate(matmuls(case))])
            fn = functools.partial(g.compile(isa=v.isa).run, n_threads=nth, **ins)
            return fn, fn
        triples = [(ins[f"a{i}"], W[w], np.empty((m, W[w].shape[1]), np.float32))
                   for i, (m, k, w) in enumerate(matmuls(case))]

        def fn():
            for a, b, o in triples:
                np.matmul(a, b, out=o)
        return fn, fn

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
        k, ra = all_core(res)
        d.update(ratios(t, {"fusion_gain": ("plan unfused", "plan fused"), "user_gain": ("numpy", "plan fused")}))
        if k and "plan fused" in t:
            d["all_core_speedup"] = t["plan fused"] / ra["median_ns"]
        return d


def ratios(t, spec):
    """{key: t[a] / t[b]} for spec's {key: (a, b)} where both ran"""
    return {k: t[a] / t[b] for k, (a, b) in spec.items() if a in t and b in t}


# ------------------------------------------------------------------------------------------------
# Dispatch overhead: a plan of many tiny nodes vs the same chain called from Python

class DispatchSection(Section):
    key, title = "dispatch", "per-node dispatch overhead"
    intro = ("A chain of tiny nodes compiled into one plan (one C call runs every kernel) vs the same chain as Python "
             "calls into preallocated buffers (`np.multiply/np.add(..., out=)` for scale/add; `cpufuse.rms_norm(x, w, "
             "out=)` for rms_norm·w, which the fused plan runs as 50 kernels).")
    derived_cols = [("ns / node, plan fused", "ns_node_plan fused", "g"), ("plan unfused", "ns_node_plan unfused", "g"),
                    ("Python per-op", "ns_node_Python per-op", "g"),
                    ("ns / kernel call, plan fused", "ns_call_plan fused", "g"),
                    ("plan unfused", "ns_call_plan unfused", "g"),
                    ("Python per-op", "ns_call_Python per-op", "g"), ("Python / plan fused", "python_over_plan", "x")]

    def __init__(self, peers, all_core):
        b = cpufuse.available_isas()[0]
        self.vlist = [Variant("plan fused", "cpufuse", b), Variant("plan unfused", "cpufuse", b, fused=False),
                      Variant("Python per-op", "user", tol=1e-10)]

    def inputs(self, case):
        rng = np.random.default_rng(zlib.crc32(case.name.encode()))
        x = rng.standard_normal((1, case.width), dtype=np.float32)
        if case.chain == "scale_add":
            return {"x": x, "c": (0.01 * rng.standard_normal((1, case.width))).astype(np.float32), "w": None}
        return {"x": x, "c": None, "w": (1.0 + 0.1 * rng.standard_normal(case.width)).astype(np.float32)}

    def reference(self, case, d):
        y = d["x"].astype(np.float64)
        for i in range(case.n_nodes if case.chain == "scale_add" else case.n_nodes // 2):
            if case.chain != "scale_add":
                y = ref.rms_norm(y.astype(np.float32), 1e-6, weight=d["w"])
            else:
                y = y * 0.999 if i % 2 == 0 else y + d["c"].astype(np.float64)
        return y

    def build(self, case, v, d):
        x, c, w = d["x"], d["c"], d["w"]
        steps = case.n_nodes if case.chain == "scale_add" else case.n_nodes // 2
        if v.kind == "cpufuse":
            g = cpufuse.Graph()
            y = g.input("x", x.shape)
            k = g.constant(c if w is None else w, "c" if w is None else "w")
            for i in range(steps):
                y = (g.scale(y, 0.999) if i % 2 == 0 else g.add(y, k)) if w is None else g.mul(g.rms_norm(y, 1e-6), k)
            g.output(y)
            fn = functools.partial(g.compile(fusion=v.fused, isa=v.isa).run, n_threads=threads.resolve(v.nth), x=x)
            return fn, lambda: fn()[0]
        # Python per-op calls into preallocated buffers (what the plan saves): numpy ufuncs, or cpufuse
        bufs, calls, src = [np.empty_like(x), np.empty_like(x)], [], x
        s, rms = np.float32(0.999), functools.partial(cpufuse.rms_norm, eps=1e-6, n_threads=1)
        for i in range(steps):
            dst = bufs[i % 2]
            calls.append(functools.partial(np.multiply, src, s, out=dst) if w is None and i % 2 == 0 else
                         functools.partial(np.add, src, c, out=dst) if w is None else
                         functools.partial(rms, src, w, out=dst))
            src = dst

        def fn():
            for f in calls:
                f()
            return dst
        return fn, fn

    def derived(self, case, res, env):
        t = times(res)
        half = case.n_nodes // 2 if case.chain == "rms_norm" else case.n_nodes
        calls = {"plan fused": half, "plan unfused": case.n_nodes, "Python per-op": half}
        d = {f"ns_node_{k}": v / case.n_nodes for k, v in t.items()}
        d.update({f"ns_call_{k}": v / calls[k] for k, v in t.items() if k in calls})
        return dict(d, **ratios(t, {"python_over_plan": ("Python per-op", "plan fused")}))
