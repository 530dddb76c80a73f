import sys, time, json, numpy as np
from cpufuse.llama import Model
path, nth, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = Model.load(path, n_ctx=128 + steps, n_threads=nth)
toks = [int(t) for t in np.random.default_rng(0).integers(10, m.hparams.n_vocab - 10, size=64 + steps)]
m.eval(toks[:16])
for t in toks[16:40]:
    m.eval([t])
c0, t0 = time.process_time(), time.perf_counter()
for t in toks[40:40 + steps]:
    m.eval([t])
print(json.dumps({"wall_ms": (time.perf_counter() - t0) / steps * 1e3, "cpu_ms": (time.process_time() - c0) / steps * 1e3}))
