"""One layer's decode attention (Llama-3.2-1B heads: 32 query heads, 8 KV heads of 64), one query
row, no mask, cpufuse.flash_attn's split-KV decode: CPU and wall time per call, ns per (cell, KV
head), K+V bytes per CPU ns, and the 1-thread read probe over the same bytes.

    python -m bench.attndec --depths 4096,16384 --types f16,q8_0,q4_0 [--cold] [--reps 20] [--isa avx512] [--layout heads]
        [--threads 2]
    python -m bench.attndec --ab BASE_TREE HEAD_TREE --rounds 4 --core 1 -- --depths 4096 --cold
    python -m bench.attndec --envs "CPUFUSE_FA_CELLS_NTH=64 CPUFUSE_FA_SLICE=0" --core 0-15 -- --threads 16 --cold

K and V are laid out as the KV cache holds them (cell-major, the KV heads of a cell together;
--layout heads: each head contiguous). "cold": 64 MiB written between calls, as a decoder's
weights stream between its layers, and the call says so (flash_attn(cold=True): K/V prefetched at any size, as
the decoder's are; before session 24 only past 4 MiB, so an --ab against an older tree compares unlike calls
there); warm: the call repeated, K/V in the caches where they fit. --ab runs the two trees in alternating
processes, each pinned to --core under nice, the tree first on PYTHONPATH (the A/B in docs/kv.md); --envs
runs this tree as it is and under each setting the same way (the even rounds in reverse order).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from .timing import bench_env

HQ, HKV, D = 32, 8, 64


def one_case(T, t, reps, cold, isa, flush, layout, threads=1):
    import cpufuse
    from cpufuse.ops import kvquant

    from .threads import read_fn
    rng = np.random.default_rng(T)
    q = rng.uniform(-2, 2, (1, HQ, 1, D)).astype(np.float32)
    shape = (1, T, HKV, D) if layout == "cache" else (1, HKV, T, D)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    kb = kvquant.quantize(k, t) if t != "f16" else k.astype(np.float16)
    vb = kvquant.quantize(v, t) if t != "f16" else v.astype(np.float16)
    if layout == "cache":  # (cells, KV heads, D) as the KV cache stores them, viewed as (1, heads, cells, D)
        kb, vb = kb.transpose(0, 2, 1, 3), vb.transpose(0, 2, 1, 3)
    kw = {"isa": isa} if isa else {}
    if cold:   # as the decoder's steps say of their cache: prefetched at any size (else only past 4 MiB)
        kw["cold"] = True
    f = lambda: cpufuse.flash_attn(q, kb, vb, None, scale=float(D) ** -0.5, k_type=t, v_type=t, dv=D, n_threads=threads,
                                  **kw)  # noqa
    f()
    cs, ws = [], []
    for _ in range(reps):
        if cold:
            flush += 1.0
        c0, w0 = time.process_time(), time.perf_counter()
        f()
        cs.append(time.process_time() - c0)
        ws.append(time.perf_counter() - w0)
    nbytes = kb.nbytes + vb.nbytes
    buf = np.full(nbytes // 4, 1.0, np.float32)
    rf, _ = read_fn(buf, 1, isa or "avx512")
    rf()
    pr = []
    for _ in range(reps):
        if cold:
            flush += 1.0
        w0 = time.perf_counter()
        rf()
        pr.append(time.perf_counter() - w0)
    return {"cpu_ms": statistics.median(cs) * 1e3, "wall_ms": min(ws) * 1e3, "wall_med_ms": statistics.median(ws) * 1e3,
            "bytes": nbytes,
            "probe_bpns": buf.nbytes / min(pr) / 1e9}


def run(a):
    flush = np.ones((64 << 20) // 8) if a.cold else None
    out = {}
    for T in [int(x) for x in a.depths.split(",")]:
        for t in a.types.split(","):
            out[f"{t}@{T}"] = one_case(T, t, a.reps, a.cold, a.isa, flush, a.layout, a.threads)
    return out


def row(name, r):
    ns = r["cpu_ms"] * 1e6 / (int(name.split("@")[1]) * HKV)
    return ns, r["bytes"] / (r["cpu_ms"] * 1e6)


def sides_of(a):
    """(label, tree, extra env) of each side: --ab's two trees, or --envs' settings of this tree"""
    if a.ab:
        return [("base", a.ab[0], {}), ("head", a.ab[1], {})]
    out = [("default", ".", {})]
    for side in a.envs.split():
        env = {}
        for ev in side.split(","):
            name, eq, val = ev.partition("=")
            if not eq or not name:
                raise SystemExit(f"--envs: expected sides separated by spaces, each NAME=VALUE[,NAME=VALUE], got {side!r}")
            env[name] = val
        out.append((side, ".", env))
    return out


def ab(a, rest):
    sides = sides_of(a)
    runs = {s[0]: [] for s in sides}
    nth = rest[rest.index("--threads") + 1] if "--threads" in rest else "1"
    for rnd in range(a.rounds):
        for label, tree, extra in (sides if rnd % 2 == 0 else sides[::-1]):
            tree = os.path.abspath(tree)
            cmd = ["taskset", "-c", str(a.core), "nice", sys.executable, "-m", "bench.attndec", "--json"] + rest
            path = os.pathsep.join([tree] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])
            env = dict(bench_env(), PYTHONPATH=path, CPUFUSE_NUM_THREADS=nth, **extra)
            p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(p.stderr[-2000:])
            runs[label].append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(f"round {rnd + 1}: {label} done", file=sys.stderr, flush=True)
    base = sides[0][0]
    print(f"| case | side | K+V MB | CPU ms (median of {a.rounds}) | wall ms (median of the rounds' medians) | "
          f"wall / {base}'s (range) | bytes/ns (wall) | read probe bytes/ns (1 thread) |")
    print("|---|---|---|---|---|---|---|---|")
    for k in runs[base][0]:
        bw = [r[k]["wall_med_ms"] for r in runs[base]]
        for label, _, _ in sides:
            c = [r[k]["cpu_ms"] for r in runs[label]]
            w = [r[k]["wall_med_ms"] for r in runs[label]]
            q = [y / x for x, y in zip(bw, w)]
            nb = runs[label][0][k]["bytes"]
            pb = max(r[k]["probe_bpns"] for r in runs[label])
            print(f"| {k} | {label} | {nb / 1e6:.1f} | {statistics.median(c):.3f} | {statistics.median(w):.3f} | "
                  f"{statistics.median(q):.3f} ({min(q):.2f}-{max(q):.2f}) | {nb / (statistics.median(w) * 1e6):.1f} | "
                  f"{pb:.1f} |")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.attndec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="4096,16384")
    ap.add_argument("--types", default="f16,q8_0,q4_0")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--isa", default=None)
    ap.add_argument("--layout", choices=("cache", "heads"), default="cache",
                    help="cache: K/V rows of a head n_head_kv rows apart, as in the KV cache; heads: each head contiguous")
    ap.add_argument("--threads", type=int, default=1, help="n_threads of the call (the probe stays at 1)")
    ap.add_argument("--heads", default=None, metavar="HQ,HKV,D",
                    help="query heads, KV heads, head size (default 32,8,64: Llama-3.2-1B; 12,2,128: Qwen2.5-1.5B)")
    ap.add_argument("--json", action="store_true", help="one JSON line (the --ab children)")
    ap.add_argument("--ab", nargs=2, metavar=("BASE_TREE", "HEAD_TREE"))
    ap.add_argument("--envs", default=None, metavar="'NAME=VALUE ...'",
                    help="alternate processes of this tree as it is and under each side's settings (A/B knobs; sides "
                         "separated by spaces, a side's settings by commas)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--core", default="1", help="taskset CPU list of the --ab children (e.g. 0,1 with --threads 2)")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    if a.heads:
        global HQ, HKV, D
        try:
            HQ, HKV, D = (int(x) for x in a.heads.split(","))
        except ValueError:
            ap.error(f"--heads: expected HQ,HKV,D (three integers), got {a.heads!r}")
    if a.ab or a.envs:
        return ab(a, argv[cut + 1:])
    res = run(a)
    if a.json:
        print(json.dumps(res))
        return
    print("| case | K+V MB | CPU ms | wall ms | ns/(cell, KV head) | bytes/ns (CPU) | read probe bytes/ns |")
    print("|---|---|---|---|---|---|---|")
    for k, r in res.items():
        ns, bpns = row(k, r)
        print(f"| {k} | {r['bytes'] / 1e6:.1f} | {r['cpu_ms']:.3f} | {r['wall_ms']:.3f} | {ns:.1f} | {bpns:.1f} | "
              f"{r['probe_bpns']:.1f} |")


if __name__ == "__main__":
    main()
