"""Decode attention with the group rows cut in slices (CPUFUSE_FA_SLICE: the fewest rows a slice keeps; 0 = no
slices), one layer, the auto strategy (rows below 512 cells, split from 512), f16 cache; µs a call (the Python call
included), median of 5 x 200. Each setting runs in its own process, settings alternating over the rounds.
Usage: python bench/results/vm-s18/fa_slice.py THREADS ROUNDS SLICES (e.g. 16 3 0,2,1,4). Slices engage only where
the team outnumbers the tasks: on 2 threads, the one-KV-head shape below 512 cells."""
import os, subprocess, sys, time
import numpy as np

SHAPES = ((32, 4, 128), (64, 8, 64), (8, 1, 128))  # Qwen3-30B-A3B, gpt-oss-20b (8 query heads a KV head); one KV head
CELLS = (32, 128, 256, 511, 700, 1024, 2048)


def child(nth):
    from cpufuse.ops.attention import flash_attn
    rng = np.random.default_rng(0)
    for Hq, Hk, D in SHAPES:
        for T in CELLS:
            q = rng.standard_normal((1, Hq, 1, D)).astype(np.float32)
            k = rng.standard_normal((1, Hk, T, D)).astype(np.float16)
            v = rng.standard_normal((1, Hk, T, D)).astype(np.float16)
            f = lambda: flash_attn(q, k, v, scale=0.088, n_threads=nth)
            f()
            best = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(200):
                    f()
                best.append((time.perf_counter() - t0) / 200 * 1e6)
            print(f"{Hq},{Hk},{D} {T} {np.median(best):.1f}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(int(sys.argv[2]))
        sys.exit()
    nth, rounds, slices = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    res = {}
    for r in range(rounds):
        for s in slices:
            out = subprocess.run([sys.executable, __file__, "--child", str(nth)], capture_output=True, text=True,
                                 env=dict(os.environ, CPUFUSE_FA_SLICE=s)).stdout
            for line in out.splitlines():
                shape, T, us = line.split()
                res.setdefault((shape, int(T)), {}).setdefault(s, []).append(float(us))
            print(f"round {r} slice {s} done", file=sys.stderr, flush=True)
    print(f"# {nth} threads, {rounds} rounds; µs a call, median over rounds; ratio = slice 0 / slice s, paired median")
    print("shape cells " + " ".join(f"s{s}" for s in slices) + " " + " ".join(f"0/s{s}" for s in slices[1:]))
    for (shape, T), d in sorted(res.items()):
        med = [np.median(d[s]) for s in slices]
        rat = [np.median(np.array(d[slices[0]]) / np.array(d[s])) for s in slices[1:]]
        print(shape, T, " ".join(f"{m:.1f}" for m in med), " ".join(f"{x:.2f}" for x in rat))
