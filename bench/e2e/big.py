"""End to end on real model shapes: cpufuse.llama against llama.cpp on synthetic 1B-8B GGUFs.

    python -m bench.e2e.big [--models 1b[,8b,gemma3-1b,phi4-mini]] [--types q4_0,q4_k,q6_k,q8_0,q4_k_m] [--threads 1,2]
                            [--rounds 3] [--llama-bench PATH | --peer-python PATH] [--dir D]
                            [--ik-llama-src CHECKOUT (or IK_LLAMA_SRC=CHECKOUT)]
                            [--json P] [--md P] [--png P]

Details: bench/README.md, "bench.e2e.big".
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from .. import threads as threads_mod
from ..timing import RESULTS, cpu_name, fmt, load_avg, median, parse_threads, peer_status, run_job
from . import bigmodels
from .model import DEFAULT_PEER, HERE, N_CTX, bench_tokens, per_round, run_rounds

PP, TG = 512, 128
ENGINES = ("cpufuse", "llamacpp-fa-off", "llamacpp-fa-on", "ik-fa-off", "ik-fa-on")
LABEL = {"cpufuse": "cpufuse", "llamacpp-fa-off": "llama.cpp FA off", "llamacpp-fa-on": "llama.cpp FA on",
         "ik-fa-off": "ik_llama.cpp FA off", "ik-fa-on": "ik_llama.cpp FA on"}
# the peers' columns: (engine prefix, summary key, name in the report)
PEER_COLS = (("llamacpp", "llamacpp-best", "llama.cpp"), ("ik", "ik-best", "ik_llama.cpp"))
IK_CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"]


# ================================================================================================
# workers (each in its own process)

def worker_probe(job):
    """the probes at job["threads"] threads: DRAM read bandwidth and the int8 peak"""
    n = int(job["threads"])
    isa = threads_mod.best_isa()
    return {"isa": isa, "threads": n,
            "read": threads_mod.read_bw_stats(n, nbytes=int(job.get("read_bytes", 1 << 30)), isa=isa),
            "int8": threads_mod.int8_peak_stats(isa, n) if isa else None,
            "fma": threads_mod.fma_peak_stats(isa, n) if isa else None}


def run_llama_bench(exe, path, threads, fa, reps, pin, timeout=1800, extra=()):
    """llama-bench (llama.cpp's or ik_llama.cpp's) for pp512 and tg128 at `threads`, flash attention on
    or off: ({"wall": {"pp512": [tok/s per run], "tg128": [...]}, "raw": its JSON records}, None) or
    (None, an error string)"""
    cmd = (["taskset", "-c", "0"] if pin else []) + [
        exe, "-m", path, "-p", str(PP), "-n", str(TG), "-t", str(threads), "-fa", "1" if fa else "0",
        "-r", str(reps), "-o", "json", *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timeout after {timeout}s"
    if p.returncode:
        return None, f"exit {p.returncode}: {(p.stderr or p.stdout).strip()[-600:]}"
    try:
        recs = json.loads(p.stdout)
    except ValueError:
        return None, f"unreadable output: {p.stdout[-300:]}"
    wall = {}
    for r in recs:
        key = f"pp{r['n_prompt']}" if r.get("n_prompt") and not r.get("n_gen") else f"tg{r['n_gen']}"
        wall[key] = [float(x) for x in r.get("samples_ts", [])] or [float(r["avg_ts"])]
    keep = ("build_commit", "build_number", "cpu_info", "backends", "n_threads", "flash_attn", "type_k",
            "type_v", "n_batch", "n_ubatch", "use_mmap", "model_type", "model_size")
    return {"wall": wall, "raw": [{k: r.get(k) for k in keep} for r in recs],
            "version": f"(build {recs[0].get('build_commit', '?')}, {recs[0].get('build_number', '?')})" if recs else ""}, None


def _run_llamacpp_python(python, path, threads, fa, toks, args, pin):
    job = {"job": "speed", "model": path, "tokens": toks, "threads": threads, "pp": [PP], "tg": TG, "n_ctx": N_CTX,
           "reps": {f"pp{PP}": args.reps_pp, f"tg{TG}": args.reps_tg}, "flash_attn": fa, "pp_warm": args.pp_warm}
    return run_job(job, python, [os.path.join(HERE, "peer.py")], pin, threads, timeout=args.timeout)


def _run_llama_bench(exe, path, threads, fa, toks, args, pin):
    return run_llama_bench(exe, path, threads, fa, args.reps_pp, pin, timeout=args.timeout)


def _run_ik(exe, path, threads, fa, toks, args, pin):
    return run_llama_bench(exe, path, threads, fa, args.reps_pp, pin, timeout=args.timeout, extra=["-rtr", "1"])


def build_ik(src, models_dir, timeout=7200):
    """ik_llama.cpp's llama-bench built from the checkout `src` into <models dir>/ik-llama-bench (outside
    the repository; cmake builds incrementally): (path, None) or (None, why not)"""
    src = os.path.abspath(os.path.expanduser(src))
    if not os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        return None, f"IK_LLAMA_SRC={src} has no CMakeLists.txt"
    bdir = os.path.join(bigmodels.models_dir(models_dir), "ik-llama-bench")
    jobs = str(len(os.sched_getaffinity(0)))
    for cmd in (["cmake", "-S", src, "-B", bdir, *IK_CMAKE],
                ["cmake", "--build", bdir, "--target", "llama-bench", "-j", jobs]):
        print("bench.e2e.big: " + " ".join(cmd), flush=True)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"ik_llama.cpp build: {e}"
        if p.returncode:
            return None, f"ik_llama.cpp build: exit {p.returncode}: {(p.stderr or p.stdout).strip()[-600:]}"
    exe = os.path.join(bdir, "bin", "llama-bench")
    return (exe, None) if os.access(exe, os.X_OK) else (None, f"ik_llama.cpp build: no {exe}")


def _executable(prog):
    return None if os.access(prog, os.X_OK) else f"{prog} is not an executable file"


class Peer:
    """a llama.cpp peer: how to build it (said when it is missing), why a program is not usable (None
    when it is), how to run one cell: run(program, gguf path, threads, flash_attn, tokens, args, pin)
    -> (result {"wall": {"pp512": [tok/s...], "tg128": [...]}, ...} or None, error or None)"""

    def __init__(self, build, missing, run):
        self.build, self.missing, self.run = build, missing, run


# the llama.cpp peers by name (--llama-bench PATH picks llama-bench, else llama-cpp-python)
PEERS = {
    "llama-cpp-python": Peer("make bench-e2e builds its venv (PEER_VENV; --peer-python PATH)", peer_status,
                             _run_llamacpp_python),
    "llama-bench": Peer("make llama-bench (bench/llama_bench_build.sh; --llama-bench PATH)", _executable,
                        _run_llama_bench),
    "ik_llama.cpp": Peer("IK_LLAMA_SRC=<ik_llama.cpp checkout> (or --ik-llama-src) builds its llama-bench",
                         _executable, _run_ik),
}


# ================================================================================================
# the run

def run(args):
    ncpu = len(os.sched_getaffinity(0))
    threads = parse_threads(args.threads, ncpu) if args.threads else sorted({1, ncpu})
    models = bigmodels.parse_list(args.models, list(bigmodels.SHAPES), "models")
    types = bigmodels.parse_list(args.types, list(bigmodels.TYPES), "types")
    files = []
    for shape in models:
        for qt in types:
            path = bigmodels.ensure(shape, qt, args.dir)
            files.append({"shape": shape, "type": qt, "path": path, "bytes": os.path.getsize(path),
                          "work": bigmodels.work(shape, qt)})
    peer_kind, prog = ("llama-bench", os.path.abspath(os.path.expanduser(args.llama_bench))) if args.llama_bench \
        else ("llama-cpp-python", args.peer_python)
    why_peer = PEERS[peer_kind].missing(prog)
    exe = prog if peer_kind != "llama-cpp-python" else None
    ik, why_ik = build_ik(args.ik_llama_src, args.dir) if args.ik_llama_src else (None, "IK_LLAMA_SRC not given")
    engines = [e for e in ENGINES if not (why_peer and e.startswith("llamacpp")) and not (why_ik and e.startswith("ik"))]
    if args.engines:
        engines = [e for e in engines if e in args.engines.split(",")]
    jobs = engines + ["probe"]
    reps = {f"pp{PP}": args.reps_pp, f"tg{TG}": args.reps_tg}
    t_start = time.time()
    la0 = load_avg()
    print(f"bench.e2e.big: {len(files)} files x threads {threads} x {args.rounds} rounds, engines "
          f"{', '.join(engines)} (llama.cpp via {peer_kind}); load average {la0[0]:.2f}", flush=True)
    if why_peer:
        print(f"bench.e2e.big: llama.cpp columns skipped: {why_peer} ({PEERS[peer_kind].build})", flush=True)
    if args.ik_llama_src and why_ik:
        print(f"bench.e2e.big: ik_llama.cpp columns skipped: {why_ik}", flush=True)
    raw = {}
    errors = {}
    peer_info = {}
    busy = [threads_mod.busy_cores()]   # cores other work keeps busy (bench/threads.py), between rounds

    def report(final):
        """the JSON and markdown of what is measured so far (rewritten after every thread count of
        every round, so a run stopped by a time limit leaves its results)"""
        la1 = load_avg()
        done = [f for f in files if os.path.basename(f["path"]) in raw]
        out = {"kind": "e2e-big", "complete": final,
               "machine": {"cpu": cpu_name(), "ncpu_affinity": ncpu, "platform": platform.platform(),
                           "python": sys.version.split()[0], "cpufuse_isa": threads_mod.best_isa()},
               "load_avg_start": la0, "load_avg_end": la1, "busy_cores": busy, "seconds": time.time() - t_start,
               "rounds": args.rounds, "threads": threads, "reps": reps, "pp_warm": args.pp_warm,
               "read_mib": args.read_mib, "n_ctx": N_CTX, "peer_kind": peer_kind, "llama_bench": exe,
               "ik_llama_bench": ik, "ik_skipped": why_ik if args.ik_llama_src else None,
               "peer": peer_info, "peer_skipped": why_peer, "errors": errors, "files": done,
               "summary": summarize(done, raw, threads, engines), "raw": raw}
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
        write_md(out, args.md, args.png if final else None)
        return out

    for f in files:
        name = os.path.basename(f["path"])
        toks = bench_tokens(f["path"], PP + TG + 8)

        def one(e, t):
            if e == "probe":
                return run_job({"threads": t, "read_bytes": args.read_mib << 20}, sys.executable,
                               ["-m", "bench.e2e.big", "--probe-worker"], t == 1, t)
            if e == "cpufuse":
                job = {"job": "speed", "engine": "cpufuse", "model": f["path"], "tokens": toks, "threads": t,
                       "pp": [PP], "tg": TG, "reps": reps, "n_ctx": N_CTX, "pp_warm": args.pp_warm}
                return run_job(job, sys.executable, ["-m", "bench.e2e", "--worker"], t == 1, t, timeout=args.timeout)
            if e.startswith("ik"):
                res, err = PEERS["ik_llama.cpp"].run(ik, f["path"], t, e.endswith("fa-on"), toks, args, t == 1)
                if res:
                    peer_info["ik_version"] = res.get("version", "")
                return res, err
            res, err = PEERS[peer_kind].run(prog, f["path"], t, e.endswith("fa-on"), toks, args, t == 1)
            if res and "version" in res:
                peer_info.update(version=res["version"], system_info=res.get("system_info", ""), raw=res.get("raw"))
            return res, err

        def line(e, res):
            if e == "probe":
                return (f"probes: DRAM read {res['read']['gbps']:.1f} GB/s, int8 "
                        f"{(res.get('int8') or {}).get('best', float('nan')):.0f} GMAC/s")
            fin = res.get("logits_finite")
            return (f"{LABEL[e]:17s} " + "  ".join(f"{k} {fmt(median(v), 2):>8}" for k, v in res["wall"].items())
                    + ("" if fin is None else f"  logits finite {fin}"))

        def after():
            busy.append(threads_mod.busy_cores(0.3))
            report(False)
        raw[name] = {j: {str(t): [] for t in threads} for j in jobs}
        run_rounds(raw[name], errors, name, jobs, threads, args.rounds, one, line, after)
    out = report(True)
    print(f"bench.e2e.big: wrote {args.json}, {args.md} ({out['seconds'] / 60:.1f} min; load average "
          f"{la0[0]:.2f} -> {out['load_avg_end'][0]:.2f})")
    return out


def summarize(files, raw, threads, engines):
    """per file and thread count: each engine's median over rounds (of its in-process medians), the
    min / max over rounds, llama.cpp's better FA setting, the probes' medians and the derived rates"""
    S = {}
    for f in files:
        name = os.path.basename(f["path"])
        R = raw[name]
        for t in threads:
            d = S.setdefault(name, {}).setdefault(str(t), {})
            pr = R["probe"][str(t)]
            if pr:
                d["read_gbps"] = median([p["read"]["gbps"] for p in pr])
                d["int8_gmacs"] = median([(p.get("int8") or {}).get("best") for p in pr])
                d["fma_gflops"] = median([(p.get("fma") or {}).get("best") for p in pr])
                d["probe_how"] = pr[0]["read"]["how"]
            for e in engines:
                rs = R.get(e, {}).get(str(t))
                if not rs:
                    continue
                de = d.setdefault(e, {})
                de["logits_finite"] = all(r.get("logits_finite", True) for r in rs)
                for key in (f"pp{PP}", f"tg{TG}"):
                    if per_round(rs, key):
                        de[key] = per_round(rs, key)
            for pre, best, _ in PEER_COLS:
                for key in (f"pp{PP}", f"tg{TG}"):
                    cands = [(d[e][key]["median"], e) for e in (f"{pre}-fa-off", f"{pre}-fa-on") if key in d.get(e, {})]
                    if cands:
                        v, e = max(cands)
                        d.setdefault(best, {})[key] = {"median": v, "which": e}
            w = f["work"]
            for e in ("cpufuse", "llamacpp-best", "ik-best"):
                de = d.get(e, {})
                tg, pp = de.get(f"tg{TG}", {}).get("median"), de.get(f"pp{PP}", {}).get("median")
                if tg:
                    de["decode_gbps"] = w["weight_bytes_per_token"] * tg / 1e9
                    if d.get("read_gbps"):
                        de["decode_pct_read"] = 100 * de["decode_gbps"] / d["read_gbps"]
                if pp:
                    de["prompt_gmacs"] = w["matmul_macs_per_token"] * pp / 1e9
                    if d.get("int8_gmacs"):
                        de["prompt_pct_int8"] = 100 * de["prompt_gmacs"] / d["int8_gmacs"]
    return S


# ================================================================================================
# report

def write_md(R, md_path, png_path=None):
    m = R["machine"]
    S = R["summary"]
    threads = R["threads"]
    lb = R["peer_kind"] == "llama-bench"
    peer = R.get("peer") or {}
    L = ["# cpufuse.llama vs llama.cpp on real model shapes (Llama 3, Gemma 3, Phi-4-mini) (`python -m bench.e2e.big`)", ""]
    if not R.get("complete", True):
        L += ["**Partial results** (written after every round; the run did not finish).", ""]
    L += [
         f"Machine: {m['cpu']}, {m['ncpu_affinity']} CPUs in the affinity, Python {m['python']}, cpufuse ISA "
         f"{m['cpufuse_isa']}. llama.cpp: {R['peer_kind']} {peer.get('version', '')}. Load average at start "
         f"{R['load_avg_start'][0]:.2f}, at end {R['load_avg_end'][0]:.2f}. {R['rounds']} alternating rounds (each "
         f"engine and the probes in their own process per round, order rotated); run time {R['seconds'] / 60:.1f} min.",
         ""]
    b = [x for x in R.get("busy_cores", []) if x is not None]
    if b and max(b) > 0.25:
        L += [f"**Shared machine:** other work kept {statistics.median(b):.2f} cores busy (median; largest "
              f"{max(b):.2f}) of {m['ncpu_affinity']}, measured between rounds while this run slept (/proc/stat): "
              "the all-core cells (and the spread) show that contention, not only the engines.", ""]
    if R.get("peer_skipped"):
        L += [f"**llama.cpp columns skipped:** {R['peer_skipped']}", ""]
    if R.get("ik_skipped"):
        L += [f"**ik_llama.cpp columns skipped:** {R['ik_skipped']}", ""]
    ik = any("ik-best" in d for n in S for d in S[n].values())
    L += ["Models (random weights with the real shapes, written by `bench/e2e/bigmodels.py`; weights = bytes a decode "
          "step streams: every layer matrix and the output matrix; MACs = int8 multiply-adds per token of the "
          "matmuls):", "", "| file | size | tensor types (bytes) | weights / token | MACs / token |", "|---|---|---|---|---|"]
    for f in R["files"]:
        w = f["work"]
        tys = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(w["bytes_by_type"].items()))
        L.append(f"| {os.path.basename(f['path'])} | {f['bytes'] / 2**30:.2f} GiB | {tys} | "
                 f"{w['weight_bytes_per_token'] / 1e6:.0f} MB | {w['matmul_macs_per_token'] / 1e9:.2f} G |")
    L += ["", "## Probes (same run, median over rounds)", "",
          "| threads | DRAM read GB/s | int8 peak GMAC/s | FMA peak GFLOP/s |", "|---|---|---|---|"]
    first = S[next(iter(S))] if S else {}
    for t in threads:
        vals = [S[n].get(str(t), {}) for n in S]
        L.append(f"| {t} | {fmt(median([v.get('read_gbps') for v in vals]))} | "
                 f"{fmt(median([v.get('int8_gmacs') for v in vals]), 0)} | {fmt(median([v.get('fma_gflops') for v in vals]), 0)} |")
    how = first.get(str(threads[0]), {}).get("probe_how", "")
    L += ["", f"DRAM read: a sum over {R.get('read_mib', 1024)} MiB of float32 ({how}), median of 7 passes; int8 peak: `cf_int8_peak` "
          "(native/kernels/probe.inc), best of ~2 ms runs on every thread at once; FMA peak: `cf_fma_peak`. "
          "1 thread pinned (`taskset -c 0`), more threads unpinned.", ""]
    head = [t for k in ("pp", "tg") for t in [f"{k}{PP if k == 'pp' else TG} cpufuse", f"{k}{PP if k == 'pp' else TG} "
            "llama.cpp", f"**{k} ratio**"] + ([f"{k}{PP if k == 'pp' else TG} ik_llama.cpp", f"**{k} ratio ik**"] if ik else [])]
    head += ["decode GB/s cpufuse / llama.cpp", "% DRAM read", "prompt GMAC/s cpufuse / llama.cpp", "% int8 peak"]
    L += ["## Speed (tokens/s, median over rounds; llama.cpp" + (", ik_llama.cpp" if ik else "") + " = the better of "
          "flash attention off / on; ratio = cpufuse / peer)", "",
          "| file | threads | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    spreads = []
    for f in R["files"]:
        name = os.path.basename(f["path"])
        for t in threads:
            d = S[name].get(str(t), {})
            c, b = d.get("cpufuse", {}), d.get("llamacpp-best", {})
            row = [name.replace("llama-", "").replace("-shapes", "").replace(".gguf", ""), str(t)]
            for key in (f"pp{PP}", f"tg{TG}"):
                a = c.get(key, {}).get("median")
                row.append(fmt(a, 2))
                for best in ("llamacpp-best", "ik-best") if ik else ("llamacpp-best",):
                    l_ = d.get(best, {}).get(key, {}).get("median")
                    fa = d.get(best, {}).get(key, {}).get("which", "")
                    row += [fmt(l_, 2) + (" (FA on)" if fa.endswith("on") else " (FA off)" if fa else ""),
                            f"**{a / l_:.2f}×**" if a and l_ else "–"]
            row += [f"{fmt(c.get('decode_gbps'))} / {fmt(b.get('decode_gbps'))}",
                    f"{fmt(c.get('decode_pct_read'), 0)} / {fmt(b.get('decode_pct_read'), 0)} %",
                    f"{fmt(c.get('prompt_gmacs'))} / {fmt(b.get('prompt_gmacs'))}",
                    f"{fmt(c.get('prompt_pct_int8'), 0)} / {fmt(b.get('prompt_pct_int8'), 0)} %"]
            L.append("| " + " | ".join(row) + " |")
            for e in ENGINES:
                for key in (f"pp{PP}", f"tg{TG}"):
                    x = d.get(e, {}).get(key)
                    if x and x.get("median"):
                        spreads.append((x["max"] - x["min"]) / x["median"])
    L += [""]
    if spreads:
        L += [f"Spread between rounds ((max − min) / median, over every engine and cell): median "
              f"{100 * statistics.median(spreads):.0f} %, largest {100 * max(spreads):.0f} %.", ""]
    fa_rows = []
    for f in R["files"]:
        name = os.path.basename(f["path"])
        for t in threads:
            d = S[name].get(str(t), {})
            parts = [f"{LABEL[e]} pp {fmt(d.get(e, {}).get(f'pp{PP}', {}).get('median'), 2)} / tg "
                     f"{fmt(d.get(e, {}).get(f'tg{TG}', {}).get('median'), 2)}" for e in ENGINES[1:] if e in d]
            if parts:
                fa_rows.append(f"- {name} × {t}: " + "; ".join(parts))
    if fa_rows:
        L += ["The peers with flash attention off and on (tok/s, pp512 / tg128):", ""] + fa_rows + [""]
    bad = [f"{n} × {t} {e}" for n in S for t in S[n] for e in ENGINES
           if isinstance(S[n][t].get(e), dict) and S[n][t][e].get("logits_finite") is False]
    L += [("Logits: **non-finite values** in " + ", ".join(bad)) if bad else
          ("Logits: every logits row read by the engines (the last of each pp eval and tg step) was finite"
           + (" (llama-bench reads none)." if lb else "."))]
    L += ["", "## Settings", "",
          f"- pp512: one eval of 512 tokens from an empty cache, after an untimed warm-up eval of {R['pp_warm']} tokens "
          f"(llama-bench: its warm-up run is a full pp512); {R['reps'][f'pp{PP}']} timed eval(s) per process. tg128: "
          f"128 single-token evals after a 1-token prompt, the next token given, after 16 untimed steps; "
          f"{R['reps'][f'tg{TG}']} timed run(s) per process. Wall time around the eval calls (llama-bench: its own "
          "timer around llama_decode).",
          f"- cpufuse: `Model.load(path, n_ctx={R['n_ctx']}, n_threads=k)` (q8 activations, f16 K/V, n_batch 512).",
          (f"- llama.cpp: `{R.get('llama_bench') or 'llama-bench'} -m FILE -p 512 -n 128 -t k -fa 0|1 -r R -o json` "
           "(n_batch 2048, n_ubatch 512, f16 K/V, mmap, repack on; random token ids; built by "
           "bench/llama_bench_build.sh from the llama.cpp vendored in llama-cpp-python 0.3.36)." if lb else
           "- llama.cpp: llama-cpp-python in its own venv and process (bench/e2e/peer.py): `Llama(n_ctx=1024, "
           "n_batch=512, n_ubatch=512, n_threads=k, n_threads_batch=k, flash_attn=…)`, f16 K/V, mmap, repack on."),
          "- 1 thread: the engine's process under `taskset -c 0`; more threads: unpinned.", ""]
    if ik:
        L[-1:-1] = [f"- ik_llama.cpp {peer.get('ik_version', '')}: `{R.get('ik_llama_bench') or 'llama-bench'} -m FILE -p 512 "
                    "-n 128 -t k -fa 0|1 -r R -o json -rtr 1` (run-time repack), built from IK_LLAMA_SRC with "
                    "cmake " + " ".join(IK_CMAKE) + ", target llama-bench; its rounds alternate with the others."]
    if peer.get("system_info"):
        L += [f"llama.cpp system info: `{peer['system_info'].strip()}`", ""]
    if R.get("errors"):
        L += ["Failures: " + "; ".join(f"{k}: {v[-200:]}" for k, v in R["errors"].items()), ""]
    if png_path:
        why = plot(R, png_path)
        if why is None:
            L += [f"![tok/s against threads]({os.path.basename(png_path)})", ""]
        else:
            L += [f"(chart skipped: {why})", ""]
    with open(md_path, "w") as fh:
        fh.write("\n".join(L))


def plot(R, path):
    """tok/s against threads, pp512 and tg128 panels, a colour per file, solid cpufuse, dashed
    llama.cpp (best of FA off / on); None when written, else the reason"""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except Exception as e:  # noqa: BLE001
        return f"matplotlib unavailable ({e})"
    from ..plot import OTHER
    S, threads = R["summary"], R["threads"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, title in ((axes[0], f"pp{PP}", "prompt, pp512"), (axes[1], f"tg{TG}", "decode, tg128")):
        for i, f in enumerate(R["files"]):
            name = os.path.basename(f["path"])
            lab = name.replace("llama-", "").replace("-shapes", "").replace(".gguf", "")
            for e, ls, mk in (("cpufuse", "-", "o"), ("llamacpp-best", "--", "s"), ("ik-best", ":", "^")):
                xs, ys = [], []
                for t in threads:
                    v = S[name].get(str(t), {}).get(e, {}).get(key, {}).get("median")
                    if v:
                        xs.append(t)
                        ys.append(v)
                if xs:
                    ax.plot(xs, ys, ls, marker=mk, color=OTHER[i % len(OTHER)],
                            label=f"{lab} {dict((c[1], c[2]) for c in PEER_COLS).get(e, 'cpufuse')}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(threads)
        ax.set_xticklabels([str(t) for t in threads])
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(   # every minor tick labelled on a short axis
            lambda v, _, ax=ax: f"{v:g}" if ax.get_ylim()[1] < 20 * ax.get_ylim()[0] or f"{v:g}"[0] in "25" else ""))
        ax.set_xlabel("threads")
        ax.set_ylabel("tokens/s")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7, loc="best")
    fig.suptitle(f"cpufuse (solid) vs llama.cpp (dashed), ik_llama.cpp (dotted) — {R['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.e2e.big", description=__doc__.split("\n\n")[0])
    ap.add_argument("--probe-worker", metavar="JOB", help=argparse.SUPPRESS)
    ap.add_argument("--models", default="1b", help="comma list of " + ",".join(bigmodels.SHAPES) + " (default 1b)")
    ap.add_argument("--types", default="all", help="comma list of " + ",".join(bigmodels.TYPES) + ", or all (default)")
    ap.add_argument("--threads", help="comma list, e.g. 1,2,4,8,16 or 1,all (default: 1 and every core in the affinity)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps-pp", type=int, default=1, help="timed pp512 evals per process (default 1)")
    ap.add_argument("--reps-tg", type=int, default=1, help="timed tg128 runs per process (default 1)")
    ap.add_argument("--pp-warm", type=int, default=64, help="tokens of the untimed warm-up prompt, which pages in "
                    "every weight (default 64; llama-bench's warm-up is always a full pp512)")
    ap.add_argument("--read-mib", type=int, default=1024, help="the DRAM read probe's buffer (MiB, default 1024)")
    ap.add_argument("--engines", help="comma list, a subset of " + ",".join(ENGINES))
    ap.add_argument("--llama-bench", metavar="PATH", help="run llama.cpp as this llama-bench binary "
                    "(bench/llama_bench_build.sh builds it) instead of llama-cpp-python")
    ap.add_argument("--ik-llama-src", metavar="DIR", default=os.environ.get("IK_LLAMA_SRC") or None,
                    help="an ik_llama.cpp checkout: build its llama-bench (into <--dir>/ik-llama-bench) and add its "
                    "columns (default $IK_LLAMA_SRC)")
    ap.add_argument("--peer-python", default=DEFAULT_PEER, help=f"interpreter with llama_cpp (default {DEFAULT_PEER})")
    ap.add_argument("--dir", help="the models' cache folder (bench/e2e/bigmodels.py; default $CPUFUSE_BENCH_MODELS "
                    f"or {bigmodels.DEFAULT_DIR})")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per engine process")
    ap.add_argument("--json", default=os.path.join(RESULTS, "e2e-big.json"))
    ap.add_argument("--md", default=os.path.join(RESULTS, "e2e-big.md"))
    ap.add_argument("--png", default=os.path.join(RESULTS, "e2e-big.png"))
    ap.add_argument("--from-json", metavar="P", help="only write --md and --png again from a run's JSON")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as fh:
            write_md(json.load(fh), args.md, args.png)
        return
    if args.probe_worker:
        with open(args.probe_worker) as fh:
            job = json.load(fh)
        sys.stdout.write("E2E_RESULT " + json.dumps(worker_probe(job)) + "\n")
        return
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    os.makedirs(os.path.dirname(os.path.abspath(args.md)), exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
