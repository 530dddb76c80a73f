"""The model, peer and serving benches (bench/README.md): `python -m bench.e2e` (model.py), big.py and
bigmodels.py (real shapes), serve.py (the servers under load), profile.py; peer.py runs in llama-cpp-python's
venv. Below: what they share (one process per engine, medians over rounds, the report's header and
footer; the tables: bench/report.py's table)."""
import importlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from ..timing import bench_env, cpu_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "bench", "results")
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PEER = os.path.join(ROOT, ".venv-llama", "bin", "python")
NCPU = len(os.sched_getaffinity(0))


def parse_threads(s, ncpu=NCPU):
    """--threads: a comma list of thread counts ("all" = ncpu), sorted, no repeats; empty: 1 and ncpu"""
    if not s:
        return sorted({1, ncpu})
    try:
        ts = sorted({ncpu if x.strip() in ("all", "max") else int(x) for x in s.split(",") if x.strip()})
    except ValueError:
        ts = []
    if not ts or ts[0] < 1:
        raise SystemExit(f"--threads {s!r}: expected a comma list of positive integers or 'all'")
    return ts


def median(xs):
    """the median of the numbers that are not None or NaN (None when there are none)"""
    xs = [x for x in xs if x is not None and x == x]
    return statistics.median(xs) if xs else None


def fmt(x, nd=1):
    return "–" if x is None or x != x else f"{x:.{nd}f}"


def ratio(a, b, nd=2):
    return f"{a / b:.{nd}f}×" if a and b and a == a and b == b else "–"


def machine():
    """the machine's facts for a report's header"""
    import cpufuse
    return {"cpu": cpu_name(), "ncpu_affinity": NCPU, "platform": platform.platform(),
            "python": platform.python_version(), "cpufuse": cpufuse.__version__,
            "cpufuse_isa": cpufuse.available_isas()[0]}


def model_path(name=None):
    """The GGUF of a --model(s) argument: SmolLM2 (None or smollm2; its package installed), 1b (bigmodels.py's
    1B Q4_0 file, written on first use), a model name of `python -m cpufuse models` or a path"""
    from cpufuse.llama.cli import INSTALL_HINT, find_smollm2
    from cpufuse.llama.hub import resolve
    if name == "1b":
        from . import bigmodels
        return bigmodels.ensure("1b", "q4_0", log=lambda m: print(m, flush=True))
    try:
        path = find_smollm2() if name in (None, "smollm2") else resolve(name)
    except (ValueError, OSError) as e:
        sys.exit(f"bench.e2e: model {name!r}: {e}")
    return path or sys.exit(f"bench.e2e: SmolLM2 is not installed: {INSTALL_HINT} (or give a model)")


def peer_status(peer, module="llama_cpp"):
    """None when the interpreter `peer` imports `module` (and numpy), else why not"""
    if not peer or not os.path.exists(peer):
        return f"peer interpreter {peer} not found (build it with `make bench-e2e`, ~20 min)"
    p = subprocess.run([peer, "-c", f"import {module}, numpy"], capture_output=True, text=True)
    return f"{module} not importable by {peer}: {p.stderr.strip()[-300:]!r}" if p.returncode else None


def run_job(job, python=sys.executable, script=("-m", "bench.e2e", "--worker"), pin=False, threads=1, timeout=900):
    """One job (a dict, passed as a JSON file) in a fresh process `python *script JOB.json`, pinned to
    core 0 when `pin`, BLAS on `threads`; the process prints `E2E_RESULT {json}`: (result, None) or
    (None, the error)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    cmd = ([shutil.which("taskset") or "taskset", "-c", "0"] if pin else []) + [python, *script, f.name]
    env = bench_env("CPUFUSE_DISABLE_FUSION")
    env.update({v: str(threads) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")})
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, f"timeout after {timeout}s"
    finally:
        os.unlink(f.name)
    for line in p.stdout.splitlines():
        if line.startswith("E2E_RESULT "):
            return json.loads(line[len("E2E_RESULT "):]), None
    return None, f"exit {p.returncode}: {(p.stderr or p.stdout).strip()[-600:]}"


def worker(path):
    """`python -m bench.e2e --worker JOB.json`: bench.e2e.<job["worker"]>.worker(job), printed for run_job"""
    with open(path) as f:
        job = json.load(f)
    res = importlib.import_module(f"bench.e2e.{job['worker']}").worker(job)
    sys.stdout.write("E2E_RESULT " + json.dumps(res) + "\n")


def run_rounds(raw, errors, name, jobs, threads, rounds, run_one, line, after=None):
    """Every job (an engine or the probes) at every thread count in its own process, `rounds` times, the
    order rotated each round: raw[job][str(t)] gets each round's result (run_one(job, t) -> (result,
    error)), errors[f"{name} {job} t={t}"] the first error; after() runs after each thread count."""
    for rnd in range(rounds):
        for t in threads:
            k = rnd % len(jobs)
            for j in jobs[k:] + jobs[:k]:
                t0 = time.perf_counter()
                res, err = run_one(j, t)
                if err:
                    errors.setdefault(f"{name} {j} t={t}", err)
                    print(f"  {name} round {rnd + 1} t={t} {j}: FAILED {err[-300:]}", flush=True)
                    continue
                res.update(load_avg=os.getloadavg(), seconds=time.perf_counter() - t0)
                raw[j][str(t)].append(res)
                print(f"  {name} round {rnd + 1} t={t} {line(j, res)} ({res['seconds']:.0f} s)", flush=True)
            if after:
                after()


def per_round(rs, key):
    """{median, rounds, min, max} over the rounds of each round's median of one measurement, or None"""
    xs = [x for x in (median(r["wall"].get(key, [])) for r in rs) if x is not None]
    return {"median": median(xs), "rounds": xs, "min": min(xs), "max": max(xs)} if xs else None


def spread_line(cells):
    """the report's line on the spread between rounds of per_round cells"""
    s = [(d["max"] - d["min"]) / d["median"] for d in cells if d and d.get("median")]
    return [f"Spread between rounds ((max − min) / median over all cells): median {100 * statistics.median(s):.0f} %, "
            f"largest {100 * max(s):.0f} %.", ""] if s else []


def wall_line(res, nd=1):
    return "  ".join(f"{k} {fmt(median(v), nd):>8}" for k, v in res["wall"].items())


def header(R, what):
    """the report's first lines: the machine, the load, the rounds"""
    m, la = R["machine"], (R["load_avg_start"][0], R["load_avg_end"][0])
    return [f"Machine: {m['cpu']}, {m['ncpu_affinity']} CPUs in the affinity, Python {m['python']}, cpufuse ISA "
            f"{m['cpufuse_isa']}. llama.cpp: {what}. Load average at start {la[0]:.2f}, at end {la[1]:.2f}. "
            f"{R['rounds']} alternating rounds (each engine in its own process per round, order rotated); run time "
            f"{R['seconds'] / 60:.1f} min.", ""]


def footer(R):
    """the report's last lines: llama.cpp's system info, the failures"""
    info = (R.get("peer") or {}).get("system_info")
    return ([f"llama.cpp system info: `{info.strip()}`", ""] if info else []) + (
        ["Failures: " + "; ".join(f"{k}: {v[-200:]}" for k, v in R["errors"].items()), ""] if R.get("errors") else [])
