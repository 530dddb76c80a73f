"""Fidelity of a quantized KV cache (issue 42 item 1): teacher-forced top-1 agreement and mean KL
divergence of the q8_0 / q4_0 cache against the f16 cache, at given contexts.

    python -m bench.e2e.kvfidelity --model qwen2.5-coder-1.5b --ctx 4096,16384 --types q8_0,q4_0 -t 16

For each context C the text's first C tokens are fed to each cache type: the first C - n_eval
untimed, then the last n_eval with every position's logits (teacher forcing: the text's own next
tokens, never the model's). Against the f16 cache's logits at the same positions it reports the share
of positions with the same arg-max (top-1 agreement), mean KL(P_f16 || P_type) in nats (float64
softmax), and each type's top-1 accuracy on the text. --text FILE (default: the repository's own
Python sources, joined: code, as a coding model reads it)."""
import argparse
import glob
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def compare(base, other):
    """(top-1 agreement, mean KL(base || other)) of two (n, n_vocab) logits arrays"""
    lp, lq = log_softmax(base), log_softmax(other)
    kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    return float(np.mean(base.argmax(-1) == other.argmax(-1))), float(np.mean(kl))


def teacher_forced(path, ids, ctx, n_eval, kv_type, threads, n_batch):
    """logits (n_eval, n_vocab) of positions ctx - n_eval .. ctx - 1 with a kv_type cache ("T" for K and V,
    or "TK/TV"), the seconds it took and the cache's bytes"""
    from cpufuse.llama.model import Model
    tk, _, tv = kv_type.partition("/")
    m = Model.load(path, n_ctx=ctx, n_threads=threads, type_k=tk, type_v=tv or tk, n_batch=n_batch)
    t0 = time.perf_counter()
    m.eval(ids[:ctx - n_eval])
    out = m.eval(ids[ctx - n_eval:ctx], logits_all=True)
    return out, time.perf_counter() - t0, m.kv_bytes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a GGUF path or a model name (cpufuse.llama.hub)")
    ap.add_argument("--text", default=None, help="a UTF-8 text file (default: the repository's Python sources)")
    ap.add_argument("--ctx", default="4096,16384", help="contexts in tokens, comma-separated")
    ap.add_argument("--n-eval", type=int, default=256, help="positions scored at the end of each context")
    ap.add_argument("--types", default="q8_0,q4_0", help="cache types compared against f16: T (K and V) or TK/TV")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    a = ap.parse_args(argv)
    from cpufuse.llama import hub
    from cpufuse.llama.model import Model
    path = hub.resolve(a.model)
    ctxs = [int(c) for c in a.ctx.split(",")]
    types = [t.strip() for t in a.types.split(",") if t.strip()]
    text = open(a.text, encoding="utf-8").read() if a.text else default_text()
    tok = Model.load(path, n_ctx=8).tokenizer
    ids = tok.encode(text)
    if len(ids) < max(ctxs):
        sys.exit(f"error: the text has {len(ids)} tokens, fewer than --ctx {max(ctxs)}")
    if not 0 < a.n_eval < min(ctxs):
        sys.exit(f"error: --n-eval must be in [1, {min(ctxs) - 1}], got {a.n_eval}")
    rows = []
    print(f"{os.path.basename(path)}: {len(ids)} tokens of text, last {a.n_eval} positions of each context scored, "
          f"threads {a.threads or 'default'}")
    print(f"{'ctx':>6} {'type':>9} {'top-1 agree':>11} {'mean KL':>10} {'top-1 acc':>9} {'KV MiB':>8} {'s':>7}")
    for C in ctxs:
        base, dt, kvb = teacher_forced(path, ids, C, a.n_eval, "f16", a.threads, a.n_batch)
        nxt = np.asarray(ids[C - a.n_eval + 1:C + 1])
        acc = lambda lg: float(np.mean(lg.argmax(-1)[:len(nxt)] == nxt))   # noqa: E731
        rows.append({"ctx": C, "type": "f16", "top1_agree": 1.0, "kl": 0.0, "top1_acc": acc(base),
                     "kv_bytes": kvb, "s": dt})
        for t in types:
            lg, dt, kvb = teacher_forced(path, ids, C, a.n_eval, t, a.threads, a.n_batch)
            agree, kl = compare(base, lg)
            rows.append({"ctx": C, "type": t, "top1_agree": agree, "kl": kl, "top1_acc": acc(lg), "kv_bytes": kvb,
                         "s": dt})
        for r in rows[-1 - len(types):]:
            print(f"{r['ctx']:>6} {r['type']:>9} {r['top1_agree']:>11.4f} {r['kl']:>10.6f} {r['top1_acc']:>9.4f} "
                  f"{r['kv_bytes'] / 2**20:>8.1f} {r['s']:>7.1f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": os.path.basename(path), "n_eval": a.n_eval, "threads": a.threads, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
