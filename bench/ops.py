"""The ops section: softmax / rms_norm / add_rms_norm rows (bench/cases.py) x numpy, numba, scalar,
SIMD unfused and fused, all cores, the peers, and the softmax rows' exp floor (bench/README.md)."""
import functools
import zlib

import numpy as np

import cpufuse
from cpufuse import reference as ref

from . import threads
from .cases import Section, Unavailable, Variant

SIMD_ISAS = ("avx512", "avx2", "neon")
EXP_FLOOR = "exp floor"
PEERS = ("torch", "ggml")


def best_simd():
    return next((i for i in cpufuse.available_isas() if i in SIMD_ISAS), None)


def all_core_name(name):
    return f"{name} ×{threads.n_all}"


def make_inputs(case):
    """deterministic float32 inputs (seeded from the case's op and shape)"""
    rng = np.random.default_rng(zlib.crc32(f"{case.op}{case.shape}{case.mask}".encode()))
    R, C = case.shape
    inp = {"x": rng.standard_normal(case.shape, dtype=np.float32), "mask": None, "w": None, "r": None}
    if case.op == "softmax":
        inp["x"] *= 8.0 if case.scale != 1 else 3.0
        i, j = np.arange(R)[:, None], np.arange(C)[None, :]
        if case.mask:   # f32: query row i sits at position C - R + i; f16-causal: row i masks keys j > i mod C
            inp["mask"] = np.where(j > (C - R + i if case.mask == "f32" else i % C), -np.inf, 0.0).astype(
                np.float32 if case.mask == "f32" else np.float16)
        return inp
    inp["w"] = (1.0 + 0.1 * rng.standard_normal(C, dtype=np.float32)).astype(np.float32)
    if case.op == "add_rms_norm":
        inp["r"] = rng.standard_normal(case.shape, dtype=np.float32)
    return inp


def reference(case, inp):
    """float64 oracle: array, or (h, y) for add_rms_norm"""
    if case.op == "softmax":
        return ref.softmax(inp["x"], inp["mask"], scale=case.scale)
    return ref.rms_norm(inp["x"], case.eps, weight=inp["w"], residual=inp["r"] if case.op == "add_rms_norm" else None)


def min_bytes(case, inp):
    """minimum bytes read + written: x + mask + out, x + w + out, x + r + w + h + y"""
    x = inp["x"].nbytes
    if case.op == "softmax":
        return 2 * x + (inp["mask"].nbytes if inp["mask"] is not None else 0)
    return (2 if case.op == "rms_norm" else 4) * x + inp["w"].nbytes


def _np_softmax(x, mask, scale):
    z = x * scale + mask if mask is not None else (x * scale if scale != 1.0 else x.copy())
    z -= z.max(-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(-1, keepdims=True)
    return z


def _np_rms_norm(x, w, eps):
    return x * (1 / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)) * w


def _np_add_rms_norm(x, r, w, eps):
    h = x + r
    return h, _np_rms_norm(h, w, eps)


def build(case, inp, isa=None, fused=True, nth=1):
    """isa None: what users write (unfused numpy, allocating); else cpufuse on isa with n_threads=nth
    (always passed: the default is every core), into preallocated outputs but in the alloc row"""
    x, r, w = inp["x"], inp["r"], inp["w"]
    if isa is None:
        f, args = {"softmax": (_np_softmax, (x, inp["mask"], case.scale)), "rms_norm": (_np_rms_norm, (x, w, case.eps)),
                   "add_rms_norm": (_np_add_rms_norm, (x, r, w, case.eps))}[case.op]
        fn = functools.partial(f, *args)
        return fn, fn
    if isa not in cpufuse.available_isas():
        raise Unavailable(f"ISA {isa} not available here")
    kw = dict(isa=isa, n_threads=nth, **({} if fused else {"fused": False}))
    out = None if case.mode == "alloc" else (np.empty_like(x), np.empty_like(x))
    if case.op == "softmax":
        fn = functools.partial(cpufuse.softmax, x, inp["mask"], scale=case.scale, out=out and out[0], **kw)
    elif case.op == "rms_norm":
        fn = functools.partial(cpufuse.rms_norm, x, w, eps=case.eps, out=out and out[0], **kw)
    else:
        fn = functools.partial(cpufuse.add_rms_norm, x, r, w, eps=case.eps, out=out, **kw)
    return fn, fn


def build_peer(case, v, inp):
    from . import peers
    res, why = peers.PEERS[v.name](case, inp)
    if res is None:
        raise Unavailable(why)
    return res


def exp_floor_input(case, inp):
    """what a softmax row exponentiates: z = x·scale − rowmax(x·scale) (<= 0; no mask, every element a real exp)"""
    z = inp["x"] * np.float32(case.scale)
    return np.ascontiguousarray(z - z.max(-1, keepdims=True), dtype=np.float32)


def build_exp_floor(case, inp, isa):
    """cpufuse's exp pass alone over the softmax's R×C elements: one cffi call of cf_exp_f32__<isa>(n,
    x, y) into a preallocated y, checked against np.exp in float64"""
    if case.op != "softmax":
        raise Unavailable("softmax rows only", quiet=True)
    from cpufuse import _backend, _registry
    fn = _registry.table("exp").get(isa)
    if fn is None:
        raise Unavailable(f"no cf_exp_f32__{isa} in the native extension")
    z = exp_floor_input(case, inp)
    y, ffi = np.empty_like(z), _backend.ffi
    call = functools.partial(fn, z.size, ffi.from_buffer("float[]", z), ffi.from_buffer("float[]", y))
    call()
    e = ref.nmse(np.exp(z.astype(np.float64)), y)
    if not e <= 1e-10:
        raise ValueError(f"cf_exp_f32__{isa} disagrees with np.exp: NMSE {e:.3g}")
    return call, lambda: (call(), y)[1]


def variants(peers=False, all_core=False, peer_names=PEERS, **kw):
    """the standard columns here: numpy, numba, scalar, SIMD unfused, each SIMD ISA, the peers, the best
    SIMD ISA on every core (unavailable ISAs are left out); kw: for the numba and scalar columns"""
    avail, b = cpufuse.available_isas(), best_simd()
    vs = [Variant("numpy", "user", tol=1e-6)]
    vs += [Variant(i, "cpufuse", i, **kw) for i in ("numba", "scalar") if i in avail]
    vs += [Variant(f"{b} unfused", "cpufuse", b, fused=False)] if b else []
    vs += [Variant(i, "cpufuse", i) for i in SIMD_ISAS if i in avail]
    vs += [Variant(p, "peer", tol=1e-6) for p in peer_names] if peers else []
    return vs + ([Variant(all_core_name(b), "cpufuse", b, nth=threads.ALL)] if all_core and b else [])


def unavailable_isas():
    """{isa: reason} for the cpufuse ISAs that get no column here (reason from cpufuse itself)"""
    out = {}
    for isa in (i for i in cpufuse.ALL_ISAS if i not in cpufuse.available_isas()):
        try:
            cpufuse.softmax(np.zeros((1, 1), np.float32), isa=isa)
            out[isa] = "not listed by cpufuse.available_isas()"
        except ValueError as e:
            out[isa] = str(e)
    return out


def times(res, one_thread=False):
    return {k: r["median_ns"] for k, r in res.items() if r.get("median_ns") and r.get("status") == "ok"
            and (not one_thread or r.get("n_threads", 1) == 1)}


def all_core(res):
    """(name, result) of the all-core cpufuse column, if it ran"""
    return next(((k, r) for k, r in res.items() if r.get("n_threads", 1) > 1 and r.get("median_ns")
                 and r["kind"] == "cpufuse"), (None, None))


def common_derived(res, peers=PEERS, key="gbps"):
    """best 1-thread cpufuse column and its ratios to numpy, the peers, scalar, unfused; the all-core column"""
    t, one, b = times(res), times(res, True), best_simd()
    cf = {k: v for k, v in one.items() if res[k]["kind"] == "cpufuse" and res[k].get("strategy") is None}
    d = {k: t[a] / t[c] for k, (a, c) in (("vector_gain", ("scalar", b)), ("fusion_gain", (f"{b} unfused", b)))
         if a in t and c in t}
    if not cf:
        return d, None
    best = min(cf, key=cf.get)
    d.update(best_cpufuse=best, best_cpufuse_us=cf[best] / 1e3, **{f"best_cpufuse_{key}": res[best].get(key)})
    d.update({("user_gain" if p == "numpy" else f"{p}_over_cpufuse"): t[p] / cf[best] for p in ("numpy",) + peers
              if p in t})
    k, r = all_core(res)
    if k:
        d.update(all_core=k, all_core_us=r["median_ns"] / 1e3, all_core_speedup=cf[best] / r["median_ns"],
                 **{f"all_core_{key}": r.get(key)})
    return d, res[best]


class OpsSection(Section):
    key, title = "ops", "softmax / rms_norm"
    intro = ("Masks: `32×4096` = 32 new tokens at the end of a 4096-token context (row i masks keys j > 4064 + i); "
             "`4096×512` = 8 heads × 512 queries over 512 keys, flattened (row i masks keys j > i mod 512), f16. "
             "Kernel rows: back-to-back calls into preallocated outputs (numpy and torch allocate). Latency rows: "
             "each call timed on its own. GB/s = minimum bytes moved / median time; exp floor = `cf_exp_f32` alone "
             "over the softmax's elements (softmax ÷ exp floor = 1: the softmax costs one exp pass).")
    derived_cols = [("MB moved", "mb", "g"), ("best cpufuse", "best_cpufuse", "s"), ("GB/s", "best_cpufuse_gbps", "g"),
                    ("vector gain", "vector_gain", "x"), ("fusion gain", "fusion_gain", "x"),
                    ("user gain", "user_gain", "x"), ("% DRAM copy", "pct_dram_copy", "pct"),
                    ("exp floor µs", "exp_floor_us", "us"), ("softmax ÷ exp floor", "softmax_over_exp_floor", "x"),
                    *[(f"{p} / best", f"{p}_over_cpufuse", "x") for p in PEERS],
                    ("all-core GB/s", "all_core_gbps", "g"), ("all-core speedup", "all_core_speedup", "x"),
                    ("% all-core DRAM copy", "pct_dram_copy_all", "pct")]

    def __init__(self, peers, all_core):
        b = best_simd()   # the softmax rows' exp floor, timed in the same rounds (the fused SIMD ISA's exp)
        self.vlist = variants(peers, all_core) + ([Variant(EXP_FLOOR, "baseline", b)] if b else [])

    inputs = staticmethod(make_inputs)
    reference = staticmethod(reference)

    def build(self, case, v, inp):
        if v.kind == "baseline":
            return build_exp_floor(case, inp, v.isa)
        if v.kind == "peer":
            return build_peer(case, v, inp)
        return build(case, inp, v.isa, v.fused, threads.resolve(v.nth))

    def work(self, case, inp):
        return {"bytes": min_bytes(case, inp)}

    def derived(self, case, res, env):
        cb = env["copy_bw"]
        d, best = common_derived(res)
        d["mb"] = env["work"]["bytes"] / 1e6
        if best is not None and case.dram:
            d["pct_dram_copy"] = 100 * best["gbps"] / cb["dram"]["gbps"]
            if d.get("all_core_gbps") and "dram_all" in cb:
                d["pct_dram_copy_all"] = 100 * d["all_core_gbps"] / cb["dram_all"]["gbps"]
        ef = res.get(EXP_FLOOR, {})
        if best is not None and case.op == "softmax" and ef.get("status") == "ok" and ef.get("median_ns"):
            d["exp_floor_us"] = ef["median_ns"] / 1e3
            d["softmax_over_exp_floor"] = d["best_cpufuse_us"] * 1e3 / ef["median_ns"]
        return d
