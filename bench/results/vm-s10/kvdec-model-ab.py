# run from this folder: BASE_TREE=... NEW_TREE=... python kvdec-model-ab.py ROUNDS kvdec-model-depth.py DEPTH TYPES (CORE: the pinned core)
import sys, subprocess, json, os, collections, statistics as st
rounds = int(sys.argv[1]); args = sys.argv[2:]
trees = {"base": os.environ["BASE_TREE"], "new": os.environ["NEW_TREE"]}   # two trees, each with its build
out = collections.defaultdict(lambda: collections.defaultdict(list))
for r in range(rounds):
    for name in (("base", "new") if r % 2 == 0 else ("new", "base")):
        env = dict(os.environ, PYTHONPATH=trees[name])
        p = subprocess.run(["taskset", "-c", os.environ.get("CORE", "0"), "nice", "/work/main/.venv/bin/python"] + args, env=env, capture_output=True, text=True)
        if p.returncode: print(p.stderr[-3000:]); sys.exit(1)
        for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items(): out[k][name].append(v)
        print(name, p.stdout.strip().splitlines()[-1], flush=True)
print("| K/V | pp128 before | pp128 after | tg before (median / best) | tg after (median / best) |")
print("|---|---|---|---|---|")
for k, d in out.items():
    f = lambda xs, i: "-".join(f"{x[i]:.1f}" for x in xs)
    print(f"| {k} | {f(d['base'],0)} | {f(d['new'],0)} | {f(d['base'],1)} / {f(d['base'],2)} | {f(d['new'],1)} / {f(d['new'],2)} |")
