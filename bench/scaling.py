"""Thread scaling of the cpufuse ops: each op at 1, 2, 4, 8, 16 threads (up to the cores this
process may use), speedup vs 1 thread, GB/s or GFLOP/s, and the multi-threaded copy bandwidth
measured in the same run at each thread count.

    python -m bench.scaling [--max-threads N] [--tag TAG] [--quick] [--json PATH] [--md PATH]

Needs only numpy and cpufuse (numba optional; no peers). Writes
bench/results/scaling-<tag or hostname>.{json,md}. Run it unpinned (no taskset): the 1-thread
runs pin their own thread to one core, the n-thread runs use every core of the affinity set with
n_threads = n (and OpenBLAS on n threads for the block's matmuls). The thread counts are
interleaved in rounds, so noise hits them alike. Every output is checked against the float64
reference at 1 thread, and every other thread count must give the bit-identical result (cpufuse's
fixed chunking; the block, whose matmuls run in OpenBLAS, is checked by NMSE instead).
"""
import argparse
import functools
import json
import os
import platform
import sys
import time
from dataclasses import dataclass

import numpy as np

import cpufuse
from . import blocks
from cpufuse import reference as ref

from . import attn, graphbench, run, threads, timing


@dataclass(frozen=True)
class Op:
    name: str
    kind: str               # softmax / rms_norm (bench.run cases) | attn | block
    case: object
    metric: str             # GB/s | GFLOP/s
    strategy: str = None
    quick: bool = True


def _ops():
    by_name = {c.name: c for c in run.CASES}
    ac = {c.name: c for c in attn.CASES}
    bc = {c.name: c for c in graphbench.CASES}
    return [
        Op("softmax 32×4096 +mask f32", "op", by_name["softmax 32×4096 +mask f32"], "GB/s"),
        Op("softmax 4096×512 causal f16", "op", by_name["softmax 4096×512 causal f16"], "GB/s"),
        Op("softmax 1×32000", "op", by_name["softmax 1×32000 (vocab)"], "GB/s"),
        Op("rms_norm×w 1×4096", "op", by_name["rms_norm×w 1×4096"], "GB/s"),
        Op("rms_norm×w 512×8192", "op", by_name["rms_norm×w 512×8192"], "GB/s"),
        Op("decode attn T=16384 f16 (auto)", "attn", ac["decode T=16384 f16"], "GB/s"),
        Op("decode attn T=16384 f16 rows", "attn", ac["decode T=16384 f16"], "GB/s", strategy="rows", quick=False),
        Op("decode attn T=16384 f16 split", "attn", ac["decode T=16384 f16"], "GB/s", strategy="split", quick=False),
        Op("decode attn T=16384 f16 tiled", "attn", ac["decode T=16384 f16"], "GB/s", strategy="tiled", quick=False),
        Op("prefill attn 512 causal f16", "attn", ac["prefill 512 causal f16"], "GFLOP/s"),
        Op("SmolLM2 block n_tok=128 (plan fused)", "block", bc["SmolLM2 block n_tok=128 n_past=0"], "GFLOP/s"),
    ]


def thread_counts(max_threads=None):
    """1, 2, 4, 8, 16 (and the core count when it is not a power of two), up to the cores here"""
    cap = threads.n_all if max_threads is None else min(max_threads, threads.n_all)
    counts = [n for n in (1, 2, 4, 8, 16) if n <= cap]
    if cap not in counts:
        counts.append(cap)
    skipped = [n for n in (1, 2, 4, 8, 16) if n > cap]
    return counts, skipped


def setup(op):
    """(inputs, reference, work {bytes|flops}, make_fn(n) -> (fn, get), exact across threads)"""
    c = op.case
    if op.kind == "op":
        inp = run.make_inputs(c)
        want = run.reference(c, inp)
        work = {"bytes": run.min_bytes(c, inp)}
        isa = run._best_simd() or cpufuse.available_isas()[0]

        def make(n):
            return run.build_cpufuse(isa, True, n)(c, inp)
        return want, work, make, True
    if op.kind == "attn":
        inp = attn.make_inputs(c)
        want = attn.reference(c, inp)
        work = attn.work(c, inp)
        isa = run._best_simd() or cpufuse.available_isas()[0]
        v = run.Variant(op.name, "cpufuse", isa, strategy=op.strategy)

        def make(n):
            return attn.build(c, v, inp, n)
        return want, work, make, True
    d = graphbench.make_inputs(c)
    want = graphbench.reference(c, d)
    work = graphbench.work(c, d)
    plan = blocks.build_graph(d["cfg"], d["W"], c.n_tok, c.n_past).compile()

    def make(n):
        fn = functools.partial(plan.run, n_threads=n, **d["inp"])
        return fn, lambda: fn()[0].copy()
    return want, work, make, False


def run_op(op, counts, target, rounds, log):
    want, work, make, exact = setup(op)
    threads.settle_s[0] = 0.2 if op.kind == "block" else 0.0
    fns, pre, res, first = {}, {}, {}, None
    for n in counts:
        threads.enter(n)
        r = res[n] = {"n_threads": n, "status": "ok"}
        try:
            fn, get = make(n)
            got = np.array(get(), copy=True)
            err = ref.nmse(want, got) if got.shape == np.shape(want) and np.all(np.isfinite(got)) else float("inf")
        except Exception as e:
            r.update(status="error", reason=f"{type(e).__name__}: {e}")
            log(f"!!! {op.name} at {n} threads: ERROR {r['reason']}")
            continue
        r["nmse"] = err
        tol = 1e-10
        if first is None:
            first = got
        elif exact:
            r["bit_identical_to_1_thread"] = bool(np.array_equal(got.view(np.uint32), first.view(np.uint32)))
            if not r["bit_identical_to_1_thread"]:
                log(f"!!! {op.name}: {n} threads differ from 1 thread (NMSE {ref.nmse(first, got):.3g})")
        if not err <= tol:
            r.update(status="failed", reason=f"NMSE {err:.3g} > {tol:g}")
            log(f"!!! {op.name} at {n} threads: FAILED CHECK, NMSE {err:.3g}")
            continue
        fns[n] = fn
        pre[n] = functools.partial(threads.enter, n)
    threads.settle_s[0] = 0.2 if op.kind == "block" else 0.0  # OpenBLAS workers spin ~0.1 s after a call
    timed = timing.measure(fns, target_s=target, rounds=rounds, pre=pre)
    threads.settle_s[0] = 0.0
    for n, tr in timed.items():
        r = res[n]
        r.update(tr)
        r["median_us"] = tr["median_ns"] / 1e3
        if "bytes" in work:
            r["gbps"] = work["bytes"] / tr["median_ns"]
        if "flops" in work:
            r["gflops"] = work["flops"] / tr["median_ns"]
    t1 = res.get(counts[0], {}).get("median_ns")
    for r in res.values():
        if t1 and r.get("median_ns"):
            r["speedup"] = t1 / r["median_ns"]
    return work, res


def markdown(rep):
    m = rep["machine"]
    counts = rep["thread_counts"]
    hdr = "| op | metric | " + " | ".join(f"{n} thr" for n in counts) + " |"
    sep = "|---|---|" + "---:|" * len(counts)
    lines = [
        "# cpufuse thread scaling",
        "",
        f"{m['date']} · {m['cpu_model']} · {m['hostname']} · tag {rep['tag']} · Python {m['python']} · "
        f"numpy {m['numpy']} · numba {m['numba']} · cpufuse {m['cpufuse']['version']} "
        f"({', '.join(m['cpufuse']['available_isas'])}) · git {m['git_commit']}{' (dirty)' if m['git_dirty'] else ''} · "
        f"affinity {len(m['affinity'] or [])} cores · load average {m['loadavg_start'][0]:.2f} → {rep['loadavg_end'][0]:.2f} · "
        f"run took {rep['runtime_s']:.0f} s{' · QUICK' if rep['quick'] else ''}",
        "",
        "1 thread = pinned to one core; n threads = `n_threads=n` with every core allowed (OpenBLAS on n threads for "
        "the block). Copy = `np.copyto` of a 256 MiB float32 array split into n disjoint slices copied by n Python "
        "threads (numpy releases the GIL), counted as read + write; FMA peak = cpufuse's `cf_fma_peak` on n threads. "
        "Medians of interleaved rounds. GB/s = minimum bytes moved (softmax / rms_norm: in + mask + out; attention "
        "decode: K + V); GFLOP/s: prefill attention 4·D·Hq·T(T+1)/2, block = its matmul flops only.",
        "",
    ]
    if rep["skipped_counts"]:
        why = (f"--max-threads {rep['max_threads']}" if rep["max_threads"] and rep["max_threads"] < rep["n_cores"]
               else f"this process may use {rep['n_cores']} core{'s' if rep['n_cores'] != 1 else ''}")
        lines += [f"Thread counts {rep['skipped_counts']} skipped: {why}.", ""]
    lines += ["Median time per call, µs:", "", hdr, sep]
    for e in rep["ops"]:
        cells = [run._fmt_us(e["results"][str(n)].get("median_us")) if e["results"][str(n)].get("median_us")
                 else e["results"][str(n)]["status"].upper() for n in counts]
        lines.append(f"| {e['name']} | µs | " + " | ".join(cells) + " |")
    lines += ["", "Speedup vs 1 thread:", "", hdr, sep]
    for e in rep["ops"]:
        cells = [f"{e['results'][str(n)]['speedup']:.2f}×" if e["results"][str(n)].get("speedup") else "–" for n in counts]
        lines.append(f"| {e['name']} | × | " + " | ".join(cells) + " |")
    lines += ["", "Throughput (and the machine's, same run):", "", hdr, sep]
    for e in rep["ops"]:
        key = "gbps" if e["metric"] == "GB/s" else "gflops"
        cells = [f"{e['results'][str(n)][key]:.1f}" if e["results"][str(n)].get(key) else "–" for n in counts]
        lines.append(f"| {e['name']} | {e['metric']} | " + " | ".join(cells) + " |")
    lines.append("| **copy (DRAM, n threads)** | GB/s | " + " | ".join(
        f"{rep['copy_bw'][str(n)]['gbps']:.1f}" for n in counts) + " |")
    if rep.get("fma_peak"):
        lines.append(f"| **FMA peak ({rep['fma_isa']})** | GFLOP/s | " + " | ".join(
            f"{rep['fma_peak'][str(n)]:.1f}" if rep["fma_peak"].get(str(n)) else "–" for n in counts) + " |")
    lines += ["", "Same, as % of the copy bandwidth (GB/s rows) or FMA peak (GFLOP/s rows) at that thread count:", "",
              hdr, sep]
    for e in rep["ops"]:
        cells = []
        for n in counts:
            r = e["results"][str(n)]
            if e["metric"] == "GB/s" and r.get("gbps"):
                cells.append(f"{100 * r['gbps'] / rep['copy_bw'][str(n)]['gbps']:.0f}%")
            elif e["metric"] == "GFLOP/s" and r.get("gflops") and rep.get("fma_peak", {}).get(str(n)):
                cells.append(f"{100 * r['gflops'] / rep['fma_peak'][str(n)]:.0f}%")
            else:
                cells.append("–")
        lines.append(f"| {e['name']} | % | " + " | ".join(cells) + " |")
    notes = []
    for e in rep["ops"]:
        for n in counts:
            r = e["results"][str(n)]
            if r["status"] != "ok":
                notes.append(f"- **{r['status'].upper()}** {e['name']} at {n} threads: {r.get('reason')}")
            if r.get("bit_identical_to_1_thread") is False:
                notes.append(f"- {e['name']}: the {n}-thread result is **not** bit-identical to the 1-thread one")
    exact = [e["name"] for e in rep["ops"] if e["exact"]]
    if exact and not any("bit-identical" in s for s in notes):
        notes.append(f"- every cpufuse op result was bit-identical across thread counts ({len(exact)} ops)")
    if notes:
        lines += ["", "Notes:", ""] + notes
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-threads", type=int, default=None, help="highest thread count (default: the cores here)")
    ap.add_argument("--tag", default=None, help="names the result files (default: the hostname)")
    ap.add_argument("--quick", action="store_true", help="short timings, fewer ops")
    ap.add_argument("--only", action="append", metavar="SUBSTR", help="only ops whose name contains this")
    ap.add_argument("--target", type=float, default=None, help="seconds of timing per op and thread count")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--md", metavar="PATH")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    counts, skipped = thread_counts(a.max_threads)
    tag = a.tag or platform.node() or "host"
    target = a.target if a.target is not None else (0.05 if a.quick else 0.4)
    rounds = a.rounds if a.rounds is not None else (3 if a.quick else 7)
    machine = run.machine_info(False)
    log(f"cpufuse {', '.join(cpufuse.available_isas())}; affinity {threads.ALL_CORES}; thread counts {counts}"
        + (f" (skipped {skipped})" if skipped else ""))
    if threads.n_all == 1:
        log("note: this process may use one core only (taskset?): only the 1-thread column runs")
    # copy bandwidth at each thread count, sampled at the start and after every op
    n = 256 << 20
    shared = (np.random.default_rng(1).standard_normal(n // 4, dtype=np.float32), np.empty(n // 4, np.float32))
    copiers = {k: threads.ParallelCopyBandwidth(n, k, reps=7, arrays=shared) for k in counts}
    for c in copiers.values():
        c.sample(3)
    isa = run._best_simd() or cpufuse.available_isas()[0]
    peaks = {k: threads.fma_peak(isa, k, seconds=0.1 if a.quick else 0.2) for k in counts}
    log("copy GB/s: " + ", ".join(f"{k}: {c.result()['gbps']:.1f}" for k, c in copiers.items())
        + f"; FMA peak {isa} GFLOP/s: " + ", ".join(f"{k}: {v:.1f}" for k, v in peaks.items() if v))
    ops = [o for o in _ops() if (not a.quick or o.quick) and (not a.only or any(s in o.name for s in a.only))]
    entries = []
    for op in ops:
        t0 = time.perf_counter()
        work, res = run_op(op, counts, target, rounds, log)
        entries.append({"name": op.name, "metric": op.metric, "strategy": op.strategy, "exact": op.kind != "block",
                        "case": op.case.name, "work": work, "results": {str(k): v for k, v in res.items()}})
        log(f"{op.name} ({time.perf_counter() - t0:.0f} s): " + ", ".join(
            f"{k}t {r['median_us']:.4g} µs ({r.get('speedup', 0):.2f}×)" for k, r in res.items() if r.get("median_us")))
        for c in copiers.values():
            c.sample()
    graphbench.release()
    for k in counts:  # best of the start and end probes
        p = threads.fma_peak(isa, k, seconds=0.1 if a.quick else 0.2)
        if p and (peaks[k] or 0) < p:
            peaks[k] = p
    threads.enter(1)
    copy_bw = {str(k): c.result() for k, c in copiers.items()}
    for c in copiers.values():
        c.release()
    rep = {"tag": tag, "quick": a.quick, "machine": machine, "thread_counts": counts, "skipped_counts": skipped,
           "max_threads": a.max_threads, "n_cores": threads.n_all, "copy_bw": copy_bw, "fma_isa": isa,
           "fma_peak": {str(k): v for k, v in peaks.items()}, "target_s": target, "rounds": rounds, "ops": entries,
           "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
           "runtime_s": time.perf_counter() - t_start}
    md = markdown(rep)
    print(md)
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    jpath = a.json or os.path.join(here, f"scaling-{tag}.json")
    mpath = a.md or os.path.join(here, f"scaling-{tag}.md")
    for p, text in ((jpath, json.dumps(rep, indent=1, default=str)), (mpath, md)):
        os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
        with open(p, "w") as f:
            f.write(text)
    log(f"wrote {jpath} and {mpath} ({rep['runtime_s']:.0f} s)")
    bad = [(e["name"], k) for e in entries for k, r in e["results"].items() if r["status"] != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
