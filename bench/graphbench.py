"""Graph cases for the benchmark: the llama decoder block (bench/blocks.py) as a compiled plan,
fused and unfused, against the same block in numpy; and the per-node dispatch cost of a plan.

Block cases: SmolLM2-135M and Llama-7B-like sizes, one token over a 256-token cache (decode) and a
128-token batch (prefill chunk). The matmul baselines are the block's seven matmuls alone, same
shapes, run as a cpufuse plan (C calls into numpy's OpenBLAS, as the block plan does) and as numpy
np.matmul(..., out=): non-matmul share = (block time - matmul time) / block time.

Dispatch cases: a plan of many tiny nodes, time per node, against the same chain as Python calls.
"""
import functools
import zlib
from dataclasses import dataclass

import numpy as np

import cpufuse
from . import blocks
from cpufuse import reference as ref

CONFIGS = {"SmolLM2-135M": blocks.SMOLLM2_135M, "Llama-7B": blocks.LLAMA_7B}


@dataclass(frozen=True)
class BlockCase:
    name: str
    model: str
    n_tok: int
    n_past: int
    big: bool = False       # Llama-7B: ~810 MB of f32 weights, skipped by --quick and --no-big
    quick: bool = True
    rounds: int = None
    group: str = None
    mode: str = "kernel"
    op: str = "block"


CASES = [
    BlockCase("SmolLM2 block n_tok=1 n_past=256", "SmolLM2-135M", 1, 256),
    BlockCase("SmolLM2 block n_tok=128 n_past=0", "SmolLM2-135M", 128, 0, quick=False),
    BlockCase("SmolLM2 block n_tok=128 n_past=128", "SmolLM2-135M", 128, 128),
    BlockCase("Llama-7B block n_tok=1 n_past=256", "Llama-7B", 1, 256, big=True, quick=False, rounds=9),
    BlockCase("Llama-7B block n_tok=128 n_past=128", "Llama-7B", 128, 128, big=True, quick=False, rounds=4),
]

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
    raise LookupError(f"no {v.name} column for the block")


# ------------------------------------------------------------------------------------------------
# Dispatch overhead: a plan of many tiny nodes vs the same chain called from Python

@dataclass(frozen=True)
class DispatchCase:
    name: str
    chain: str              # "scale_add" | "rms_norm"
    n_nodes: int
    width: int
    quick: bool = True
    rounds: int = None
    group: str = None
    mode: str = "kernel"
    op: str = "dispatch"


DISPATCH_CASES = [
    DispatchCase("200 nodes scale/add on 8 floats", "scale_add", 200, 8),
    DispatchCase("100 nodes rms_norm, mul(w) on 1×64 (50 fused kernels)", "rms_norm", 100, 64),
]


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
