"""Where the time goes: a per-op profile of one decode step and one 512-token prompt of cpufuse.llama
on a GGUF, against the machine's probes (for the closing note of issue 19).

    python -m bench.profile_big [--model PATH | --shape 1b --type q4_0] [--threads N] [--prompt 512]
                                [--steps 8] [--rounds 2] [--ghz F] [--md PATH]

The forward is driven op by op by bench/opbyop.py (the forward the model ran before the decoder
graph, and the tests' reference for it): cpufuse's public ops on the model's own (repacked)
weights, in our own buffers and KV cache arrays (the model's state is not touched; Model itself is
not changed), each op timed with perf_counter, for n = --prompt tokens from an empty cache and for
--steps decode steps after it (mean per step). Rows: embed+setup (embedding rows, positions,
mask), norm+QKV matmul (the RMS norm in the matmul's prologue), RoPE + KV store (q; k with the
cache store; v's store), attention (flash_attn), attn_output matmul, residual adds,
norm+gate/up SwiGLU matmul, ffn_down matmul, norm+output matmul. The same tokens then go through
Model.eval, the real path (the decoder graph: one compiled plan per micro-batch or step, the
prompt as one micro-batch): rows "decode step, Model.eval" and "prompt, Model.eval"; per-op minus
those is the per-op driver's Python overhead and the fusions the plan adds. The header reports
whether both paths gave the same logits (bit for bit, or the largest difference).

Per matmul row: weight bytes (decode: bytes streamed per step, GB/s, bytes per cycle, % of the
DRAM read probe) and int8 multiply-adds (prompt: MACs per cycle, % of the int8 peak probe), the
probes measured in this process at the same thread count first (bench/threads.py). Cycles = time
x the clock: /proc/cpuinfo's "cpu MHz" of the first core of the affinity (the nominal clock on
most VMs; boost and AVX-512 clocks differ), or --ghz. With --threads 1 the whole process is
pinned to that core first.
"""
import argparse
import collections
import os
import sys
import time

import numpy as np

from . import bigmodels, opbyop, threads

MATMUL_ROWS = ("norm+qkv matmul", "attn_output matmul", "norm+gate/up swiglu", "ffn_down matmul",
               "norm+output matmul")


def clock_ghz(core):
    try:
        with open("/proc/cpuinfo") as f:
            cur = None
            for line in f:
                if line.startswith("processor"):
                    cur = int(line.split(":")[1])
                elif line.startswith("cpu MHz") and cur == core:
                    return float(line.split(":")[1]) / 1e3
    except (OSError, ValueError):
        pass
    return None


class Timer:
    """opbyop.forward's timer: seconds per row, summed (perf_counter around each op)"""

    def __init__(self):
        self.t = collections.defaultdict(float)
        self._key = self._t0 = None

    def __call__(self, key):
        self._key = key
        return self

    def __enter__(self):
        self._t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.t[self._key] += time.perf_counter() - self._t0


def step_profile(m, tokens, pos0, kc, vc, bufs):
    """one forward of `tokens` at positions pos0.. on our own cache (kc, vc) and buffers, op by op:
    ({row: seconds, "TOTAL (per-op)": seconds}, the last token's logits (a copy))"""
    tm = Timer()
    t0 = time.perf_counter()
    out = opbyop.forward(m, tokens, pos0, kc, vc, timer=tm, bufs=bufs)
    tm.t["TOTAL (per-op)"] = time.perf_counter() - t0
    return dict(tm.t), out[0].copy()


def matmul_work(m):
    """{row: (weight bytes, int8 MACs per token)} of the matmul rows (output: the last token only)"""
    def wb(ws):
        return sum(w.nbytes for w in ws), sum(w.n_in * w.n_out for w in ws)
    rows = collections.defaultdict(lambda: [0, 0])
    for L in m.layers:
        for key, ws in (("norm+qkv matmul", (L.wq, L.wk, L.wv)), ("attn_output matmul", (L.wo,)),
                        ("norm+gate/up swiglu", (L.wg, L.wu)), ("ffn_down matmul", (L.wd,))):
            b, mac = wb(ws)
            rows[key][0] += b
            rows[key][1] += mac
    rows["norm+output matmul"] = list(wb((m.output,)))
    return rows


def profile(path, n_threads, n_prompt=512, n_steps=8, ghz=None, rounds=2, log=print):
    """the probes, then `rounds` alternating rounds of: the prompt and n_steps decode steps op by op
    (our own KV cache and buffers), then the same tokens through Model.eval (the model's cache and
    compiled plans). Per path the best round (prompt; decode: the mean step)."""
    import cpufuse
    from cpufuse.llama import Model
    core = sorted(os.sched_getaffinity(0))[0]
    if n_threads == 1:
        os.sched_setaffinity(0, {core})
    ghz = ghz or clock_ghz(core)
    isa = next(i for i in cpufuse.available_isas() if i != "numba")
    log(f"probes at {n_threads} thread(s) ({isa}) ...")
    rd = threads.read_bw_stats(n_threads, isa=isa)
    pk = threads.int8_peak_stats(isa, n_threads)
    # n_batch = the prompt: Model.eval runs it as one micro-batch, like the op-by-op forward
    m = Model.load(path, n_ctx=n_prompt + n_steps + 8, n_threads=n_threads, n_batch=n_prompt)
    ids = [int(t) % m.n_vocab for t in np.random.default_rng(0).integers(0, 120000, n_prompt + n_steps)]
    prompt_ids, step_ids = ids[:n_prompt], ids[n_prompt:]
    kc, vc = np.zeros_like(m.k_cache), np.zeros_like(m.v_cache)   # ours: the model's stay untouched
    bufs = opbyop.buffers(m, n_prompt)
    # warm-up: both paths on a short prompt and a step (the plans compile, the buffers fault in)
    w = min(8, n_prompt)
    step_profile(m, prompt_ids[:w], 0, kc, vc, bufs)
    step_profile(m, step_ids[:1], w, kc, vc, bufs)
    m.reset()
    m.eval(prompt_ids[:w])
    m.eval(step_ids[:1])
    prompt = dec = None
    eval_prompt = eval_step = float("inf")
    max_diff = max_abs = 0.0
    for r in range(rounds):
        log(f"round {r + 1}/{rounds}: op by op ...")
        p, ref = step_profile(m, prompt_ids, 0, kc, vc, bufs)
        refs = [ref]
        d = collections.defaultdict(float)
        for i, t in enumerate(step_ids):
            s, ref = step_profile(m, [t], n_prompt + i, kc, vc, bufs)
            refs.append(ref)
            for key, v in s.items():
                d[key] += v / n_steps
        if prompt is None or p["TOTAL (per-op)"] < prompt["TOTAL (per-op)"]:
            prompt = p
        if dec is None or d["TOTAL (per-op)"] < dec["TOTAL (per-op)"]:
            dec = dict(d)
        log(f"round {r + 1}/{rounds}: Model.eval ...")
        m.reset()
        t0 = time.perf_counter()
        got = [m.eval(prompt_ids)]
        eval_prompt = min(eval_prompt, time.perf_counter() - t0)
        t0 = time.perf_counter()
        got += [m.eval([t]) for t in step_ids]
        eval_step = min(eval_step, (time.perf_counter() - t0) / n_steps)
        for a, b in zip(refs, got):
            max_diff = max(max_diff, float(np.max(np.abs(a - b))))
            max_abs = max(max_abs, float(np.max(np.abs(b))))
    dec["decode step, Model.eval"] = eval_step
    prompt["prompt, Model.eval"] = eval_prompt
    return {"path": path, "threads": n_threads, "ghz": ghz, "isa": isa, "read_gbps": rd["gbps"],
            "int8_gmacs": pk["best"] if pk else None, "prompt": prompt, "decode": dec,
            "n_prompt": n_prompt, "n_steps": n_steps, "rounds": rounds,
            "check": {"tokens": 1 + n_steps, "max_diff": max_diff, "max_abs": max_abs},
            "work": {k: tuple(v) for k, v in matmul_work(m).items()}}


def table(P):
    ghz, rd, pk = P["ghz"], P["read_gbps"], P["int8_gmacs"]
    n, c = P["n_prompt"], P["check"]
    L = [f"Profile of `{os.path.basename(P['path'])}` at {P['threads']} thread(s), cpufuse ISA {P['isa']}. Probes "
         f"in the same process: DRAM read {rd:.1f} GB/s, int8 peak {pk or float('nan'):.0f} GMAC/s; clock "
         f"{ghz or float('nan'):.2f} GHz for the per-cycle columns "
         f"({(rd / ghz) if ghz else float('nan'):.1f} read bytes/cycle, "
         f"{(pk / ghz) if ghz and pk else float('nan'):.0f} int8 MACs/cycle at the probes).", "",
         f"Check: the op-by-op forward's logits against Model.eval's for {c['tokens']} tokens (the prompt's "
         f"last, then {c['tokens'] - 1} decode steps) x {P['rounds']} rounds: "
         + ("bit-identical." if c["max_diff"] == 0 else
            f"max |difference| {c['max_diff']:.3g} (largest |logit| {c['max_abs']:.3g}).") + " "
         f"Decode: the mean of {P['n_steps']} steps at positions {n}-{n + P['n_steps'] - 1}; both paths: "
         f"the best of {P['rounds']} alternating rounds.", "",
         f"| op | decode ms | % | GB/s | bytes/cycle | % DRAM read | prompt ({n}) ms | % | GMAC/s | MACs/cycle | % int8 peak |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    D, Pr = P["decode"], P["prompt"]
    td, tp = D["TOTAL (per-op)"], Pr["TOTAL (per-op)"]
    real = ("decode step, Model.eval", "prompt, Model.eval")
    keys = [k for k in {**D, **Pr} if k != "TOTAL (per-op)" and k not in real]
    for k in keys + ["TOTAL (per-op)", *real]:
        d, p = D.get(k), Pr.get(k)
        row = [k, f"{1e3 * d:.3f}" if d else "–", f"{100 * d / td:.0f}" if d else "–"]
        w = P["work"].get(k)
        if w and d:
            gbs = w[0] / d / 1e9
            row += [f"{gbs:.1f}", f"{gbs / ghz:.2f}" if ghz else "–", f"{100 * gbs / rd:.0f}"]
        else:
            row += ["–"] * 3
        row += [f"{1e3 * p:.1f}" if p else "–", f"{100 * p / tp:.0f}" if p else "–"]
        if w and p:
            toks = 1 if k == "norm+output matmul" else n
            gm = w[1] * toks / p / 1e9
            row += [f"{gm:.1f}", f"{gm / ghz:.1f}" if ghz else "–", f"{100 * gm / pk:.0f}" if pk else "–"]
        else:
            row += ["–"] * 3
        L.append("| " + " | ".join(row) + " |")
    return "\n".join(L)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.profile_big", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a GGUF (default: the bench's synthetic --shape / --type file)")
    ap.add_argument("--shape", default="1b", choices=list(bigmodels.SHAPES))
    ap.add_argument("--type", default="q4_0", choices=list(bigmodels.TYPES))
    ap.add_argument("--dir", help="the synthetic models' cache folder")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of both paths (the best counts)")
    ap.add_argument("--ghz", type=float, help="the clock for the per-cycle columns (default: /proc/cpuinfo)")
    ap.add_argument("--md", help="also write the table here")
    a = ap.parse_args(argv)
    if min(a.threads, a.prompt, a.steps, a.rounds) < 1:
        sys.exit("--threads, --prompt, --steps and --rounds must be >= 1")
    path = a.model or bigmodels.ensure(a.shape, a.type, a.dir)
    t = table(profile(path, a.threads, a.prompt, a.steps, a.ghz, a.rounds, log=lambda s: print(s, file=sys.stderr)))
    print(t)
    if a.md:
        with open(a.md, "w") as f:
            f.write(t + "\n")


if __name__ == "__main__":
    main()
