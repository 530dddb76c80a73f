"""Fidelity of a quantized KV cache (issue 42 item 1): teacher-forced top-1 agreement and mean KL
divergence of the q8_0 / q4_0 cache against the f16 cache, at given contexts, in cpufuse or in
llama.cpp (llama-cpp-python) on the same token ids.

    python -m bench.e2e.kvfidelity --model qwen2.5-coder-1.5b --ctx 1024,4096,16384 -t 2 \\
        --types q8_0,f16/q4_0,q8_0/q4_0,q4_0 [--peer llama-cpp-python --peer-python VENV/bin/python]

The text (--text FILE; default: the repository's own Python sources, joined: code, as a coding
model reads it) is tokenized once by cpufuse; every engine gets the same ids. Each cache type is one
teacher-forced pass up to the largest context (the model's own next-token choices are never fed
back): for each context C, in increasing order, the tokens up to C - n_eval are evaluated without
logits, then the last n_eval with every position's logits. The logits of the smaller contexts are
those a separate pass of that length would give: the tokens before them are the same. Against the
SAME engine's f16 cache's logits at the same positions it reports the share of positions with the
same arg-max (top-1 agreement), mean KL(P_f16 || P_type) in nats (float64 softmax), and each type's
top-1 accuracy on the text.

--peer llama-cpp-python runs the passes in a child process of --peer-python (a Python with
llama_cpp installed) on llama.cpp with flash attention on (a quantized V needs it) and type_k /
type_v set; only the scored positions ask for logits (llama_decode with per-token logits flags),
so a 16k context does not allocate n_ctx x n_vocab floats."""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GGML_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}    # ggml's type ids (llama-cpp-python's type_k/type_v)
PEERS = ("llama-cpp-python",)


def default_text():
    parts = []
    for p in sorted(glob.glob(os.path.join(ROOT, "cpufuse", "**", "*.py"), recursive=True)):
        with open(p, encoding="utf-8") as f:
            parts.append(f"# file: {os.path.relpath(p, ROOT)}\n{f.read()}")
    return "\n\n".join(parts)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def compare(base, other, rows=256):
    """(top-1 agreement, mean KL(base || other)) of two (n, n_vocab) logits arrays, `rows` rows at a time
    (float64 temporaries of a few rows: 2048 scored positions of a 152k vocabulary stay a few MB)"""
    kl = np.empty(len(base))
    for s in range(0, len(base), rows):
        lp, lq = log_softmax(base[s:s + rows]), log_softmax(other[s:s + rows])
        kl[s:s + rows] = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    return float(np.mean(base.argmax(-1) == other.argmax(-1))), float(np.mean(kl))


def split_type(kv_type):
    """"T" (K and V) or "TK/TV" -> (TK, TV)"""
    tk, _, tv = kv_type.partition("/")
    return tk, tv or tk


def cpufuse_engine(path, n_ctx, kv_type, threads, n_batch):
    """(eval(tokens, logits) -> (len, n_vocab) float32 array or None, KV bytes at n_ctx) on cpufuse"""
    from cpufuse.llama.model import Model
    tk, tv = split_type(kv_type)
    m = Model.load(path, n_ctx=n_ctx, n_threads=threads, type_k=tk, type_v=tv, n_batch=n_batch)

    def run(tokens, logits):
        out = m.eval(tokens, logits_all=logits)
        return out if logits else None
    return run, m.kv_bytes


def llama_cpp_engine(path, n_ctx, kv_type, threads, n_batch):
    """the same on llama-cpp-python: llama_decode in micro-batches of n_batch, logits requested only
    for the scored tokens and read with llama_get_logits_ith"""
    import llama_cpp
    tk, tv = split_type(kv_type)
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                          n_threads_batch=threads, type_k=GGML_TYPE[tk], type_v=GGML_TYPE[tv], flash_attn=True,
                          logits_all=False, verbose=False)
    n_vocab = llm.n_vocab()
    state = {"n_past": 0}

    def run(tokens, logits):
        out = np.empty((len(tokens), n_vocab), np.float32) if logits else None
        for s in range(0, len(tokens), n_batch):
            chunk = tokens[s:s + n_batch]
            llm._batch.set_batch(chunk, state["n_past"], logits_all=logits)
            llm._ctx.decode(llm._batch)
            state["n_past"] += len(chunk)
            if logits:
                for i in range(len(chunk)):
                    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, i)
                    out[s + i] = np.ctypeslib.as_array(ptr, shape=(n_vocab,))
        return out
    run.llm = llm          # keeps the model alive as long as run
    return run, None


ENGINES = {"cpufuse": cpufuse_engine, "llama-cpp-python": llama_cpp_engine}


def teacher_forced(engine, path, ids, ctxs, n_eval, kv_type, threads, n_batch):
    """one pass of a kv_type cache up to max(ctxs): {C: logits (n_eval, n_vocab) of positions C - n_eval ..
    C - 1}, {C: (wall seconds, CPU seconds of this process) from the start to C}, the cache's bytes at
    max(ctxs) (None if unknown)"""
    run, kv_bytes = ENGINES[engine](path, max(ctxs), kv_type, threads, n_batch)
    out, secs, pos, t0, c0 = {}, {}, 0, time.perf_counter(), time.process_time()
    for C in ctxs:
        if C - n_eval > pos:
            run(ids[pos:C - n_eval], False)
        out[C] = run(ids[C - n_eval:C], True)
        pos, secs[C] = C, (time.perf_counter() - t0, time.process_time() - c0)
    return out, secs, kv_bytes


def score(engine, path, ids, ctxs, n_eval, types, threads, n_batch, log=print):
    """rows {ctx, type, top1_agree, kl, top1_acc, kv_bytes, s} of f16 and each type, in this process"""
    nmax = max(ctxs)
    acc = {C: (lambda lg, nxt=np.asarray(ids[C - n_eval + 1:C + 1]): float(np.mean(lg.argmax(-1)[:len(nxt)] == nxt)))
           for C in ctxs}
    base, secs, kvb = teacher_forced(engine, path, ids, ctxs, n_eval, "f16", threads, n_batch)
    rows = {C: [dict(ctx=C, type="f16", top1_agree=1.0, kl=0.0, top1_acc=acc[C](base[C]),
                     kv_bytes=kvb and kvb * C // nmax, s=secs[C][0], cpu_s=secs[C][1])] for C in ctxs}
    log(f"{engine} f16: {secs[nmax][0]:.0f} s ({secs[nmax][1]:.0f} CPU s)")
    for t in types:
        lg, secs, kvb = teacher_forced(engine, path, ids, ctxs, n_eval, t, threads, n_batch)
        for C in ctxs:
            agree, kl = compare(base[C], lg[C])
            rows[C].append(dict(ctx=C, type=t, top1_agree=agree, kl=kl, top1_acc=acc[C](lg[C]),
                                kv_bytes=kvb and kvb * C // nmax, s=secs[C][0], cpu_s=secs[C][1]))
        log(f"{engine} {t}: {secs[nmax][0]:.0f} s ({secs[nmax][1]:.0f} CPU s); " + ", ".join(
            f"ctx {r['ctx']}: agree {r['top1_agree']:.4f} KL {r['kl']:.6f} acc {r['top1_acc']:.4f}"
            for C in ctxs for r in rows[C][-1:]))
        del lg
    return [r for C in ctxs for r in rows[C]]


def worker(job):
    """the child process of --peer: the job file names the engine, the ids (.npy) and the arguments;
    the rows go to job's "out" file"""
    with open(job) as f:
        j = json.load(f)
    ids = np.load(j["ids"]).tolist()
    rows = score(j["engine"], j["path"], ids, j["ctxs"], j["n_eval"], j["types"], j["threads"], j["n_batch"],
                 log=lambda s: print(s, file=sys.stderr, flush=True))
    with open(j["out"], "w") as f:
        json.dump(rows, f)


def run_peer(peer, peer_python, path, ids, ctxs, n_eval, types, threads, n_batch):
    with tempfile.TemporaryDirectory(prefix="kvfidelity-") as d:
        np.save(os.path.join(d, "ids.npy"), np.asarray(ids, np.int32))
        job = os.path.join(d, "job.json")
        with open(job, "w") as f:
            json.dump(dict(engine=peer, path=path, ids=os.path.join(d, "ids.npy"), ctxs=ctxs, n_eval=n_eval,
                           types=types, threads=threads, n_batch=n_batch, out=os.path.join(d, "rows.json")), f)
        r = subprocess.run([peer_python, os.path.abspath(__file__), "--worker", job])
        if r.returncode:
            sys.exit(f"error: the {peer} worker ({peer_python}) exited with {r.returncode}")
        with open(os.path.join(d, "rows.json")) as f:
            return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a GGUF path or a model name (cpufuse.llama.hub)")
    ap.add_argument("--text", default=None, help="a UTF-8 text file (default: the repository's Python sources)")
    ap.add_argument("--ctx", default="1024,4096,16384", help="contexts in tokens, comma-separated")
    ap.add_argument("--n-eval", type=int, default=128, help="positions scored at the end of each context")
    ap.add_argument("--types", default="q8_0,f16/q4_0,q8_0/q4_0,q4_0",
                    help="cache types compared against f16: T (K and V) or TK/TV")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--peer", choices=PEERS, default=None, help="measure this engine instead of cpufuse")
    ap.add_argument("--peer-python", default=sys.executable,
                    help="the Python that runs --peer (one with llama_cpp installed; default: this one)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    a = ap.parse_args(argv)
    from cpufuse.llama import hub
    from cpufuse.llama.tokenizer import Tokenizer
    path = hub.resolve(a.model)
    ctxs = sorted({int(c) for c in a.ctx.split(",")})
    types = [t.strip() for t in a.types.split(",") if t.strip()]
    for t in types:
        for half in split_type(t):
            if half not in GGML_TYPE:
                sys.exit(f"error: --types: {half!r} is not one of {', '.join(GGML_TYPE)}")
    gaps = [c - p for p, c in zip([0] + ctxs, ctxs)]
    if not 0 < a.n_eval <= min(gaps) - 1:
        sys.exit(f"error: --n-eval must be in [1, {min(gaps) - 1}] (below each context and each gap between "
                 f"contexts), got {a.n_eval}")
    text = open(a.text, encoding="utf-8").read() if a.text else default_text()
    ids = Tokenizer.from_gguf(path).encode(text)
    if len(ids) < max(ctxs) + 1:
        sys.exit(f"error: the text has {len(ids)} tokens, fewer than --ctx {max(ctxs)} + 1")
    engine = a.peer or "cpufuse"
    threads = a.threads
    if a.peer and threads is None:
        threads = os.cpu_count()
    print(f"{engine} on {os.path.basename(path)}: {len(ids)} tokens of text, last {a.n_eval} positions of each "
          f"context scored, threads {threads or 'default'}", flush=True)
    t0 = time.perf_counter()
    if a.peer:
        rows = run_peer(a.peer, a.peer_python, path, ids, ctxs, a.n_eval, types, threads, a.n_batch)
    else:
        rows = score(engine, path, ids, ctxs, a.n_eval, types, threads, a.n_batch)
    print(f"{'ctx':>6} {'type':>11} {'top-1 agree':>11} {'mean KL':>10} {'top-1 acc':>9} {'KV MiB':>8} {'s':>7} {'CPU s':>7}")
    for r in rows:
        kv = "-" if r["kv_bytes"] is None else f"{r['kv_bytes'] / 2**20:.1f}"
        print(f"{r['ctx']:>6} {r['type']:>11} {r['top1_agree']:>11.4f} {r['kl']:>10.6f} {r['top1_acc']:>9.4f} "
              f"{kv:>8} {r['s']:>7.1f} {r.get('cpu_s', float('nan')):>7.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"engine": engine, "model": os.path.basename(path), "n_eval": a.n_eval, "threads": threads,
                       "n_batch": a.n_batch, "text_tokens": len(ids), "wall_s": time.perf_counter() - t0,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
    else:
        main()
