"""Where a decode step's time goes across threads: serial time, task time, and the idle and
synchronization time inside the parallel regions (issue 27, DECODE.md's "sync time").

    python -m bench.sync MODEL.gguf [--threads 1,2,16] [--steps 64]

Counted by the thread pool itself (cf_pool_profile, native/src/pool.c) over `--steps` single-token
evals after a short prompt: W = wall time per token; R = the parallel regions' wall time on the
calling thread; B = every thread's time inside the regions' tasks. Serial = W - R (one thread works:
activation quantization of one row, small ops, Python); in-region idle + sync = R - B / n (the
average thread waits for work or for the slowest thread). "Lost" = serial x (n - 1) / n + in-region
idle + sync, as a share of W. Each thread count runs in its own process.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def worker(path, nth, steps):
    from cpufuse import _backend
    from cpufuse.llama import Model
    ffi, lib = _backend.ffi, _backend.lib
    m = Model.load(path, n_ctx=512, n_threads=nth)
    rng = np.random.default_rng(0)
    toks = [int(t) for t in rng.integers(10, m.hparams.n_vocab - 10, size=steps + 40)]
    m.eval(toks[:16])
    for i in range(16):
        m.eval([toks[16 + i]])
    out = ffi.new("uint64_t[67]")
    lib.cf_pool_profile(1, ffi.NULL)
    t0 = time.perf_counter_ns()
    for i in range(steps):
        m.eval([toks[32 + i]])
    wall = time.perf_counter_ns() - t0
    lib.cf_pool_profile(0, out)
    busy, region, nreg = (int(out[i]) for i in range(3))
    from cpufuse.graph.kinds import RECORDS
    ops = {r.name: out[3 + r.op] / steps / 1e3 for r in RECORDS if r.op < 64 and out[3 + r.op]}
    W = wall / steps / 1e3
    R = region / steps / 1e3
    B = busy / steps / 1e3
    return {"threads": nth, "wall_us": W, "region_us": R, "busy_us": B, "regions": nreg / steps,
            "serial_us": W - R if nth > 1 else 0.0, "idle_sync_us": R - B / nth if nth > 1 else 0.0, "ops_us": ops}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.model, a.worker, a.steps)))
        return
    print(f"{os.path.basename(a.model)}, {a.steps} decode steps per thread count")
    print("| threads | token µs | regions / token | serial µs | in-region idle + sync µs | task µs / thread | idle+sync % |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    per_op = []
    for t in (int(x) for x in a.threads.split(",")):
        cmd = [sys.executable, "-m", "bench.sync", a.model, "--steps", str(a.steps), "--worker", str(t)]
        if t == 1:
            cmd = ["taskset", "-c", "0"] + cmd
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        lost = r["serial_us"] * (t - 1) / t + r["idle_sync_us"] if t > 1 else 0.0
        print(f"| {t} | {r['wall_us']:.0f} | {r['regions']:.0f} | {r['serial_us']:.0f} | {r['idle_sync_us']:.0f} | "
              f"{r['busy_us'] / t:.0f} | {100 * lost / r['wall_us']:.1f} |", flush=True)
        per_op.append((t, r["ops_us"]))
    print("\nwall µs per token by plan record kind (the C plan executor; the rest of the token is Python):")
    kinds = sorted({k for _, o in per_op for k in o}, key=lambda k: -per_op[0][1].get(k, 0))
    print("| threads | " + " | ".join(kinds) + " |")
    print("|---:|" + "---:|" * len(kinds))
    for t, o in per_op:
        print(f"| {t} | " + " | ".join(f"{o.get(k, 0):.0f}" for k in kinds) + " |")


if __name__ == "__main__":
    main()
