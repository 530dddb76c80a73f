import sys, time, numpy as np
from cpufuse.llama.model import Model
M = "/root/.cache/cpufuse/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
t = sys.argv[1]
m = Model.load(M, n_ctx=16528, n_threads=1, type_k=t, type_v=t)
m.load_kv(f"/tmp/depth_ab_state14/cpufuse-{t}-16384.state") if hasattr(m, "load_kv") else None
print("n_past", m.n_past if hasattr(m, "n_past") else m._n_past, flush=True)
for _ in range(4): m.eval([100])
c0, w0 = time.process_time(), time.perf_counter()
for i in range(16): m.eval([200 + i])
print(t, "tg16 tok/CPU s %.2f  wall %.2f" % (16 / (time.process_time() - c0), 16 / (time.perf_counter() - w0)), flush=True)
