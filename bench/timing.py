"""Timing primitives for the benchmark: interleaved rounds, copy bandwidth, timer overhead.

Timing is done on the calling thread with time.perf_counter_ns (the variants may use threads). A *sample* is the mean time of one
sub-batch of k back-to-back calls (k chosen so a sub-batch lasts >= ~20 µs, which makes the
timer's own cost negligible); k = 1 for the per-call latency rows. Variants are interleaved in
rounds (each round runs every variant's batch once, in a rotated order) so that slow drifts and
noise bursts on a shared machine hit all variants alike; the reported figure is the median over all
samples of all rounds.
"""
import itertools
import math
import statistics
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


class CopyBandwidth:
    """np.copyto of an nbytes float32 array into another, counted as 2 x nbytes (read + write).

    sample() adds samples (each = enough copies to last >= min_s / reps); the run takes some at
    the start and one after every case, so the figure (median over all samples) sees the same
    machine conditions as the cases."""

    def __init__(self, nbytes, min_s=0.05, reps=7, pre=None):
        self.pre = pre  # run before sampling (the harness pins the thread to one core there)
        if pre is not None:
            pre()
        n = nbytes // 4
        self.nbytes, self.reps = nbytes, reps
        self.src = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
        self.dst = np.empty_like(self.src)
        self.fn = lambda: np.copyto(self.dst, self.src)  # noqa: E731
        est = warm_up(self.fn, min_s=0.005, min_calls=2)
        self.k = max(1, math.ceil(min_s / reps * 1e9 / est))
        self.samples = []

    def sample(self, n=1):
        if self.pre is not None:
            self.pre()
        for _ in range(n):
            self.samples.append(_time_k(self.fn, self.k))

    def result(self):
        med = statistics.median(self.samples)
        return {"bytes": self.nbytes, "counted_bytes": 2 * self.nbytes, "median_ns": med,
                "gbps": 2 * self.nbytes / med, "best_gbps": 2 * self.nbytes / min(self.samples),
                "worst_gbps": 2 * self.nbytes / max(self.samples), "samples": len(self.samples), "k": self.k}

    def release(self):
        self.src = self.dst = None
