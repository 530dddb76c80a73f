"""a plan of L x (norm+QKV, o+res, norm+gate/up, down+res) one-row Q4_0 calls of small N (so the serial parts
show): time per call at nth, and the QMM serial part (cf_pool_profile_ext)"""
import sys, time, numpy as np, cpufuse
from cpufuse import Graph, _backend
from cpufuse.graph.kinds import RECORDS
from cpufuse.reference import quant as qref
nth, reps = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
K, N, L = 2048, 256, 16
W = lambda n, k: qref.make_weight("Q4_0", n, k, rng)
g = Graph(); x = g.input("x", (1, K)); r = x
for l in range(L):
    h = g.mul(g.rms_norm(r, 1e-5), g.constant(rng.uniform(-1, 1, K).astype(np.float32), f"n{l}"))
    q = g.qmatmul(h, W(N, K)); k = g.qmatmul(h, W(N, K))
    a = g.add(g.reshape(g.qmatmul(g.add(q, k), W(K, N)), (1, K)), r)
    h2 = g.mul(g.rms_norm(a, 1e-5), g.constant(rng.uniform(-1, 1, K).astype(np.float32), f"m{l}"))
    f = g.mul(g.silu(g.qmatmul(h2, W(N, K))), g.qmatmul(h2, W(N, K)))
    r = g.add(g.qmatmul(f, W(K, N)), a)
g.output(r)
p = g.compile()
X = rng.uniform(-1, 1, (1, K)).astype(np.float32)
run = p.bind(x=X)
for _ in range(20): run(n_threads=nth)
ffi, lib = _backend.ffi, _backend.lib
EXT = 2 * 64 + 5
ext = ffi.new(f"uint64_t[{EXT}]"); out = ffi.new("uint64_t[67]")
lib.cf_pool_profile(1, ffi.NULL)
t0 = time.perf_counter_ns(); c0 = time.process_time()
for _ in range(reps): run(n_threads=nth)
wall = (time.perf_counter_ns() - t0) / reps / 1e3
lib.cf_pool_profile_ext(ext); lib.cf_pool_profile(0, out)
ser = {rc.name: ext[rc.op] / reps / 1e3 for rc in RECORDS if rc.op < 64 and ext[rc.op]}
print(f"nth {nth}: run {wall:.1f} us, regions {out[2] / reps:.0f}, serial us a run:", {k: round(v, 1) for k, v in ser.items()})
