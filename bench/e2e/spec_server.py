"""llama.cpp's llama-server as a peer of bench/e2e/spec.py (--peer-llama-server PATH): two servers on
the same GGUF, one plain and one with its n-gram speculation (default `--spec-type ngram-simple
--spec-draft-n-max 64`, the command llama.cpp's docs/speculative.md gives; no draft model). Each
prompt's token ids go to POST /completion greedily (temperature 0, top_k 1), once with n_predict 1
so the prompt is cached, then timed. Decode tok/s are the server's own timings (predicted_n /
predicted_ms); CPU seconds are the server process's utime + stime over the timed request
(/proc/PID/stat). The servers inherit this process's CPU affinity (taskset)."""
import json
import os
import shlex
import socket
import subprocess
import time
import urllib.error
import urllib.request

DEFAULT_SPEC = "--spec-type ngram-simple --spec-draft-n-max 64"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid):
    """utime + stime of process pid, seconds (all its threads)"""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


class LlamaServer:
    """one llama-server process; .complete(ids, n) -> dict (tokens, decode wall and CPU seconds,
    drafted and accepted counts)"""

    def __init__(self, binary, model, threads, n_ctx, extra="", log=None):
        self.port = _free_port()
        cmd = [binary, "-m", model, "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-np", "1",
               "--host", "127.0.0.1", "--port", str(self.port)] + shlex.split(extra)
        self.log = open(log or os.devnull, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.cmd = " ".join(shlex.quote(c) for c in cmd)
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise OSError(f"llama-server exited with {self.proc.returncode}: {self.cmd}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.time() - t0 > 300:
                self.close()
                raise OSError(f"llama-server did not become healthy in 300 s: {self.cmd}")
            time.sleep(0.5)

    def _post(self, body):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.load(r)

    def complete(self, ids, n_predict):
        body = {"prompt": [int(t) for t in ids], "temperature": 0.0, "top_k": 1, "seed": 0, "cache_prompt": True,
                "return_tokens": True, "stream": False}
        self._post(dict(body, n_predict=1))                # the prompt is evaluated and cached
        c0 = _cpu_s(self.proc.pid)
        r = self._post(dict(body, n_predict=n_predict))
        cpu = _cpu_s(self.proc.pid) - c0
        t = r.get("timings", {})
        return {"tokens": [int(x) for x in r.get("tokens", [])], "n": int(t.get("predicted_n", 0)),
                "wall_s": t.get("predicted_ms", float("nan")) / 1e3, "cpu_s": cpu,
                "drafted": int(t.get("draft_n", 0)), "accepted": int(t.get("draft_n_accepted", 0))}

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class ServerPeer:
    """the plain and the speculative llama-server, started once per thread count"""

    def __init__(self, binary, model, threads, n_ctx, spec_args=DEFAULT_SPEC, log_dir=None):
        lg = (lambda h: os.path.join(log_dir, f"llama-server-{h}-t{threads}.log")) if log_dir else (lambda h: None)
        self.spec_args = spec_args
        self.srv = {"plain": LlamaServer(binary, model, threads, n_ctx, log=lg("plain"))}
        try:
            self.srv["spec"] = LlamaServer(binary, model, threads, n_ctx, spec_args, log=lg("spec"))
        except OSError:
            self.close()
            raise

    def run(self, ids, n_predict, spec_first):
        return {h: self.srv[h].complete(ids, n_predict) for h in (("spec", "plain") if spec_first else ("plain", "spec"))}

    def close(self):
        for s in self.srv.values():
            s.close()


def summary(results, cpufuse_outs, eog=()):
    """totals of ServerPeer.run results (one per prompt) as spec.py's peer columns; a stop token
    the server returns at the end is left out of the comparisons (cpufuse's tokens leave it out)"""
    eog = set(eog)

    def ids(x):
        t = x["tokens"]
        return t[:-1] if t and t[-1] in eog else t
    n = {h: sum(x[h]["n"] for x in results) for h in ("plain", "spec")}
    w = {h: sum(x[h]["wall_s"] for x in results) for h in ("plain", "spec")}
    c = {h: sum(x[h]["cpu_s"] for x in results) for h in ("plain", "spec")}
    d, a = sum(x["spec"]["drafted"] for x in results), sum(x["spec"]["accepted"] for x in results)
    return {"plain_tps": n["plain"] / w["plain"], "spec_tps": n["spec"] / w["spec"],
            "speedup": (n["spec"] / w["spec"]) / (n["plain"] / w["plain"]),
            "speedup_cpu": (n["spec"] / c["spec"]) / (n["plain"] / c["plain"]) if c["spec"] > 0 else float("nan"),
            "drafted": d, "accepted": a,
            "same_as_its_plain": sum(ids(x["plain"]) == ids(x["spec"]) for x in results),
            "same_as_cpufuse": sum(ids(x["plain"]) == list(o) for x, o in zip(results, cpufuse_outs)),
            "prompts": len(results)}
