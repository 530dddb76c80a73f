"""One source tree against another: `python -m bench.run ARGS` in each tree, pinned to one core,
alternating; per row and column the median over rounds of base, head and head / base.

    python -m bench.ab BASE_TREE HEAD_TREE [--rounds 3] [--core 1] -- --section calls
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from .timing import bench_env


def child(tree, core, args):
    """{(section, case, column): median ns} of one `bench.run` in `tree`"""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        tree = os.path.abspath(tree)
        cmd = ["taskset", "-c", str(core), sys.executable, "-m", "bench.run", "--threads", "1", "--json", out]
        p = subprocess.run(cmd + list(args), cwd=tree, env=dict(bench_env(), PYTHONPATH=tree),
                           capture_output=True, text=True)
        if p.returncode not in (0, 1) or not os.path.exists(out):
            raise SystemExit(f"bench.run failed in {tree}:\n{p.stderr[-2000:]}")
        with open(out) as f:
            rep = json.load(f)
    return {(s, e["case"]["name"], k): r["median_ns"] for s, sec in rep["sections"].items() for e in sec["cases"]
            for k, r in e["results"].items() if r.get("status") == "ok" and r.get("median_ns")}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, kw in (("base", {}), ("head", {}), ("--rounds", {"type": int, "default": 3}),
                     ("--core", {"type": int, "default": 1})):
        ap.add_argument(name, **kw)
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    runs = {"base": [], "head": []}
    for rnd in range(a.rounds):
        for side in ("base", "head") if rnd % 2 == 0 else ("head", "base"):
            runs[side].append(child(getattr(a, side), a.core, argv[cut + 1:]))
            print(f"round {rnd + 1}: {side} done", file=sys.stderr, flush=True)
    print(f"| case | column | base µs | head µs | head / base (range over {a.rounds} rounds) |")
    print("|---|---|---:|---:|---:|")
    for k in (k for k in runs["head"][0] if all(k in r for r in runs["base"] + runs["head"])):
        b, h = ([r[k] / 1e3 for r in runs[s]] for s in ("base", "head"))
        q = [y / x for x, y in zip(b, h)]
        print(f"| {k[1]} | {k[2]} | {statistics.median(b):.2f} | {statistics.median(h):.2f} | "
              f"{statistics.median(q):.2f} ({min(q):.2f}–{max(q):.2f}) |")


if __name__ == "__main__":
    main()
