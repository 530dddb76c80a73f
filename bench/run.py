"""cpufuse benchmark: tables of cases x variants, medians, 1-thread and all-core columns.

    python -m bench.run [--quick] [--peers] [--threads auto|1|both] [--no-big] [--section NAME]
                        [--json PATH] [--md PATH] [--plot PATH] [--only SUBSTR]

Sections: ops (softmax, rms_norm: the original table), attention (flash_attn decode / prefill),
graph (the llama decoder block as a plan, fused / unfused / numpy) and dispatch (per-node plan
overhead). Unset old OpenBLAS tuning variables for numpy's sake (`env -u OPENBLAS_CORETYPE -u
OPENBLAS_L2_SIZE`). Run it unpinned to get the all-core columns: the 1-thread columns pin their
own thread to one core (bench/threads.py); under `taskset -c 0` only the 1-thread columns run.
Progress (the case being run, the time left) goes to stderr; with --json / --md the chart
(bench/plot.py) is written beside them. See bench/README.md.
"""
import argparse
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass

import numpy as np

import cpufuse
from cpufuse import reference as ref

from . import attn, graphbench, threads, timing

EPS = 1e-6
SIMD_ISAS = ("avx512", "avx2", "neon")


# ------------------------------------------------------------------------------------------------
# The cases

@dataclass(frozen=True)
class Case:
    name: str
    op: str                 # softmax | rms_norm | add_rms_norm
    shape: tuple
    mask: str = None        # None | "f32" (decode-like tail mask) | "f16-causal"
    scale: float = 1.0
    eps: float = EPS
    mode: str = "kernel"    # kernel: back-to-back throughput; alloc / out: per-call latency rows
    dram: bool = False      # the case whose bandwidth is compared with the DRAM copy bandwidth
    group: str = None       # adjacent cases of one group are timed interleaved with each other
    quick: bool = True      # part of --quick


CASES = [
    # 32 new tokens at the end of a 4096-token context: causal f32 mask, so rows 0..31 see 4065..4096 keys
    Case("softmax 32×4096 +mask f32", "softmax", (32, 4096), mask="f32", scale=0.125),
    # 8 heads x 512 queries over 512 keys, flattened to 4096 rows: f16 mask, row i masks keys j > i % 512
    Case("softmax 4096×512 causal f16", "softmax", (4096, 512), mask="f16-causal", scale=0.125),
    Case("softmax 1×32000 (vocab)", "softmax", (1, 32000)),
    Case("softmax 1×151936 (vocab)", "softmax", (1, 151936)),
    Case("rms_norm×w 1×576", "rms_norm", (1, 576)),
    Case("rms_norm×w 1×4096", "rms_norm", (1, 4096)),
    Case("rms_norm×w 32×4096", "rms_norm", (32, 4096)),
    Case("rms_norm×w 512×4096", "rms_norm", (512, 4096)),
    Case("rms_norm×w 512×8192", "rms_norm", (512, 8192), dram=True),
    Case("add_rms_norm 32×4096", "add_rms_norm", (32, 4096)),
    # from-Python latency: every call timed on its own (k = 1), output allocated vs passed as out=
    Case("latency rms_norm×w 1×4096, alloc", "rms_norm", (1, 4096), mode="alloc", group="latency"),
    Case("latency rms_norm×w 1×4096, out=", "rms_norm", (1, 4096), mode="out", group="latency"),
]


def make_inputs(case):
    """Deterministic float32 inputs (seeded from the case's op and shape)."""
    rng = np.random.default_rng(zlib.crc32(f"{case.op}{case.shape}{case.mask}".encode()))
    R, C = case.shape
    inp = {"x": None, "mask": None, "w": None, "r": None}
    if case.op == "softmax":
        inp["x"] = (rng.standard_normal(case.shape, dtype=np.float32) * (8.0 if case.scale != 1 else 3.0))
        if case.mask == "f32":        # query row i sits at position C - R + i
            j = np.arange(C)[None, :]
            i = np.arange(R)[:, None]
            inp["mask"] = np.where(j > C - R + i, -np.inf, 0.0).astype(np.float32)
        elif case.mask == "f16-causal":
            j = np.arange(C)[None, :]
            i = np.arange(R)[:, None] % C
            inp["mask"] = np.where(j > i, -np.inf, 0.0).astype(np.float16)
    else:
        inp["x"] = rng.standard_normal(case.shape, dtype=np.float32)
        inp["w"] = (1.0 + 0.1 * rng.standard_normal(C, dtype=np.float32)).astype(np.float32)
        if case.op == "add_rms_norm":
            inp["r"] = rng.standard_normal(case.shape, dtype=np.float32)
    return inp


def reference(case, inp):
    """float64 oracle: array, or (h, y) for add_rms_norm."""
    if case.op == "softmax":
        return ref.softmax(inp["x"], inp["mask"], scale=case.scale)
    if case.op == "rms_norm":
        return ref.rms_norm(inp["x"], case.eps, weight=inp["w"])
    return ref.rms_norm(inp["x"], case.eps, weight=inp["w"], residual=inp["r"])


def min_bytes(case, inp):
    """Minimum bytes read + written: x + mask + out (softmax), x + w + out (rms_norm),
    x + r + w + h + y (add_rms_norm)."""
    x = inp["x"].nbytes
    if case.op == "softmax":
        return 2 * x + (inp["mask"].nbytes if inp["mask"] is not None else 0)
    if case.op == "rms_norm":
        return 2 * x + inp["w"].nbytes
    return 4 * x + inp["w"].nbytes


# ------------------------------------------------------------------------------------------------
# The variants. build(case, inp) -> (fn, get): fn() is one timed call, get() returns its output.

class Unavailable(Exception):
    """a variant that cannot run here; quiet=True: expected by design (shown blank, not in the notes)"""

    def __init__(self, why, quiet=False):
        super().__init__(why)
        self.quiet = quiet


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
    return h, h * (1 / np.sqrt(np.mean(h * h, -1, keepdims=True) + eps)) * w


def build_numpy(case, inp):
    """What users write: unfused numpy expressions, allocating temporaries and the result."""
    if case.op == "softmax":
        fn = functools.partial(_np_softmax, inp["x"], inp["mask"], case.scale)
    elif case.op == "rms_norm":
        fn = functools.partial(_np_rms_norm, inp["x"], inp["w"], case.eps)
    else:
        fn = functools.partial(_np_add_rms_norm, inp["x"], inp["r"], inp["w"], case.eps)
    return fn, fn


def build_cpufuse(isa, fused=True, nth=1):
    """cpufuse on one ISA, n_threads=nth (always passed: the default is every core). Kernel rows
    and the out= row pass preallocated outputs; the alloc row lets cpufuse allocate."""
    def build(case, inp):
        if isa not in cpufuse.available_isas():
            raise Unavailable(f"ISA {isa} not available here")
        x, kw = inp["x"], {"isa": isa, "n_threads": nth}
        if not fused:
            kw["fused"] = False
        alloc = case.mode == "alloc"
        if case.op == "softmax":
            out = None if alloc else np.empty_like(x)
            fn = functools.partial(cpufuse.softmax, x, inp["mask"], scale=case.scale, out=out, **kw)
        elif case.op == "rms_norm":
            out = None if alloc else np.empty_like(x)
            fn = functools.partial(cpufuse.rms_norm, x, inp["w"], eps=case.eps, out=out, **kw)
        else:
            out = None if alloc else (np.empty_like(x), np.empty_like(x))
            fn = functools.partial(cpufuse.add_rms_norm, x, inp["r"], inp["w"], eps=case.eps, out=out, **kw)
        return fn, fn
    return build


def build_peer(name):
    def build(case, inp):
        from . import peers
        res, why = peers.PEERS[name](case, inp)
        if res is None:
            raise Unavailable(why)
        return res
    return build


EXP_FLOOR = "exp floor"


def exp_floor_input(case, inp):
    """the values a softmax row exponentiates: z = x·scale − rowmax(x·scale) (<= 0, finite; the
    mask is not applied, so every element is a real exp)"""
    z = inp["x"] * np.float32(case.scale)
    z -= z.max(-1, keepdims=True)
    return np.ascontiguousarray(z, dtype=np.float32)


def build_exp_floor(case, inp, isa):
    """cpufuse's own exp pass alone over the softmax's R×C elements: lib.cf_exp_f32__<isa>(n, x, y),
    one cffi call (GIL released), into a preallocated y. Checked here against np.exp in float64."""
    if case.op != "softmax":
        raise Unavailable("softmax rows only", quiet=True)
    from cpufuse import _backend, _registry
    fn = _registry.table("exp").get(isa)
    if fn is None:
        raise Unavailable(f"no cf_exp_f32__{isa} in the native extension")
    z = exp_floor_input(case, inp)
    y = np.empty_like(z)
    ffi = _backend.ffi
    call = functools.partial(fn, z.size, ffi.from_buffer("float[]", z), ffi.from_buffer("float[]", y))
    call()
    e = ref.nmse(np.exp(z.astype(np.float64)), y)
    if not e <= 1e-10:
        raise ValueError(f"cf_exp_f32__{isa} disagrees with np.exp: NMSE {e:.3g}")
    return call, lambda: (call(), y)[1]


def _best_simd():
    return next((i for i in cpufuse.available_isas() if i in SIMD_ISAS), None)


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str               # user | cpufuse | peer | baseline (timed, not checked: matmul-only runs)
    isa: str = None         # cpufuse ISA (None for user/peer)
    fused: bool = True
    tol: float = 1e-10      # NMSE limit against the float64 reference
    nth: int = 1            # threads: 1, or threads.ALL (every core of the affinity set)
    strategy: str = None    # flash_attn strategy (None: auto)
    max_call_s: float = None  # not timed when one call takes longer than this


def all_core_name(name):
    return f"{name} ×{threads.n_all}"


def variants(peers=False, all_core=False):
    """The columns, in table order, for this machine (unavailable ISAs are left out here;
    peers that fail to load are reported as skipped). all_core adds the best SIMD ISA on every
    core (n_threads = the affinity set's size)."""
    avail = cpufuse.available_isas()
    vs = [Variant("numpy", "user", tol=1e-6)]
    if "numba" in avail:
        vs.append(Variant("numba", "cpufuse", "numba"))
    if "scalar" in avail:
        vs.append(Variant("scalar", "cpufuse", "scalar"))
    b = _best_simd()
    if b:
        vs.append(Variant(f"{b} unfused", "cpufuse", b, fused=False))
    for isa in SIMD_ISAS:
        if isa in avail:
            vs.append(Variant(isa, "cpufuse", isa))
    if peers:
        vs += [Variant(p, "peer", tol=1e-6) for p in ("torch", "onnxruntime", "ggml")]
    if all_core and b:
        vs.append(Variant(all_core_name(b), "cpufuse", b, nth=threads.ALL))
    return vs


def unavailable_isas():
    """{isa: reason} for the cpufuse ISAs that get no column here (reason from cpufuse itself)."""
    out = {}
    for isa in cpufuse.ALL_ISAS:
        if isa in cpufuse.available_isas():
            continue
        try:
            cpufuse.softmax(np.zeros((1, 1), np.float32), isa=isa)
            out[isa] = "not listed by cpufuse.available_isas()"
        except ValueError as e:
            out[isa] = str(e)
    return out


def builder(v):
    if v.kind == "user":
        return build_numpy
    if v.kind == "cpufuse":
        return build_cpufuse(v.isa, v.fused, threads.resolve(v.nth))
    return build_peer(v.name)


# ------------------------------------------------------------------------------------------------
# Checking

def check(case, v, got, want, tol=None):
    """NMSE of each output against the float64 reference; (ok, nmse)."""
    tol = v.tol if tol is None else tol
    if getattr(case, "op", None) == "add_rms_norm":
        pairs = list(zip(got, want))
    else:
        pairs = [(got, want)]
    worst = 0.0
    for g, w in pairs:
        g = np.asarray(g)
        if g.shape != np.shape(w) or not np.all(np.isfinite(g)):
            return False, float("inf")
        worst = max(worst, ref.nmse(w, g))
    return worst <= tol, worst


# ------------------------------------------------------------------------------------------------
# Sections: each gives its cases, its columns, and how to build / check / measure one of them

class OpsSection:
    key, title = "ops", "softmax / rms_norm"

    def __init__(self, peers, all_core):
        self.vlist = variants(peers, all_core)
        b = _best_simd()
        if b:  # the softmax rows' exp floor, timed in the same rounds (the fused SIMD ISA's exp)
            self.vlist.append(Variant(EXP_FLOOR, "baseline", b))

    def cases(self, a):
        return [c for c in CASES if (not a.quick or c.quick)]

    def inputs(self, case):
        return make_inputs(case)

    def reference(self, case, inp):
        return reference(case, inp)

    def build(self, case, v, inp):
        if v.kind == "baseline":
            return build_exp_floor(case, inp, v.isa)
        return builder(v)(case, inp)

    def tol(self, case, v):
        return v.tol, None

    def work(self, case, inp):
        return {"bytes": min_bytes(case, inp)}

    def annotate(self, case, r, work):
        r["median_us"] = r["median_ns"] / 1e3
        r["gbps"] = work["bytes"] / r["median_ns"]


def _peer(case, v, inp):
    from . import peers
    res, why = peers.PEERS[v.name](case, inp)
    if res is None:
        raise Unavailable(why)
    return res


class AttnSection:
    key, title = "attention", "flash attention"
    STRATS = ("rows", "split", "tiled")

    def __init__(self, peers, all_core):
        avail = cpufuse.available_isas()
        b = _best_simd()
        vs = [Variant("numpy", "user", tol=1e-6)]
        for isa in ("numba", "scalar"):
            if isa in avail:
                vs.append(Variant(isa, "cpufuse", isa, max_call_s=2.0))
        if b:
            vs.append(Variant(f"{b} unfused", "cpufuse", b, fused=False))
        for isa in SIMD_ISAS:
            if isa in avail:
                vs.append(Variant(isa, "cpufuse", isa))
        if b:
            vs += [Variant(f"{b} {s}", "cpufuse", b, strategy=s) for s in self.STRATS]
        if peers:
            vs += [Variant(p, "peer", tol=1e-6) for p in ("torch", "ggml")]
        if all_core and b:
            vs.append(Variant(all_core_name(b), "cpufuse", b, nth=threads.ALL))
        if b:  # the FMA peak timed in the prefill case's own rounds: % of peak under the same conditions
            vs.append(Variant(self.PROBE, "baseline", b))
        self.vlist = vs
        self.probe_flops = {}

    PROBE = "FMA peak probe"

    def cases(self, a):
        return [c for c in attn.CASES if (not a.quick or c.quick)]

    def inputs(self, case):
        return attn.make_inputs(case)

    def reference(self, case, inp):
        return attn.reference(case, inp)

    def build(self, case, v, inp):
        if v.kind == "peer":
            return _peer(case, v, inp)
        if v.kind == "baseline":
            if case.kind != "prefill":
                raise Unavailable("timed only beside the prefill cases (their % of FMA peak)")
            fn, flops = threads.fma_probe(v.isa, seconds=0.002)
            if fn is None:
                raise Unavailable(f"no cf_fma_peak for {v.isa}")
            self.probe_flops[case.name] = flops
            return fn, fn
        try:
            return attn.build(case, v, inp, threads.resolve(v.nth))
        except LookupError as e:
            raise Unavailable(str(e)) from None

    def tol(self, case, v):
        return attn.peer_tol(case, v) if v.kind == "peer" else (v.tol, None)

    def work(self, case, inp):
        return attn.work(case, inp)

    def annotate(self, case, r, work):
        r["median_us"] = r["median_ns"] / 1e3
        if r["kind"] == "baseline":  # the FMA peak probe
            r["gflops"] = self.probe_flops[case.name] / r["median_ns"]
            return
        r["gbps"] = work["bytes"] / r["median_ns"]
        r["gflops"] = work["flops"] / r["median_ns"]


class GraphSection:
    key, title = "graph", "llama decoder block"
    settle_s = 0.2  # after an all-core column, let OpenBLAS's spinning workers sleep (threads.settle_s)

    def __init__(self, peers, all_core):
        b = cpufuse.available_isas()[0]
        self.isa = b
        vs = [Variant("numpy", "user", tol=1e-6),
              Variant("plan unfused", "cpufuse", b, fused=False),
              Variant("plan fused", "cpufuse", b)]
        if all_core:
            vs.append(Variant(all_core_name("plan fused"), "cpufuse", b, nth=threads.ALL))
        vs += [Variant("matmuls plan", "baseline", b), Variant("matmuls numpy", "baseline")]
        if all_core:
            vs.append(Variant(all_core_name("matmuls plan"), "baseline", b, nth=threads.ALL))
        self.vlist = vs

    def cases(self, a):
        return [c for c in graphbench.CASES if (not a.quick or c.quick) and not (c.big and a.no_big)]

    def inputs(self, case):
        return graphbench.make_inputs(case)

    def reference(self, case, inp):
        return graphbench.reference(case, inp)

    def build(self, case, v, inp):
        try:
            return graphbench.build(case, v, inp, threads.resolve(v.nth))
        except LookupError as e:
            raise Unavailable(str(e)) from None

    def tol(self, case, v):
        return v.tol, None

    def work(self, case, inp):
        return graphbench.work(case, inp)

    def annotate(self, case, r, work):
        r["median_us"] = r["median_ns"] / 1e3


class DispatchSection:
    key, title = "dispatch", "per-node plan overhead"

    def __init__(self, peers, all_core):
        b = cpufuse.available_isas()[0]
        self.vlist = [Variant("plan fused", "cpufuse", b), Variant("plan unfused", "cpufuse", b, fused=False),
                      Variant("Python per-op", "user", tol=1e-10)]

    def cases(self, a):
        return list(graphbench.DISPATCH_CASES)

    def inputs(self, case):
        return graphbench.dispatch_inputs(case)

    def reference(self, case, inp):
        return graphbench.dispatch_reference(case, inp)

    def build(self, case, v, inp):
        return graphbench.dispatch_build(case, v, inp, threads.resolve(v.nth))

    def tol(self, case, v):
        return v.tol, None

    def work(self, case, inp):
        return {"nodes": case.n_nodes}

    def annotate(self, case, r, work):
        r["median_us"] = r["median_ns"] / 1e3
        r["ns_per_node"] = r["median_ns"] / case.n_nodes
        if r["kind"] == "cpufuse":
            r["kernel_calls"] = graphbench.dispatch_kernel_calls(case, r["fused"])
        else:
            r["kernel_calls"] = case.n_nodes if case.chain == "scale_add" else case.n_nodes // 2
        r["ns_per_call"] = r["median_ns"] / r["kernel_calls"]


SECTIONS = {"ops": OpsSection, "attention": AttnSection, "graph": GraphSection, "dispatch": DispatchSection}


# ------------------------------------------------------------------------------------------------
# Preparing and timing a case

def prepare(section, case, vlist, log):
    """Build and check every variant for one case: (work, results, {variant: fn}, {variant: pre})."""
    inp = section.inputs(case)
    want = section.reference(case, inp)
    fns, pre, res = {}, {}, {}
    for v in vlist:
        r = res[v.name] = {"kind": v.kind, "isa": v.isa, "fused": v.fused, "strategy": v.strategy,
                           "n_threads": threads.resolve(v.nth), "status": "ok"}
        threads.enter(v.nth)
        try:
            fn, get = section.build(case, v, inp)
            t0 = time.perf_counter()
            got = get()
            dt = time.perf_counter() - t0
            if v.max_call_s and dt > v.max_call_s:  # maybe a JIT compile: one more call decides
                t0 = time.perf_counter()
                got = get()
                dt = min(dt, time.perf_counter() - t0)
            if v.kind == "baseline":
                ok, err, tol, note = True, None, None, None
            else:
                tol, note = section.tol(case, v)
                ok, err = check(case, v, got, want, tol)
        except Unavailable as e:
            r.update(status="skipped", reason=str(e))
            if e.quiet:
                r["quiet"] = True
            continue
        except Exception as e:  # a crashing variant is a loud failure, not the end of the run
            r.update(status="error", reason=f"{type(e).__name__}: {e}")
            log(f"!!! {case.name} / {v.name}: ERROR {r['reason']}")
            continue
        finally:
            got = None
        r["nmse"] = err
        if note:
            r["tol"], r["tol_note"] = tol, note
        if not ok:
            r.update(status="failed", reason=f"NMSE {err:.3g} > {tol:g}")
            log(f"!!! {case.name} / {v.name}: FAILED CHECK, NMSE {err:.3g} > {tol:g}; not timed")
            continue
        if v.max_call_s and dt > v.max_call_s:
            r.update(status="skipped", reason=f"too slow to time: one call took {dt:.1f} s (> {v.max_call_s:g} s)",
                     one_call_s=dt)
            continue
        fns[v.name] = fn
        pre[v.name] = functools.partial(threads.enter, v.nth)
    return section.work(case, inp), res, fns, pre


def run_cases(section, group, vlist, target_s, rounds, log):
    """Time one case, or a group of cases (same `group`) interleaved together, so that rows meant
    to be compared with each other (alloc vs out=) see the same machine conditions."""
    vlist_nth = {v.name: v.nth for v in vlist}
    threads.settle_s[0] = getattr(section, "settle_s", 0.0)
    prepared = [prepare(section, c, vlist, log) for c in group]
    fns = {(i, k): fn for i, (_, _, f, _) in enumerate(prepared) for k, fn in f.items()}
    pre = {(i, k): p for i, (_, _, _, pp) in enumerate(prepared) for k, p in pp.items()}
    # each variant gets ~target_s of calls (>= one per round), interleaved over the rounds
    blocks = {key: ("1" if vlist_nth[key[1]] == 1 else "n") for key in fns}
    threads.settle_s[0] = getattr(section, "settle_s", 0.0)
    timed = timing.measure(fns, target_s=target_s, rounds=rounds, per_call=group[0].mode != "kernel", pre=pre,
                           blocks=blocks)
    threads.settle_s[0] = 0.0
    for (i, k), tr in timed.items():
        work, res, _, _ = prepared[i]
        res[k].update(tr)
        section.annotate(group[i], res[k], work)
    return [(c, work, res) for c, (work, res, _, _) in zip(group, prepared)]


# ------------------------------------------------------------------------------------------------
# Derived numbers

def _times(res):
    return {k: r["median_ns"] for k, r in res.items() if r.get("median_ns") and r.get("status") == "ok"}


def _all_core(res):
    """(name, result) of the all-core column, if it ran"""
    for k, r in res.items():
        if r.get("n_threads", 1) > 1 and r.get("median_ns") and r["kind"] == "cpufuse":
            return k, r
    return None, None


def derived(case, res, env):
    """Ratios for one ops case from {variant: result dict} (median_ns of variants that ran)."""
    copy_bw = env["copy_bw"]
    t = _times(res)
    one = {k: v for k, v in t.items() if res[k].get("n_threads", 1) == 1}
    simd = {k: t[k] for k in SIMD_ISAS if k in one}
    cf = {k: one[k] for k in one if res[k]["kind"] == "cpufuse"}
    d = {}
    if simd:
        best_simd = min(simd, key=simd.get)
        d["best_simd"] = best_simd
        if "scalar" in t:
            d["vector_gain"] = t["scalar"] / simd[best_simd]
    b = _best_simd()
    if b and f"{b} unfused" in t and b in t:
        d["fusion_gain"] = t[f"{b} unfused"] / t[b]
    if cf:
        best = min(cf, key=cf.get)
        d["best_cpufuse"] = best
        d["best_cpufuse_us"] = cf[best] / 1e3
        d["best_cpufuse_gbps"] = res[best]["gbps"]
        if "numpy" in t:
            d["user_gain"] = t["numpy"] / cf[best]
        d["pct_dram_copy"] = 100 * res[best]["gbps"] / copy_bw["dram"]["gbps"]
        d["pct_l2_copy"] = 100 * res[best]["gbps"] / copy_bw["l2"]["gbps"]
        for p in ("torch", "onnxruntime", "ggml"):
            if p in t:
                d[f"{p}_over_cpufuse"] = t[p] / cf[best]
        ef = res.get(EXP_FLOOR, {})
        if getattr(case, "op", None) == "softmax" and ef.get("status") == "ok" and ef.get("median_ns"):
            d["exp_floor_us"] = ef["median_ns"] / 1e3
            d["softmax_over_exp_floor"] = cf[best] / ef["median_ns"]
        k, r = _all_core(res)
        if k:
            d["all_core"] = k
            d["all_core_us"] = r["median_ns"] / 1e3
            d["all_core_gbps"] = r["gbps"]
            d["all_core_speedup"] = cf[best] / r["median_ns"]
            if "dram_all" in copy_bw:
                d["pct_dram_copy_all"] = 100 * r["gbps"] / copy_bw["dram_all"]["gbps"]
    return d


def derived_attn(case, res, env):
    copy_bw, peak = env["copy_bw"], env["fma_peak"]
    t = _times(res)
    one = {k: v for k, v in t.items() if res[k].get("n_threads", 1) == 1}
    cf = {k: v for k, v in one.items() if res[k]["kind"] == "cpufuse"}
    d = {"kind": case.kind, "strategy_auto": cpufuse.ops.attention.choose_strategy(case.N, case.T)}
    b = _best_simd()
    if cf:
        best = min(cf, key=cf.get)
        r = res[best]
        d.update(best_cpufuse=best, best_cpufuse_us=cf[best] / 1e3, best_cpufuse_gbps=r["gbps"],
                 best_cpufuse_gflops=r["gflops"])
        d["pct_dram_copy"] = 100 * r["gbps"] / copy_bw["dram"]["gbps"]
        if peak.get("gflops_1"):
            d["pct_fma_peak"] = 100 * r["gflops"] / peak["gflops_1"]
        pr = res.get(AttnSection.PROBE, {})
        if pr.get("status") == "ok" and pr.get("gflops"):  # same rounds, same statistic (medians)
            d["probe_gflops"] = pr["gflops"]
            d["pct_probe_peak"] = 100 * r["gflops"] / pr["gflops"]
        if "numpy" in t:
            d["user_gain"] = t["numpy"] / cf[best]
        for p in ("torch", "ggml"):
            if p in t:
                d[f"{p}_over_cpufuse"] = t[p] / cf[best]
        k, ra = _all_core(res)
        if k:
            d.update(all_core=k, all_core_us=ra["median_ns"] / 1e3, all_core_gbps=ra["gbps"],
                     all_core_gflops=ra["gflops"], all_core_speedup=cf[best] / ra["median_ns"])
            if "dram_all" in copy_bw:
                d["pct_dram_copy_all"] = 100 * ra["gbps"] / copy_bw["dram_all"]["gbps"]
            if peak.get("gflops_all"):
                d["pct_fma_peak_all"] = 100 * ra["gflops"] / peak["gflops_all"]
    if b:
        strat = {s: t[f"{b} {s}"] for s in AttnSection.STRATS if f"{b} {s}" in t}
        if strat:
            d["fastest_strategy"] = min(strat, key=strat.get)
            d["strategy_us"] = {s: v / 1e3 for s, v in strat.items()}
            if b in t:
                d["auto_over_fastest_strategy"] = t[b] / strat[d["fastest_strategy"]]
        if f"{b} unfused" in t and b in t:
            d["fusion_gain"] = t[f"{b} unfused"] / t[b]
        if "scalar" in t and b in t:
            d["vector_gain"] = t["scalar"] / t[b]
    return d


def derived_graph(case, res, env):
    t = _times(res)
    d = {"matmul_gflop": graphbench.matmul_flops(case) / 1e9}
    base1 = t.get("matmuls plan")
    basen = t.get("matmuls numpy")
    basea = next((v for k, v in t.items() if k.startswith("matmuls plan ×")), None)
    shares = {}
    for k, v in t.items():
        r = res[k]
        if r["kind"] == "baseline":
            continue
        mm = basen if k == "numpy" else (basea if r["n_threads"] > 1 else base1)
        if mm:
            shares[k] = (v - mm) / v
    d["non_matmul_share"] = shares
    if base1:
        d["matmul_plan_gflops"] = graphbench.matmul_flops(case) / base1
    if "plan unfused" in t and "plan fused" in t:
        d["fusion_gain"] = t["plan unfused"] / t["plan fused"]
    if "numpy" in t and "plan fused" in t:
        d["user_gain"] = t["numpy"] / t["plan fused"]
    k, ra = _all_core(res)
    if k and "plan fused" in t:
        d["all_core_speedup"] = t["plan fused"] / ra["median_ns"]
    return d


def derived_dispatch(case, res, env):
    t = _times(res)
    d = {}
    if "plan fused" in t and "Python per-op" in t:
        d["python_over_plan"] = t["Python per-op"] / t["plan fused"]
    return d


DERIVED = {"ops": derived, "attention": derived_attn, "graph": derived_graph, "dispatch": derived_dispatch}


# ------------------------------------------------------------------------------------------------
# Probes and progress

def _add_peak(peak, isa, all_core):
    """one more FMA peak measurement (start or end of the run); the peak = the best run of all"""
    for key, n in (("1", 1), ("all", threads.n_all)):
        if key == "all" and not all_core:
            continue
        st = threads.fma_peak_stats(isa, n)
        if st is not None:
            runs = peak.setdefault(f"runs_{key}", [])
            runs.append(st)
            peak[f"gflops_{key}"] = max(x["best"] for x in runs)
        st = threads.int8_peak_stats(isa, n)   # the int8 dot peak (cf_int8_peak), G multiply-adds/s
        if st is not None:
            peak[f"int8_gmacs_{key}"] = max(st["best"], peak.get(f"int8_gmacs_{key}", 0.0))


def sample_probes(copiers, settle_s=0.0):
    """one sampling point of every copy probe, after a case: first, after an all-core column, let
    OpenBLAS's spinning workers sleep (settle_s), so that they do not share the probe's core"""
    threads.settle_s[0] = settle_s
    threads.enter(1)
    threads.settle_s[0] = 0.0
    for c in copiers.values():
        c.sample()


def probe_check(report):
    """Sanity checks of the probes every ratio leans on: a list of warnings (empty: ok)."""
    cb, w = report.get("copy_bw", {}), []
    dram, l2 = cb.get("dram"), cb.get("l2")
    if dram and l2 and not l2["gbps"] > dram["gbps"]:
        w.append(f"the L2 copy probe ({l2['gbps']:.1f} GB/s) does not exceed the DRAM copy probe "
                 f"({dram['gbps']:.1f} GB/s): the % copy ratios of this run are not to be trusted")
    for k, r in cb.items():
        fast = r.get("p90_gbps")
        if fast and r["gbps"] < 0.8 * fast:
            w.append(f"{k} copy probe: median {r['gbps']:.1f} GB/s < 80% of its fast decile {fast:.1f} GB/s "
                     f"(slow decile {r['p10_gbps']:.1f}): many samples disturbed, other load?")
    pk = report.get("fma_peak") or {}
    for key, what in (("1", "1 thread"), ("all", "all cores")):
        runs = pk.get(f"runs_{key}")
        if runs:
            best, med = max(x["best"] for x in runs), max(x["median"] for x in runs)
            if med < 0.8 * best:
                w.append(f"FMA peak probe ({what}): median run {med:.1f} GFLOP/s < 80% of the best {best:.1f} "
                         "(the peak is the best run; many runs disturbed, other load?)")
    n = (report.get("machine") or {}).get("threads", {}).get("n_all", 1)
    if pk.get("gflops_1") and pk.get("gflops_all") and n > 1 and pk["gflops_all"] < 0.75 * n * pk["gflops_1"]:
        w.append(f"all-core FMA peak {pk['gflops_all']:.1f} GFLOP/s is only {pk['gflops_all'] / pk['gflops_1']:.2f}× "
                 f"the 1-thread peak on {n} cores: the cores are shared with other work")
    busy = [(when, report.get(k)) for when, k in (("start", "busy_cores_start"), ("end", "busy_cores_end"))
            if report.get(k) is not None]
    for when, b in busy:
        if b > 0.25:
            w.append(f"other work kept {b:.2f} cores busy at the {when} (measured while the benchmark slept): "
                     "other processes share the cores")
    return w


def _fmt_s(sec):
    return f"{sec:.0f} s" if sec < 90 else f"{sec / 60:.0f} min"


class Progress:
    """Progress on stderr: the group of cases being run, and the time left. Cost model: variants ×
    cases × (target + 0.1 s) per group, rescaled by how long the finished groups took against it."""

    def __init__(self, groups, log):
        self.w = [nv * len(g) * (target + 0.1) for nv, g, target in groups]
        self.log, self.i, self.t0 = log, 0, time.perf_counter()

    def eta(self):
        done, left = sum(self.w[:self.i]), sum(self.w[self.i:])
        return left * ((time.perf_counter() - self.t0) / done if done else 1.5)

    def start(self, section, group):
        names = ", ".join(c.name for c in group)
        self.log(f"[{self.i + 1}/{len(self.w)}] {section}: {names} · {_fmt_s(time.perf_counter() - self.t0)} "
                 f"elapsed, ~{_fmt_s(self.eta())} left")

    def done(self):
        self.i += 1


# ------------------------------------------------------------------------------------------------
# Reporting

def machine_info(peers):
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=5).stdout.strip())
    except Exception:
        commit, dirty = None, None
    try:
        import numba
        numba_v = numba.__version__
    except Exception:
        numba_v = None
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "cpu_model": cpu,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "numba": numba_v,
        "affinity": threads.ALL_CORES,
        "threads": threads.describe(),
        "os_cpu_count": os.cpu_count(),
        "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "openblas_env": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ},
        "git_commit": commit,
        "git_dirty": dirty,
        "cpufuse": cpufuse.info(),
    }
    if peers:
        from . import peers as P
        info["peers"] = {p: {"version": P.PEER_VERSIONS[p](), "unavailable": why}
                         for p, why in P.availability().items()}
    return info


def _fmt_us(us):
    if us is None:
        return "–"
    return f"{us:.2f}" if us < 10 else f"{us:,.0f}" if us >= 1000 else f"{us:.1f}"


def _fmt_ms(us):
    if us is None:
        return "–"
    ms = us / 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:,.0f}"


def _fmt_load(v):
    return "?" if not v else f"{v[0]:.2f}"


def _fmt_busy(v):
    return "?" if v is None else f"{v:.2f}"


def _fmt_x(v):
    return "–" if v is None else f"{v:.2f}×"


def _fmt_pct(v):
    return "–" if v is None else f"{v:.0f}%"


def _fmt_g(v):
    return "–" if v is None else f"{v:.1f}"


def _time_table(entries, cols, fmt=_fmt_us, key="median_us"):
    lines = ["| case | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for c in entries:
        t = {k: r.get(key) for k, r in c["results"].items() if r.get("status") == "ok" and r["kind"] != "baseline"}
        best = min((v for v in t.values() if v), default=None)
        cells = []
        for k in cols:
            r = c["results"].get(k, {})
            if r.get("status") == "ok":
                s = fmt(r.get(key))
                cells.append(f"**{s}**" if r.get(key) == best else s)
            elif r.get("quiet"):
                cells.append("")
            else:
                cells.append({"skipped": "n/a", "failed": "FAIL", "error": "ERR"}.get(r.get("status"), "–"))
        lines.append(f"| {c['case']['name']} | " + " | ".join(cells) + " |")
    return lines


def _notes(entries, extra=()):
    notes = list(extra)
    for c in entries:
        for k, r in c["results"].items():
            if r.get("status") in ("failed", "error"):
                notes.append(f"- **{r['status'].upper()}** {c['case']['name']} / {k}: {r['reason']}")
            if r.get("tol_note"):
                notes.append(f"- {c['case']['name']} / {k}: {r['tol_note']} (NMSE {r['nmse']:.2g})")
    skipped = {}
    for c in entries:
        for k, r in c["results"].items():
            if r.get("status") == "skipped" and not r.get("quiet"):
                skipped.setdefault((k, r["reason"]), []).append(c["case"]["name"])
    for (k, why), names in skipped.items():
        where = "all cases" if len(names) == len(entries) else ", ".join(names)
        notes.append(f"- skipped {k} ({where}): {why}")
    return ["", "Notes:", ""] + notes if notes else []


def _spread(r):
    return f"[{r['p10_gbps']:.1f}–{r['p90_gbps']:.1f}]" if "p10_gbps" in r else ""


def _header(report):
    m = report["machine"]
    cb = report["copy_bw"]
    thr = m["threads"]
    all_line = ""
    if "dram_all" in cb:
        d = cb["dram_all"]
        all_line = (f" All-core ({d['threads']} threads, np.copyto of disjoint slices at once): DRAM "
                    f"{d['gbps']:.1f} GB/s {_spread(d)}.")
    pk = report.get("fma_peak", {})
    peak = ""
    if pk.get("gflops_1"):
        runs = pk.get("runs_1") or [{}]
        peak = (f" FMA peak ({pk['isa']}, cf_fma_peak, best of {sum(x.get('runs', 0) for x in runs)} runs of "
                f"{runs[0].get('run_ms', 0):g} ms at the start and end): {pk['gflops_1']:.1f} GFLOP/s 1 thread"
                + (f", {pk['gflops_all']:.1f} GFLOP/s on {thr['n_all']} threads" if pk.get("gflops_all") else "") + "."
                + (f" int8 dot peak (cf_int8_peak): {pk['int8_gmacs_1']:.0f} GMAC/s 1 thread"
                   + (f", {pk['int8_gmacs_all']:.0f} on {thr['n_all']}" if pk.get("int8_gmacs_all") else "") + "."
                   if pk.get("int8_gmacs_1") else ""))
    mode = (f"1-thread columns pinned to core {thr['pin_core']}, all-core columns (×{thr['n_all']}) on "
            f"cores {thr['affinity']}" if report["all_core"] else
            f"1 thread only ({'affinity is one core' if thr['n_all'] == 1 else '--threads 1'})")
    dram, l2 = cb["dram"], cb["l2"]
    check = report.get("probe_check")
    if check is None:
        check_line = []
    elif not check:
        check_line = ["", "Probe check: ok (L2 copy > DRAM copy; every probe's median within 80% of its fast decile)."]
    else:
        check_line = ["", "**Probe check: flagged.** " + " · ".join(check)]
    return [
        "# cpufuse benchmark",
        "",
        f"{m['date']} · {m['cpu_model']} · {m['hostname']} · Python {m['python']} · numpy {m['numpy']} · "
        f"numba {m['numba']} · cpufuse {m['cpufuse']['version']} ({', '.join(m['cpufuse']['available_isas'])}) · "
        f"git {m['git_commit']}{' (dirty)' if m['git_dirty'] else ''} · affinity {m['affinity']}"
        f"{' · QUICK' if report['quick'] else ''} · {mode} · run took {report.get('runtime_s', 0):.0f} s",
        "",
        f"Copy bandwidth, 1 thread ({dram.get('how', 'np.copyto')}, counted as read + write; median of many short "
        f"samples spread over the run, [slow decile – fast decile]): DRAM {dram['gbps']:.1f} GB/s {_spread(dram)} "
        f"({dram.get('chunk', dram['bytes']) >> 20} MiB slices of a {dram['bytes'] >> 20} MiB array, "
        f"{dram['samples']} samples), L2 {l2['gbps']:.1f} GB/s {_spread(l2)} ({l2['bytes'] >> 10} KiB array, "
        f"{l2['samples']} samples of {l2['k']} copies"
        + (f"; the call's own {l2['call_overhead_ns']:.0f} ns ({l2['call_overhead_pct']:.1f}%) subtracted"
           if "call_overhead_ns" in l2 else "")
        + f").{all_line}{peak} Timer pair: {report['timer_overhead_ns']:.0f} ns. "
        f"Load average at start / end: {_fmt_load(m.get('loadavg_start'))} / {_fmt_load(report.get('loadavg_end'))}; "
        f"cores kept busy by other work at start / end: {_fmt_busy(report.get('busy_cores_start'))} / "
        f"{_fmt_busy(report.get('busy_cores_end'))}.",
    ] + check_line


def markdown_ops(report, sec):
    entries = sec["cases"]
    cols = [v["name"] for v in sec["variants"]]
    peer_cols = [p for p in ("torch", "onnxruntime", "ggml") if p in cols]
    allc = any(v["nth"] != 1 for v in sec["variants"])
    floor = any("softmax_over_exp_floor" in c["derived"] for c in entries)
    lines = [
        "",
        "## softmax / rms_norm",
        "",
        "Masks: `32×4096` = 32 new tokens at the end of a 4096-token context (row i masks keys j > 4064 + i); "
        "`4096×512` = 8 heads × 512 queries over 512 keys, flattened (row i masks keys j > i mod 512), f16. "
        "Kernel rows: back-to-back calls, cpufuse / onnxruntime / ggml write into preallocated outputs, numpy and "
        "torch allocate as users write them. Latency rows: each call timed on its own.",
        "",
        "Median time per call, µs (1 thread unless the column says ×N; **bold** = fastest in the row):",
        "",
    ] + _time_table(entries, cols)
    lines += [
        "",
        "Derived (best cpufuse = fastest 1-thread cpufuse column; GB/s = minimum bytes moved / median time):",
        "",
        "| case | MB moved | best cpufuse | GB/s | vector gain | fusion gain | user gain | % DRAM copy |"
        + (" exp floor µs | softmax ÷ exp floor |" if floor else "")
        + "".join(f" {p} / best |" for p in peer_cols)
        + (" all-core GB/s | all-core speedup | % all-core DRAM copy |" if allc else ""),
        "|---|---:|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if floor else "") + "---:|" * len(peer_cols)
        + ("---:|---:|---:|" if allc else ""),
    ]
    for c in entries:
        d = c["derived"]
        dram = c["case"].get("dram")
        pct = f"{d['pct_dram_copy']:.0f}%" if dram and "pct_dram_copy" in d else ""
        gb = f"{d['best_cpufuse_gbps']:.1f}" if "best_cpufuse_gbps" in d else "–"
        row = (f"| {c['case']['name']} | {c['work']['bytes'] / 1e6:.3g} | {d.get('best_cpufuse', '–')} | {gb} | "
               f"{_fmt_x(d.get('vector_gain'))} | {_fmt_x(d.get('fusion_gain'))} | {_fmt_x(d.get('user_gain'))} | {pct} |"
               + (f" {_fmt_us(d.get('exp_floor_us')) if 'exp_floor_us' in d else ''} | "
                  f"{_fmt_x(d.get('softmax_over_exp_floor')) if 'softmax_over_exp_floor' in d else ''} |" if floor else "")
               + "".join(f" {_fmt_x(d.get(f'{p}_over_cpufuse'))} |" for p in peer_cols))
        if allc:
            row += (f" {_fmt_g(d.get('all_core_gbps'))} | {_fmt_x(d.get('all_core_speedup'))} | "
                    f"{_fmt_pct(d.get('pct_dram_copy_all')) if dram else ''} |")
        lines.append(row)
    lines += [
        "",
        "vector gain = scalar fused / best SIMD fused · fusion gain = SIMD unfused / SIMD fused (same ISA) · "
        "user gain = numpy / best cpufuse" + (" · peer / best = peer time / best cpufuse time (> 1: cpufuse faster)"
                                             if peer_cols else "")
        + (" · all-core speedup = best 1-thread cpufuse / all-core column" if allc else ""),
    ]
    extra = []
    if floor:
        isa = next(v["isa"] for v in sec["variants"] if v["name"] == EXP_FLOOR)
        extra.append(f"- exp floor (softmax rows) = `cf_exp_f32__{isa}` alone over the row's R×C elements (one cffi "
                     "call, preallocated output), timed in the same interleaved rounds as the other columns; input "
                     "z = x·scale − rowmax(x·scale): the values the softmax exponentiates, all ≤ 0 and finite (the "
                     "mask is not applied, so no −inf). softmax ÷ exp floor = best 1-thread cpufuse softmax / exp "
                     "floor (1 = the softmax costs one exp pass).")
    err = report["machine"]["cpufuse"].get("native_load_error")
    if err:
        extra.append(f"- **WARNING: the cpufuse native extension did not load** ({err}); only numba runs")
    for isa, why in report.get("unavailable_isas", {}).items():
        extra.append(f"- no {isa} column: {why}")
    return lines + _notes(entries, extra)


def markdown_attn(report, sec):
    entries = sec["cases"]
    cols = [v["name"] for v in sec["variants"] if v["name"] != AttnSection.PROBE]
    allc = any(v["nth"] != 1 for v in sec["variants"])
    lines = [
        "",
        "## flash attention",
        "",
        f"q f32 (1, {attn.HQ}, N, {attn.D}), K/V (1, {attn.HKV}, T, {attn.D}) f16 or f32 (GQA {attn.HQ // attn.HKV}), "
        f"scale 1/√{attn.D}, out (1, N, {attn.HQ}, {attn.D}) preallocated for cpufuse. Decode: N = 1, no mask. "
        "Prefill: N = T = 512, causal f16 mask. numpy = `q @ kᵀ` per KV-head group (q heads reshaped "
        "(Hkv, G·N, D)), softmax, `@ v`, f16 K/V upcast with astype (as users write it; allocates). "
        "torch = `F.scaled_dot_product_attention(..., is_causal, enable_gqa=True)`, f16 K/V upcast with "
        "`.float()` inside the timed call. ggml = `ggml_flash_attn_ext`, 1 thread, graph prepared once. "
        "`<isa> rows / split / tiled` force cpufuse's strategy; the plain ISA column is the auto choice.",
        "",
        "Median time per call, µs (**bold** = fastest):",
        "",
    ] + _time_table(entries, cols)
    lines += [
        "",
        "Derived. Decode: GB/s = bytes of K + V / time (vs the 1-thread DRAM copy); prefill: GFLOP/s with "
        "flops = 4·D·Hq·(visible query–key pairs) = 4·D·Hq·T(T+1)/2 for causal N = T "
        "(causal fraction (T+1)/2T ≈ 0.5 of 4·N·T·D·Hq), vs the FMA peak. % FMA peak: against the run's "
        "best probe (start and end of the run); % adjacent peak: the median of the same probe timed in the prefill "
        "case's own interleaved rounds (same clock, same neighbours, same statistic as the kernel's median):",
        "",
        "| case | K+V MB | GFLOP | best 1-thread | GB/s | % DRAM copy | GFLOP/s | % FMA peak | % adjacent peak | auto → | fastest strategy "
        "| auto / fastest | fusion gain | vector gain | user gain | torch / best | ggml / best |"
        + (" all-core GB/s | % all-core copy | all-core GFLOP/s | % all-core peak | speedup |" if allc else ""),
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" * 5 if allc else ""),
    ]
    for c in entries:
        d = c["derived"]
        dec = d["kind"] == "decode"
        row = (f"| {c['case']['name']} | {c['work']['bytes'] / 1e6:.1f} | {c['work']['flops'] / 1e9:.3g} | "
               f"{d.get('best_cpufuse', '–')} | {_fmt_g(d.get('best_cpufuse_gbps')) if dec else ''} | "
               f"{_fmt_pct(d.get('pct_dram_copy')) if dec else ''} | {_fmt_g(d.get('best_cpufuse_gflops'))} | "
               f"{_fmt_pct(d.get('pct_fma_peak'))} | {_fmt_pct(d.get('pct_probe_peak'))} | {d['strategy_auto']} | {d.get('fastest_strategy', '–')} | "
               f"{_fmt_x(d.get('auto_over_fastest_strategy'))} | {_fmt_x(d.get('fusion_gain'))} | "
               f"{_fmt_x(d.get('vector_gain'))} | {_fmt_x(d.get('user_gain'))} | "
               f"{_fmt_x(d.get('torch_over_cpufuse'))} | {_fmt_x(d.get('ggml_over_cpufuse'))} |")
        if allc:
            row += (f" {_fmt_g(d.get('all_core_gbps')) if dec else ''} | {_fmt_pct(d.get('pct_dram_copy_all')) if dec else ''} | "
                    f"{_fmt_g(d.get('all_core_gflops'))} | {_fmt_pct(d.get('pct_fma_peak_all'))} | "
                    f"{_fmt_x(d.get('all_core_speedup'))} |")
        lines.append(row)
    lines += [
        "",
        "auto → = the strategy cpufuse picks (`choose_strategy`) · auto / fastest = auto column / fastest forced "
        "strategy (> 1: auto picked a slower one) · fusion gain = SIMD unfused / SIMD auto · vector gain = scalar / "
        "SIMD auto · user gain = numpy / best 1-thread cpufuse · peer / best > 1: cpufuse faster",
    ]
    return lines + _notes(entries)


def markdown_graph(report, sec):
    entries = sec["cases"]
    cols = [v["name"] for v in sec["variants"]]
    lines = [
        "",
        "## llama decoder block (graph)",
        "",
        "`bench/blocks.py` pre-norm block (rms_norm·w, q/k/v matmuls, KV-cache concat, flash_attn with causal "
        "f16 mask, o matmul, residual, rms_norm·w, SwiGLU FFN, residual), f32 weights and cache. "
        "plan = `build_graph(...).compile()` (fusion=False for unfused), `plan.run(n_threads=…)`; numpy = "
        "`blocks.numpy_block` (f32). matmuls = the block's 7 matmuls alone with the same shapes: as a cpufuse "
        "plan (C → numpy's OpenBLAS, as the block plan) and as `np.matmul(..., out=)`. The 1-thread columns "
        "limit OpenBLAS to 1 thread; the ×N columns give it N.",
        "",
        "Median time per block, ms (**bold** = fastest):",
        "",
    ] + _time_table(entries, cols, fmt=_fmt_ms)
    share_cols = [k for k in cols if not k.startswith("matmuls")]
    lines += [
        "",
        "Share of the block's time outside matmul = (block − matmuls) / block (numpy vs the numpy matmuls, plans "
        "vs the plan matmuls with the same thread count):",
        "",
        "| case | weights MB | matmul GFLOP | matmul GFLOP/s (plan, 1 thr) | " + " | ".join(
            f"non-matmul {k}" for k in share_cols) + " | fusion gain | user gain | all-core speedup |",
        "|---|---:|---:|---:|" + "---:|" * len(share_cols) + "---:|---:|---:|",
    ]
    for c in entries:
        d = c["derived"]
        sh = d.get("non_matmul_share", {})
        lines.append(
            f"| {c['case']['name']} | {c['work']['bytes'] / 1e6:.0f} | {d['matmul_gflop']:.3g} | "
            f"{_fmt_g(d.get('matmul_plan_gflops'))} | "
            + " | ".join(_fmt_pct(100 * sh[k]) if k in sh else "–" for k in share_cols)
            + f" | {_fmt_x(d.get('fusion_gain'))} | {_fmt_x(d.get('user_gain'))} | {_fmt_x(d.get('all_core_speedup'))} |")
    lines += ["", "fusion gain = plan unfused / plan fused · user gain = numpy / plan fused · all-core speedup = "
              "plan fused / plan fused ×N"]
    return lines + _notes(entries)


def markdown_dispatch(report, sec):
    entries = sec["cases"]
    cols = [v["name"] for v in sec["variants"]]
    lines = [
        "",
        "## per-node dispatch overhead",
        "",
        "A chain of tiny nodes compiled into one plan (one C call runs every kernel) vs the same chain as Python "
        "calls into preallocated buffers (numpy ufuncs `np.multiply/np.add(..., out=)` for scale/add; "
        "`cpufuse.rms_norm(x, w, out=)` for rms_norm·w, which the fused plan runs as 50 kernels). ns per graph "
        "node (per kernel call in brackets):",
        "",
        "| case | " + " | ".join(cols) + " | Python / plan fused |",
        "|---|" + "---:|" * (len(cols) + 1),
    ]
    for c in entries:
        cells = []
        for k in cols:
            r = c["results"].get(k, {})
            cells.append(f"{r['ns_per_node']:.0f} ({r['ns_per_call']:.0f})" if r.get("ns_per_node") else
                         {"skipped": "n/a", "failed": "FAIL", "error": "ERR"}.get(r.get("status"), "–"))
        lines.append(f"| {c['case']['name']} | " + " | ".join(cells)
                     + f" | {_fmt_x(c['derived'].get('python_over_plan'))} |")
    return lines + _notes(entries)


MARKDOWN = {"ops": markdown_ops, "attention": markdown_attn, "graph": markdown_graph, "dispatch": markdown_dispatch}

# the quantized-matmul section (bench/quant.py) adds itself to SECTIONS, DERIVED and MARKDOWN
from . import quant, smallcalls  # noqa: E402
quant.register(sys.modules[__name__])
smallcalls.register(sys.modules[__name__])  # the "calls" section: small calls vs np.add


HEADLINE_PEERS = ("numpy", "onnxruntime", "ggml", "torch")


def headline(report):
    """The first lines of the report: per peer, over every case where both ran on one thread, how
    often cpufuse's fastest variant beats the peer's fastest, and by how much (geometric mean,
    range)."""
    got = {}
    for sec in report["sections"].values():
        for e in sec["cases"]:
            res = e["results"]

            def best(pred):
                ts = [r["median_ns"] for k, r in res.items() if r.get("status") == "ok" and r.get("median_ns")
                      and r.get("n_threads", 1) == 1 and pred(k, r)]
                return min(ts) if ts else None
            cf = best(lambda k, r: r["kind"] == "cpufuse")
            if cf is None:
                continue
            for p in HEADLINE_PEERS:
                t = best(lambda k, r: r["kind"] in ("user", "peer") and (k == p or k.startswith(p + " ")))
                if t is not None:
                    got.setdefault(p, []).append((t / cf, e["case"]["name"] if isinstance(e["case"], dict)
                                                  else e["case"].name))
    lines = ["## Headline", "",
             "cpufuse's fastest 1-thread variant against each peer's, case by case (peer time ÷ cpufuse time: "
             "above 1× cpufuse is faster):", ""]
    for p in HEADLINE_PEERS:
        if p not in got:
            continue
        rs = got[p]
        gm = float(np.exp(np.mean(np.log([r for r, _ in rs]))))
        lo, hi = min(rs), max(rs)
        n_fast = sum(r > 1 for r, _ in rs)
        lines.append(f"- **{p}**: cpufuse is faster in {n_fast} of {len(rs)} cases, "
                     f"{'faster' if gm >= 1 else 'slower'} by {gm if gm >= 1 else 1 / gm:.1f}× on geometric mean "
                     f"(from {lo[0]:.2f}× on {lo[1]} to {hi[0]:.1f}× on {hi[1]}).")
    missing = [p for p in HEADLINE_PEERS[1:] if p not in got]
    if missing:
        lines.append(f"- {', '.join(missing)}: not in this run (`make bench-peers` adds them).")
    return lines + [""]


def markdown(report):
    lines = headline(report) + _header(report)
    for key in SECTIONS:
        if key in report["sections"]:
            lines += MARKDOWN[key](report, report["sections"][key])
    notes = []
    if report["threads_note"]:
        notes.append(f"- {report['threads_note']}")
    if notes:
        lines += ["", "## Run notes", ""] + notes
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short timings, fewer cases (smoke run, ~1 min)")
    ap.add_argument("--peers", action="store_true", help="add PyTorch, onnxruntime and ggml columns")
    ap.add_argument("--json", metavar="PATH", help="write the full results as JSON")
    ap.add_argument("--md", metavar="PATH", help="write the markdown tables")
    ap.add_argument("--plot", metavar="PATH", help="write the chart (PNG, matplotlib) here; default with --json "
                                                   "or --md: beside the markdown (or JSON), .png")
    ap.add_argument("--only", metavar="SUBSTR", action="append", help="run only cases whose name contains this")
    ap.add_argument("--section", action="append", choices=list(SECTIONS),
                    help="run only this section (repeatable; default: all)")
    ap.add_argument("--threads", choices=("auto", "1", "both"), default="auto",
                    help="1: 1-thread columns only; both: also the all-core columns; auto (default): both when "
                         "the process may use more than one core")
    ap.add_argument("--pin-core", type=int, default=None, help="core for the 1-thread columns (default: the first)")
    ap.add_argument("--no-big", action="store_true", help="skip the Llama-7B block cases (~810 MB of weights)")
    ap.add_argument("--target", type=float, default=None, help="seconds of timing per variant and case")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per case (overrides per-case)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if a.pin_core is not None:
        threads.set_pin_core(a.pin_core)
    threads_note = None
    all_core = a.threads in ("auto", "both") and threads.n_all > 1
    if a.threads == "both" and threads.n_all == 1:
        threads_note = ("all-core columns skipped: this process may run on one core only "
                        f"(affinity {threads.ALL_CORES}); run without taskset for them")
    elif a.threads != "1" and threads.n_all == 1:
        threads_note = "1-thread columns only: the process affinity is one core (run unpinned for the all-core columns)"
    target = a.target if a.target is not None else (0.03 if a.quick else 0.6)
    rounds = a.rounds if a.rounds is not None else (3 if a.quick else 15)
    keys = [k for k in SECTIONS if not a.section or k in a.section]
    machine = machine_info(a.peers)
    if a.peers:
        for p, d in machine["peers"].items():
            if d["unavailable"]:
                log(f"peer {p} skipped: {d['unavailable']}")
    if machine["cpufuse"]["native_load_error"]:
        log(f"!!! cpufuse native extension failed to load: {machine['cpufuse']['native_load_error']}")
    busy_start = threads.busy_cores()
    sections = {k: SECTIONS[k](a.peers, all_core) for k in keys}
    log(f"cpufuse ISAs {', '.join(cpufuse.available_isas())}; affinity {threads.ALL_CORES}; "
        f"{'1-thread pinned to core %s + all-core x%d' % (threads.pin_core(), threads.n_all) if all_core else '1 thread'}")

    # the probes (bench/README.md, "Probes"): copy bandwidth sampled at the start and after every
    # case (many ~50 µs samples each time; medians over all of them), FMA peak at start and end
    pin1 = functools.partial(threads.enter, 1)
    copiers = {"dram": timing.CopyBandwidth(256 << 20, chunk=4 << 20, per_sample_s=0.02, pre=pin1),
               "l2": timing.CopyBandwidth(256 << 10, pre=pin1)}
    if all_core:
        copiers["dram_all"] = threads.ParallelCopyBandwidth(256 << 20, threads.n_all)
    for c in copiers.values():
        c.sample(3 if a.quick else 7)
    copy_bw = {k: c.result() for k, c in copiers.items()}
    log("copy bandwidth at start (median [slow decile – fast decile]): " + ", ".join(
        f"{k} {v['gbps']:.1f} [{v['p10_gbps']:.1f}–{v['p90_gbps']:.1f}] GB/s" for k, v in copy_bw.items()))
    b = _best_simd()
    peak = {"isa": b}
    if b and "attention" in keys:
        _add_peak(peak, b, all_core)
        log(f"FMA peak {b}: {_fmt_g(peak.get('gflops_1'))} GFLOP/s 1 thread"
            + (f", {_fmt_g(peak.get('gflops_all'))} on {threads.n_all}" if all_core else ""))
    report = {"quick": a.quick, "peers": a.peers, "all_core": all_core, "threads_note": threads_note,
              "machine": machine, "unavailable_isas": unavailable_isas(), "copy_bw": copy_bw, "fma_peak": peak,
              "timer_overhead_ns": timing.timer_overhead_ns(), "target_s": target, "rounds": rounds,
              "busy_cores_start": busy_start,
              "eps": EPS, "sections": {}}
    plan = {}
    for key, sec in sections.items():
        groups = []
        for case in sec.cases(a):
            if a.only and not any(s in case.name for s in a.only):
                continue
            if groups and case.group and groups[-1][0].group == case.group:
                groups[-1].append(case)
            else:
                groups.append([case])
        plan[key] = groups
    progress = Progress([(len(sec.vlist), g, target) for key, sec in sections.items() for g in plan[key]], log)
    for key, sec in sections.items():
        groups = plan[key]
        if not groups:
            continue
        log(f"== {sec.title}: variants {', '.join(v.name for v in sec.vlist)}")
        entries = []
        for group in groups:
            r = a.rounds if a.rounds is not None else min(rounds, getattr(group[0], "rounds", None) or rounds)
            progress.start(sec.key, group)
            t0 = time.perf_counter()
            for case, work, res in run_cases(sec, group, sec.vlist, target, r, log):
                entries.append({"case": case, "work": work, "results": res})
                log(f"{case.name} ({time.perf_counter() - t0:.0f} s): "
                    + ", ".join(f"{k} {r['median_us']:.4g}" for k, r in res.items() if "median_us" in r))
            sample_probes(copiers, getattr(sec, "settle_s", 0.0))
            progress.done()
        if key == "graph":
            graphbench.release()
        report["sections"][key] = {"title": sec.title, "variants": [asdict(v) for v in sec.vlist], "cases": entries}
    if b and "attention" in keys:  # best of the start and end probes
        _add_peak(peak, b, all_core)
    threads.enter(1)
    report["copy_bw"] = copy_bw = {k: c.result() for k, c in copiers.items()}
    for c in copiers.values():
        c.release()
    env = {"copy_bw": copy_bw, "fma_peak": peak}
    for key, sec in report["sections"].items():
        for entry in sec["cases"]:
            entry["derived"] = DERIVED[key](entry["case"], entry["results"], env)
            entry["case"] = asdict(entry["case"])
    if "ops" in report["sections"]:  # the original layout's keys, for old readers of the JSON
        report["cases"] = [dict(e, bytes=e["work"]["bytes"]) for e in report["sections"]["ops"]["cases"]]
        report["variants"] = report["sections"]["ops"]["variants"]
    report["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    report["busy_cores_end"] = threads.busy_cores()
    report["probe_check"] = probe_check(report)
    for w in report["probe_check"]:
        log(f"!!! probe check: {w}")
    report["runtime_s"] = time.perf_counter() - t_start
    md = markdown(report)
    print(md)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if a.md:
        os.makedirs(os.path.dirname(os.path.abspath(a.md)), exist_ok=True)
        with open(a.md, "w") as f:
            f.write(md)
    if a.plot or (a.plot is None and (a.json or a.md)):
        out = a.plot or os.path.splitext(a.md or a.json)[0] + ".png"
        from . import plot
        why = plot.write(report, out)
        log(f"chart: {out}" if why is None else f"chart skipped: {why}")
    bad = [(c["case"]["name"], k) for s in report["sections"].values() for c in s["cases"]
           for k, r in c["results"].items() if r["status"] in ("failed", "error") and r["kind"] == "cpufuse"]
    log(f"total run time {report['runtime_s']:.0f} s")
    log("\n".join(["headline (the report above opens with it):"] + [x for x in headline(report) if x.startswith("- ")]))
    if bad:
        log(f"!!! {len(bad)} cpufuse variant(s) failed the check: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
