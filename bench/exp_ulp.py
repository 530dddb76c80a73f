"""Exhaustive accuracy of cpufuse's exp kernels (cf_exp_f32, cf_exp_le0_f32) over every float32, per
native ISA, against float64 exp rounded to float32 -> bench/results/exp_ulp.md (docs/notes.md).

    python -m bench.exp_ulp [--isa avx2] [--step 1] [--md bench/results/exp_ulp.md]
"""
import argparse
import time

import numpy as np

from cpufuse import _backend, _registry, available_isas

CHUNK = 1 << 24


def run(isa, fn_name, step, lo, hi):
    ffi, lib = _backend.ffi, _backend.lib
    fn = _registry.kernel({"cf_exp_f32": "exp", "cf_exp_le0_f32": "exp_le0"}[fn_name], isa)
    worst, worst_x, n, bad = 0.0, None, 0, 0
    tiny = np.float64(2.0) ** -149
    for start in range(0, 1 << 32, CHUNK):
        bits = np.arange(start, start + CHUNK, step, dtype=np.uint64).astype(np.uint32)
        x = bits.view(np.float32)
        if fn_name == "cf_exp_le0_f32":
            x = x[~(x > 0)]  # the function's domain: x <= 0, -inf and NaN
        if x.size == 0:
            continue
        y = np.empty_like(x)
        fn(x.size, ffi.cast("float *", x.ctypes.data), ffi.cast("float *", y.ctypes.data))
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            ref = np.exp(x.astype(np.float64))
            reff = ref.astype(np.float32)
        nan = np.isnan(x)
        bad += int(np.count_nonzero(nan & ~np.isnan(y)))
        inr = (x >= lo) & (x <= hi)
        out = ~inr & ~nan
        # outside the accurate range: +inf above, +0 below (le0: +0 or the correct subnormal)
        want_out = np.where(x[out] > 0, np.float32(np.inf), np.float32(0))
        ok = (y[out] == want_out) & ~np.signbit(y[out])
        if fn_name == "cf_exp_le0_f32":
            ok |= np.abs(y[out].astype(np.float64) - ref[out]) <= 8 * np.spacing(np.float32(2.0 ** -126))
        else:
            ok |= y[out] == reff[out]
        bad += int(np.count_nonzero(~ok))
        xi, yi, ri = x[inr], y[inr].astype(np.float64), ref[inr]
        if xi.size:
            ulp = np.maximum(np.spacing(np.abs(ri.astype(np.float32))).astype(np.float64), tiny)
            err = np.abs(yi - ri) / ulp
            k = int(np.argmax(err))
            n += xi.size
            if err[k] > worst:
                worst, worst_x = float(err[k]), float(xi[k])
    return worst, worst_x, n, bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", action="append")
    ap.add_argument("--step", type=int, default=1, help="test every step-th bit pattern (1: all 2^32)")
    ap.add_argument("--md", default=None)
    a = ap.parse_args()
    isas = a.isa or [i for i in available_isas() if i != "numba"]
    lines = ["| ISA | function | domain tested | points | max error (ulp) | at x | wrong specials |",
             "|---|---|---|---:|---:|---:|---:|"]
    for isa in isas:
        for fn, lo, hi, dom in (("cf_exp_f32", -103.972, 88.7228, "[-103.97, 88.72]"),
                                ("cf_exp_le0_f32", -87.33654, 0.0, "[-87.34, 0]")):
            t = time.time()
            w, wx, n, bad = run(isa, fn, a.step, lo, hi)
            print(f"{isa} {fn}: max {w:.3f} ulp at x={wx!r} over {n} points, {bad} wrong specials "
                  f"({time.time() - t:.0f} s)", flush=True)
            lines.append(f"| {isa} | {fn} | {dom} | {n:,} | {w:.2f} | {wx:.7g} | {bad} |")
    md = "\n".join(lines)
    print(md)
    if a.md:
        with open(a.md, "w") as f:
            f.write("# exp accuracy, exhaustive over float32 (python -m bench.exp_ulp)\n\n" + md + "\n")


if __name__ == "__main__":
    main()
