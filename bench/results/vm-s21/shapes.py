import sys, time, numpy as np
from cpufuse import _backend, _registry
from cpufuse.quant.matmul import matmul
from cpufuse.reference.quant import random_blocks
rng = np.random.default_rng(0)
def rate(ws, x, out, reps):
    for w in ws: matmul(x, w, out=out, n_threads=1)
    c0 = time.process_time()
    for _ in range(reps):
        for w in ws: matmul(x, w, out=out, n_threads=1)
    c1 = time.process_time()
    return sum(w.raw.nbytes if hasattr(w, "raw") else w.nbytes for w in ws) * reps / (c1 - c0) / 1e9
def probe():
    a = np.ones(64 << 20, np.float32)
    f, ffi = _registry.table("read_sum")["avx512"], _backend.ffi
    p = ffi.cast("const float *", a.ctypes.data); f(p, a.size, 1)
    c0 = time.process_time()
    for _ in range(4): f(p, a.size, 1)
    return a.nbytes * 4 / (time.process_time() - c0) / 1e9
cases = {"head 151936x2048": ("Q4_K", 2048, 151936, 1, 3), "q 4096x2048 x40": ("Q4_K", 2048, 4096, 40, 3),
         "kv 512x2048 x300": ("Q4_K", 2048, 512, 300, 3), "o 2048x4096 x40": ("Q4_K", 4096, 2048, 40, 3),
         "router F32 128x2048 x60": ("F32", 2048, 128, 60, 3), "expert up 768x2048 x200": ("Q4_K", 2048, 768, 200, 3),
         "expert down 2048x768 x200": ("Q4_K", 768, 2048, 200, 3)}
print("probe", round(probe(), 1))
for name, (t, K, N, cnt, reps) in cases.items():
    if t == "F32":
        ws = [random_blocks("F32", N, K, rng) for _ in range(cnt)]
    else:
        q = random_blocks(t, N, K, rng, d_range=(1e-4, 1e-3)); ws = [q.repack() for _ in range(cnt)]
    x = rng.standard_normal((1, K)).astype(np.float32); out = np.empty((1, N), np.float32)
    print(name, round(rate(ws, x, out, reps), 1), "GB/CPU-s")
    del ws
