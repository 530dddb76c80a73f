"""The quantized-matmul section: cpufuse.matmul on GGUF weights vs ggml's MUL_MAT and numpy, and the
fused-op rows (SwiGLU, RMSNorm -> matmul, residual, QKV, RoPE + f16 cache write); the rows:
bench/cases.py; the columns, weights and checks: bench/README.md ("quant section").
"""
import functools
import statistics
import zlib

import numpy as np

import cpufuse
from cpufuse import reference as ref
from cpufuse.quant.matmul import DEFAULT_ACT
from cpufuse.reference.quant import random_blocks

from . import threads
from .cases import ROPE_DIM, ROPE_HEADS, Section, Unavailable, Variant
from .ops import all_core_name

EPS_NORM = 1e-5
Q8REF_MAX = 2e8          # rows * N * K up to which the q8 block reference is computed (~2 s at 4.5e7)
READ_BYTES = 256 << 20   # the DRAM read probe's array
NA = "not a column of this row kind"
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
ROPE_CTX = 1024


def make_raw(qtype, n_out, n_in, rng):
    """GGUF bytes (n_out, row bytes) of a random (n_out, n_in) weight: quantized N(0, 0.02²) for the
    legacy types, cpufuse.reference.quant.random_blocks with f16 scales of ±[1e-4, 1e-3] for the others"""
    if qtype not in LEGACY:
        return random_blocks(qtype, n_out, n_in, rng, d_range=(1e-4, 1e-3)).raw
    import gguf
    w = rng.standard_normal((n_out, n_in), dtype=np.float32) * 0.02
    return np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype]))


class Weight:
    """one weight: raw GGUF bytes, the QTensor and its repacked panels, the f32 matrix for numpy"""

    def __init__(self, qtype, n_out, n_in, tag=""):
        rng = np.random.default_rng(zlib.crc32(f"{qtype}{n_out}{n_in}{tag}".encode()))
        self.qtype, self.n_out, self.n_in = qtype, n_out, n_in
        self.raw = make_raw(qtype, n_out, n_in, rng)
        self.qt = cpufuse.QTensor(self.raw, qtype, (n_out, n_in))
        self.wf = self.qt.dequantize()
        self.qp, self.nbytes = self.qt.repack(), self.raw.nbytes


_wcache, _read = {}, {}


def weights(keys):
    """the weights of these (type, n_out, n_in, tag); the cache keeps the last case's only (Llama-7B
    down in f32 is 180 MB)"""
    for k in [k for k in _wcache if k not in keys]:
        del _wcache[k]
    for k in keys:
        if k not in _wcache:
            _wcache[k] = Weight(*k)
    return [_wcache[k] for k in keys]


def release():
    _wcache.clear()
    _read.clear()


def read_probe(n_threads):
    """a zero-arg call reading READ_BYTES once (np.max; n threads: slices from a pool started in the
    caller's all-core mode)"""
    if n_threads not in _read:
        a = _read.setdefault("a", np.full(READ_BYTES // 4, 1.0, np.float32))
        _read[n_threads] = threads.read_fn(a, n_threads)[0]
    return _read[n_threads]


# ------------------------------------------------------------------------------------------------
# Inputs and float64 references

WEIGHTS = {"matmul": ("",), "residual": ("",), "norm_matmul": ("",), "swiglu": ("gate", "up"), "qkv": ("q", "k", "v")}


def inputs(case):
    rng = lambda what: np.random.default_rng(zlib.crc32(f"{case.kind}{case.n_in}{case.rows}{what}".encode()))  # noqa
    if case.kind == "rope":
        T = case.rows
        pos0 = 0 if T > 1 else ROPE_CTX // 2 - 1
        return {"k": rng("k").standard_normal((T, ROPE_HEADS, ROPE_DIM), dtype=np.float32), "pos0": pos0,
                "pos": np.arange(pos0, pos0 + T, dtype=np.int32),
                "kc": np.zeros((ROPE_CTX, ROPE_HEADS, ROPE_DIM), np.float16)}
    n_out = lambda tag: case.n_kv if tag in ("k", "v") else case.n_out  # noqa: E731
    inp = {"x": rng("x").standard_normal((case.rows, case.n_in), dtype=np.float32),
           "w": weights([(case.qtype, n_out(t), case.n_in, t) for t in WEIGHTS[case.kind]])}
    if case.kind == "residual":
        inp["r"] = rng("r").standard_normal((case.rows, case.n_out), dtype=np.float32)
    if case.kind == "norm_matmul":
        inp["g"] = (1.0 + 0.1 * rng("g").standard_normal(case.n_in, dtype=np.float32)).astype(np.float32)
    return inp


def ref_matmul64(x, wf, chunk=1024):
    """float64 x @ wf.T, converting wf to float64 a chunk of rows at a time"""
    x64 = x.astype(np.float64)
    return np.concatenate([x64 @ wf[o:o + chunk].astype(np.float64).T for o in range(0, wf.shape[0], chunk)], axis=-1)


def reference(case, inp):
    if case.kind == "rope":
        return ref.rope(inp["k"], inp["pos"], ROPE_DIM)
    x, ws = inp["x"], inp["w"]
    if case.kind == "norm_matmul":
        x64 = x.astype(np.float64)
        x = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + EPS_NORM) * inp["g"].astype(np.float64)
    ys = [ref_matmul64(x, w.wf) for w in ws]
    if case.kind == "swiglu":
        return ys[0] / (1.0 + np.exp(-ys[0])) * ys[1]
    return np.concatenate(ys, axis=-1) + (inp["r"] if case.kind == "residual" else 0.0)


# ------------------------------------------------------------------------------------------------
# The columns

KIND_COLS = {"matmul": ("cpufuse", "cpufuse f32", "cpufuse q8", "ggml", "ggml repack", "numpy", "DRAM read"),
             "rope": ("fused", "unfused", "copy")}
SPECS = [("cpufuse", "cpufuse", 1e-3), ("cpufuse f32", "cpufuse", 1e-10), ("cpufuse q8", "cpufuse", 1e-3),
         ("ggml", "peer", 1e-3), ("ggml repack", "peer", 1e-3), ("numpy", "user", 1e-6), ("DRAM read", "baseline", 0.0),
         ("fused", "cpufuse", 1e-3), ("unfused", "cpufuse", 1e-3), ("numpy unfused", "user", 1e-6),
         ("copy", "baseline", 0.0)]


@functools.lru_cache(maxsize=8)
def _swiglu_plan(rows, n):
    g = cpufuse.Graph()
    a, b = g.input("gate", (rows, n)), g.input("up", (rows, n))
    g.output(g.mul(g.silu(a, name="silu"), b, name="swiglu"))
    return g.compile(fusion=True)


def _np_norm(x, g, t, ms):
    np.multiply(x, x, out=t)
    np.mean(t, axis=-1, keepdims=True, out=ms)
    np.add(ms, EPS_NORM, out=ms)
    np.sqrt(ms, out=ms)
    np.divide(x, ms, out=t)
    np.multiply(t, g, out=t)


def fused_calls(case, inp, nth):
    """{column: zero-arg call} of a fused-op row (not rope), and out(column): the column's output"""
    x, ws, rows, mm = inp["x"], inp["w"], case.rows, functools.partial(cpufuse.matmul, n_threads=nth)
    ys = [np.empty((rows, w.n_out), np.float32) for w in ws]
    y, tn, to = ys[0], np.empty_like(x), np.empty_like(ys[0])
    out = lambda col: np.concatenate(ys, axis=-1)  # noqa: E731
    if case.kind == "swiglu":
        (wg, wu), g, u, res = ws, to, ys[1], {}
        plan = _swiglu_plan(rows, case.n_out)

        def unfused():
            mm(x, wg.qt, out=g)
            mm(x, wu.qt, out=u)
            r = plan.run(gate=g, up=u, n_threads=nth)
            res["y"] = r[0] if isinstance(r, (list, tuple)) else r

        def numpy():
            np.matmul(x, wg.wf.T, out=g)
            np.matmul(x, wu.wf.T, out=u)
            np.negative(g, out=y)
            np.exp(y, out=y)
            np.add(y, 1.0, out=y)
            np.divide(g, y, out=y)
            np.multiply(y, u, out=y)
        return {"fused": functools.partial(cpufuse.matmul_swiglu, x, wg.qt, wu.qt, out=y, n_threads=nth),
                "unfused": unfused, "numpy unfused": numpy}, lambda col: np.array(res["y"] if col == "unfused" else y)
    if case.kind == "norm_matmul":
        w, gw, ms = ws[0], inp["g"], np.empty((rows, 1), np.float32)
        return {"fused": functools.partial(mm, x, w.qt, norm_weight=gw, eps=EPS_NORM, out=y),
                "unfused": lambda: (cpufuse.rms_norm(x, gw, eps=EPS_NORM, out=tn, n_threads=nth), mm(tn, w.qt, out=y)),
                "numpy unfused": lambda: (_np_norm(x, gw, tn, ms), np.matmul(tn, w.wf.T, out=y))}, out
    if case.kind == "residual":
        w, r = ws[0], inp["r"]
        return {"fused": functools.partial(mm, x, w.qt, residual=r, out=y),
                "unfused": lambda: (mm(x, w.qt, out=to), np.add(r, to, out=y)),
                "numpy unfused": lambda: (np.matmul(x, w.wf.T, out=to), np.add(r, to, out=y))}, out
    return {"fused": functools.partial(cpufuse.matmul_multi, x, tuple(w.qt for w in ws), out=tuple(ys), n_threads=nth),
            "unfused": lambda: [mm(x, w.qt, out=o) for w, o in zip(ws, ys)],
            "numpy unfused": lambda: [np.matmul(x, w.wf.T, out=o) for w, o in zip(ws, ys)]}, out


def rope_call(case, col, inp, nth):
    k, pos, pos0, kc = inp["k"], inp["pos"], inp["pos0"], inp["kc"]
    dst = kc[pos0:pos0 + case.rows]
    if col == "copy":  # plain copy bandwidth: k into an f32 scratch (read + write 4 bytes per element)
        scratch = np.empty_like(k)
        fn = functools.partial(np.copyto, scratch, k)
        return fn, lambda: (fn(), scratch)[1]
    if col == "fused":
        fn = functools.partial(cpufuse.rope, k, pos, n_dims=ROPE_DIM, cache=(kc, pos0), n_threads=nth)
    else:
        tmp = np.empty_like(k)
        fn = lambda: (cpufuse.rope(k, pos, n_dims=ROPE_DIM, out=tmp, n_threads=nth),  # noqa: E731
                      np.copyto(dst, tmp, casting="same_kind"))
    return fn, lambda: (fn(), dst.astype(np.float32))[1]


class QuantSection(Section):
    key, title = "quant", "quantized matmul"
    settle_s = 0.1  # after the all-core columns: OpenBLAS's idle workers spin ~0.1 s (threads.settle_s)

    def __init__(self, peers, all_core):
        self.col, self.vlist = {}, []
        for nth in ((1, threads.ALL) if all_core else (1,)):
            for name, kind, tol in SPECS:
                nm = name if nth == 1 else all_core_name(name)
                self.col[nm] = name
                self.vlist.append(Variant(nm, kind, None, tol=tol, nth=nth,
                                          max_call_s=3.0 if kind in ("cpufuse", "user") else None))
        self.stash, self.info, self.q8ref, self.extra, self.probes = {}, {}, {}, {}, {}
        self.q8ref_max = Q8REF_MAX

    def cases(self, a):
        self.q8ref_max = 1e7 if a.quick else Q8REF_MAX   # --quick: the SmolLM2 rows only
        return super().cases(a)

    inputs = staticmethod(inputs)
    reference = staticmethod(reference)

    def tol(self, case, v):
        if case.kind == "rope":
            return 1e-6, None   # f16 cache: the f16 rounding (~1e-7)
        return (1e-10 if self.col[v.name] == "cpufuse" and DEFAULT_ACT == "f32" else v.tol), None

    def build(self, case, v, inp):
        col, nth = self.col[v.name], threads.resolve(v.nth)
        if col not in KIND_COLS.get(case.kind, ("fused", "unfused", "numpy unfused")):
            raise Unavailable(NA, quiet=True)
        if col == "DRAM read":
            if case.rows != 1:
                raise Unavailable("timed beside the decode rows only", quiet=True)
            fn = read_probe(nth)
            return fn, fn
        if case.kind == "rope":
            fn, get = rope_call(case, col, inp, nth)
        elif case.kind == "matmul":
            fn, get = self._matmul(case, col, inp, nth, v.name)
        else:
            calls, out = fused_calls(case, inp, nth)
            fn = calls[col]
            get = lambda: (fn(), out(col))[1]  # noqa: E731

        def stashing():   # the outputs, for the cross checks in work()
            y = get()
            self.stash.setdefault(case.name, {})[v.name] = np.array(y, copy=True)
            return y
        return fn, stashing if v.kind != "baseline" else get

    def _matmul(self, case, col, inp, nth, vname):
        x, w = inp["x"], inp["w"][0]
        y = np.empty((case.rows, case.n_out), np.float32)
        if col.startswith("ggml"):
            from . import peers
            res, why = peers.ggml_mul_mat_build(w.raw, w.qtype, w.n_out, w.n_in, x, nth, repack=col == "ggml repack")
            if res is None:
                raise Unavailable(why)
            self.info.setdefault(case.name, {})[vname] = res[2]
            return res[:2]
        if col == "numpy":
            fn = functools.partial(np.matmul, x, w.wf.T, out=y)
            return fn, lambda: (fn(), y.copy())[1]
        act = col.split()[1] if " " in col else None
        fn = functools.partial(cpufuse.matmul, x, w.qp if act is None else w.qt, out=y, n_threads=nth,
                               **({"act": act} if act else {}))

        def get():   # q8 mode must be the float64 of ggml's integer block arithmetic (design doc)
            fn()
            q8 = self._q8_reference(case, inp) if (act or DEFAULT_ACT) == "q8" else None
            e = None if q8 is None else ref.nmse(q8, y)
            if e is not None and not e <= 1e-10:
                raise AssertionError(f"q8 mode: NMSE {e:.3g} > 1e-10 against cpufuse.reference.quant.ref_matmul_q8")
            return y.copy()
        return fn, get

    def _q8_reference(self, case, inp):
        if case.name not in self.q8ref:
            from cpufuse.reference.quant import ref_matmul_q8
            small = case.rows * case.n_out * case.n_in <= self.q8ref_max
            self.q8ref[case.name] = ref_matmul_q8(inp["x"], inp["w"][0].qt) if small else None
        return self.q8ref[case.name]

    def work(self, case, inp):
        """bytes and flops of the row, and the cross checks on the outputs the checks just made (after
        every column of the case was built and checked, before timing)"""
        if case.kind == "rope":
            w = {"bytes": case.rows * case.n_in * 6, "weight_bytes": 0, "flops": 0}
        else:
            ws = inp["w"]
            w = {"weight_bytes": sum(x.nbytes for x in ws), "weight_f32_bytes": sum(x.wf.nbytes for x in ws),
                 "flops": 2 * case.rows * case.n_in * sum(x.n_out for x in ws), "bytes": sum(x.nbytes for x in ws)}
        outs, q8 = self.stash.pop(case.name, {}), self.q8ref.pop(case.name, None)
        ex = self.extra[case.name] = {"ggml_info": self.info.pop(case.name, {})}
        if q8 is not None:
            ex["nmse_vs_q8ref"] = {k: ref.nmse(q8, o) for k, o in outs.items()
                                   if self.col[k] in ("cpufuse", "cpufuse q8", "ggml", "ggml repack")}
        # every thread count must give the same bits (cpufuse's contract; ggml's on x86)
        ex["threads_bit_identical"] = {self.col[k]: bool(np.array_equal(o, outs[self.col[k]])) for k, o in outs.items()
                                       if k != self.col[k] and self.col[k] in outs}
        return w

    def annotate(self, case, r, work):
        r["median_us"] = r["median_ns"] / 1e3
        if r["kind"] == "baseline" and case.kind != "rope":   # the DRAM read probe
            r["gbps"] = READ_BYTES / r["median_ns"]
            self.probes.setdefault(r["n_threads"], []).append(r["gbps"])
        elif r["kind"] == "baseline":                          # rope rows: the f32 copy of k, read + write
            r["gbps"] = 2 * 4 * case.rows * case.n_in / r["median_ns"]
        else:
            r["gbps"] = work["bytes"] / r["median_ns"]
            if work.get("flops"):
                r["gflops"] = work["flops"] / r["median_ns"]

    def derived(self, case, res, env):
        """the same-run ratios of a row (derived runs after every section: the weights go first)"""
        release()
        ex = self.extra.get(case.name, {})
        d = {"kind": case.kind, "threads_bit_identical": ex.get("threads_bit_identical"),
             "nmse_vs_q8ref": ex.get("nmse_vs_q8ref"),
             "ggml_path": {k: v["path"] + (f" {v['layout']}" if v.get("layout") and v["path"] == "repack" else "")
                           for k, v in ex.get("ggml_info", {}).items()}}
        for sfx, allc in (("", False), ("_all", True)):
            c = {k.split(" ×")[0]: r for k, r in res.items()
                 if r.get("status") == "ok" and r.get("median_ns") and (r.get("n_threads", 1) > 1) == allc}
            t = {k: r["median_ns"] for k, r in c.items()}

            def ratio(key, a, b):
                if a in t and b in t:
                    d[key + sfx] = t[a] / t[b]
            if case.kind != "matmul":
                if "fused" in c:
                    d["fused_us" + sfx], d["gbps" + sfx] = t["fused"] / 1e3, c["fused"]["gbps"]
                    ratio("fusion_gain", "unfused", "fused")
                    ratio("user_gain", "numpy unfused", "fused")
                    ratio("fused_over_copy", "fused", "copy")
                    if "copy" in c:
                        d["pct_copy_gbps" + sfx] = 100 * c["fused"]["gbps"] / c["copy"]["gbps"]
                if "copy" in c:
                    d["copy_gbps" + sfx] = c["copy"]["gbps"]
                continue
            gg = "ggml repack" if "ggml repack" in t else "ggml" if "ggml" in t else None
            d["ggml_default" + sfx] = gg
            if gg:
                t["ggml default"], c["ggml default"] = t[gg], c[gg]
            ratio("ggml_over_cpufuse", "ggml default", "cpufuse")
            ratio("ggml_plain_over_cpufuse", "ggml", "cpufuse")
            ratio("numpy_over_cpufuse", "numpy", "cpufuse")
            if [k for k in ("cpufuse", "cpufuse q8") if k in t] and gg:
                d["ggml_over_best_cpufuse_q8" + sfx] = t[gg] / min(t[k] for k in ("cpufuse", "cpufuse q8") if k in t)
            if "cpufuse" in c:
                d["cpufuse_us" + sfx] = t["cpufuse"] / 1e3
                d[("cpufuse_gbps" if case.rows == 1 else "cpufuse_gflops") + sfx] = c["cpufuse"][
                    "gbps" if case.rows == 1 else "gflops"]
            if case.rows != 1:
                continue
            if gg:
                d["ggml_gbps" + sfx] = c[gg]["gbps"]
            if "DRAM read" in c:
                d["read_gbps_row" + sfx] = c["DRAM read"]["gbps"]
            pl = self.probes.get(threads.n_all if allc else 1)
            if pl:
                d["read_gbps" + sfx] = probe = statistics.median(pl)
                for key, col in (("pct_read", "cpufuse"), ("ggml_pct_read", gg)):
                    if col in c:
                        d[key + sfx] = 100 * c[col]["gbps"] / probe
        return d

    def tables(self, entries):
        return [(KIND_TITLE.get(k), rows, None if k != "matmul" else self.intro)
                for k in ("matmul", "swiglu", "norm_matmul", "residual", "qkv", "rope")
                for rows in [[e for e in entries if e["case"]["kind"] == k]] if rows]


def _path(d):
    gp = d.get("ggml_path") or {}
    return " / ".join(gp.get(k, "n/a") for k in ("ggml", "ggml repack")) if gp else None


def _q8(d):
    nq = d.get("nmse_vs_q8ref") or {}
    return " / ".join("–" if nq.get(k) is None else f"{nq[k]:.1e}" for k in ("cpufuse q8", "ggml", "ggml repack")) \
        if nq else None


def _same(d):
    same = d.get("threads_bit_identical") or {}
    return ", ".join(f"{k} {'yes' if v else '**NO**'}" for k, v in same.items()) or None


KIND_TITLE = {"swiglu": "gate/up + SwiGLU: `matmul_swiglu` vs two matmuls + swiglu",
              "norm_matmul": "RMSNorm → quant → matmul: `matmul(norm_weight=g, eps=1e-5)` vs `rms_norm` then `matmul`",
              "residual": "matmul + residual add: `matmul(x, w, residual=r, out=y)` vs `matmul` then `np.add(r, t)`",
              "qkv": "QKV on one activation: `matmul_multi(x, (wq, wk, wv))` vs three matmuls",
              "rope": "RoPE + f16 KV-cache write: `rope(k, pos, n_dims=128, cache=(kc, pos0))` vs rope then a cast copy "
                      "into the cache, vs numpy's copy bandwidth"}
QuantSection.intro = (
    "y = x · dequant(W)ᵀ, W a GGUF weight (n_out × K), x f32 (rows × K), y preallocated; cpufuse = `cpufuse.matmul` "
    "(its default act; f32 / q8 forced); ggml = `ggml_mul_mat` (CPU buffer: vec_dot or llamafile sgemm; repack: the "
    "CPU_REPACK buffer llama.cpp runs by default), same thread count; numpy = `np.matmul` on pre-dequantized f32 "
    "weights. Decode rows: GB/s = weight bytes / time, % of the DRAM read probe (np.max over 256 MiB, timed in the "
    "decode rows' own rounds); prefill rows: GFLOP/s = 2·rows·K·N / time. NMSE vs q8 ref = against "
    "`cpufuse.reference.quant.ref_matmul_q8` (float64 of ggml's integer block arithmetic).")
QuantSection.derived_cols = [
    ("ggml path (plain / repack)", _path, "s"), ("ggml / cpufuse", "ggml_over_cpufuse", "x"),
    ("ggml plain / cpufuse", "ggml_plain_over_cpufuse", "x"), ("numpy / cpufuse", "numpy_over_cpufuse", "x"),
    ("cpufuse GB/s", "cpufuse_gbps", "g"), ("cpufuse GFLOP/s", "cpufuse_gflops", "g"), ("% DRAM read", "pct_read", "pct"),
    ("ggml % DRAM read", "ggml_pct_read", "pct"), ("ggml / cpufuse ×N", "ggml_over_cpufuse_all", "x"),
    ("numpy / cpufuse ×N", "numpy_over_cpufuse_all", "x"), ("GB/s ×N", "cpufuse_gbps_all", "g"),
    ("GFLOP/s ×N", "cpufuse_gflops_all", "g"), ("% DRAM read ×N", "pct_read_all", "pct"),
    ("NMSE vs q8 ref: cpufuse q8 / ggml / ggml repack", _q8, "s"), ("thread counts bit-identical", _same, "s"),
    ("fused GB/s", "gbps", "g"), ("copy GB/s", "copy_gbps", "g"), ("% copy GB/s", "pct_copy_gbps", "pct"),
    ("fused / copy", "fused_over_copy", "x"), ("fusion gain", "fusion_gain", "x"), ("user gain", "user_gain", "x"),
    ("fusion gain ×N", "fusion_gain_all", "x"), ("user gain ×N", "user_gain_all", "x")]
