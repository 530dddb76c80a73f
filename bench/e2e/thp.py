"""Huge pages for the repacked panels, A/B in one process (`python -m bench.e2e.thp`): the model loaded
twice, its panels on 4 KiB pages (CPUFUSE_HUGEPAGES=0) and on 2 MiB pages (=1, the default); then
decode rounds on the two alternating, and the read probe over the very same panel buffers (and over a
buffer of ones the same size, on the same pages), so the page size's effect on the stream shows apart
from the kernels. The AnonHugePages (/proc/self/smaps) of the panels' mappings after each load show
which pages were taken. Each thread count runs in its own process (1 thread pinned to core 0; --here:
in this process, pinned by the caller, e.g. `taskset -c 1`)."""
import argparse
import ctypes
import os
import re
import statistics
import sys
import time

import numpy as np

from ..report import save, table
from . import parse_threads, run_job
from . import bigmodels

MODES = ("0", "1")       # CPUFUSE_HUGEPAGES: 4 KiB, 2 MiB


def rollup():
    """{field: kB} of /proc/self/smaps_rollup ({} where there is none)"""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return {m.group(1): int(m.group(2)) for m in (re.match(r"(\w+):\s+(\d+) kB", x) for x in f) if m}
    except OSError:
        return {}


def panels(m):
    """the model's repacked weight buffers, in the order a token reads them"""
    ws = [w for L in m.layers for w in vars(L).values() if hasattr(w, "n_in")] + [m.output]
    return [w.raw for w in ws if getattr(w, "layout", "gguf") == "p16"]


def spans(bufs):
    """uint64 views over the address ranges the buffers fill, neighbours closer than 4 KiB merged (an
    arena's panels lie back to back in a few chunks, so the probe reads them in a few long runs); the
    views own nothing: the caller keeps the buffers alive"""
    out = []
    for lo, hi in sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in bufs):
        if out and out[-1][1] <= lo < out[-1][1] + 4096:
            out[-1][1] = hi
        else:
            out.append([lo, hi])
    return [np.frombuffer((ctypes.c_uint64 * ((hi - lo) // 8)).from_address(lo), np.uint64) for lo, hi in out]


def int_reader(nth):
    """f(list of uint64 arrays): numpy's integer sum over them, split over nth Python threads (numpy
    releases the GIL): a read probe that does no float work on the panels' bit patterns"""
    if nth <= 1:
        return lambda vs: [np.add.reduce(v) for v in vs]
    import concurrent.futures
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=nth)

    def read(vs):
        parts = [v[v.size * i // nth:v.size * (i + 1) // nth] for v in vs for i in range(nth)]
        list(pool.map(np.add.reduce, parts))
    return read


def float_reader(nth, isa):
    """f(float32 array): one pass of cpufuse's read probe (cf_read_sum) over it on nth threads"""
    from cpufuse import _backend, _registry
    f, ffi = _registry.table("read_sum")[isa], _backend.ffi
    return lambda a: f(ffi.cast("const float *", a.ctypes.data), a.size, nth)


def worker(job):
    import cpufuse
    from cpufuse import _pages
    from cpufuse.llama import Model
    nth, n_prompt, steps, rounds = job["threads"], job["prompt"], job["steps"], job["rounds"]
    isa = cpufuse.info()["isa"]
    iread, fread = int_reader(nth), float_reader(nth, isa)
    res = {"threads": nth, "isa": isa, "thp": _pages.thp(), "modes": {}}
    models, ones, old = {}, {}, os.environ.get(_pages.ENV)
    try:
        for mode in MODES:
            os.environ[_pages.ENV] = mode
            h0 = rollup().get("AnonHugePages", 0)
            m = Model.load(job["model"], n_ctx=max(n_prompt, 16) + steps + 8, n_threads=nth, n_batch=max(n_prompt, 16))
            h1 = rollup().get("AnonHugePages", 0)
            ps = panels(m)
            nb = sum(a.nbytes for a in ps)
            with _pages.arena():
                ones[mode] = _pages.empty(nb // 4 * 4).view(np.float32)
            ones[mode][:] = 1.0
            models[mode] = m, ps, spans(ps)
            res["modes"][mode] = {"panel_bytes": nb, "huge_kib_after_load": h1 - h0,
                                  "panel_huge_bytes": _pages.coverage(ps)[0], "decode_ms": [], "cpu_ms": [],
                                  "probe_panels_gbps": [], "probe_ones_gbps": [], "probe_panels_cpu_gbps": [],
                                  "probe_ones_cpu_gbps": []}
    finally:
        if old is None:
            os.environ.pop(_pages.ENV, None)
        else:
            os.environ[_pages.ENV] = old
    n_vocab = models["1"][0].hparams.n_vocab
    toks = [int(t) for t in np.random.default_rng(0).integers(10, n_vocab - 10, size=n_prompt + steps + 17)]
    for m, _, _ in models.values():         # warm-up: the plans compile, the buffers fault in
        m.eval(toks[:16])
        m.eval([toks[16]])
        m.reset()
    for r in range(rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            (m, _, ps), st = models[mode], res["modes"][mode]
            m.reset()
            m.eval(toks[:n_prompt])
            t0, c0 = time.perf_counter_ns(), time.process_time_ns()
            for t in toks[n_prompt:n_prompt + steps]:
                m.eval([t])
            st["decode_ms"].append((time.perf_counter_ns() - t0) / steps / 1e6)
            st["cpu_ms"].append((time.process_time_ns() - c0) / steps / 1e6)
            for key, fn in (("probe_panels", lambda: iread(ps)), ("probe_ones", lambda: fread(ones[mode]))):
                t0, c0 = time.perf_counter_ns(), time.process_time_ns()
                fn()
                st[key + "_gbps"].append(st["panel_bytes"] / (time.perf_counter_ns() - t0))
                st[key + "_cpu_gbps"].append(st["panel_bytes"] * nth / (time.process_time_ns() - c0))
    res["os_threads"] = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None
    return res


FIELDS = ("decode_ms", "cpu_ms", "probe_panels_gbps", "probe_ones_gbps", "probe_panels_cpu_gbps",
          "probe_ones_cpu_gbps")


def _rounds(r):
    m0, m1, t = r["modes"]["0"], r["modes"]["1"], r["threads"]
    return f"{t}T " + ", ".join(f"({a:.1f}, {b:.1f} | {c / t:.1f}, {d / t:.1f})" for a, b, c, d in
                                zip(m0["decode_ms"], m1["decode_ms"], m0["cpu_ms"], m1["cpu_ms"]))


def markdown(model, R, n_prompt, steps, rounds):
    L = [f"# Huge pages for the repacked panels: `{model}` (`python -m bench.e2e.thp`)", "",
         f"One process per thread count; the model loaded twice (CPUFUSE_HUGEPAGES=0: 4 KiB pages, =1: 2 MiB), "
         f"{rounds} rounds alternating, each a {n_prompt}-token prompt then {steps} decode steps; medians. "
         "Probes, after each round: numpy's integer sum over the same panel buffers (Python threads), and "
         "cf_read_sum over ones of the same size on the same pages. wall / CPU: rates by the clock and by "
         "the process's CPU time (÷ threads), the latter for a shared machine.", ""]
    rows = []
    for r in R:
        med = {k: {f: statistics.median(v[f]) for f in FIELDS} for k, v in r["modes"].items()}
        for mode in MODES:
            s, d = r["modes"][mode], med[mode]
            gbs = s["panel_bytes"] / d["decode_ms"] / 1e6
            rows.append([r["threads"], "2 MiB" if mode == "1" else "4 KiB",
                         f"{s['panel_huge_bytes'] / 2**20:.0f} / {s['panel_bytes'] / 2**20:.0f}",
                         f"{d['decode_ms']:.2f} / {d['cpu_ms'] / r['threads']:.2f}", f"{1e3 / d['decode_ms']:.1f}",
                         f"{gbs:.1f}", f"{d['probe_panels_gbps']:.1f} / {d['probe_panels_cpu_gbps']:.1f}",
                         f"{d['probe_ones_gbps']:.1f} / {d['probe_ones_cpu_gbps']:.1f}",
                         f"{100 * gbs / d['probe_ones_gbps']:.0f} %"])
        x = {f: med["0"][f] / med["1"][f] if f.endswith("ms") else med["1"][f] / med["0"][f] for f in FIELDS}
        rows.append([r["threads"], "**2M ÷ 4K**", "", f"**{x['decode_ms']:.3f}× / {x['cpu_ms']:.3f}×**", "", "",
                     f"{x['probe_panels_gbps']:.3f}× / {x['probe_panels_cpu_gbps']:.3f}×",
                     f"{x['probe_ones_gbps']:.3f}× / {x['probe_ones_cpu_gbps']:.3f}×", ""])
    L += table(["threads", "pages", "panel MiB on huge pages / panel MiB", "decode ms / token, wall / CPU",
                "tok/s", "decode GB/s (panels)", "probe GB/s, panels, wall / CPU", "probe GB/s, ones, wall / CPU",
                "decode ÷ probe (ones, wall)"], rows, "---:")
    t = R[0]["thp"] if R else {}
    L += ["", f"THP: enabled `{t.get('enabled')}`, defrag `{t.get('defrag')}`; ISA {R[0]['isa'] if R else '–'}; "
          "OS threads in the process after the rounds: " + ", ".join(f"{r['os_threads']} at {r['threads']}T" for r in R)
          + " (1 thread: cf_parallel_for runs the chunks in the caller, no pool worker exists). "
          "Speed-ups read 2 MiB over 4 KiB (> 1: huge pages faster).", "",
          "Per round, decode ms / token (4 KiB, 2 MiB), wall | CPU: " + "; ".join(_rounds(r) for r in R)]
    return "\n".join(L) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.e2e.thp", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="a GGUF (default: the synthetic --shape / --type file)")
    ap.add_argument("--shape", default="1b", choices=list(bigmodels.SHAPES))
    ap.add_argument("--type", default="q4_0", choices=list(bigmodels.TYPES))
    ap.add_argument("--pure", action="store_true", help="the one-type file (bigmodels --pure)")
    ap.add_argument("--dir", help="the synthetic models' cache folder")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--here", action="store_true", help="run in this process (one thread count; pin it yourself)")
    ap.add_argument("--md", help="also write the table here")
    ap.add_argument("--json", help="also write the raw results here")
    a = ap.parse_args(argv)
    if min(a.prompt, a.steps, a.rounds) < 1:
        sys.exit("--prompt, --steps and --rounds must be >= 1")
    path = a.model or bigmodels.ensure(a.shape, a.type, a.dir, pure=a.pure)
    R = []
    for t in parse_threads(a.threads, len(os.sched_getaffinity(0))):
        job = {"worker": "thp", "model": path, "threads": t, "prompt": a.prompt, "steps": a.steps, "rounds": a.rounds}
        if a.here:
            res, err = worker(job), None
        else:
            res, err = run_job(job, pin=t == 1, threads=t, timeout=3600)
        R.append(res or sys.exit(f"thp at {t} thread(s): {err}"))
        print(f"thp: {t} thread(s) done", file=sys.stderr, flush=True)
    md = markdown(os.path.basename(path), R, a.prompt, a.steps, a.rounds)
    print(md)
    if a.md:
        save(a.md, md)
    if a.json:
        save(a.json, R)


if __name__ == "__main__":
    main()
