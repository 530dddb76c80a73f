"""Throughput of the server on Ray Serve with 1 replica of T threads against R replicas of T/R threads
each, on one machine (cpufuse.serve.ray; needs `pip install "cpufuse[ray]"`).

    python -m bench.e2e.replicas MODEL [--threads 16] [--replicas 2] [--parallel 8] [--clients 16]
                                 [--rounds 2] [--max-tokens 128] [--json PATH]

Both set-ups run behind the same Ray Serve proxy with the same total threads and slots (the one
replica gets replicas x parallel slots); the load is bench.e2e.serve's (streaming clients, greedy,
a distinct prompt per request). Prints each set-up's aggregate output tok/s and the ratio.
"""
import argparse
import asyncio
import json
import socket
import sys

from bench.e2e.serve import drive


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=16, help="threads in all (default 16)")
    ap.add_argument("--replicas", type=int, default=2, help="replicas of the second set-up (default 2)")
    ap.add_argument("--parallel", type=int, default=8, help="slots per replica of the second set-up (default 8)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.threads % a.replicas:
        ap.error(f"--threads ({a.threads}) must be a multiple of --replicas ({a.replicas})")
    import ray
    from ray import serve

    from cpufuse.serve.ray import build_app
    ray.init(num_cpus=a.threads, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    out = {}
    try:
        for n in (1, a.replicas):
            args = {"model": a.model, "num_replicas": n, "num_cpus": a.threads // n,
                    "parallel": a.parallel * a.replicas // n, "n_ctx": a.n_ctx}
            print(f"{n} replica(s) x {a.threads // n} threads, {args['parallel']} slots each:", file=sys.stderr)
            serve.run(build_app(args), name="cpufuse", route_prefix="/")
            _, rows = asyncio.run(drive(url, "completions", [a.clients], a.rounds, a.max_tokens))
            out[n] = dict(rows[0], replicas=n, threads_each=a.threads // n, slots_each=args["parallel"])
            serve.delete("cpufuse")
    finally:
        serve.shutdown()
        ray.shutdown()
    ratio = out[a.replicas]["tok_s"] / out[1]["tok_s"]
    print(f"1 x {a.threads} threads: {out[1]['tok_s']:.1f} tok/s; {a.replicas} x {a.threads // a.replicas} threads: "
          f"{out[a.replicas]['tok_s']:.1f} tok/s; ratio {ratio:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": list(out.values()), "ratio": ratio}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
