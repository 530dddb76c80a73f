"""One-row quantized matmul (decode GEMV) timing: bytes/cycle from cache and from DRAM, per type.

    python -m bench.gemv [--types q4_0,q8_0,q4_k,q6_k] [--isa avx2] [--reps 200]

Details: bench/README.md, "bench.gemv".
"""
import argparse
import statistics
import time

import numpy as np

import cpufuse
from cpufuse import _backend, _registry
from cpufuse.quant.matmul import qm_desc
from cpufuse.quant.types import QTYPES

ffi = _backend.ffi


def make_weight(tname, n_out, n_in, rng, like=None):
    """a QTensor of random codes with valid f16 scales, repacked (timing only: values are noise);
    like: a raw array of the same size to copy instead (fresh pages, no random generation)"""
    t = QTYPES[tname.upper()]
    qk, bb = t.block_size, t.type_size
    nb = n_out * n_in // qk
    if like is not None:
        raw = np.copy(like)
    else:
        raw = rng.integers(0, 256, size=(nb, bb), dtype=np.uint8)
        h = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        for off in _f16_offsets(tname.upper(), bb):
            raw[:, off:off + 2] = h
    w = cpufuse.QTensor(raw.reshape(-1), tname.upper(), (n_out, n_in))
    return w.repack(), raw


def _f16_offsets(t, bb):
    return {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
            "Q5_K": [0, 2], "Q6_K": [bb - 2]}.get(t, [])


def caller(ws, isa, K, nth=1):
    fn = _registry.kernel("qmatmul", isa)
    d = ffi.new("int64_t[]", qm_desc(1, K, K, True, 0, 0, ws[:1], [ws[0].shape[0]]))
    x = np.random.default_rng(1).standard_normal(K).astype(np.float32)
    y = np.empty(ws[0].shape[0], np.float32)
    xp, yp = ffi.cast("const float *", x.ctypes.data), ffi.cast("float *", y.ctypes.data)
    ptrs = [ffi.cast("const void *", ffi.from_buffer(w.raw)) for w in ws]
    N = ffi.NULL

    keep = (x, y, ws)

    def run(i, keep=keep):
        return fn(d, xp, N, 0.0, ptrs[i % len(ptrs)], N, N, yp, N, N, N, nth)
    return run


def time_calls(run, n_calls, reps):
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for i in range(n_calls):
            run(i)
        best = min(best, (time.perf_counter_ns() - t0) / n_calls)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="q4_0,q8_0,q4_k,q6_k")
    ap.add_argument("--isa", default=None)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--cache-kib", type=int, default=256)
    ap.add_argument("--dram-mib", type=int, default=256)
    ap.add_argument("--ghz", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nth", type=int, default=1)
    ap.add_argument("--ramp", default="", help="E5 size ramp: comma list of weight rows per call (from DRAM), "
                    "e.g. 64,256,1024,4096; prints time per call against bytes per call instead of the table")
    a = ap.parse_args()
    isa = a.isa or cpufuse.info()["auto_isa"]
    rng = np.random.default_rng(0)
    print(f"isa {isa}, K {a.K}, threads {a.nth}, in-cache weight {a.cache_kib} KiB, DRAM ring {a.dram_mib} MiB")
    from bench.threads import read_bw_stats
    pr = read_bw_stats(a.nth, nbytes=512 << 20, passes=5, isa=isa)
    print(f"read probe ({pr['how']}): {pr['gbps']:.2f} GB/s = B/ns")
    if a.ramp:
        print("| type | rows | KiB / call | µs / call (DRAM) | B/ns |")
        print("|---|---:|---:|---:|---:|")
        for tn in a.types.split(","):
            t = QTYPES[tn.upper()]
            row_bytes = a.K // t.block_size * t.type_size
            for rows in (int(r) for r in a.ramp.split(",")):
                nb = rows * row_bytes
                nring = max(2, a.dram_mib * 2**20 // nb)
                first, raw = make_weight(tn, rows, a.K, rng)
                ring = [first] + [make_weight(tn, rows, a.K, rng, like=raw)[0] for _ in range(nring - 1)]
                rd = caller(ring, isa, a.K, a.nth)
                ts = sorted(time_calls(rd, nring, 3) for _ in range(a.rounds))
                tm = ts[len(ts) // 2]
                print(f"| {tn} | {rows} | {nb / 1024:.0f} | {tm / 1e3:.2f} | {nb / tm:.2f} |", flush=True)
                del ring, rd
        return
    print("| type | cache B/ns | DRAM B/ns | cache B/cyc | DRAM B/cyc |")
    print("|---|---:|---:|---:|---:|")
    for tn in a.types.split(","):
        t = QTYPES[tn.upper()]
        row_bytes = a.K // t.block_size * t.type_size
        n_small = max(64, (a.cache_kib * 1024 // row_bytes) // 64 * 64)
        n_big = 4096
        big_bytes = n_big * row_bytes
        nring = max(2, a.dram_mib * 2**20 // big_bytes)
        small = make_weight(tn, n_small, a.K, rng)[0]
        first, raw = make_weight(tn, n_big, a.K, rng)
        ring = [first] + [make_weight(tn, n_big, a.K, rng, like=raw)[0] for _ in range(nring - 1)]
        rc, rd = caller([small], isa, a.K, a.nth), caller(ring, isa, a.K, a.nth)
        cs, ds = [], []
        for _ in range(a.rounds):
            cs.append(n_small * row_bytes / time_calls(rc, 50, 20))
            ds.append(big_bytes / time_calls(rd, nring, 3))
        c, dd = statistics.median(cs), statistics.median(ds)
        g = a.ghz or float("nan")
        print(f"| {tn} | {c:.2f} | {dd:.2f} | {c / g:.2f} | {dd / g:.2f} |", flush=True)


if __name__ == "__main__":
    main()
