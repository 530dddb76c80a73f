"""Thread control for the benchmark: 1-thread vs all-core columns in one process.

Details: bench/README.md, "bench.threads".
"""
import concurrent.futures
import ctypes
import functools
import glob
import math
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

ALL = 0  # Variant.nth value meaning "every core of the affinity set"

try:
    ALL_CORES = sorted(os.sched_getaffinity(0))
except (AttributeError, OSError):  # not Linux: no affinity control, 1-thread columns only
    ALL_CORES = None
n_all = len(ALL_CORES) if ALL_CORES else 1
_pin_core = [ALL_CORES[0] if ALL_CORES else None]
_mode = [None]


def best_isa():
    """cpufuse's first native ISA here (the probes' and the model's), or None"""
    import cpufuse
    return next((i for i in cpufuse.available_isas() if i != "numba"), None)


def set_pin_core(core):
    if ALL_CORES is None:
        return
    if core not in ALL_CORES:
        raise ValueError(f"--pin-core {core} is not in this process's affinity {ALL_CORES}")
    _pin_core[0] = core
    _mode[0] = None


def pin_core():
    return _pin_core[0]


def resolve(nth):
    """the thread count a variant's nth means here"""
    return n_all if nth == ALL else nth


# ------------------------------------------------------------------------------------------------
# OpenBLAS (numpy's) thread count, through its exported setter (no threadpoolctl needed)

def _find_blas_setter():
    try:
        import threadpoolctl  # noqa: F401  (preferred when installed)
        from threadpoolctl import ThreadpoolController
        ctl = ThreadpoolController()
        libs = [lib for lib in ctl.lib_controllers if lib.internal_api in ("openblas", "mkl", "blis")]
        if libs:
            return (lambda n: [lib.set_num_threads(n) for lib in libs]), f"threadpoolctl ({libs[0].internal_api})"
    except Exception:
        pass
    libdir = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in glob.glob(os.path.join(libdir, "lib*openblas*.so*")):
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
    return None, "numpy's OpenBLAS set_num_threads not found (BLAS thread count left as is)"


_blas_set, BLAS_CONTROL = _find_blas_setter()


def set_blas_threads(n):
    if _blas_set is not None:
        _blas_set(n)


# ------------------------------------------------------------------------------------------------

def enter(nth):
    """Make the calling (main) thread ready to run a variant with `nth` threads: 1 (pinned to one
    core, OpenBLAS on 1 thread), ALL (every core, OpenBLAS on all of them), or a count n > 1
    (every core allowed, OpenBLAS on n threads: bench.run --scaling)."""
    n = resolve(nth)
    want = 1 if n == 1 else n
    if _mode[0] == want:
        return
    leaving_multi = _mode[0] is not None and _mode[0] > want  # fewer threads than before
    if ALL_CORES is not None and (_mode[0] is None or (_mode[0] == 1) != (want == 1)):
        os.sched_setaffinity(0, {_pin_core[0]} if want == 1 else set(ALL_CORES))
    set_blas_threads(want)
    _mode[0] = want
    if leaving_multi and settle_s[0] > 0:
        time.sleep(settle_s[0])


# Seconds to wait when going from n threads to fewer (set by sections whose all-core columns run
# OpenBLAS): OpenBLAS's idle workers keep spinning for ~0.1 s after a parallel call (its
# THREAD_TIMEOUT, 2^28 cycles), which would steal the core of the next 1-thread variant.
settle_s = [0.0]


def run_module(*args, timeout=900):
    """python -m ARGS from the repository root on every core of the original affinity (a pinned
    test process's child inherits its pinning); asserts it exits 0, returns its stdout"""
    every = (lambda: os.sched_setaffinity(0, ALL_CORES)) if ALL_CORES else None
    p = subprocess.run([sys.executable, "-m", *args], cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       capture_output=True, text=True, timeout=timeout, preexec_fn=every)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def _cpu_times():
    """{cpu: (busy, total)} jiffies from /proc/stat for the cores of the affinity set"""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3:4].isdigit():
                name, *v = line.split()
                cpu = int(name[3:])
                if ALL_CORES is None or cpu in ALL_CORES:
                    v = [int(x) for x in v[:8]]  # user nice system idle iowait irq softirq steal
                    out[cpu] = (sum(v) - v[3] - v[4], sum(v))
    return out


def busy_cores(seconds=0.5):
    """How many of this process's cores other work keeps busy: the busy share of each core (steal
    time included: other guests on the host) summed over the affinity set, measured while this
    process sleeps for `seconds`. None where /proc/stat is missing."""
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
# Multi-threaded copy bandwidth: np.copyto (numpy releases the GIL while copying) of disjoint slices
# by a pool of n threads at once, counted as 2 x bytes, like timing.CopyBandwidth: one sample =
# every thread copies one chunk (<= 8 MiB) of its own slice, the slices walked in turn, so each
# sample lasts ~1 ms (far shorter than a scheduler time slice) and reads DRAM.

class ParallelCopyBandwidth:
    """arrays: optional (src, dst) float32 buffers to share between several instances."""

    def __init__(self, nbytes, n_threads, per_sample_s=0.02, chunk=8 << 20, arrays=None, min_s=None, reps=None):
        self.nbytes, self.n, self.per_sample_s = nbytes, n_threads, per_sample_s
        n = nbytes // 4
        if arrays is None:
            self.src = np.empty(n, np.float32)
            self.src.fill(1.5)
            self.dst = np.empty_like(self.src)
        else:
            self.src, self.dst = arrays[0][:n], arrays[1][:n]
        bounds = [n * i // n_threads for i in range(n_threads + 1)]
        bounds = [b - b % 16 for b in bounds[:-1]] + [n]  # cache-line aligned slice bounds (16 floats)
        # each thread's slice cut into >= 4 chunks of <= `chunk` bytes: one sample = one chunk per thread
        steps = max(4, math.ceil((bounds[1] - bounds[0]) * 4 / chunk))
        self.parts = []
        for j in range(steps):
            step = []
            for a, b in zip(bounds[:-1], bounds[1:]):
                lo, hi = a + (b - a) * j // steps, a + (b - a) * (j + 1) // steps
                step.append((self.dst[lo:hi], self.src[lo:hi]))
            self.parts.append(step)
        self.counted = [2 * sum(d.nbytes for d, _ in step) for step in self.parts]
        prev = _mode[0]
        enter(max(2, n_threads) if n_all > 1 else 1)  # the pool's threads inherit the full affinity
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=n_threads)
        # start every worker now (the executor starts them lazily, one per submit when none idle)
        barrier = threading.Barrier(n_threads)
        list(self.pool.map(lambda _: barrier.wait(), range(n_threads)))
        self._next = 0
        for _ in range(2 * steps):  # first touch and warm-up
            self._once()
        self.samples = []  # ns per counted byte
        if prev is not None:
            enter(prev)

    def _once(self):
        step = self.parts[self._next]
        t0 = time.perf_counter_ns()
        futs = [self.pool.submit(np.copyto, d, s) for d, s in step]
        for f in futs:
            f.result()
        dt = time.perf_counter_ns() - t0
        i = self._next
        self._next = (i + 1) % len(self.parts)
        return dt / self.counted[i]

    def sample(self, n=1):
        enter(self.n if self.n > 1 else 1)
        for _ in range(n):
            t_end = time.perf_counter_ns() + self.per_sample_s * 1e9
            m = 0
            while m < 8 or time.perf_counter_ns() < t_end:
                self.samples.append(self._once())
                m += 1

    def result(self):
        from .timing import spread
        r = {"bytes": self.nbytes, "counted_bytes": self.counted[0], "threads": self.n, "how": "np.copyto",
             "median_ns": statistics.median(self.samples) * self.counted[0], "samples": len(self.samples), "k": 1}
        r.update(spread(self.samples, 1.0))
        return r

    def release(self):
        self.pool.shutdown()
        self.src = self.dst = self.parts = None


# ------------------------------------------------------------------------------------------------
# Peak probes: cpufuse's cf_fma_peak__<isa>(iters, float *sink) returns the flops it did and
# cf_int8_peak__<isa>(iters, int32_t *sink) the int8 multiply-adds (native/kernels/probe.inc); we
# time them. cf_read_sum__<isa>(x, n, nth) sums a float array on nth threads: the read bandwidth.

# probe kind: (the registry's op, the sink's C type)
PROBES = {"fma": ("fma_peak", "float *"), "int8": ("int8_peak", "int32_t *")}


def _probe(isa, kind="fma"):
    """cf_<kind>_peak__<isa>, or None when the probe is missing"""
    from cpufuse import _registry
    return _registry.table(PROBES[kind][0]).get(isa)


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
    """(fn, flops): a zero-arg call of `isa`'s FMA peak probe on the calling thread taking about
    `seconds`, and the flops one call does; (None, None) when the probe is missing. For timing the
    probe in the same interleaved rounds as a kernel, so both see the same clock and neighbours."""
    fn = _probe(isa)
    if fn is None:
        return None, None
    from cpufuse import _backend
    sink = _backend.ffi.new("float *")
    it = _probe_iters(fn, sink, seconds)
    return (lambda: fn(it, sink)), fn(it, sink)


def fma_peak_stats(isa, n_threads=1, seconds=0.2, run_s=None, kind="fma"):
    """Peak of `isa`'s probe `kind` ("fma": single-precision FMA, GFLOP/s; "int8": the int8 dot,
    G multiply-adds/s) on n_threads threads (cffi releases the GIL): many short runs (~2 ms; 5 ms
    on n > 1 threads, whose start costs more), so that a preemption on a shared machine spoils a
    few runs instead of all of them. {"best", "median", "p10" (slow decile), "runs", "run_ms"};
    None when the probe is missing. The peak is the best run: noise only slows a run down."""
    fn = _probe(isa, kind)
    if fn is None:
        return None
    from cpufuse import _backend
    enter(n_threads)
    run_s = run_s or (0.002 if n_threads == 1 else 0.005)
    runs = max(5, int(seconds / run_s))
    sinks = [_backend.ffi.new(PROBES[kind][1]) for _ in range(n_threads)]
    it = _probe_iters(fn, sinks[0], run_s)
    fn(it, sinks[0])  # warm-up (clock ramp)
    res = []
    if n_threads == 1:
        for _ in range(runs):
            t0 = time.perf_counter_ns()
            flops = fn(it, sinks[0])
            res.append(flops / (time.perf_counter_ns() - t0))
    else:
        # each worker times its own call: the main thread, one more thread than cores, may get a
        # core only after the workers are well into their runs (a late start would read high)
        flops, t0s, t1s = [0.0] * n_threads, [0] * n_threads, [0] * n_threads
        start, done = threading.Barrier(n_threads + 1), threading.Barrier(n_threads + 1)

        def work(i):
            for _ in range(runs):
                start.wait()
                t0s[i] = time.perf_counter_ns()
                flops[i] = fn(it, sinks[i])
                t1s[i] = time.perf_counter_ns()
                done.wait()
        ths = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n_threads)]
        for t in ths:
            t.start()
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
    """the best run of fma_peak_stats (GFLOP/s), or None when the probe is missing"""
    st = fma_peak_stats(isa, n_threads, seconds)
    return st["best"] if st else None


def int8_peak_stats(isa, n_threads=1, seconds=0.2):
    """fma_peak_stats of the int8 dot probe: G int8 multiply-adds per second"""
    return fma_peak_stats(isa, n_threads, seconds, kind="int8")


def read_bw_stats(n_threads=1, nbytes=1 << 30, passes=7, isa=None):
    """DRAM read bandwidth: a sum over a float32 array of nbytes (far beyond the last-level cache)
    on n_threads threads, `passes` times after one untimed pass; {"gbps" (median pass), "best_gbps",
    "worst_gbps", "passes", "bytes", "threads", "how"}. Through cpufuse's cf_read_sum (its thread
    pool, vector loads) when the build has it, else numpy's max reduction over n_threads slices
    from Python threads. The caller sets the affinity (taskset -c 0 for the 1-thread figure)."""
    a = np.empty(nbytes // 4, np.float32)
    a.fill(1.0)                                # written: no page is the shared zero page
    fn = None
    if isa:
        from cpufuse import _backend, _registry
        f = _registry.table("read_sum").get(isa)
        if f is not None:
            ptr = _backend.ffi.cast("const float *", a.ctypes.data)
            fn, how = (lambda: f(ptr, a.size, n_threads)), f"cf_read_sum__{isa} (cpufuse pool)"
    pool = None
    if fn is None:
        if n_threads <= 1:
            fn = functools.partial(np.max, a)
        else:
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=n_threads)
            b = [a.size * i // n_threads // 16 * 16 for i in range(n_threads)] + [a.size]
            parts = [a[lo:hi] for lo, hi in zip(b[:-1], b[1:])]
            fn = lambda: max(pool.map(np.max, parts))   # noqa: E731
        how = "numpy max" + (f" on {n_threads} Python threads" if n_threads > 1 else "")
    try:
        fn()
        ts = []
        for _ in range(passes):
            t0 = time.perf_counter_ns()
            fn()
            ts.append(time.perf_counter_ns() - t0)
    finally:
        if pool is not None:
            pool.shutdown()
    ts.sort()
    return {"gbps": a.nbytes / statistics.median(ts), "best_gbps": a.nbytes / ts[0], "worst_gbps": a.nbytes / ts[-1],
            "passes": passes, "bytes": a.nbytes, "threads": n_threads, "how": how}
