"""Speculative decoding in cpufuse.llama: accepted-token rate, tokens per verification and decode
speedup on code-editing prompts (the answer repeats much of the prompt) and on plain chat, greedy,
against plain decoding of the same model in the same run; each speculative output is checked to be
the plain one token for token (bench/README.md, "bench.e2e.spec").

    python -m bench.e2e.spec --model qwen2.5-coder-1.5b --threads 1,2 --lookup 15 --peer .venv-llama/bin/python
    python -m bench.e2e.spec --model M.gguf --draft SMALL.gguf --draft-max 16
    python -m bench.e2e.spec --model tiny.gguf --n-predict 32      # a sanity run

--peer PYTHON runs llama-cpp-python (bench/e2e/spec_peer.py, in its own process, after cpufuse's
prompts of each kind) on the same token ids: plain greedy decoding, then its Python prompt lookup
(llama_cpp.llama_speculative.LlamaPromptLookupDecoding with the same --lookup and --ngram).

--peer-llama-server PATH runs llama.cpp's llama-server (bench/e2e/spec_server.py): a plain server and
one with --peer-llama-server-spec (default: its n-gram speculation, `--spec-type ngram-simple
--spec-draft-n-max 64`, no draft model), on the same token ids, each prompt right after cpufuse's,
in the opposite order. --rounds R repeats every prompt R times, alternating which goes first.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CODE = '''import json
import os


class Inventory:
    def __init__(self, path):
        self.path = path
        self.items = {}
        if os.path.exists(path):
            with open(path) as f:
                self.items = json.load(f)

    def add(self, name, count, price):
        if count <= 0:
            raise ValueError("count must be positive")
        item = self.items.get(name)
        if item is None:
            self.items[name] = {"count": count, "price": price}
        else:
            item["count"] = item["count"] + count
            item["price"] = price

    def remove(self, name, count):
        item = self.items.get(name)
        if item is None or item["count"] < count:
            raise KeyError(name)
        item["count"] = item["count"] - count
        if item["count"] == 0:
            del self.items[name]

    def total_value(self):
        total = 0
        for name in self.items:
            item = self.items[name]
            total = total + item["count"] * item["price"]
        return total

    def cheapest(self, n):
        names = sorted(self.items, key=lambda name: self.items[name]["price"])
        return names[:n]

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.items, f, indent=2)


def load_prices(path):
    prices = {}
    with open(path) as f:
        for line in f:
            name, price = line.strip().split(",")
            prices[name] = float(price)
    return prices


def update_prices(inventory, prices):
    changed = 0
    for name in prices:
        if name in inventory.items:
            inventory.items[name]["price"] = prices[name]
            changed = changed + 1
    return changed
'''

EDIT = " Reply with the whole code only.\n\n"
CODE_PROMPTS = [
    "Rename the variable `item` to `entry` everywhere in this Python code." + EDIT + CODE,
    "Add type hints to every function and method of this Python code." + EDIT + CODE,
    "Add a one-line docstring to every function and method of this Python code, changing nothing else." + EDIT + CODE,
    "Use augmented assignment (such as `x += y`) wherever this Python code can, changing nothing else." + EDIT + CODE,
]
CHAT_PROMPTS = [
    "What is the capital of France? Answer in two sentences.",
    "Write a short poem about the sea.",
    "Give me three tips for learning to cook.",
]
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spec_peer.py")


def _prompt(model, text):
    if getattr(model.tokenizer, "chat_template", None):
        return [{"role": "user", "content": text}]
    return text


def _timed(model, p, n_predict, draft):
    """generate after the prompt is cached (only its last token is evaluated again): the result
    and the CPU seconds of the call (this process: every thread)"""
    c0 = time.process_time()
    r = model.generate(p, max_tokens=n_predict, temperature=0, reuse_cache=True, draft=draft)
    return r, time.process_time() - c0


def run_one(model, draft, text, n_predict, spec_first):
    """plain and speculative decoding of one prompt, in the order spec_first says (alternated by
    the caller), after one evaluation of the prompt"""
    p = _prompt(model, text)
    model.reset()
    model.generate(p, max_tokens=1, temperature=0, reuse_cache=False)
    got = {}
    for how in (("spec", "plain") if spec_first else ("plain", "spec")):
        got[how] = _timed(model, p, n_predict, draft if how == "spec" else None)
    (a, ca), (b, cb) = got["plain"], got["spec"]
    if a.tokens != b.tokens:
        raise AssertionError(f"speculative output differs from plain decoding on {text[:40]!r}")
    tr = trace(draft, model, model.prompt_ids(p), a, n_predict)
    if (sum(k for k, _ in tr), sum(x for _, x in tr)) != (b.draft_tokens, b.draft_accepted):
        print(f"warning: the trace of {text[:40]!r} does not add up to the run's counts", flush=True)
    return {"trace": tr, "tokens": len(a.tokens), "plain_s": a.decode_time, "spec_s": b.decode_time, "plain_cpu": ca,
            "spec_cpu": cb, "drafted": b.draft_tokens, "accepted": b.draft_accepted, "verify_steps": b.draft_steps,
            "decode_steps": a.decode_tokens, "ids": model.prompt_ids(p), "out": a.tokens}


def trace(draft, model, ids, res, max_tokens):
    """the (drafted, accepted) count of every decoder call of a speculative generation, replayed
    from the plain one's tokens (the same loop as cpufuse.llama.generate.decode: the outputs are
    the same, so the drafts are too; the caller checks the totals against the run's)"""
    from cpufuse.llama.speculative import draft_ids, next_cap
    seq = list(res.tokens) + ([res.stop_token] if res.stop_token is not None else [])
    steps, cap, i = [], 1 << 30, 0
    while i < res.decode_tokens:
        lim = min(cap, max_tokens - 2 - i, model.n_ctx - len(ids) - i - 1, model.n_batch - 1)
        d = draft_ids(draft, ids + seq[:i + 1], lim, model.n_vocab)
        a = 0
        while a < len(d) and i + 1 + a < len(seq) and d[a] == seq[i + 1 + a]:
            a += 1
        steps.append((len(d), a))
        cap = next_cap(cap, len(d), a)
        i += a + 1
    return steps


def replay(args, path, traces):
    """--replay: the decoder calls of recorded traces (trace()) on `path` (a file of the same
    shapes, e.g. random weights: only the time is measured), against as many plain decode steps,
    alternated; a greedy sample of every row used, as the real loop"""
    import numpy as np
    from cpufuse.llama import Model
    from cpufuse.llama.sampling import Sampler
    from cpufuse.llama.speculative import rewind, verify
    res = {"model": os.path.basename(path), "replayed": args.replay, "runs": []}
    for nt in [int(t) for t in args.threads.split(",")]:
        m = Model.load(path, n_ctx=args.n_ctx, n_threads=nt)
        smp = Sampler(temperature=0)
        rng = np.random.default_rng(0)
        for kind in dict.fromkeys(t["kind"] for t in traces):
            tp = ts = cp = cs = 0.0
            n = calls = 0
            for j, t in enumerate(x for x in traces if x["kind"] == kind):
                m.reset()
                toks = [int(v) for v in rng.integers(10, m.n_vocab - 10, t["prompt"] + 1)]
                with m._lock:
                    m._eval(toks[:-1])
                    base = m._n_past
                    for how in (("spec", "plain") if j % 2 else ("plain", "spec")):
                        rewind(m, base)
                        t0, c0 = time.perf_counter(), time.process_time()
                        steps = [(0, 0)] * t["decode_steps"] if how == "plain" else t["steps"]
                        for k, a in steps:
                            rows = m._eval([toks[-1]])[None] if k == 0 else verify(m, [toks[-1]] * (k + 1))
                            for r in range(a + 1):
                                smp.sample(rows[r])
                            rewind(m, m._n_past - k + a)
                        dt, dc = time.perf_counter() - t0, time.process_time() - c0
                        if how == "plain":
                            tp, cp = tp + dt, cp + dc
                        else:
                            ts, cs = ts + dt, cs + dc
                n += t["decode_steps"]
                calls += len(t["steps"])
            s = {"threads": nt, "prompts": kind, "tokens": n, "calls": calls, "plain_tps": n / tp, "spec_tps": n / ts,
                 "speedup": tp / ts, "speedup_cpu": cp / cs}
            res["runs"].append(s)
            print(f"{res['model']} t={nt} {kind:12s} replay of {args.replay}: {n} tokens in {calls} calls, plain "
                  f"{s['plain_tps']:.1f} tok/s, speculative {s['spec_tps']:.1f} tok/s ({s['speedup']:.2f}x wall, "
                  f"{s['speedup_cpu']:.2f}x CPU s)", flush=True)
    return res


def summary(rows):
    n = sum(r["decode_steps"] for r in rows)
    S = {k: sum(r[k] for r in rows) for k in ("plain_s", "spec_s", "plain_cpu", "spec_cpu", "drafted", "accepted",
                                              "verify_steps")}
    d, acc, v = S["drafted"], S["accepted"], S["verify_steps"]
    nan = float("nan")
    return {"tokens": n, "plain_tps": n / S["plain_s"], "spec_tps": n / S["spec_s"],
            "speedup": S["plain_s"] / S["spec_s"], "speedup_cpu": S["plain_cpu"] / S["spec_cpu"],
            "drafted": d, "accepted": acc, "accept_rate": acc / d if d else nan, "verify_steps": v,
            "tokens_per_verify": (acc + v) / v if v else nan, "calls": n - acc}


def peer(python, path, nt, args, rows, eog):
    """llama-cpp-python's plain and lookup decoding of the same prompt ids (spec_peer.py)"""
    job = {"model": path, "threads": nt, "lookup": args.lookup, "ngram": args.ngram or 2, "max_tokens": args.n_predict,
           "n_ctx": args.n_ctx, "eog": sorted(eog), "prompts": [r["ids"] for r in rows]}
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "job.json"), "w") as f:
            json.dump(job, f)
        subprocess.run([python, PEER, os.path.join(d, "job.json"), os.path.join(d, "out.json")], check=True)
        with open(os.path.join(d, "out.json")) as f:
            res = json.load(f)
    t = {h: sum(len(x[h]["tokens"]) - 1 for x in res) for h in ("plain", "lookup")}
    s = {h: sum(x[h]["wall_s"] for x in res) for h in ("plain", "lookup")}
    c = {h: sum(x[h]["cpu_s"] for x in res) for h in ("plain", "lookup")}
    return {"plain_tps": t["plain"] / s["plain"], "spec_tps": t["lookup"] / s["lookup"],
            "speedup": (t["lookup"] / s["lookup"]) / (t["plain"] / s["plain"]),
            "speedup_cpu": (t["lookup"] / c["lookup"]) / (t["plain"] / c["plain"]),
            "same_as_its_plain": sum(x["plain"]["tokens"] == x["lookup"]["tokens"] for x in res),
            "same_as_cpufuse": sum(x["plain"]["tokens"] == r["out"] for x, r in zip(res, rows)), "prompts": len(res)}


def markdown(res):
    L = ["| threads | prompts | tokens | accepted / drafted | tokens per verification | decoder calls | "
         "plain tok/s | speculative tok/s | speedup (wall) | speedup (CPU s) | peer | peer plain / speculative tok/s | "
         "its speedup (wall) | its speedup (CPU s) | its accepted / drafted | its speculative tokens = its plain |",
         "|" + "---|" * 16]
    for s in res["runs"]:
        peers = [(n, s[k]) for n, k in (("llama-cpp-python lookup", "peer"), ("llama-server", "peer_server")) if k in s]
        for n, p in peers or [("–", None)]:
            pc = (f"{n} | {p['plain_tps']:.1f} / {p['spec_tps']:.1f} | {p['speedup']:.2f}x | {p['speedup_cpu']:.2f}x | "
                  + (f"{p['accepted']} / {p['drafted']} | " if "drafted" in p else "– | ")
                  + f"{p['same_as_its_plain']}/{p['prompts']}" if p else "– | – | – | – | – | –")
            L.append(f"| {s['threads']} | {s['prompts']} | {s['tokens']} | {s['accepted']} / {s['drafted']} "
                     f"({100 * s['accept_rate']:.0f}%) | {s['tokens_per_verify']:.2f} | {s['calls']} | "
                     f"{s['plain_tps']:.1f} | {s['spec_tps']:.1f} | {s['speedup']:.2f}x | {s['speedup_cpu']:.2f}x | {pc} |")
    return "\n".join(L) + "\n"


def main(argv=None):
    from cpufuse.llama import Model, hub
    from cpufuse.llama.speculative import DraftModel, LlamaPromptLookupDecoding
    ap = argparse.ArgumentParser(prog="python -m bench.e2e.spec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF path or a model name")
    ap.add_argument("--threads", default="1", help="comma-separated thread counts (default 1)")
    ap.add_argument("--lookup", type=int, default=15, help="prompt lookup: the most tokens drafted per step (default 15)")
    ap.add_argument("--ngram", type=int, default=None,
                    help="prompt lookup: max_ngram_size, llama-cpp-python's rule (default: cpufuse's adaptive match; "
                         "the llama-cpp-python peer then uses 2)")
    ap.add_argument("--draft", default=None, help="a draft model instead of prompt lookup")
    ap.add_argument("--draft-max", type=int, default=16)
    ap.add_argument("--draft-p-min", type=float, default=0.75)
    ap.add_argument("--n-predict", type=int, default=256)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--kinds", default="code-editing,chat", help="which prompt sets (default code-editing,chat)")
    ap.add_argument("--peer", default=None, help="llama-cpp-python's python (e.g. .venv-llama/bin/python): its "
                                                 "plain and prompt-lookup decoding on the same prompts")
    ap.add_argument("--peer-llama-server", default=None, metavar="PATH",
                    help="llama.cpp's llama-server binary: its plain and speculative decoding of the same prompt ids")
    ap.add_argument("--peer-llama-server-spec", default=None, metavar="ARGS",
                    help="llama-server's speculation arguments (default: '--spec-type ngram-simple --spec-draft-n-max 64')")
    ap.add_argument("--peer-log-dir", default=None, help="write the llama-server logs here")
    ap.add_argument("--rounds", type=int, default=1, help="run every prompt this many times, alternating the order")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--md", default=None, help="write the table as markdown here")
    ap.add_argument("--replay", default=None, help="an --out JSON: time its traces' decoder calls on --model "
                                                   "(same shapes; random weights do) instead of generating")
    args = ap.parse_args(argv)
    path = hub.resolve(args.model)
    if args.replay:
        with open(args.replay) as f:
            traces = [t for r in json.load(f)["runs"] for t in r.get("traces", [])]
        if not traces:
            ap.error(f"--replay: {args.replay} holds no traces (write one with --out)")
        res = replay(args, path, traces)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    sets = {"code-editing": CODE_PROMPTS, "chat": CHAT_PROMPTS}
    kinds = args.kinds.split(",")
    if any(k not in sets for k in kinds):
        ap.error(f"--kinds: expected a comma-separated subset of {sorted(sets)}, got {args.kinds!r}")
    res = {"model": os.path.basename(path), "n_predict": args.n_predict, "runs": []}
    for nt in [int(t) for t in args.threads.split(",")]:
        m = Model.load(path, n_ctx=args.n_ctx, n_threads=nt)
        if args.draft:
            draft = DraftModel(hub.resolve(args.draft), num_pred_tokens=args.draft_max, p_min=args.draft_p_min,
                               n_ctx=args.n_ctx, n_threads=nt)
            draft.bind(m)                              # loads it and checks its vocabulary
            how = f"draft {os.path.basename(draft.model.path)} max {args.draft_max}"
        else:
            draft = LlamaPromptLookupDecoding(max_ngram_size=args.ngram, num_pred_tokens=args.lookup)
            how = f"lookup {args.lookup}"
        run_one(m, draft, CHAT_PROMPTS[0], 8, False)          # warm-up: the plans compile
        srv = None
        if args.peer_llama_server:
            import signal

            from .spec_server import DEFAULT_SPEC, ServerPeer
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # so `finally` stops the servers
            srv = ServerPeer(args.peer_llama_server, path, nt, args.n_ctx, args.peer_llama_server_spec or DEFAULT_SPEC,
                             log_dir=args.peer_log_dir)
        try:
            for kind in kinds:
                run_kind(args, res, path, m, draft, how, nt, kind, sets[kind], srv)
        finally:
            if srv is not None:
                srv.close()
    print(markdown(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(res))
    return 0


def run_kind(args, res, path, m, draft, how, nt, kind, prompts, srv):
    """every prompt of one kind, --rounds times; cpufuse's plain and speculative runs, then
    llama-server's (srv, if any) in the opposite order; the totals go into res["runs"]"""
    from . import spec_server
    t0 = time.perf_counter()
    rows, srows = [], []
    for rnd in range(max(1, args.rounds)):
        for i, p in enumerate(prompts):
            first = (i + rnd) % 2 == 1
            rows.append(run_one(m, draft, p, args.n_predict, first))
            if srv is not None:
                srows.append(srv.run(rows[-1]["ids"], args.n_predict, not first))
    s = summary(rows)
    s.update(threads=nt, prompts=kind, how=how, wall_s=time.perf_counter() - t0, rounds=max(1, args.rounds),
             traces=[{"kind": kind, "prompt": len(r["ids"]), "decode_steps": r["decode_steps"],
                      "steps": r["trace"]} for r in rows[:len(prompts)]])
    print(f"{res['model']} t={nt} {kind:12s} {how}: {s['tokens']} tokens, plain {s['plain_tps']:.1f} tok/s, "
          f"speculative {s['spec_tps']:.1f} tok/s ({s['speedup']:.2f}x wall, {s['speedup_cpu']:.2f}x CPU s), "
          f"accepted {s['accepted']}/{s['drafted']} drafted ({100 * s['accept_rate']:.0f}%), "
          f"{s['tokens_per_verify']:.2f} tokens per verification", flush=True)
    if srv is not None:
        s["peer_server"] = p = spec_server.summary(srows, [r["out"] for r in rows], m.eog_ids)
        s["peer_server"]["args"] = srv.spec_args
        print(f"  llama-server t={nt} {kind} ({srv.spec_args}): plain {p['plain_tps']:.1f} tok/s, speculative "
              f"{p['spec_tps']:.1f} tok/s ({p['speedup']:.2f}x wall, {p['speedup_cpu']:.2f}x CPU s), accepted "
              f"{p['accepted']}/{p['drafted']}; its speculative output = its plain on {p['same_as_its_plain']}/"
              f"{p['prompts']}, its plain = cpufuse's on {p['same_as_cpufuse']}/{p['prompts']}", flush=True)
    if args.peer and not args.draft:
        try:
            s["peer"] = p = peer(args.peer, path, nt, args, rows[:len(prompts)], m.eog_ids)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"  llama-cpp-python t={nt} {kind}: failed ({e}); its columns are left out", flush=True)
        else:
            print(f"  llama-cpp-python t={nt} {kind}: plain {p['plain_tps']:.1f} tok/s, lookup {p['spec_tps']:.1f} "
                  f"tok/s ({p['speedup']:.2f}x wall, {p['speedup_cpu']:.2f}x CPU s); its lookup output = its plain "
                  f"on {p['same_as_its_plain']}/{p['prompts']}, its plain = cpufuse's on "
                  f"{p['same_as_cpufuse']}/{p['prompts']}", flush=True)
    res["runs"].append(s)


if __name__ == "__main__":
    sys.exit(main())
