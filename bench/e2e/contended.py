"""The contended case (issue 42 item 5): decode (tg) at each engine's DEFAULT thread count, on a quiet
machine and beside one CPU-bound competitor process per two cores (a plain busy loop), cpufuse against
llama.cpp on the same file, quiet and contended phases alternating round by round. The figure of merit
is each engine's contended / quiet ratio: cpufuse's must be no worse than llama.cpp's.

    python -m bench.e2e --contended --model PATH [--tg 32] [--rounds 3] [--settle 5]
                        [--llama-bench PATH | --peer-python PY]

Default thread counts: cpufuse `Model.load(n_threads=None)` (the affinity's cores less their share of
the load, cpufuse/_dispatch.py default_threads), llama-bench without -t (llama.cpp's
cpu_get_num_math: the physical cores, whatever the load); without --llama-bench, llama-cpp-python
(peer.py) given that same count. Each measurement is its own process: the competitors run through
the whole contended phase, started `--settle` seconds before its first measurement."""
import os
import subprocess
import sys
import time

from ..report import save, table
from . import HERE, NCPU, fmt, machine, median, model_path, peer_status, run_job

ENGINES = ("cpufuse", "llama.cpp")
BUSY = "while True:\n    pass\n"


def llamacpp_default_threads():
    """llama.cpp's default thread count on Linux (common_cpu_get_num_physical_cores, what
    cpu_get_num_math returns on x86 without hybrid cores): the distinct thread_siblings sets"""
    sib, cpu = set(), 0
    while True:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings") as f:
                sib.add(f.readline().strip())
        except OSError:
            break
        cpu += 1
    return len(sib) or os.cpu_count() or 1


class Competitors:
    """n busy-loop processes (plain Python `while True: pass`) for the life of the `with` block, after
    `settle` seconds; stopped (terminate, then kill) on exit"""

    def __init__(self, n, settle=0.0):
        self.n, self.settle, self.procs = n, settle, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(self.n)]
        if self.n and self.settle > 0:
            time.sleep(self.settle)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


def worker(job):
    """cpufuse's decode at its default thread count (python -m bench.e2e --worker), timed by peer.speed"""
    from .peer import speed
    got = {}

    def load():
        from cpufuse.llama import Model
        m = Model.load(job["model"], n_ctx=job["n_ctx"], n_threads=None)
        import cpufuse
        got["threads"] = m.n_threads or cpufuse.get_num_threads()   # the default, set at import
        return m.reset, m.eval
    res = speed(job, load)
    res.update(got)
    return res


def llama_bench(exe, path, tg, reps, timeout):
    """llama-bench -p 0 -n tg at its default thread count and flash attention setting: ({"wall":
    {"tgN": [tok/s]}, "threads"}, None) or (None, why)"""
    from .big import run_llama_bench
    res, err = run_llama_bench(exe, path, None, None, reps, False, timeout, pp=(), tg=tg)
    if res:
        res.update(threads=(res["raw"] or [{}])[-1].get("n_threads"), version=f"llama-bench {res['version']}")
    return res, err


def one(engine, args, path, toks):
    tg, reps = args.tg, args.tg_reps
    job = {"job": "speed", "model": path, "tokens": toks, "pp": [], "tg": tg, "reps": {f"tg{tg}": reps},
           "n_ctx": len(toks) + 16}
    if engine == "cpufuse":
        return run_job(dict(job, worker="contended"), timeout=args.timeout)
    if args.llama_bench:
        return llama_bench(args.llama_bench, path, tg, reps, args.timeout)
    t = llamacpp_default_threads()
    res, err = run_job(dict(job, threads=t), args.peer_python, [os.path.join(HERE, "peer.py")], False, t,
                       args.timeout)
    if res:
        res.update(threads=t, version=f"llama-cpp-python {res.get('version', '?')}")
    return res, err


def run(args):
    from .big import bench_tokens
    path = model_path(args.model)
    if args.llama_bench:
        args.llama_bench = os.path.abspath(os.path.expanduser(args.llama_bench))
        why = None if os.access(args.llama_bench, os.X_OK) else f"{args.llama_bench} is not an executable file"
    else:
        why = peer_status(args.peer_python)
    engines = [e for e in ENGINES if not (why and e != "cpufuse")]
    if why:
        print(f"bench.e2e --contended: llama.cpp skipped: {why}", flush=True)
    n_comp = max(1, NCPU // 2)
    toks = bench_tokens(path, args.tg + 32)
    key = f"tg{args.tg}"
    raw = {ph: {e: [] for e in engines} for ph in ("quiet", "contended")}
    errors, t0, la0 = {}, time.time(), os.getloadavg()
    print(f"bench.e2e --contended: {os.path.basename(path)}, tg {args.tg} x {args.tg_reps}, {args.rounds} rounds, "
          f"{n_comp} competitor(s) on {NCPU} cores; load average {la0[0]:.2f}", flush=True)

    def report(final):
        out = {"complete": final, "machine": machine(), "model": path, "bytes": os.path.getsize(path), "key": key,
               "tg": args.tg, "tg_reps": args.tg_reps, "rounds": args.rounds, "competitors": n_comp,
               "settle": args.settle, "llama_bench": args.llama_bench, "peer_skipped": why,
               "load_avg_start": la0, "load_avg_end": os.getloadavg(), "seconds": time.time() - t0,
               "errors": errors, "summary": summarize(raw, engines, key), "raw": raw}
        save(args.json, out)
        save(args.md, "\n".join(markdown(out)))
        return out

    for rnd in range(args.rounds):
        for ph in (("quiet", "contended") if rnd % 2 == 0 else ("contended", "quiet")):
            with Competitors(n_comp if ph == "contended" else 0, args.settle):
                k = rnd % len(engines)
                for e in engines[k:] + engines[:k]:
                    s, la = time.perf_counter(), os.getloadavg()
                    res, err = one(e, args, path, toks)
                    if err:
                        errors.setdefault(f"{ph} {e}", err)
                        print(f"  round {rnd + 1} {ph:9s} {e:9s} FAILED {err[-300:]}", flush=True)
                        continue
                    res.update(round=rnd, seconds=time.perf_counter() - s, load_avg=la)
                    raw[ph][e].append(res)
                    print(f"  round {rnd + 1} {ph:9s} {e:9s} {key} {fmt(median(res['wall'][key]), 2):>7} tok/s, "
                          f"{res.get('threads')} threads, load {res['load_avg'][0]:.1f} ({res['seconds']:.0f} s)",
                          flush=True)
        report(False)
    out = report(True)
    for e, d in out["summary"].items():
        print(f"bench.e2e --contended: {e}: quiet {fmt(d['quiet'], 2)}, contended {fmt(d['contended'], 2)} tok/s, "
              f"contended/quiet {fmt(d['ratio'], 3)}", flush=True)
    print(f"bench.e2e --contended: wrote {args.json}, {args.md} ({out['seconds'] / 60:.1f} min; load average "
          f"{la0[0]:.2f} -> {out['load_avg_end'][0]:.2f})", flush=True)
    return out


def summarize(raw, engines, key):
    """per engine: the median tok/s quiet and contended, their ratio, the ratio in each round (the
    two phases of one round are next to each other in time), the thread counts used"""
    S = {}
    for e in engines:
        q, c = ({r["round"]: median(r["wall"][key]) for r in raw[ph][e]} for ph in ("quiet", "contended"))
        mq, mc = median(list(q.values())), median(list(c.values()))
        S[e] = {"quiet": mq, "contended": mc, "ratio": mc / mq if mq and mc else None,
                "round_ratios": [c[r] / q[r] for r in sorted(q) if r in c and q[r]],
                "threads_quiet": sorted({r.get("threads") for r in raw["quiet"][e]}, key=str),
                "threads_contended": sorted({r.get("threads") for r in raw["contended"][e]}, key=str),
                "version": next((r["version"] for ph in raw for r in raw[ph][e] if r.get("version")), None)}
    return S


def markdown(R):
    S, m = R["summary"], R["machine"]
    L = ["# Decode on a contended machine (`python -m bench.e2e --contended`)", "",
         f"Model `{os.path.basename(R['model'])}` ({R['bytes'] / 2**20:.0f} MiB). Machine: {m['cpu']}, "
         f"{m['ncpu_affinity']} CPUs in the affinity, cpufuse ISA {m['cpufuse_isa']}. Load average at start "
         f"{R['load_avg_start'][0]:.2f}, at end {R['load_avg_end'][0]:.2f}. {R['rounds']} rounds, quiet and contended "
         f"phases alternating (each measurement its own process); contended = {R['competitors']} busy-loop "
         f"process(es), started {R['settle']:g} s before the phase. tg {R['tg']} after a 1-token prompt, "
         f"{R['tg_reps']} timed run(s) per process after an untimed one. Run time {R['seconds'] / 60:.1f} min.", ""]
    if R.get("peer_skipped"):
        L += [f"**llama.cpp skipped:** {R['peer_skipped']}", ""]
    L += table(["engine", "threads quiet / contended", f"quiet {R['key']} tok/s", "contended tok/s",
                "contended / quiet", "per round"],
               [[e + (f" ({d['version']})" if d.get("version") and e != "cpufuse" else ""),
                 f"{','.join(map(str, d['threads_quiet']))} / {','.join(map(str, d['threads_contended']))}",
                 fmt(d["quiet"], 2), fmt(d["contended"], 2), f"**{fmt(d['ratio'], 3)}**",
                 ", ".join(f"{x:.3f}" for x in d["round_ratios"])] for e, d in S.items()]) + [""]
    c, p = (S.get(e, {}).get("ratio") for e in ENGINES)
    if c and p:
        L += [f"cpufuse's contended/quiet ratio {c:.3f} against llama.cpp's {p:.3f}: the target (no worse) is "
              f"**{'met' if c >= p else 'NOT met'}**.", ""]
    if R.get("errors"):
        L += ["Failures: " + "; ".join(f"{k}: {v[-200:]}" for k, v in R["errors"].items()), ""]
    return L
