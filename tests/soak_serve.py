"""The server soak (`make soak`, outside the default test run): `python -m cpufuse serve` on a tiny
GGUF, driven for SOAK_SECONDS by N clients that stream, wait for whole replies, disconnect mid-way
and send bad requests, then checked:

- every accepted request completed (a finish_reason) or ended with a reason (an error object, or
  an SSE error event then [DONE]); a request the server refused is a 4xx/503 with an error body;
- the engine's books balance: requests submitted == requests finished (every reason), none
  running, none waiting: no slot leaked;
- the server's RSS after the warm-up (the first quarter, at least 20 s) stays within 5% of its
  first sample after the warm-up;
- SIGTERM then exits 0 without a traceback.

    python tests/soak_serve.py [--seconds 1800] [--clients 64] [--json out.json]

Prints a summary and exits 1 on a failed check.
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402

from _serving import free_port  # noqa: E402
from _tiny_gguf import write_tiny_gguf  # noqa: E402

N_CTX = 512
WORDS = "the a cat dog runs sleeps quickly blue red green tree house river sky".split()
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def metrics(url) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.n = {}
        self.bad = []                         # (kind, what) of a check that failed

    def add(self, key, ok=True, what=""):
        with self.lock:
            self.n[key] = self.n.get(key, 0) + 1
            if not ok:
                self.bad.append((key, what[:300]))


def _error_body(r) -> bool:
    try:
        e = r.json()["error"]
        return bool(e.get("message")) and "type" in e
    except (ValueError, KeyError, TypeError):
        return False


def body(rng, chat, stream):
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    b = {"max_tokens": rng.randint(1, 48), "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randint(0, 99),
         "stream": stream}
    if chat:
        b["messages"] = [{"role": "user", "content": text}]
    else:
        b["prompt"] = text
    if rng.random() < 0.2:
        b["stop"] = [rng.choice(WORDS)]
    return ("/v1/chat/completions" if chat else "/v1/completions"), b


BAD = [b"{not json", b"[1]", b'{"prompt": "x", "temperature": 9}', b'{"prompt": [1, 99999999]}',
       b'{"messages": "nope"}', b'{"prompt": "x", "n": 999}', b'{"prompt": "x", "max_tokens": 100000}',
       b'{"prompt": "x", "frobnicate": 1}']


def client(url, seed, t_end, tally: Tally):
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=120) as c:
        while time.time() < t_end:
            kind = rng.choices(["stream", "whole", "drop_stream", "drop_whole", "bad", "huge"],
                               [40, 20, 15, 8, 14, 3])[0]
            path, b = body(rng, rng.random() < 0.5, kind in ("stream", "drop_stream"))
            try:
                if kind == "stream":
                    with c.stream("POST", path, json=b) as r:
                        if r.status_code != 200:
                            tally.add("refused", r.status_code == 503 and _error_body(r), f"{r.status_code}")
                            continue
                        ev = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
                    ok = bool(ev) and ev[-1] == "[DONE]" and (
                        any('"finish_reason":"' in e for e in ev) or '"error"' in ev[-2])
                    tally.add("stream_error" if '"error"' in ev[-2] else "stream", ok, "|".join(ev[-3:]))
                elif kind == "whole":
                    r = c.post(path, json=b)
                    if r.status_code == 200:
                        ch = r.json()["choices"]
                        tally.add("whole", all(x["finish_reason"] in ("stop", "length") for x in ch), r.text)
                    else:
                        tally.add("refused" if r.status_code == 503 else "whole_error", _error_body(r), r.text)
                elif kind == "drop_stream":
                    b["max_tokens"] = 400
                    with c.stream("POST", path, json=b) as r:
                        it = r.iter_lines()
                        for _ in range(rng.randint(1, 6)):
                            next(it, None)
                    tally.add("dropped_stream")
                elif kind == "drop_whole":
                    b["max_tokens"] = 400
                    try:
                        c.post(path, json=b, timeout=rng.uniform(0.01, 0.3))
                        tally.add("drop_whole_finished")
                    except httpx.TimeoutException:
                        tally.add("dropped_whole")
                elif kind == "bad":
                    r = c.post("/v1/completions", content=rng.choice(BAD), headers={"Content-Type": "application/json"})
                    tally.add("bad", 400 <= r.status_code < 500 and _error_body(r), f"{r.status_code} {r.text}")
                else:                         # a body over --max-body
                    r = c.post("/v1/completions", content=b'{"prompt": "' + b"x" * (70 << 10) + b'"}')
                    tally.add("huge", r.status_code == 413 and _error_body(r), f"{r.status_code}")
            except httpx.HTTPError as e:
                tally.add("transport_error", False, f"{kind}: {type(e).__name__}: {e}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS", 1800)))
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the summary here")
    a = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="cpufuse-soak-")
    gguf = write_tiny_gguf(os.path.join(tmp, "tiny.gguf"), tied=False, n_ctx_train=N_CTX, chat_template=TEMPLATE)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logf = open(os.path.join(tmp, "server.log"), "w+")
    proc = subprocess.Popen([sys.executable, "-m", "cpufuse", "serve", gguf, "--port", str(port), "-c", str(N_CTX),
                             "-t", str(a.threads), "--parallel", str(a.parallel), "--chunk", "16",
                             "--max-queue", str(4 * a.clients), "--max-body", str(64 << 10), "--timeout", "60",
                             "--shutdown-timeout", "5", "--log-level", "warning"],
                            stdout=logf, stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() - t0 > 120:
            print("the server did not start"); logf.seek(0); print(logf.read()[-5000:])
            return 1
        time.sleep(0.1)
    tally = Tally()
    t_start = time.time()
    t_end = t_start + a.seconds
    warm = max(20.0, a.seconds / 4)
    rss = []                                  # (seconds since start, KiB)
    threads = [threading.Thread(target=client, args=(url, 1000 + i, t_end, tally), daemon=True)
               for i in range(a.clients)]
    for t in threads:
        t.start()
    while time.time() < t_end:
        rss.append((time.time() - t_start, rss_kib(proc.pid)))
        time.sleep(min(2.0, max(0.1, t_end - time.time())))
    for t in threads:
        t.join(180)
    # the disconnects' cancellations and the last requests settle
    deadline = time.time() + 30
    while True:
        m = metrics(url)
        fin = sum(v for k, v in m.items() if k.startswith("cpufuse_requests_finished_total"))
        if (m["cpufuse_requests_running"] == 0 and m["cpufuse_requests_waiting"] == 0
                and fin == m["cpufuse_requests_submitted_total"]) or time.time() > deadline:
            break
        time.sleep(0.2)
    health = httpx.get(url + "/health").json()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "killed"
    logf.seek(0)
    log = logf.read()
    after = [k for s, k in rss if s >= warm]
    base = after[0] if after else 0
    drift = (max(abs(k - base) for k in after) / base) if base else float("nan")
    finished = {k.split('"')[1]: int(v) for k, v in m.items() if k.startswith("cpufuse_requests_finished_total")}
    summary = {
        "seconds": a.seconds, "clients": a.clients, "parallel": a.parallel, "client_outcomes": tally.n,
        "submitted": int(m["cpufuse_requests_submitted_total"]), "finished": finished,
        "running_after": int(m["cpufuse_requests_running"]), "waiting_after": int(m["cpufuse_requests_waiting"]),
        "generated_tokens": int(m["cpufuse_generation_tokens_total"]), "health_after": health,
        "rss_kib_first": rss[0][1] if rss else None, "rss_kib_after_warmup": base,
        "rss_kib_max_after_warmup": max(after) if after else None, "rss_drift_after_warmup": drift,
        "exit_code": rc, "failed_checks": tally.bad[:20], "n_failed_checks": len(tally.bad),
    }
    checks = {
        "every client check passed": not tally.bad,
        "submitted == finished": sum(finished.values()) == summary["submitted"],
        "no slot leaked": summary["running_after"] == 0 and summary["waiting_after"] == 0
        and health.get("status") == "ok",
        "RSS within 5% after warm-up": drift <= 0.05,
        "exit 0 without a traceback": rc == 0 and "Traceback" not in log,
    }
    summary["checks"] = checks
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    if not all(checks.values()):
        print("soak FAILED:", [k for k, v in checks.items() if not v])
        print(log[-3000:])
        return 1
    print(f"soak passed: {summary['submitted']} requests in {a.seconds:g} s, RSS drift {drift:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
