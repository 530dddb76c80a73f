"""Timing for the kernel tables: interleaved rounds of in-process variants, the copy-bandwidth probe,
the machine's load. Details: bench/README.md, "bench.timing".
"""
import concurrent.futures
import functools
import itertools
import math
import os
import platform
import statistics
import time

import cffi
import numpy as np

_pc = time.perf_counter_ns
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def timer_overhead_ns(n=20001):
    """median cost of one back-to-back perf_counter_ns pair (ns)"""
    d = []
    for _ in range(n):
        t0 = _pc()
        d.append(_pc() - t0)
    return statistics.median(d)


def _time_k(fn, k):
    if k == 1:
        t0 = _pc()
        fn()
        return _pc() - t0
    t0 = _pc()
    for _ in itertools.repeat(None, k):
        fn()
    return (_pc() - t0) / k


def warm_up(fn, min_s=0.01, min_calls=3, max_calls=10000):
    """call fn for min_calls calls and min_s seconds; a per-call estimate (ns)"""
    t_end, last = _pc() + min_s * 1e9, []
    while len(last) < max_calls and (len(last) < min_calls or _pc() < t_end):
        last.append(_time_k(fn, 1))
    return statistics.median(last[-15:])


def plan(est_ns, target_s, rounds, per_call=False, sub_batch_ns=20_000, max_calls=1_000_000):
    """(calls per round, sub-batch size k) for a variant whose call takes about est_ns"""
    est_ns = max(est_ns, 20.0)
    per_round = max(1, math.ceil(int(min(max_calls, max(rounds, target_s * 1e9 / est_ns))) / rounds))
    k = 1 if per_call else max(1, min(per_round, math.ceil(sub_batch_ns / est_ns)))
    return max(k, per_round - per_round % k), k   # whole sub-batches


def _round_order(names, r, blocks):
    """names rotated by r; with blocks ({name: key}) each block's names rotate among themselves and
    the blocks keep their first-appearance order (a round switches thread modes once)"""
    keys = list(dict.fromkeys((blocks or {}).get(nm) for nm in names))
    out = []
    for key in keys:
        grp = [nm for nm in names if (blocks or {}).get(nm) == key]
        out += grp[r % len(grp):] + grp[:r % len(grp)]
    return out


def measure(fns, *, target_s=0.3, rounds=5, per_call=False, warm_s=0.01, pre=None, blocks=None):
    """Time the zero-arg callables of `fns` ({name: fn}) in interleaved rounds: {name: {"median_ns",
    "min_ns", "p10_ns", "p90_ns", "samples", "calls", "k"}}. pre: {name: call} run untimed before a
    variant's warm-up and batches (its thread mode); blocks: {name: key}, kept together in a round."""
    names, pre = _round_order(list(fns), 0, blocks), pre or {}
    nop = lambda: None  # noqa: E731
    plans = {}
    for nm in names:
        pre.get(nm, nop)()
        plans[nm] = plan(warm_up(fns[nm], min_s=warm_s), target_s, rounds, per_call)
    samples = {nm: [] for nm in names}
    for r in range(rounds):
        for nm in _round_order(names, r, blocks):
            (per_round, k), fn = plans[nm], fns[nm]
            pre.get(nm, nop)()
            samples[nm] += [_time_k(fn, k) for _ in range(per_round // k)]
    res = {}
    for nm, s in samples.items():
        s.sort()
        n = len(s)
        res[nm] = {"median_ns": statistics.median(s), "min_ns": s[0], "p10_ns": s[int(0.1 * (n - 1))],
                   "p90_ns": s[int(0.9 * (n - 1))], "samples": n, "calls": n * plans[nm][1], "k": plans[nm][1]}
    return res


def spread(samples_ns, nbytes):
    """GB/s of per-copy times: median, best, fast (p90) and slow (p10) decile, worst"""
    s = sorted(samples_ns)
    q = lambda p: s[min(len(s) - 1, max(0, int(round(p * (len(s) - 1)))))]  # noqa: E731
    return {"gbps": nbytes / statistics.median(s), "best_gbps": nbytes / s[0], "p90_gbps": nbytes / q(0.1),
            "p10_gbps": nbytes / q(0.9), "worst_gbps": nbytes / s[-1]}


_ffi = cffi.FFI()


class CopyBandwidth:
    """Copy bandwidth (read + write counted) of n_threads threads each copying `chunk` bytes of its
    slice of nbytes at a time, the chunks in turn (chunk = nbytes: cache-resident; 4 MiB of 256 MiB:
    DRAM); 1 thread: memmove through cffi, n: np.copyto from a pool. A sample = k copies of ~sample_s
    (a preemption spoils a few samples, not the median); bench/README.md, "Probes". pre: run before
    sampling (the thread mode); buf: a float32 block of >= 2 * nbytes + 4 KiB to share."""

    def __init__(self, nbytes, chunk=None, n_threads=1, sample_s=50e-6, per_sample_s=0.01, warm_s=0.02,
                 pre=None, buf=None):
        self.pre, self.n, self.nbytes, self.per_sample_s = pre, n_threads, nbytes, per_sample_s
        if pre is not None:
            pre()
        n = nbytes // 4
        # one block, dst half a page after src's page offset: no 4K aliasing between loads and stores
        buf = np.empty(2 * n + 1024, np.float32) if buf is None else buf
        self.src, self.dst = buf[:n], buf[n + 512:2 * n + 512]
        self.src.fill(1.5)   # written: no page is the shared zero page
        np.copyto(self.dst, self.src)  # first touch
        bounds = [n * i // n_threads // 16 * 16 for i in range(n_threads)] + [n]   # cache-line aligned
        per = bounds[1] - bounds[0]
        self.chunk = min(chunk or 4 * per, 4 * per)
        steps = max(1 if n_threads == 1 else 4, math.ceil(4 * per / self.chunk))
        cut = [[a + (b - a) * j // steps for j in range(steps + 1)] for a, b in zip(bounds[:-1], bounds[1:])]
        self.steps = [[(self.dst[c[j]:c[j + 1]], self.src[c[j]:c[j + 1]]) for c in cut] for j in range(steps)]
        self.counted = 2 * sum(d.nbytes for d, _ in self.steps[0])
        if n_threads == 1:
            cp = lambda d: _ffi.cast("char *", d.ctypes.data)  # noqa: E731
            self.calls = [functools.partial(_ffi.memmove, cp(d), cp(s), d.nbytes) for (d, s), in self.steps]
            self.how, self.pool = "memmove (cffi)", None
        else:
            self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=n_threads)
            self.calls = [functools.partial(self._parallel, st) for st in self.steps]
            self.how = f"np.copyto on {n_threads} threads"
        self._next, self.samples = 0, []
        t_end, last = _pc() + warm_s * 1e9, []
        while len(last) < 2 * len(self.calls) or _pc() < t_end:
            last.append(self._time(1))
        self.k = max(1, math.ceil(sample_s * 1e9 / max(statistics.median(last[-15:]), 1)))

    def _parallel(self, step):
        for f in [self.pool.submit(np.copyto, d, s) for d, s in step]:
            f.result()

    def _time(self, k):
        """mean ns of k copies, the chunks taken in turn from where the last batch stopped"""
        calls, i = self.calls, self._next
        t0 = _pc()
        for _ in itertools.repeat(None, k):
            calls[i]()
            i = i + 1 if i + 1 < len(calls) else 0
        dt = _pc() - t0
        self._next = i
        return dt / k

    def sample(self, n=1):
        """n sampling points (the harness: a few at the start, one after every case group)"""
        if self.pre is not None:
            self.pre()
        for _ in range(n):
            t_end = _pc() + self.per_sample_s * 1e9
            m = 0
            while m < 8 or _pc() < t_end:
                self.samples.append(self._time(self.k))
                m += 1

    def result(self):
        r = {"bytes": self.nbytes, "chunk": self.chunk, "counted_bytes": self.counted, "how": self.how,
             "threads": self.n, "median_ns": statistics.median(self.samples), "samples": len(self.samples), "k": self.k}
        return dict(r, **spread(self.samples, self.counted))

    def release(self):
        if self.pool is not None:
            self.pool.shutdown()
        self.src = self.dst = self.steps = self.calls = None


def bench_env(*drop):
    """os.environ without the old OpenBLAS tuning variables (they slow a current numpy) and `drop`"""
    return {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", *drop)}


def load_avg():
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith(("model name", "Model", "Hardware"))),
                        platform.processor())
    except OSError:
        return platform.processor()
