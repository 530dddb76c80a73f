"""one layer's decode attention (Llama-3.2-1B: 32 q heads, 8 KV heads, D 64), 1 thread: CPU and wall per call"""
import sys, time, json, os
import numpy as np
import cpufuse
from cpufuse.ops import kvquant
depths = [int(x) for x in sys.argv[1].split(",")]
types = sys.argv[2].split(",")
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
cold = len(sys.argv) > 4 and sys.argv[4] == "cold"
rng = np.random.default_rng(0)
res = {}
flush = np.ones(64 << 20 >> 3)
for T in depths:
    q = rng.uniform(-2, 2, (1, 32, 1, 64)).astype(np.float32)
    k = rng.standard_normal((1, 8, T, 64)).astype(np.float32)
    v = rng.standard_normal((1, 8, T, 64)).astype(np.float32)
    for t in types:
        kb = kvquant.quantize(k, t) if t != "f16" else k.astype(np.float16)
        vb = kvquant.quantize(v, t) if t != "f16" else v.astype(np.float16)
        f = lambda: cpufuse.flash_attn(q, kb, vb, None, scale=0.125, k_type=t, v_type=t, dv=64, n_threads=1, **({"isa": os.environ["ISA"]} if os.environ.get("ISA") else {}))
        f()
        cs, ws = [], []
        for _ in range(reps):
            if cold: flush += 1.0
            c0, w0 = time.process_time(), time.perf_counter()
            f()
            cs.append(time.process_time() - c0); ws.append(time.perf_counter() - w0)
        sys.path.append(os.environ.get("NEW_TREE", ".")); from bench.threads import read_fn
        buf = np.full((kb.nbytes + vb.nbytes) // 4, 1.0, np.float32)
        rf, _ = read_fn(buf, 1, "avx512")
        rf(); pr = []
        for _ in range(reps):
            if cold: flush += 1.0
            w0 = time.perf_counter(); rf(); pr.append(time.perf_counter() - w0)
        res[f"{t}@{T}"] = (float(np.median(cs)) * 1e3, float(np.min(ws)) * 1e3, float(np.median(ws)) * 1e3, int(kb.nbytes + vb.nbytes), buf.nbytes / float(np.min(pr)) / 1e9)
print(json.dumps(res))
