"""Load generator for an OpenAI-compatible server: N concurrent streaming clients.

    python -m bench.e2e.load --url http://127.0.0.1:8080 [--clients 1,4,8,16] [--max-tokens 128]
                               [--rounds 2] [--endpoint chat|completions] [--json PATH]
                               [--extra-body JSON]

Details: bench/README.md, "bench.e2e.load".
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

TOPICS = ["the sea", "a mountain village", "an old library", "a train journey", "a winter market",
          "a lighthouse keeper", "a garden in spring", "a night in the desert"]


def prompt_text(client: int, rnd: int) -> str:
    topic = TOPICS[(client + rnd) % len(TOPICS)]
    return f"Request {client}.{rnd}: write a long, detailed story about {topic}, with many characters."


def pct(xs, q):
    """the q-quantile (0..1) by linear interpolation; NaN for no data"""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def one_request(http, url, model, endpoint, text, max_tokens, extra=None):
    """stream one request; returns dict(t0, chunks=[times of content chunks], end, tokens, counted)"""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **(extra or {})}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = text
        path = "/v1/completions"
    t0 = time.perf_counter()
    chunks, usage, finish = [], None, None
    async with http.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"{path}: stream error: {obj['error']}")
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices") or ():
                finish = ch.get("finish_reason") or finish
                piece = (ch.get("delta") or {}).get("content") if endpoint == "chat" else ch.get("text")
                if piece:
                    chunks.append(time.perf_counter())
    end = time.perf_counter()
    if usage and "completion_tokens" in usage:
        tokens, counted = usage["completion_tokens"], "usage"
    elif finish == "length":
        tokens, counted = max_tokens, "length"
    else:
        tokens, counted = len(chunks), "chunks"
    return dict(t0=t0, chunks=chunks, end=end, tokens=tokens, counted=counted)


async def level(url, model, endpoint, n_clients, rounds, max_tokens, extra=None):
    import httpx
    limits = httpx.Limits(max_connections=n_clients + 2, max_keepalive_connections=n_clients + 2)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        async def client(i):
            return [await one_request(http, url, model, endpoint, prompt_text(i, r), max_tokens, extra)
                    for r in range(rounds)]
        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(client(i) for i in range(n_clients)))
        wall = time.perf_counter() - t0
    reqs = [r for rs in per_client for r in rs]
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


async def run(args):
    import httpx
    url = args.url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.get(url + "/v1/models")
        r.raise_for_status()
        model = args.model or r.json()["data"][0]["id"]
    # warm-up: one short request (compiles, faults the weights in)
    async with httpx.AsyncClient(timeout=None) as http:
        await one_request(http, url, model, args.endpoint, "Hello.", 8, args.extra_body)
    out = []
    for n in args.clients:
        res = await level(url, model, args.endpoint, n, args.rounds, args.max_tokens, args.extra_body)
        out.append(res)
        print(f"  {n:>3} clients: {res['tok_s']:8.1f} tok/s, TTFT p50 {res['ttft_p50'] * 1e3:7.1f} ms "
              f"p95 {res['ttft_p95'] * 1e3:7.1f} ms, ITL p50 {res['itl_p50'] * 1e3:6.1f} ms "
              f"p95 {res['itl_p95'] * 1e3:6.1f} ms", file=sys.stderr, flush=True)
    return model, out


def table(model, url, rows, args) -> str:
    lines = [f"Server {url}, model `{model}`, endpoint {args.endpoint}, {args.max_tokens} greedy tokens a request, "
             f"{args.rounds} request(s) per client.", "",
             "| clients | requests | output tok/s | × 1 client | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms "
             "| per-request tok/s | counted |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    base = next((r["tok_s"] for r in rows if r["clients"] == 1), None)
    for r in rows:
        rel = f"{r['tok_s'] / base:.2f}×" if base else "–"
        lines.append(f"| {r['clients']} | {r['requests']} | {r['tok_s']:.1f} | {rel} | {r['ttft_p50'] * 1e3:.1f} "
                     f"| {r['ttft_p95'] * 1e3:.1f} | {r['itl_p50'] * 1e3:.1f} | {r['itl_p95'] * 1e3:.1f} "
                     f"| {r['req_decode_tok_s']:.1f} | {', '.join(r['counted'])} |")
    return "\n".join(lines) + "\n"


def add_load_args(ap, requests_flag="--rounds"):
    """the load's options (bench.e2e.serve shares them): --clients, --max-tokens, requests per client"""
    ap.add_argument("--clients", default="1,4,8,16", help="concurrency levels, comma-separated (default 1,4,8,16)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default 128)")
    ap.add_argument(requests_flag, type=int, default=2, help="requests per client, back to back (default 2)")


def check_load_args(ap, args, requests="rounds"):
    """parse --clients into a list and check the load's options (ap.error on bad values); `requests`:
    the attribute that holds the requests per client"""
    try:
        args.clients = [int(x) for x in args.clients.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--clients must be comma-separated integers, got {args.clients!r}")
    if not args.clients or min(args.clients) < 1:
        ap.error(f"--clients must be >= 1, got {args.clients}")
    if args.max_tokens < 1 or getattr(args, requests) < 1:
        ap.error(f"--max-tokens and --{requests} must be >= 1")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.e2e.load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (with or without /v1)")
    add_load_args(ap)
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    ap.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--extra-body", default=None,
                    help='JSON object of fields added to every request, e.g. \'{"logit_bias": {"2": -1000}}\'')
    args = ap.parse_args(argv)
    try:
        args.extra_body = json.loads(args.extra_body) if args.extra_body else None
    except ValueError as e:
        ap.error(f"--extra-body must be a JSON object, got {args.extra_body!r}: {e}")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        ap.error(f"--extra-body must be a JSON object, got {args.extra_body!r}")
    check_load_args(ap, args)
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        import httpx  # noqa: F401
    except ImportError:
        print("bench.e2e.load needs httpx: pip install cpufuse[bench]", file=sys.stderr)
        return 2
    model, rows = asyncio.run(run(args))
    print(table(model, args.url, rows, args), end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(url=args.url, model=model, endpoint=args.endpoint, max_tokens=args.max_tokens,
                           rounds=args.rounds, levels=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
