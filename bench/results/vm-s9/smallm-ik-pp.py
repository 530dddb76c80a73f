"""ik_llama.cpp's llama-bench prompt rate in CPU seconds: a run with -r 1+N minus one with -r 1 (same load,
repack and warm-up) is N timed repetitions; child CPU time from wait4 (moe-peers-ikcpu.py's cpu); pinned to
core $CORE (default 1). usage: smallm-ik-pp.py EXE MODEL 32,512 N"""
import importlib.util, json, os, sys

_spec = importlib.util.spec_from_file_location("ikcpu", os.path.join(os.path.dirname(__file__), "moe-peers-ikcpu.py"))
ikcpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ikcpu)

exe, model, pps, n = sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3].split(",")], int(sys.argv[4])
core = os.environ.get("CORE", "1")
res = {"engine": "ik_llama.cpp"}
for pp in pps:
    c1, _ = ikcpu.cpu(exe, model, ["-p", str(pp), "-n", "0", "-r", "1"], core)
    cn, recs = ikcpu.cpu(exe, model, ["-p", str(pp), "-n", "0", "-r", str(1 + n)], core)
    res[f"pp{pp}_cpu"] = n * pp / (cn - c1)
    res[f"pp{pp}_wall"] = recs[0]["avg_ts"]
print(json.dumps(res))
