"""the model at depth, CPU seconds: fill to D tokens, then pp128 appended (CPU s), reset+fill, tg8 (CPU s per token)"""
import sys, time, json, os
import numpy as np
from cpufuse.llama import Model
path = os.path.expanduser("~/.cache/cpufuse-bench/llama-1b-shapes-Q4_0.gguf")
D = int(sys.argv[1]); types = sys.argv[2].split(","); ntg = 8
out = {}
rng = np.random.default_rng(0)
toks = [int(t) for t in rng.integers(100, 30000, D + 256)]
for t in types:
    m = Model.load(path, n_ctx=D + 256, n_threads=1, type_k=t, type_v=t)
    m.reset(); m.eval(toks[:64])  # warm
    m.reset(); m.eval(toks[:D])
    c0 = time.process_time(); m.eval(toks[D:D + 128]); pp = 128 / (time.process_time() - c0)
    # tg after the pp: positions D+128..; fine (depth D+128)
    tg = []
    for i in range(ntg):
        c0 = time.process_time(); m.eval([toks[D + 128 + i]]); tg.append(time.process_time() - c0)
    out[t] = (pp, 1.0 / float(np.median(tg)), 1.0 / float(np.min(tg)))
    del m
print(json.dumps(out))
