"""Serving benchmark: cpufuse's OpenAI-compatible server against llama-cpp-python's, same run;
--constrained-ab: constrained / plain decoding in one BatchEngine; --url: the load generator (N concurrent
streaming clients) on any running OpenAI-compatible server. Details: bench/README.md, "bench.e2e.serve"."""
import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

from ..plot import plot_setup
from ..report import save, table
from . import NCPU, ROOT, fmt, machine, median, model_path, peer_status, ratio, run_job

ENGINES = ("cpufuse", "llama-cpp-python")
# the constrained row: cpufuse at --constrained-clients clients, every request under this JSON schema
# (at least 256 strings: the grammar cannot end before max_tokens, as the others run with ignore_eos)
BENCH_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"},
                                                            "minItems": 256}},
                "required": ["items"], "additionalProperties": False}
CONSTRAINED_BODY = {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": BENCH_SCHEMA}}}
STEP_SIZES = (1, 8, 16)
STEP_POS = 128
METRICS = ("tok_s", "ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "req_decode_tok_s")


# ================================================================================================
# the load

TOPICS = ["the sea", "a mountain village", "an old library", "a train journey", "a winter market",
          "a lighthouse keeper", "a garden in spring", "a night in the desert"]


def pct(xs, q):
    """the q-quantile (0..1) by linear interpolation; NaN for no data"""
    if not xs:
        return float("nan")
    s, k = sorted(xs), (len(xs) - 1) * q
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


async def one_request(http, url, model, endpoint, text, max_tokens, extra=None):
    """stream one request: dict(t0, chunks=[times of content chunks], end, tokens, counted)"""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **(extra or {})}
    chat = endpoint == "chat"
    body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0, chunks, usage, finish = time.perf_counter(), [], None, None
    async with http.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            data = line[5:].strip() if line.startswith("data:") else None
            if data == "[DONE]":
                break
            obj = json.loads(data) if data else {}
            if "error" in obj:
                raise RuntimeError(f"{path}: stream error: {obj['error']}")
            usage = obj.get("usage") or usage
            for ch in obj.get("choices") or ():
                finish = ch.get("finish_reason") or finish
                if (ch.get("delta") or {}).get("content") if chat else ch.get("text"):
                    chunks.append(time.perf_counter())
    if usage and "completion_tokens" in usage:
        tokens, counted = usage["completion_tokens"], "usage"
    else:
        tokens, counted = (max_tokens, "length") if finish == "length" else (len(chunks), "chunks")
    return dict(t0=t0, chunks=chunks, end=time.perf_counter(), tokens=tokens, counted=counted)


async def load_level(url, model, endpoint, n_clients, rounds, max_tokens, extra=None):
    """n_clients clients at once, each sending `rounds` requests back to back: the level's figures.
    `url` may be a list of replicas' URLs: client i sends to url[i % len(url)] (a round-robin router)"""
    urls = [url] if isinstance(url, str) else list(url)
    import httpx
    limits = httpx.Limits(max_connections=n_clients + 2, max_keepalive_connections=n_clients + 2)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        async def client(i):
            return [await one_request(http, urls[i % len(urls)], model, endpoint, f"Request {i}.{r}: write a long, detailed story "
                                      f"about {TOPICS[(i + r) % len(TOPICS)]}, with many characters.", max_tokens, extra)
                    for r in range(rounds)]
        t0 = time.perf_counter()
        reqs = [r for rs in await asyncio.gather(*(client(i) for i in range(n_clients))) for r in rs]
        wall = time.perf_counter() - t0
    ttft = [r["chunks"][0] - r["t0"] for r in reqs if r["chunks"]]
    itl = [b - a for r in reqs for a, b in zip(r["chunks"], r["chunks"][1:])]
    dec = [(r["tokens"] - 1) / (r["end"] - r["chunks"][0]) for r in reqs
           if r["chunks"] and r["tokens"] > 1 and r["end"] > r["chunks"][0]]
    tokens = sum(r["tokens"] for r in reqs)
    return dict(clients=n_clients, requests=len(reqs), output_tokens=tokens,
                content_chunks=sum(len(r["chunks"]) for r in reqs), wall_s=wall,
                tok_s=tokens / wall if wall > 0 else float("nan"),
                ttft_p50=pct(ttft, 0.5), ttft_p95=pct(ttft, 0.95), itl_p50=pct(itl, 0.5), itl_p95=pct(itl, 0.95),
                req_decode_tok_s=statistics.median(dec) if dec else float("nan"),
                counted=sorted({r["counted"] for r in reqs}))


async def drive(url, endpoint, clients, rounds, max_tokens, extra=None, model=None):
    """a short warm-up request (compiles, faults the weights in), then each level: (model, [level rows]).
    `url` may be a list of replicas' URLs (each is warmed up; clients are spread round-robin)"""
    import httpx
    urls = [u.rstrip("/").removesuffix("/v1") for u in ([url] if isinstance(url, str) else url)]
    async with httpx.AsyncClient(timeout=None) as http:
        for u in urls:
            r = await http.get(u + "/v1/models")
            r.raise_for_status()
            model = model or r.json()["data"][0]["id"]
            await one_request(http, u, model, endpoint, "Hello.", 8, extra)
    url = urls[0] if len(urls) == 1 else urls
    out = []
    for n in clients:
        out.append(res := await load_level(url, model, endpoint, n, rounds, max_tokens, extra))
        print(f"  {n:>3} clients: {res['tok_s']:8.1f} tok/s, TTFT p50 {res['ttft_p50'] * 1e3:7.1f} ms "
              f"p95 {res['ttft_p95'] * 1e3:7.1f} ms, ITL p50 {res['itl_p50'] * 1e3:6.1f} ms "
              f"p95 {res['itl_p95'] * 1e3:6.1f} ms", file=sys.stderr, flush=True)
    return model, out


# ================================================================================================
# the servers

def server_status(peer):
    """(None when `peer -m llama_cpp.server` can run, else why not; llama_cpp's version)"""
    why = peer_status(peer)
    if why:
        return why, None
    p = subprocess.run([peer, "-m", "llama_cpp.server", "--help"], capture_output=True, text=True, timeout=120)
    if p.returncode:
        return (f"`{peer} -m llama_cpp.server` does not run (pip install 'llama-cpp-python[server]' there): "
                f"{(p.stderr.strip().splitlines() or [''])[-1][-300:]}"), None
    v = subprocess.run([peer, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True, text=True)
    return None, v.stdout.strip()


@contextlib.contextmanager
def server(engine, path, args, log_path, timeout=300):
    """a server process on a free port, up once its health URL answers 200: yields (url, startup s, log tail())"""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port, t = str(sock.getsockname()[1]), str(args.threads)
    if engine == "cpufuse":
        cmd, health = [sys.executable, "-m", "cpufuse", "serve", path, "--parallel", str(args.parallel), "--n-ctx",
                       str(args.n_ctx), "--threads", t, "--chunk", str(args.chunk), "--batch-tokens",
                       str(args.batch_tokens), "--log-level", "warning"], "/health"
    else:
        cmd, health = [args.peer_python, "-m", "llama_cpp.server", "--model", path, "--n_ctx", str(args.n_ctx),
                       "--n_threads", t, "--n_threads_batch", t, "--interrupt_requests", "False", "--verbose",
                       "False"], "/v1/models"
    url, t0 = f"http://127.0.0.1:{port}", time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", port], stdout=log, stderr=subprocess.STDOUT,
                                cwd=ROOT)
    tail = lambda: open(log_path, errors="replace").read()[-600:].strip()   # noqa: E731
    try:
        while not up(url + health):
            if proc.poll() is not None or time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"{engine} server exited ({proc.returncode}) or not up in {timeout} s: {tail()}")
            time.sleep(0.5)
        yield url, time.perf_counter() - t0, tail
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.unlink(log_path)


def up(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def worker(job):
    """the decode step: one decoder call for the next token of k sequences at STEP_POS, on the server's plan"""
    import numpy as np

    from cpufuse.llama import Model
    from cpufuse.llama.decoder import Batch
    m = Model.load(job["path"], n_ctx=job["n_ctx"], n_threads=job["threads"], n_seq=max(STEP_SIZES))
    cap = (max(job["chunk"], job["batch_tokens"]) + m.n_seq, m.n_seq, m.n_seq)   # BatchEngine's plan capacity
    tok = m.tokenizer.tokenize("The", add_bos=False)[0]
    batches, times = {}, {k: [] for k in STEP_SIZES}
    for k in STEP_SIZES:
        b = batches[k] = Batch(m)
        for s in range(k):
            b.add(s, [tok], STEP_POS, logits=True)
        for _ in range(3):                                       # warm-up: compiles each plan size once
            rows = b.run(m.decoder, cap, n_threads=job["threads"])
            assert rows.shape[0] == k and np.isfinite(rows).all()
    for r in range(job["rounds"]):
        for k in STEP_SIZES[r % 3:] + STEP_SIZES[:r % 3]:
            for _ in range(job["iters"]):
                t0 = time.perf_counter()
                batches[k].run(m.decoder, cap, n_threads=job["threads"])
                times[k].append(time.perf_counter() - t0)
    return {str(k): {"median_ms": median(v) * 1e3, "min_ms": min(v) * 1e3, "n": len(v)} for k, v in times.items()}


def summarize(runs):
    """{engine: {clients: {metric: median over rounds}}} of one model's runs"""
    out = {}
    for e in ENGINES:
        levels = {}
        for row in (row for run in runs if run["engine"] == e for row in run.get("levels") or ()):
            levels.setdefault(row["clients"], []).append(row)
        out[e] = {c: {**{k: median([r[k] for r in rows]) for k in METRICS}, "rounds": len(rows),
                      "counted": sorted({x for r in rows for x in r["counted"]})} for c, rows in sorted(levels.items())}
    return out


def cell(summary, engine, clients, key):
    v = summary.get(engine, {}).get(clients, {}).get(key)
    return float("nan") if v is None else v


def checks(res, issue_model):
    """the issue's four performance checks on SmolLM2: [(name, ratio, target, ok, why not measured)]"""
    m = res["models"].get(issue_model)
    if m is None:
        return []
    s, st = m["summary"], m.get("step") or {}
    cf = lambda c, k: cell(s, "cpufuse", c, k)   # noqa: E731
    step = st["8"]["median_ms"] / st["1"]["median_ms"] if st else float("nan")
    rows = [("aggregate tok/s at 8 clients / at 1 client (cpufuse)", cf(8, "tok_s") / cf(1, "tok_s"), 3, ""),
            ("aggregate tok/s at 8 clients, cpufuse / llama-cpp-python",
             cf(8, "tok_s") / cell(s, "llama-cpp-python", 8, "tok_s"), 2,
             f"peer skipped: {res['peer_skipped']}" if res["peer_skipped"] else ""),
            ("TTFT p95 at 8 clients / single-client TTFT (p50 at 1 client; cpufuse)",
             cf(8, "ttft_p95") / cf(1, "ttft_p50"), -3, ""),
            ("decode step over 8 sequences / over 1 sequence", step, -2, "")]
    # target > 0: ratio >= target; < 0: ratio <= -target
    return [(name, r, (">= " if t > 0 else "<= ") + str(abs(t)), r >= t if t > 0 else r <= -t,
             why or "not measured in this run" if r != r else "") for name, r, t, why in rows]


def write_md(res, path):
    a, m = res["args"], res["machine"]
    L = ["# Serving: cpufuse's OpenAI-compatible server vs llama-cpp-python's (`python -m bench.e2e.serve`)", "",
         f"Machine: {m['cpu']}, {m['ncpu_affinity']} CPUs in the affinity, Python {m['python']}, cpufuse {m['cpufuse']} "
         f"(ISA {m['cpufuse_isa']}), llama-cpp-python {res['peer_version'] or '–'}. Load average at start "
         f"{res['load_start']:.2f}, at end {res['load_end']:.2f}; run time {res['seconds'] / 60:.1f} min; {res['date']}.",
         "", f"Settings: {a['threads']} threads for both servers (unpinned); n_ctx {a['n_ctx']} per sequence; cpufuse "
         f"`--parallel {a['parallel']} --chunk {a['chunk']} --batch-tokens {a['batch_tokens']}`; llama-cpp-python "
         f"`--interrupt_requests False`. Levels {', '.join(map(str, a['clients']))} clients, each sending "
         f"{a['requests']} streaming request(s) of {a['max_tokens']} greedy tokens back to back; {a['rounds']} round(s), "
         "engines alternating; medians over rounds. The columns: bench/README.md, \"bench.e2e.serve\".", ""]
    if res["peer_skipped"]:
        L += [f"**llama-cpp-python skipped:** {res['peer_skipped']}", ""]
    for name, mres in res["models"].items():
        s = mres["summary"]
        L += [f"## {name}: `{os.path.basename(mres['path'])}` ({mres['endpoint']} endpoint)", ""]
        L += [f"- {run['engine']} round {run['round']}: **failed**: {run['error']}" for run in mres["runs"]
              if run.get("error")]
        rows = []
        for c in a["clients"]:
            cf, pe = (lambda k: cell(s, "cpufuse", c, k)), (lambda k: cell(s, "llama-cpp-python", c, k))
            rows.append([c, fmt(cf("tok_s")), fmt(pe("tok_s")), ratio(cf("tok_s"), pe("tok_s")),
                         ratio(cf("tok_s"), cell(s, "cpufuse", 1, "tok_s"))]
                        + [f"{fmt(cf(k) * 1e3)} / {fmt(pe(k) * 1e3)}" for k in METRICS[1:5]])
        L += table(["clients", "cpufuse tok/s", "llama-cpp-python tok/s", "cpufuse / peer", "cpufuse × 1 client"]
                   + [f"{k.split('_')[0].upper()} {k.split('_')[1]} ms cpufuse / peer" for k in METRICS[1:5]], rows, "---:")
        crow = [r for run in mres["runs"] for r in run.get("constrained") or ()]
        if crow:
            c, ctok = crow[0]["clients"], median([r["tok_s"] for r in crow])
            L += ["", f"Constrained: {c} clients, every request under a JSON schema (`response_format` json_schema, "
                  f"a list of >= 256 strings, so every request runs to max_tokens), cpufuse: {fmt(ctok)} tok/s = "
                  f"{fmt(ctok / cell(s, 'cpufuse', c, 'tok_s'), 3)}× its unconstrained "
                  f"{fmt(cell(s, 'cpufuse', c, 'tok_s'))} tok/s at {c} clients (target: >= 0.95 on SmolLM2, >= 0.98 on "
                  f"the 1B shapes); TTFT p50 {fmt(median([r['ttft_p50'] for r in crow]) * 1e3)} ms, ITL p50 "
                  f"{fmt(median([r['itl_p50'] for r in crow]) * 1e3)} ms."]
        chunks = {e: [sum(r.get(k, 0) for run in mres["runs"] if run["engine"] == e for r in run.get("levels") or ())
                      for k in ("output_tokens", "content_chunks")] for e in ENGINES}
        L += [f"\n{e}: {c} content chunks for {t} tokens (text held back until it decodes), so its ITL reads high by "
              "about that ratio." for e, (t, c) in chunks.items() if t and c < 0.95 * t]
        st = mres.get("step")
        if st:
            L += ["", f"Decode step (one decoder call, the next token of k sequences at position {STEP_POS}, on the "
                  f"server's plan; median (min) of {st['1']['n']} calls, sizes alternating): " + ", ".join(
                      f"{k} seq {v['median_ms']:.2f} ms ({v['min_ms']:.2f}), {v['median_ms'] / st['1']['median_ms']:.2f}× "
                      "the 1-seq median" for k, v in st.items()) + "."]
        elif mres.get("step_error"):
            L += ["", f"Decode step: failed: {mres['step_error']}"]
        L += [""]
    L += ["## The issue's performance checks (SmolLM2, all cores)", ""]
    L += table(["check", "measured", "target", "result"],
               [[name, f"{fmt(r, 2)}×", lim, (note if r != r else "pass" if ok else "**fail**") or "not measured"]
                for name, r, lim, ok, note in res["checks"]] or [["(SmolLM2 not in this run)", "", "", ""]])
    L += ["", f"![tok/s and TTFT against clients]({os.path.basename(path)[:-3]}.png)" if res.get("chart") == "ok"
          else f"Chart: {res.get('chart')}", ""]
    save(path, "\n".join(L))


def write_chart(res, path):
    plt, why = plot_setup()
    if why:
        return why
    names, clients = list(res["models"]), res["args"]["clients"]
    fig, axes = plt.subplots(2, len(names), figsize=(5.5 * len(names), 7.5), squeeze=False)
    style = {"cpufuse": dict(color="#173f7a", marker="o"), "llama-cpp-python": dict(color="#3fa34d", marker="s")}
    for j, name in enumerate(names):
        s = res["models"][name]["summary"]
        for i, (key, label, scale) in enumerate((("tok_s", "aggregate output tok/s", 1), ("ttft_p95", "TTFT p95 (ms)",
                                                                                           1e3))):
            ax = axes[i][j]
            for e in ENGINES:
                cs = sorted(s.get(e, {}))
                if cs:
                    ax.plot(cs, [s[e][c][key] * scale for c in cs], label=e, **style[e])
            ax.set_xscale("log", base=2)
            ax.set_xticks(clients, [str(c) for c in clients])
            ax.set_yscale("log" if i else "linear")
            ax.set(xlabel="concurrent clients", ylabel=label)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        axes[0][j].set_title(f"{name}: {res['args']['max_tokens']} greedy tokens a request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "ok"


def constrained_ab(args):
    """constrained against plain greedy decoding of --clients sequences in one BatchEngine, alternating rounds:
    wall and process CPU time per token (docs/serve.md)"""
    from cpufuse.llama import Model
    from cpufuse.llama.constrain import Constraint
    from cpufuse.serve.batch import BatchEngine
    from cpufuse.serve.engine import EngineRequest, SamplingParams, TokenEvent
    n = args.clients[0]
    m = Model.load(model_path(args.models[0]), n_ctx=64 + args.max_tokens * 2, n_seq=n, n_threads=args.threads)
    c = Constraint.from_options(m.tokenizer, json_schema=BENCH_SCHEMA)
    eng = BatchEngine(m, chunk=128, mask_thread=not args.serial_masks)
    eng.start()

    def run(constrained):
        reqs = [EngineRequest(m.tokenizer.tokenize(f"List {i} things.", add_bos=False), args.max_tokens,
                              SamplingParams(temperature=0), stop_ids=frozenset(), constraint=c if constrained else None)
                for i in range(n)]
        c0, w0 = time.process_time(), time.perf_counter()
        k = sum(1 for h in [eng.submit(r) for r in reqs] for ev in h if isinstance(ev, TokenEvent))
        return (time.perf_counter() - w0) / k, (time.process_time() - c0) / k

    try:
        run(False)
        run(True)
        res = {False: [], True: []}
        for r in range(args.rounds):
            for k in ((False, True) if r % 2 == 0 else (True, False)):
                res[k].append(run(k))
    finally:
        eng.stop()
    med = {k: (median([x[0] for x in v]), median([x[1] for x in v])) for k, v in res.items()}
    for k, name in ((False, "plain"), (True, "constrained")):
        print(f"{name:>12}: wall {med[k][0] * 1e6:8.0f} us/token, CPU {med[k][1] * 1e6:8.0f} us/token")
    print(f"throughput constrained / plain: wall {med[False][0] / med[True][0]:.3f}, CPU {med[False][1] / med[True][1]:.3f}"
          f"  ({n} sequences, {args.threads} threads, {args.rounds} rounds, masks "
          f"{'serial' if args.serial_masks else 'in the worker thread'})")


def int_list(s):
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.e2e.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,1b", help="smollm2, 1b, models of "
                    "`python -m cpufuse models` and/or GGUF paths, comma-separated")
    for flag, default, what in (
            ("--max-tokens", 128, "tokens per request"), ("--requests", 2, "requests per client, back to back"),
            ("--rounds", 1, "rounds of both engines per model"), ("--parallel", 16, "cpufuse --parallel"),
            ("--n-ctx", 512, "context per sequence, both servers"), ("--threads", NCPU, "threads of both servers"),
            ("--chunk", 128, "cpufuse --chunk"), ("--batch-tokens", 128, "cpufuse --batch-tokens"),
            ("--constrained-clients", 8, "clients of the constrained (JSON schema) row, cpufuse only; 0 skips it"),
            ("--step-rounds", 5, "decode-step rounds; 0 skips it"),
            ("--step-iters", 30, "decoder calls per size per round")):
        ap.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    ap.add_argument("--clients", type=int_list, default="1,4,8,16", help="concurrency levels (default 1,4,8,16)")
    ap.add_argument("--peer-python", default=os.path.join(ROOT, ".venv-llama", "bin", "python"),
                    help="interpreter with llama-cpp-python and its server extras (default .venv-llama)")
    ap.add_argument("--out", default=os.path.join("bench", "results", "serve"),
                    help="writes OUT.json, OUT.md, OUT.png (default bench/results/serve)")
    ap.add_argument("--url", help="only drive this running server (with or without /v1) and print the table")
    ap.add_argument("--endpoint", choices=("chat", "completions"), help="with --url (default chat)")
    ap.add_argument("--extra-body", type=json.loads, help="with --url: a JSON object of fields added to every request")
    ap.add_argument("--json", help="with --url: also write the levels here")
    ap.add_argument("--constrained-ab", action="store_true", help="constrained / plain decoding in one process "
                    "(the first model, the first --clients sequences, --rounds rounds; no servers)")
    ap.add_argument("--serial-masks", action="store_true", help="with --constrained-ab: fill the masks on the "
                    "engine thread before each step (BatchEngine(mask_thread=False))")
    args = ap.parse_args(argv)
    args.models = [x.strip() for x in args.models.split(",") if x.strip()]
    lows = dict(max_tokens=1, requests=1, rounds=1, n_ctx=1, threads=1, chunk=1, batch_tokens=1, step_iters=1,
                step_rounds=0, constrained_clients=0)
    if not args.url:   # cpufuse's server takes every client at once, and 16 sequences for the decode step
        lows["parallel"] = max(args.clients + [max(STEP_SIZES)] * bool(args.step_rounds))
    bad = [f"--{k.replace('_', '-')} must be >= {lo}" for k, lo in lows.items() if getattr(args, k) < lo]
    if bad or not args.clients or min(args.clients) < 1:
        ap.error("; ".join(bad) or f"--clients must be >= 1, got {args.clients}")
    for a in ap._actions:   # parse again with no defaults: the flags given, each of which the mode must use
        a.default = argparse.SUPPRESS
    given = set(vars(ap.parse_args(argv)))
    if args.url and args.constrained_ab:
        ap.error("--url and --constrained-ab are two different runs: give one")
    mode, uses = (("--url", {"url", "clients", "max_tokens", "requests", "endpoint", "extra_body", "json"}) if args.url
                  else ("--constrained-ab", {"constrained_ab", "models", "clients", "max_tokens", "rounds", "threads",
                                             "serial_masks"}) if args.constrained_ab
                  else ("the server bench", set(vars(args)) - {"url", "endpoint", "extra_body", "json", "serial_masks"}))
    unused = sorted(given - uses)
    if unused:
        ap.error(f"{mode} does not use " + ", ".join("--" + d.replace("_", "-") for d in unused))
    args.endpoint = args.endpoint or "chat"
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        ap.error(f"--extra-body must be a JSON object, got {args.extra_body!r}")
    return args


def run_model(res, name, path, engines, mi, args):
    """one model: the decode step, then each round both servers under load (order alternating)"""
    from cpufuse.llama.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(path)
    eog, endpoint = sorted(int(i) for i in tok.eog_ids), "chat" if tok.chat_template else "completions"
    mres = res["models"][name] = dict(path=path, endpoint=endpoint, eog_ids=eog, runs=[])
    if args.step_rounds:
        print(f"[{name}] decode step: 1, 8, 16 sequences", flush=True)
        mres["step"], mres["step_error"] = run_job(
            dict(worker="serve", path=path, n_ctx=args.n_ctx, threads=args.threads, chunk=args.chunk,
                 batch_tokens=args.batch_tokens, rounds=args.step_rounds, iters=args.step_iters), timeout=1800)
        print("  " + (", ".join(f"{k} seq {v['median_ms']:.2f} ms" for k, v in mres["step"].items()) if mres["step"]
                      else f"failed: {mres['step_error']}"), flush=True)
    load = lambda url, extra, clients: asyncio.run(drive(  # noqa: E731
        url, endpoint, clients, args.requests, args.max_tokens, extra))[1]
    for r in range(args.rounds):
        for e in engines if (mi + r) % 2 == 0 else engines[::-1]:
            run = dict(engine=e, round=r)
            mres["runs"].append(run)
            print(f"[{name}] round {r + 1}/{args.rounds}: {e} server", flush=True)
            try:
                with server(e, path, args, os.path.join(os.path.dirname(os.path.abspath(args.out)),
                                                        f".serve-{e}.log")) as (url, run["startup_s"], tail):
                    try:
                        run["levels"] = load(url, e != "cpufuse" and {"logit_bias": {str(i): -1000 for i in eog}},
                                             args.clients)
                        if e == "cpufuse" and args.constrained_clients:
                            print(f"  constrained (json_schema) at {args.constrained_clients} clients", flush=True)
                            run["constrained"] = load(url, CONSTRAINED_BODY, [args.constrained_clients])
                    except Exception as ex:  # noqa: BLE001 -- a failed engine is reported, the run goes on
                        raise RuntimeError(f"{type(ex).__name__}: {ex}; server log: {tail()}") from ex
            except RuntimeError as ex:
                run["error"] = str(ex)
                print(f"  failed: {ex}", flush=True)
    mres["summary"] = summarize(mres["runs"])


def load_table(args):
    """--url: the levels against a running server, printed as a table"""
    model, rows = asyncio.run(drive(args.url, args.endpoint, args.clients, args.requests, args.max_tokens,
                                    args.extra_body))
    base = next((r["tok_s"] for r in rows if r["clients"] == 1), None)
    print(f"Server {args.url}, model `{model}`, endpoint {args.endpoint}, {args.max_tokens} greedy tokens a request, "
          f"{args.requests} request(s) per client.\n")
    print("\n".join(table(["clients", "requests", "output tok/s", "× 1 client", "TTFT p50 ms", "TTFT p95 ms",
                           "ITL p50 ms", "ITL p95 ms", "per-request tok/s", "counted"],
                          [[r["clients"], r["requests"], fmt(r["tok_s"]), ratio(r["tok_s"], base)]
                           + [fmt(r[k] * 1e3) for k in METRICS[1:5]] + [fmt(r["req_decode_tok_s"]),
                                                                          ", ".join(r["counted"])] for r in rows], "---:")))
    if args.json:
        save(args.json, dict(url=args.url, model=model, endpoint=args.endpoint, max_tokens=args.max_tokens,
                             requests=args.requests, levels=rows))


def main(argv=None):
    args = parse_args(argv)
    if args.constrained_ab or args.url:
        return (constrained_ab if args.constrained_ab else load_table)(args)
    t_start = time.perf_counter()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    peer_skipped, peer_version = server_status(args.peer_python)
    if peer_skipped:
        print(f"bench.e2e.serve: llama-cpp-python columns skipped: {peer_skipped}", flush=True)
    res = dict(machine=machine(), load_start=os.getloadavg()[0], date=time.strftime("%Y-%m-%d %H:%M %Z"),
               peer_version=peer_version, peer_skipped=peer_skipped, args=vars(args), models={})
    engines = [e for e in ENGINES if not (peer_skipped and e != "cpufuse")]
    for mi, name in enumerate(args.models):
        run_model(res, name if name in ("smollm2", "1b") else os.path.splitext(os.path.basename(name))[0],
                  model_path(name), engines, mi, args)
    res.update(load_end=os.getloadavg()[0], seconds=time.perf_counter() - t_start, checks=checks(res, "smollm2"))
    res["chart"] = write_chart(res, args.out + ".png")
    save(args.out + ".json", res)
    write_md(res, args.out + ".md")
    print(f"bench.e2e.serve: wrote {args.out}.md, .json{', .png' if res['chart'] == 'ok' else ''}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
