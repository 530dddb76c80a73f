"""The "quantized matmul" section of bench.run: cpufuse.matmul on GGUF weights vs ggml's MUL_MAT and numpy,
and the fused-op rows (SwiGLU, RMSNorm -> matmul, residual, QKV, RoPE + f16 cache write); the rows:
bench/cases.py; the columns, weights and checks: bench/README.md ("quant section").
"""
import concurrent.futures
import functools
import statistics
import sys
import zlib

import numpy as np

import cpufuse
from cpufuse import reference as ref

from . import threads
from .cases import ROPE_DIM, ROPE_HEADS, Section
from .cases import Unavailable, Variant
from .ops import all_core_name

EPS_NORM = 1e-5
Q8REF_MAX = 2e8          # rows * N * K up to which the q8 block reference is computed (~2 s at 4.5e7)
Q8REF_MAX_QUICK = 1e7    # the same with --quick (SmolLM2 rows only)
READ_BYTES = 256 << 20   # the DRAM read probe's array
NA = "not a column of this row kind"

LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
ROPE_CTX = 1024


# ------------------------------------------------------------------------------------------------
# Weights

def _gguf():
    import gguf
    return gguf


def make_raw(qtype, n_out, n_in, rng):
    """GGUF bytes (n_out, row_bytes) uint8 of a random (n_out, n_in) weight of type qtype."""
    gg = _gguf()
    T = gg.GGMLQuantizationType[qtype]
    if qtype in LEGACY:
        w = rng.standard_normal((n_out, n_in), dtype=np.float32) * np.float32(0.02)
        return np.ascontiguousarray(gg.quants.quantize(w, T))
    block, tsize = gg.GGML_QUANT_SIZES[T]
    nb = n_out * n_in // block
    b = rng.integers(0, 256, (nb, tsize), dtype=np.uint8)

    def f16(lo, hi):
        return rng.uniform(lo, hi, nb).astype("<f2").view(np.uint8).reshape(nb, 2)
    if qtype in ("Q4_K", "Q5_K"):          # d, dmin at bytes 0..3
        b[:, 0:2], b[:, 2:4] = f16(1e-4, 1e-3), f16(1e-4, 1e-3)
    elif qtype == "Q6_K":                  # d at the end
        b[:, tsize - 2:] = f16(1e-4, 1e-3)
    elif qtype == "Q2_K":                  # d, dmin at the end
        b[:, tsize - 4:tsize - 2], b[:, tsize - 2:] = f16(1e-4, 1e-3), f16(1e-4, 1e-3)
    elif qtype == "Q3_K":
        b[:, tsize - 2:] = f16(1e-4, 1e-3)
    elif qtype in ("IQ4_NL", "IQ4_XS"):    # d at bytes 0..1
        b[:, 0:2] = f16(1e-4, 1e-3)
    else:
        raise ValueError(f"no random-bytes recipe for {qtype}")
    return b.reshape(n_out, -1)


def dequantize(raw, qtype, n_in):
    gg = _gguf()
    return np.ascontiguousarray(gg.quants.dequantize(raw, gg.GGMLQuantizationType[qtype]).reshape(-1, n_in),
                                dtype=np.float32)


class Weight:
    """One weight: raw GGUF bytes, the cpufuse QTensor (None while cpufuse has none), the f32
    dequantized matrix for the numpy column."""

    def __init__(self, qtype, n_out, n_in, tag=""):
        rng = np.random.default_rng(zlib.crc32(f"{qtype}{n_out}{n_in}{tag}".encode()))
        self.qtype, self.n_out, self.n_in = qtype, n_out, n_in
        self.raw = make_raw(qtype, n_out, n_in, rng)
        self.wf = dequantize(self.raw, qtype, n_in)
        self.qt = cpufuse.QTensor(self.raw, qtype, (n_out, n_in))
        # the repacked weights (cpufuse's P16 panels) where this cpufuse has them
        self.qp = self.qt.repack()
        self.nbytes = self.raw.nbytes


_wcache = {}


def weight(qtype, n_out, n_in, tag=""):
    """the weight of this (type, shape, tag); the cache holds the last case's weights only (Llama-7B
    down in f32 is 180 MB)"""
    key = (qtype, n_out, n_in, tag)
    if key not in _wcache:
        w = Weight(qtype, n_out, n_in, tag)
        _wcache[key] = w
    return _wcache[key]


def _keep_only(keys):
    for k in list(_wcache):
        if k not in keys:
            del _wcache[k]


def release():
    _wcache.clear()
    _read.clear()


# ------------------------------------------------------------------------------------------------
# Inputs and float64 references

def _rng(case, what):
    return np.random.default_rng(zlib.crc32(f"{case.kind}{case.n_in}{case.rows}{what}".encode()))


def inputs(case):
    inp = {}
    if case.kind == "rope":
        T, H, D = case.rows, ROPE_HEADS, ROPE_DIM
        pos0 = 0 if T > 1 else ROPE_CTX // 2 - 1
        inp["k"] = _rng(case, "k").standard_normal((T, H, D), dtype=np.float32)
        inp["pos"] = np.arange(pos0, pos0 + T, dtype=np.int32)
        inp["pos0"] = pos0
        inp["kc"] = np.zeros((ROPE_CTX, H, D), np.float16)
        return inp
    x = _rng(case, "x").standard_normal((case.rows, case.n_in), dtype=np.float32)
    inp["x"] = x
    if case.kind in ("matmul", "residual"):
        _keep_only({(case.qtype, case.n_out, case.n_in, "")})
        inp["w"] = [weight(case.qtype, case.n_out, case.n_in)]
        if case.kind == "residual":
            inp["r"] = _rng(case, "r").standard_normal((case.rows, case.n_out), dtype=np.float32)
    elif case.kind == "swiglu":
        keys = [(case.qtype, case.n_out, case.n_in, t) for t in ("gate", "up")]
        _keep_only(set(keys))
        inp["w"] = [weight(*k) for k in keys]
    elif case.kind == "norm_matmul":
        _keep_only({(case.qtype, case.n_out, case.n_in, "")})
        inp["w"] = [weight(case.qtype, case.n_out, case.n_in)]
        inp["g"] = (1.0 + 0.1 * _rng(case, "g").standard_normal(case.n_in, dtype=np.float32)).astype(np.float32)
    elif case.kind == "qkv":
        keys = [(case.qtype, n, case.n_in, t) for n, t in ((case.n_out, "q"), (case.n_kv, "k"), (case.n_kv, "v"))]
        _keep_only(set(keys))
        inp["w"] = [weight(*k) for k in keys]
    return inp


def ref_matmul64(x, wf, chunk=1024):
    """float64 x @ wf.T, converting wf to float64 a chunk of rows at a time"""
    x64 = x.astype(np.float64)
    y = np.empty((x.shape[0], wf.shape[0]))
    for o in range(0, wf.shape[0], chunk):
        y[:, o:o + chunk] = x64 @ wf[o:o + chunk].astype(np.float64).T
    return y


def _rms64(x, g, eps):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + eps) * g.astype(np.float64)


def reference(case, inp):
    if case.kind == "rope":
        return ref.rope(inp["k"], inp["pos"], ROPE_DIM)
    x, ws = inp["x"], inp["w"]
    if case.kind == "matmul":
        return ref_matmul64(x, ws[0].wf)
    if case.kind == "swiglu":
        g, u = ref_matmul64(x, ws[0].wf), ref_matmul64(x, ws[1].wf)
        return g / (1.0 + np.exp(-g)) * u
    if case.kind == "norm_matmul":
        return _rms64(x, inp["g"], EPS_NORM) @ ws[0].wf.astype(np.float64).T
    if case.kind == "residual":
        return inp["r"].astype(np.float64) + ref_matmul64(x, ws[0].wf)
    if case.kind == "qkv":
        return np.concatenate([ref_matmul64(x, w.wf) for w in ws], axis=-1)
    raise ValueError(case.kind)


# ------------------------------------------------------------------------------------------------
# The DRAM read probe: np.max over 256 MiB (1 thread), or N slices by N Python threads at once

_read = {}


def read_probe(n_threads):
    """a zero-arg call reading READ_BYTES once (np.max; n threads: slices from a pool started in the
    caller's all-core mode)"""
    if n_threads not in _read:
        a = _read.setdefault("a", np.full(READ_BYTES // 4, 1.0, np.float32))
        _read[n_threads] = threads.read_fn(a, n_threads)[0]
    return _read[n_threads]


# ------------------------------------------------------------------------------------------------
# The section (bench.run protocol: cases / inputs / reference / build / tol / work / annotate)

MM_COLS = ("cpufuse", "cpufuse f32", "cpufuse q8", "ggml", "ggml repack", "numpy", "DRAM read")
FUSED_COLS = ("fused", "unfused", "numpy unfused", "copy")
KIND_COLS = {"matmul": MM_COLS[:-1] + ("DRAM read",),
             "swiglu": FUSED_COLS[:3], "norm_matmul": FUSED_COLS[:3], "residual": FUSED_COLS[:3], "qkv": FUSED_COLS[:3],
             "rope": ("fused", "unfused", "copy")}
KIND_TITLE = {"swiglu": "gate/up + SwiGLU: `matmul_swiglu` vs two matmuls + swiglu",
              "norm_matmul": "RMSNorm → quant → matmul: `matmul(norm_weight=g, eps=1e-5)` vs `rms_norm` then `matmul`",
              "residual": "matmul + residual add: `matmul(x, w, residual=r, out=y)` vs `matmul` then `np.add(r, t)`",
              "qkv": "QKV on one activation: `matmul_multi(x, (wq, wk, wv))` vs three matmuls",
              "rope": "RoPE + f16 KV-cache write: `rope(k, pos, n_dims=128, cache=(kc, pos0))` vs rope then a cast copy "
                      "into the cache, vs numpy's copy bandwidth"}


def _default_act():
    qm = sys.modules.get("cpufuse.quant.matmul")
    return getattr(qm, "DEFAULT_ACT", None)


class QuantSection(Section):
    key, title = "quant", "quantized matmul"
    settle_s = 0.1  # after the all-core columns: OpenBLAS's idle workers spin ~0.1 s (threads.settle_s)

    def __init__(self, peers, all_core):
        V = Variant
        self.col = {}
        vs = []
        specs = [("cpufuse", "cpufuse", 1e-3), ("cpufuse f32", "cpufuse", 1e-10), ("cpufuse q8", "cpufuse", 1e-3),
                 ("ggml", "peer", 1e-3), ("ggml repack", "peer", 1e-3), ("numpy", "user", 1e-6),
                 ("DRAM read", "baseline", None),
                 ("fused", "cpufuse", 1e-3), ("unfused", "cpufuse", 1e-3), ("numpy unfused", "user", 1e-6),
                 ("copy", "baseline", None)]
        for nth in ((1, threads.ALL) if all_core else (1,)):
            for name, kind, tol in specs:
                nm = name if nth == 1 else all_core_name(name)
                self.col[nm] = name
                slow = 3.0 if kind in ("cpufuse", "user") else None
                vs.append(V(nm, kind, None, tol=tol if tol is not None else 0.0, nth=nth, max_call_s=slow))
        self.vlist = vs
        self.stash = {}   # (case name) -> {column name: output}, for the cross checks in work()
        self.info = {}    # (case name) -> {column name: ggml path info}
        self.q8ref = {}   # (case name) -> float64 q8 block reference (or None)
        self.q8ref_max = Q8REF_MAX

    # ---- protocol
    def cases(self, a):
        self.q8ref_max = Q8REF_MAX_QUICK if a.quick else Q8REF_MAX
        return super().cases(a)

    inputs = staticmethod(inputs)
    reference = staticmethod(reference)

    def tol(self, case, v):
        col = self.col[v.name]
        if col == "cpufuse" and _default_act() == "f32":
            return 1e-10, None
        if case.kind == "rope":
            return 1e-6, None   # f16 cache: the f16 rounding (~1e-7)
        return v.tol, None

    def build(self, case, v, inp):
        col = self.col[v.name]
        if col not in KIND_COLS[case.kind]:
            raise Unavailable(NA, quiet=True)
        nth = threads.resolve(v.nth)
        if col == "DRAM read":
            if case.rows != 1:
                raise Unavailable("timed beside the decode rows only", quiet=True)
            fn = read_probe(nth)
            return fn, fn
        if case.kind == "matmul":
            fn, get = self._build_matmul(case, col, inp, nth, v.name)
        else:
            fn, get = self._build_fused(case, col, inp, nth)
        return fn, (self._stashing(case, v.name, get) if v.kind != "baseline" else get)

    def _stashing(self, case, name, get):
        def g():
            y = get()
            self.stash.setdefault(case.name, {})[name] = np.array(y, copy=True)
            return y
        return g

    def _build_matmul(self, case, col, inp, nth, vname):
        x, w = inp["x"], inp["w"][0]
        y = np.empty((case.rows, case.n_out), np.float32)
        if col.startswith("cpufuse"):
            kw = {"out": y, "n_threads": nth}
            if col != "cpufuse":
                kw["act"] = col.split()[1]
            fn = functools.partial(cpufuse.matmul, x, w.qp if col == "cpufuse" else w.qt, **kw)
            act = kw.get("act") or _default_act() or "q8"

            def get():
                fn()
                out = y.copy()
                if act == "q8":
                    self._check_q8(case, inp, out)
                return out
            return fn, get
        if col.startswith("ggml"):
            from . import peers
            res, why = peers.ggml_mul_mat_build(w.raw, w.qtype, w.n_out, w.n_in, x, nth, repack=col == "ggml repack")
            if res is None:
                raise Unavailable(why)
            fn, get, info = res
            self.info.setdefault(case.name, {})[vname] = info
            return fn, get
        if col == "numpy":
            wt = w.wf.T
            fn = functools.partial(np.matmul, x, wt, out=y)
            return fn, lambda: (fn(), y.copy())[1]
        raise Unavailable(NA)

    def _q8_reference(self, case, inp):
        if case.name not in self.q8ref:
            ref = None
            if case.rows * case.n_out * case.n_in <= self.q8ref_max:
                try:
                    from cpufuse.reference import quant as qref
                    ref = qref.ref_matmul_q8(inp["x"], inp["w"][0].qt)
                except (ImportError, AttributeError):
                    ref = None
            self.q8ref[case.name] = ref
        return self.q8ref[case.name]

    def _check_q8(self, case, inp, out):
        """cpufuse's q8 mode must be the float64 of ggml's integer block arithmetic (design doc)"""
        ref = self._q8_reference(case, inp)
        if ref is None:
            return
        e = _nmse(ref, out)
        if not e <= 1e-10:
            raise AssertionError(f"q8 mode: NMSE {e:.3g} > 1e-10 against cpufuse.reference.quant.ref_matmul_q8")

    def _build_fused(self, case, col, inp, nth):
        if case.kind == "rope":
            return self._build_rope(case, col, inp, nth)
        x, ws = inp["x"], inp["w"]
        rows = case.rows
        if case.kind == "swiglu":
            wg, wu = ws
            y = np.empty((rows, case.n_out), np.float32)
            g = np.empty_like(y)
            u = np.empty_like(y)
            if col == "fused":
                fn = functools.partial(cpufuse.matmul_swiglu, x, wg.qt, wu.qt, out=y, n_threads=nth)
            elif col == "unfused":
                plan = _swiglu_plan(rows, case.n_out)

                def fn():
                    cpufuse.matmul(x, wg.qt, out=g, n_threads=nth)
                    cpufuse.matmul(x, wu.qt, out=u, n_threads=nth)
                    r = plan.run(gate=g, up=u, n_threads=nth)
                    return r[0] if isinstance(r, (list, tuple)) else r

                def get():
                    return np.array(fn(), copy=True)
                return fn, get
            else:
                wgt, wut = wg.wf.T, wu.wf.T

                def fn():
                    np.matmul(x, wgt, out=g)
                    np.matmul(x, wut, out=u)
                    np.negative(g, out=y)
                    np.exp(y, out=y)
                    np.add(y, 1.0, out=y)
                    np.divide(g, y, out=y)
                    np.multiply(y, u, out=y)
        elif case.kind == "norm_matmul":
            w, gw = ws[0], inp["g"]
            y = np.empty((rows, case.n_out), np.float32)
            t = np.empty_like(x)
            if col == "fused":
                fn = functools.partial(cpufuse.matmul, x, w.qt, norm_weight=gw, eps=EPS_NORM, out=y, n_threads=nth)
            elif col == "unfused":
                def fn():
                    cpufuse.rms_norm(x, gw, eps=EPS_NORM, out=t, n_threads=nth)
                    cpufuse.matmul(t, w.qt, out=y, n_threads=nth)
            else:
                wt = w.wf.T
                ms = np.empty((rows, 1), np.float32)

                def fn():
                    np.multiply(x, x, out=t)
                    np.mean(t, axis=-1, keepdims=True, out=ms)
                    np.add(ms, EPS_NORM, out=ms)
                    np.sqrt(ms, out=ms)
                    np.divide(x, ms, out=t)
                    np.multiply(t, gw, out=t)
                    np.matmul(t, wt, out=y)
        elif case.kind == "residual":
            w, r = ws[0], inp["r"]
            y = np.empty((rows, case.n_out), np.float32)
            t = np.empty_like(y)
            if col == "fused":
                fn = functools.partial(cpufuse.matmul, x, w.qt, residual=r, out=y, n_threads=nth)
            elif col == "unfused":
                def fn():
                    cpufuse.matmul(x, w.qt, out=t, n_threads=nth)
                    np.add(r, t, out=y)
            else:
                wt = w.wf.T

                def fn():
                    np.matmul(x, wt, out=t)
                    np.add(r, t, out=y)
        elif case.kind == "qkv":
            ys = [np.empty((rows, w.n_out), np.float32) for w in ws]
            y = None
            if col == "fused":
                fn = functools.partial(cpufuse.matmul_multi, x, tuple(w.qt for w in ws), out=tuple(ys), n_threads=nth)
            elif col == "unfused":
                def fn():
                    for w, o in zip(ws, ys):
                        cpufuse.matmul(x, w.qt, out=o, n_threads=nth)
            else:
                wts = [w.wf.T for w in ws]

                def fn():
                    for wt, o in zip(wts, ys):
                        np.matmul(x, wt, out=o)

            def get():
                fn()
                return np.concatenate(ys, axis=-1)
            return fn, get
        else:
            raise Unavailable(NA)

        def get():
            fn()
            return y.copy()
        return fn, get

    def _build_rope(self, case, col, inp, nth):
        k, pos, pos0, kc = inp["k"], inp["pos"], inp["pos0"], inp["kc"]
        T = case.rows
        dst = kc[pos0:pos0 + T]
        if col == "copy":  # plain copy bandwidth: k into an f32 scratch (read + write 4 bytes per element)
            scratch = np.empty_like(k)
            fn = functools.partial(np.copyto, scratch, k)
            return fn, lambda: (fn(), scratch)[1]
        if col == "fused":
            fn = functools.partial(cpufuse.rope, k, pos, n_dims=ROPE_DIM, cache=(kc, pos0), n_threads=nth)
        else:
            tmp = np.empty_like(k)

            def fn():
                cpufuse.rope(k, pos, n_dims=ROPE_DIM, out=tmp, n_threads=nth)
                np.copyto(dst, tmp, casting="same_kind")

        def get():
            fn()
            return dst.astype(np.float32)
        return fn, get

    def work(self, case, inp):
        """bytes and flops of the row; also the cross checks on the outputs the checks just made
        (runs after every column of the case was built and checked, before timing)"""
        if case.kind == "rope":
            w = {"bytes": case.rows * case.n_in * 6, "weight_bytes": 0, "flops": 0}
        else:
            ws = inp["w"]
            n_out = sum(x.n_out for x in ws)
            w = {"weight_bytes": sum(x.nbytes for x in ws), "weight_f32_bytes": sum(x.wf.nbytes for x in ws),
                 "flops": 2 * case.rows * case.n_in * n_out, "bytes": sum(x.nbytes for x in ws)}
        outs = self.stash.pop(case.name, {})
        extra = EXTRA.setdefault(case.name, {})
        extra["ggml_info"] = self.info.pop(case.name, {})
        q8 = self.q8ref.pop(case.name, None)
        if q8 is not None:
            extra["nmse_vs_q8ref"] = {k: _nmse(q8, o) for k, o in outs.items()
                                      if self.col[k] in ("cpufuse", "cpufuse q8", "ggml", "ggml repack")}
        # every thread count must give the same bits (cpufuse's contract; ggml's on x86, docs/quant-design.md)
        same = {}
        for k, o in outs.items():
            if k != self.col[k] and self.col[k] in outs:
                same[self.col[k]] = bool(np.array_equal(o, outs[self.col[k]]))
        extra["threads_bit_identical"] = same
        return w

    def annotate(self, case, r, work):
        r["median_us"] = r["median_ns"] / 1e3
        if r["kind"] == "baseline" and case.kind != "rope":   # the DRAM read probe
            r["gbps"] = READ_BYTES / r["median_ns"]
            PROBES.setdefault(r["n_threads"], []).append(r["gbps"])
            return
        if r["kind"] == "baseline":                           # rope rows: the f32 copy of k, read + write
            r["gbps"] = 2 * 4 * case.rows * case.n_in / r["median_ns"]
            return
        r["gbps"] = work["bytes"] / r["median_ns"]
        if work.get("flops"):
            r["gflops"] = work["flops"] / r["median_ns"]


@functools.lru_cache(maxsize=8)
def _swiglu_plan(rows, n):
    g = cpufuse.Graph()
    a = g.input("gate", (rows, n))
    b = g.input("up", (rows, n))
    g.output(g.mul(g.silu(a, name="silu"), b, name="swiglu"))
    return g.compile(fusion=True)


def _nmse(want, got):
    want = np.asarray(want, np.float64)
    d = np.asarray(got, np.float64) - want
    return float((d * d).sum() / max((want * want).sum(), 1e-300))


EXTRA = {}     # case name -> cross checks and ggml path info (filled in work(), read in derived())
PROBES = {}    # thread count -> DRAM read GB/s of every decode row's probe


# ------------------------------------------------------------------------------------------------
# Derived numbers and the markdown

def _cols(res, nth_all):
    """{base column: result} for the 1-thread (nth_all False) or all-core columns"""
    out = {}
    for k, r in res.items():
        if r.get("status") != "ok" or not r.get("median_ns"):
            continue
        allc = r.get("n_threads", 1) > 1
        if allc == nth_all:
            out[k.split(" ×")[0]] = r
    return out


def derived(case, res, env):
    """the same-run ratios of a row (runs after the section: drops its weights and arrays first)"""
    release()   # the section is done (derived runs after every section): drop its weights and arrays
    ex = EXTRA.get(case.name, {})
    d = {"kind": case.kind, "threads_bit_identical": ex.get("threads_bit_identical"),
         "nmse_vs_q8ref": ex.get("nmse_vs_q8ref")}
    info = ex.get("ggml_info", {})
    d["ggml_path"] = {k: (v["path"] + (f" {v['layout']}" if v.get("layout") and v["path"] == "repack" else ""))
                      for k, v in info.items()}
    for suffix, allc in (("", False), ("_all", True)):
        c = _cols(res, allc)
        if not c:
            continue
        if case.kind == "matmul":
            cf = c.get("cpufuse")
            gg = c.get("ggml repack") or c.get("ggml")
            d["ggml_default" + suffix] = "ggml repack" if "ggml repack" in c else ("ggml" if "ggml" in c else None)
            if cf:
                t = cf["median_ns"]
                d["cpufuse_us" + suffix] = t / 1e3
                if gg:
                    d["ggml_over_cpufuse" + suffix] = gg["median_ns"] / t
                if "ggml" in c:
                    d["ggml_plain_over_cpufuse" + suffix] = c["ggml"]["median_ns"] / t
                if "numpy" in c:
                    d["numpy_over_cpufuse" + suffix] = c["numpy"]["median_ns"] / t
                if case.rows == 1:
                    d["cpufuse_gbps" + suffix] = cf["gbps"]
                else:
                    d["cpufuse_gflops" + suffix] = cf["gflops"]
            q8 = [c[k] for k in ("cpufuse", "cpufuse q8") if k in c]
            if q8 and gg:
                d["ggml_over_best_cpufuse_q8" + suffix] = gg["median_ns"] / min(r["median_ns"] for r in q8)
            if case.rows == 1:
                if gg:
                    d["ggml_gbps" + suffix] = gg["gbps"]
                pl = PROBES.get(threads.n_all if allc else 1)
                probe = statistics.median(pl) if pl else None
                if "DRAM read" in c:
                    d["read_gbps_row" + suffix] = c["DRAM read"]["gbps"]
                if probe:
                    d["read_gbps" + suffix] = probe
                    if cf:
                        d["pct_read" + suffix] = 100 * cf["gbps"] / probe
                    if gg:
                        d["ggml_pct_read" + suffix] = 100 * gg["gbps"] / probe
        else:
            f = c.get("fused")
            if f:
                d["fused_us" + suffix] = f["median_ns"] / 1e3
                if "unfused" in c:
                    d["fusion_gain" + suffix] = c["unfused"]["median_ns"] / f["median_ns"]
                if "numpy unfused" in c:
                    d["user_gain" + suffix] = c["numpy unfused"]["median_ns"] / f["median_ns"]
                if "copy" in c:
                    d["fused_over_copy" + suffix] = f["median_ns"] / c["copy"]["median_ns"]
                    d["pct_copy_gbps" + suffix] = 100 * f["gbps"] / c["copy"]["gbps"]
                d["gbps" + suffix] = f["gbps"]
            if "copy" in c:
                d["copy_gbps" + suffix] = c["copy"]["gbps"]
    return d


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
QuantSection.derived = staticmethod(derived)
QuantSection.tables = lambda self, entries: [
    (KIND_TITLE.get(k), rows, None if k != "matmul" else self.intro)
    for k in ("matmul", "swiglu", "norm_matmul", "residual", "qkv", "rope")
    for rows in [[e for e in entries if e["case"]["kind"] == k]] if rows]
