"""Batched decode: NSEQ sequences of CTX cached tokens each, one Batch a step (each sequence one token),
as the server's continuous batching runs them; tok/s over STEPS steps and the step's ATTN_SEQS µs
(cf_pool_profile), in one process per (tree, round), trees alternating (the order reversed every other round). The logits' hash shows the
trees give the same bits.
Usage: python batch_dec.py MODEL THREADS NSEQ CTX STEPS ROUNDS TREE [TREE ...]"""
import hashlib, os, subprocess, sys, time
import numpy as np


def child(model, nth, nseq, ctx, steps):
    from cpufuse import _backend
    from cpufuse.graph.kinds import RECORDS
    from cpufuse.llama.decoder import Batch
    from cpufuse.llama.model import Model
    ffi, lib = _backend.ffi, _backend.lib
    m = Model.load(model, n_ctx=ctx + steps + 8, n_seq=nseq, n_batch=64, n_threads=nth)
    toks = [int(t) for t in np.random.default_rng(0).integers(10, 20000, size=ctx + steps + nseq + 8)]
    cap = (64, nseq, nseq)
    for s in range(nseq):
        for i in range(0, ctx, 64):
            b = Batch(m)
            b.add(s, toks[i + s:i + s + min(64, ctx - i)], i)
            b.run(m.decoder, cap, n_threads=nth)
    h = hashlib.sha1()

    def step(j):
        b = Batch(m)
        for s in range(nseq):
            b.add(s, [toks[ctx + j + s]], ctx + j)
        return b.run(m.decoder, cap, n_threads=nth)
    h.update(step(0).tobytes())
    out = ffi.new("uint64_t[67]")
    attn = next(r.op for r in RECORDS if r.name == "ATTN_SEQS")
    lib.cf_pool_profile(1, ffi.NULL)
    t0 = time.perf_counter()
    for j in range(1, steps + 1):
        h.update(step(j).tobytes())
    dt = time.perf_counter() - t0
    lib.cf_pool_profile(0, out)
    print(f"{nseq * steps / dt:.1f} {int(out[3 + attn]) / steps / 1e3:.1f} {dt / steps * 1e3:.2f} {h.hexdigest()[:16]}")


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(sys.argv[2], *map(int, sys.argv[3:7]))
        sys.exit()
    model, nth, nseq, ctx, steps, rounds = sys.argv[1], *sys.argv[2:7]
    trees = sys.argv[7:]
    res = {t: [] for t in trees}
    for r in range(int(rounds)):
        for t in (trees if r % 2 == 0 else trees[::-1]):   # the order turns each round
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in ("/tmp/site", os.path.abspath(t)) if p))
            o = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model, nth, nseq, ctx, steps],
                               capture_output=True, text=True, env=env, cwd=t)
            line = o.stdout.strip().splitlines()[-1] if o.stdout.strip() else "ERR " + o.stderr[-300:]
            res[t].append(line)
            print(f"round {r} {t}: {line}", flush=True)
    print(f"# {nth} threads, {nseq} sequences at {ctx} cells, {steps} steps; tok/s, ATTN_SEQS µs a step, ms a step, hash")
    for t in trees:
        v = [x.split() for x in res[t] if not x.startswith("ERR")]
        if v:
            print(t, "median tok/s", np.median([float(x[0]) for x in v]), "attn µs", np.median([float(x[1]) for x in v]),
                  "hashes", sorted({x[3] for x in v}))
