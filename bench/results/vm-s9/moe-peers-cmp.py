"""one engine's pp64 / tg16 in CPU seconds (time.process_time) and wall: python cmp.py cpufuse|llamacpp MODEL"""
import json, sys, time
eng, path = sys.argv[1], sys.argv[2]
toks = list(range(1000, 1000 + 64 + 16 + 8))
if eng == "cpufuse":
    from cpufuse.llama import Model
    m = Model.load(path, n_ctx=256, n_threads=1)
    reset, ev = m.reset, m.eval
else:
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=256, n_batch=512, n_threads=1, n_threads_batch=1, verbose=False, seed=0)
    reset, ev = llm.reset, llm.eval
out = {}
for rep in range(2):   # the first pass warms up
    reset(); c0, w0 = time.process_time(), time.perf_counter(); ev(toks[:64])
    pp = (64 / (time.process_time() - c0), 64 / (time.perf_counter() - w0))
    reset(); ev(toks[:1]); c0, w0 = time.process_time(), time.perf_counter()
    for t in toks[64:80]:
        ev([t])
    tg = (16 / (time.process_time() - c0), 16 / (time.perf_counter() - w0))
out = {"engine": eng, "pp64_cpu": pp[0], "pp64_wall": pp[1], "tg16_cpu": tg[0], "tg16_wall": tg[1]}
print(json.dumps(out))
