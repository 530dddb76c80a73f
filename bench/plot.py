"""The benchmark's chart: per case, the 1-thread time of every way of computing it, on a log axis.

    python -m bench.plot bench/results/latest.json -o bench/results/latest.png
"""
import argparse
import json
import math
import sys

# fixed colours by role, so that a column keeps its colour across panels and runs
COLOURS = {
    "numpy": "#9e9e9e", "Python per-op": "#9e9e9e", "matmuls numpy": "#bdbdbd",
    "numba": "#8e6bbf", "scalar": "#c98b3a",
    "unfused": "#8fbfe6", "plan unfused": "#8fbfe6",
    "avx2": "#3b7dd8", "neon": "#2a9d8f", "avx512": "#173f7a", "plan fused": "#173f7a",
    "torch": "#d8473b", "ggml": "#3fa34d", "ggml repack": "#8acb88",
    # the quant section's columns
    "cpufuse": "#173f7a", "fused": "#173f7a", "cpufuse f32": "#2a9d8f", "cpufuse q8": "#ad1457",
    "numpy unfused": "#616161",
}
OTHER = ["#6d4c41", "#00838f", "#ad1457", "#827717", "#4527a0", "#ef6c00", "#546e7a", "#2e7d32"]
FLOOR = "exp floor"


def series(sec):
    """the section's plotted columns: 1 thread, no forced strategy, not a baseline"""
    return [v["name"] for v in sec["variants"]
            if v.get("nth", 1) == 1 and not v.get("strategy") and v.get("kind") in ("user", "cpufuse", "peer")]


def colour(name, i):
    if name in COLOURS:
        return COLOURS[name]
    if name.endswith(" unfused"):
        return COLOURS["unfused"]
    return OTHER[i % len(OTHER)]


def eng(sec):
    """a time in seconds, short: 88.5µs, 1.21ms"""
    for unit, f in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if sec >= f:
            v = sec / f
            break
    else:
        unit, v = "ns", sec * 1e9
    return f"{v:.3g}{unit}"


def _time_s(r):
    if r.get("status") == "ok" and r.get("median_ns"):
        return r["median_ns"] * 1e-9
    return None


def panels(report):
    """[(title, [case names], [series names], {series: [seconds or None per case]}, [floor s or None])]"""
    out = []
    for key, sec in report.get("sections", {}).items():
        names = series(sec)
        cases = [c for c in sec.get("cases", []) if any(_time_s(c["results"].get(k, {})) for k in names)]
        if not cases:
            continue
        names = [k for k in names if any(_time_s(c["results"].get(k, {})) for c in cases)]
        times = {k: [_time_s(c["results"].get(k, {})) for c in cases] for k in names}
        floor = [_time_s(c["results"].get(FLOOR, {})) for c in cases]
        out.append((sec.get("title", key), [c["case"]["name"] for c in cases], names, times, floor))
    return out


def write(report, path, dpi=110):
    """Draw the chart of a bench.run report (dict) into `path`; None when written, else the reason."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import EngFormatter, NullFormatter
    except Exception as e:
        return f"matplotlib is not available ({type(e).__name__}: {e}); pip install matplotlib"
    ps = panels(report)
    if not ps:
        return "no timed case in the report"
    bar, dot_row = 0.12, 0.2  # inches per bar (grouped bars) / per case (dot rows)
    heights = [0.8 + (len(cases) * dot_row if len(cases) > DOTS_ABOVE else len(cases) * (len(names) * bar + 0.18))
               for _, cases, names, _, _ in ps]
    top = 0.7  # inches for the title
    fig, axes = plt.subplots(len(ps), 1, figsize=(10, sum(heights) + top), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    m = report.get("machine", {})
    fig.suptitle(f"cpufuse benchmark, 1 thread: median time per call (log scale, shorter is faster)\n"
                 f"{m.get('cpu_model', '?')} · git {m.get('git_commit', '?')} · {str(m.get('date', ''))[:10]}"
                 + (" · QUICK run" if report.get("quick") else ""), fontsize=10)
    for ax, (title, cases, names, times, floor) in zip(axes[:, 0], ps):
        dots = len(cases) > DOTS_ABOVE
        (_dots if dots else _bars)(ax, cases, names, times, floor)
        vals = [v for k in names for v in times[k] if v] + [f for f in floor if f]
        lo, hi = min(vals), max(vals)
        # at least one decade boundary inside (major ticks), and room for the value labels
        ax.set_xscale("log")
        ax.set_xlim(min(lo / 1.5, 10 ** math.floor(math.log10(lo))), hi * (1.5 if dots else 3.0))
        ax.xaxis.set_major_formatter(EngFormatter(unit="s"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_yticks(range(len(cases)))
        ax.set_yticklabels(cases, fontsize=8 if not dots else 7)
        ax.set_ylim(len(cases) - 0.5, -0.5)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="x", which="major", color="#dddddd", zorder=0)
        ax.grid(axis="x", which="minor", color="#f2f2f2", zorder=0)
        if dots:
            ax.grid(axis="y", color="#f2f2f2", zorder=0)
        ax.set_title(title + (" (one row per case, a marker per column)" if dots else ""), fontsize=9, loc="left")
        h, lab = ax.get_legend_handles_labels()
        order = sorted(range(len(lab)), key=lambda i: (lab[i].startswith(FLOOR), names.index(lab[i]) if lab[i] in names else 0))
        ax.legend([h[i] for i in order], [lab[i] for i in order], fontsize=7, loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - top / (sum(heights) + top)))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return None


DOTS_ABOVE = 16  # a section with more cases than this is drawn as dot rows (quant: ~50 cases)
MARKERS = "osD^vP*Xph<>"


def _bars(ax, cases, names, times, floor):
    """grouped horizontal bars, value labels at their ends, the exp floor as a black tick"""
    n = len(names)
    width = 1.0 / (n + 1)
    for j, k in enumerate(names):
        pts = [(i + (j - (n - 1) / 2) * width, v) for i, v in enumerate(times[k]) if v]
        if pts:
            ax.barh([p[0] for p in pts], [p[1] for p in pts], height=width * 0.9, color=colour(k, j), label=k, zorder=2)
            for y, v in pts:
                ax.text(v * 1.04, y, eng(v), va="center", ha="left", fontsize=5.5, color="#444444", zorder=4)
    first = True
    for i, f in enumerate(floor):
        if f:
            ax.plot([f, f], [i - 0.5 + width / 2, i + 0.5 - width / 2], color="black", lw=2, zorder=3,
                    label=f"{FLOOR} (cf_exp_f32)" if first else None)
            first = False


def _dots(ax, cases, names, times, floor):
    """one row per case: a grey line from the fastest to the slowest column, a marker per column"""
    for i in range(len(cases)):
        row = [times[k][i] for k in names if times[k][i]]
        if row:
            ax.plot([min(row), max(row)], [i, i], color="#cccccc", lw=1, zorder=1)
    for j, k in enumerate(names):
        pts = [(v, i) for i, v in enumerate(times[k]) if v]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=28, marker=MARKERS[j % len(MARKERS)],
                       color=colour(k, j), label=k, zorder=3, edgecolors="white", linewidths=0.4)
    pts = [(f, i) for i, f in enumerate(floor) if f]
    if pts:
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=40, marker="|", color="black",
                   label=f"{FLOOR} (cf_exp_f32)", zorder=4)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="a bench.run --json report")
    ap.add_argument("-o", "--out", required=True, help="the PNG to write")
    a = ap.parse_args(argv)
    with open(a.json) as f:
        report = json.load(f)
    why = write(report, a.out)
    if why:
        print(f"chart skipped: {why}", file=sys.stderr)
        return 1
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
