"""One prompt-shaped quantized matmul, timed in this process (the tree on sys.path): a JSON line of
seconds per call (min of 5 repeats) for each case. Called by bench/device/peers.sh once per tree and
round, alternating trees, so two builds compare in one run.

    python bench/device/mm_ab.py ISA THREADS TYPES ROWS
"""
import json, sys, time
import numpy as np
import cpufuse
from cpufuse.reference.quant import make_weight

isa, nth = sys.argv[1], int(sys.argv[2])
types, rows = sys.argv[3].split(","), [int(r) for r in sys.argv[4].split(",")]
rng = np.random.default_rng(0)
res = {}
for qt in types:
    for (n, k) in ((8192, 2048), (2048, 8192)):
        w = make_weight(qt, n, k, rng).repack()
        for m in rows:
            x = rng.standard_normal((m, k), dtype=np.float32)
            o = np.empty((m, n), np.float32)
            cpufuse.matmul(x, w, out=o, isa=isa, n_threads=nth)
            best = 1e9
            for _ in range(5):
                t = time.perf_counter()
                cpufuse.matmul(x, w, out=o, isa=isa, n_threads=nth)
                best = min(best, time.perf_counter() - t)
            res[f"{qt} {m}x{k}->{n}"] = best
print(json.dumps(res))
