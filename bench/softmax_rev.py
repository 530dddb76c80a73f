"""Softmax against another revision of cpufuse (issue 14: ">= 2x this project's softmax at 49ecff0"),
and against onnxruntime when it is importable, 1 thread, the four softmax cases of bench/run.py.

    git worktree add /tmp/cf-old 49ecff0 && (cd /tmp/cf-old && python setup.py -q build_ext --inplace)
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m bench.softmax_rev --old /tmp/cf-old

Two cpufuse packages can't share a process, so each side runs in its own child process, pinned to
the same core; the children alternate in rounds and each reports medians of back-to-back calls
(from Python, output preallocated). The ratio is old / new per round; the table gives the median
round and the spread.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import json, os, sys, time
import numpy as np
reps_scale, which, data = float(sys.argv[1]), sys.argv[2], sys.argv[3]
meta = json.load(open(os.path.join(data, "cases.json")))
if which == "cpufuse":
    import cpufuse
else:
    sys.path.insert(0, sys.argv[4])
    from bench import peers
out = {}
for k, (name, scale, has_mask) in enumerate(meta):
    x = np.load(os.path.join(data, f"x{k}.npy"))
    mask = np.load(os.path.join(data, f"m{k}.npy")) if has_mask else None
    y = np.empty_like(x)
    if which == "cpufuse":
        fn = lambda: cpufuse.softmax(x, mask, scale=scale, out=y, n_threads=1)
    else:
        from bench.run import CASES
        case = [c for c in CASES if c.name == name][0]
        built, why = peers.ort_build(case, {"x": x, "mask": mask, "w": None, "r": None})
        if built is None:
            continue
        fn = built[0]
    n = max(5, int(reps_scale * 2e6 / x.size))
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter_ns(); fn(); ts.append(time.perf_counter_ns() - t)
    ts.sort()
    out[name] = ts[len(ts) // 2] / 1e3
print(json.dumps(out))
'''


def child(path, which, reps, core, data):
    env = dict(os.environ, PYTHONPATH=path, CPUFUSE_NUM_THREADS="1")
    cmd = ["taskset", "-c", str(core), sys.executable, "-c", CHILD, str(reps), which, data, ROOT]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=data)
    if r.returncode:
        raise SystemExit(f"child failed ({path}, {which}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="a source tree of the older revision, built in place")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=float, default=1.0)
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--ort", action="store_true", help="also time onnxruntime (from this tree's venv)")
    a = ap.parse_args()
    from bench.run import CASES, make_inputs
    data = tempfile.mkdtemp(prefix="cf-softmax-rev-")
    meta = []
    for case in (c for c in CASES if c.op == "softmax"):
        inp = make_inputs(case)
        np.save(os.path.join(data, f"x{len(meta)}.npy"), inp["x"])
        if inp["mask"] is not None:
            np.save(os.path.join(data, f"m{len(meta)}.npy"), inp["mask"])
        meta.append((case.name, case.scale, inp["mask"] is not None))
    with open(os.path.join(data, "cases.json"), "w") as f:
        json.dump(meta, f)
    rows = {}
    for _ in range(a.rounds):
        new = child(ROOT, "cpufuse", a.reps, a.core, data)
        old = child(os.path.abspath(a.old), "cpufuse", a.reps, a.core, data)
        ort = child(ROOT, "ort", a.reps, a.core, data) if a.ort else {}
        for k in new:
            rows.setdefault(k, []).append((new[k], old.get(k), ort.get(k)))
    print(f"| case (1 thread, µs, medians over {a.rounds} alternating rounds) | cpufuse | old rev | old ÷ new "
          "| onnxruntime | ort ÷ new |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, v in rows.items():
        n = statistics.median(t[0] for t in v)
        o = statistics.median(t[1] for t in v)
        r = [t[1] / t[0] for t in v]
        line = f"| {k} | {n:.1f} | {o:.1f} | {statistics.median(r):.2f}× ({min(r):.2f}–{max(r):.2f}) |"
        if a.ort and v[0][2]:
            q = [t[2] / t[0] for t in v]
            line += f" {statistics.median(t[2] for t in v):.1f} | {statistics.median(q):.2f}× ({min(q):.2f}–{max(q):.2f}) |"
        else:
            line += " – | – |"
        print(line)


if __name__ == "__main__":
    main()
