"""The live server: `python -m cpufuse serve` on a tiny GGUF, on a free port, driven by the official
openai client (and raw httpx / sockets where the client cannot misbehave on purpose)."""
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
pytest.importorskip("starlette", reason="the serve extra (pip install cpufuse[serve]) is not installed")
openai = pytest.importorskip("openai", reason="the openai client (test extra) is not installed")
httpx = pytest.importorskip("httpx")

from _serving import free_port  # noqa: E402
from _tiny_gguf import write_tiny_gguf  # noqa: E402
from cpufuse.llama import Model  # noqa: E402
from cpufuse.llama.chat import chat_prompt  # noqa: E402
from cpufuse.serve.engine import SamplingParams, make_sampler  # noqa: E402

N_CTX = 16384           # long enough that a cancelled request could not have finished on its own
NAME = "tiny"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'tool' %}"
            "{{ raise_exception('this template has no tool role') }}{% endif %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("serve") / f"{NAME}.gguf", tied=False, n_ctx_train=N_CTX,
                           chat_template=TEMPLATE)


CHUNK = 8   # the server's --chunk: its prompt chunks are a Model's micro-batches of n_batch = CHUNK


@pytest.fixture(scope="module")
def model(gguf):
    return Model.load(gguf, n_ctx=N_CTX, n_batch=CHUNK)


def serve_process(args):
    """`python -m cpufuse serve` with args on a free port: yields its base URL once /health answers,
    then stops it with SIGINT and checks it exited 0 without a traceback (a generator for fixtures)"""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cpufuse", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail("the server did not become healthy in 120 s")
        time.sleep(0.05)
    yield base
    proc.send_signal(signal.SIGINT)                        # graceful shutdown: exit code 0
    try:
        rc = proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "killed after 30 s"
    log = proc.stdout.read()
    assert rc == 0, f"server exit: {rc}\n{log}"
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def url(gguf):
    yield from serve_process([gguf, "--n-ctx", str(N_CTX), "--threads", "1", "--parallel", "2", "--chunk",
                              str(CHUNK), "--log-level", "warning"])


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="sk-none", max_retries=0, timeout=60)


def metrics(url):
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def wait_metrics(url, cond, timeout=20):
    t0 = time.time()
    while True:
        m = metrics(url)
        if cond(m):
            return m
        if time.time() - t0 > timeout:
            raise AssertionError(f"metrics never met the condition: {m}")
        time.sleep(0.02)


CANCELLED = 'cpufuse_requests_finished_total{reason="cancelled"}'


def chat_ids(model, messages):
    return model.tokenize(chat_prompt(model.tokenizer, messages), add_bos=False, special=True)


# ---------------------------------------------------------------------------------- endpoints
def test_health_models_metrics(url, client):
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    (m,) = client.models.list().data
    assert (m.id, m.object, m.owned_by) == (NAME, "model", "cpufuse")
    assert m.model_extra["max_model_len"] == N_CTX
    r = httpx.get(url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    m = metrics(url)
    for k in ("cpufuse_requests_waiting", "cpufuse_requests_running", "cpufuse_batch_size",
              "cpufuse_prompt_tokens_total", "cpufuse_generation_tokens_total", "cpufuse_parallel"):
        assert k in m


def test_chat_sync_and_stream(client, model):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]
    r = client.chat.completions.create(model="any-name", messages=msgs, max_tokens=24, **GREEDY)
    (c,) = r.choices
    assert (r.object, r.model, c.finish_reason, c.message.role) == ("chat.completion", NAME, "length", "assistant")
    ids = chat_ids(model, msgs)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 24, len(ids) + 24)
    ref = model.generate(ids, max_tokens=24, temperature=0, stop_at_eog=False, reuse_cache=False)
    assert c.message.content == ref.text                   # the server's tokens are Model.generate's

    chunks = list(client.chat.completions.create(model="x", messages=msgs, max_completion_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert len({ch.id for ch in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    assert [ch.choices[0].finish_reason for ch in chunks[:-1]] == [None] * (len(chunks) - 2) + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(ch.usage is None for ch in chunks[:-1])
    plain = list(client.chat.completions.create(model="x", messages=msgs, max_tokens=3, stream=True, **GREEDY))
    assert all(ch.usage is None for ch in plain) and plain[-1].choices[0].finish_reason == "length"


def test_completions_sync_stream_and_logprobs(client, model):
    prompt = "the world is"
    ids = model.tokenize(prompt, special=True)
    r = client.completions.create(model="x", prompt=prompt, max_tokens=16, logprobs=2, **GREEDY)
    (c,) = r.choices
    ref = model.generate(ids, max_tokens=16, temperature=0, stop_at_eog=False, reuse_cache=False)
    assert (r.object, c.text, c.finish_reason) == ("text_completion", ref.text, "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 16)
    lp = c.logprobs
    assert lp.tokens == [model.tokenizer.token_to_piece(t, True).decode("utf-8", "replace") for t in ref.tokens]
    assert all(len(d) <= 2 and max(d.values()) <= lp.token_logprobs[i] + 1e-12
               for i, d in enumerate(lp.top_logprobs))        # greedy: the chosen token is the top one
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # the same from token ids, streamed, with the default max_tokens (16)
    chunks = list(client.completions.create(model="x", prompt=ids, stream=True, logprobs=2, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks) == ref.text
    assert sum((ch.choices[0].logprobs.tokens for ch in chunks if ch.choices[0].logprobs), []) == lp.tokens
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seeds_and_sampling_params(client, model):
    kw = dict(model="x", prompt="hello", max_tokens=20, temperature=0.9, top_p=0.9, presence_penalty=0.5,
              frequency_penalty=0.3)
    ext = {"ignore_eos": True, "top_k": 40, "min_p": 0.01}
    a = client.completions.create(seed=7, extra_body=ext, **kw).choices[0].text
    b = client.completions.create(seed=7, extra_body=ext, **kw).choices[0].text
    c = client.completions.create(seed=8, extra_body=ext, **kw).choices[0].text
    assert a == b != c
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, min_p=0.01, seed=7, presence_penalty=0.5,
                        frequency_penalty=0.3)
    ref = model.generate(model.tokenize("hello", special=True), max_tokens=20, sampler=make_sampler(sp),
                         stop_at_eog=False, reuse_cache=False)
    assert a == ref.text
    r = client.completions.create(model="x", prompt="hello", max_tokens=1, **GREEDY)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (1, "length")


def _ascii_boundary(lp):
    """a token boundary whose neighbours are printable ASCII: (token index k, text offset)"""
    for k in range(2, len(lp.tokens)):
        a, b = lp.tokens[k - 1], lp.tokens[k]
        if a and b and (a + b).isascii() and (a + b).isprintable():
            return k, lp.text_offset[k]
    pytest.skip("no ASCII token boundary in the greedy text")


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "stream"])
def test_stop_strings_never_leak(client, stream):
    kw = dict(model="x", prompt="hello world", max_tokens=64, **GREEDY)
    full = client.completions.create(logprobs=0, **kw).choices[0]
    text = full.text
    k, off = _ascii_boundary(full.logprobs)
    stop = text[off - 1:off + 1]                           # straddles tokens k-1 and k
    at = text.find(stop)
    stops = [stop, "\u2603never"]
    if stream:
        chunks = list(client.completions.create(stop=stops, stream=True, stream_options={"include_usage": True}, **kw))
        pieces = [ch.choices[0].text for ch in chunks if ch.choices]
        assert all(stop not in p for p in pieces)
        got, reason, usage = "".join(pieces), chunks[-2].choices[0].finish_reason, chunks[-1].usage
    else:
        r = client.completions.create(stop=stops, **kw)
        got, reason, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
    assert (got, reason) == (text[:at], "stop")
    if at == off - 1:                                      # its first occurrence: token k completes it
        assert usage.completion_tokens == k + 1
    # a single string works too, and a stop that never occurs changes nothing
    r = client.completions.create(stop="\u2603", **kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text, "length")


def test_eight_concurrent_requests_equal_alone(client):
    reqs = []
    for i in range(8):
        kw = dict(model="x", prompt=f"hello {i} the world", max_tokens=24, logprobs=0,
                  extra_body={"ignore_eos": True})
        if i % 2:
            kw.update(temperature=0)
        else:
            kw.update(temperature=1.0, seed=100 + i)
        reqs.append((kw, i % 4 == 0))

    def run(arg):
        kw, stream = arg
        if not stream:
            c = client.completions.create(**kw).choices[0]
            return c.text, c.logprobs.tokens, c.logprobs.token_logprobs
        text, toks, lps = "", [], []
        for ch in client.completions.create(stream=True, **kw):
            text += ch.choices[0].text
            if ch.choices[0].logprobs:
                toks += ch.choices[0].logprobs.tokens
                lps += ch.choices[0].logprobs.token_logprobs
        return text, toks, lps

    alone = [run(a) for a in reqs]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        together = list(ex.map(run, reqs))
    assert together == alone
    assert len({a[0] for a in alone}) == 8


def test_disconnects_free_their_slot(url, client):
    m0 = metrics(url)
    c0, g0 = m0[CANCELLED], m0["cpufuse_generation_tokens_total"]
    slots = int(m0["cpufuse_parallel"])
    # A: long streams in every slot, read a little, keep them open
    streams = []
    for _ in range(slots):
        a = client.completions.create(model="x", prompt="hello", max_tokens=N_CTX - 16, stream=True, **GREEDY)
        it = iter(a)
        for _ in range(3):
            next(it)
        streams.append(a)
    # B: non-streaming, waits in the queue behind them; its client gives up
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=0.3)
    wait_metrics(url, lambda m: m[CANCELLED] == c0 + 1 and m["cpufuse_requests_waiting"] == 0)
    # A's clients go: their sequences are cancelled and the engine is idle again
    for a in streams:
        a.close()
    m = wait_metrics(url, lambda m: m[CANCELLED] == c0 + 1 + slots and m["cpufuse_requests_running"] == 0)
    assert m["cpufuse_generation_tokens_total"] - g0 < slots * N_CTX // 2
    # C: non-streaming, running when its client closes the socket
    body = json.dumps({"prompt": "hello", "max_tokens": N_CTX - 16, "temperature": 0, "ignore_eos": True}).encode()
    host, port = url.rsplit("/", 1)[-1].split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_metrics(url, lambda m: m["cpufuse_requests_running"] == 1)
    m = wait_metrics(url, lambda m: m[CANCELLED] == c0 + 2 + slots and m["cpufuse_requests_running"] == 0)
    assert m["cpufuse_generation_tokens_total"] - g0 < (slots + 1) * N_CTX // 2
    # the server goes on serving
    r = client.completions.create(model="x", prompt="hello", max_tokens=4, **GREEDY)
    assert r.usage.completion_tokens == 4


# ------------------------------------------------------------------------------------ errors
def _err(r, status, param=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) >= {"message", "type", "param", "code"} and e["message"]
    if param is not None:
        assert e["param"] == param, e
    return e


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b'{"prompt": "hi", "temperature": 3}', "temperature"),
    (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "hi", "top_p": 0}', "top_p"),
    (b'{"prompt": "hi", "stream": "maybe"}', "stream"),
    (b'{"prompt": "hi", "n": 99}', "n"),
    (b'{"prompt": "hi", "logit_bias": {"99999": 1}}', "logit_bias"),
    (b'{"prompt": "hi", "grammar": "root ::= (", "max_tokens": 4}', "grammar"),
    (b'{"prompt": "hi", "stop": ["a", ""]}', "stop"),
    (b'{"prompt": "hi", "logprobs": 50}', "logprobs"),
    (b'{"prompt": ["a", "b"]}', "prompt"),
    (b'{"prompt": [1, 99999]}', "prompt"),
    (b'{"prompt": ""}', "prompt"),
    (b'{"max_tokens": 4}', "prompt"),
], ids=lambda x: x.decode()[:28] if isinstance(x, bytes) else str(x))
def test_bad_completions_requests_are_400(url, body, param):
    _err(httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"}), 400, param)


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
     "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),       # the template raises
])
def test_bad_chat_requests_are_400(url, body, param):
    _err(httpx.post(url + "/v1/chat/completions", json=body), 400, param)


def test_openai_client_errors_and_routes(url, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    _err(httpx.get(url + "/v1/nothing"), 404)
    _err(httpx.get(url + "/v1/completions"), 405)


def test_context_overflow_is_400_with_the_reason(client, model):
    long_prompt = "hello world " * (N_CTX // 2)
    n = len(model.tokenize(long_prompt, special=True))
    assert n > N_CTX
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="x", prompt=long_prompt, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert f"maximum context length is {N_CTX} tokens" in e.value.message
    assert f"you requested {n + 4} tokens ({n} in your prompt, 4 in the completion)" in e.value.message
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=msgs, max_tokens=N_CTX)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert "in the messages" in e.value.message
    with pytest.raises(openai.BadRequestError, match="leaves no room"):
        client.completions.create(model="x", prompt=[1] * N_CTX, max_tokens=None)
