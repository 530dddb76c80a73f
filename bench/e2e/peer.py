"""The llama.cpp side of bench/e2e/model.py, run by llama-cpp-python's interpreter: `peer.py JOB.json`.
speed() is every engine's timing loop (cpufuse's worker calls it too)."""
import json
import os
import sys
import time


def _rss_kb(field="VmRSS:"):   # VmHWM: the peak (ru_maxrss would count the RSS a fork inherited)
    with open("/proc/self/status") as f:
        return next((int(ln.split()[1]) for ln in f if ln.startswith(field)), -1)


GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}   # ggml_type values of the KV cache types


def _load(job, logits_all=False):
    import llama_cpp
    k = int(job.get("threads") or os.cpu_count())
    llm = llama_cpp.Llama(model_path=job["model"], n_ctx=int(job.get("n_ctx", 1024)), n_batch=512, n_ubatch=512,
                          n_threads=k, n_threads_batch=k, flash_attn=bool(job.get("flash_attn")),
                          logits_all=logits_all, verbose=False, seed=0,
                          **{f"type_{w}": GGML_TYPES[job.get(f"type_{w}", "f16")] for w in "kv"})
    return llama_cpp, llm


def _last_logits(llama_cpp, llm):
    import numpy as np
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()


def speed(job, load, perf=None):
    """pp / tg tokens per second of one engine in this process: load() -> (reset(), eval(tokens) -> last
    logits); perf: (reset(), read() -> (prompt ms, prompt tokens, eval ms, eval tokens)) of the engine's
    own counters, or None. pp N: one eval of N tokens from an empty cache (the first, untimed, of pp_warm
    tokens); tg N: N one-token evals after a 1-token prompt (the first run, untimed, of 16).
    job["depth"] = d > 0 (llama-bench's -d): each timed run first fills the cache with d tokens, untimed;
    pp N then appends N tokens to that cache, and tg N decodes N tokens after it (the warm-up runs
    start from an empty cache: they only page in the weights)."""
    import numpy as np
    rss0 = _rss_kb()
    reset, ev = load()
    res = {"wall": {}, "perf": {}, "rss_after_import_kb": rss0, "rss_after_load_kb": _rss_kb()}
    toks, reps, finite = [int(t) for t in job["tokens"]], job.get("reps", {}), True
    tg, depth = int(job["tg"]), int(job.get("depth", 0))
    for key in [f"pp{n}" for n in job["pp"]] + [f"tg{tg}"]:
        wall, internal = [], []
        for r in range(1 + int(reps.get(key, 3 if key[0] == "p" else 1))):     # the first is a warm-up
            reset()
            d = depth if r else 0
            if key[0] == "p":
                n = int(key[2:])
                if d:
                    ev(toks[:d])        # the cache at depth, untimed
                perf and perf[0]()
                t0 = time.perf_counter()
                lg = ev(toks[d:d + n] if r else toks[:int(job.get("pp_warm", n))])
                dt = time.perf_counter() - t0
            else:
                n, d0 = (tg if r else 16), max(d, 1)
                ev(toks[:d0])
                perf and perf[0]()
                dt = 0.0
                for i in range(n):
                    t0 = time.perf_counter()
                    lg = ev([toks[d0 + i]])
                    dt += time.perf_counter() - t0
            finite &= bool(np.isfinite(lg).all())
            if r:
                wall.append(n / dt)
                c = perf[1]() if perf else (0, 0, 0, 0)
                ms, nt = c[:2] if key[0] == "p" else c[2:]
                internal.append(nt / ms * 1e3 if ms > 0 else float("nan"))
        res["wall"][key], res["perf"][key] = wall, internal
    if perf is None:
        del res["perf"]
    res.update(logits_finite=finite, maxrss_kb=_rss_kb("VmHWM:"))
    return res


def job_speed(job):
    lc = {}

    def load():
        lc["m"], lc["llm"] = llama_cpp, llm = _load(job)
        return llm.reset, lambda t: (llm.eval(t), _last_logits(llama_cpp, llm))[1]

    def read():
        d = lc["m"].llama_perf_context(lc["llm"].ctx)
        return d.t_p_eval_ms, d.n_p_eval, d.t_eval_ms, d.n_eval
    res = speed(job, load, (lambda: lc["m"].llama_perf_context_reset(lc["llm"].ctx), read))
    res["version"] = lc["m"].__version__
    res["system_info"] = lc["m"].llama_print_system_info().decode(errors="replace")
    return res


def job_logits(job):
    import numpy as np
    _, llm = _load(job, logits_all=True)
    llm.eval([int(t) for t in job["tokens"]])
    np.save(job["out"], np.array(llm.scores[:len(job["tokens"])], dtype=np.float32))
    return {"n": len(job["tokens"]), "out": job["out"]}


def job_greedy(job):
    """argmax generation from each prompt until end-of-generation or n tokens, with the top-1 margins"""
    import numpy as np
    llama_cpp, llm = _load(job)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    eog = {t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)}
    out = []
    for ids in job["prompts"]:
        llm.reset()
        llm.eval([int(t) for t in ids])
        toks, margins = [], []
        for _ in range(int(job["n"])):
            lg = _last_logits(llama_cpp, llm)
            o = np.argsort(lg)[::-1][:2]
            toks.append(int(o[0]))
            margins.append(float(lg[o[0]] - lg[o[1]]))
            if toks[-1] in eog:
                break
            llm.eval([toks[-1]])
        out.append({"tokens": toks, "margins": margins})
    return {"results": out, "eog": sorted(eog)}


def job_tokenize(job):
    from llama_cpp import Llama
    llm = Llama(model_path=job["model"], vocab_only=True, verbose=False)
    return {"tokens": [llm.tokenize(t.encode(), add_bos=False, special=True) for t in job["texts"]]}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        job = json.load(f)
    res = {"speed": job_speed, "logits": job_logits, "greedy": job_greedy, "tokenize": job_tokenize}[job["job"]](job)
    sys.stdout.write("E2E_RESULT " + json.dumps(res) + "\n")
