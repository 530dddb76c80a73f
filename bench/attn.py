"""The attention section: cpufuse.flash_attn against what users write, and peers (the rows:
bench/cases.py). Shapes, metrics and flop counts: bench/README.md, "Attention".
"""
import functools
import zlib

import numpy as np

import cpufuse
from cpufuse import reference as ref

from . import threads
from .cases import Section, Unavailable, Variant
from .ops import best_simd, build_peer, common_derived, times, variants

HQ, HKV, D = 32, 8, 128


def make_inputs(case):
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    dt = np.float16 if case.kv == "f16" else np.float32
    q = rng.standard_normal((1, HQ, case.N, D), dtype=np.float32)
    k = rng.standard_normal((1, HKV, case.T, D), dtype=np.float32).astype(dt)
    v = rng.standard_normal((1, HKV, case.T, D), dtype=np.float32).astype(dt)
    mask = None
    if case.causal:  # query i sits at position T - N + i
        i = np.arange(case.N)[:, None] + (case.T - case.N)
        mask = np.where(np.arange(case.T)[None, :] > i, -np.inf, 0.0).astype(np.float16).reshape(1, 1, case.N, case.T)
    return {"q": q, "k": k, "v": v, "mask": mask, "causal": case.causal, "scale": 1.0 / np.sqrt(D)}


def reference(case, inp):
    return ref.flash_attn(inp["q"], inp["k"], inp["v"], inp["mask"], scale=inp["scale"])


def visible_pairs(case):
    if not case.causal:
        return case.N * case.T
    off = case.T - case.N
    return sum(min(case.T, off + i + 1) for i in range(case.N))


def work(case, inp):
    """bytes of K + V read, and the flop count used for GFLOP/s"""
    return {"bytes": inp["k"].nbytes + inp["v"].nbytes, "flops": 4 * D * HQ * visible_pairs(case)}


# ------------------------------------------------------------------------------------------------
# numpy, as a user writes it: GQA by reshaping q's heads into groups of its KV head

def np_attention(q, k, v, mask, scale):
    S, Hq, N, Dq = q.shape
    Hk, T = k.shape[1], k.shape[2]
    G = Hq // Hk
    kf = k[0].astype(np.float32) if k.dtype != np.float32 else k[0]
    vf = v[0].astype(np.float32) if v.dtype != np.float32 else v[0]
    s = q[0].reshape(Hk, G * N, Dq) @ kf.transpose(0, 2, 1)     # (Hk, G*N, T)
    s *= scale
    if mask is not None:
        s = s.reshape(Hk, G, N, T)
        s += mask[0, 0]
    s -= s.max(-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(-1, keepdims=True)
    o = s.reshape(Hk, G * N, T) @ vf                              # (Hk, G*N, D)
    return o.reshape(Hq, N, -1).transpose(1, 0, 2)[None]          # (1, N, Hq, D)


class AttnSection(Section):
    key, title, unit = "attention", "flash attention", "µs"
    STRATS = ("rows", "split", "tiled")
    PROBE = "FMA peak probe"
    intro = (f"q f32 (1, {HQ}, N, {D}), K/V (1, {HKV}, T, {D}) f16 or f32 (GQA {HQ // HKV}), scale 1/√{D}. Decode: "
             "N = 1, no mask; prefill: N = T = 512, causal f16 mask. numpy = `q @ kᵀ` per KV-head group, softmax, "
             "`@ v`; torch = `F.scaled_dot_product_attention`; ggml = `ggml_flash_attn_ext`. `<isa> rows / split / "
             "tiled` force cpufuse's strategy (the plain ISA column is the auto choice). Decode: GB/s = bytes of "
             "K + V / time; prefill: GFLOP/s with flops = 4·D·Hq·(visible query–key pairs), % of the FMA peak of "
             "the run (start and end) and of the same probe timed in the case's own rounds (% adjacent peak).")
    derived_cols = [("K+V MB", "mb", "g"), ("best 1-thread", "best_cpufuse", "s"), ("GB/s", "best_cpufuse_gbps", "g"),
                    ("% DRAM copy", "pct_dram_copy", "pct"), ("GFLOP/s", "best_cpufuse_gflops", "g"),
                    ("% FMA peak", "pct_fma_peak", "pct"), ("% adjacent peak", "pct_probe_peak", "pct"),
                    ("auto →", "strategy_auto", "s"), ("fastest strategy", "fastest_strategy", "s"),
                    ("auto / fastest", "auto_over_fastest_strategy", "x"), ("fusion gain", "fusion_gain", "x"),
                    ("vector gain", "vector_gain", "x"), ("user gain", "user_gain", "x"),
                    ("torch / best", "torch_over_cpufuse", "x"), ("ggml / best", "ggml_over_cpufuse", "x"),
                    ("all-core GFLOP/s", "all_core_gflops", "g"), ("% all-core peak", "pct_fma_peak_all", "pct"),
                    ("speedup", "all_core_speedup", "x")]

    def __init__(self, peers, all_core):
        b = best_simd()
        self.vlist = variants(max_call_s=2.0)
        self.vlist += [Variant(f"{b} {s}", "cpufuse", b, strategy=s) for s in self.STRATS if b]
        self.vlist += variants(peers, all_core, ("torch", "ggml"))[len(variants()):]
        if b:  # the FMA peak timed in the prefill case's own rounds: % of peak under the same conditions
            self.vlist.append(Variant(self.PROBE, "baseline", b))
        self.probe_flops = {}

    inputs = staticmethod(make_inputs)
    reference = staticmethod(reference)
    work = staticmethod(work)

    def build(self, case, v, inp):
        if v.kind == "peer":
            return build_peer(case, v, inp)
        if v.kind == "baseline":
            if case.kind != "prefill":
                raise Unavailable("timed only beside the prefill cases (their % of FMA peak)")
            fn, self.probe_flops[case.name] = threads.fma_probe(v.isa, seconds=0.002)
            if fn is None:
                raise Unavailable(f"no cf_fma_peak for {v.isa}")
            return fn, fn
        q, k, vv, m, sc = inp["q"], inp["k"], inp["v"], inp["mask"], inp["scale"]
        if v.kind == "user":
            fn = functools.partial(np_attention, q, k, vv, m, sc)
            return fn, fn
        if v.isa not in cpufuse.available_isas():
            raise Unavailable(f"ISA {v.isa} not available here")
        fn = functools.partial(cpufuse.flash_attn, q, k, vv, m, scale=sc, out=np.empty((1, case.N, HQ, D), np.float32),
                               isa=v.isa, n_threads=threads.resolve(v.nth), **({} if v.fused else {"fused": False}),
                               **({"strategy": v.strategy} if v.strategy else {}))
        return fn, fn

    def tol(self, case, v):
        """ggml's CPU path accumulates softmax.V in f16 when V is f16 (its VKQ16 accumulator on the
        non-tiled path, which decode takes): its NMSE grows with T (~1e-5 at T = 512, ~1e-4 at 4096),
        so it is checked at 1e-3 there; the check is meant to catch layout mistakes (NMSE ~1)."""
        if v.name == "ggml" and case.kv == "f16" and case.N < 64:
            return 1e-3, ("ggml accumulates P.V in an f16 accumulator for f16 V on its non-tiled (decode) path, "
                          "so its error grows with T: checked at ≤ 1e-3 instead of 1e-6")
        return v.tol, None

    def annotate(self, case, r, work):
        if r["kind"] == "baseline":  # the FMA peak probe
            r["median_us"] = r["median_ns"] / 1e3
            r["gflops"] = self.probe_flops[case.name] / r["median_ns"]
            return
        super().annotate(case, r, work)

    def derived(self, case, res, env):
        copy_bw, peak = env["copy_bw"], env["fma_peak"]
        d, best = common_derived(res, ("torch", "ggml"), key="gflops")
        d.update(mb=env["work"]["bytes"] / 1e6, strategy_auto=cpufuse.ops.attention.choose_strategy(case.N, case.T))
        if best is not None:
            dec = case.kind == "decode"
            if dec:
                d["best_cpufuse_gbps"] = best["gbps"]
                d["pct_dram_copy"] = 100 * best["gbps"] / copy_bw["dram"]["gbps"]
            if peak.get("gflops_1"):
                d["pct_fma_peak"] = 100 * best["gflops"] / peak["gflops_1"]
            pr = res.get(self.PROBE, {})
            if pr.get("status") == "ok" and pr.get("gflops"):  # same rounds, same statistic (medians)
                d["pct_probe_peak"] = 100 * best["gflops"] / pr["gflops"]
            if d.get("all_core_gflops") and peak.get("gflops_all"):
                d["pct_fma_peak_all"] = 100 * d["all_core_gflops"] / peak["gflops_all"]
        b, t = best_simd(), times(res)
        strat = {s: t[f"{b} {s}"] for s in self.STRATS if f"{b} {s}" in t}
        if strat:
            d["fastest_strategy"] = min(strat, key=strat.get)
            if b in t:
                d["auto_over_fastest_strategy"] = t[b] / strat[d["fastest_strategy"]]
        return d
