"""ik_llama.cpp's llama-bench prompt rate in CPU seconds: a run with -r 1+N minus one with -r 1 (same load,
repack and warm-up) is N timed repetitions; child CPU time from wait4; pinned to core $CORE (default 1).
usage: smallm-ik-pp.py EXE MODEL 32,512 N"""
import json, os, subprocess, sys
exe, model, pps, n = sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3].split(",")], int(sys.argv[4])

def cpu(args):
    p = subprocess.Popen(["taskset", "-c", os.environ.get("CORE", "1"), exe, "-m", model, "-t", "1", "-fa", "0", "-rtr", "1", "-fmoe", "1",
                          "-o", "json", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out = p.stdout.read()
    _, st, ru = os.wait4(p.pid, 0)
    assert st == 0, (args, st)
    return ru.ru_utime + ru.ru_stime, json.loads(out)

res = {"engine": "ik_llama.cpp"}
for pp in pps:
    c1, _ = cpu(["-p", str(pp), "-n", "0", "-r", "1"])
    cn, recs = cpu(["-p", str(pp), "-n", "0", "-r", str(1 + n)])
    res[f"pp{pp}_cpu"] = n * pp / (cn - c1)
    res[f"pp{pp}_wall"] = recs[0]["avg_ts"]
print(json.dumps(res))
