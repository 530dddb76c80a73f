"""End to end on real model shapes: cpufuse.llama against llama.cpp on synthetic 1B-8B GGUFs
(bench/README.md, "bench.e2e.big")."""
import argparse
import json
import os
import statistics
import subprocess
import time

from ..plot import plot_setup
from ..report import save, table
from ..timing import bench_env
from . import (DEFAULT_PEER, HERE, RESULTS, fmt, footer, header, machine, median, parse_threads, peer_status,
               per_round, ratio, run_job, run_rounds, spread_line, wall_line)

PP, TG, N_CTX = 512, 128, 1024
KEYS = (f"pp{PP}", f"tg{TG}")
ENGINES = ("cpufuse", "llamacpp-fa-off", "llamacpp-fa-on", "ik-fa-off", "ik-fa-on")
LABEL = {"cpufuse": "cpufuse", "cpufuse-unfused": "cpufuse fusion=False", "llamacpp-fa-off": "llama.cpp FA off",
         "llamacpp-fa-on": "llama.cpp FA on", "ik-fa-off": "ik_llama.cpp FA off", "ik-fa-on": "ik_llama.cpp FA on"}
# ik_llama.cpp's llama-bench: run-time repack, and its fused MoE gate/up (-fmoe; no effect on dense files)
IK_FLAGS = ["-rtr", "1", "-fmoe", "1"]
BEST = {"llamacpp-best": "llama.cpp", "ik-best": "ik_llama.cpp"}   # the peers' better FA setting per cell
RSS = ("maxrss_kb", "rss_after_import_kb", "rss_after_load_kb", "mem_available_before_load_kb",
       "mem_available_after_load_kb", "mem_available_end_kb", "rss_anon_end_kb", "rss_file_end_kb")
IK_CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"]
BUILD_HINT = {"llama-cpp-python": "make bench-e2e builds its venv (PEER_VENV; --peer-python PATH)",
              "llama-bench": "make llama-bench (bench/llama_bench_build.sh; --llama-bench PATH)"}
# Ordinary English prose (written for this benchmark), the teacher-forced text and the source of
# the benchmark's token ids.
TEXT = (
    "The town library stands at the corner of Elm Street and the old market square. It was built in "
    "1894 with money raised by the families who ran the mills along the river, and for most of its "
    "first century it was open only three afternoons a week. Today it opens every day except Sunday. "
    "On a typical morning, a few retired teachers read the newspapers by the front windows, a group "
    "of parents brings small children to the story hour, and students from the high school come in "
    "after lunch to use the computers and the quiet rooms upstairs.\n\n"
    "The head librarian, a patient woman named Margaret Hill, has worked there for twenty-two years. "
    "She says the biggest change she has seen is not the arrival of the internet but the way people "
    "use the building itself. \"People used to come here to borrow books and leave,\" she explained. "
    "\"Now they come to stay. They meet friends, they apply for jobs, they learn to speak English, "
    "and some of them just want a warm place to sit for an hour.\" Last winter the library started "
    "lending board games, tools and even fishing rods, and the waiting list for the sewing machine "
    "is now longer than the one for the most popular novel.\n\n"
    "Money is always a concern. The city council pays for the staff and the heating, but new books, "
    "repairs to the roof and the summer reading program depend on donations and on the annual book "
    "sale, which fills the parking lot every September. Volunteers sort thousands of used books in "
    "the basement for weeks before the sale, and the most valuable ones are set aside for a small "
    "auction. Two years ago a first edition of a famous children's book, found in a box of cookbooks, "
    "sold for enough money to replace every chair in the reading room.\n\n"
    "When asked what she would like the library to become in the next ten years, Margaret smiled and "
    "looked around the crowded room. \"Exactly what it is now,\" she said, \"only with a better roof.\""
)



def bench_tokens(path, n):
    """n token ids of TEXT, repeated; the file's tokenizer only (loading the model here would hold a second
    copy of its weights beside the engine's process)"""
    from cpufuse.llama.tokenizer import Tokenizer
    ids = Tokenizer.from_gguf(path).tokenize(TEXT, add_bos=False)
    return (ids * (n // len(ids) + 1))[:n]


def speed_job(engine, path, toks, t, pp, reps, peer, timeout=900, tg=TG, **extra):
    """one engine's speed process at t threads (1: pinned): cpufuse here, llama.cpp in the peer's venv"""
    job = {"job": "speed", "worker": "big", "engine": engine, "model": path, "tokens": toks, "threads": t,
           "pp": list(pp), "tg": tg, "reps": reps, "n_ctx": N_CTX, "flash_attn": engine.endswith("fa-on"), **extra}
    job["n_ctx"] = max(N_CTX, job.get("depth", 0) + max(pp) + tg + 16)
    if engine.startswith("llamacpp"):
        return run_job(job, peer, [os.path.join(HERE, "peer.py")], t == 1, t, timeout)
    return run_job(job, pin=t == 1, threads=t, timeout=timeout)


def worker(job):
    """a speed job's cpufuse engine, timed as bench/e2e/peer.py times llama.cpp; or the probes at
    job["threads"] threads: DRAM read bandwidth, the int8 and FMA peaks"""
    if job.get("job") == "speed":
        from .peer import _rss_kb, speed

        from cpufuse.llama.loader import mem_available
        mem = {"mem_available_before_load_kb": (mem_available() or 0) >> 10}

        def load():
            from cpufuse.llama import Model
            m = Model.load(job["model"], n_ctx=job["n_ctx"], n_threads=int(job["threads"]),
                           fusion=job["engine"] == "cpufuse", type_k=job.get("type_k", "f16"),
                           type_v=job.get("type_v", "f16"), repack=job.get("repack", True))
            mem.update(mem_available_after_load_kb=(mem_available() or 0) >> 10,
                       experts_mapped=bool(getattr(m, "experts_mapped", False)))
            return m.reset, m.eval
        res = speed(job, load)
        return dict(res, **mem, mem_available_end_kb=(mem_available() or 0) >> 10,
                    rss_anon_end_kb=_rss_kb("RssAnon:"), rss_file_end_kb=_rss_kb("RssFile:"))
    from .. import threads as threads_mod
    n, isa = int(job["threads"]), threads_mod.best_isa()
    return {"isa": isa, "threads": n, "read": threads_mod.read_bw_stats(n, nbytes=job["read_mib"] << 20, isa=isa),
            "int8": isa and threads_mod.int8_peak_stats(isa, n), "fma": isa and threads_mod.fma_peak_stats(isa, n)}


# the lines of a failing llama-bench's verbose log that say why (the loader's "error loading model: ...")
WHY_WORDS = ("error", "failed", "unknown", "wrong", "missing", "invalid", "not found", "unsupported", "exception")


def failure_text(cmd, p, timeout=300):
    """why a llama-bench run failed: it logs nothing but "failed to load model" unless verbose (-v), so a
    failed run is repeated with -v and the log lines that name an error are kept (else the output's tail)"""
    text = (p.stderr or p.stdout).strip()
    try:
        v = subprocess.run(cmd + ["-v"], capture_output=True, text=True, timeout=timeout, env=bench_env())
        text = (v.stderr + v.stdout).strip() or text
    except (OSError, subprocess.TimeoutExpired):
        pass
    why = list(dict.fromkeys(ln.strip() for ln in text.splitlines() if any(w in ln.lower() for w in WHY_WORDS)))
    specific = [ln for ln in why if "failed to load model" not in ln]   # the reason before the generic line
    return " | ".join(specific[-3:] or why[-2:])[-400:] if why else text[-400:]


def run_llama_bench(exe, path, threads, fa, reps, pin, timeout=1800, extra=(), pp=(PP,), tg=TG):
    """llama-bench (llama.cpp's or ik_llama.cpp's) for the prompt sizes pp (default 512; () for none) and tg
    (default 128), flash attention on or off (None: its default), at `threads` (None: its default):
    ({"wall": {"pp512": [tok/s per run], "tg128": [...]}, "raw": its records, "version"}, None) or (None, why)"""
    cmd = (["taskset", "-c", "0"] if pin else []) + [exe, "-m", path, "-p", ",".join(map(str, pp)) or "0",
                                                     "-n", str(tg), "-r", str(reps), "-o", "json", *extra]
    cmd += ([] if threads is None else ["-t", str(threads)]) + ([] if fa is None else ["-fa", str(int(fa))])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=bench_env())
        recs = json.loads(p.stdout) if not p.returncode else None
    except subprocess.TimeoutExpired:
        return None, f"timeout after {timeout}s"
    except ValueError:
        return None, f"unreadable output: {p.stdout[-300:]}"
    if recs is None:
        return None, f"exit {p.returncode}: {failure_text(cmd, p, timeout)}"
    wall = {(f"pp{r['n_prompt']}" if r.get("n_prompt") and not r.get("n_gen") else f"tg{r['n_gen']}"):
            [float(x) for x in r.get("samples_ts", [])] or [float(r["avg_ts"])] for r in recs}
    keep = ("build_commit", "build_number", "cpu_info", "backends", "n_threads", "flash_attn", "type_k", "type_v",
            "n_batch", "n_ubatch", "use_mmap", "model_type", "model_size")
    v = f"(build {recs[0].get('build_commit', '?')}, {recs[0].get('build_number', '?')})" if recs else ""
    return {"wall": wall, "raw": [{k: r.get(k) for k in keep} for r in recs], "version": v}, None


def build_ik(src, models_dir, timeout=7200):
    """ik_llama.cpp's llama-bench built from the checkout `src` into <models dir>/ik-llama-bench (outside
    the repository; cmake builds incrementally): (path, None) or (None, why not)"""
    from . import bigmodels
    src = os.path.abspath(os.path.expanduser(src))
    if not os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        return None, f"IK_LLAMA_SRC={src} has no CMakeLists.txt"
    bdir = os.path.join(bigmodels.models_dir(models_dir), "ik-llama-bench")
    for cmd in (["cmake", "-S", src, "-B", bdir, *IK_CMAKE],
                ["cmake", "--build", bdir, "--target", "llama-bench", "-j", str(len(os.sched_getaffinity(0)))]):
        print("bench.e2e.big: " + " ".join(cmd), flush=True)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"ik_llama.cpp build: {e}"
        if p.returncode:
            return None, f"ik_llama.cpp build: exit {p.returncode}: {(p.stderr or p.stdout).strip()[-600:]}"
    exe = os.path.join(bdir, "bin", "llama-bench")
    return (exe, None) if os.access(exe, os.X_OK) else (None, f"ik_llama.cpp build: no {exe}")


def run(args, files, engines, keys, reps, write):
    """Every file x thread count x engine (and the probes where the files have their `work`) in alternating
    rounds (run_rounds), each in its own process; the JSON and write(out, final) after every thread count of
    every round (a run stopped by a time limit leaves its results) and at the end. bench.e2e's runner too."""
    from .. import threads as threads_mod
    threads, pp = parse_threads(args.threads), [int(k[2:]) for k in keys if k.startswith("pp")]
    tg = int(tg_key(keys)[2:])
    ctk, ctv = getattr(args, "ctk", "f16"), getattr(args, "ctv", None) or getattr(args, "ctk", "f16")
    files = [dict(f, depth=d) for f in files for d in parse_depths(getattr(args, "depth", "0"))]
    exe = os.path.abspath(os.path.expanduser(args.llama_bench)) if args.llama_bench else None
    peer_kind = "llama-bench" if exe else "llama-cpp-python"
    why_peer = (None if os.access(exe, os.X_OK) else f"{exe} is not an executable file") if exe \
        else peer_status(args.peer_python)
    ik, why_ik = build_ik(args.ik_llama_src, args.dir) if args.ik_llama_src else (None, "IK_LLAMA_SRC not given")
    engines = [e for e in engines if not (why_peer and e.startswith("llamacpp")) and not (why_ik and e.startswith("ik"))
               and (not args.engines or e in args.engines.split(","))]
    if ctv != "f16" and ctv != "f32":   # llama.cpp takes a quantized V cache with flash attention only
        if any(e.endswith("fa-off") for e in engines):
            print(f"bench.e2e: FA-off peer columns skipped: a {ctv} V cache needs flash attention (-fa 1)", flush=True)
        engines = [e for e in engines if not e.endswith("fa-off")]
    jobs = engines + ["probe"] * bool(files[0].get("work"))
    t_start, la0 = time.time(), os.getloadavg()
    print(f"bench.e2e: {len(files)} file(s) x threads {threads} x {args.rounds} rounds, engines "
          f"{', '.join(engines)} (llama.cpp via {peer_kind}); load average {la0[0]:.2f}", flush=True)
    for who, why in (("llama.cpp", why_peer and f"{why_peer} ({BUILD_HINT[peer_kind]})"),
                     ("ik_llama.cpp", args.ik_llama_src and why_ik)):
        if why:
            print(f"bench.e2e: {who} columns skipped: {why}", flush=True)
    raw, errors, peer_info = {}, {}, {}
    busy = [threads_mod.busy_cores()]   # cores other work keeps busy (bench/threads.py), between rounds

    def report(final):
        done = [f for f in files if fname(f) in raw]
        out = {"complete": final, "machine": machine(), "load_avg_start": la0, "load_avg_end": os.getloadavg(),
               "busy_cores": busy, "seconds": time.time() - t_start, "rounds": args.rounds, "threads": threads,
               "keys": keys, "reps": reps, "cache_types": [ctk, ctv], "pp_warm": getattr(args, "pp_warm", None),
               "read_mib": getattr(args, "read_mib", 1024), "n_ctx": N_CTX,
               "no_repack": bool(getattr(args, "no_repack", False)),
               "peer_kind": peer_kind, "llama_bench": exe, "ik_llama_bench": ik,
               "ik_skipped": why_ik if args.ik_llama_src else None, "peer": peer_info, "peer_skipped": why_peer,
               "errors": errors, "files": done, "summary": summarize(done, raw, threads, engines, keys), "raw": raw}
        save(args.json, out)
        write(out, final)
        return out

    for f in files:
        name, depth = fname(f), f.get("depth", 0)
        toks = bench_tokens(f["path"], depth + max(pp) + tg + 8)

        def one(e, t):
            if e == "probe":
                return run_job({"worker": "big", "threads": t, "read_mib": args.read_mib}, pin=t == 1, threads=t)
            if e.startswith("cpufuse") or not exe and e.startswith("llamacpp"):
                res, err = speed_job(e, f["path"], toks, t, pp, reps, args.peer_python, args.timeout, tg,
                                     **({"pp_warm": args.pp_warm} if getattr(args, "pp_warm", None) else {}),
                                     **({"repack": False} if getattr(args, "no_repack", False) else {}),
                                     depth=depth, type_k=ctk, type_v=ctv)
            elif e.startswith("ik") and depth:   # ik_llama.cpp's llama-bench has no -d
                res, err = None, "ik_llama.cpp's llama-bench takes no -d (depth); its column is empty at depth > 0"
            else:
                extra = ["-d", str(depth)] * (not e.startswith("ik"))
                extra += ["-ctk", ctk, "-ctv", ctv] if (ctk, ctv) != ("f16", "f16") else []
                res, err = run_llama_bench(ik if e.startswith("ik") else exe, f["path"], t, e.endswith("on"),
                                           args.reps_pp, t == 1, args.timeout, IK_FLAGS * e.startswith("ik")
                                           + extra, pp or (PP,), tg)
            if res and "version" in res:
                peer_info.update({"ik_version": res["version"]} if e.startswith("ik") else
                                 {"version": res["version"], "system_info": res.get("system_info", ""),
                                  "raw": res.get("raw")})
            return res, err

        def line(e, res):
            if e == "probe":
                return (f"probes: DRAM read {res['read']['gbps']:.1f} GB/s, int8 "
                        f"{(res.get('int8') or {}).get('best', float('nan')):.0f} GMAC/s")
            return f"{LABEL[e]:17s} {wall_line(res, 2)}  logits finite {res.get('logits_finite', '–')}"

        def after():
            busy.append(threads_mod.busy_cores(0.3))
            report(False)
        raw[name] = {j: {str(t): [] for t in threads} for j in jobs}
        run_rounds(raw[name], errors, name, jobs, threads, args.rounds, one, line, after)
    out = report(True)
    print(f"bench.e2e: wrote {args.json}, {args.md} ({out['seconds'] / 60:.1f} min; load average "
          f"{la0[0]:.2f} -> {out['load_avg_end'][0]:.2f})")
    return out


def summarize(files, raw, threads, engines, keys=KEYS):
    """per file and thread count: each engine's per_round cells (and llama.cpp's own timings, the memory),
    the peers' better FA setting, the probes' medians and the derived rates (decode GB/s, prompt GMAC/s
    and their % of the probes)"""
    S = {}
    for f in files:
        name, w = fname(f), f.get("work")
        for t in threads:
            d = S.setdefault(name, {}).setdefault(str(t), {})
            pr = raw[name].get("probe", {}).get(str(t))
            if pr:
                d.update(read_gbps=median([p["read"]["gbps"] for p in pr]), probe_how=pr[0]["read"]["how"],
                         **{f"{k}_{u}": median([(p.get(k) or {}).get("best") for p in pr])
                            for k, u in (("int8", "gmacs"), ("fma", "gflops"))})
            for e in engines:
                rs = raw[name].get(e, {}).get(str(t))
                if rs:
                    d[e] = {k: per_round(rs, k) for k in keys if per_round(rs, k)}
                    for k in d[e]:
                        if rs[0].get("perf"):
                            d[e][k]["internal_median"] = median([median(r["perf"][k]) for r in rs])
                    d[e].update(logits_finite=all(r.get("logits_finite", True) for r in rs),
                                **{k[:-3] + "_mib": median([r[k] / 1024 for r in rs if k in r]) for k in RSS},
                                **({"experts_mapped": any(r["experts_mapped"] for r in rs)}
                                   if "experts_mapped" in rs[0] else {}))
            for best in BEST:
                for key in keys:
                    cands = [(d[e][key]["median"], e) for e in (best[:-4] + "fa-off", best[:-4] + "fa-on")
                             if key in d.get(e, {})]
                    if cands:
                        d.setdefault(best, {})[key] = dict(zip(("median", "which"), max(cands)))
            for e in ("cpufuse", *BEST) if w else ():
                de = d.get(e, {})
                tg, pp = (de.get(k, {}).get("median") for k in (tg_key(keys), prompt_key(keys)))
                if tg:
                    de["decode_gbps"] = w["weight_bytes_per_token"] * tg / 1e9
                    de["decode_pct_read"] = d.get("read_gbps") and 100 * de["decode_gbps"] / d["read_gbps"]
                if pp:
                    de["prompt_gmacs"] = w["matmul_macs_per_token"] * pp / 1e9
                    de["prompt_pct_int8"] = d.get("int8_gmacs") and 100 * de["prompt_gmacs"] / d["int8_gmacs"]
    return S


def tg_key(keys):
    """the decode key of the run (tg128 unless --tg)"""
    return next((k for k in keys if k.startswith("tg")), f"tg{TG}")


def prompt_key(keys):
    """the longest prompt of the run (its GMAC/s column and chart)"""
    return max((k for k in keys if k.startswith("pp")), key=lambda k: int(k[2:]))


def short(path, depth=0):
    name = os.path.basename(path).replace("llama-", "").replace("-shapes", "").replace(".gguf", "")
    return name + (f" @{depth}" if depth else "")


def fname(f):
    """a file row's key: the file's name, and its depth (--depth) when > 0"""
    return os.path.basename(f["path"]) + (f"@d{f['depth']}" if f.get("depth") else "")


def parse_depths(text):
    """--depth: a comma list of cache depths in tokens (llama-bench's -d)"""
    try:
        ds = sorted({int(d) for d in str(text).split(",")})
    except ValueError:
        raise SystemExit(f"--depth must be a comma list of token counts, e.g. 0,4096,16384, got {text!r}")
    if not ds or ds[0] < 0:
        raise SystemExit(f"--depth: depths must be >= 0, got {text!r}")
    return ds


def write_md(R, md_path, png_path=None):
    S, threads, peer, keys = R["summary"], R["threads"], R.get("peer") or {}, R.get("keys", KEYS)
    pps = [k for k in keys if k.startswith("pp")]
    lb = R["peer_kind"] == "llama-bench"
    ik = any("ik-best" in d for n in S for d in S[n].values())
    L = ["# cpufuse.llama vs llama.cpp on real model shapes (Llama 3, Gemma 3, Phi-4-mini) (`python -m bench.e2e.big`)",
         ""] + ([] if R.get("complete", True) else ["**Partial results** (written after every round; the run did not "
                                                    "finish).", ""])
    L += header(R, f"{R['peer_kind']} {peer.get('version', '')}")
    b = [x for x in R.get("busy_cores", []) if x is not None]
    if b and max(b) > 0.25:
        L += [f"**Shared machine:** other work kept {statistics.median(b):.2f} cores busy (median; largest "
              f"{max(b):.2f}) of {R['machine']['ncpu_affinity']}, measured between rounds while this run slept "
              "(/proc/stat): the all-core cells (and the spread) show that contention, not only the engines.", ""]
    for who, k in (("llama.cpp", "peer_skipped"), ("ik_llama.cpp", "ik_skipped")):
        if R.get(k):
            L += [f"**{who} columns skipped:** {R[k]}", ""]
    L += ["Models (random weights, real shapes, `bench/e2e/bigmodels.py`; weights and MACs per token: the matmuls'):", ""]
    L += table(["file", "size", "tensor types (bytes)", "weights / token", "MACs / token"],
               [[os.path.basename(f["path"]), f"{f['bytes'] / 2**30:.2f} GiB",
                 ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(f["work"]["bytes_by_type"].items())),
                 f"{f['work']['weight_bytes_per_token'] / 1e6:.0f} MB", f"{f['work']['matmul_macs_per_token'] / 1e9:.2f} G"]
                for f in R["files"]])
    L += ["", "## Probes (same run, median over rounds)", ""]
    L += table(["threads", "DRAM read GB/s", "int8 peak GMAC/s", "FMA peak GFLOP/s"],
               [[t] + [fmt(median([S[n].get(str(t), {}).get(k) for n in S]), nd) for k, nd in
                       (("read_gbps", 1), ("int8_gmacs", 0), ("fma_gflops", 0))] for t in threads])
    how = next((S[n][str(threads[0])].get("probe_how") for n in S if str(threads[0]) in S[n]), "")
    L += ["", f"DRAM read: a sum over {R.get('read_mib', 1024)} MiB ({how}); int8 and FMA peaks: `cf_int8_peak`, "
          "`cf_fma_peak` on every thread at once (bench/README.md, \"Probes\").", ""]
    bests = ["llamacpp-best"] + ["ik-best"] * ik
    head = [h for k in keys for h in [f"{k} cpufuse", f"{k} llama.cpp", f"**{k[:2]} ratio**"]
            + ([f"{k} ik_llama.cpp", f"**{k[:2]} ratio ik**"] if ik else [])]
    head += ["decode GB/s cpufuse / llama.cpp", "% DRAM read", "prompt GMAC/s cpufuse / llama.cpp", "% int8 peak"]
    rows, cells = [], []
    for f in R["files"]:
        for t in threads:
            d = S[fname(f)].get(str(t), {})
            c, bb = d.get("cpufuse", {}), d.get("llamacpp-best", {})
            row = [short(f["path"], f.get("depth", 0)), t]
            for key in keys:
                a = c.get(key, {}).get("median")
                row.append(fmt(a, 2))
                for best in bests:
                    v, fa = d.get(best, {}).get(key, {}).get("median"), d.get(best, {}).get(key, {}).get("which", "")
                    row += [fmt(v, 2) + (" (FA on)" if fa.endswith("on") else " (FA off)" if fa else ""),
                            f"**{ratio(a, v)}**"]
            row += [f"{fmt(c.get(k), nd)} / {fmt(bb.get(k), nd)}" + (" %" if nd == 0 else "") for k, nd in
                    (("decode_gbps", 1), ("decode_pct_read", 0), ("prompt_gmacs", 1), ("prompt_pct_int8", 0))]
            rows.append(row)
            cells += [d.get(e, {}).get(k) for e in ENGINES for k in keys]
    L += ["## Speed (tokens/s, median over rounds; llama.cpp" + (", ik_llama.cpp" if ik else "") + " = the better "
          "of flash attention off / on; ratio = cpufuse / peer)", ""]
    L += table(["file", "threads"] + head, rows)
    L += [""] + spread_line(cells)
    L += memory_lines(R, threads)
    bad = [f"{n} × {t} {e}" for n in S for t in S[n] for e in ENGINES
           if isinstance(S[n][t].get(e), dict) and S[n][t][e].get("logits_finite") is False]
    L += [("Logits: **non-finite values** in " + ", ".join(bad)) if bad else
          ("Logits: every logits row read by the engines (the last of each pp eval and tg step) was finite"
           + (" (llama-bench reads none)." if lb else "."))]
    L += ["", "## Settings (bench/README.md, \"bench.e2e.big\")", "",
          f"- {', '.join(pps)} after an untimed warm-up eval of {R['pp_warm']} tokens (llama-bench: a full pp512), "
          f"{R['reps'][pps[0]]} timed eval(s) per process; {tg_key(keys)} after 16 untimed steps, "
          f"{R['reps'][tg_key(keys)]} timed "
          f"run(s) per process. cpufuse: `Model.load(path, n_ctx={R['n_ctx']}, n_threads=k)`.",
          f"- llama.cpp: `{R.get('llama_bench')} -m FILE -p {','.join(k[2:] for k in pps)} -n {tg_key(keys)[2:]} "
          "-t k -fa 0|1 -r R "
          "-o json`" if lb else
          "- llama.cpp: llama-cpp-python (bench/e2e/peer.py), `Llama(n_ctx=1024, n_batch=512, n_threads=k, "
          "n_threads_batch=k, flash_attn=…)`.",
          f"- KV cache K/V types {'/'.join(R.get('cache_types') or ['f16', 'f16'])} for every engine (`-ctk/-ctv`). "
          "A row `name @D` is at depth D: pp appends its prompt to a cache filled with D tokens (untimed), tg "
          "decodes after them (llama-bench `-d D`); n_ctx grows to hold them."]
    if ik:
        L += [f"- ik_llama.cpp {peer.get('ik_version', '')}: `{R.get('ik_llama_bench')} ... {' '.join(IK_FLAGS)}`, built from "
              "IK_LLAMA_SRC with cmake " + " ".join(IK_CMAKE) + "."]
    L += ["- 1 thread: the engine's process under `taskset -c 0`; more threads: unpinned.", ""] + footer(R)
    if png_path:
        why = plot(R, png_path)
        L += [f"![tok/s against threads]({os.path.basename(png_path)})" if why is None else f"(chart skipped: {why})", ""]
    save(md_path, "\n".join(L))


def memory_lines(R, threads):
    """cpufuse's memory per file and thread count (median over rounds): RSS after load, the peak (VmHWM),
    MemAvailable before and after load and at the end, and whether the experts stayed mapped"""
    S, rows = R["summary"], []
    for f in R["files"]:
        for t in threads:
            c = S[fname(f)].get(str(t), {}).get("cpufuse", {})
            if c.get("maxrss_mib") is not None:
                rows.append([short(f["path"], f.get("depth", 0)), t] + [fmt(c.get(k) and c[k] / 1024, 2) for k in (
                    "rss_after_load_mib", "maxrss_mib", "rss_anon_end_mib", "rss_file_end_mib",
                    "mem_available_before_load_mib", "mem_available_after_load_mib", "mem_available_end_mib")]
                            + [{True: "yes", False: "no"}.get(c.get("experts_mapped"), "–")])
    if not rows:
        return []
    return (["", f"## Memory (cpufuse, GiB, median over rounds; repack={not R.get('no_repack')})", ""]
            + table(["file", "threads", "RSS after load", "peak RSS (VmHWM)", "at the end: anonymous", "file pages",
                     "MemAvailable before load", "after load", "at the end", "experts mapped"], rows)
            + ["", "RSS counts the file's mapped pages a run touched (reclaimable page cache) as well as anonymous "
               "memory; MemAvailable is the machine's, other processes included.", ""])


COLOURS = ["#6d4c41", "#00838f", "#ad1457", "#827717", "#4527a0", "#ef6c00", "#546e7a", "#2e7d32"]


def plot(R, path):
    """tok/s against threads, the longest prompt's and tg128 panels, a colour per file, solid cpufuse, dashed llama.cpp,
    dotted ik_llama.cpp (the better of FA off / on); None when written, else the reason"""
    plt, why = plot_setup()
    if why:
        return why
    from matplotlib.ticker import FuncFormatter
    S, threads, pk, tk = R["summary"], R["threads"], prompt_key(R.get("keys", KEYS)), tg_key(R.get("keys", KEYS))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, title in ((axes[0], pk, f"prompt, {pk}"), (axes[1], tk, f"decode, {tk}")):
        for i, f in enumerate(R["files"]):
            name = fname(f)
            for e, ls, mk in (("cpufuse", "-", "o"), ("llamacpp-best", "--", "s"), ("ik-best", ":", "^")):
                pts = [(t, S[name].get(str(t), {}).get(e, {}).get(key, {}).get("median")) for t in threads]
                pts = [(t, v) for t, v in pts if v]
                if pts:
                    ax.plot(*zip(*pts), ls, marker=mk, color=COLOURS[i % len(COLOURS)],
                            label=f"{short(f['path'], f.get('depth', 0))} {BEST.get(e, 'cpufuse')}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(threads, [str(t) for t in threads])
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(   # every minor tick labelled on a short axis
            lambda v, _, ax=ax: f"{v:g}" if ax.get_ylim()[1] < 20 * ax.get_ylim()[0] or f"{v:g}"[0] in "25" else ""))
        ax.set(xlabel="threads", ylabel="tokens/s", title=title)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7, loc="best")
    fig.suptitle(f"cpufuse (solid) vs llama.cpp (dashed), ik_llama.cpp (dotted) — {R['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_args(ap, engines, timeout):
    """the runner's options, shared with `python -m bench.e2e`"""
    ap.add_argument("--threads", help="comma list, e.g. 1,2,4,8,16 or 1,all (default: 1 and every core in the affinity)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", help="comma list, a subset of " + ",".join(engines))
    ap.add_argument("--peer-python", default=DEFAULT_PEER, help=f"interpreter with llama_cpp (default {DEFAULT_PEER})")
    ap.add_argument("--llama-bench", metavar="PATH", help="run llama.cpp as this llama-bench binary "
                    "(bench/llama_bench_build.sh builds it) instead of llama-cpp-python")
    ap.add_argument("--timeout", type=int, default=timeout, help=f"seconds per engine process (default {timeout})")
    ap.add_argument("--depth", default="0", help="comma list of KV cache depths in tokens, e.g. 0,4096,16384,32768 "
                    "(llama-bench's -d): pp appends its prompt to a cache filled to that depth (untimed), tg "
                    "decodes after it (default 0)")
    ap.add_argument("--ctk", choices=("f16", "f32", "q8_0", "q4_0"), default="f16",
                    help="the K cache's type, for every engine (llama-bench's -ctk; default f16)")
    ap.add_argument("--ctv", choices=("f16", "f32", "q8_0", "q4_0"), default=None,
                    help="the V cache's type (default: --ctk; a quantized V runs the peers with FA on only)")


def main(argv=None):
    from . import bigmodels
    ap = argparse.ArgumentParser(prog="python -m bench.e2e.big", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="1b", help="comma list of " + ",".join(bigmodels.SHAPES) + " (default 1b)")
    ap.add_argument("--types", default="all", help="comma list of " + ",".join(bigmodels.TYPES) + ", or all (default)")
    ap.add_argument("--pure", action="store_true", help="the one-type files (every 2-D weight of the type, the head "
                    "included: bench.e2e.bigmodels --pure) instead of the real-shape mix")
    run_args(ap, ENGINES, 1800)
    ap.add_argument("--pp", default=str(PP), help=f"comma list of prompt lengths (default {PP}; e.g. 128,512)")
    ap.add_argument("--reps-pp", type=int, default=1, help="timed evals per prompt length and process (default 1)")
    ap.add_argument("--tg", type=int, default=TG, help=f"decode steps of the tg run (default {TG})")
    ap.add_argument("--reps-tg", type=int, default=1, help="timed tg runs per process (default 1)")
    ap.add_argument("--no-repack", action="store_true", help="cpufuse: Model.load(repack=False), every weight "
                    "mapped from the file (docs/moe.md, \"Memory\")")
    ap.add_argument("--pp-warm", type=int, default=64, help="tokens of the untimed warm-up prompt, which pages in "
                    "every weight (default 64; llama-bench's warm-up is always a full pp512)")
    ap.add_argument("--read-mib", type=int, default=1024, help="the DRAM read probe's buffer (MiB, default 1024)")
    ap.add_argument("--ik-llama-src", metavar="DIR", default=os.environ.get("IK_LLAMA_SRC") or None,
                    help="an ik_llama.cpp checkout: build its llama-bench (into <--dir>/ik-llama-bench) and add its "
                    "columns (default $IK_LLAMA_SRC)")
    ap.add_argument("--dir", help="the models' cache folder (default $CPUFUSE_BENCH_MODELS or "
                    f"{bigmodels.DEFAULT_DIR})")
    for ext in ("json", "md", "png"):
        ap.add_argument(f"--{ext}", default=os.path.join(RESULTS, f"e2e-big.{ext}"))
    ap.add_argument("--from-json", metavar="P", help="only write --md and --png again from a run's JSON")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as fh:
            return write_md(json.load(fh), args.md, args.png)
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    os.makedirs(os.path.dirname(os.path.abspath(args.md)), exist_ok=True)
    files = [{"shape": shape, "type": qt, "path": (path := bigmodels.ensure(shape, qt, args.dir, pure=args.pure)),
              "bytes": os.path.getsize(path), "work": bigmodels.work(shape, qt, args.pure)}
             for shape in bigmodels.parse_list(args.models, list(bigmodels.SHAPES), "models")
             for qt in bigmodels.parse_list(args.types, list(bigmodels.TYPES), "types")]
    try:
        pps = sorted({int(p) for p in args.pp.split(",")})
    except ValueError:
        raise SystemExit(f"--pp must be a comma list of prompt lengths, got {args.pp!r}")
    if not 1 <= args.tg <= N_CTX // 2:
        raise SystemExit(f"--tg: decode steps must be 1..{N_CTX // 2}, got {args.tg}")
    if not pps or min(pps) < 1 or max(pps) + args.tg + 8 > N_CTX:
        raise SystemExit(f"--pp: prompt lengths must be 1..{N_CTX - args.tg - 8}, got {args.pp!r}")
    keys = tuple(f"pp{p}" for p in pps) + (f"tg{args.tg}",)
    run(args, files, ENGINES, keys, {**{k: args.reps_pp for k in keys[:-1]}, keys[-1]: args.reps_tg},
        lambda out, final: write_md(out, args.md, args.png if final else None))


if __name__ == "__main__":
    main()
