"""llama.cpp's side of bench/e2e/spec.py, run by the llama-cpp-python peer venv (make peer-venv) as
`python bench/e2e/spec_peer.py JOB.json OUT.json`. JOB: {"model", "threads", "lookup", "ngram",
"max_tokens", "eog": [ids], "prompts": [token ids, ...]}. Per prompt, plain greedy decoding then llama-cpp-python's
LlamaPromptLookupDecoding (its Python prompt lookup, not llama-server's --lookup), on the same token
ids: the ids generated and the decode time (wall and CPU seconds from the first sampled token to the
last, so the prompt is not counted)."""
import json
import sys
import time

from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

job = json.load(open(sys.argv[1]))
kw = dict(n_ctx=job.get("n_ctx", 2048), n_threads=job["threads"], n_threads_batch=job["threads"], verbose=False)
# logits_all=True: with a draft model llama-cpp-python 0.3.36 keeps every row's logits but sizes its
# scores buffer by logits_all as given (n_batch rows), so past n_batch tokens it fails (a ValueError)
llms = {"plain": Llama(job["model"], **kw),
        "lookup": Llama(job["model"], logits_all=True, draft_model=LlamaPromptLookupDecoding(
            max_ngram_size=job["ngram"], num_pred_tokens=job["lookup"]), **kw)}


def run(llm, ids, n):
    llm.reset()
    toks, t0 = [], None
    for t in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        if t0 is None:
            t0, c0 = time.perf_counter(), time.process_time()
        if t in eog:
            break
        toks.append(int(t))
        if len(toks) == n:
            break
    return {"tokens": toks, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


eog = set(job["eog"])
out = []
for ids in job["prompts"]:
    out.append({how: run(llm, ids, job["max_tokens"]) for how, llm in llms.items()})
json.dump(out, open(sys.argv[2], "w"))
