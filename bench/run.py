"""cpufuse benchmark: the kernel tables (cases x variants, medians, 1-thread and all-core columns).
Run it unpinned (the 1-thread columns pin themselves); progress goes to stderr. See bench/README.md.
"""
import argparse
import datetime
import functools
import importlib.metadata
import itertools
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict

import numpy as np

import cpufuse

from . import report as R
from . import threads, timing
from .attn import AttnSection
from .cases import CASES, Section, Unavailable, Variant, check
from .graphbench import DispatchSection, GraphSection
from .ops import OpsSection, best_simd, unavailable_isas
from .quant import QuantSection
from .smallcalls import CallsSection

SECTIONS = {"ops": OpsSection, "attention": AttnSection, "graph": GraphSection, "dispatch": DispatchSection,
            "quant": QuantSection, "calls": CallsSection}


class ScalingSection(Section):
    """the rows marked `scaling`, on the best ISA at 1, 2, 4, 8, 16 threads (up to the cores here)"""
    key, title = "scaling", "thread scaling"
    settle_s = 0.2   # OpenBLAS's idle workers spin ~0.1 s after the block's parallel matmuls
    intro = ("1 thread = pinned to one core; n = `n_threads=n` with every core allowed (OpenBLAS on n threads for "
             "the block). Copy = 256 MiB split into n slices copied by n threads (read + write); FMA peak = "
             "`cf_fma_peak` on n threads. Every cpufuse op's result must be bit-identical across thread counts (the "
             "block, whose matmuls run in OpenBLAS, is checked by NMSE only).")

    def __init__(self, counts):
        isa = best_simd() or cpufuse.available_isas()[0]
        self.counts, self.vlist = counts, [Variant(f"×{n}", "cpufuse", isa, nth=n) for n in counts]
        self.sections = {k: SECTIONS[k](False, False) for k in ("ops", "attention", "graph")}
        self.first, self.same = {}, {}
        self.derived_cols = [(f"speedup ×{n}", f"speedup_{n}", "x") for n in counts[1:]] + \
            [(f"GB/s or GFLOP/s ×{n}", f"rate_{n}", "g") for n in counts] + \
            [(f"% copy or peak ×{n}", f"pct_{n}", "pct") for n in counts] + [("bit-identical", "same", "s")]

    def cases(self, a):
        return [c for c in CASES if c.scaling]

    def inputs(self, case):
        return self.sections[case.section].inputs(case)

    def reference(self, case, inp):
        return self.sections[case.section].reference(case, inp)

    def work(self, case, inp):
        return self.sections[case.section].work(case, inp)

    def build(self, case, v, inp):
        fn, get = self.sections[case.section].build(case, v, inp)

        def checked():   # every thread count against the first one's bits
            y = get()
            y = np.array(y[0] if isinstance(y, tuple) else y, copy=True)
            y0 = self.first.setdefault(case.name, y)
            if case.section != "graph":
                self.same.setdefault(case.name, []).append(bool(np.array_equal(y.view(np.uint8), y0.view(np.uint8))))
            return y
        return fn, checked

    def derived(self, case, res, env):
        d, t1 = {}, res.get(self.vlist[0].name, {}).get("median_ns")
        key = "gflops" if case.section == "graph" or getattr(case, "kind", "") == "prefill" else "gbps"
        for n, v in zip(self.counts, self.vlist):
            r = res.get(v.name, {})
            if r.get("median_ns"):
                if t1 and n > 1:
                    d[f"speedup_{n}"] = t1 / r["median_ns"]
                d[f"rate_{n}"] = r.get(key)
                base = env["scaling"]["copy" if key == "gbps" else "peak"].get(n)
                if base and r.get(key):
                    d[f"pct_{n}"] = 100 * r[key] / base
        if case.name in self.same:
            d["same"] = "yes" if all(self.same[case.name]) else "**NO**"
        return d


def thread_counts(max_threads=None):
    """1, 2, 4, 8, 16 (and the core count when it is not a power of two), up to the cores here"""
    cap = threads.n_all if max_threads is None else min(max_threads, threads.n_all)
    counts = [n for n in (1, 2, 4, 8, 16) if n <= cap]
    return counts + ([cap] if cap not in counts else []), [n for n in (1, 2, 4, 8, 16) if n > cap]


# ------------------------------------------------------------------------------------------------
# Preparing and timing a case

def prepare(section, case, log):
    """build and check every variant of one case: (work, results, {variant: fn}, {variant: pre})"""
    inp = section.inputs(case)
    want = section.reference(case, inp)
    fns, pre, res = {}, {}, {}
    for v in section.vlist:
        r = res[v.name] = {"kind": v.kind, "isa": v.isa, "fused": v.fused, "strategy": v.strategy,
                           "n_threads": threads.resolve(v.nth), "status": "ok"}
        threads.enter(v.nth)
        try:
            fn, get = section.build(case, v, inp)
            dt = []
            for _ in range(2 if v.max_call_s else 1):   # a slow first call may be a JIT compile
                t0 = time.perf_counter()
                got = get()
                dt.append(time.perf_counter() - t0)
                if not v.max_call_s or dt[0] <= v.max_call_s:
                    break
            tol, note = (None, None) if v.kind == "baseline" else section.tol(case, v)
            ok, err = (True, None) if v.kind == "baseline" else check(case, got, want, tol)
        except Unavailable as e:
            r.update(status="skipped", reason=str(e), **({"quiet": True} if e.quiet else {}))
            continue
        except Exception as e:  # a crashing variant is a loud failure, not the end of the run
            r.update(status="error", reason=f"{type(e).__name__}: {e}")
            log(f"!!! {case.name} / {v.name}: ERROR {r['reason']}")
            continue
        finally:
            got = None
        r["nmse"] = err
        if note:
            r["tol"], r["tol_note"] = tol, note
        if not ok:
            r.update(status="failed", reason=f"NMSE {err:.3g} > {tol:g}")
            log(f"!!! {case.name} / {v.name}: FAILED CHECK, NMSE {err:.3g} > {tol:g}; not timed")
        elif v.max_call_s and min(dt) > v.max_call_s:
            r.update(status="skipped", reason=f"too slow to time: one call took {min(dt):.1f} s (> {v.max_call_s:g} s)")
        else:
            fns[v.name], pre[v.name] = fn, functools.partial(threads.enter, v.nth)
    return section.work(case, inp), res, fns, pre


def run_cases(section, group, target_s, rounds, log):
    """Time one case, or a group of cases (same `group`) interleaved, so that rows meant to be
    compared (alloc vs out=) see the same machine conditions."""
    nth = {v.name: v.nth for v in section.vlist}
    threads.settle_s[0] = section.settle_s
    prepared = [prepare(section, c, log) for c in group]
    fns = {(i, k): fn for i, p in enumerate(prepared) for k, fn in p[2].items()}
    pre = {(i, k): f for i, p in enumerate(prepared) for k, f in p[3].items()}
    blocks = {key: nth[key[1]] == 1 for key in fns}
    timed = timing.measure(fns, target_s=target_s, rounds=rounds, per_call=group[0].mode != "kernel", pre=pre,
                           blocks=blocks)
    threads.settle_s[0] = 0.0
    for (i, k), tr in timed.items():
        work, res = prepared[i][:2]
        res[k].update(tr)
        section.annotate(group[i], res[k], work)
    return [(c, p[0], p[1]) for c, p in zip(group, prepared)]


# ------------------------------------------------------------------------------------------------
# Probes, the machine

def add_peak(peak, isa, all_core):
    """one more FMA and int8 peak measurement (start or end of the run); the peak = the best run"""
    for key, n in (("1", 1), ("all", threads.n_all))[:2 if all_core else 1]:
        st = threads.fma_peak_stats(isa, n)
        if st is not None:
            peak.setdefault(f"runs_{key}", []).append(st)
            peak[f"gflops_{key}"] = max(x["best"] for x in peak[f"runs_{key}"])
        st = threads.int8_peak_stats(isa, n)
        if st is not None:
            peak[f"int8_gmacs_{key}"] = max(st["best"], peak.get(f"int8_gmacs_{key}", 0.0))


def probe_check(report):
    """sanity checks of the probes every ratio leans on: a list of warnings (empty: ok)"""
    cb, w = report.get("copy_bw", {}), []
    dram, l2 = cb.get("dram"), cb.get("l2")
    if dram and l2 and not l2["gbps"] > dram["gbps"]:
        w.append(f"the L2 copy probe ({l2['gbps']:.1f} GB/s) does not exceed the DRAM copy probe "
                 f"({dram['gbps']:.1f} GB/s): the % copy ratios of this run are not to be trusted")
    w += [f"{k} copy probe: median {r['gbps']:.1f} GB/s < 80% of its fast decile {r['p90_gbps']:.1f} GB/s (slow decile "
          f"{r['p10_gbps']:.1f}): many samples disturbed, other load?"
          for k, r in cb.items() if r["gbps"] < 0.8 * r["p90_gbps"]]
    pk = report.get("fma_peak") or {}
    for key, what in (("1", "1 thread"), ("all", "all cores")):
        runs = pk.get(f"runs_{key}")
        best, med = (max(x["best"] for x in runs), max(x["median"] for x in runs)) if runs else (0, 0)
        if med < 0.8 * best:
            w.append(f"FMA peak probe ({what}): median run {med:.1f} GFLOP/s < 80% of the best {best:.1f} "
                     "(the peak is the best run; many runs disturbed, other load?)")
    n = (report.get("machine") or {}).get("threads", {}).get("n_all", 1)
    if pk.get("gflops_1") and pk.get("gflops_all") and n > 1 and pk["gflops_all"] < 0.75 * n * pk["gflops_1"]:
        w.append(f"all-core FMA peak {pk['gflops_all']:.1f} GFLOP/s is only {pk['gflops_all'] / pk['gflops_1']:.2f}× "
                 f"the 1-thread peak on {n} cores: the cores are shared with other work")
    for when in ("start", "end"):
        b = report.get(f"busy_cores_{when}")
        if b is not None and b > 0.25:
            w.append(f"other work kept {b:.2f} cores busy at the {when} (measured while the benchmark slept): "
                     "other processes share the cores")
    return w


def machine_info(peers):
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        git = lambda *a: subprocess.run(["git", "-C", here, *a], capture_output=True, text=True,  # noqa: E731
                                        timeout=5).stdout.strip()
        commit, dirty = git("rev-parse", "--short", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except Exception:
        commit, dirty = None, None
    try:
        numba_v = importlib.metadata.version("numba")
    except importlib.metadata.PackageNotFoundError:
        numba_v = None
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "hostname": platform.node(), "cpu_model": timing.cpu_name(), "platform": platform.platform(),
            "python": sys.version.split()[0], "numpy": np.__version__, "numba": numba_v, "affinity": threads.ALL_CORES,
            "threads": threads.describe(), "os_cpu_count": os.cpu_count(), "loadavg_start": timing.load_avg(),
            "openblas_env": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ},
            "git_commit": commit, "git_dirty": dirty, "cpufuse": cpufuse.info()}
    if peers:
        from . import peers as P
        info["peers"] = {p: {"version": P.PEER_VERSIONS[p](), "unavailable": why} for p, why in P.availability().items()}
    return info


# ------------------------------------------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    arg = ap.add_argument
    arg("--quick", action="store_true", help="short timings, fewer cases (smoke run, ~1 min)")
    arg("--peers", action="store_true", help="add the PyTorch and ggml columns")
    arg("--json", metavar="PATH", help="write the full results as JSON")
    arg("--md", metavar="PATH", help="write the markdown tables")
    arg("--plot", metavar="PATH", help="the chart (PNG); default with --json / --md: beside them, .png")
    arg("--only", metavar="SUBSTR", action="append", help="run only cases whose name contains this")
    arg("--section", action="append", choices=list(SECTIONS), help="run only this section (repeatable)")
    arg("--threads", choices=("auto", "1", "both"), default="auto",
        help="1: 1-thread columns only; both, auto (default): also the all-core columns where there are cores")
    arg("--pin-core", type=int, default=None, help="core for the 1-thread columns (default: the first)")
    arg("--no-big", action="store_true", help="skip the Llama-7B block and prefill cases")
    arg("--target", type=float, default=None, help="seconds of timing per variant and case")
    arg("--rounds", type=int, default=None, help="interleaved rounds per case (overrides per-case)")
    arg("--scaling", action="store_true", help="the scaling rows at 1, 2, 4, 8, 16 threads instead "
        "(default output: bench/results/scaling-<tag>.{json,md})")
    arg("--max-threads", type=int, default=None, help="--scaling: the highest thread count")
    arg("--tag", default=None, help="--scaling: names the result files (default: the hostname)")
    return ap.parse_args(argv)


def scaling_setup(a):
    """the scaling section and its per-count probes: copy bandwidth and FMA peak at each thread count"""
    counts, skipped = thread_counts(a.max_threads)
    sec = ScalingSection(counts)
    n = 256 << 20
    shared = np.empty(n // 2 + 1024, np.float32)
    cps = {k: timing.CopyBandwidth(n, 8 << 20, k, per_sample_s=0.02, buf=shared,
                                   pre=functools.partial(threads.enter, k)) for k in counts}
    for c in cps.values():
        c.sample(3)
    env = {"copy": {k: c.result()["gbps"] for k, c in cps.items()},
           "peak": {k: threads.fma_peak(sec.vlist[0].isa, k, seconds=0.1 if a.quick else 0.2) for k in counts}}
    for c in cps.values():
        c.release()
    tag = a.tag or platform.node() or "host"
    a.json = a.json or os.path.join(timing.RESULTS, f"scaling-{tag}.json")
    a.md = a.md or os.path.join(timing.RESULTS, f"scaling-{tag}.md")
    a.plot = a.plot or ""
    return sec, env, f"thread counts {skipped} skipped: {threads.n_all} cores here" if skipped else None


def main(argv=None):
    a = parse_args(argv)
    t_start = time.perf_counter()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if a.pin_core is not None:
        threads.set_pin_core(a.pin_core)
    all_core = a.threads != "1" and threads.n_all > 1 and not a.scaling
    threads_note = None if a.threads == "1" or threads.n_all > 1 else (
        f"all-core columns skipped: this process may run on one core only (affinity {threads.ALL_CORES}); "
        "run without taskset for them")
    target = a.target if a.target is not None else (0.03 if a.quick else 0.6)
    rounds = a.rounds if a.rounds is not None else (3 if a.quick else 15)
    machine = machine_info(a.peers)
    for p, d in machine.get("peers", {}).items():
        if d["unavailable"]:
            log(f"peer {p} skipped: {d['unavailable']}")
    if machine["cpufuse"]["native_load_error"]:
        log(f"!!! cpufuse native extension failed to load: {machine['cpufuse']['native_load_error']}")
    busy_start = threads.busy_cores()
    env = {}
    if a.scaling:
        sec, env["scaling"], note = scaling_setup(a)
        sections, threads_note = {"scaling": sec}, note or threads_note
    else:
        sections = {k: SECTIONS[k](a.peers, all_core) for k in SECTIONS if not a.section or k in a.section}
    log(f"cpufuse ISAs {', '.join(cpufuse.available_isas())}; affinity {threads.ALL_CORES}; "
        f"{'1-thread pinned to core %s + all-core x%d' % (threads.pin_core(), threads.n_all) if all_core else '1 thread'}")

    # the probes (bench/README.md, "Probes"): copy bandwidth sampled at the start and after every
    # case group (many ~50 µs samples; medians over all of them), FMA peak at start and end
    pin1 = functools.partial(threads.enter, 1)
    copiers = {"dram": timing.CopyBandwidth(256 << 20, 4 << 20, per_sample_s=0.02, pre=pin1),
               "l2": timing.CopyBandwidth(256 << 10, pre=pin1)}
    if all_core:
        copiers["dram_all"] = timing.CopyBandwidth(256 << 20, 8 << 20, threads.n_all, per_sample_s=0.02,
                                                   pre=functools.partial(threads.enter, threads.ALL))
    for c in copiers.values():
        c.sample(3 if a.quick else 7)
    b = best_simd()
    peak = {"isa": b}
    if b and "attention" in sections:
        add_peak(peak, b, all_core)
    report = {"quick": a.quick, "peers": a.peers, "all_core": all_core, "threads_note": threads_note,
              "machine": machine, "unavailable_isas": unavailable_isas(), "fma_peak": peak,
              "timer_overhead_ns": timing.timer_overhead_ns(), "target_s": target, "rounds": rounds,
              "busy_cores_start": busy_start, "sections": {}, **env}
    # per section, its cases in groups (the cases of one group are timed interleaved)
    plan = {key: [list(g) for _, g in itertools.groupby((c for c in sec.cases(a) if not a.only or any(
        s in c.name for s in a.only)), lambda c: c.group or id(c))] for key, sec in sections.items()}
    # progress: variants x cases x (target + 0.1 s) per group, rescaled by the time the done ones took
    cost = [len(sec.vlist) * len(g) * (target + 0.1) for key, sec in sections.items() for g in plan[key]]
    done = 0
    for key, sec in sections.items():
        if not plan[key]:
            continue
        log(f"== {sec.title}: variants {', '.join(v.name for v in sec.vlist)}")
        entries = []
        for group in plan[key]:
            el = time.perf_counter() - t_start
            left = sum(cost[done:]) * (el / sum(cost[:done]) if done else 1.5)
            log(f"[{done + 1}/{len(cost)}] {key}: {', '.join(c.name for c in group)} · {el / 60:.1f} min elapsed, "
                f"~{left / 60:.1f} min left")
            r = a.rounds if a.rounds is not None else min(rounds, group[0].rounds or rounds)
            t0 = time.perf_counter()
            for case, work, res in run_cases(sec, group, target, r, log):
                entries.append({"case": case, "work": work, "results": res})
                log(f"{case.name} ({time.perf_counter() - t0:.0f} s): "
                    + ", ".join(f"{k} {r['median_us']:.4g}" for k, r in res.items() if "median_us" in r))
            threads.settle_s[0] = sec.settle_s
            threads.enter(1)
            threads.settle_s[0] = 0.0
            for c in copiers.values():
                c.sample()
            done += 1
        getattr(sec, "release", lambda: None)()
        report["sections"][key] = {"title": sec.title, "variants": [asdict(v) for v in sec.vlist], "cases": entries}
    if b and "attention" in sections:  # best of the start and end probes
        add_peak(peak, b, all_core)
    threads.enter(1)
    report["copy_bw"] = copy_bw = {k: c.result() for k, c in copiers.items()}
    for c in copiers.values():
        c.release()
    for key, sec in report["sections"].items():
        for e in sec["cases"]:
            e["derived"] = sections[key].derived(e["case"], e["results"], dict(env, copy_bw=copy_bw, fma_peak=peak,
                                                                                 work=e["work"]))
            e["case"] = e["case"].asdict()
    report.update(loadavg_end=timing.load_avg(), busy_cores_end=threads.busy_cores())
    report["probe_check"] = probe_check(report)
    for w in report["probe_check"]:
        log(f"!!! probe check: {w}")
    report["runtime_s"] = time.perf_counter() - t_start
    md = R.markdown(report, sections)
    print(md)
    for path, data in ((a.json, report), (a.md, md)):
        if path:
            R.save(path, data)
    if a.plot or (a.plot is None and (a.json or a.md)):
        out = a.plot or os.path.splitext(a.md or a.json)[0] + ".png"
        from . import plot
        why = plot.write(report, out)
        log(f"chart: {out}" if why is None else f"chart skipped: {why}")
    bad = [(c["case"]["name"], k) for s in report["sections"].values() for c in s["cases"]
           for k, r in c["results"].items() if r["status"] in ("failed", "error") and r["kind"] == "cpufuse"]
    log(f"total run time {report['runtime_s']:.0f} s")
    log("\n".join(["headline (the report above opens with it):"] + [x for x in R.headline(report) if x.startswith("- ")]))
    if bad:
        log(f"!!! {len(bad)} cpufuse variant(s) failed the check: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
