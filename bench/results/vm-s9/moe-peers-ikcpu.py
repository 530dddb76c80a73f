"""ik_llama.cpp's llama-bench in CPU seconds: a run with -r 11 minus one with -r 1 (same load and warm-up)
is 10 timed repetitions; child CPU time from wait4. usage: ikcpu.py EXE MODEL -> JSON"""
import json, os, subprocess, sys


def cpu(exe, model, args, core="1"):
    """(CPU seconds, llama-bench's JSON records) of one llama-bench run, 1 thread pinned to `core`"""
    p = subprocess.Popen(["taskset", "-c", core, exe, "-m", model, "-t", "1", "-fa", "0", "-rtr", "1", "-fmoe", "1",
                          "-o", "json", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out = p.stdout.read()
    _, st, ru = os.wait4(p.pid, 0)
    assert st == 0, (args, st)
    return ru.ru_utime + ru.ru_stime, json.loads(out)


if __name__ == "__main__":
    exe, model = sys.argv[1:3]
    res = {"engine": "ik"}
    for key, args, n in (("pp64", ["-p", "64", "-n", "0"], 64), ("tg16", ["-p", "0", "-n", "16"], 16)):
        c1, _ = cpu(exe, model, args + ["-r", "1"])
        c4, recs = cpu(exe, model, args + ["-r", "11"])
        res[key + "_cpu"] = 10 * n / (c4 - c1)
        res[key + "_wall"] = recs[0]["avg_ts"]
    print(json.dumps(res))
