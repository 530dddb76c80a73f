"""Medians (and ranges) of ab.sh's rounds per tree and thread count: python summary.py OUT.jsonl"""
import json, sys
from statistics import median

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if r.get("res")]
KEYS = [("wall_np_us", "token wall, no profiling, us"), ("cpu_np_us", "token CPU, no profiling, us"),
        ("regions", "regions a token"), ("outside_us", "calling thread outside regions, us"),
        ("dispatch_us", "regions: publishing, us"), ("join_us", "regions: waiting, us")]


def fmt(vs):
    return f"{median(vs):.0f} ({min(vs):.0f}-{max(vs):.0f})" if len(vs) > 1 else f"{vs[0]:.0f}"


for nth in sorted({r["res"]["nth"] for r in rows}):
    by = {t: [r["res"] for r in rows if r["tree"] == t and r["res"]["nth"] == nth] for t in "AB"}
    print(f"\n{nth} thread(s), rounds A {len(by['A'])}, B {len(by['B'])}: median (min-max)")
    print("| | A (main) | B (this) |\n|---|---:|---:|")
    for k, name in KEYS:
        print(f"| {name} | " + " | ".join(fmt([x[k] for x in by[t]]) for t in "AB") + " |")
    kinds = sorted({k for t in "AB" for x in by[t] for k in x.get("ops_serial", {})},
                   key=lambda k: -median([x["ops_serial"].get(k, 0) for x in by["A"]]))
    for k in kinds:
        cells = []
        for t in "AB":
            s = [x["ops_serial"].get(k, 0) for x in by[t]]
            g = [x["ops_regions"].get(k, 0) for x in by[t]]
            cells.append(f"{fmt(s)} [{median(g):.0f}]")
        print(f"| {k} outside regions, us [regions] | " + " | ".join(cells) + " |")
