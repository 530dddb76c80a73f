# run from this folder: BASE_TREE=... NEW_TREE=... python kvdec-ab.py ROUNDS kvdec-attn.py DEPTHS TYPES REPS [cold] (CORE: the pinned core)
"""alternating A/B rounds: python ab.py ROUNDS script args... ; A = /tmp/kvdec/base, B = /work/wt-kvdec"""
import sys, subprocess, json, os, collections
rounds = int(sys.argv[1]); args = sys.argv[2:]
trees = {"base": os.environ["BASE_TREE"], "new": os.environ["NEW_TREE"]}   # two trees, each with its build
out = collections.defaultdict(lambda: collections.defaultdict(list))
for r in range(rounds):
    for name in (("base", "new") if r % 2 == 0 else ("new", "base")):
        env = dict(os.environ, PYTHONPATH=trees[name], CPUFUSE_NUM_THREADS="1")
        p = subprocess.run(["taskset", "-c", os.environ.get("CORE", "1"), "nice", "/work/main/.venv/bin/python"] + args, env=env, capture_output=True, text=True)
        if p.returncode: print(p.stderr); sys.exit(1)
        for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items(): out[k][name].append(v)
print("| case | K+V MB | before: CPU ms | after: CPU ms | before: wall ms | after: wall ms | CPU ratio | after: bytes/ns (CPU) | read probe, same bytes: bytes/ns |")
print("|---|---|---|---|---|---|---|---|---|")
for k, d in out.items():
    import statistics as st
    bc = st.median(x[0] for x in d["base"]); nc = st.median(x[0] for x in d["new"])
    bw = min(x[1] for x in d["base"]); nw = min(x[1] for x in d["new"]); mb = d["new"][0][3] / 1e6
    pb = max(x[4] for x in d["new"] + d["base"])
    print(f"| {k} | {mb:.1f} | {bc:.3f} | {nc:.3f} | {bw:.3f} | {nw:.3f} | {bc/nc:.2f}x | {mb/nc:.1f} | {pb:.1f} |")
