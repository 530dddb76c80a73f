"""cpufuse's embeddings against llama.cpp's for the same model, texts and pooling: the cosine of each pair.

    .venv-llama/bin/python bench/e2e/emb_peer.py MODEL.gguf /tmp/emb.json
    .venv/bin/python bench/e2e/emb_compare.py MODEL.gguf /tmp/emb.json
"""
import json, sys
import numpy as np
from cpufuse.llama import Llama
path, ref = sys.argv[1], json.load(open(sys.argv[2]))
for pool in ("mean", "last", "cls"):
    llm = Llama(path, embedding=True, pooling_type=pool, n_ctx=256, n_threads=1, verbose=False)
    for t, r in zip(ref["texts"], ref["emb"][pool]):
        a = np.asarray(llm.embed(t, normalize=False), np.float64).ravel(); b = np.asarray(r, np.float64).ravel()
        print(pool, repr(t[:24]), "cos", round(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)), 6), "dim", a.size, b.size)
