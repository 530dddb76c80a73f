"""cpufuse benchmark: one table of cases x variants, single thread, medians in µs.

    python -m bench.run [--quick] [--peers] [--json PATH] [--md PATH] [--only SUBSTR]

Pin it (`taskset -c 0`) and unset old OpenBLAS tuning variables for numpy's sake
(`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE`), as `make bench` does. See bench/README.md.
"""
import argparse
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import zlib
from dataclasses import asdict, dataclass

import numpy as np

import cpufuse
from cpufuse import reference as ref

from . import timing

EPS = 1e-6
SIMD_ISAS = ("avx512", "avx2", "neon")


# ------------------------------------------------------------------------------------------------
# The cases

@dataclass(frozen=True)
class Case:
    name: str
    op: str                 # softmax | rms_norm | add_rms_norm
    shape: tuple
    mask: str = None        # None | "f32" (decode-like tail mask) | "f16-causal"
    scale: float = 1.0
    eps: float = EPS
    mode: str = "kernel"    # kernel: back-to-back throughput; alloc / out: per-call latency rows
    dram: bool = False      # the case whose bandwidth is compared with the DRAM copy bandwidth
    group: str = None       # adjacent cases of one group are timed interleaved with each other
    quick: bool = True      # part of --quick


CASES = [
    # 32 new tokens at the end of a 4096-token context: causal f32 mask, so rows 0..31 see 4065..4096 keys
    Case("softmax 32×4096 +mask f32", "softmax", (32, 4096), mask="f32", scale=0.125),
    # 8 heads x 512 queries over 512 keys, flattened to 4096 rows: f16 mask, row i masks keys j > i % 512
    Case("softmax 4096×512 causal f16", "softmax", (4096, 512), mask="f16-causal", scale=0.125),
    Case("softmax 1×32000 (vocab)", "softmax", (1, 32000)),
    Case("softmax 1×151936 (vocab)", "softmax", (1, 151936)),
    Case("rms_norm×w 1×576", "rms_norm", (1, 576)),
    Case("rms_norm×w 1×4096", "rms_norm", (1, 4096)),
    Case("rms_norm×w 32×4096", "rms_norm", (32, 4096)),
    Case("rms_norm×w 512×4096", "rms_norm", (512, 4096)),
    Case("rms_norm×w 512×8192", "rms_norm", (512, 8192), dram=True),
    Case("add_rms_norm 32×4096", "add_rms_norm", (32, 4096)),
    # from-Python latency: every call timed on its own (k = 1), output allocated vs passed as out=
    Case("latency rms_norm×w 1×4096, alloc", "rms_norm", (1, 4096), mode="alloc", group="latency"),
    Case("latency rms_norm×w 1×4096, out=", "rms_norm", (1, 4096), mode="out", group="latency"),
]


def make_inputs(case):
    """Deterministic float32 inputs (seeded from the case's op and shape)."""
    rng = np.random.default_rng(zlib.crc32(f"{case.op}{case.shape}{case.mask}".encode()))
    R, C = case.shape
    inp = {"x": None, "mask": None, "w": None, "r": None}
    if case.op == "softmax":
        inp["x"] = (rng.standard_normal(case.shape, dtype=np.float32) * (8.0 if case.scale != 1 else 3.0))
        if case.mask == "f32":        # query row i sits at position C - R + i
            j = np.arange(C)[None, :]
            i = np.arange(R)[:, None]
            inp["mask"] = np.where(j > C - R + i, -np.inf, 0.0).astype(np.float32)
        elif case.mask == "f16-causal":
            j = np.arange(C)[None, :]
            i = np.arange(R)[:, None] % C
            inp["mask"] = np.where(j > i, -np.inf, 0.0).astype(np.float16)
    else:
        inp["x"] = rng.standard_normal(case.shape, dtype=np.float32)
        inp["w"] = (1.0 + 0.1 * rng.standard_normal(C, dtype=np.float32)).astype(np.float32)
        if case.op == "add_rms_norm":
            inp["r"] = rng.standard_normal(case.shape, dtype=np.float32)
    return inp


def reference(case, inp):
    """float64 oracle: array, or (h, y) for add_rms_norm."""
    if case.op == "softmax":
        return ref.softmax(inp["x"], inp["mask"], scale=case.scale)
    if case.op == "rms_norm":
        return ref.rms_norm(inp["x"], case.eps, weight=inp["w"])
    return ref.rms_norm(inp["x"], case.eps, weight=inp["w"], residual=inp["r"])


def min_bytes(case, inp):
    """Minimum bytes read + written: x + mask + out (softmax), x + w + out (rms_norm),
    x + r + w + h + y (add_rms_norm)."""
    x = inp["x"].nbytes
    if case.op == "softmax":
        return 2 * x + (inp["mask"].nbytes if inp["mask"] is not None else 0)
    if case.op == "rms_norm":
        return 2 * x + inp["w"].nbytes
    return 4 * x + inp["w"].nbytes


# ------------------------------------------------------------------------------------------------
# The variants. build(case, inp) -> (fn, get): fn() is one timed call, get() returns its output.

class Unavailable(Exception):
    pass


def _np_softmax(x, mask, scale):
    z = x * scale + mask if mask is not None else (x * scale if scale != 1.0 else x.copy())
    z -= z.max(-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(-1, keepdims=True)
    return z


def _np_rms_norm(x, w, eps):
    return x * (1 / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)) * w


def _np_add_rms_norm(x, r, w, eps):
    h = x + r
    return h, h * (1 / np.sqrt(np.mean(h * h, -1, keepdims=True) + eps)) * w


def build_numpy(case, inp):
    """What users write: unfused numpy expressions, allocating temporaries and the result."""
    if case.op == "softmax":
        fn = functools.partial(_np_softmax, inp["x"], inp["mask"], case.scale)
    elif case.op == "rms_norm":
        fn = functools.partial(_np_rms_norm, inp["x"], inp["w"], case.eps)
    else:
        fn = functools.partial(_np_add_rms_norm, inp["x"], inp["r"], inp["w"], case.eps)
    return fn, fn


def build_cpufuse(isa, fused=True):
    """cpufuse on one ISA. Kernel rows and the out= row pass preallocated outputs; the alloc row
    lets cpufuse allocate."""
    def build(case, inp):
        if isa not in cpufuse.available_isas():
            raise Unavailable(f"ISA {isa} not available here")
        x, kw = inp["x"], {"isa": isa}
        if not fused:
            kw["fused"] = False
        alloc = case.mode == "alloc"
        if case.op == "softmax":
            out = None if alloc else np.empty_like(x)
            fn = functools.partial(cpufuse.softmax, x, inp["mask"], scale=case.scale, out=out, **kw)
        elif case.op == "rms_norm":
            out = None if alloc else np.empty_like(x)
            fn = functools.partial(cpufuse.rms_norm, x, inp["w"], eps=case.eps, out=out, **kw)
        else:
            out = None if alloc else (np.empty_like(x), np.empty_like(x))
            fn = functools.partial(cpufuse.add_rms_norm, x, inp["r"], inp["w"], eps=case.eps, out=out, **kw)
        return fn, fn
    return build


def build_peer(name):
    def build(case, inp):
        from . import peers
        res, why = peers.PEERS[name](case, inp)
        if res is None:
            raise Unavailable(why)
        return res
    return build


def _best_simd():
    return next((i for i in cpufuse.available_isas() if i in SIMD_ISAS), None)


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str               # user | cpufuse | peer
    isa: str = None         # cpufuse ISA (None for user/peer)
    fused: bool = True
    tol: float = 1e-10      # NMSE limit against the float64 reference


def variants(peers=False):
    """The columns, in table order, for this machine (unavailable ISAs are left out here;
    peers that fail to load are reported as skipped)."""
    avail = cpufuse.available_isas()
    vs = [Variant("numpy", "user", tol=1e-6)]
    if "numba" in avail:
        vs.append(Variant("numba", "cpufuse", "numba"))
    if "scalar" in avail:
        vs.append(Variant("scalar", "cpufuse", "scalar"))
    b = _best_simd()
    if b:
        vs.append(Variant(f"{b} unfused", "cpufuse", b, fused=False))
    for isa in SIMD_ISAS:
        if isa in avail:
            vs.append(Variant(isa, "cpufuse", isa))
    if peers:
        vs += [Variant(p, "peer", tol=1e-6) for p in ("torch", "onnxruntime", "ggml")]
    return vs


def unavailable_isas():
    """{isa: reason} for the cpufuse ISAs that get no column here (reason from cpufuse itself)."""
    out = {}
    for isa in cpufuse.ALL_ISAS:
        if isa in cpufuse.available_isas():
            continue
        try:
            cpufuse.softmax(np.zeros((1, 1), np.float32), isa=isa)
            out[isa] = "not listed by cpufuse.available_isas()"
        except ValueError as e:
            out[isa] = str(e)
    return out


def builder(v):
    if v.kind == "user":
        return build_numpy
    if v.kind == "cpufuse":
        return build_cpufuse(v.isa, v.fused)
    return build_peer(v.name)


# ------------------------------------------------------------------------------------------------
# Checking, timing, derived numbers

def check(case, v, got, want):
    """NMSE of each output against the float64 reference; (ok, nmse)."""
    if case.op == "add_rms_norm":
        pairs = list(zip(got, want))
    else:
        pairs = [(got, want)]
    worst = 0.0
    for g, w in pairs:
        g = np.asarray(g)
        if g.shape != np.shape(w) or not np.all(np.isfinite(g)):
            return False, float("inf")
        worst = max(worst, ref.nmse(w, g))
    return worst <= v.tol, worst


def derived(case, res, copy_bw):
    """Ratios for one case from {variant: result dict} (median_ns of variants that ran)."""
    t = {k: r["median_ns"] for k, r in res.items() if r.get("median_ns")}
    simd = {k: t[k] for k in SIMD_ISAS if k in t}
    cf = {k: t[k] for k, r in res.items() if k in t and r["kind"] == "cpufuse"}
    d = {}
    if simd:
        best_simd = min(simd, key=simd.get)
        d["best_simd"] = best_simd
        if "scalar" in t:
            d["vector_gain"] = t["scalar"] / simd[best_simd]
    b = _best_simd()
    if b and f"{b} unfused" in t and b in t:
        d["fusion_gain"] = t[f"{b} unfused"] / t[b]
    if cf:
        best = min(cf, key=cf.get)
        d["best_cpufuse"] = best
        d["best_cpufuse_us"] = cf[best] / 1e3
        d["best_cpufuse_gbps"] = res[best]["gbps"]
        if "numpy" in t:
            d["user_gain"] = t["numpy"] / cf[best]
        d["pct_dram_copy"] = 100 * res[best]["gbps"] / copy_bw["dram"]["gbps"]
        d["pct_l2_copy"] = 100 * res[best]["gbps"] / copy_bw["l2"]["gbps"]
        for p in ("torch", "onnxruntime", "ggml"):
            if p in t:
                d[f"{p}_over_cpufuse"] = t[p] / cf[best]
    return d


def prepare(case, vlist, log):
    """Build and check every variant for one case: (nbytes, results, {variant: fn} of those to time)."""
    inp = make_inputs(case)
    want = reference(case, inp)
    fns, res = {}, {}
    for v in vlist:
        r = res[v.name] = {"kind": v.kind, "isa": v.isa, "fused": v.fused, "status": "ok"}
        try:
            fn, get = builder(v)(case, inp)
            ok, err = check(case, v, get(), want)
        except Unavailable as e:
            r.update(status="skipped", reason=str(e))
            continue
        except Exception as e:  # a crashing variant is a loud failure, not the end of the run
            r.update(status="error", reason=f"{type(e).__name__}: {e}")
            log(f"!!! {case.name} / {v.name}: ERROR {r['reason']}")
            continue
        r["nmse"] = err
        if not ok:
            r.update(status="failed", reason=f"NMSE {err:.3g} > {v.tol:g}")
            log(f"!!! {case.name} / {v.name}: FAILED CHECK, NMSE {err:.3g} > {v.tol:g}; not timed")
            continue
        fns[v.name] = fn
    return min_bytes(case, inp), res, fns


def run_cases(group, vlist, target_s, rounds, log):
    """Time one case, or a group of cases (same `group`) interleaved together, so that rows meant
    to be compared with each other (alloc vs out=) see the same machine conditions."""
    prepared = [prepare(c, vlist, log) for c in group]
    fns = {(i, k): fn for i, (_, _, f) in enumerate(prepared) for k, fn in f.items()}
    # each variant gets ~target_s of calls (>= one per round), interleaved over the rounds
    timed = timing.measure(fns, target_s=target_s, rounds=rounds, per_call=group[0].mode != "kernel")
    for (i, k), tr in timed.items():
        nbytes, res, _ = prepared[i]
        res[k].update(tr)
        res[k]["median_us"] = tr["median_ns"] / 1e3
        res[k]["gbps"] = nbytes / tr["median_ns"]
    return [(c, nbytes, res) for c, (nbytes, res, _) in zip(group, prepared)]


# ------------------------------------------------------------------------------------------------
# Reporting

def machine_info(peers):
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=5).stdout.strip())
    except Exception:
        commit, dirty = None, None
    try:
        import numba
        numba_v = numba.__version__
    except Exception:
        numba_v = None
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "numba": numba_v,
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "os_cpu_count": os.cpu_count(),
        "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "openblas_env": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ},
        "git_commit": commit,
        "git_dirty": dirty,
        "cpufuse": cpufuse.info(),
    }
    if peers:
        from . import peers as P
        info["peers"] = {p: {"version": P.PEER_VERSIONS[p](), "unavailable": why}
                         for p, why in P.availability().items()}
    return info


def _fmt_us(us):
    if us is None:
        return "–"
    return f"{us:.2f}" if us < 10 else f"{us:,.0f}" if us >= 1000 else f"{us:.1f}"


def _fmt_load(v):
    return "?" if not v else f"{v[0]:.2f}"


def _fmt_x(v):
    return "–" if v is None else f"{v:.2f}×"


def markdown(report):
    m = report["machine"]
    cols = [v["name"] for v in report["variants"]]
    lines = [
        "# cpufuse benchmark",
        "",
        f"{m['date']} · {m['cpu_model']} · Python {m['python']} · numpy {m['numpy']} · numba {m['numba']} · "
        f"cpufuse {m['cpufuse']['version']} ({', '.join(m['cpufuse']['available_isas'])}) · "
        f"git {m['git_commit']}{' (dirty)' if m['git_dirty'] else ''} · affinity {m['affinity']}"
        f"{' · QUICK' if report['quick'] else ''}",
        "",
        f"Copy bandwidth (np.copyto, counted as read + write): DRAM {report['copy_bw']['dram']['gbps']:.1f} GB/s "
        f"({report['copy_bw']['dram']['bytes'] >> 20} MiB array), L2 {report['copy_bw']['l2']['gbps']:.1f} GB/s "
        f"({report['copy_bw']['l2']['bytes'] >> 10} KiB array); medians of {report['copy_bw']['dram']['samples']} "
        f"samples spread over the run. Timer pair: {report['timer_overhead_ns']:.0f} ns. "
        f"Load average at start / end: {_fmt_load(m.get('loadavg_start'))} / {_fmt_load(report.get('loadavg_end'))}.",
        "",
        "Masks: `32×4096` = 32 new tokens at the end of a 4096-token context (row i masks keys j > 4064 + i); "
        "`4096×512` = 8 heads × 512 queries over 512 keys, flattened (row i masks keys j > i mod 512), f16. "
        "Kernel rows: back-to-back calls, cpufuse / onnxruntime / ggml write into preallocated outputs, numpy and "
        "torch allocate as users write them. Latency rows: each call timed on its own.",
        "",
        "Median time per call, µs (1 thread; **bold** = fastest in the row):",
        "",
        "| case | " + " | ".join(cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for c in report["cases"]:
        t = {k: r.get("median_us") for k, r in c["results"].items()}
        best = min((v for v in t.values() if v), default=None)
        cells = []
        for k in cols:
            r = c["results"].get(k, {})
            if r.get("status") == "ok":
                s = _fmt_us(t[k])
                cells.append(f"**{s}**" if t[k] == best else s)
            else:
                cells.append({"skipped": "n/a", "failed": "FAIL", "error": "ERR"}.get(r.get("status"), "–"))
        lines.append(f"| {c['case']['name']} | " + " | ".join(cells) + " |")
    peer_cols = [p for p in ("torch", "onnxruntime", "ggml") if p in cols]
    lines += [
        "",
        "Derived (best cpufuse = fastest cpufuse column; GB/s = minimum bytes moved / median time):",
        "",
        "| case | MB moved | best cpufuse | GB/s | vector gain | fusion gain | user gain | % DRAM copy |"
        + "".join(f" {p} / best |" for p in peer_cols),
        "|---|---:|---|---:|---:|---:|---:|---:|" + "---:|" * len(peer_cols),
    ]
    for c in report["cases"]:
        d = c["derived"]
        pct = f"{d['pct_dram_copy']:.0f}%" if c["case"]["dram"] and "pct_dram_copy" in d else ""
        gb = f"{d['best_cpufuse_gbps']:.1f}" if "best_cpufuse_gbps" in d else "–"
        lines.append(
            f"| {c['case']['name']} | {c['bytes'] / 1e6:.3g} | {d.get('best_cpufuse', '–')} | {gb} | "
            f"{_fmt_x(d.get('vector_gain'))} | {_fmt_x(d.get('fusion_gain'))} | {_fmt_x(d.get('user_gain'))} | {pct} |"
            + "".join(f" {_fmt_x(d.get(f'{p}_over_cpufuse'))} |" for p in peer_cols))
    lines += [
        "",
        "vector gain = scalar fused / best SIMD fused · fusion gain = SIMD unfused / SIMD fused (same ISA) · "
        "user gain = numpy / best cpufuse" + (" · peer / best = peer time / best cpufuse time (> 1: cpufuse faster)"
                                             if peer_cols else ""),
    ]
    notes = []
    err = m["cpufuse"].get("native_load_error")
    if err:
        notes.append(f"- **WARNING: the cpufuse native extension did not load** ({err}); only numba runs")
    for isa, why in report.get("unavailable_isas", {}).items():
        notes.append(f"- no {isa} column: {why}")
    for c in report["cases"]:
        for k, r in c["results"].items():
            if r.get("status") in ("failed", "error"):
                notes.append(f"- **{r['status'].upper()}** {c['case']['name']} / {k}: {r['reason']}")
    skipped = {}
    for c in report["cases"]:
        for k, r in c["results"].items():
            if r.get("status") == "skipped":
                skipped.setdefault((k, r["reason"]), []).append(c["case"]["name"])
    for (k, why), names in skipped.items():
        where = "all cases" if len(names) == len(report["cases"]) else ", ".join(names)
        notes.append(f"- skipped {k} ({where}): {why}")
    if notes:
        lines += ["", "Notes:", ""] + notes
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short timings (smoke run, < 1 min)")
    ap.add_argument("--peers", action="store_true", help="add PyTorch, onnxruntime and ggml columns")
    ap.add_argument("--json", metavar="PATH", help="write the full results as JSON")
    ap.add_argument("--md", metavar="PATH", help="write the markdown tables")
    ap.add_argument("--only", metavar="SUBSTR", action="append", help="run only cases whose name contains this")
    ap.add_argument("--target", type=float, default=None, help="seconds of timing per variant and case")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per case")
    a = ap.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    target = a.target if a.target is not None else (0.03 if a.quick else 0.6)
    rounds = a.rounds if a.rounds is not None else (3 if a.quick else 15)
    cases = [c for c in CASES if (not a.quick or c.quick) and (not a.only or any(s in c.name for s in a.only))]
    vlist = variants(a.peers)
    machine = machine_info(a.peers)
    if a.peers:
        for p, d in machine["peers"].items():
            if d["unavailable"]:
                log(f"peer {p} skipped: {d['unavailable']}")
    log(f"cpufuse ISAs {', '.join(cpufuse.available_isas())}; variants: {', '.join(v.name for v in vlist)}; "
        f"affinity {machine['affinity']}")
    if machine["cpufuse"]["native_load_error"]:
        log(f"!!! cpufuse native extension failed to load: {machine['cpufuse']['native_load_error']}")
    if machine["affinity"] and len(machine["affinity"]) > 1:
        log("note: not pinned to one core (use taskset -c 0)")

    # copy bandwidth: samples at the start, then one after every case; medians over all of them
    copiers = {"dram": timing.CopyBandwidth(256 << 20, reps=7), "l2": timing.CopyBandwidth(256 << 10, reps=15)}
    for c in copiers.values():
        c.sample(3 if a.quick else 7)
    copy_bw = {k: c.result() for k, c in copiers.items()}
    report = {"quick": a.quick, "peers": a.peers, "machine": machine, "unavailable_isas": unavailable_isas(),
              "copy_bw": copy_bw,
              "timer_overhead_ns": timing.timer_overhead_ns(), "target_s": target, "rounds": rounds,
              "eps": EPS, "variants": [asdict(v) for v in vlist], "cases": []}
    log(f"copy bandwidth at start: DRAM {copy_bw['dram']['gbps']:.1f} GB/s, L2 {copy_bw['l2']['gbps']:.1f} GB/s")
    groups = []
    for case in cases:
        if groups and case.group and groups[-1][0].group == case.group:
            groups[-1].append(case)
        else:
            groups.append([case])
    for group in groups:
        for case, nbytes, res in run_cases(group, vlist, target, rounds, log):
            report["cases"].append({"case": case, "bytes": nbytes, "results": res})
            log(f"{case.name}: " + ", ".join(f"{k} {r['median_us']:.3g}" for k, r in res.items() if "median_us" in r))
        for c in copiers.values():
            c.sample()
    report["copy_bw"] = copy_bw = {k: c.result() for k, c in copiers.items()}
    for c in copiers.values():
        c.release()
    for entry in report["cases"]:
        entry["derived"] = derived(entry["case"], entry["results"], copy_bw)
        entry["case"] = asdict(entry["case"])
    report["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    md = markdown(report)
    print(md)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if a.md:
        os.makedirs(os.path.dirname(os.path.abspath(a.md)), exist_ok=True)
        with open(a.md, "w") as f:
            f.write(md)
    bad = [(c["case"]["name"], k) for c in report["cases"] for k, r in c["results"].items()
           if r["status"] in ("failed", "error") and r["kind"] == "cpufuse"]
    if bad:
        log(f"!!! {len(bad)} cpufuse variant(s) failed the check: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
