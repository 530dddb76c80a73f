"""Small-row quantized matmuls: the cost of M = 1..16 activation rows against one weight, in units of
the one-row call (t(M) / t(1)), at one thread, CPU seconds (time.process_time) and wall.

    python -m bench.smallrows [--shapes q4k-1536,...] [--rows 1-16] [--json OUT]
    python -m bench.smallrows --ab BASE_TREE HEAD_TREE [--rounds 3] [--core 1] [...]
    python -m bench.smallrows --verify MODEL.gguf [--rows 1-16] [--ab ...]

--verify times a model's speculative verification of M tokens in one decoder call instead (M = 1: a
decode step; docs/speculative.md "Cost"), after a 64-token prompt, at one thread.

--ab runs this module in each tree (each with its own bench/smallrows.py and built cpufuse) in turn (pinned to one core, alternating, BASE first in odd rounds,
HEAD first in even ones) and prints, per shape and M, the median over rounds of each tree's CPU ms and
HEAD / BASE. Weights are random bytes of real shapes (bench.quant.make_raw), repacked as the loader
does; the activations are N(0, 1).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np

# name: (type, n_out, n_in)
SHAPES = {
    "q4k-1536": ("Q4_K", 1536, 1536),      # Qwen2.5-1.5B attn_q / attn_output
    "q4k-8960": ("Q4_K", 8960, 1536),      # its ffn_gate / ffn_up
    "q6k-head": ("Q6_K", 151936, 1536),    # its output head
    "q8_0-1536": ("Q8_0", 1536, 1536),
    "q4_0-1536": ("Q4_0", 1536, 1536),
    "q8_0-expert": ("Q8_0", 512, 1024),    # granite-1b-a400m: one expert's gate or up
}


def parse_rows(s):
    out = []
    for part in s.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def measure(shape, rows, min_s=0.25, isa=None):
    """{M: (cpu ms, wall ms)} per call: the best of 3 repeats of at least min_s CPU seconds each"""
    import cpufuse
    from .quant import make_raw
    qtype, n_out, n_in = SHAPES[shape]
    rng = np.random.default_rng(zlib.crc32(shape.encode()))
    w = cpufuse.QTensor(make_raw(qtype, n_out, n_in, rng), qtype, (n_out, n_in)).repack(isa=isa)
    x = rng.standard_normal((max(rows), n_in)).astype(np.float32)
    res = {}
    for m in rows:
        xm, out = x[:m], np.empty((m, n_out), np.float32)
        cpufuse.matmul(xm, w, out=out, n_threads=1, isa=isa)
        best = None
        for _ in range(3):
            n, c0, w0 = 0, time.process_time(), time.perf_counter()
            while True:
                cpufuse.matmul(xm, w, out=out, n_threads=1, isa=isa)
                n += 1
                c = time.process_time() - c0
                if c >= min_s:
                    break
            t = (1e3 * c / n, 1e3 * (time.perf_counter() - w0) / n)
            best = t if best is None or t[0] < best[0] else best
        res[m] = best
    return res


def measure_verify(path, rows, reps=3):
    """{M: (cpu ms, wall ms)}: the best of `reps` decoder calls of M tokens (M = 1: a decode step)"""
    from cpufuse.llama import Model
    from cpufuse.llama.speculative import rewind, verify
    m = Model.load(path, n_ctx=512, n_threads=1)
    toks = [100 + (7 * i) % 1000 for i in range(64)]
    res = {}
    with m._lock:
        m._eval(toks)
        base = m._n_past
        for M in rows:
            best = None
            for _ in range(reps + 1):  # the first call warms the plan up
                rewind(m, base)
                c0, w0 = time.process_time(), time.perf_counter()
                if M == 1:
                    m._eval([toks[-1]])
                else:
                    verify(m, [toks[-1]] * M)
                t = (1e3 * (time.process_time() - c0), 1e3 * (time.perf_counter() - w0))
                best = t if best is None or t[0] < best[0] else best
            res[M] = best
    return res


def run_ab(args, rest):
    per = {}  # (tree, shape, m) -> [cpu ms]
    for rnd in range(args.rounds):
        order = (args.ab[0], args.ab[1]) if rnd % 2 == 0 else (args.ab[1], args.ab[0])
        for tree in order:
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "r.json")
                tree_abs = os.path.abspath(tree)
                cmd = ["taskset", "-c", str(args.core), sys.executable, "-m", "bench.smallrows", "--json", out] + rest
                env = dict(os.environ, PYTHONPATH=tree_abs, OMP_NUM_THREADS="1")
                p = subprocess.run(cmd, cwd=tree_abs, env=env,
                                   capture_output=True, text=True)
                if p.returncode:
                    raise SystemExit(f"bench.smallrows failed with {tree}:\n{p.stderr[-2000:]}")
                with open(out) as f:
                    for shape, r in json.load(f).items():
                        for m, (c, _w) in r.items():
                            per.setdefault((tree, shape, int(m)), []).append(c)
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    base, head = args.ab
    shapes = sorted({k[1] for k in per}, key=lambda s: list(SHAPES).index(s) if s in SHAPES else -1)
    table = {}
    for s in shapes:
        ms = sorted({k[2] for k in per if k[1] == s})
        b1 = statistics.median(per[(base, s, 1)]) if (base, s, 1) in per else None
        h1 = statistics.median(per[(head, s, 1)]) if (head, s, 1) in per else None
        print(f"\n{s} {SHAPES.get(s, '')}: CPU ms per call, median of {args.rounds} rounds; x1: in one-row calls")
        print("| M | base ms | head ms | head/base | base x1 | head x1 |")
        print("|---:|---:|---:|---:|---:|---:|")
        for m in ms:
            b, h = statistics.median(per[(base, s, m)]), statistics.median(per[(head, s, m)])
            table.setdefault(s, {})[m] = (b, h)
            print(f"| {m} | {b:.3f} | {h:.3f} | {h / b:.2f} | {b / b1:.2f} | {h / h1:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({s: {str(m): v for m, v in t.items()} for s, t in table.items()}, f, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.smallrows", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default="1-16")
    ap.add_argument("--min-s", type=float, default=0.25)
    ap.add_argument("--json")
    ap.add_argument("--isa", help="the kernels' ISA (default: the best this CPU runs)")
    ap.add_argument("--ab", nargs=2, metavar=("BASE", "HEAD"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--verify", metavar="MODEL", help="time a model's verification calls of M tokens instead")
    args = ap.parse_args(argv)
    if args.ab:
        rest = ["--shapes", args.shapes, "--rows", args.rows, "--min-s", str(args.min_s)] + (
            ["--isa", args.isa] if args.isa else [])
        return run_ab(args, rest + (["--verify", os.path.abspath(args.verify)] if args.verify else []))
    rows = parse_rows(args.rows)
    out = {}
    if args.verify:
        r = measure_verify(args.verify, rows)
        out["verify"] = {str(m): v for m, v in r.items()}
        print("verify", " ".join(f"{m}:{v[0]:.1f}ms({v[0] / r[rows[0]][0]:.2f})" for m, v in r.items()), flush=True)
        args.shapes = ""
    for s in filter(None, args.shapes.split(",")):
        if s not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {s!r}; known: {', '.join(SHAPES)}")
        r = measure(s, rows, args.min_s, args.isa)
        out[s] = {str(m): v for m, v in r.items()}
        r1 = r[rows[0]][0]
        print(s, " ".join(f"{m}:{v[0]:.3f}ms({v[0] / r1:.2f})" for m, v in r.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
