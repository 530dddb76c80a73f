"""Serving benchmark: cpufuse's OpenAI-compatible server against llama-cpp-python's, same run.

    python -m bench.e2e.serve [--models smollm2,1b] [--clients 1,4,8,16] [--max-tokens 128]
                                [--requests 2] [--rounds 1] [--parallel 16] [--n-ctx 512]
                                [--threads N] [--chunk 128] [--batch-tokens 128] [--peer-python PATH]
                                [--step-rounds 5] [--step-iters 30] [--constrained-clients 8]
                                [--out bench/results/serve]

Details: bench/README.md, "bench.e2e.serve".
"""
import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

from ..timing import ROOT, cpu_name, fmt, load_avg, median
from ..timing import peer_status as _importable
from . import load as serve_load

DEFAULT_PEER = os.path.join(".venv-llama", "bin", "python")     # relative to the repository root
ENGINES = ("cpufuse", "llama-cpp-python")
# the constrained row: cpufuse at --constrained-clients clients, every request under this JSON schema
# (a list of at least 256 strings: the grammar cannot end before max_tokens, so every request runs
# to max_tokens, as the unconstrained requests do with ignore_eos)
BENCH_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"},
                                                            "minItems": 256}},
                "required": ["items"], "additionalProperties": False}
CONSTRAINED_BODY = {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": BENCH_SCHEMA}}}
STEP_SIZES = (1, 8, 16)
STEP_POS = 128


def threads_default():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def model_paths(names):
    out = {}
    for name in names:
        if name == "smollm2":
            from cpufuse.llama.cli import INSTALL_HINT, find_smollm2
            p = find_smollm2()
            if p is None:
                sys.exit(f"bench.e2e.serve: SmolLM2 not installed: {INSTALL_HINT}")
            out[name] = p
        elif name == "1b":
            from . import bigmodels
            out[name] = bigmodels.ensure("1b", "q4_0", log=lambda m: print(m, flush=True))
        elif os.path.exists(name):
            out[os.path.splitext(os.path.basename(name))[0]] = name
        else:
            sys.exit(f"bench.e2e.serve: --models: {name!r} is not smollm2, 1b or a GGUF path")
    return out


def model_facts(path):
    """(end-of-generation ids, has a chat template) from the GGUF's tokenizer"""
    from cpufuse.llama.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(path)
    return sorted(int(i) for i in tok.eog_ids), bool(tok.chat_template)


# ================================================================================================
# servers

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_status(peer):
    """None when `peer -m llama_cpp.server` can run, else why not; and llama_cpp's version"""
    why = _importable(peer)
    if why:
        return why, None
    p = subprocess.run([peer, "-m", "llama_cpp.server", "--help"], capture_output=True, text=True, timeout=120)
    if p.returncode:
        return (f"`{peer} -m llama_cpp.server` does not run (pip install 'llama-cpp-python[server]' there): "
                f"{p.stderr.strip()[-300:]}"), None
    v = subprocess.run([peer, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True, text=True)
    return None, v.stdout.strip()


def server_cmd(engine, path, port, args):
    if engine == "cpufuse":
        return [sys.executable, "-m", "cpufuse", "serve", path, "--host", "127.0.0.1", "--port", str(port),
                "--parallel", str(args.parallel), "--n-ctx", str(args.n_ctx), "--threads", str(args.threads),
                "--chunk", str(args.chunk), "--batch-tokens", str(args.batch_tokens),
                "--log-level", "warning"], "/health"
    t = str(args.threads)
    return [args.peer_python, "-m", "llama_cpp.server", "--model", path, "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", str(args.n_ctx), "--n_threads", t, "--n_threads_batch", t,
            "--interrupt_requests", "False", "--verbose", "False"], "/v1/models"


class Server:
    """A server process on a free port, up once its health URL answers 200; stop() ends it."""

    def __init__(self, engine, path, args, log_path, timeout=300):
        self.port = free_port()
        cmd, health = server_cmd(engine, path, self.port, args)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        t0 = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{engine} server exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + health, timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.perf_counter() - t0 > timeout:
                self.stop()
                raise RuntimeError(f"{engine} server not up after {timeout} s: {self.tail()}")
            time.sleep(0.5)
        self.startup_s = time.perf_counter() - t0

    def tail(self):
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-600:].strip()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def drive(url, endpoint, args, extra, clients=None):
    argv = ["--url", url, "--clients", ",".join(map(str, clients or args.clients)), "--max-tokens",
            str(args.max_tokens), "--rounds", str(args.requests), "--endpoint", endpoint]
    if extra:
        argv += ["--extra-body", json.dumps(extra)]
    _, rows = asyncio.run(serve_load.run(serve_load.parse_args(argv)))
    return rows


# ================================================================================================
# decode step (worker process)

def step_worker(spec):
    import numpy as np

    from cpufuse.llama import Model
    from cpufuse.llama.decoder import Batch
    m = Model.load(spec["path"], n_ctx=spec["n_ctx"], n_threads=spec["threads"], n_seq=max(STEP_SIZES))
    cap = (max(spec["chunk"], spec["batch_tokens"]) + m.n_seq, m.n_seq, m.n_seq)       # BatchEngine's plan capacity (serve/batch.py)
    tok = m.tokenizer.tokenize("The", add_bos=False)[0]
    batches = {}
    for k in STEP_SIZES:
        b = Batch(m)
        for s in range(k):
            b.add(s, [tok], STEP_POS, logits=True)
        batches[k] = b
    times = {k: [] for k in STEP_SIZES}
    for k in STEP_SIZES:                                        # warm-up: compiles each plan size once
        for _ in range(3):
            rows = batches[k].run(m.decoder, cap, n_threads=spec["threads"])
            assert rows.shape[0] == k and np.isfinite(rows).all()
    for r in range(spec["rounds"]):
        order = STEP_SIZES[r % len(STEP_SIZES):] + STEP_SIZES[:r % len(STEP_SIZES)]
        for k in order:
            b = batches[k]
            for _ in range(spec["iters"]):
                t0 = time.perf_counter()
                b.run(m.decoder, cap, n_threads=spec["threads"])
                times[k].append(time.perf_counter() - t0)
    return {str(k): {"median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3, "n": len(v)}
            for k, v in times.items()}


def step_bench(path, args):
    spec = dict(path=path, n_ctx=args.n_ctx, threads=args.threads, chunk=args.chunk, batch_tokens=args.batch_tokens,
                rounds=args.step_rounds, iters=args.step_iters)
    p = subprocess.run([sys.executable, "-m", "bench.e2e.serve", "--step-worker", json.dumps(spec)],
                       capture_output=True, text=True, cwd=ROOT, timeout=1800)
    for line in p.stdout.splitlines():
        if line.startswith("STEP_RESULT "):
            return json.loads(line[len("STEP_RESULT "):]), None
    return None, f"exit {p.returncode}: {(p.stderr or p.stdout).strip()[-600:]}"


# ================================================================================================
# summary, report, chart

METRICS = ("tok_s", "ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "req_decode_tok_s")


def summarize(runs):
    """{engine: {clients: {metric: median over rounds}}} of one model's runs"""
    out = {}
    for e in ENGINES:
        levels = {}
        for run in runs:
            if run["engine"] != e or not run.get("levels"):
                continue
            for row in run["levels"]:
                levels.setdefault(row["clients"], []).append(row)
        out[e] = {c: {**{k: median([r[k] for r in rows]) for k in METRICS},
                      "counted": sorted({x for r in rows for x in r["counted"]}), "rounds": len(rows)}
                  for c, rows in sorted(levels.items())}
    return out


def level(summary, engine, clients, key):
    return summary.get(engine, {}).get(clients, {}).get(key, float("nan"))


def checks(res, issue_model):
    """the issue's four performance checks on `issue_model` (SmolLM2): [(name, ratio, target, ok, why not measured)]"""
    m = res["models"].get(issue_model)
    if m is None:
        return []
    s, st = m["summary"], m.get("step") or {}
    cf = lambda c, k: level(s, "cpufuse", c, k)   # noqa: E731
    peer = level(s, "llama-cpp-python", 8, "tok_s")
    step = st["8"]["median_ms"] / st["1"]["median_ms"] if st else float("nan")
    rows = [("aggregate tok/s at 8 clients / at 1 client (cpufuse)", cf(8, "tok_s") / cf(1, "tok_s"), 3, ""),
            ("aggregate tok/s at 8 clients, cpufuse / llama-cpp-python", cf(8, "tok_s") / peer, 2,
             f"peer skipped: {res['peer_skipped']}" if res["peer_skipped"] else ""),
            ("TTFT p95 at 8 clients / single-client TTFT (p50 at 1 client; cpufuse)",
             cf(8, "ttft_p95") / cf(1, "ttft_p50"), -3, ""),
            ("decode step over 8 sequences / over 1 sequence", step, -2, "")]
    # target > 0: ratio >= target; < 0: ratio <= -target
    return [(name, r, (">= " if t > 0 else "<= ") + str(abs(t)), r >= t if t > 0 else r <= -t,
             why or "not measured in this run" if r != r else "")
            for name, r, t, why in rows]


def write_md(res, path):
    a = res["args"]
    m = res["machine"]
    L = ["# Serving: cpufuse's OpenAI-compatible server vs llama-cpp-python's (`python -m bench.e2e.serve`)", "",
         f"Machine: {m['cpu']}, {m['cpus']} CPUs in the affinity, Python {m['python']}, cpufuse {m['cpufuse']} "
         f"(ISA {m['isa']}), llama-cpp-python {res['peer_version'] or '–'}. Load average at start "
         f"{m['load_start']:.2f}, at end {m['load_end']:.2f}; run time {res['seconds'] / 60:.1f} min; {res['date']}.", "",
         f"Settings: {a['threads']} threads for both servers (unpinned); n_ctx {a['n_ctx']} per sequence; cpufuse "
         f"`--parallel {a['parallel']} --chunk {a['chunk']} --batch-tokens {a['batch_tokens']}` (BatchEngine); llama-cpp-python "
         f"`--interrupt_requests False` (one request at a time). Load: bench/e2e/load.py, concurrency levels "
         f"{', '.join(map(str, a['clients']))}; each client sends {a['requests']} streaming request(s) of "
         f"{a['max_tokens']} greedy tokens back to back (ignore_eos; the peer: a -1000 logit bias on the "
         f"end-of-generation tokens), a distinct prompt each. {a['rounds']} round(s), engines in alternating order; "
         "figures are medians over rounds.", "",
         "Columns: aggregate output tok/s = every request's output tokens / the level's wall time; TTFT = request "
         "sent to first content chunk; ITL = gap between consecutive content chunks (pooled over the level's "
         "requests); tokens counted from `usage` (cpufuse) or as max_tokens on finish_reason `length` (the peer, "
         "which sends no usage when streaming). Each server's first, short request is a warm-up, not counted.", ""]
    if res["peer_skipped"]:
        L += [f"**llama-cpp-python skipped:** {res['peer_skipped']}", ""]
    for name, mres in res["models"].items():
        s = mres["summary"]
        L += [f"## {name}: `{os.path.basename(mres['path'])}` ({mres['endpoint']} endpoint)", ""]
        for run in mres["runs"]:
            if run.get("error"):
                L += [f"- {run['engine']} round {run['round']}: **failed**: {run['error']}"]
        L += ["| clients | cpufuse tok/s | llama-cpp-python tok/s | cpufuse / peer | cpufuse × 1 client "
              "| TTFT p50 ms cpufuse / peer | TTFT p95 ms cpufuse / peer | ITL p50 ms cpufuse / peer "
              "| ITL p95 ms cpufuse / peer |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        base = level(s, "cpufuse", 1, "tok_s")
        for c in a["clients"]:
            cf, pe = (lambda k: level(s, "cpufuse", c, k)), (lambda k: level(s, "llama-cpp-python", c, k))
            pair = lambda k: f"{fmt(cf(k) * 1e3)} / {fmt(pe(k) * 1e3)}"   # noqa: E731
            L.append(f"| {c} | {fmt(cf('tok_s'))} | {fmt(pe('tok_s'))} | {fmt(cf('tok_s') / pe('tok_s'), 2)}× "
                     f"| {fmt(cf('tok_s') / base, 2)}× | {pair('ttft_p50')} | {pair('ttft_p95')} | {pair('itl_p50')} "
                     f"| {pair('itl_p95')} |")
        crow = [r for run in mres["runs"] if run.get("constrained") for r in run["constrained"]]
        if crow:
            c = crow[0]["clients"]
            ctok = median([r["tok_s"] for r in crow])
            L += ["", f"Constrained: {c} clients, every request under a JSON schema (`response_format` json_schema, "
                  f"a list of >= 256 strings, so every request runs to max_tokens), cpufuse: {fmt(ctok)} tok/s = {fmt(ctok / level(s, 'cpufuse', c, 'tok_s'), 3)}× "
                  f"its unconstrained {fmt(level(s, 'cpufuse', c, 'tok_s'))} tok/s at {c} clients (target: >= 0.95 on "
                  f"SmolLM2, >= 0.98 on the 1B shapes); TTFT p50 {fmt(median([r['ttft_p50'] for r in crow]) * 1e3)} ms, "
                  f"ITL p50 {fmt(median([r['itl_p50'] for r in crow]) * 1e3)} ms."]
        for e in ENGINES:
            rows = [r for run in mres["runs"] if run["engine"] == e for r in run.get("levels") or ()]
            tok, chk = sum(r["output_tokens"] for r in rows), sum(r.get("content_chunks", 0) for r in rows)
            if tok and chk < 0.95 * tok:
                L += ["", f"{e}: {chk} content chunks for {tok} tokens (text held back until it decodes), so its "
                      "ITL reads high by about that ratio."]
        st = mres.get("step")
        if st:
            one = st["1"]["median_ms"]
            L += ["", "Decode step (one decoder call, the next token of k sequences at position "
                  f"{STEP_POS}, on the server's plan; median (min) of {st['1']['n']} calls, sizes alternating): " +
                  ", ".join(f"{k} seq {v['median_ms']:.2f} ms ({v['min_ms']:.2f}), {v['median_ms'] / one:.2f}× "
                            "the 1-seq median" for k, v in st.items()) + "."]
        elif mres.get("step_error"):
            L += ["", f"Decode step: failed: {mres['step_error']}"]
        L += [""]
    L += ["## The issue's performance checks (SmolLM2, all cores)", "",
          "| check | measured | target | result |", "|---|---:|---|---|"]
    if not res["checks"]:
        L.append("| (SmolLM2 not in this run) | | | |")
    for name, r, lim, ok, note in res["checks"]:
        verdict = note if r != r else ("pass" if ok else "**fail**")
        verdict = verdict or "not measured"
        L.append(f"| {name} | {fmt(r, 2)}× | {lim} | {verdict} |")
    png = os.path.basename(res["args"]["out"]) + ".png"
    L += ["", f"![tok/s and TTFT against clients]({png})" if res.get("chart") == "ok" else
          f"Chart: {res.get('chart')}", ""]
    with open(path, "w") as f:
        f.write("\n".join(L))


def write_chart(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib unavailable ({e})"
    names = list(res["models"])
    fig, axes = plt.subplots(2, len(names), figsize=(5.5 * len(names), 7.5), squeeze=False)
    style = {"cpufuse": dict(color="#173f7a", marker="o"), "llama-cpp-python": dict(color="#3fa34d", marker="s")}
    for j, name in enumerate(names):
        s = res["models"][name]["summary"]
        for i, (key, label, scale) in enumerate((("tok_s", "aggregate output tok/s", 1),
                                                 ("ttft_p95", "TTFT p95 (ms)", 1e3))):
            ax = axes[i][j]
            for e in ENGINES:
                cs = sorted(s.get(e, {}))
                if cs:
                    ax.plot(cs, [s[e][c][key] * scale for c in cs], label=e, **style[e])
            ax.set_xscale("log", base=2)
            ax.set_xticks(res["args"]["clients"], [str(c) for c in res["args"]["clients"]])
            if key == "ttft_p95":
                ax.set_yscale("log")
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            if i == 0:
                ax.set_title(f"{name}: {res['args']['max_tokens']} greedy tokens a request")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "ok"


# ================================================================================================

def machine(args):
    import cpufuse
    return dict(cpu=cpu_name(), cpus=threads_default(), python=platform.python_version(),
                cpufuse=cpufuse.__version__, isa=cpufuse.available_isas()[0], load_start=load_avg()[0])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.e2e.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,1b", help="smollm2, 1b and/or GGUF paths, comma-separated")
    serve_load.add_load_args(ap, "--requests")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of both engines per model (default 1)")
    ap.add_argument("--parallel", type=int, default=16, help="cpufuse --parallel (default 16)")
    ap.add_argument("--n-ctx", type=int, default=512, help="context per sequence, both servers (default 512)")
    ap.add_argument("--threads", type=int, default=None, help="threads of both servers (default: the CPUs in the affinity)")
    ap.add_argument("--chunk", type=int, default=128, help="cpufuse --chunk (default 128)")
    ap.add_argument("--batch-tokens", type=int, default=128, help="cpufuse --batch-tokens (default 128)")
    ap.add_argument("--peer-python", default=DEFAULT_PEER,
                    help=f"interpreter with llama-cpp-python and its server extras (default {DEFAULT_PEER})")
    ap.add_argument("--constrained-clients", type=int, default=8,
                    help="clients of the constrained (JSON schema) row, cpufuse only (default 8; 0 skips it)")
    ap.add_argument("--step-rounds", type=int, default=5, help="decode-step rounds (default 5; 0 skips it)")
    ap.add_argument("--step-iters", type=int, default=30, help="decoder calls per size per round (default 30)")
    ap.add_argument("--out", default=os.path.join("bench", "results", "serve"),
                    help="writes OUT.json, OUT.md, OUT.png (default bench/results/serve)")
    ap.add_argument("--from-json", metavar="P", help="only write OUT.md and OUT.png again from a run's JSON")
    ap.add_argument("--step-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.step_worker or args.from_json:
        return args
    serve_load.check_load_args(ap, args, "requests")
    if max(args.clients) > args.parallel:
        ap.error(f"--clients must be <= --parallel ({args.parallel}), got {args.clients}")
    for k in ("rounds", "parallel", "n_ctx", "chunk", "batch_tokens", "step_iters"):
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    if args.step_rounds < 0:
        ap.error(f"--step-rounds must be >= 0, got {args.step_rounds}")
    if args.parallel < max(STEP_SIZES) and args.step_rounds:
        ap.error(f"--parallel must be >= {max(STEP_SIZES)} for the decode-step part (or --step-rounds 0)")
    args.threads = args.threads or threads_default()
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    args.models = [x.strip() for x in args.models.split(",") if x.strip()]
    if not os.path.isabs(args.peer_python):
        args.peer_python = os.path.join(ROOT, args.peer_python)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.step_worker:
        print("STEP_RESULT " + json.dumps(step_worker(json.loads(args.step_worker))), flush=True)
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            res = json.load(f)
        for mres in res["models"].values():       # JSON keeps no int keys: the summary again from the runs
            mres["summary"] = summarize(mres["runs"])
        res["chart"] = write_chart(res, args.out + ".png")
        write_md(res, args.out + ".md")
        print(f"bench.e2e.serve: wrote {args.out}.md{', .png' if res['chart'] == 'ok' else ''} from {args.from_json}")
        return 0
    t_start = time.perf_counter()
    paths = model_paths(args.models)
    peer_skipped, peer_version = peer_status(args.peer_python)
    if peer_skipped:
        print(f"bench.e2e.serve: llama-cpp-python columns skipped: {peer_skipped}", flush=True)
    res = dict(machine=machine(args), date=time.strftime("%Y-%m-%d %H:%M %Z"), peer_version=peer_version,
               peer_skipped=peer_skipped, args={k: v for k, v in vars(args).items() if k != "step_worker"},
               models={})
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    engines = [e for e in ENGINES if not (peer_skipped and e != "cpufuse")]
    for mi, (name, path) in enumerate(paths.items()):
        eog, chat = model_facts(path)
        endpoint = "chat" if chat else "completions"
        mres = res["models"][name] = dict(path=path, endpoint=endpoint, eog_ids=eog, runs=[])
        if args.step_rounds:
            print(f"[{name}] decode step: 1, 8, 16 sequences", flush=True)
            mres["step"], mres["step_error"] = step_bench(path, args)
            if mres["step"]:
                print("  " + ", ".join(f"{k} seq {v['median_ms']:.2f} ms" for k, v in mres["step"].items()), flush=True)
            else:
                print(f"  failed: {mres['step_error']}", flush=True)
        for r in range(args.rounds):
            order = engines if (mi + r) % 2 == 0 else engines[::-1]
            for e in order:
                run = dict(engine=e, round=r)
                extra = None if e == "cpufuse" else {"logit_bias": {str(i): -1000 for i in eog}}
                print(f"[{name}] round {r + 1}/{args.rounds}: {e} server", flush=True)
                log = os.path.join(out_dir, f".serve-{e}.log")
                try:
                    srv = Server(e, path, args, log)
                except RuntimeError as ex:
                    run["error"] = str(ex)
                    print(f"  {ex}", flush=True)
                    mres["runs"].append(run)
                    continue
                try:
                    run["startup_s"] = srv.startup_s
                    run["levels"] = drive(srv.url, endpoint, args, extra)
                    if e == "cpufuse" and args.constrained_clients:
                        print(f"  constrained (json_schema) at {args.constrained_clients} clients", flush=True)
                        run["constrained"] = drive(srv.url, endpoint, args, CONSTRAINED_BODY,
                                                   [args.constrained_clients])
                except Exception as ex:  # noqa: BLE001 -- a failed engine is reported, the run goes on
                    run["error"] = f"{type(ex).__name__}: {ex}"
                    print(f"  failed: {run['error']}; server log: {srv.tail()}", flush=True)
                finally:
                    srv.stop()
                    os.unlink(log)
                mres["runs"].append(run)
        mres["summary"] = summarize(mres["runs"])
    res["machine"]["load_end"] = load_avg()[0]
    res["seconds"] = time.perf_counter() - t_start
    res["checks"] = checks(res, "smollm2")
    res["chart"] = write_chart(res, args.out + ".png")
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    write_md(res, args.out + ".md")
    print(open(args.out + ".md").read())
    print(f"bench.e2e.serve: wrote {args.out}.md, .json{', .png' if res['chart'] == 'ok' else ''} "
          f"({res['seconds'] / 60:.1f} min)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
