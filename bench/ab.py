"""One source tree against another: `python -m bench.run ARGS` run in each tree (each built in place),
in child processes pinned to one core that alternate (the order swapped every round); per row and
column, the median time of each round. Prints base, head and head / base per cell (the median over
rounds, and the range of the per-round ratios). Two cpufuse builds cannot share a process.

    python -m bench.ab BASE_TREE HEAD_TREE [--rounds 3] [--core 1] -- --section calls     # the small calls
    python -m bench.ab OLD_TREE . -- --section ops --only softmax                          # softmax, issue 14
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def child(tree, core, args):
    """{(section, case, column): median ns} of one `bench.run` in `tree`"""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        for v in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
            env.pop(v, None)
        p = subprocess.run(["taskset", "-c", str(core), sys.executable, "-m", "bench.run", "--threads", "1", "--json", out,
                            *args], cwd=os.path.abspath(tree), env=env, capture_output=True, text=True)
        if p.returncode not in (0, 1) or not os.path.exists(out):
            raise SystemExit(f"bench.run failed in {tree}:\n{p.stderr[-2000:]}")
        rep = json.load(open(out))
    return {(s, e["case"]["name"], k): r["median_ns"] for s, sec in rep["sections"].items() for e in sec["cases"]
            for k, r in e["results"].items() if r.get("status") == "ok" and r.get("median_ns")}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("head")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--core", type=int, default=1)
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    a.args = argv[cut + 1:]     # bench.run's own arguments
    runs = {"base": [], "head": []}
    for rnd in range(a.rounds):
        for side in ("base", "head") if rnd % 2 == 0 else ("head", "base"):
            runs[side].append(child(getattr(a, side), a.core, a.args))
            print(f"round {rnd + 1}: {side} done", file=sys.stderr, flush=True)
    keys = [k for k in runs["head"][0] if all(k in r for r in runs["base"] + runs["head"])]
    print(f"| case | column | base µs | head µs | head / base (range over {a.rounds} rounds) |\n|---|---|---:|---:|---:|")
    for k in keys:
        b, h = ([r[k] / 1e3 for r in runs[s]] for s in ("base", "head"))
        q = [y / x for x, y in zip(b, h)]
        print(f"| {k[1]} | {k[2]} | {statistics.median(b):.2f} | {statistics.median(h):.2f} | "
              f"{statistics.median(q):.2f} ({min(q):.2f}–{max(q):.2f}) |")


if __name__ == "__main__":
    main()
