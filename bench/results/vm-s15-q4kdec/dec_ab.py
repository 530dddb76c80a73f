"""Decode A/B of two cpufuse trees on one GGUF, one thread pinned (taskset -c 0), alternating processes:
python dec_ab.py MODEL ROUNDS STEPS LABEL=TREE ... ; each process loads the model, runs a 16-token prompt,
16 untimed decode steps, then STEPS timed ones (CPU seconds from time.process_time and wall seconds);
prints per label the median (min-max) tok/s by CPU and by wall time."""
import json
import os
import statistics
import subprocess
import sys

if sys.argv[1] == "--worker":
    import time
    import numpy as np
    from cpufuse.llama import Model
    path, steps = sys.argv[2], int(sys.argv[3])
    m = Model.load(path, n_ctx=256, n_threads=1)
    toks = [int(t) for t in np.random.default_rng(0).integers(10, 1000, size=16 + 16 + steps + 1)]
    m.eval(toks[:16])
    for t in toks[16:32]:
        m.eval([t])
    c0, t0 = time.process_time(), time.perf_counter()
    for t in toks[32:32 + steps]:
        m.eval([t])
    c1, t1 = time.process_time(), time.perf_counter()
    print(json.dumps({"cpu_tps": steps / (c1 - c0), "wall_tps": steps / (t1 - t0)}))
    sys.exit(0)

path, rounds, steps, specs = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
res = {}
for r in range(rounds):
    for spec in (specs if r % 2 == 0 else specs[::-1]):
        label, tree = spec.split("=", 1)
        out = subprocess.run(["taskset", "-c", "0", sys.executable, os.path.abspath(__file__), "--worker", path, steps],
                             env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True, check=True).stdout
        d = json.loads(out.strip().splitlines()[-1])
        res.setdefault(label, []).append(d)
        print(label, r, d, flush=True)
for label, ds in res.items():
    c, w = [d["cpu_tps"] for d in ds], [d["wall_tps"] for d in ds]
    print(f"{label:8s} tok/s by CPU {statistics.median(c):6.2f} ({min(c):.2f}-{max(c):.2f})  by wall "
          f"{statistics.median(w):6.2f} ({min(w):.2f}-{max(w):.2f})")
