"""Load generator for an OpenAI-compatible server: N concurrent streaming clients.

    python -m bench.e2e.load --url http://127.0.0.1:8080 [--clients 1,4,8,16] [--max-tokens 128]
                               [--rounds 2] [--endpoint chat|completions] [--json PATH] [--extra-body JSON]

Details: bench/README.md, "bench.e2e.load".
"""
import argparse
import asyncio
import json
import statistics
import sys
import time

from . import fmt, ratio, table

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


async def level(url, model, endpoint, n_clients, rounds, max_tokens, extra=None):
    """n_clients clients at once, each sending `rounds` requests back to back: the level's figures"""
    import httpx
    limits = httpx.Limits(max_connections=n_clients + 2, max_keepalive_connections=n_clients + 2)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        async def client(i):
            return [await one_request(http, url, model, endpoint, f"Request {i}.{r}: write a long, detailed story "
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


async def run(url, endpoint, clients, rounds, max_tokens, extra=None, model=None):
    """a short warm-up request (compiles, faults the weights in), then each level: (model, [level rows])"""
    import httpx
    url = url.rstrip("/").removesuffix("/v1")
    async with httpx.AsyncClient(timeout=None) as http:
        r = await http.get(url + "/v1/models")
        r.raise_for_status()
        model = model or r.json()["data"][0]["id"]
        await one_request(http, url, model, endpoint, "Hello.", 8, extra)
    out = []
    for n in clients:
        out.append(res := await level(url, model, endpoint, n, rounds, max_tokens, extra))
        print(f"  {n:>3} clients: {res['tok_s']:8.1f} tok/s, TTFT p50 {res['ttft_p50'] * 1e3:7.1f} ms "
              f"p95 {res['ttft_p95'] * 1e3:7.1f} ms, ITL p50 {res['itl_p50'] * 1e3:6.1f} ms "
              f"p95 {res['itl_p95'] * 1e3:6.1f} ms", file=sys.stderr, flush=True)
    return model, out


def add_load_args(ap, requests_flag="--rounds"):
    """the load's options (bench.e2e.serve shares them): --clients, --max-tokens, requests per client"""
    ap.add_argument("--clients", default="1,4,8,16", help="concurrency levels, comma-separated (default 1,4,8,16)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default 128)")
    ap.add_argument(requests_flag, type=int, default=2, help="requests per client, back to back (default 2)")


def check_load_args(ap, args, requests="rounds"):
    """--clients into a list, and the load's options checked (ap.error on bad values)"""
    try:
        args.clients = [int(x) for x in args.clients.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--clients must be comma-separated integers, got {args.clients!r}")
    if not args.clients or min(args.clients) < 1:
        ap.error(f"--clients must be >= 1, got {args.clients}")
    if args.max_tokens < 1 or getattr(args, requests) < 1:
        ap.error(f"--max-tokens and --{requests} must be >= 1")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.e2e.load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (with or without /v1)")
    add_load_args(ap)
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    ap.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--extra-body", type=json.loads, default=None,
                    help='JSON object of fields added to every request, e.g. \'{"logit_bias": {"2": -1000}}\'')
    args = ap.parse_args(argv)
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        ap.error(f"--extra-body must be a JSON object, got {args.extra_body!r}")
    check_load_args(ap, args)
    model, rows = asyncio.run(run(args.url, args.endpoint, args.clients, args.rounds, args.max_tokens,
                                  args.extra_body, args.model))
    base = next((r["tok_s"] for r in rows if r["clients"] == 1), None)
    print(f"Server {args.url}, model `{model}`, endpoint {args.endpoint}, {args.max_tokens} greedy tokens a request, "
          f"{args.rounds} request(s) per client.\n")
    print("\n".join(table(["clients", "requests", "output tok/s", "× 1 client", "TTFT p50 ms", "TTFT p95 ms",
                           "ITL p50 ms", "ITL p95 ms", "per-request tok/s", "counted"],
                          [[r["clients"], r["requests"], fmt(r["tok_s"]), ratio(r["tok_s"], base)]
                           + [fmt(r[k] * 1e3) for k in ("ttft_p50", "ttft_p95", "itl_p50", "itl_p95")]
                           + [fmt(r["req_decode_tok_s"]), ", ".join(r["counted"])] for r in rows], "---:")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(url=args.url, model=model, endpoint=args.endpoint, max_tokens=args.max_tokens,
                           rounds=args.rounds, levels=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
