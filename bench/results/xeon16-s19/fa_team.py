"""Decode attention at 16 threads: where a call's time goes (session 19, time-only experiments).
One layer, f16 cache, the auto strategy; per (threads, CPUFUSE_FA_SLICE) one process, settings alternating over the rounds.
warm: the same K/V called back to back (µs a call, Python included, median of 5 x 100).
cold: a 256 MiB sweep between calls evicts K/V (µs of the call alone, Python included, median of 10).
Usage: python fa_team.py ROUNDS THREADS SLICES   (e.g. 3 1,4,16 0,2)"""
import os, subprocess, sys, time
import numpy as np

SHAPES = ((32, 4, 128), (64, 8, 64))  # Qwen3-30B-A3B, gpt-oss-20b
CELLS = (32, 256, 511, 2048)


def child(nth):
    from cpufuse.ops.attention import flash_attn
    rng = np.random.default_rng(0)
    sweep = np.ones(256 << 18, np.float32)
    for Hq, Hk, D in SHAPES:
        for T in CELLS:
            q = rng.standard_normal((1, Hq, 1, D)).astype(np.float32)
            k = rng.standard_normal((1, Hk, T, D)).astype(np.float16)
            v = rng.standard_normal((1, Hk, T, D)).astype(np.float16)
            f = lambda: flash_attn(q, k, v, scale=0.088, n_threads=nth)
            f()
            warm = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(100):
                    f()
                warm.append((time.perf_counter() - t0) / 100 * 1e6)
            cold = []
            for _ in range(10):
                sweep.sum()
                t0 = time.perf_counter()
                f()
                cold.append((time.perf_counter() - t0) * 1e6)
            print(f"{Hq},{Hk},{D} {T} {np.median(warm):.1f} {np.median(cold):.1f}", flush=True)


def report(res, sets, rounds):
    print(f"# {rounds} rounds; median over rounds of µs a call; columns threads/slice: warm (cold)")
    print("shape cells " + " ".join(f"t{t}/s{s}" for t, s in sets))
    for (shape, T), d in sorted(res.items()):
        print(shape, T, " ".join(f"{np.median(d[k][0]):.1f} ({np.median(d[k][1]):.1f})" for k in sets))


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(int(sys.argv[2]))
        sys.exit()
    rounds, threads, slices = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3].split(",")
    sets = [(t, s) for t in threads for s in (slices if t != "1" else slices[:1])]
    res = {}
    for r in range(rounds):
        for t, s in sets:
            out = subprocess.run([sys.executable, __file__, "--child", t], capture_output=True, text=True,
                                 env=dict(os.environ, CPUFUSE_FA_SLICE=s)).stdout
            for line in out.splitlines():
                shape, T, w, c = line.split()
                d = res.setdefault((shape, int(T)), {}).setdefault((t, s), ([], []))
                d[0].append(float(w))
                d[1].append(float(c))
        report(res, sets, r + 1)
        sys.stdout.flush()

