"""The kernel tables' chart: per case, the 1-thread time of every way of computing it, on a log
axis: `python -m bench.plot bench/results/latest.json -o bench/results/latest.png`."""
import argparse
import json
import math
import sys

# fixed colours by role, so that a column keeps its colour across panels and runs
COLOURS = {"numpy": "#9e9e9e", "Python per-op": "#9e9e9e", "numba": "#8e6bbf", "scalar": "#c98b3a",
           "unfused": "#8fbfe6", "avx2": "#3b7dd8", "neon": "#2a9d8f", "avx512": "#173f7a", "plan fused": "#173f7a",
           "torch": "#d8473b", "ggml": "#3fa34d", "ggml repack": "#8acb88", "cpufuse": "#173f7a", "fused": "#173f7a",
           "cpufuse f32": "#2a9d8f", "cpufuse q8": "#ad1457", "numpy unfused": "#616161"}
OTHER = ["#6d4c41", "#00838f", "#ad1457", "#827717", "#4527a0", "#ef6c00", "#546e7a", "#2e7d32"]
MARKERS = "osD^vP*Xph<>"
FLOOR = "exp floor"


def colour(name, i):
    return COLOURS.get(name) or (COLOURS["unfused"] if name.endswith(" unfused") else OTHER[i % len(OTHER)])


def eng(sec):
    """a time in seconds, short: 88.5µs, 1.21ms"""
    unit, f = next(((u, f) for u, f in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)) if sec >= f), ("ns", 1e-9))
    return f"{sec / f:.3g}{unit}"


def panels(report):
    """[(title, [case names], [series names], {series: [seconds or None per case]}, [floor s or None])]:
    per section, the 1-thread user / cpufuse / peer columns without a forced strategy"""
    out = []
    for key, sec in report.get("sections", {}).items():
        def s(c, k):
            r = c["results"].get(k, {})
            return r["median_ns"] * 1e-9 if r.get("status") == "ok" and r.get("median_ns") else None
        names = [v["name"] for v in sec["variants"]
                 if v.get("nth", 1) == 1 and not v.get("strategy") and v.get("kind") in ("user", "cpufuse", "peer")]
        cases = [c for c in sec.get("cases", []) if any(s(c, k) for k in names)]
        names = [k for k in names if any(s(c, k) for c in cases)]
        if cases:
            out.append((sec.get("title", key), [c["case"]["name"] for c in cases], names,
                        {k: [s(c, k) for c in cases] for k in names}, [s(c, FLOOR) for c in cases]))
    return out


def plot_setup():
    """matplotlib's pyplot (Agg), or the reason it is unavailable (every bench's charts)"""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt, None
    except Exception as e:
        return None, f"matplotlib is not available ({type(e).__name__}: {e}); pip install matplotlib"


def write(report, path, dpi=110):
    """draw the chart of a bench.run report into `path`: one row per case, a grey line from its
    fastest to its slowest column, a marker per column; None when written, else the reason"""
    plt, why = plot_setup()
    if why:
        return why
    from matplotlib.ticker import EngFormatter, NullFormatter
    ps = panels(report)
    if not ps:
        return "no timed case in the report"
    heights, top = [0.8 + 0.22 * len(cases) for _, cases, _, _, _ in ps], 0.7   # inches
    fig, axes = plt.subplots(len(ps), 1, figsize=(10, sum(heights) + top), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    m = report.get("machine", {})
    fig.suptitle(f"cpufuse benchmark, 1 thread: median time per call (log scale, shorter is faster)\n"
                 f"{m.get('cpu_model', '?')} · git {m.get('git_commit', '?')} · {str(m.get('date', ''))[:10]}"
                 + (" · QUICK run" if report.get("quick") else ""), fontsize=10)
    for ax, (title, cases, names, times, floor) in zip(axes[:, 0], ps):
        for i in range(len(cases)):
            row = [times[k][i] for k in names if times[k][i]]
            ax.plot([min(row), max(row)], [i, i], color="#cccccc", lw=1, zorder=1)
        for j, k in enumerate(names):
            ax.scatter(*zip(*[(v, i) for i, v in enumerate(times[k]) if v]), s=28, marker=MARKERS[j % len(MARKERS)],
                       color=colour(k, j), label=k, zorder=3, edgecolors="white", linewidths=0.4)
        pts = [(f, i) for i, f in enumerate(floor) if f]
        if pts:
            ax.scatter(*zip(*pts), s=40, marker="|", color="black", label=f"{FLOOR} (cf_exp_f32)", zorder=4)
        vals = [v for k in names for v in times[k] if v] + [f for f in floor if f]
        ax.set_xscale("log")   # at least one decade boundary inside (major ticks)
        ax.set_xlim(min(min(vals) / 1.5, 10 ** math.floor(math.log10(min(vals)))), max(vals) * 1.5)
        ax.xaxis.set_major_formatter(EngFormatter(unit="s"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_yticks(range(len(cases)))
        ax.set_yticklabels(cases, fontsize=7)
        ax.set_ylim(len(cases) - 0.5, -0.5)
        ax.tick_params(axis="x", labelsize=8)
        for axis, which, c in (("x", "major", "#dddddd"), ("x", "minor", "#f2f2f2"), ("y", "major", "#f2f2f2")):
            ax.grid(axis=axis, which=which, color=c, zorder=0)
        ax.set_title(title, fontsize=9, loc="left")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - top / (sum(heights) + top)))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="a bench.run --json report")
    ap.add_argument("-o", "--out", required=True, help="the PNG to write")
    a = ap.parse_args(argv)
    with open(a.json) as f:
        why = write(json.load(f), a.out)
    print(f"chart skipped: {why}" if why else a.out, file=sys.stderr if why else sys.stdout)
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
