"""The real model at depth, cpufuse against llama.cpp (llama-cpp-python, flash attention on), one thread
pinned, CPU seconds and wall (issue 42, session 12):

    python bench/results/vm-s12/depth_ab.py --model PATH --text FILE --depth 4096 --types f16,q8_0 \\
        --rounds 2 --core 1 --json bench/results/vm-s12/depth-4096.json

Each (round, cache type, engine) is its own process `taskset -c CORE nice python depth_ab.py --child JOB`
(cpufuse: this interpreter; llama.cpp: --peer-python), the engine order rotated each round. A child
loads the model (n_ctx = depth + pp + tg + 16, one thread, K and V of the type), brings the cache to
`depth` tokens of the text (token ids from cpufuse's tokenizer, the same for both engines) and times:

- pp: `pp` tokens appended at depth (one eval call), `--reps-pp` times, the cache rewound to depth
  between them (cpufuse: n_past; llama-cpp-python: n_tokens, whose eval drops the later cells);
- tg: `tg` one-token evals after depth, once.

An untimed pp of 16 tokens at depth (then rewound) comes first: it pages the weights in when the
cache came from a state file. Each timed part records wall (perf_counter) and this process's CPU
seconds (process_time; one thread, so CPU seconds are compute time however the core is shared).

Depth fill: the first child of an (engine, type) evaluates the `depth` tokens (reported, wall and
CPU) and saves the cache state (cpufuse: Model.save_kv; llama.cpp: llama_state_save_file); later
rounds load it, so a round costs its timed parts only. The state holds the same cells the fill
wrote. RSS: VmRSS after load, after the cache is at depth, and VmHWM at the end."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
GGML = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}


def rss_kb(field="VmRSS:"):
    with open("/proc/self/status") as f:
        return next((int(ln.split()[1]) for ln in f if ln.startswith(field)), -1)


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def cpufuse_engine(j):
    sys.path.insert(0, ROOT)
    from cpufuse.llama.model import Model
    m = Model.load(j["model"], n_ctx=j["n_ctx"], n_threads=1, type_k=j["type"], type_v=j["type"])

    def rewind(n):
        m._n_past = n          # later cells are overwritten by the next eval (bench only)

    def load_state(p):
        return m.load_kv(p)
    return dict(eval=lambda t: m.eval(t), rewind=rewind, save=m.save_kv, load=load_state,
                n_past=lambda: m.n_past, kv_bytes=m.kv_bytes, version="cpufuse")


def llama_engine(j):
    import ctypes
    import llama_cpp
    llm = llama_cpp.Llama(model_path=j["model"], n_ctx=j["n_ctx"], n_batch=512, n_ubatch=512, n_threads=1,
                          n_threads_batch=1, flash_attn=True, type_k=GGML[j["type"]], type_v=GGML[j["type"]],
                          logits_all=False, verbose=False, seed=0)

    def rewind(n):
        llm.n_tokens = n       # Llama.eval removes the cells from n_tokens on before it decodes

    def save(p):
        toks = (llama_cpp.llama_token * llm.n_tokens)(*llm.input_ids[:llm.n_tokens].tolist())
        assert llama_cpp.llama_state_save_file(llm.ctx, p.encode(), toks, llm.n_tokens)

    def load(p):
        cap = j["n_ctx"]
        toks, n = (llama_cpp.llama_token * cap)(), ctypes.c_size_t(0)
        assert llama_cpp.llama_state_load_file(llm.ctx, p.encode(), toks, cap, ctypes.byref(n))
        llm.input_ids[:n.value] = list(toks)[:n.value]
        llm.n_tokens = n.value
        return n.value
    return dict(eval=llm.eval, rewind=rewind, save=save, load=load, n_past=lambda: llm.n_tokens, kv_bytes=None,
                version=f"llama-cpp-python {llama_cpp.__version__}")


def child(j):
    res = {"rss_start_kb": rss_kb()}
    e = (cpufuse_engine if j["engine"] == "cpufuse" else llama_engine)(j)
    res["rss_after_load_kb"], res["version"], res["kv_bytes"] = rss_kb(), e["version"], e["kv_bytes"]
    toks, d, pp, tg = j["tokens"], j["depth"], j["pp"], j["tg"]
    if os.path.exists(j["state"]):
        res["depth_from"] = "state"
        assert e["load"](j["state"]) == d
    else:
        res["depth_from"] = "fill"
        res["fill_wall_s"], res["fill_cpu_s"] = timed(lambda: e["eval"](toks[:d]))
        e["save"](j["state"])
    assert e["n_past"]() == d
    res["rss_at_depth_kb"] = rss_kb()
    e["eval"](toks[d:d + 16])           # untimed: pages the weights in
    e["rewind"](d)
    res["pp"] = []
    for _ in range(j["reps_pp"]):
        res["pp"].append(timed(lambda: e["eval"](toks[d:d + pp])))
        e["rewind"](d)
    steps = []
    for i in range(tg):
        steps.append(timed(lambda: e["eval"]([toks[d + i]])))
    res["tg"] = [sum(s[0] for s in steps), sum(s[1] for s in steps)]
    res["tg_steps"] = steps
    res["maxrss_kb"] = rss_kb("VmHWM:")
    return res


def run_child(python, job, core, timeout):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = ["taskset", "-c", str(core), python, os.path.abspath(__file__), "--child", f.name]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    finally:
        os.unlink(f.name)
    for ln in p.stdout.splitlines():
        if ln.startswith("DEPTH_RESULT "):
            return json.loads(ln[len("DEPTH_RESULT "):])
    raise SystemExit(f"child {job['engine']} {job['type']} failed ({p.returncode}): {p.stderr[-2000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True, help="UTF-8 text; its cpufuse token ids feed both engines")
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--reps-pp", type=int, default=2)
    ap.add_argument("--types", default="f16,q8_0")
    ap.add_argument("--engines", default="cpufuse,llama.cpp")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--peer-python", default="/work/main/.venv-llama/bin/python")
    ap.add_argument("--state-dir", default="/tmp/depth_ab_state")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    from cpufuse.llama.tokenizer import Tokenizer
    with open(a.text, encoding="utf-8") as f:
        text = f.read()
    n = a.depth + max(a.pp, a.tg) + 16
    toks = Tokenizer.from_gguf(a.model).encode(text[:n * 8])[:n]
    assert len(toks) == n, (len(toks), n)
    os.makedirs(a.state_dir, exist_ok=True)
    engines, types = a.engines.split(","), a.types.split(",")
    out = dict(model=os.path.basename(a.model), depth=a.depth, pp=a.pp, tg=a.tg, reps_pp=a.reps_pp, core=a.core,
               load_avg_start=os.getloadavg(), runs=[])
    for rnd in range(a.rounds):
        for ti, t in enumerate(types):
            k = (rnd + ti) % len(engines)
            for e in engines[k:] + engines[:k]:
                job = dict(engine=e, type=t, model=a.model, tokens=toks, depth=a.depth, pp=a.pp, tg=a.tg,
                           reps_pp=a.reps_pp, n_ctx=a.depth + max(a.pp, a.tg) + 16,
                           state=os.path.join(a.state_dir, f"{e}-{t}-{a.depth}.state"))
                t0 = time.perf_counter()
                r = run_child(sys.executable if e == "cpufuse" else a.peer_python, job, a.core, a.timeout)
                r.update(round=rnd + 1, engine=e, type=t, seconds=time.perf_counter() - t0, load_avg=os.getloadavg())
                out["runs"].append(r)
                pp_best = max(a.pp / w for w, c in r["pp"])
                pp_cpu = max(a.pp / c for w, c in r["pp"])
                print(f"round {rnd + 1} {e:9s} {t:5s} depth from {r['depth_from']}"
                      + (f" ({r['fill_wall_s']:.0f} s wall, {r['fill_cpu_s']:.0f} CPU s)" if "fill_wall_s" in r else "")
                      + f": pp{a.pp} {pp_best:.2f} tok/s wall, {pp_cpu:.2f} per CPU s; tg{a.tg} "
                      f"{a.tg / r['tg'][0]:.2f} wall, {a.tg / r['tg'][1]:.2f} per CPU s; RSS at depth "
                      f"{r['rss_at_depth_kb'] / 1024:.0f} MiB, peak {r['maxrss_kb'] / 1024:.0f} MiB "
                      f"({r['seconds']:.0f} s, load {r['load_avg'][0]:.1f})", flush=True)
                with open(a.json, "w") as f:
                    json.dump(out, f, indent=1)
    out["load_avg_end"] = os.getloadavg()
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


def child_main(run=None):
    """`--child JOB.json`: run the job (with `run`, default child) and print its result line"""
    with open(sys.argv[2]) as fh:
        res = (run or child)(json.load(fh))
    sys.stdout.write("DEPTH_RESULT " + json.dumps(res) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child_main()
    else:
        main()
