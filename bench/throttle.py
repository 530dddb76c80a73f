"""The throttled read probe (E1), the page size (E4) and the clock check (E8): does this core overlap work per cache line
with its DRAM misses? bench/throttle.c does the timing (built here with the system C compiler and
-march=native); this writes the table and the chart. One pinned thread.

    python -m bench.throttle [--core C] [--mib 1024] [--md PATH] [--json PATH] [--png PATH]

Per W (units of VPMADDWD + VPADDD per 32 bytes of each 64-byte line), in two modes that run the
same instructions: `indep` (the work does not use the loaded data) and `dep` (it does, as a
kernel's unpack and dot do), with the 1 GiB buffer on 4 KiB pages and on transparent huge pages.
Reading, per row: DRAM time per line against max(DRAM at W = 0, L2
time) (full overlap) and their sum (none); `overlap lost` = (DRAM − max) / (sum − max).
"""
import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

from .plot import plot_setup
from .report import save, table

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


def measure(core=None, mib=1024, small_kib=128, reps=5):
    """the probe's JSON for 4 KiB pages and for transparent huge pages: {"4k": ..., "thp": ..., "cpu", "core"}"""
    exe = build()
    pre = None
    if core is not None and hasattr(os, "sched_setaffinity"):
        pre = lambda: os.sched_setaffinity(0, {core})  # noqa: E731
    r = {p: json.loads(subprocess.run([exe, str(mib), str(small_kib), str(reps), p], capture_output=True, text=True,
                                      check=True, preexec_fn=pre).stdout) for p in ("4k", "thp")}
    r.update(cpu=cpu_name(), core=core)
    return r


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


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
    ax.set_xlabel("ns per 64-byte line, in L2 (the work alone)")
    ax.set_ylabel("ns per 64-byte line, from DRAM")
    ax.set_title(f"E1/E4, 1 thread (dotted: full overlap, grey: none) — {r['cpu']}", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--core", type=int, default=None, help="pin to this core (default: the first of the affinity)")
    ap.add_argument("--mib", type=int, default=1024, help="the DRAM stream's size (default 1024)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--md"), ap.add_argument("--json"), ap.add_argument("--png")
    a = ap.parse_args(argv)
    core = a.core if a.core is not None else (min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)
    r = measure(core, a.mib, reps=a.reps)
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
