"""Where a token's time goes: cpufuse.llama on a GGUF (or a bigmodels.py file), per thread
count, each in its own process; what is counted (cf_pool_profile): bench/README.md."""
import argparse
import os
import sys
import time

import numpy as np

from ..report import save, table
from . import fmt, parse_threads, run_job
from . import bigmodels
from .big import worker as probes


EXT = 3 * 64 + 5     # cf_pool_profile_ext's entries (CF_PROF_EXT, native/kernels/pool.h; an older build fills fewer)


def _profiled(fn):
    """(wall ns, busy ns, region ns, regions, {record kind: ns}) of fn() (cf_pool_profile)"""
    from cpufuse import _backend
    from cpufuse.graph.kinds import RECORDS
    ffi, lib = _backend.ffi, _backend.lib
    out, ext = ffi.new("uint64_t[67]"), ffi.new(f"uint64_t[{EXT}]")
    lib.cf_pool_profile(1, ffi.NULL)
    t0 = time.perf_counter_ns()
    fn()
    wall = time.perf_counter_ns() - t0
    has_ext = hasattr(lib, "cf_pool_profile_ext")   # not in an older build (an A/B's base tree)
    if has_ext:
        lib.cf_pool_profile_ext(ext)    # before the reset below
    lib.cf_pool_profile(0, out)
    ops = {r.name: int(out[3 + r.op]) for r in RECORDS if r.op < 64 and out[3 + r.op]}
    res = {"wall": wall, "busy": int(out[0]), "region": int(out[1]), "regions": int(out[2]), "ops": ops}
    if has_ext:
        res.update(serial={r.name: (int(ext[r.op]), int(ext[64 + r.op]), int(ext[133 + r.op]))
                           for r in RECORDS if r.op < 64 and out[3 + r.op]},
                   dispatch=int(ext[128]), own=int(ext[129]), join=int(ext[130]), plan=int(ext[131]))
    return res


def fill_cache(m, depth, seed=1):
    """A timing experiment's cache at depth: cells [0, depth) of every layer set to random values of the
    cache's type (one block of them, copied to each layer) and the model told it holds `depth` tokens, in
    place of a prompt of that length (what a decode step then reads and computes is the same; its values are
    not a real context's). Rings (sliding-window layers) are not supported."""
    from cpufuse.ops import kvquant
    kv = m.kv
    if kv.ring_cells:
        raise SystemExit("--depth: this model's cache has sliding-window rings")
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((depth, kv.n_head_kv, kv.head_dim)) * 0.5).astype(np.float32)
    blocks = [kvquant.quantize(x, q) if q else x.astype(dt) for q, dt in ((kv.quant_k, kv.dtype_k), (kv.quant_v, kv.dtype_v))]
    for li in range(kv.n_layer):
        for arr, blk in zip(kv.layer(li), blocks):
            arr[:depth] = blk
    m._n_past = depth     # noqa: SLF001 (a bench's synthetic fill; Model has no public way to claim cells)
    m._cached = [int(t) for t in rng.integers(10, m.hparams.n_vocab - 10, size=depth)]   # noqa: SLF001


def worker(job):
    os.environ.setdefault("CPUFUSE_MOE_PROF", "off")   # the routed matmul's own phase clocks (moeprof's) off
    from cpufuse.llama import Model
    nth, n_prompt, steps, depth = job["threads"], job["prompt"], job["steps"], job.get("depth", 0)
    p = probes(job) if job["read_mib"] else {"read": {}}
    res = {"threads": nth, "isa": p.get("isa"), "read_gbps": p["read"].get("gbps"),
           "int8_gmacs": (p.get("int8") or {}).get("best")}
    for fusion in (True, False)[:1 if job.get("fused_only") else 2]:
        m = Model.load(job["model"], n_ctx=depth + n_prompt + steps + 40, n_threads=nth, n_batch=max(n_prompt, 16),
                       fusion=fusion, type_k=job.get("ctk", "f16"), type_v=job.get("ctk", "f16"))
        toks = [int(t) for t in np.random.default_rng(0).integers(10, m.hparams.n_vocab - 10, size=n_prompt + steps + 17)]
        m.eval(toks[:16])                                  # warm-up: the plans compile, the buffers fault in
        m.eval([toks[16]])
        m.reset()
        if depth:
            fill_cache(m, depth)
        prompt = _profiled(lambda: m.eval(toks[:n_prompt]))
        def decode_steps():     # each step's logits dropped at once, as a sampling loop does (a list of them
            for t in toks[n_prompt:n_prompt + steps]:   # faulted in fresh pages for every copy: ~120 µs a token here)
                m.eval([t])
        decode = _profiled(decode_steps)
        res["fused" if fusion else "unfused"] = {"prompt": prompt, "decode": decode}
        # streamed per decode token; of a mixture's stacked experts, the n_expert_used a token picks
        ws = [w for L in m.layers for w in vars(L).values() if hasattr(w, "n_in")]
        act = [m.hparams.n_expert_used / m.hparams.n_expert if w.n_expert else 1 for w in ws]
        res["weight_bytes"] = sum(w.nbytes * a for w, a in zip(ws, act)) + m.output.nbytes
        kv = m.kv   # at depth, decode GB/s also counts the cells a step reads: on average depth + prompt + half the
        # steps, K and V, every layer (at no depth only the weights, as before)
        res["kv_read"] = (depth + n_prompt + (steps + 1) / 2) * kv.nbytes / (kv.n_seq * kv.n_ctx) if depth else 0
        res["macs"] = sum(w.n_in * w.n_out * max(w.n_expert, 1) * a for w, a in zip(ws, act))   # per prompt token
        m = None    # noqa: F841 (the next model loads without this one)
    return res


def markdown(model, P, n_prompt, steps):
    L = [f"# Where a token's time goes: `{model}` (`python -m bench.e2e.profile`)", "",
         f"A prompt of {n_prompt} tokens, then {steps} decode steps; fused = Model.eval as it runs, unfused = "
         "`Model.load(fusion=False)`. Counted by cf_pool_profile (native/src/pool.c).", ""]
    rows = []
    for r in P:
        t, d, p = r["threads"], r["fused"]["decode"], r["fused"]["prompt"]
        W, R, B = (d[k] / steps / 1e3 for k in ("wall", "region", "busy"))
        serial, idle = (W - R, R - B / t) if t > 1 else (0.0, 0.0)
        gbs, gm = (r["weight_bytes"] + r.get("kv_read", 0)) / (W * 1e3), r["macs"] * n_prompt / p["wall"]
        rd, pk = r["read_gbps"], r["int8_gmacs"]
        rows.append([t, f"{W:.0f}", f"{d['regions'] / steps:.0f}", f"{serial:.0f}", f"{idle:.0f}",
                     f"{B / t:.0f}", f"{100 * (serial * (t - 1) / t + idle) / W:.1f}",
                     f"{gbs:.1f} ({fmt(rd and 100 * gbs / rd, 0)} %)",
                     f"{gm:.1f} ({fmt(pk and 100 * gm / pk, 0)} %)"])
    L += table(["threads", "token µs", "regions / token", "serial µs", "in-region idle + sync µs",
                "task µs / thread", "idle+sync %", "decode GB/s (% DRAM read)",
                "prompt GMAC/s (% int8 peak)"], rows, "---:")
    scale = (steps * 1e3, steps * 1e3, 1e6, 1e6)   # µs per decode token, ms per prompt
    for r in P:
        f = r["fused"]
        u = r.get("unfused") or {w: {"wall": 0, "ops": {}} for w in ("decode", "prompt")}
        kinds = sorted({k for x in (f, u) for w in ("decode", "prompt") for k in x[w]["ops"]},
                       key=lambda k: -u["decode"]["ops"].get(k, 0))
        L += ["", f"Wall time per plan record kind at {r['threads']} thread(s) (the C plan executor; the rest of "
              f"the total is Python and the embedding); probes: DRAM read {r['read_gbps'] or float('nan'):.1f} GB/s, "
              f"int8 peak {r['int8_gmacs'] or float('nan'):.0f} GMAC/s ({r['isa']}):", ""]
        cells = {k: [x[w]["wall"] if k == "TOTAL (wall)" else x[w]["ops"].get(k) for w in ("decode", "prompt")
                     for x in (f, u)] for k in kinds + ["TOTAL (wall)"]}
        L += table(["record", "decode µs / token, fused", "unfused", "prompt ms, fused", "unfused"],
                   [[k] + [f"{v / s:.1f}" if v else "–" for v, s in zip(c, scale)] for k, c in cells.items()],
                   "---:", first="---")
    for r in P:   # the calling thread's side (cf_pool_profile_ext): what the other threads wait for
        d = r["fused"]["decode"]
        if "serial" not in d:
            continue
        us = lambda v: f"{v / steps / 1e3:.1f}"     # noqa: E731
        # the wait per record kind: an older build (an A/B's base tree) leaves those counters 0, shown as –
        has_wait = any(v[2] for v in d["serial"].values())
        rows = [[k, us(v[0]), f"{v[1] / steps:.0f}", us(v[2]) if has_wait else "–"]
                for k, v in sorted(d["serial"].items(), key=lambda kv: -kv[1][0])]
        rows += [["(regions: publishing the job, on the caller)", us(d["dispatch"]), "", ""],
                 ["(regions: the caller's own chunks)", us(d["own"]), "", ""],
                 ["(regions: the caller waiting for the others)", us(d["join"]), "", ""],
                 ["(the plan's C call, whole)", us(d["plan"]), "", ""],
                 ["(outside the C call: Python, the embedding, the logits copy)", us(d["wall"] - d["plan"]), "", ""]]
        L += ["", f"A decode token's calling thread at {r['threads']} thread(s): per record kind its time outside "
              "parallel regions (µs a token; at one thread all of it), its regions a token, and its wait at their "
              "ends for the other threads (µs a token):", ""]
        L += table(["record", "serial µs / token", "regions / token", "caller's wait µs / token"], rows, "---:",
                   first="---")
    return "\n".join(L) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.e2e.profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="a GGUF (default: the synthetic --shape / --type file)")
    ap.add_argument("--shape", default="1b", choices=list(bigmodels.SHAPES))
    ap.add_argument("--type", default="q4_0", choices=list(bigmodels.TYPES))
    ap.add_argument("--dir", help="the synthetic models' cache folder")
    ap.add_argument("--pure", action="store_true", help="the one-type --shape / --type file (bigmodels --pure)")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--read-mib", type=int, default=1024, help="the DRAM read probe's array (0: no probe)")
    ap.add_argument("--fused-only", action="store_true", help="skip the unfused model (its columns read –)")
    ap.add_argument("--md", help="also write the tables here")
    ap.add_argument("--depth", type=int, default=0,
                    help="cells of cache filled with random values before the prompt (a timing experiment at depth; "
                         "decode GB/s then counts the cells a step reads too)")
    ap.add_argument("--ctk", default="f16", help="the K and V cache type (f16, f32, q8_0, q4_0)")
    a = ap.parse_args(argv)
    if min(a.prompt, a.steps) < 1 or a.depth < 0:
        sys.exit("--prompt and --steps must be >= 1, --depth >= 0")
    path, P = a.model or bigmodels.ensure(a.shape, a.type, a.dir, pure=a.pure), []
    for t in parse_threads(a.threads, len(os.sched_getaffinity(0))):
        res, err = run_job({"worker": "profile", "model": path, "threads": t, "prompt": a.prompt, "steps": a.steps,
                            "read_mib": a.read_mib, "fused_only": a.fused_only, "depth": a.depth, "ctk": a.ctk},
                           pin=t == 1, threads=t, timeout=3600)
        P.append(res or sys.exit(f"profile at {t} thread(s): {err}"))
        print(f"profile: {t} thread(s) done", file=sys.stderr, flush=True)
    md = markdown(os.path.basename(path) + (f", {a.depth} cells of {a.ctk} cache first" if a.depth else ""), P,
                  a.prompt, a.steps)
    print(md)
    if a.md:
        save(a.md, md)


if __name__ == "__main__":
    main()
