"""Thread control for the benchmark: 1-thread vs all-core columns in one process.

The 1-thread columns must run on one core and the all-core columns on every core the process may
use. Instead of pinning the whole process with `taskset -c 0` (which leaves no cores for the
all-core columns), the harness switches the *main thread's* CPU affinity before each batch of
calls (outside the timed region):

  * ``enter(1)``: main thread pinned to one core (the first of the affinity set, or --pin-core),
    numpy's OpenBLAS limited to 1 thread;
  * ``enter(ALL)``: main thread back on the whole affinity set, OpenBLAS on ``n_all`` threads.

Thread pools created later inherit the creating thread's affinity, so nothing with more than one
thread may be *started* while the main thread is pinned: cpufuse's pool starts its workers during
its first n_threads > 1 call, which the harness only makes in ALL mode, and the parallel copy's
threads are started here at construction. OpenBLAS starts its workers when numpy is imported (before
any pinning). torch, onnxruntime and ggml are configured for one thread elsewhere.

When the process itself is pinned to one core (taskset -c 0), ``n_all`` is 1 and the all-core
columns are skipped.
"""
import concurrent.futures
import ctypes
import glob
import math
import os
import statistics
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
    (every core allowed, OpenBLAS on n threads: bench.scaling)."""
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


def describe():
    return {"affinity": ALL_CORES, "n_all": n_all, "pin_core": _pin_core[0], "blas_control": BLAS_CONTROL}


# ------------------------------------------------------------------------------------------------
# Multi-threaded copy bandwidth: np.copyto on disjoint slices from a pool of n threads (numpy
# releases the GIL while copying), counted as 2 x bytes, like timing.CopyBandwidth.

class ParallelCopyBandwidth:
    """arrays: optional (src, dst) float32 buffers to share between several instances."""

    def __init__(self, nbytes, n_threads, min_s=0.05, reps=7, arrays=None):
        self.nbytes, self.n, self.reps = nbytes, n_threads, reps
        n = nbytes // 4
        if arrays is None:
            self.src = np.random.default_rng(1).standard_normal(n, dtype=np.float32)
            self.dst = np.empty_like(self.src)
        else:
            self.src, self.dst = arrays[0][:n], arrays[1][:n]
        bounds = [n * i // n_threads for i in range(n_threads + 1)]
        # cache-line aligned slice bounds (16 floats)
        bounds = [b - b % 16 for b in bounds[:-1]] + [n]
        self.parts = [(self.dst[a:b], self.src[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        prev = _mode[0]
        enter(max(2, n_threads) if n_all > 1 else 1)  # the pool's threads inherit the full affinity
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=n_threads)
        # start every worker now (the executor starts them lazily, one per submit when none idle)
        barrier = threading.Barrier(n_threads)
        list(self.pool.map(lambda _: barrier.wait(), range(n_threads)))
        t0 = time.perf_counter_ns()
        self._once()
        est = max(1, time.perf_counter_ns() - t0)
        self.k = max(1, math.ceil(min_s / reps * 1e9 / est))
        self.samples = []
        if prev is not None:
            enter(prev)

    def _once(self):
        futs = [self.pool.submit(np.copyto, d, s) for d, s in self.parts]
        for f in futs:
            f.result()

    def sample(self, n=1):
        enter(self.n if self.n > 1 else 1)
        for _ in range(n):
            t0 = time.perf_counter_ns()
            for _ in range(self.k):
                self._once()
            self.samples.append((time.perf_counter_ns() - t0) / self.k)

    def result(self):
        med = statistics.median(self.samples)
        return {"bytes": self.nbytes, "counted_bytes": 2 * self.nbytes, "threads": self.n, "median_ns": med,
                "gbps": 2 * self.nbytes / med, "best_gbps": 2 * self.nbytes / min(self.samples),
                "worst_gbps": 2 * self.nbytes / max(self.samples), "samples": len(self.samples), "k": self.k}

    def release(self):
        self.pool.shutdown()
        self.src = self.dst = self.parts = None


# ------------------------------------------------------------------------------------------------
# FMA peak: cpufuse's cf_fma_peak__<isa>(iters, sink) returns the flops it did; we time it.

def _probe(isa):
    """cf_fma_peak__<isa>, or None when the probe is missing"""
    from cpufuse import _backend
    lib = _backend.lib
    return getattr(lib, f"cf_fma_peak__{isa}", None) if lib is not None else None


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


def fma_peak(isa, n_threads=1, seconds=0.2, tries=5):
    """Single-precision FMA peak (GFLOP/s) of `isa` on n_threads threads (cffi releases the GIL):
    best of `tries` runs of about seconds / tries each. None when the probe is missing."""
    fn = _probe(isa)
    if fn is None:
        return None
    from cpufuse import _backend
    enter(n_threads)
    sinks = [_backend.ffi.new("float *") for _ in range(n_threads)]
    it = _probe_iters(fn, sinks[0], seconds / tries)
    best = 0.0
    for _ in range(tries):
        if n_threads == 1:
            t0 = time.perf_counter()
            flops = fn(it, sinks[0])
            dt = time.perf_counter() - t0
        else:
            res = [0.0] * n_threads
            barrier = threading.Barrier(n_threads + 1)

            def work(i):
                barrier.wait()
                res[i] = fn(it, sinks[i])
            ths = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
            for t in ths:
                t.start()
            barrier.wait()
            t0 = time.perf_counter()
            for t in ths:
                t.join()
            dt = time.perf_counter() - t0
            flops = sum(res)
        best = max(best, flops / dt / 1e9)
    return best
