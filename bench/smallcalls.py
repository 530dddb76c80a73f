"""Small calls: the time per call from Python of every public op on tiny inputs, beside
`np.add(x, y, out=z)` on the same arrays, timed interleaved in the same run (issue 14 items 2, 4).

    python -m bench.smallcalls [--quick]        # this table alone
    python -m bench.run --section calls         # the same, as a section of the benchmark

Tiny inputs: one 64-wide float32 row (softmax, rms_norm, add_rms_norm, rope: one token, one head of
64), quantized matmul on 64x64 Q8_0 / Q4_0 weights with one activation row, flash_attn with one
query row over one f16 KV row, head dim 64. Every call passes a preallocated out= (the decode
loop's form) and the default ISA and thread count. The bound is the issue's: <= 2x np.add, 3x for
flash_attn. The numba rows compare isa="numba" with isa="scalar" on one 576-wide row; their bound
is the difference, <= 3 us.
"""
import functools
import sys
from dataclasses import dataclass

import numpy as np

import cpufuse
from cpufuse import reference as ref
from cpufuse.reference.quant import make_weight, ref_matmul_q8

EPS = 1e-6
R = None  # bench.run, set by register()


@dataclass(frozen=True)
class Call:
    name: str
    op: str
    bound: float            # ratio bound (op rows) or microseconds above scalar (numba rows)
    kind: str = "op"        # op: cpufuse vs np.add; numba: isa="numba" vs isa="scalar"
    qtype: str = None
    n: int = 64
    mode: str = "kernel"    # timed in back-to-back batches (bench.timing)
    group: str = None
    quick: bool = True


CASES = [
    Call("softmax 1×64", "softmax", 2.0),
    Call("rms_norm×w 1×64", "rms_norm", 2.0),
    Call("add_rms_norm 1×64", "add_rms_norm", 2.0),
    Call("matmul Q8_0 1×64 → 64", "matmul", 2.0, qtype="Q8_0"),
    Call("matmul Q4_0 1×64 → 64", "matmul", 2.0, qtype="Q4_0"),
    Call("matmul_multi Q8_0 1×64 → 3×64", "matmul_multi", 2.0, qtype="Q8_0"),
    Call("matmul_swiglu Q4_0 1×64 → 64", "matmul_swiglu", 2.0, qtype="Q4_0"),
    Call("rope 1 token × 1 head × 64, out=", "rope", 2.0),
    Call("rope 1×1×64 → f16 cache", "rope_cache", 2.0),
    Call("flash_attn 1 query × 1 KV (f16), D=64", "flash_attn", 3.0),
    Call("numba − scalar: rms_norm×w 1×576", "rms_norm", 3.0, kind="numba", n=576),
    Call("numba − scalar: softmax 1×576", "softmax", 3.0, kind="numba", n=576),
]


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
    op, x, y = case.op, inp["x"], inp["y"]
    kw = {} if isa is None else {"isa": isa}
    if op == "softmax":
        fn = functools.partial(cpufuse.softmax, x, out=y, **kw)
    elif op == "rms_norm":
        fn = functools.partial(cpufuse.rms_norm, x, inp["w"], eps=EPS, out=y, **kw)
    elif op == "add_rms_norm":
        fn = functools.partial(cpufuse.add_rms_norm, x, inp["x2"], inp["w"], eps=EPS, out=(inp["h"], y), **kw)
        return fn, lambda: fn()[1]
    elif op == "matmul":
        fn = functools.partial(cpufuse.matmul, x, inp["ws"][0], out=y, **kw)
    elif op == "matmul_multi":
        fn = functools.partial(cpufuse.matmul_multi, x, tuple(inp["ws"]), out=tuple(inp["ys"]), **kw)
        return fn, lambda: np.concatenate(fn(), axis=-1)
    elif op == "matmul_swiglu":
        fn = functools.partial(cpufuse.matmul_swiglu, x, inp["ws"][0], inp["ws"][1], out=y, **kw)
    elif op == "rope":
        fn = functools.partial(cpufuse.rope, x, inp["pos"], n_dims=case.n, out=y, **kw)
    elif op == "rope_cache":
        kc = inp["kc"]
        fn = functools.partial(cpufuse.rope, x, inp["pos"], n_dims=case.n, cache=(kc, 2), **kw)
        return fn, lambda: (fn(), kc[2:3].astype(np.float32))[1]
    elif op == "flash_attn":
        fn = functools.partial(cpufuse.flash_attn, x, inp["k"], inp["v"], scale=0.125, out=y, **kw)
    else:
        raise ValueError(op)
    return fn, fn


def build(case, variant, inp):
    """variant "call": the op (isa="numba" on the numba rows); "baseline": np.add(x, x2, out=y)
    on the op's own arrays (isa="scalar" on the numba rows)"""
    if case.kind == "numba":
        isa = "numba" if variant == "call" else "scalar"
        if isa not in cpufuse.available_isas():
            raise LookupError(f"ISA {isa} not available here")
        return call(case, inp, isa)
    if variant == "call":
        return call(case, inp)
    fn = functools.partial(np.add, inp["x"], inp["x2"], out=inp["y"])
    return fn, fn


def derived(case, res):
    t = {k: r["median_ns"] for k, r in res.items() if r.get("status") == "ok" and "median_ns" in r}
    if "call" not in t or "baseline" not in t:
        return {}
    if case.kind == "numba":
        d = (t["call"] - t["baseline"]) / 1e3
        return {"excess_us": d, "within_bound": d <= case.bound}
    x = t["call"] / t["baseline"]
    return {"ratio": x, "within_bound": x <= case.bound}


def table(entries):
    """markdown lines for [(case dict, results, derived)]"""
    def us(r):
        return f"{r['median_ns'] / 1e3:.2f}" if r.get("status") == "ok" and "median_ns" in r else {
            "skipped": "n/a", "failed": "FAIL", "error": "ERR"}.get(r.get("status"), "–")
    ops = [e for e in entries if e[0]["kind"] == "op"]
    nbs = [e for e in entries if e[0]["kind"] == "numba"]
    lines = []
    if ops:
        lines += ["| op (tiny input, out=) | cpufuse µs | np.add µs | ratio | bound | |", "|---|---:|---:|---:|---:|---|"]
        for c, res, d in ops:
            ok = "" if "within_bound" not in d else ("ok" if d["within_bound"] else "**over**")
            lines.append(f"| {c['name']} | {us(res.get('call', {}))} | {us(res.get('baseline', {}))} | "
                         + (f"{d['ratio']:.2f}×" if "ratio" in d else "–") + f" | ≤ {c['bound']:g}× | {ok} |")
    if nbs:
        lines += ["", "| numba path overhead | numba µs | scalar C µs | numba − scalar µs | bound | |",
                  "|---|---:|---:|---:|---:|---|"]
        for c, res, d in nbs:
            ok = "" if "within_bound" not in d else ("ok" if d["within_bound"] else "**over**")
            lines.append(f"| {c['name'].split(': ', 1)[-1]} | {us(res.get('call', {}))} | {us(res.get('baseline', {}))} | "
                         + (f"{d['excess_us']:.2f}" if "excess_us" in d else "–") + f" | ≤ {c['bound']:g} µs | {ok} |")
    return lines


INTRO = ("Time per call from Python (median of back-to-back batches, interleaved rounds) of each op on tiny "
         "inputs with a preallocated out=, beside `np.add(x, y, out=z)` on the same arrays in the same run; "
         "then the numba path's per-call cost above the scalar C path on one 576-wide row. The last column says "
         "whether the call stays within the overhead budget set for it (bound): **over** means slower than that "
         "budget, not a wrong result (every result is checked first).")


# ------------------------------------------------------------------------------------------------
# as a section of bench.run

class CallsSection:
    key, title = "calls", "small calls"

    def __init__(self, peers, all_core):
        self.vlist = [R.Variant("call", "cpufuse", cpufuse.available_isas()[0], tol=1e-10),
                      R.Variant("baseline", "baseline")]

    def cases(self, a):
        return [c for c in CASES if not a.quick or c.quick]

    def inputs(self, case):
        return make_inputs(case)

    def reference(self, case, inp):
        return reference(case, inp)

    def build(self, case, v, inp):
        try:
            return build(case, v.name, inp)
        except LookupError as e:
            raise R.Unavailable(str(e)) from None

    def tol(self, case, v):
        return (1e-10 if case.op in ("softmax", "rms_norm", "add_rms_norm", "flash_attn") else 1e-6), None

    def work(self, case, inp):
        return {}

    def annotate(self, case, r, work):
        r["median_us"] = r["median_ns"] / 1e3


def _derived(case, res, env):
    return derived(case, res)


def _markdown(report, sec):
    entries = [(e["case"], e["results"], e["derived"]) for e in sec["cases"]]
    return ["", "## small calls", "", INTRO, ""] + table(entries) + R._notes(sec["cases"])


def register(run_module):
    """Add the "calls" section to bench.run (called at its import with the module itself)."""
    global R
    R = run_module
    for table, entry in ((R.SECTIONS, CallsSection), (R.DERIVED, _derived), (R.MARKDOWN, _markdown)):
        table["calls"] = entry


# ------------------------------------------------------------------------------------------------
# standalone

def measure(cases=CASES, target_s=0.3, rounds=15, only=None):
    """[(case dict, results, derived)], each case's two variants timed interleaved (bench.timing)"""
    from dataclasses import asdict

    from . import timing
    out = []
    for case in cases:
        if only and not any(s in case.name for s in only):
            continue
        inp = make_inputs(case)
        fns, res = {}, {}
        for v in ("call", "baseline"):
            try:
                fn, get = build(case, v, inp)
                if v == "call":
                    got, want = np.asarray(get(), np.float64), reference(case, inp)
                    err = ref.nmse(want, got)
                    if not err <= 1e-6:
                        res[v] = {"status": "failed", "reason": f"NMSE {err:.3g}"}
                        continue
                fns[v] = fn
            except LookupError as e:
                res[v] = {"status": "skipped", "reason": str(e)}
        for k, r in timing.measure(fns, target_s=target_s, rounds=rounds).items():
            res[k] = dict(r, status="ok")
        out.append((asdict(case), res, derived(case, res)))
    return out


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(prog="python -m bench.smallcalls", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", action="append", metavar="SUBSTR")
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args(argv)
    print("\n".join(["## small calls", "", INTRO, ""] + table(
        measure(target_s=0.05 if a.quick else 0.3, rounds=5 if a.quick else a.rounds, only=a.only))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
