"""The throttled read probe (E1), the page size (E4) and the clock check (E8): does this core overlap work per cache line
with its DRAM misses? bench/throttle.c does the timing (built here with the system C compiler and
-march=native); this writes the table and the chart. One pinned thread.

    python -m bench.throttle [--core C] [--mib 1024] [--md PATH] [--json PATH] [--png PATH]
    python -m bench.throttle --types Q4_0,Q8_0,Q4_K [--core C] --md PATH     (E6, per type)

Per W (units of VPMADDWD + VPADDD per 32 bytes of each 64-byte line), in two modes that run the
same instructions: `indep` (the work does not use the loaded data) and `dep` (it does, as a
kernel's unpack and dot do), with the 1 GiB buffer on 4 KiB pages and on transparent huge pages.
With --types (E6): cpufuse's one-row matmul (4096 x 4096, one thread) per weight type, from DRAM (a
ring of weights far larger than the last-level cache) and in cache (one weight again and again), in
bytes of weight per cycle at the clock E8 measures, with the probe's rate at W = 0 beside them.
Reading, per row: DRAM time per line against max(DRAM at W = 0, L2
time) (full overlap) and their sum (none); `overlap lost` = (DRAM − max) / (sum − max).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from statistics import median

from .plot import plot_setup
from .report import save, table
from .timing import cpu_name

MAX_REPS = 32  # throttle.c keeps each cell's runs in an array of this size

HERE = os.path.dirname(os.path.abspath(__file__))


def build(cc=None):
    """compile throttle.c; the executable's path, or raise RuntimeError with the compiler's words"""
    cc = cc or os.environ.get("CC") or shutil.which("cc") or "gcc"
    exe = os.path.join(tempfile.mkdtemp(prefix="cf-throttle-"), "throttle")
    p = subprocess.run([cc, "-O2", "-march=native", "-o", exe, os.path.join(HERE, "throttle.c")],
                       capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{cc} failed: {p.stderr.strip()[-600:]}")
    return exe


def check_reps(reps):
    if not isinstance(reps, int) or not 1 <= reps <= MAX_REPS:
        raise ValueError(f"reps: expected an int in 1..{MAX_REPS}, got {reps!r}")
    return reps


def measure(core=None, mib=1024, small_kib=128, reps=5):
    """the probe's JSON for 4 KiB pages and for transparent huge pages: {"4k": ..., "thp": ..., "cpu", "core"}"""
    check_reps(reps)
    exe = build()
    pre = None
    if core is not None and hasattr(os, "sched_setaffinity"):
        pre = lambda: os.sched_setaffinity(0, {core})  # noqa: E731
    r = {p: json.loads(subprocess.run([exe, str(mib), str(small_kib), str(reps), p], capture_output=True, text=True,
                                      check=True, preexec_fn=pre).stdout) for p in ("4k", "thp")}
    r.update(cpu=cpu_name(), core=core)
    return r


def derive(r):
    """per page size, rows with B/cycle and the overlap reading added; and the clock (GHz) used"""
    ghz = median(r["4k"]["ghz_idle"] + r["thp"]["ghz_idle"])
    out = {}
    for pages in ("4k", "thp"):
        rows = []
        for mode in ("indep", "dep"):
            mine = [x for x in r[pages]["rows"] if x["mode"] == mode]
            d0 = mine[0]["dram_ns"]
            for x in mine:
                full, none = max(d0, x["l2_ns"]), d0 + x["l2_ns"]
                lost = (x["dram_ns"] - full) / (none - full) if none > full else 0.0
                rows.append(dict(x, l2_bpc=64 / (x["l2_ns"] * ghz), dram_bpc=64 / (x["dram_ns"] * ghz),
                                 full_ns=full, none_ns=none, lost=lost))
        out[pages] = rows
    return out, ghz


def markdown(r):
    d, ghz = derive(r)
    a = r["4k"]
    L = [f"# Throttled read probe (E1), page size (E4) and clock (E8): {r['cpu']}", "",
         f"`python -m bench.throttle`: one thread (core {r['core']}), {a['vec']} code, a {a['big_mib']} MiB stream "
         f"(DRAM) on 4 KiB pages and on transparent huge pages (THP), and a {a['small_kib']} KiB one (L2); median of "
         f"{a['reps']} passes (L2: the fastest of {a['reps']} runs of ≥ 2 ms); cycles at the measured {ghz:.2f} GHz "
         "(E8 below). W = units of VPMADDWD + VPADDD per 32 bytes of each 64-byte line. `lost`: (DRAM − max(DRAM at "
         "W=0, L2)) / (their sum − that max): 0 = the work hides under the misses, 1 = it adds to them.", ""]
    body = [[x["W"], x["mode"], f"{x['l2_ns']:.2f}", f"{x['l2_bpc']:.1f}", f"{x['dram_ns']:.2f}", f"{x['dram_bpc']:.2f}",
             f"{x['lost']:.2f}", f"{y['dram_ns']:.2f}", f"{y['dram_bpc']:.2f}", f"{y['lost']:.2f}"]
            for x, y in zip(d["4k"], d["thp"])]
    L += table(["W", "mode", "L2 ns/line", "L2 B/cycle", "DRAM ns/line 4K", "B/cycle 4K", "lost 4K",
                "DRAM ns/line THP", "B/cycle THP", "lost THP"], body, "--:", "--:")
    L += ["", "## E8: clock (GHz, 8 dependent register adds per iteration)", ""]
    for p in ("4k", "thp"):
        L += [f"- {p} run: at start {r[p]['ghz_start']:.2f}; after 0.1 s of scalar work "
              f"{', '.join(f'{g:.2f}' for g in r[p]['ghz_idle'])}; right after 0.1 s of the widest int8 dot "
              f"({r[p]['heavy']}) {', '.join(f'{g:.2f}' for g in r[p]['ghz_after_int8'])}."]
    return "\n".join(L + [""])


def chart(r, path):
    plt, why = plot_setup()
    if why:
        return why
    d, _ = derive(r)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for pages, ls in (("4k", "-"), ("thp", "--")):
        for mode, mk in (("indep", "o"), ("dep", "s")):
            xs = sorted((x for x in d[pages] if x["mode"] == mode), key=lambda x: x["l2_ns"])
            ax.plot([x["l2_ns"] for x in xs], [x["dram_ns"] for x in xs], mk + ls, ms=4,
                    label=f"DRAM, {pages.upper()} pages, work {mode}endent")
        xs = sorted((x for x in d[pages] if x["mode"] == "dep"), key=lambda x: x["l2_ns"])
        ax.plot([x["l2_ns"] for x in xs], [x["full_ns"] for x in xs], "k:", lw=0.8)
        ax.plot([x["l2_ns"] for x in xs], [x["none_ns"] for x in xs], color="grey", ls=":", lw=0.8)
    return _finish(plt, fig, ax, path, "ns per 64-byte line, in L2 (the work alone)", "ns per 64-byte line, from DRAM",
                   f"E1/E4, 1 thread (dotted: full overlap, grey: none) — {r['cpu']}")


def _finish(plt, fig, ax, path, xlabel, ylabel, title):
    """label, grid, legend and write a chart; None (written)"""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def kernel_rates(types, core=None, ring_mib=512, reps=7):
    """E6: {"types": {T: {"dram_s", "cache_s", "bytes"}}, "ghz", "probe": the 4k/thp W=0 runs, ...}"""
    import time
    import numpy as np
    import cpufuse
    from cpufuse.reference.quant import random_blocks
    check_reps(reps)
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    probe = measure(core, mib=ring_mib, reps=min(reps, 3))
    x = np.random.default_rng(0).standard_normal((1, 4096), dtype=np.float32)
    o = np.empty((1, 4096), np.float32)
    out = {}
    for qt in types:
        w0 = random_blocks(qt, 4096, 4096, np.random.default_rng(0)).repack()
        n = max(2, -(-ring_mib * 2 ** 20 // w0.nbytes))
        ring = [w0] + [random_blocks(qt, 4096, 4096, np.random.default_rng(i)).repack() for i in range(1, n)]
        med = {}
        for name, ws in (("dram_s", ring), ("cache_s", [w0] * n)):
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                for w in ws:
                    cpufuse.matmul(x, w, out=o, n_threads=1)
                ts.append((time.perf_counter() - t) / len(ws))
            med[name] = median(ts)
        out[qt] = dict(med, bytes=w0.nbytes, ring=n)
        del ring
    return {"types": out, "ghz": derive(probe)[1], "probe": probe, "isa": cpufuse.available_isas()[0],
            "cpu": cpu_name(), "core": core, "ring_mib": ring_mib, "reps": reps}


def kernel_markdown(k):
    g = k["ghz"]
    d0 = {p: 64 / (k["probe"][p]["rows"][0]["dram_ns"] * g) for p in ("4k", "thp")}
    L = [f"# E6: the one-row matmul per type, in cache and from DRAM: {k['cpu']}", "",
         f"`python -m bench.throttle --types ...`: cpufuse's `matmul` of one activation row by a 4096 × 4096 weight "
         f"(repacked, ISA {k['isa']}), one thread (core {k['core']}), medians of {k.get('reps', 7)} passes; from DRAM: a ring of "
         f"≥ {k['ring_mib']} MiB of weights; in cache: one weight again. Bytes of weight per cycle at "
         f"{g:.2f} GHz (E8). The throttled probe at W = 0 on the same core: {d0['4k']:.2f} B/cycle on 4 KiB "
         f"pages, {d0['thp']:.2f} on huge pages.", ""]
    rows = []
    for qt, r in k["types"].items():
        c, dr = r["bytes"] / (r["cache_s"] * g * 1e9), r["bytes"] / (r["dram_s"] * g * 1e9)
        rows.append([qt, f"{r['cache_s'] * 1e6:.0f}", f"{c:.2f}", f"{r['dram_s'] * 1e6:.0f}", f"{dr:.2f}",
                     f"{dr / d0['thp']:.0%}", f"{dr / c:.0%}"])
    L += table(["type", "cache µs", "cache B/cycle", "DRAM µs", "DRAM B/cycle", "DRAM ÷ probe (THP)", "DRAM ÷ cache"],
               rows, "--:", "---")
    return "\n".join(L + [""])


def kernel_chart(ks, path):
    """DRAM B/cycle against in-cache B/cycle per type, one marker set per machine (ks: kernel_rates results)"""
    plt, why = plot_setup()
    if why:
        return why
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    top = 0
    for k, mk in zip(ks, "os^D"):
        g = k["ghz"]
        xs = {qt: (r["bytes"] / (r["cache_s"] * g * 1e9), r["bytes"] / (r["dram_s"] * g * 1e9)) for qt, r in k["types"].items()}
        p = ax.plot([v[0] for v in xs.values()], [v[1] for v in xs.values()], mk, label=f"{k['cpu'][:40]} ({k['isa']})")[0]
        for qt, v in xs.items():
            ax.annotate(qt, v, fontsize=6, xytext=(3, 2), textcoords="offset points")
        probe = 64 / (k["probe"]["thp"]["rows"][0]["dram_ns"] * g)
        ax.axhline(probe, color=p.get_color(), ls=":", lw=0.8)
        top = max(top, max(max(v) for v in xs.values()), probe)
    ax.plot([0, top * 1.1], [0, top * 1.1], color="grey", lw=0.6)
    return _finish(plt, fig, ax, path, "bytes of weight per cycle, in cache", "bytes of weight per cycle, from DRAM",
                   "E6: one-row matmul, 1 thread (dotted: the probe at W = 0, huge pages)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--core", type=int, default=None, help="pin to this core (default: the first of the affinity)")
    ap.add_argument("--mib", type=int, default=1024,
                    help="the DRAM stream's size; with --types, the ring of weights (default 1024)")
    ap.add_argument("--reps", type=int, default=None,
                    help=f"passes per cell, 1..{MAX_REPS} (default 5; with --types 7)")
    ap.add_argument("--md"), ap.add_argument("--json"), ap.add_argument("--png")
    ap.add_argument("--types", help="E6 instead: comma list of weight types for the one-row matmul")
    ap.add_argument("--chart-from", nargs="*", default=[], metavar="JSON",
                    help="with --types: more machines' E6 JSON files to draw beside this one")
    a = ap.parse_args(argv)
    if a.chart_from and not a.types:
        ap.error("--chart-from draws E6 charts: it needs --types")
    reps = a.reps if a.reps is not None else 7 if a.types else 5
    if not 1 <= reps <= MAX_REPS:
        ap.error(f"--reps: expected 1..{MAX_REPS}, got {reps}")
    core = a.core if a.core is not None else (min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)
    if a.types:
        k = kernel_rates(a.types.split(","), core, ring_mib=a.mib, reps=reps)
        md = kernel_markdown(k)
        print(md)
        if a.json:
            save(a.json, k)
        if a.md:
            save(a.md, md)
            ks = [k] + [json.load(open(f)) for f in a.chart_from]
            why = kernel_chart(ks, a.png or os.path.splitext(a.md)[0] + ".png")
            if why:
                print(f"chart skipped: {why}", file=sys.stderr)
        return
    r = measure(core, a.mib, reps=reps)
    md = markdown(r)
    print(md)
    if a.json:
        save(a.json, r)
    if a.md:
        save(a.md, md + "\n")
    if a.png or a.md:
        why = chart(r, a.png or os.path.splitext(a.md)[0] + ".png")
        if why:
            print(f"chart skipped: {why}", file=sys.stderr)


if __name__ == "__main__":
    main()
