"""Paired per-round ratios and medians of the A/B lines (xeon.sh ab) in this folder's call*.txt files."""
import glob, re, statistics as st
from collections import defaultdict
rows = defaultdict(lambda: defaultdict(dict))   # (file kind) -> round -> tag -> us
for f in sorted(glob.glob("call*.txt")):
    kind = "qwen3" if "qwen3" in f else "1b"
    call = f.split("-")[0]
    for line in open(f):
        m = re.search(r"round (\d+) (\S+) (\S+): \| 16 \| (\d+) \|", line)
        if m:
            rows[(kind, m.group(2))][(call, int(m.group(1)))][m.group(3)] = int(m.group(4))
for (kind, ty), rounds in rows.items():
    tags = sorted({t for r in rounds.values() for t in r})
    print(f"## {kind} {ty}: µs a decode token at 16 threads, {len(rounds)} rounds")
    for t in tags:
        v = [r[t] for r in rounds.values() if t in r]
        print(f"  {t:28s} n={len(v):2d} median {st.median(v):7.0f}  min {min(v)}")
    base = [t for t in tags if t.startswith("base")][0] if any(t.startswith("base") for t in tags) else None
    for t in tags:
        if t == base:
            continue
        q = [r[base] / r[t] for r in rounds.values() if t in r and base in r]
        if q:
            print(f"  {base} / {t}: paired median {st.median(q):.3f} (n={len(q)}, {sum(x > 1 for x in q)} faster)")
print("## qwen3: the tree at each group size (paired)")
r = rows[("qwen3", "q4_k-pure")]
for g in (1, 2, 4):
    q = [x[f"base-moe_group-{g}"] / x[f"new-moe_group-{g}"] for x in r.values() if f"new-moe_group-{g}" in x and f"base-moe_group-{g}" in x]
    print(f"  group {g}: base / new paired median {st.median(q):.3f} (n={len(q)}, {sum(v > 1 for v in q)} faster)")
