"""Thread control for the kernel tables (1-thread and all-core columns in one process) and the
machine probes (FMA and int8 peak, DRAM read, busy cores). Details: bench/README.md, "bench.threads".
"""
import concurrent.futures
import ctypes
import glob
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from .timing import spread

ALL = 0  # Variant.nth value meaning "every core of the affinity set"
try:
    ALL_CORES = sorted(os.sched_getaffinity(0))
except (AttributeError, OSError):  # not Linux: no affinity control, 1-thread columns only
    ALL_CORES = None
n_all = len(ALL_CORES) if ALL_CORES else 1
_pin_core, _mode = [ALL_CORES[0] if ALL_CORES else None], [None]
# seconds to wait when going from n threads to fewer (set by sections whose all-core columns run OpenBLAS):
# its idle workers spin ~0.1 s after a parallel call (THREAD_TIMEOUT), stealing the next 1-thread core
settle_s = [0.0]


def best_isa():
    """cpufuse's first native ISA here (the probes' and the model's), or None"""
    import cpufuse
    return next((i for i in cpufuse.available_isas() if i != "numba"), None)


def set_pin_core(core):
    if ALL_CORES is not None and core not in ALL_CORES:
        raise ValueError(f"--pin-core {core} is not in this process's affinity {ALL_CORES}")
    _pin_core[0], _mode[0] = core, None


def pin_core():
    return _pin_core[0]


def resolve(nth):
    """the thread count a variant's nth means here"""
    return n_all if nth == ALL else nth


def _find_blas_setter():
    """numpy's OpenBLAS set_num_threads (no threadpoolctl needed): (setter, its name)"""
    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in glob.glob(os.path.join(libs, "lib*openblas*.so*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "openblas_set_num_threads64_", "openblas_set_num_threads"):
            f = getattr(lib, name, None)
            if f is not None:
                f.argtypes, f.restype = [ctypes.c_int], None
                return (lambda n, f=f: f(int(n))), f"{os.path.basename(path)}:{name}"
    return (lambda n: None), "numpy's OpenBLAS set_num_threads not found (BLAS thread count left as is)"


set_blas_threads, BLAS_CONTROL = _find_blas_setter()


def enter(nth):
    """make the calling (main) thread ready for a variant of `nth` threads: 1 (pinned to one core,
    OpenBLAS on 1 thread), ALL (every core, OpenBLAS on all), or n > 1 (every core allowed, OpenBLAS
    on n: bench.run --scaling)"""
    want = resolve(nth)
    if _mode[0] == want:
        return
    leaving_multi = _mode[0] is not None and _mode[0] > want
    if ALL_CORES is not None and (_mode[0] is None or (_mode[0] == 1) != (want == 1)):
        os.sched_setaffinity(0, {_pin_core[0]} if want == 1 else set(ALL_CORES))
    set_blas_threads(want)
    _mode[0] = want
    if leaving_multi and settle_s[0] > 0:
        time.sleep(settle_s[0])


def run_module(*args, timeout=900):
    """python -m ARGS from the repository root on every core of the original affinity (a pinned test
    process's child inherits its pinning); asserts it exits 0, returns its stdout"""
    p = subprocess.run([sys.executable, "-m", *args], cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       capture_output=True, text=True, timeout=timeout,
                       preexec_fn=(lambda: os.sched_setaffinity(0, ALL_CORES)) if ALL_CORES else None)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def _cpu_times():
    """{cpu: (busy, total)} jiffies from /proc/stat for the cores of the affinity set"""
    out = {}
    with open("/proc/stat") as f:
        for name, *v in (ln.split() for ln in f if ln.startswith("cpu") and ln[3:4].isdigit()):
            if ALL_CORES is None or int(name[3:]) in ALL_CORES:
                v = [int(x) for x in v[:8]]  # user nice system idle iowait irq softirq steal
                out[int(name[3:])] = (sum(v) - v[3] - v[4], sum(v))
    return out


def busy_cores(seconds=0.5):
    """how many of this process's cores other work keeps busy (steal time included) while this
    process sleeps `seconds`: the busy shares summed over the affinity set; None without /proc/stat"""
    try:
        a = _cpu_times()
        time.sleep(seconds)
        b = _cpu_times()
    except (OSError, ValueError):
        return None
    return sum((b[c][0] - a[c][0]) / max(1, b[c][1] - a[c][1]) for c in a if c in b)


def describe():
    return {"affinity": ALL_CORES, "n_all": n_all, "pin_core": _pin_core[0], "blas_control": BLAS_CONTROL}


# ------------------------------------------------------------------------------------------------
# Peak probes (native/kernels/probe.inc): cf_fma_peak__<isa>(iters, float *sink) returns the flops it
# did, cf_int8_peak__<isa>(iters, int32_t *sink) the int8 multiply-adds; cf_read_sum__<isa>(x, n, nth)
# sums a float array on nth threads (the read bandwidth)

PROBES = {"fma": ("fma_peak", "float *"), "int8": ("int8_peak", "int32_t *")}   # registry op, sink type


def _probe(isa, kind="fma"):
    """(cf_<kind>_peak__<isa> or None, a function making a sink)"""
    from cpufuse import _backend, _registry
    return _registry.table(PROBES[kind][0]).get(isa), lambda: _backend.ffi.new(PROBES[kind][1])


def _probe_iters(fn, sink, seconds):
    """iterations for one call of the probe to take about `seconds` (calibrated on this thread)"""
    it = 10_000
    while True:
        t0 = time.perf_counter()
        fn(it, sink)
        dt = time.perf_counter() - t0
        if dt > min(0.005, seconds / 4):
            return max(1, int(it * seconds / dt))
        it *= 4


def fma_probe(isa, seconds=0.002):
    """(fn, flops): a zero-arg call of the FMA probe taking ~seconds, for timing in a case's own
    rounds (same clock and neighbours as the kernel); (None, None) when the probe is missing"""
    fn, new_sink = _probe(isa)
    if fn is None:
        return None, None
    sink = new_sink()
    it = _probe_iters(fn, sink, seconds)
    return (lambda: fn(it, sink)), fn(it, sink)


def fma_peak_stats(isa, n_threads=1, seconds=0.2, run_s=None, kind="fma"):
    """Peak of the probe `kind` (fma: GFLOP/s; int8: G multiply-adds/s) on n_threads threads: many
    short runs (2 ms; 5 ms on n > 1), so that a preemption spoils a few runs, not all; the peak is the
    best run. {"best", "median", "p10", "runs", "run_ms", "threads"}, or None without the probe."""
    fn, new_sink = _probe(isa, kind)
    if fn is None:
        return None
    enter(n_threads)
    run_s = run_s or (0.002 if n_threads == 1 else 0.005)
    runs, sinks = max(5, int(seconds / run_s)), [new_sink() for _ in range(n_threads)]
    it = _probe_iters(fn, sinks[0], run_s)
    fn(it, sinks[0])  # warm-up (clock ramp)
    flops, t0s, t1s = [0.0] * n_threads, [0] * n_threads, [0] * n_threads
    start, done = threading.Barrier(n_threads + 1), threading.Barrier(n_threads + 1)

    def work(i):   # each worker times its own call: the main thread may get a core late
        for _ in range(runs):
            start.wait()
            t0s[i] = time.perf_counter_ns()
            flops[i] = fn(it, sinks[i])
            t1s[i] = time.perf_counter_ns()
            done.wait()
    ths = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n_threads)]
    for t in ths:
        t.start()
    res = []
    for _ in range(runs):
        start.wait()
        done.wait()
        res.append(sum(flops) / (max(t1s) - min(t0s)))
    for t in ths:
        t.join()
    res.sort()
    return {"best": res[-1], "median": statistics.median(res), "p10": res[int(0.1 * (len(res) - 1))],
            "runs": len(res), "run_ms": run_s * 1e3, "threads": n_threads}


def fma_peak(isa, n_threads=1, seconds=0.2):
    """the best run of fma_peak_stats (GFLOP/s), or None"""
    st = fma_peak_stats(isa, n_threads, seconds)
    return st and st["best"]


def int8_peak_stats(isa, n_threads=1, seconds=0.2):
    return fma_peak_stats(isa, n_threads, seconds, kind="int8")


def read_fn(a, n_threads=1, isa=None):
    """(a zero-arg call reading the float32 array a once, how): cpufuse's cf_read_sum__<isa> on its
    pool when isa has one, else numpy's max over n_threads slices from Python threads (numpy
    releases the GIL; the pool is started in the caller's thread mode)"""
    if isa:
        from cpufuse import _backend, _registry
        f = _registry.table("read_sum").get(isa)
        if f is not None:
            ptr = _backend.ffi.cast("const float *", a.ctypes.data)
            return (lambda: f(ptr, a.size, n_threads)), f"cf_read_sum__{isa} (cpufuse pool)"
    if n_threads <= 1:
        return (lambda: np.max(a)), "numpy max"
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=n_threads)
    b = [a.size * i // n_threads // 16 * 16 for i in range(n_threads)] + [a.size]
    parts = [a[lo:hi] for lo, hi in zip(b[:-1], b[1:])]
    list(pool.map(np.max, parts))   # start every worker now
    return (lambda: max(pool.map(np.max, parts))), f"numpy max on {n_threads} Python threads"


def read_bw_stats(n_threads=1, nbytes=1 << 30, passes=7, isa=None):
    """DRAM read bandwidth over a float32 array of nbytes, `passes` timed passes after one untimed:
    timing.spread's GB/s ("gbps": the median pass), "passes", "bytes", "threads", "how"; the caller
    sets the affinity (taskset -c 0 for the 1-thread figure)"""
    a = np.full(nbytes // 4, 1.0, np.float32)    # written: no page is the shared zero page
    fn, how = read_fn(a, n_threads, isa)
    fn()
    ts = []
    for _ in range(passes):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return dict(spread(ts, a.nbytes), passes=passes, bytes=a.nbytes, threads=n_threads, how=how)
