"""The llama.cpp side of bench/e2e/model.py, run by the peer interpreter (llama-cpp-python's venv).

Details: bench/README.md, "bench.e2e.peer".
"""
import json
import os
import resource
import sys
import time


def _rss_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
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


def speed(job, load, perf=None):
    """pp / tg tokens per second of one engine in this process, the same for every engine (cpufuse's
    worker calls it too): load() -> (reset(), eval(tokens) -> last logits); perf: (reset(), read()
    -> (prompt ms, prompt tokens, eval ms, eval tokens)) of the engine's own counters, or None.
    pp N: one eval of N tokens from an empty cache (the first, untimed, of pp_warm tokens); tg N: N
    one-token evals after a 1-token prompt (the first run, untimed, of 16)."""
    import numpy as np
    rss0 = _rss_kb()
    reset, ev = load()
    res = {"wall": {}, "perf": {}, "rss_after_import_kb": rss0, "rss_after_load_kb": _rss_kb()}
    toks, reps, finite = [int(t) for t in job["tokens"]], job.get("reps", {}), True
    for n in job["pp"]:
        key, wall, internal = f"pp{n}", [], []
        for r in range(1 + int(reps.get(key, 3))):        # the first is a warm-up
            reset()
            perf and perf[0]()
            t0 = time.perf_counter()
            lg = ev(toks[:n if r else int(job.get("pp_warm", n))])
            dt = time.perf_counter() - t0
            finite &= bool(np.isfinite(lg).all())
            if r:
                wall.append(n / dt)
                tp, npe, _, _ = perf[1]() if perf else (0, 0, 0, 0)
                internal.append(npe / tp * 1e3 if tp > 0 else float("nan"))
        res["wall"][key], res["perf"][key] = wall, internal
    key, wall, internal = f"tg{int(job['tg'])}", [], []
    for r in range(1 + int(reps.get(key, 1))):
        nstep = 16 if r == 0 else int(job["tg"])
        reset()
        ev(toks[:1])
        perf and perf[0]()
        tsum = 0.0
        for i in range(nstep):
            t0 = time.perf_counter()
            lg = ev([toks[1 + i]])
            tsum += time.perf_counter() - t0
            int(np.argmax(lg))
        finite &= bool(np.isfinite(lg).all())
        if r:
            wall.append(nstep / tsum)
            _, _, te, ne = perf[1]() if perf else (0, 0, 0, 0)
            internal.append(ne / te * 1e3 if te > 0 else float("nan"))
    res["wall"][key], res["perf"][key] = wall, internal
    if perf is None:
        del res["perf"]
    res["logits_finite"] = finite
    res["maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return res


def job_speed(job):
    lc = {}

    def load():
        lc["m"], lc["llm"] = llama_cpp, llm = _load(job, flash_attn=bool(job["flash_attn"]))

        def ev(t):
            llm.eval(t)
            return _last_logits(llama_cpp, llm)
        return llm.reset, ev

    def read():
        d = lc["m"].llama_perf_context(lc["llm"].ctx)
        return d.t_p_eval_ms, d.n_p_eval, d.t_eval_ms, d.n_eval
    res = speed(job, load, (lambda: lc["m"].llama_perf_context_reset(lc["llm"].ctx), read))
    res["version"] = lc["m"].__version__
    try:
        res["system_info"] = lc["m"].llama_print_system_info().decode(errors="replace")
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
