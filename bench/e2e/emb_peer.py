"""llama.cpp's side of bench/e2e/emb_compare.py: run by the llama-cpp-python peer venv (make peer-venv)
as `python bench/e2e/emb_peer.py MODEL.gguf OUT.json`; unnormalised embeddings of three texts with
mean, last and cls pooling, one thread."""
import json, sys
from llama_cpp import Llama
path = sys.argv[1]
texts = ["def add(a, b):\n    return a + b", "The capital of France is Paris.", "Mixture of experts models route each token."]
out = {}
for pool, code in (("mean", 1), ("last", 3), ("cls", 2)):
    llm = Llama(path, embedding=True, pooling_type=code, n_ctx=256, n_threads=1, n_threads_batch=1, verbose=False)
    out[pool] = [llm.embed(t, normalize=False) for t in texts]
    del llm
json.dump({"texts": texts, "emb": out}, open(sys.argv[2], "w"))
