"""The routed matmul's phases (QMM_ID, native/kernels/qmoe.inc) on a MoE GGUF, and a model of W threads
from a run at fewer: the serial phases as measured, the activation region divided by W, the (expert x
chunk) tasks' CPU times scheduled in queue order on W workers. Counts CPU time of the calling thread
(and per task), so a loaded machine changes the numbers less than wall time; pin it (taskset).

    python -m bench.e2e.moeprof FILE --prompt 64,512 --decode 16 --threads 1,16 --rounds 3
    python -m bench.e2e.moeprof FILE --ab 32 --threads 1,16 --rounds 5

--ab N: decode A/B of the routed matmul's prefetch hints (CPUFUSE_MOE_HINTS=1 against =0, no result
changes), N steps per process, the two in alternating processes per round, each with the DRAM read
probe: tok/s, CPU ms a token (time.process_time) and the active bytes a token reads against the probe,
in wall and per CPU second, and the plan records' wall time per token (decode_ab.py).

Threads beyond the cores still give the task list of that thread count and each task's CPU time, so
--threads 16 on a small machine models 16 threads (the sim16 column), including how the work was split.

Decode (calls of up to 16 routed rows, docs/moe.md "Routing and threads"): the tasks quantize their own rows,
so the prep column is only the clock read, and the quantization is in the tasks' times; the down projection
runs inside the gate/up call (one region), so it counts as a part of the "pair" calls (its phases there, its
tasks not in the task list), and the "one" rows are the prompt's down calls only.
"""
import argparse
import os
import resource
import statistics
import time

import numpy as np

SLOTS = ["setup", "prep", "ctx", "mm", "out", "wall", "task_sum", "sim1", "sim2", "sim4", "sim8", "sim16",
         "task_max", "calls", "tasks", "rows"]     # qmoe.inc's QP_* enum, slots 48..63
W = (1, 2, 4, 8, 16)


def profiled(fn, which):
    """{slot: value} of the QMM_ID calls `which` selects ('pair' or 'one'), plus the plan's per-op ns"""
    from cpufuse import _backend
    from cpufuse.graph.kinds import RECORDS
    ffi, lib = _backend.ffi, _backend.lib
    os.environ["CPUFUSE_MOE_PROF"] = which
    out = ffi.new("uint64_t[67]")
    lib.cf_pool_profile(1, ffi.NULL)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0, t0 = time.process_time_ns(), time.perf_counter_ns()
    fn()
    wall, cpu = time.perf_counter_ns() - t0, time.process_time_ns() - c0
    r_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    lib.cf_pool_profile(0, out)
    r = {name: int(out[3 + 48 + i]) for i, name in enumerate(SLOTS)}
    r["ops"] = {k.name: int(out[3 + k.op]) for k in RECORDS if k.op < 48 and out[3 + k.op]}
    r["eval_wall"], r["eval_cpu"], r["faults"] = wall, cpu, r_faults
    return r


def model16(r, w):
    """modelled ns of these calls at w threads: serial phases + prep / w + the tasks' makespan at w"""
    return r["setup"] + r["ctx"] + r["out"] + r["prep_cpu1"] / w + r[f"sim{w}"]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.e2e.moeprof", description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", default="512", help="prompt lengths, comma-separated")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--decode", type=int, default=0, help="also this many decode steps after a 16-token prompt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ab", type=int, default=0, metavar="N", help="decode A/B of the hints, N steps (above)")
    a = ap.parse_args(argv)
    if a.ab:
        from .decode_ab import ab
        return ab(a.model, a.ab, [int(t) for t in a.threads.split(",")], a.rounds)
    from cpufuse.llama import Model
    prompts = [int(p) for p in a.prompt.split(",")] + ([-a.decode] if a.decode else [])   # -N: N decode steps
    threads = [int(t) for t in a.threads.split(",")]
    m = Model.load(a.model, n_ctx=max(prompts) + a.decode + 64, n_threads=threads[0], n_batch=max(prompts))
    toks = [int(t) for t in np.random.default_rng(0).integers(10, m.hparams.n_vocab - 10, size=max(prompts) + 16 + a.decode)]

    def run(p):
        if p > 0:
            return lambda: m.eval(toks[:p])
        m.eval(toks[:16])
        return lambda: [m.eval([t]) for t in toks[16:16 - p]]
    m.eval(toks[:16])
    m.reset()
    res = {}
    for _ in range(a.rounds):                    # rounds alternate thread counts and prompts
        for p in prompts:
            for t in threads:
                m.n_threads = t
                for which in ("pair", "one"):
                    m.reset()
                    res.setdefault((p, t, which), []).append(profiled(run(p), which))
    print(f"# {os.path.basename(a.model)}: QMM_ID phases, medians of {a.rounds} rounds, ms per prompt (prompt -N: "
          "N decode steps) (CPU ms of the calling thread; tasks: CPU ms summed)\n")
    hdr = ["prompt", "thr", "call", "calls", "tasks", "rows/call", "setup", "prep", "ctx", "tasks(caller)", "out",
           "wall", "task sum", "task max", "serial %1t"] + [f"sim{w}" for w in W] + ["eval wall", "eval cpu", "page faults"]
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for (p, t, which), rs in sorted(res.items()):
        med = {k: statistics.median(r[k] for r in rs) for k in SLOTS + ["eval_wall", "eval_cpu", "faults"]}
        if not med["calls"]:              # no such calls (a graph without a gate/up pair)
            continue
        ser = med["setup"] + med["ctx"] + med["out"]
        tot1 = ser + med["prep"] + med["task_sum"]
        row = [p, t, which, f"{med['calls']:.0f}", f"{med['tasks'] / max(med['calls'], 1):.0f}",
               f"{med['rows'] / max(med['calls'], 1):.0f}"]
        row += [f"{med[k] / 1e6:.2f}" for k in ("setup", "prep", "ctx", "mm", "out", "wall", "task_sum", "task_max")]
        row += [f"{100 * ser / tot1:.1f}" if t == 1 else "–"]
        row += [f"{med[f'sim{w}'] / 1e6:.2f}" for w in W]
        row += [f"{med['eval_wall'] / 1e6:.0f}", f"{med['eval_cpu'] / 1e6:.0f}", f"{med['faults']:.0f}"]
        print("| " + " | ".join(str(x) for x in row) + " |")
    print("\nOther plan records (median ms per prompt, wall, at each thread count):\n")
    for (p, t, which), rs in sorted(res.items()):
        if which != "one":                # the plan's records are the same in both passes
            continue
        ops = {k: statistics.median(r["ops"].get(k, 0) for r in rs) / 1e6 for k in rs[0]["ops"]}
        print(f"- pp{p} t{t}: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(ops.items(), key=lambda x: -x[1])))
    # the model of 16 threads: per prompt, from the 1-thread run's serial and prep CPU times
    print("\nModel of W threads (serial phases + prep/W + the tasks' makespan at W), ms of QMM_ID per prompt:\n")
    for p in prompts:
        for which in ("pair", "one"):
            rs = res.get((p, threads[0], which))
            if not rs or not statistics.median(r["calls"] for r in rs):
                continue
            med = {k: statistics.median(r[k] for r in rs) for k in SLOTS}
            ser = med["setup"] + med["ctx"] + med["out"]
            cells = [f"W={w}: {(ser + med['prep'] / w + med[f'sim{w}']) / 1e6:.2f}" for w in W]
            print(f"- pp{p} {which} (from {threads[0]} thread(s)): serial {ser / 1e6:.2f}, prep {med['prep'] / 1e6:.2f}; "
                  + ", ".join(cells) + f"; ideal at 16 (task sum / 16) {med['task_sum'] / 16e6:.2f}")


if __name__ == "__main__":
    main()
