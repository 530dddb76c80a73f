"""cpufuse's prompt rate on a GGUF at one thread, CPU seconds (time.process_time) and wall: the best of
the timed evals after one untimed eval of each length. usage: smallm-moe-pp.py MODEL 32,512 -> JSON"""
import json, sys, time
from cpufuse.llama import Model
path, pps = sys.argv[1], [int(p) for p in sys.argv[2].split(",")]
m = Model.load(path, n_ctx=max(pps) + 64, n_threads=1, n_batch=max(pps))
toks = list(range(1000, 1000 + max(pps)))
out = {"engine": "cpufuse"}
for pp in pps:
    best = None
    for rep in range(1 + (4 if pp < 100 else 2)):
        m.reset()
        c0, w0 = time.process_time(), time.perf_counter()
        m.eval(toks[:pp])
        c, w = time.process_time() - c0, time.perf_counter() - w0
        if rep and (best is None or c < best[0]):
            best = (c, w)
    out[f"pp{pp}_cpu"], out[f"pp{pp}_wall"] = pp / best[0], pp / best[1]
print(json.dumps(out))
