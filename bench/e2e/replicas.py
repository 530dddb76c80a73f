"""Throughput of the server with 1 replica of T threads against R replicas of T/R threads each, on one
machine: on Ray Serve (cpufuse.serve.ray; needs `pip install "cpufuse[ray]"`), or with `--plain` as
R plain `cpufuse serve` processes, each pinned to its own T/R cores, behind a round-robin client
(the set-up of docs/deploy.md's "plain replicas"; needs no Ray).

    python -m bench.e2e.replicas MODEL [--plain] [--threads 16] [--replicas 2] [--parallel 8]
                                 [--clients 16] [--rounds 2] [--max-tokens 128] [--json PATH]

Both set-ups have the same total threads and slots (the one replica gets replicas x parallel
slots); the load is bench.e2e.serve's (streaming clients, greedy, a distinct prompt per request).
With --alternate N the two set-ups run N times each, alternating. Prints each set-up's aggregate
output tok/s and the ratio.
"""
import argparse
import asyncio
import json
import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

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
    ap.add_argument("--plain", action="store_true", help="plain server processes, no Ray")
    ap.add_argument("--alternate", type=int, default=1, help="runs of each set-up, alternating (default 1)")
    a = ap.parse_args(argv)
    if a.threads % a.replicas:
        ap.error(f"--threads ({a.threads}) must be a multiple of --replicas ({a.replicas})")
    if a.plain:
        return plain(a)
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


@contextlib.contextmanager
def replicas(a, n):
    """n `cpufuse serve` processes, replica i pinned to cores [i*T/n, (i+1)*T/n): yields their URLs"""
    each, slots, procs, urls = a.threads // n, a.parallel * a.replicas // n, [], []
    try:
        for i in range(n):
            port = free_port()
            cores = f"{i * each}-{(i + 1) * each - 1}"
            cmd = ["taskset", "-c", cores, sys.executable, "-m", "cpufuse", "serve", a.model, "--threads", str(each),
                   "--parallel", str(slots), "--n-ctx", str(a.n_ctx), "--host", "127.0.0.1", "--port", str(port),
                   "--log-level", "warning"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            urls.append(f"http://127.0.0.1:{port}")
        t0 = time.time()
        for p, u in zip(procs, urls):
            while True:
                try:
                    with urllib.request.urlopen(u + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if p.poll() is not None or time.time() - t0 > 300:
                    raise RuntimeError(f"replica {u} did not start: {p.stderr.read()[-600:]!r}")
                time.sleep(0.5)
        yield urls
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def plain(a):
    runs = {1: [], a.replicas: []}
    if os.cpu_count() < a.threads:
        print(f"note: {a.threads} threads on {os.cpu_count()} CPUs", file=sys.stderr)
    for k in range(a.alternate):
        for n in (1, a.replicas):
            print(f"run {k + 1}: {n} plain replica(s) x {a.threads // n} threads, "
                  f"{a.parallel * a.replicas // n} slots each:", file=sys.stderr)
            with replicas(a, n) as urls:
                _, rows = asyncio.run(drive(urls, "completions", [a.clients], a.rounds, a.max_tokens))
            runs[n].append(dict(rows[0], replicas=n, threads_each=a.threads // n,
                                slots_each=a.parallel * a.replicas // n, run=k + 1))
    ratios = [r2["tok_s"] / r1["tok_s"] for r1, r2 in zip(runs[1], runs[a.replicas])]
    for r1, r2, q in zip(runs[1], runs[a.replicas], ratios):
        print(f"run {r1['run']}: 1 x {a.threads} threads: {r1['tok_s']:.1f} tok/s; {a.replicas} x "
              f"{a.threads // a.replicas} threads: {r2['tok_s']:.1f} tok/s; ratio {q:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"mode": "plain", "runs": runs[1] + runs[a.replicas], "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
