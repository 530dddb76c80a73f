"""One-row (decode) Q4_K (or MICRO_TYPE) matmul micro benchmark, one thread: GB of weights per CPU second (and per wall
second) at an L2-resident size, an L3 size and a DRAM size (many distinct repacked matrices cycled),
beside cpufuse's DRAM read probe (cf_read_sum over 256 MiB) in the same process.
Run: PYTHONPATH=<tree> taskset -c 0 python micro.py [label] ; prints one JSON line."""
import json
import os
import sys
import time

import numpy as np

import cpufuse
from cpufuse import _backend, _pages, _registry
from cpufuse.quant.matmul import matmul
from cpufuse.reference.quant import random_blocks


QTYPE = os.environ.get("MICRO_TYPE", "Q4_K")


def mats(K, N, count, seed=0):
    qt = random_blocks(QTYPE, N, K, np.random.default_rng(seed), d_range=(1e-4, 1e-3))
    return [qt.repack() for _ in range(count)], qt.raw.nbytes


def rate(ws, nbytes, x, out, reps):
    for w in ws:
        matmul(x, w, out=out, n_threads=1)
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(reps):
        for w in ws:
            matmul(x, w, out=out, n_threads=1)
    c1, t1 = time.process_time(), time.perf_counter()
    b = nbytes * len(ws) * reps
    return b / (c1 - c0) / 1e9, b / (t1 - t0) / 1e9, (c1 - c0) / (reps * len(ws)) * 1e6


def probe(a, reps=4):
    f, ffi = _registry.table("read_sum")["avx512"], _backend.ffi
    p = ffi.cast("const float *", a.ctypes.data)
    f(p, a.size, 1)
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(reps):
        f(p, a.size, 1)
    c1, t1 = time.process_time(), time.perf_counter()
    return a.nbytes * reps / (c1 - c0) / 1e9, a.nbytes * reps / (t1 - t0) / 1e9


CASES = {  # name: (K, N, count, reps)
    "tiny_256x16": (256, 16, 1, 4000),       # the call's fixed cost
    "l2_2048x64": (2048, 64, 1, 2000),
    "l2_2048x512": (2048, 512, 1, 2000),
    "l3_2048x4096x2": (2048, 4096, 2, 100),
    "dram_2048x4096x64": (2048, 4096, 64, 6),
    "l2_768x512": (768, 512, 2, 400),         # qwen3 expert down's K (3 super-blocks)
    "dram_768x2048x160": (768, 2048, 160, 2),
    "dram_2048x768x200": (2048, 768, 200, 2),  # qwen3 expert gate/up
    "dram_2880x2880x24": (2880, 2880, 24, 4),  # gpt-oss-20b's expert shapes (MXFP4 only: K is 90 blocks of 32)
}


def main():
    label = sys.argv[1] if len(sys.argv) > 1 else ""
    which = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CASES)
    res = {"label": label, "isa": cpufuse.info()["isa"], "type": QTYPE}
    with _pages.arena():
        a = _pages.empty(256 << 20).view(np.float32)
    a[:] = 1.0
    res["probe"] = probe(a)
    for name in which:
        K, N, count, reps = CASES[name]
        with _pages.arena():
            ws, nb = mats(K, N, count)
        x = np.random.default_rng(1).standard_normal((1, K)).astype(np.float32)
        out = np.empty((1, N), np.float32)
        res[name] = rate(ws, nb, x, out, reps)
        del ws
    res["probe2"] = probe(a)
    print(json.dumps(res))


main()
