"""Serial time of a decode token: python serial.py MODEL NTH STEPS -> one JSON line (ab.sh). Times
Model.eval steps without profiling (wall_np_us, cpu_np_us), then with cf_pool_profile on: per record kind
its wall (ops_wall) and, where the build has cf_pool_profile_ext, its time outside regions (ops_serial) and
regions (ops_regions); py: the step's Python pieces, timed by wrappers around them; the sampler's time."""
import sys, time, json
import numpy as np
from cpufuse import _backend
from cpufuse.graph.kinds import RECORDS
from cpufuse.llama import Model
ffi, lib = _backend.ffi, _backend.lib
path, nth, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
EXT = hasattr(lib, "cf_pool_profile_ext")
m = Model.load(path, n_ctx=128 + steps, n_threads=nth)
toks = [int(t) for t in np.random.default_rng(0).integers(10, m.hparams.n_vocab - 10, size=64 + steps)]
m.eval(toks[:16])
for t in toks[16:40]:
    m.eval([t])
st = m._step
# python pieces, timed around each call of the step (a wrapper: only here)
T = {"embed": 0, "set": 0, "run": 0, "eval": 0, "copy": 0}
emb, setc, run = st.embed, st.set_cells, st.run
pc = time.perf_counter_ns
def w(fn, k):
    def f(*a, **kw):
        t0 = pc(); r = fn(*a, **kw); T[k] += pc() - t0; T[k + "_n"] = T.get(k + "_n", 0) + 1; return r
    return f
st.embed, st.set_cells, st.run = w(emb, "embed"), w(setc, "set"), w(run, "run")
c0, t0 = time.process_time(), pc()
for t in toks[40:40 + steps]:
    m.eval([t])
wall_np, cpu_np = pc() - t0, time.process_time() - c0
m.reset(); m.eval(toks[:16])
for t in toks[16:40]:
    m.eval([t])
out = ffi.new("uint64_t[67]")
ext = ffi.new("uint64_t[133]")
for k in list(T):
    T[k] = 0
lib.cf_pool_profile(1, ffi.NULL)
c0, t0 = time.process_time(), pc()
for t in toks[40:40 + steps]:
    a = pc(); m.eval([t]); T["eval"] += pc() - a
wall, cpu = pc() - t0, time.process_time() - c0
if EXT:
    lib.cf_pool_profile_ext(ext)
lib.cf_pool_profile(0, out)
T0 = dict(T)
# sampling after eval: greedy argmax and the default sampler
lg = m.eval([toks[41]])
from cpufuse.llama.sampling import Sampler
s = Sampler(seed=1)
a = pc()
for _ in range(steps): s.sample(lg)
sampler = (pc() - a) / steps
a = pc()
for _ in range(steps): int(np.argmax(lg))
argmax = (pc() - a) / steps
us = lambda v: v / steps / 1e3
res = {"nth": nth, "wall_np_us": us(wall_np), "cpu_np_us": cpu_np / steps * 1e6, "wall_us": us(wall), "cpu_us": cpu / steps * 1e6, "regions": int(out[2]) / steps,
       "region_us": us(out[1]), "busy_us": us(out[0]), "argmax_us": argmax / 1e3, "sampler_us": sampler / 1e3,
       "py": {k: us(v) for k, v in T0.items() if not k.endswith("_n")},
       "ops_wall": {r.name: us(out[3 + r.op]) for r in RECORDS if r.op < 48 and out[3 + r.op]}}
res["outside_us"] = res["wall_us"] - res["region_us"]
if EXT:
    res["ops_serial"] = {r.name: us(ext[r.op]) for r in RECORDS if r.op < 48 and out[3 + r.op]}
    res["ops_regions"] = {r.name: int(ext[64 + r.op]) / steps for r in RECORDS if r.op < 48 and out[3 + r.op]}
    res["dispatch_us"], res["own_us"], res["join_us"], res["plan_us"] = (us(ext[128 + i]) for i in range(4))
    res["plan_runs"] = int(ext[132]) / steps
print(json.dumps(res))
