"""Timing primitives for the benchmark: interleaved rounds, copy bandwidth, timer overhead.

Details: bench/README.md, "bench.timing".
"""
import functools
import itertools
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time

import numpy as np

_pc = time.perf_counter_ns
_repeat = itertools.repeat


def timer_overhead_ns(n=20001):
    """Median cost of one back-to-back perf_counter_ns pair (ns)."""
    d = []
    for _ in range(n):
        t0 = _pc()
        t1 = _pc()
        d.append(t1 - t0)
    return statistics.median(d)


def _time_k(fn, k):
    if k == 1:
        t0 = _pc()
        fn()
        return _pc() - t0
    t0 = _pc()
    for _ in _repeat(None, k):
        fn()
    return (_pc() - t0) / k


def warm_up(fn, min_s=0.01, min_calls=3, max_calls=10000):
    """Call fn until min_calls calls and min_s seconds have passed; return a per-call estimate (ns)."""
    t_start = _pc()
    n = 0
    last = []
    while n < max_calls:
        t0 = _pc()
        fn()
        last.append(_pc() - t0)
        n += 1
        if n >= min_calls and _pc() - t_start >= min_s * 1e9:
            break
    return statistics.median(last[-min(len(last), 15):])


def plan(est_ns, target_s, rounds, per_call=False, sub_batch_ns=20_000, max_calls=1_000_000):
    """(calls per round, sub-batch size k) for a variant whose call takes about est_ns."""
    est_ns = max(est_ns, 20.0)
    total = int(min(max_calls, max(rounds, target_s * 1e9 / est_ns)))
    per_round = max(1, math.ceil(total / rounds))
    k = 1 if per_call else max(1, min(per_round, math.ceil(sub_batch_ns / est_ns)))
    per_round = max(k, per_round - per_round % k)  # whole sub-batches
    return per_round, k


def _round_order(names, r, blocks):
    """names rotated by r; with blocks ({name: block key}), each block's names are rotated among
    themselves and the blocks follow each other in first-appearance order, so a round switches
    between blocks (e.g. 1-thread and all-core variants) only once."""
    if not names:
        return []
    if not blocks:
        return names[r % len(names):] + names[:r % len(names)]
    keys = list(dict.fromkeys(blocks.get(nm) for nm in names))
    out = []
    for key in keys:
        grp = [nm for nm in names if blocks.get(nm) == key]
        out += grp[r % len(grp):] + grp[:r % len(grp)]
    return out


def measure(fns, *, target_s=0.3, rounds=5, per_call=False, warm_s=0.01, pre=None, blocks=None):
    """Time every zero-arg callable in `fns` (dict name -> fn) in interleaved rounds.

    pre: optional {name: callable} run (untimed) before that variant's warm-up and before each of
    its batches, e.g. to set the thread's CPU affinity for 1-thread vs all-core variants.
    blocks: optional {name: key}: variants of one key are kept together in every round's order
    (rotated among themselves), e.g. to switch thread modes only twice per round.
    Returns {name: {"median_ns", "min_ns", "p10_ns", "p90_ns", "samples", "calls", "k"}}.
    """
    names = list(fns)
    pre = pre or {}
    if blocks:  # warm up in block order too
        names = _round_order(names, 0, blocks)
    plans = {}
    for nm in names:
        if nm in pre:
            pre[nm]()
        est = warm_up(fns[nm], min_s=warm_s)
        plans[nm] = plan(est, target_s, rounds, per_call)
    samples = {nm: [] for nm in names}
    for r in range(rounds):
        order = _round_order(names, r, blocks)
        for nm in order:
            fn = fns[nm]
            per_round, k = plans[nm]
            s = samples[nm]
            if nm in pre:
                pre[nm]()
            for _ in range(per_round // k):
                s.append(_time_k(fn, k))
    res = {}
    for nm in names:
        s = sorted(samples[nm])
        n = len(s)
        res[nm] = {
            "median_ns": statistics.median(s),
            "min_ns": s[0],
            "p10_ns": s[int(0.1 * (n - 1))],
            "p90_ns": s[int(0.9 * (n - 1))],
            "samples": n,
            "calls": n * plans[nm][1],
            "k": plans[nm][1],
        }
    return res


def _cffi():
    """a bare cffi FFI (its memmove: glibc's memmove for about 0.1 µs a call, against ~0.5 µs for
    np.copyto), or None"""
    try:
        import cffi
        return cffi.FFI()
    except Exception:  # pragma: no cover - cffi is a dependency of cpufuse
        return None


def spread(samples_ns, nbytes):
    """GB/s statistics of per-copy times: median, best, 10th / 90th percentile (slow / fast
    tail) and worst, for `nbytes` counted per copy."""
    s = sorted(samples_ns)
    n = len(s)
    q = lambda p: s[min(n - 1, max(0, int(round(p * (n - 1)))))]  # noqa: E731
    return {"gbps": nbytes / statistics.median(s), "best_gbps": nbytes / s[0], "p90_gbps": nbytes / q(0.1),
            "p10_gbps": nbytes / q(0.9), "worst_gbps": nbytes / s[-1]}


class CopyBandwidth:
    """Copy bandwidth of one memory level, 1 thread: memmove of `chunk` bytes at a time from a
    src array of nbytes to a dst array of nbytes, counted as 2 x chunk (read + write).

    chunk = nbytes (the L2 probe: the same 256 KiB copied again and again, cache-resident) or a
    slice (the DRAM probe: 4 MiB slices of 256 MiB walked in turn, so each slice was last touched
    252 MiB earlier and comes from DRAM).

    Robust on a shared machine (bench/README.md, "Probes"): one sample = k back-to-back copies
    lasting ~sample_s (50 µs: the timer pair is < 0.2% of it, and a sample is far shorter than a
    scheduler time slice, so a preemption spoils a few samples instead of moving the median);
    sample() takes many samples (~per_sample_s of them); the figure is the median over all of
    them. The memmove is called through cffi (~0.1 µs a call); that call's own cost is measured
    (a 0-byte memmove, same loop) and subtracted, and reported as call_overhead_pct. Construction
    touches both arrays (first-touch page faults) and warms up for warm_s (clock ramp)."""

    def __init__(self, nbytes, chunk=None, sample_s=50e-6, per_sample_s=0.01, warm_s=0.02, pre=None):
        self.pre = pre  # run before sampling (the harness pins the thread to one core there)
        if pre is not None:
            pre()
        chunk = nbytes if chunk is None else min(chunk, nbytes)
        self.nbytes, self.chunk, self.per_sample_s = nbytes, chunk, per_sample_s
        self.src = np.empty(nbytes // 4, np.float32)
        self.src.fill(1.5)  # written, so no page is the shared zero page
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)  # first touch
        offs = range(0, nbytes - chunk + 1, chunk)
        ffi = _cffi()
        if ffi is not None:
            mm = ffi.memmove
            ps, pd = ffi.cast("char *", self.src.ctypes.data), ffi.cast("char *", self.dst.ctypes.data)
            self.calls = [functools.partial(mm, pd + o, ps + o, chunk) for o in offs]
            self.empty = functools.partial(mm, pd, ps, 0)
            self.how = "memmove (cffi)"
        else:
            c4 = chunk // 4
            self.calls = [functools.partial(np.copyto, self.dst[o // 4:o // 4 + c4], self.src[o // 4:o // 4 + c4])
                          for o in offs]
            self.empty = functools.partial(np.copyto, self.dst[:0], self.src[:0])
            self.how = "np.copyto"
        self._next = 0
        t_end = _pc() + warm_s * 1e9
        last = []
        while len(last) < 2 * len(self.calls) or _pc() < t_end:
            last.append(self._time(self.calls, 1))
        self.k = max(1, math.ceil(sample_s * 1e9 / max(statistics.median(last[-15:]), 1)))
        self.samples, self.ovh = [], []

    def _time(self, calls, k):
        """mean ns of k calls from `calls`, taken in turn from where the last batch stopped"""
        i, m = self._next % len(calls), len(calls)
        if m == 1:  # the L2 probe: the same copy again, the leanest loop
            f = calls[0]
            t0 = _pc()
            for _ in _repeat(None, k):
                f()
            return (_pc() - t0) / k
        t0 = _pc()
        for _ in _repeat(None, k):
            calls[i]()
            i = i + 1 if i + 1 < m else 0
        dt = _pc() - t0
        self._next = i
        return dt / k

    def sample(self, n=1):
        """n sampling points (the harness: a few at the start, one after every case), each ~per_sample_s"""
        if self.pre is not None:
            self.pre()
        est = statistics.median(self.samples[-20:]) if self.samples else self._time(self.calls, self.k)
        m = max(8, int(self.per_sample_s * 1e9 / (est * self.k)))
        empty = [self.empty]
        for _ in range(n):
            for _ in range(m):
                self.samples.append(self._time(self.calls, self.k))
            for _ in range(8):  # the call's own cost, in the same loop
                nxt = self._next
                self.ovh.append(self._time(empty, self.k))
                self._next = nxt

    def result(self):
        ovh = statistics.median(self.ovh) if self.ovh else 0.0
        net = [max(t - ovh, 1.0) for t in self.samples]
        med = statistics.median(self.samples)
        r = {"bytes": self.nbytes, "chunk": self.chunk, "counted_bytes": 2 * self.chunk, "how": self.how,
             "median_ns": med, "call_overhead_ns": ovh, "call_overhead_pct": 100 * ovh / med,
             "raw_gbps": 2 * self.chunk / med, "samples": len(self.samples), "k": self.k}
        r.update(spread(net, 2 * self.chunk))
        return r

    def release(self):
        self.src = self.dst = self.calls = self.empty = None


# ------------------------------------------------------------------------------------------------
# The process-level benches (bench/e2e/): medians over rounds, one engine per process, the machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def parse_threads(s, ncpu):
    """--threads: a comma list of thread counts, "all" = ncpu; sorted, without repeats"""
    ts = []
    for x in s.split(","):
        x = x.strip()
        if x in ("all", "max"):
            ts.append(ncpu)
        elif x:
            try:
                ts.append(int(x))
            except ValueError:
                raise SystemExit(f"--threads {s!r}: expected a comma list of positive integers or 'all'") from None
    if not ts or min(ts) < 1:
        raise SystemExit(f"--threads {s!r}: expected a comma list of positive integers or 'all'")
    return sorted(set(ts))


def median(xs):
    """the median of the numbers that are not None or NaN (None when there are none)"""
    xs = [x for x in xs if x is not None and x == x]
    return statistics.median(xs) if xs else None


def fmt(x, nd=1):
    return "–" if x is None or x != x else f"{x:.{nd}f}"


def load_avg():
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def peer_status(peer, module="llama_cpp"):
    """None when the interpreter `peer` imports `module` (and numpy), else why not"""
    if not peer or not os.path.exists(peer):
        return f"peer interpreter {peer} not found (build it with `make bench-e2e`, ~20 min)"
    p = subprocess.run([peer, "-c", f"import {module}, numpy; print({module}.__name__)"], capture_output=True, text=True)
    if p.returncode:
        return f"{module} not importable by {peer}: {p.stderr.strip()[-300:]}"
    return None


def run_job(job, python, script_args, pin, threads, timeout=900, extra_env=None):
    """One job (a dict, passed as a JSON file) in a fresh process `python script_args JOB.json`,
    pinned to core 0 when `pin`, BLAS on `threads`; the process prints `E2E_RESULT {json}`.
    Returns (result dict or None, error string or None)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
        jf = f.name
    cmd = ([shutil.which("taskset") or "taskset", "-c", "0"] if pin else []) + [python] + script_args + [jf]
    env = dict(os.environ)
    for v in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "CPUFUSE_DISABLE_FUSION"):
        env.pop(v, None)
    for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[v] = str(threads)
    env.update(extra_env or {})
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, f"timeout after {timeout}s"
    finally:
        os.unlink(jf)
    for line in p.stdout.splitlines():
        if line.startswith("E2E_RESULT "):
            return json.loads(line[len("E2E_RESULT "):]), None
    return None, f"exit {p.returncode}: {(p.stderr or p.stdout).strip()[-600:]}"
