"""One-off: a dense Q8_0 prompt matmul's rate by shape at 1 and 16 threads (graph plans of R
independent QMM records on one input, fusion off), to see why granite's small dense matmuls
(1024-wide) ran at about a quarter of the 1B's rate at 16 threads on the Xeon (moeprof, session 12)."""
import statistics
import sys
import time

import numpy as np

from cpufuse import Graph
from cpufuse.reference.quant import make_weight

R = 6
rng = np.random.default_rng(0)
shapes = [(1024, 1024, "Q8_0"), (1024, 512, "Q8_0"), (1024, 2048, "Q8_0"), (1024, 32, "F32"),
          (2048, 2048, "Q8_0"), (2048, 8192, "Q8_0"), (2880, 4096, "Q8_0"), (2048, 2048, "Q4_0"),
          (2048, 2048, "Q4_K"), (2048, 8192, "Q4_K"), (2880, 2880, "MXFP4")]
if len(sys.argv) > 2:
    shapes = [s for s in shapes if s[2] in sys.argv[2].split(",")]
threads = [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "1,16").split(",")]
print("| M | K | N | type | threads | ms a call | GMAC/s |\n|---|---|---|---|---|---|---|")
for M in (512, 128):
    for k, n, qt in shapes:
        ws = [make_weight(qt, n, k, rng).repack() for _ in range(R)]
        g = Graph()
        x = g.input("x", (M, k))
        for i, w in enumerate(ws):
            g.output(g.qmatmul(x, w, name=f"m{i}"))
        plan = g.compile(fusion=False)
        X = rng.standard_normal((M, k)).astype(np.float32)
        for t in threads:
            plan.run(n_threads=t, x=X)
            ts = []
            for _ in range(7 if t > 1 else 3):
                t0 = time.perf_counter_ns()
                plan.run(n_threads=t, x=X)
                ts.append(time.perf_counter_ns() - t0)
            ms = statistics.median(ts) / R / 1e6
            print(f"| {M} | {k} | {n} | {qt} | {t} | {ms:.3f} | {M * k * n / ms / 1e6:.0f} |", flush=True)
