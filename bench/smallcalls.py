"""The small-calls section (`--section calls`): the time per call from Python of every public op on
tiny inputs beside `np.add(x, y, out=z)` on the same arrays, interleaved in the same run; the numba
rows compare isa="numba" with isa="scalar" on one 576-wide row. The rows and bounds: bench/cases.py.
"""
import functools

import numpy as np

import cpufuse
from cpufuse import reference as ref
from cpufuse.reference.quant import make_weight, ref_matmul_q8

from .cases import EPS, Section, Unavailable, Variant


def make_inputs(case):
    rng = np.random.default_rng(14)
    n = case.n
    f = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    inp = {"x": f(1, n), "x2": f(1, n), "w": (1 + 0.1 * f(n)).astype(np.float32), "y": np.empty((1, n), np.float32)}
    op = case.op
    if op == "add_rms_norm":
        inp["h"] = np.empty((1, n), np.float32)
    elif op.startswith("matmul"):
        k = 3 if op == "matmul_multi" else 2 if op == "matmul_swiglu" else 1
        inp["ws"] = [make_weight(case.qtype, n, n, rng) for _ in range(k)]
        inp["ys"] = [np.empty((1, n), np.float32) for _ in range(k)]
        inp["y"] = inp["ys"][0]
    elif op.startswith("rope"):
        for k in ("x", "x2", "y"):
            inp[k] = inp[k].reshape(1, 1, n)
        inp["pos"] = np.array([7], np.int32)
        inp["kc"] = np.zeros((4, 1, n), np.float16)
    elif op == "flash_attn":
        for k in ("x", "x2", "y"):
            inp[k] = inp[k].reshape(1, 1, 1, n)
        inp["k"] = f(1, 1, 1, n).astype(np.float16)
        inp["v"] = f(1, 1, 1, n).astype(np.float16)
    return inp


def reference(case, inp):
    op, x = case.op, inp["x"]
    if op == "softmax":
        return ref.softmax(x)
    if op == "rms_norm":
        return ref.rms_norm(x, EPS, weight=inp["w"])
    if op == "add_rms_norm":
        return ref.rms_norm(x, EPS, weight=inp["w"], residual=inp["x2"])[1]
    if op.startswith("matmul"):
        ys = [ref_matmul_q8(x, w) for w in inp["ws"]]
        if op == "matmul_swiglu":
            g = ys[0].astype(np.float64)
            return g / (1 + np.exp(-g)) * ys[1]
        return np.concatenate(ys, axis=-1)
    if op.startswith("rope"):
        got = cpufuse.rope(x, inp["pos"], n_dims=case.n, isa="scalar")  # the scalar C path, checked by tests
        return got if op == "rope" else got.astype(np.float16).astype(np.float32)
    if op == "flash_attn":
        return ref.flash_attn(x, inp["k"], inp["v"], scale=0.125)
    raise ValueError(op)


def call(case, inp, isa=None):
    """(fn, get): fn() is one call of the op in its decode form, get() its result (for the check)"""
    op, x, y, ws, pos, kc, n = case.op, inp["x"], inp["y"], inp.get("ws"), inp.get("pos"), inp.get("kc"), case.n
    f, args, kw = {
        "softmax": (cpufuse.softmax, (x,), {"out": y}),
        "rms_norm": (cpufuse.rms_norm, (x, inp["w"]), {"eps": EPS, "out": y}),
        "add_rms_norm": (cpufuse.add_rms_norm, (x, inp["x2"], inp["w"]), {"eps": EPS, "out": (inp.get("h"), y)}),
        "matmul": (cpufuse.matmul, (x, ws and ws[0]), {"out": y}),
        "matmul_multi": (cpufuse.matmul_multi, (x, tuple(ws or ())), {"out": tuple(inp.get("ys", ()))}),
        "matmul_swiglu": (cpufuse.matmul_swiglu, (x, *(ws or (None, None))[:2]), {"out": y}),
        "rope": (cpufuse.rope, (x, pos), {"n_dims": n, "out": y}),
        "rope_cache": (cpufuse.rope, (x, pos), {"n_dims": n, "cache": (kc, 2)}),
        "flash_attn": (cpufuse.flash_attn, (x, inp.get("k"), inp.get("v")), {"scale": 0.125, "out": y}),
    }[op]
    fn = functools.partial(f, *args, **kw, **({} if isa is None else {"isa": isa}))
    get = {"add_rms_norm": lambda: fn()[1], "matmul_multi": lambda: np.concatenate(fn(), axis=-1),
           "rope_cache": lambda: (fn(), kc[2:3].astype(np.float32))[1]}.get(op, fn)
    return fn, get


class CallsSection(Section):
    key, title = "calls", "small calls"
    intro = ("Time per call from Python of each op on tiny inputs with a preallocated out= (call), beside "
             "`np.add(x, y, out=z)` on the same arrays in the same run (baseline); on the numba rows, call = "
             "isa=\"numba\" and baseline = isa=\"scalar\" on one 576-wide row. within bound: whether the call stays "
             "within the overhead budget set for it (ratio to np.add, or µs above scalar): **over** means slower "
             "than that budget, not a wrong result (every result is checked first).")
    derived_cols = [("call / np.add", "ratio", "x"), ("numba − scalar µs", "excess_us", "us"), ("bound", "bound", "s"),
                    ("within bound", "within", "s")]

    def __init__(self, peers, all_core):
        self.vlist = [Variant("call", "cpufuse", cpufuse.available_isas()[0], tol=1e-10), Variant("baseline", "baseline")]

    inputs = staticmethod(make_inputs)
    reference = staticmethod(reference)

    def build(self, case, v, inp):
        """call: the op (isa="numba" on the numba rows); baseline: np.add(x, x2, out=y) on the op's own
        arrays (isa="scalar" on the numba rows)"""
        if case.kind == "numba":
            isa = "numba" if v.name == "call" else "scalar"
            if isa not in cpufuse.available_isas():
                raise Unavailable(f"ISA {isa} not available here")
            return call(case, inp, isa)
        if v.name == "call":
            return call(case, inp)
        fn = functools.partial(np.add, inp["x"], inp["x2"], out=inp["y"])
        return fn, fn

    def tol(self, case, v):
        return (1e-10 if case.op in ("softmax", "rms_norm", "add_rms_norm", "flash_attn") else 1e-6), None

    def derived(self, case, res, env):
        t = {k: r["median_ns"] for k, r in res.items() if r.get("status") == "ok" and "median_ns" in r}
        if "call" not in t or "baseline" not in t:
            return {}
        numba = case.kind == "numba"
        x = (t["call"] - t["baseline"]) / 1e3 if numba else t["call"] / t["baseline"]
        return {"excess_us" if numba else "ratio": x, "bound": f"≤ {case.bound:g}{' µs' if numba else '×'}",
                "within": "ok" if x <= case.bound else "**over**"}
