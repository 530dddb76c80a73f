"""Per-round table of a depth_ab.py JSON with the engines cpufuse-base, cpufuse and llama.cpp (session 13):
tg32 tok/s per CPU second, the ratios, the median step (1 / median CPU s of the 32 steps), pp128.

    python bench/results/vm-s13/summary.py depth-4096-pure-1b-q4_0.json
"""
import json, statistics, sys
d = json.load(open(sys.argv[1]))
rows = {}
for r in d["runs"]:
    tg = d["tg"] / r["tg"][1]
    med = 1 / statistics.median(c for w, c in r["tg_steps"])
    pp = max(d["pp"] / c for w, c in r["pp"])
    rows.setdefault((r["type"], r["round"]), {})[r["engine"]] = (tg, med, pp, r["load_avg"][0])
print("| K/V | round | tg32 base | tg32 head | tg32 llama.cpp | head/llama | base/llama | head/base | median step head/base/llama | pp128 head/base/llama | load |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for (t, rnd), e in sorted(rows.items()):
    b, h, l = e["cpufuse-base"], e["cpufuse"], e["llama.cpp"]
    print(f"| {t} | {rnd} | {b[0]:.2f} | {h[0]:.2f} | {l[0]:.2f} | **{h[0]/l[0]:.2f}x** | {b[0]/l[0]:.2f}x | {h[0]/b[0]:.2f} | "
          f"{h[1]:.1f} / {b[1]:.1f} / {l[1]:.1f} | {h[2]:.1f} / {b[2]:.1f} / {l[2]:.1f} | {h[3]:.1f} |")
