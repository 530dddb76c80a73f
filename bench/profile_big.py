"""Where the time goes: a per-op profile of one decode step and one 512-token prompt of cpufuse.llama
on a GGUF, against the machine's probes (for the closing note of issue 19).

    python -m bench.profile_big [--model PATH | --shape 1b --type q4_0] [--threads N] [--prompt 512]
                                [--steps 8] [--ghz F] [--md PATH]

The forward is driven op by op from here with cpufuse's public ops on the model's own weights,
buffers and cache (the same calls as Model._forward's per-layer path, timed with perf_counter
around each; Model itself is not changed), for n = 1 (a decode step at position --prompt, after
the prompt) and n = --prompt tokens from an empty cache. Rows: embed, norm+QKV matmul (the RMS norm
in the matmul's prologue), RoPE (q; k with the f16 cache store), V cache store, attention
(flash_attn), attn_output matmul, residual adds, norm+gate/up SwiGLU matmul, ffn_down matmul,
norm+output matmul. The decode row "decode step, Model.eval" is the real path (one compiled plan
per token): per-op minus plan is the per-op driver's Python overhead.

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

from . import bigmodels, threads

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


def step_profile(m, tokens):
    """one forward of `tokens` at the cache's current position, op by op: {row: seconds}"""
    from cpufuse import flash_attn, matmul, matmul_multi, rope
    tm = collections.defaultdict(float)
    pc = time.perf_counter
    hp = m.hparams
    n = len(tokens)
    pos0 = m.n_past
    T = pos0 + n
    eps, act, nt, isa = hp.eps, m.act, m.n_threads, m.isa
    t_all = t = pc()
    x, q, k, v, q3, k3, v3, q4, attn, attn2, o, g = m._views_for(n)
    m._embed(tokens, x)
    pos = np.arange(pos0, T, dtype=np.int32)
    mask = None
    if n > 1:
        mask = m._mask[:n, :T]
        mask[:, :pos0] = 0
        mask[:, pos0:T] = np.triu(np.full((n, n), -np.inf, np.float16), 1)
        mask = mask[None, None]
    tm["embed+setup"] += pc() - t
    kw = m._rope_kw
    for li, L in enumerate(m.layers):
        kc, vc = m.k_cache[li], m.v_cache[li]
        steps = (
            ("norm+qkv matmul", lambda: matmul_multi(x, (L.wq, L.wk, L.wv), out=(q, k, v), norm_weight=L.attn_norm,
                                                     eps=eps, act=act, isa=isa, n_threads=nt)),
            ("rope q", lambda: rope(q3, pos, out=q3, **kw)),
            ("rope k + cache store", lambda: rope(k3, pos, cache=(kc, pos0), **kw)),
            ("v cache store", lambda: vc.__setitem__(slice(pos0, T), v3)),
            ("flash_attn", lambda: flash_attn(q4, kc[:T].transpose(1, 0, 2)[None], vc[:T].transpose(1, 0, 2)[None],
                                              mask, scale=hp.kq_scale, out=attn, isa=isa, n_threads=nt)),
            ("attn_output matmul", lambda: matmul(attn2, L.wo, out=o, act=act, isa=isa, n_threads=nt)),
            ("residual adds", lambda: np.add(x, o, out=x)),
            ("norm+gate/up swiglu", lambda: m_swiglu(x, L, g, eps, act, isa, nt)),
            ("ffn_down matmul", lambda: matmul(g, L.wd, out=o, act=act, isa=isa, n_threads=nt)),
            ("residual adds", lambda: np.add(x, o, out=x)),
        )
        for key, fn in steps:
            t = pc()
            fn()
            tm[key] += pc() - t
    t = pc()
    matmul(x[n - 1:n], m.output, out=m._logits1, norm_weight=m.output_norm, eps=eps, act=act, isa=isa, n_threads=nt)
    tm["norm+output matmul"] += pc() - t
    m._n_past = T
    m._cached.extend(int(tk) for tk in tokens)
    tm["TOTAL (per-op)"] = pc() - t_all
    return tm


def m_swiglu(x, L, g, eps, act, isa, nt):
    from cpufuse import matmul_swiglu
    return matmul_swiglu(x, L.wg, L.wu, out=g, norm_weight=L.ffn_norm, eps=eps, act=act, isa=isa, n_threads=nt)


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


def profile(path, n_threads, n_prompt=512, n_steps=8, ghz=None, log=print):
    from cpufuse.llama import Model
    core = sorted(os.sched_getaffinity(0))[0]
    if n_threads == 1:
        os.sched_setaffinity(0, {core})
    ghz = ghz or clock_ghz(core)
    isa = next(i for i in __import__("cpufuse").available_isas() if i != "numba")
    log(f"probes at {n_threads} thread(s) ({isa}) ...")
    rd = threads.read_bw_stats(n_threads, isa=isa)
    pk = threads.int8_peak_stats(isa, n_threads)
    m = Model.load(path, n_ctx=n_prompt + n_steps + 8, n_threads=n_threads)
    ids = [int(t) % m.n_vocab for t in np.random.default_rng(0).integers(0, 120000, n_prompt + n_steps + 1)]
    # prompt: warm-up once, then the profiled run (best of 2)
    m.reset()
    m.eval(ids[:n_prompt])
    prompts = []
    for _ in range(2):
        m.reset()
        prompts.append(step_profile(m, ids[:n_prompt]))
    prompt = min(prompts, key=lambda d: d["TOTAL (per-op)"])
    # decode: n_steps single-token steps after the prompt, mean per step
    dec = collections.defaultdict(float)
    for i in range(n_steps):
        for key, s in step_profile(m, [ids[n_prompt + i]]).items():
            dec[key] += s / n_steps
    # the real decode path (the compiled plan), same positions
    m.reset()
    m.eval(ids[:n_prompt])
    m.eval([ids[n_prompt]])
    t0 = time.perf_counter()
    for i in range(1, n_steps):
        m.eval([ids[n_prompt + i]])
    dec["decode step, Model.eval"] = (time.perf_counter() - t0) / max(1, n_steps - 1)
    return {"path": path, "threads": n_threads, "ghz": ghz, "isa": isa, "read_gbps": rd["gbps"],
            "int8_gmacs": pk["best"] if pk else None, "prompt": dict(prompt), "decode": dict(dec),
            "n_prompt": n_prompt, "work": {k: tuple(v) for k, v in matmul_work(m).items()}}


def table(P):
    ghz, rd, pk = P["ghz"], P["read_gbps"], P["int8_gmacs"]
    n = P["n_prompt"]
    L = [f"Profile of `{os.path.basename(P['path'])}` at {P['threads']} thread(s), cpufuse ISA {P['isa']}. Probes "
         f"in the same process: DRAM read {rd:.1f} GB/s, int8 peak {pk or float('nan'):.0f} GMAC/s; clock "
         f"{ghz or float('nan'):.2f} GHz for the per-cycle columns "
         f"({(rd / ghz) if ghz else float('nan'):.1f} read bytes/cycle, "
         f"{(pk / ghz) if ghz and pk else float('nan'):.0f} int8 MACs/cycle at the probes).", "",
         f"| op | decode ms | % | GB/s | bytes/cycle | % DRAM read | prompt ({n}) ms | % | GMAC/s | MACs/cycle | % int8 peak |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    D, Pr = P["decode"], P["prompt"]
    td, tp = D["TOTAL (per-op)"], Pr["TOTAL (per-op)"]
    keys = [k for k in D if not k.startswith("TOTAL") and k != "decode step, Model.eval"]
    for k in keys + ["TOTAL (per-op)", "decode step, Model.eval"]:
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
    ap.add_argument("--ghz", type=float, help="the clock for the per-cycle columns (default: /proc/cpuinfo)")
    ap.add_argument("--md", help="also write the table here")
    a = ap.parse_args(argv)
    if a.threads < 1 or a.prompt < 1 or a.steps < 2:
        sys.exit("--threads and --prompt must be >= 1, --steps >= 2")
    path = a.model or bigmodels.ensure(a.shape, a.type, a.dir)
    t = table(profile(path, a.threads, a.prompt, a.steps, a.ghz, log=lambda s: print(s, file=sys.stderr)))
    print(t)
    if a.md:
        with open(a.md, "w") as f:
            f.write(t + "\n")


if __name__ == "__main__":
    main()
