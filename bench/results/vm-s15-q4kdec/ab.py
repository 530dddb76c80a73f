"""Alternating-process A/B of micro.py variants: python ab.py ROUNDS CASES LABEL=TREE[:NAME=VALUE+NAME=VALUE] ... ; prints
per case and variant the median (min-max) of GB per CPU second and per wall second, and the probe's."""
import json
import os
import statistics
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
rounds, cases, specs = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
res = {}
for r in range(rounds):
    for spec in (specs if r % 2 == 0 else specs[::-1]):
        label, rest = spec.split("=", 1)
        tree, env = rest.split(":", 1) if ":" in rest else (rest, "")
        e = dict(os.environ, PYTHONPATH=tree)
        for kv in filter(None, env.split("+")):
            e[kv.split("=", 1)[0]] = kv.split("=", 1)[1]
        out = subprocess.run(["taskset", "-c", "0", sys.executable, os.path.join(here, "micro.py"), label, cases],
                             env=e, capture_output=True, text=True, check=True).stdout
        res.setdefault(label, []).append(json.loads(out))
        print(out.strip(), flush=True)
print("\ncase, variant: CPU GB/s median (min-max), wall GB/s median; probe CPU GB/s median")
for case in cases.split(",") + ["probe"]:
    for label, rs in res.items():
        c = [x[case][0] for x in rs]
        w = [x[case][1] for x in rs]
        print(f"{case:20s} {label:10s} cpu {statistics.median(c):6.1f} ({min(c):.1f}-{max(c):.1f})  wall {statistics.median(w):6.1f}")
