"""One layer of decode attention below 512 cells, the strategies side by side: rows (the default below
SPLIT_MIN_T) and split with 32, 64 and 128-cell chunks; µs a call (the Python call included), median of 5 x 200.
Usage: python bench/results/vm-s16/fa_small.py HQ,HKV,D THREADS (output: fa_small.txt)"""
import sys, time, numpy as np, cpufuse
from cpufuse.ops.attention import flash_attn
rng = np.random.default_rng(0)
Hq, Hk, D = [int(x) for x in sys.argv[1].split(",")]
nth = int(sys.argv[2])
for T in (32, 64, 128, 256, 511):
    q = rng.standard_normal((1, Hq, 1, D)).astype(np.float32)
    k = rng.standard_normal((1, Hk, T, D)).astype(np.float16)
    v = rng.standard_normal((1, Hk, T, D)).astype(np.float16)
    out = np.empty((1, 1, Hq, D), np.float32)
    res = {}
    for name, kw in (("rows", dict(strategy="rows")), ("split64", dict(strategy="split", chunk=64)), ("split32", dict(strategy="split", chunk=32)), ("split128", dict(strategy="split", chunk=128))):
        f = lambda: flash_attn(q, k, v, scale=0.088, n_threads=nth, **kw)
        f()
        best = []
        for r in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                f()
            best.append((time.perf_counter() - t0) / 200 * 1e6)
        res[name] = np.median(best)
    print(T, " ".join(f"{k} {v:.1f}" for k, v in res.items()))
# the empty call's cost (python): T=1
