"""The llama.cpp side of bench/e2e.py, run by the peer interpreter (llama-cpp-python's venv).

It never imports cpufuse (the two engines never share a process). One job per process, given as a
JSON file; the answer is one JSON line on stdout (big arrays go to .npy files named in the job):

    {"job": "speed", "model": P, "tokens": [...], "threads": k, "flash_attn": bool,
     "n_ctx": 1024, "pp": [128, 512], "tg": 128, "reps": {"pp128": 3, ...}, "pp_warm": n}
     (pp_warm: the warm-up prompt's length, default the measured one's; the answer says whether
     every logits row read was finite)
    {"job": "logits", "model": P, "tokens": [...], "out": "x.npy", "threads": k}
    {"job": "greedy", "model": P, "prompts": [[ids], ...], "n": 64, "threads": k}
    {"job": "tokenize", "model": P, "texts": [...]}

Settings (bench/README.md): n_batch = n_ubatch = 512, f16 K/V, logits_all=False for speed,
n_threads = n_threads_batch = k, flash attention as given (llama-cpp-python's default is off),
mmap on, weight repack on (libllama default; SmolLM2 Q4_1 has nothing to repack).
"""
import json
import os
import sys
import time


def _rss_kb(field="VmRSS:"):   # VmHWM: the peak (ru_maxrss would count the RSS a fork inherited)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return -1


def _load(job, logits_all=False, flash_attn=False):
    import llama_cpp
    from llama_cpp import Llama
    k = int(job.get("threads") or os.cpu_count())
    llm = Llama(model_path=job["model"], n_ctx=int(job.get("n_ctx", 1024)), n_batch=512, n_ubatch=512,
                n_threads=k, n_threads_batch=k, flash_attn=flash_attn, logits_all=logits_all,
                verbose=False, seed=0)
    return llama_cpp, llm


def _last_logits(llama_cpp, llm):
    import numpy as np
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()


def job_speed(job):
    import numpy as np
    rss0 = _rss_kb()
    llama_cpp, llm = _load(job, flash_attn=bool(job["flash_attn"]))
    rss_load = _rss_kb()
    toks = [int(t) for t in job["tokens"]]
    reps = job.get("reps", {})
    res = {"wall": {}, "perf": {}}
    finite = True

    def perf():
        d = llama_cpp.llama_perf_context(llm.ctx)
        return d.t_p_eval_ms, d.n_p_eval, d.t_eval_ms, d.n_eval

    for n in job["pp"]:
        key = f"pp{n}"
        wall, internal = [], []
        for r in range(1 + int(reps.get(key, 3))):        # the first is a warm-up
            llm.reset()
            llama_cpp.llama_perf_context_reset(llm.ctx)
            t0 = time.perf_counter()
            llm.eval(toks[:n if r else int(job.get("pp_warm", n))])
            dt = time.perf_counter() - t0
            finite &= bool(np.isfinite(_last_logits(llama_cpp, llm)).all())
            tp, npe, _, _ = perf()
            if r:
                wall.append(n / dt)
                internal.append(npe / tp * 1e3 if tp > 0 else float("nan"))
        res["wall"][key], res["perf"][key] = wall, internal
    ng = int(job["tg"])
    key = f"tg{ng}"
    wall, internal = [], []
    for r in range(1 + int(reps.get(key, 1))):
        nstep = 16 if r == 0 else ng
        llm.reset()
        llm.eval(toks[:1])
        _last_logits(llama_cpp, llm)
        llama_cpp.llama_perf_context_reset(llm.ctx)
        tsum = 0.0
        for i in range(nstep):
            t0 = time.perf_counter()
            llm.eval([toks[1 + i]])
            tsum += time.perf_counter() - t0
            lg = _last_logits(llama_cpp, llm)
            int(np.argmax(lg))
        finite &= bool(np.isfinite(lg).all())
        _, _, te, ne = perf()
        if r:
            wall.append(nstep / tsum)
            internal.append(ne / te * 1e3 if te > 0 else float("nan"))
    res["wall"][key], res["perf"][key] = wall, internal
    res["logits_finite"] = finite
    res["rss_after_import_kb"] = rss0
    res["rss_after_load_kb"] = rss_load
    res["maxrss_kb"] = _rss_kb("VmHWM:")
    res["version"] = llama_cpp.__version__
    try:
        res["system_info"] = llama_cpp.llama_print_system_info().decode(errors="replace")
    except Exception:  # noqa: BLE001
        pass
    return res


def job_logits(job):
    import numpy as np
    llama_cpp, llm = _load(job, logits_all=True, flash_attn=bool(job.get("flash_attn", False)))
    toks = [int(t) for t in job["tokens"]]
    llm.reset()
    llm.eval(toks)
    sc = np.array(llm.scores[:len(toks)], dtype=np.float32)
    np.save(job["out"], sc)
    return {"n": len(toks), "out": job["out"]}


def job_greedy(job):
    import numpy as np
    llama_cpp, llm = _load(job, flash_attn=bool(job.get("flash_attn", False)))
    eog = set()
    for t in range(llm.n_vocab()):
        if llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), t):
            eog.add(t)
    out = []
    for ids in job["prompts"]:
        llm.reset()
        llm.eval([int(t) for t in ids])
        toks, margins, top2 = [], [], []
        for i in range(int(job["n"])):
            lg = _last_logits(llama_cpp, llm)
            o = np.argsort(lg)[::-1][:2]
            tok = int(o[0])
            toks.append(tok)
            margins.append(float(lg[o[0]] - lg[o[1]]))
            top2.append(int(o[1]))
            if tok in eog:
                break
            llm.eval([tok])
        out.append({"tokens": toks, "margins": margins, "second": top2})
    return {"results": out, "eog": sorted(eog)}


def job_tokenize(job):
    from llama_cpp import Llama
    llm = Llama(model_path=job["model"], vocab_only=True, verbose=False)
    return {"tokens": [llm.tokenize(t.encode(), add_bos=False, special=True) for t in job["texts"]]}


def main():
    with open(sys.argv[1]) as f:
        job = json.load(f)
    fn = {"speed": job_speed, "logits": job_logits, "greedy": job_greedy, "tokenize": job_tokenize}[job["job"]]
    res = fn(job)
    sys.stdout.write("E2E_RESULT " + json.dumps(res) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
