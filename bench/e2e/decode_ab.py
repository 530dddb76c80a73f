"""Decode A/B for a MoE file (python -m bench.e2e.moeprof FILE --ab N): each variant's decode in its own
process, the variants alternating within each round (order reversed every other round), each process
with the DRAM read probe at its thread count. Variants are environment settings read by the native
code once per process; the default is CPUFUSE_MOE_HINTS 1 against 0 (the routed matmul's prefetch
hints, docs/moe.md). 1 thread runs pinned to one core (taskset -c 1 where there are two or more)."""
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

VARIANTS = (("hints", {"CPUFUSE_MOE_HINTS": "1"}), ("no hints", {"CPUFUSE_MOE_HINTS": "0"}))


def one(path, nth, steps):
    """this process: decode `steps` tokens after a 16-token prompt and 8 untimed steps, and the probe"""
    from cpufuse import _backend
    from cpufuse.graph.kinds import RECORDS
    from cpufuse.llama import Model
    from .. import threads as TM
    ffi, lib = _backend.ffi, _backend.lib
    m = Model.load(path, n_ctx=64 + steps, n_threads=nth)
    toks = [int(t) for t in np.random.default_rng(0).integers(10, m.hparams.n_vocab - 10, size=32 + steps)]
    ws = [w for L in m.layers for w in vars(L).values() if hasattr(w, "n_in")]
    act = [m.hparams.n_expert_used / m.hparams.n_expert if w.n_expert else 1 for w in ws]
    total = sum(w.nbytes * a for w, a in zip(ws, act)) + m.output.nbytes
    experts = sum(w.nbytes * a for w, a in zip(ws, act) if w.n_expert)
    m.eval(toks[:16])
    for t in toks[16:24]:
        m.eval([t])
    out = ffi.new("uint64_t[67]")
    lib.cf_pool_profile(1, ffi.NULL)
    c0, t0 = time.process_time(), time.perf_counter()
    for t in toks[24:24 + steps]:
        m.eval([t])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    lib.cf_pool_profile(0, out)
    ops = {k.name: int(out[3 + k.op]) / steps / 1e3 for k in RECORDS if k.op < 48 and out[3 + k.op]}
    m = None  # noqa: F841
    a = np.full((512 << 20) // 4, 1.0, np.float32)
    fn, _ = TM.read_fn(a, nth, TM.best_isa())
    fn()
    c1, t1 = time.process_time(), time.perf_counter()
    for _ in range(3):
        fn()
    pw, pc = 3 * a.nbytes / (time.perf_counter() - t1) / 1e9, 3 * a.nbytes / (time.process_time() - c1) / 1e9
    return {"ms": wall / steps * 1e3, "cpu_ms": cpu / steps * 1e3, "bytes": total, "expert_bytes": experts,
            "probe_wall": pw, "probe_cpu": pc, "ops": ops, "regions": int(out[2]) / steps}


def ab(path, steps, threads, rounds, variants=VARIANTS):
    res = {}
    for r in range(rounds):
        for t in threads:
            for name, env in (variants if r % 2 == 0 else variants[::-1]):
                cmd = [sys.executable, "-c", "import json, sys; from bench.e2e.decode_ab import one; "
                       f"print('AB ' + json.dumps(one({path!r}, {t}, {steps})))"]
                if t == 1 and len(os.sched_getaffinity(0)) > 1 and shutil.which("taskset"):
                    cmd = ["taskset", "-c", "1"] + cmd
                p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
                line = [x for x in p.stdout.splitlines() if x.startswith("AB ")]
                if not line:
                    sys.exit(f"{name} at {t} threads failed: {(p.stderr or p.stdout)[-800:]}")
                res.setdefault((t, name), []).append(json.loads(line[0][3:]))
    med = statistics.median
    print(f"# {os.path.basename(path)}: decode A/B, {steps} steps a process, {rounds} rounds (medians; "
          "GB/s: the bytes a token reads, active experts + the rest, per wall second and per CPU second)\n")
    print("| threads | variant | tok/s | ms / token | CPU ms / token | GB/s wall (% probe) | GB/CPU-s (% probe) | "
          "regions / token | rounds' ms / token |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for (t, name), rs in sorted(res.items()):
        ms, cpu, b = med(x["ms"] for x in rs), med(x["cpu_ms"] for x in rs), rs[0]["bytes"]
        pw, pc = med(x["probe_wall"] for x in rs), med(x["probe_cpu"] for x in rs)
        gw, gc = b / ms / 1e6, b / cpu / 1e6
        print(f"| {t} | {name} | {1e3 / ms:.1f} | {ms:.2f} | {cpu:.2f} | {gw:.1f} ({100 * gw / pw:.0f} %) "
              f"| {gc:.1f} ({100 * gc / pc:.0f} %) | {med(x['regions'] for x in rs):.0f} | "
              + ", ".join(f"{x['ms']:.2f}" for x in rs) + " |")
    r0 = next(iter(res.values()))[0]
    print(f"\nBytes a token: {r0['bytes'] / 1e6:.0f} MB, of them the k experts' {r0['expert_bytes'] / 1e6:.0f} MB. "
          "Probe (median): " + ", ".join(f"{t} thr {med(x['probe_wall'] for x in rs):.1f} GB/s wall, "
                                         f"{med(x['probe_cpu'] for x in rs):.1f} per CPU s"
                                         for (t, n), rs in sorted(res.items()) if n == variants[0][0]))
    print("\nPlan records, wall µs a token (median):\n")
    for (t, name), rs in sorted(res.items()):
        ops = {k: med(x["ops"].get(k, 0) for x in rs) for k in rs[0]["ops"]}
        print(f"- {t} thr, {name}: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(ops.items(), key=lambda x: -x[1])))
    return res
