"""The kernel tables' one reporter: the markdown of a bench.run report (the headline, the machine and
probe header, then per section its time tables and its derived table) and the chart (bench/plot.py).
A section says what it adds through its `intro`, `unit`, `tables(entries)` and `derived_cols`; table
and save serve every bench's reports."""
import json
import os

import numpy as np

HEADLINE_PEERS = ("numpy", "ggml", "torch")
STATUS = {"skipped": "n/a", "failed": "FAIL", "error": "ERR"}


def fmt_us(us):
    return "–" if us is None else f"{us:.2f}" if us < 10 else f"{us:,.0f}" if us >= 1000 else f"{us:.1f}"


def fmt_ms(us):
    return "–" if us is None else f"{us / 1e3:.3f}" if us < 1e3 else f"{us / 1e3:.2f}" if us < 1e5 else f"{us / 1e3:,.0f}"


FORMATS = {"x": lambda v: f"{v:.2f}×", "pct": lambda v: f"{v:.0f}%", "g": lambda v: f"{v:.3g}" if v < 10 else f"{v:.1f}",
           "us": fmt_us, "s": str}


def table(head, rows, align="---", first=None):
    """markdown lines of a table: every column aligned `align`, the first `first` if given"""
    return (["| " + " | ".join(head) + " |", "|" + f"{first or align}|" + f"{align}|" * (len(head) - 1)]
            + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def save(path, data):
    """write text, or anything else as indented JSON, to path (its folder made first)"""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(data if isinstance(data, str) else json.dumps(data, indent=1, default=str))


def time_table(entries, cols, unit="µs"):
    """median time per call of each column (µs or ms), the row's fastest in bold"""
    fmt = fmt_ms if unit == "ms" else fmt_us
    rows = []
    for c in entries:
        t = {k: r.get("median_us") for k, r in c["results"].items() if r.get("status") == "ok" and r["kind"] != "baseline"}
        best = min((v for v in t.values() if v), default=None)
        cells = [("**{}**" if r.get("median_us") == best else "{}").format(fmt(r.get("median_us")))
                 if r.get("status") == "ok" else "" if r.get("quiet") else STATUS.get(r.get("status"), "–")
                 for r in (c["results"].get(k, {}) for k in cols)]
        rows.append([c["case"]["name"]] + cells)
    return table(["case"] + cols, rows, "---:", first="---")


def derived_table(entries, spec):
    """the derived numbers: [(header, key or fn(derived), format)], the columns no row has left out"""
    def cell(d, key, f):
        v = key(d) if callable(key) else d.get(key)
        return None if v is None else FORMATS[f](v)
    rows = [[cell(e["derived"], k, f) for _, k, f in spec] for e in entries]
    keep = [i for i in range(len(spec)) if any(r[i] is not None for r in rows)]
    if not keep:
        return []
    cells = [[e["case"]["name"]] + [r[i] or "–" for i in keep] for e, r in zip(entries, rows)]
    return table(["case"] + [spec[i][0] for i in keep], cells, "---:", first="---")


def notes(entries, extra=()):
    out = list(extra)
    skipped = {}
    for c in entries:
        for k, r in c["results"].items():
            if r.get("status") in ("failed", "error"):
                out.append(f"- **{r['status'].upper()}** {c['case']['name']} / {k}: {r['reason']}")
            if r.get("tol_note"):
                out.append(f"- {c['case']['name']} / {k}: {r['tol_note']} (NMSE {r['nmse']:.2g})")
            if r.get("status") == "skipped" and not r.get("quiet"):
                skipped.setdefault((k.split(" ×")[0], r["reason"]), []).append(c["case"]["name"])
    for (k, why), names in skipped.items():
        names = list(dict.fromkeys(names))
        where = "all cases" if len(names) == len(entries) else ", ".join(names) if len(names) <= 3 else f"{len(names)} rows"
        out.append(f"- skipped {k} ({where}): {why}")
    return ["", "Notes:", ""] + out if out else []


def section_md(sec, data):
    """one section: title, intro, its time tables (the columns that ran somewhere), its derived table"""
    lines = ["", f"## {sec.title}"]
    cols = [v["name"] for v in data["variants"]]
    for sub, rows, intro in sec.tables(data["cases"]):
        used = [k for k in cols if any(not e["results"].get(k, {}).get("quiet") for e in rows)]
        lines += (["", f"### {sub}"] if sub else []) + (["", intro] if intro else [])
        lines += ["", f"Median time per call, {sec.unit} (**bold** = fastest in the row):", ""]
        lines += time_table(rows, used, sec.unit)
        d = derived_table(rows, sec.derived_cols)
        lines += ["", "Derived (1 thread unless ×N; ratios > 1: cpufuse faster):", ""] + d if d else []
    return lines + notes(data["cases"])


def _spread(r):
    return f"[{r['p10_gbps']:.1f}–{r['p90_gbps']:.1f}]" if "p10_gbps" in r else ""


def header(report):
    m, cb, pk = report["machine"], report["copy_bw"], report.get("fma_peak", {})
    thr = m["threads"]
    mode = (f"1-thread columns pinned to core {thr['pin_core']}, all-core columns (×{thr['n_all']}) on cores "
            f"{thr['affinity']}" if report["all_core"] else
            f"1 thread only ({'affinity is one core' if thr['n_all'] == 1 else '--threads 1'})")
    dram, l2 = cb["dram"], cb["l2"]
    probes = (f"Copy bandwidth, 1 thread (memmove; n threads: np.copyto; read + write; median of short samples "
              f"spread over the run, [slow decile – fast decile]): DRAM {dram['gbps']:.1f} GB/s {_spread(dram)}, L2 {l2['gbps']:.1f} GB/s "
              f"{_spread(l2)}" + (f"; all cores ({cb['dram_all']['threads']} threads) DRAM {cb['dram_all']['gbps']:.1f} "
                                  f"GB/s {_spread(cb['dram_all'])}" if "dram_all" in cb else "") + ".")
    if pk.get("gflops_1"):
        probes += (f" FMA peak ({pk['isa']}, cf_fma_peak, best of the runs at the start and end): {pk['gflops_1']:.1f} "
                   "GFLOP/s 1 thread" + (f", {pk['gflops_all']:.1f} on {thr['n_all']}" if pk.get("gflops_all") else "")
                   + "." + (f" int8 dot peak (cf_int8_peak): {pk['int8_gmacs_1']:.0f} GMAC/s 1 thread."
                            if pk.get("int8_gmacs_1") else ""))
    load = [report["machine"].get("loadavg_start"), report.get("loadavg_end")]
    busy = [report.get("busy_cores_start"), report.get("busy_cores_end")]
    probes += (f" Timer pair: {report['timer_overhead_ns']:.0f} ns. Load average at start / end: "
               + " / ".join("?" if not v else f"{v[0]:.2f}" for v in load) + "; cores kept busy by other work: "
               + " / ".join("?" if v is None else f"{v:.2f}" for v in busy) + ".")
    check = report.get("probe_check")
    lines = ["# cpufuse benchmark", "",
             f"{m['date']} · {m['cpu_model']} · {m['hostname']} · Python {m['python']} · numpy {m['numpy']} · "
             f"numba {m['numba']} · cpufuse {m['cpufuse']['version']} ({', '.join(m['cpufuse']['available_isas'])}) · "
             f"git {m['git_commit']}{' (dirty)' if m['git_dirty'] else ''}{' · QUICK' if report['quick'] else ''} · "
             f"{mode} · run took {report.get('runtime_s', 0):.0f} s", "", probes]
    if check is not None:
        lines += ["", "Probe check: ok (L2 copy > DRAM copy; every probe's median within 80% of its fast decile)."
                  if not check else "**Probe check: flagged.** " + " · ".join(check)]
    err = m["cpufuse"].get("native_load_error")
    extra = [f"- **WARNING: the cpufuse native extension did not load** ({err}); only numba runs"] if err else []
    extra += [f"- no {isa} column: {why}" for isa, why in report.get("unavailable_isas", {}).items()]
    if report.get("threads_note"):
        extra.append(f"- {report['threads_note']}")
    return lines + (["", "Run notes:", ""] + extra if extra else [])


def headline(report):
    """per peer, over every case where both ran on one thread, how often cpufuse's fastest variant
    beats the peer's fastest, and by how much (geometric mean, range)"""
    got = {}
    for sec in report["sections"].values():
        for e in sec["cases"]:
            res = e["results"]

            def best(pred):
                ts = [r["median_ns"] for k, r in res.items() if r.get("status") == "ok" and r.get("median_ns")
                      and r.get("n_threads", 1) == 1 and pred(k, r)]
                return min(ts) if ts else None
            cf = best(lambda k, r: r["kind"] == "cpufuse")
            if cf is None:
                continue
            for p in HEADLINE_PEERS:
                t = best(lambda k, r: r["kind"] in ("user", "peer") and (k == p or k.startswith(p + " ")))
                if t is not None:
                    got.setdefault(p, []).append((t / cf, e["case"]["name"]))
    lines = ["## Headline", "", "cpufuse's fastest 1-thread variant against each peer's, case by case (peer time ÷ "
             "cpufuse time: above 1× cpufuse is faster):", ""]
    for p in (p for p in HEADLINE_PEERS if p in got):
        rs = got[p]
        gm = float(np.exp(np.mean(np.log([r for r, _ in rs]))))
        lo, hi = min(rs), max(rs)
        lines.append(f"- **{p}**: cpufuse is faster in {sum(r > 1 for r, _ in rs)} of {len(rs)} cases, "
                     f"{'faster' if gm >= 1 else 'slower'} by {gm if gm >= 1 else 1 / gm:.1f}× on geometric mean "
                     f"(from {lo[0]:.2f}× on {lo[1]} to {hi[0]:.1f}× on {hi[1]}).")
    missing = [p for p in HEADLINE_PEERS[1:] if p not in got]
    if missing:
        lines.append(f"- {', '.join(missing)}: not in this run (`make bench-peers` adds them).")
    return lines + [""]


def markdown(report, sections):
    """the report's markdown; sections: {key: the section object that ran}"""
    lines = headline(report) + header(report)
    for key, data in report["sections"].items():
        lines += section_md(sections[key], data)
    return "\n".join(lines) + "\n"
