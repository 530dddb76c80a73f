"""Speculative decoding in cpufuse.llama: accepted-token rate and decode speedup on code-editing
prompts (the answer repeats much of the prompt) and on plain chat, greedy, against plain decoding
of the same model in the same run; each speculative output is checked to be the plain one token
for token (bench/README.md, "bench.e2e.spec").

    python -m bench.e2e.spec --model qwen2.5-coder-1.5b --threads 1,16 --lookup 10
    python -m bench.e2e.spec --model M.gguf --draft SMALL.gguf --draft-max 16
    python -m bench.e2e.spec --model tiny.gguf --n-predict 32      # a sanity run

The llama.cpp comparison (llama-server --lookup / --model-draft on the same prompts) is not run
here; measure it in the same session when reporting a speedup against it.
"""
import argparse
import json
import os
import sys
import time

CODE = '''def mean(xs):
    total = 0
    for x in xs:
        total = total + x
    return total / len(xs)


def variance(xs):
    m = mean(xs)
    total = 0
    for x in xs:
        total = total + (x - m) ** 2
    return total / len(xs)
'''

CODE_PROMPTS = [
    "Rename the variable `total` to `acc` everywhere in this Python code. Reply with the whole code only.\n\n" + CODE,
    "Add type hints (list[float] -> float) to both functions in this code. Reply with the whole code only.\n\n"
    + CODE,
    "Add a docstring to each function of this code, changing nothing else. Reply with the whole code only.\n\n"
    + CODE,
]
CHAT_PROMPTS = [
    "What is the capital of France? Answer in two sentences.",
    "Write a short poem about the sea.",
    "Give me three tips for learning to cook.",
]


def _prompt(model, text):
    if getattr(model.tokenizer, "chat_template", None):
        return [{"role": "user", "content": text}]
    return text


def run_one(model, draft, text, n_predict):
    p = _prompt(model, text)
    model.reset()
    a = model.generate(p, max_tokens=n_predict, temperature=0, reuse_cache=False)
    model.reset()
    b = model.generate(p, max_tokens=n_predict, temperature=0, reuse_cache=False, draft=draft)
    if a.tokens != b.tokens:
        raise AssertionError(f"speculative output differs from plain decoding on {text[:40]!r}")
    return {"tokens": len(a.tokens), "plain_s": a.decode_time, "spec_s": b.decode_time,
            "drafted": b.draft_tokens, "accepted": b.draft_accepted, "decode_steps": a.decode_tokens}


def summary(rows):
    n = sum(r["decode_steps"] for r in rows)
    ps, ss = sum(r["plain_s"] for r in rows), sum(r["spec_s"] for r in rows)
    d, acc = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
    return {"tokens": n, "plain_tps": n / ps if ps else float("nan"), "spec_tps": n / ss if ss else float("nan"),
            "speedup": ps / ss if ss else float("nan"), "drafted": d, "accepted": acc,
            "accept_rate": acc / d if d else float("nan")}


def main(argv=None):
    from cpufuse.llama import Model, hub
    from cpufuse.llama.speculative import DraftModel, LlamaPromptLookupDecoding
    ap = argparse.ArgumentParser(prog="python -m bench.e2e.spec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF path or a model name")
    ap.add_argument("--threads", default="1", help="comma-separated thread counts (default 1)")
    ap.add_argument("--lookup", type=int, default=10, help="prompt lookup: tokens drafted per step (default 10)")
    ap.add_argument("--ngram", type=int, default=3, help="prompt lookup: the longest n-gram matched (default 3)")
    ap.add_argument("--draft", default=None, help="a draft model instead of prompt lookup")
    ap.add_argument("--draft-max", type=int, default=16)
    ap.add_argument("--draft-p-min", type=float, default=0.75)
    ap.add_argument("--n-predict", type=int, default=256)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    path = hub.resolve(args.model)
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
            how = f"lookup {args.lookup} (n-gram <= {args.ngram})"
        run_one(m, draft, CHAT_PROMPTS[0], 8)          # warm-up: the plans compile
        for kind, prompts in (("code-editing", CODE_PROMPTS), ("chat", CHAT_PROMPTS)):
            t0 = time.perf_counter()
            s = summary([run_one(m, draft, p, args.n_predict) for p in prompts])
            s.update(threads=nt, prompts=kind, how=how, wall_s=time.perf_counter() - t0)
            res["runs"].append(s)
            print(f"{res['model']} t={nt} {kind:12s} {how}: {s['tokens']} tokens, plain {s['plain_tps']:.1f} tok/s, "
                  f"speculative {s['spec_tps']:.1f} tok/s ({s['speedup']:.2f}x), accepted {s['accepted']}/"
                  f"{s['drafted']} drafted ({100 * s['accept_rate']:.0f}%)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
