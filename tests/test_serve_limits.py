"""The server in production: API keys, the queue and body limits, the request timeout, /health's
states (loading, ok, busy), a disconnect freeing its slot within one engine step, one request's
sampling failure ending that request only, and SIGTERM's graceful shutdown. Through the openai
client and raw HTTP; in-process uvicorn where a failure is injected, a subprocess for signals."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
pytest.importorskip("starlette", reason="the serve extra (pip install cpufuse[serve]) is not installed")
openai = pytest.importorskip("openai", reason="the openai client (test extra) is not installed")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from _serving import free_port, live, until  # noqa: E402
from _tiny_gguf import write_tiny_gguf  # noqa: E402
from cpufuse.llama import Model  # noqa: E402
from cpufuse.serve import create_app  # noqa: E402
from cpufuse.serve.batch import BatchEngine  # noqa: E402
from cpufuse.serve.guard import Limits  # noqa: E402

N_CTX = 4096
KEY = "sk-test-123"
LONG = dict(prompt="hello", max_tokens=N_CTX - 16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("limits") / "tiny.gguf", tied=False, n_ctx_train=N_CTX)


def engine(gguf, parallel=1, step_s=0.0):
    """a BatchEngine on the tiny model; step_s > 0 slows each step (the tiny model is fast enough to
    finish any request before a timeout or a disconnect is seen)"""
    e = BatchEngine(Model.load(gguf, n_ctx=N_CTX, n_seq=parallel, n_threads=1), chunk=8)
    if step_s:
        step = e._step
        e._step = lambda: (time.sleep(step_s), step())[1]
    return e


def metric(url, name, headers=None):
    for line in httpx.get(url + "/metrics", headers=headers).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def sse_events(resp):
    """the data payloads of an SSE response, in order"""
    return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


# ---------------------------------------------------------------------------------- keys and limits
def test_keys_queue_body_timeout_and_health(gguf, caplog):
    lim = Limits(api_keys=(KEY, "sk-second"), max_queue=1, max_body=4096, timeout=5.0)
    auth = {"Authorization": f"Bearer {KEY}"}
    with live(create_app(engine(gguf, parallel=1, step_s=0.003), limits=lim)) as url, \
            caplog.at_level("INFO", logger="cpufuse.serve"):
        good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        bad = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0, timeout=60)
        # keys: 401 with OpenAI's body; /health and /metrics open; either key of the list works
        with pytest.raises(openai.AuthenticationError) as ei:
            bad.completions.create(model="x", prompt="hi", max_tokens=2)
        assert ei.value.status_code == 401 and ei.value.body["code"] == "invalid_api_key"
        for path, kw in (("/v1/models", {}), ("/v1/completions", {"json": {"prompt": "hi"}}), ("/tokenize", {})):
            r = httpx.request("POST" if kw or path == "/tokenize" else "GET", url + path, **kw)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
            e = r.json()["error"]
            assert e["code"] == "invalid_api_key" and e["type"] == "invalid_request_error" and "API key" in e["message"]
        r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sk-second"})
        assert r.status_code == 200
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        assert metric(url, "cpufuse_parallel") == 1
        assert good.completions.create(model="x", prompt="hi", max_tokens=3, temperature=0).usage.completion_tokens >= 1

        # body: 413 by Content-Length and by a chunked body that grows past the limit
        big = json.dumps({"prompt": "x" * 5000, "max_tokens": 2}).encode()
        r = httpx.post(url + "/v1/completions", content=big, headers=dict(auth, **{"Content-Type": "application/json"}))
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        r = httpx.post(url + "/v1/completions", content=iter([big[:3000], big[3000:]]), headers=auth)
        assert r.status_code == 413, r.text
        with pytest.raises(openai.APIStatusError) as ei:
            good.completions.create(model="x", prompt="x" * 5000, max_tokens=2)
        assert ei.value.status_code == 413

        # queue: A runs in the one slot, B waits (the queue holds 1), C gets 503 + Retry-After;
        # /health says busy meanwhile (all within A's 5 s timeout; A's 4080 tokens take >= 12 s)
        with httpx.stream("POST", url + "/v1/completions", json=dict(LONG, stream=True), headers=auth,
                          timeout=60) as a:
            lines = a.iter_lines()
            next(lines)
            b_out = {}
            tb = threading.Thread(target=lambda: b_out.update(r=httpx.post(
                url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, headers=auth, timeout=60)))
            tb.start()
            until(lambda: metric(url, "cpufuse_requests_waiting") == 1, what="B waiting")
            h = httpx.get(url + "/health")
            assert h.status_code == 200 and h.json()["status"] == "busy" and h.json()["slots_idle"] == 0
            assert httpx.get(url + "/health?fail_on_no_slot=1").status_code == 503
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, headers=auth)
            assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
            with pytest.raises(openai.APIStatusError) as ei:
                good.completions.create(model="x", prompt="hi", max_tokens=4)
            assert ei.value.status_code == 503
        tb.join(60)
        assert b_out["r"].status_code == 200, b_out["r"].text   # B ran once A's client went

        # timeout: a stream ends with a last error event naming it, then [DONE]; a whole reply 504
        t0 = time.time()
        with httpx.stream("POST", url + "/v1/completions", json=dict(LONG, stream=True), headers=auth,
                          timeout=60) as r:
            ev = sse_events(r)
        assert 4.9 < time.time() - t0 < 60 and ev[-1] == "[DONE]"
        err = json.loads(ev[-2])["error"]
        assert err["code"] == "timeout" and "--timeout" in err["message"], err
        r = httpx.post(url + "/v1/completions", json=LONG, headers=auth, timeout=60)
        assert r.status_code == 504 and "timeout of 5 s" in r.json()["error"]["message"]
        until(lambda: metric(url, "cpufuse_requests_running") == 0, what="the timed-out requests released")
    logged = [rec.getMessage() for rec in caplog.records]
    assert sum("timeout of 5 s" in m for m in logged) >= 2, logged
    assert any(" 401 " in m for m in logged) and any(" 413 " in m for m in logged)


def test_protect_metrics_and_loading_state(gguf):
    gate = threading.Event()

    def load():                              # the model loads behind the bound port
        gate.wait(60)
        e = engine(gguf)
        return e
    app = create_app(load, limits=Limits(api_keys=KEY, protect_metrics=True))
    with live(app) as url:
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
        r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 503 and r.headers["retry-after"] and "Loading" in r.json()["error"]["message"]
        gate.set()
        until(lambda: httpx.get(url + "/health").status_code == 200, timeout=60, what="loaded")
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200

    def broken():
        raise ValueError("not a GGUF file")
    with live(create_app(broken)) as url:
        until(lambda: "failed to load" in httpx.get(url + "/health").text, what="the load failure reported")
        assert httpx.get(url + "/health").status_code == 503


def test_limits_check_their_arguments():
    for kw, word in ((dict(api_keys=("",)), "api_keys"), (dict(max_queue=-1), "max_queue"),
                     (dict(max_body=0), "max_body"), (dict(timeout=0), "timeout")):
        with pytest.raises(ValueError, match=word):
            Limits(**kw)


# ---------------------------------------------------------------------------------- faults
def test_disconnect_frees_the_slot_within_one_step(gguf):
    """The engine's steps are slowed to 30 ms, so the gap between the client's disconnect and the
    slot's release is counted in steps: at most one."""
    eng = engine(gguf, step_s=0.03)
    at = {}
    finish = eng._finish

    def watch(h, reason, *a, **k):
        if reason == "cancelled":
            at["released"] = eng.stats().steps
        return finish(h, reason, *a, **k)
    eng._finish = watch
    with live(create_app(eng)) as url:
        host, port = url.rsplit("/", 1)[-1].split(":")
        body = json.dumps(dict(LONG, stream=True)).encode()
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while got.count(b"data: ") < 4:      # a few tokens streamed
            got += s.recv(65536)
        at["closed"] = eng.stats().steps
        s.close()
        until(lambda: "released" in at, what="the slot released")
        assert at["released"] - at["closed"] <= 1, at
        until(lambda: metric(url, "cpufuse_requests_running") == 0)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200


def test_a_failing_sampler_ends_its_request_only(gguf, monkeypatch):
    import cpufuse.serve.batch as batch
    make = batch.make_sampler

    class Failing:
        def __init__(self, inner):
            self.inner, self.n = inner, 0

        def accept_prompt(self, ids):
            self.inner.accept_prompt(ids)

        def sample(self, logits):
            self.n += 1
            if self.n == 3:
                raise RuntimeError("injected sampler failure")
            return self.inner.sample(logits)

    monkeypatch.setattr(batch, "make_sampler", lambda p, c=None: Failing(make(p, c)) if p.seed == 666 else make(p, c))
    eng = engine(gguf, parallel=3)
    req = dict(prompt="hello there", max_tokens=24, temperature=0.8, ignore_eos=True)
    with live(create_app(eng)) as url:
        alone = httpx.post(url + "/v1/completions", json=dict(req, seed=1), timeout=60).json()
        out = {}

        def go(name, body):
            out[name] = httpx.post(url + "/v1/completions", json=body, timeout=60)

        def stream():
            with httpx.stream("POST", url + "/v1/completions", json=dict(req, seed=666, stream=True),
                              timeout=60) as r:
                out["stream"] = sse_events(r)
        ts = [threading.Thread(target=go, args=("ok", dict(req, seed=1))),
              threading.Thread(target=go, args=("bad", dict(req, seed=666))),
              threading.Thread(target=stream)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert out["ok"].status_code == 200 and out["ok"].json()["choices"] == alone["choices"]
        assert out["bad"].status_code == 500
        assert "injected sampler failure" in out["bad"].json()["error"]["message"]
        assert out["stream"][-1] == "[DONE]" and "injected sampler failure" in out["stream"][-2]
        assert httpx.post(url + "/v1/completions", json=dict(req, seed=1), timeout=60).json()["choices"] == \
            alone["choices"]


def test_sigterm_drains_then_ends_open_streams(tmp_path):
    """SIGTERM: new requests 503, an open stream gets --shutdown-timeout seconds, then a last error
    event and [DONE]; exit 0, no traceback. Bound to 0.0.0.0 without a key: the warning."""
    n_ctx = 1 << 16                          # a stream far longer than the grace period
    gguf = write_tiny_gguf(tmp_path / "long.gguf", tied=False, n_ctx_train=n_ctx)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cpufuse", "serve", gguf, "--n-ctx", str(n_ctx), "-t", "1",
                             "--parallel", "2", "--chunk", "8", "--host", "0.0.0.0", "--port", str(port),
                             "--shutdown-timeout", "1.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        until(lambda: proc.poll() is None and _ok(url + "/health"), timeout=120, what="the server up")
        body = dict(LONG, stream=True, max_tokens=n_ctx - 16)
        whole = {}                           # and a whole (non-streamed) request open at the same time
        t_whole = threading.Thread(target=lambda: whole.update(r=httpx.post(
            url + "/v1/completions", json=dict(body, stream=False), timeout=60)))
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            t_whole.start()
            until(lambda: httpx.get(url + "/health").json().get("slots_processing", 0) >= 2, timeout=30,
                  what="both requests running")
            proc.send_signal(signal.SIGTERM)
            t0 = time.time()
            until(lambda: httpx.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 503,
                  what="new requests refused")
            rest = [first] + [x for x in lines]
            waited = time.time() - t0
        ev = [x[6:] for x in rest if x.startswith("data: ")]
        assert ev[-1] == "[DONE]" and "shutting down" in json.loads(ev[-2])["error"]["message"], ev[-3:]
        assert 1.0 < waited < 15, waited
        t_whole.join(30)
        assert whole["r"].status_code == 503 and "shutting down" in whole["r"].json()["error"]["message"], whole
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert rc == 0, log
    assert "Traceback" not in log and "warning: --host 0.0.0.0" in log, log


def _ok(url):
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_model_that_fails_to_load_exits_1(tmp_path):
    """the port is bound before the model loads; a load failure still ends the command with 1"""
    bad = write_tiny_gguf(tmp_path / "bad.gguf", arch="mamba")
    r = subprocess.run([sys.executable, "-m", "cpufuse", "serve", bad, "-c", "64", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "error: cannot load" in r.stderr and "'mamba' is not supported" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
