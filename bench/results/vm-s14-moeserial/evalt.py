import sys, time, numpy as np, tempfile, os
from cpufuse.llama.model import Model
from cpufuse.llama.tiny import write_tiny_gguf
p = os.path.join(tempfile.mkdtemp(), "l.gguf"); write_tiny_gguf(p, qtype="Q8_0", arch="llama")
m = Model.load(p, n_ctx=4096, n_threads=1)
res = {}
for mode in ("list", "array"):
    best = 1e9
    for r in range(5):
        m.reset(); m.eval([1, 2, 3])
        toks = [5 + (i % 50) for i in range(400)]
        t0 = time.perf_counter()
        if mode == "list":
            for t in toks: m.eval([t])
        else:
            for t in toks: m.eval(np.array([t]))
        best = min(best, (time.perf_counter() - t0) / 400 * 1e6)
    res[mode] = round(best, 2)
print(sys.argv[1], res)
