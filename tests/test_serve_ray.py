"""cpufuse.serve.ray: two replicas of the tiny model on a local Ray cluster (one thread each) behind
Ray Serve's HTTP proxy: both answer, the same request and seed give the same tokens from either,
a shared prefix goes to the replica holding it, streams work through the openai client, and a
replica killed under load loses no request. Skipped with the reason where ray is not installed or
cannot start, and under make test-asan."""
import concurrent.futures
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
pytest.importorskip("starlette", reason="the serve extra (pip install cpufuse[serve]) is not installed")
openai = pytest.importorskip("openai", reason="the openai client (test extra) is not installed")
httpx = pytest.importorskip("httpx")
if "libasan" in os.environ.get("LD_PRELOAD", ""):   # before importing ray: its extensions are not ASan-clean
    pytest.skip("not under make test-asan: the ASan preload would reach Ray's own processes", allow_module_level=True)
ray = pytest.importorskip("ray", reason="ray is not installed (pip install cpufuse[ray])")
pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install cpufuse[ray])")

from _serving import free_port  # noqa: E402
from _tiny_gguf import write_tiny_gguf  # noqa: E402
from cpufuse.serve.ray import app_options, build_app, prefix_hashes, prompt_text  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_app_options_name_the_bad_argument():
    assert app_options({"model": "m.gguf", "num_replicas": "2"})["num_replicas"] == 2
    for args, word in (({}, "model"), ({"model": "m", "replicas": "2"}, "replicas"),
                       ({"model": "m", "num_cpus": "two"}, "num_cpus"), ({"model": "m", "parallel": "0"}, "parallel"),
                       ({"model": "m", "router": "random"}, "router")):
        with pytest.raises(ValueError, match=word):
            app_options(args)
    assert prompt_text("/v1/completions", b'{"prompt": "abc"}') == "abc"
    assert prompt_text("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}') == "user\nhi\n"
    assert prompt_text("/v1/models", b"") == "" and prompt_text("/v1/completions", b"\xff") == ""
    a, b = prefix_hashes("x" * 64 * 3), prefix_hashes("x" * 64 * 2 + "y" * 64)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2] and prefix_hashes("short") == []


def test_prefix_router_takes_turns_among_equals():
    """a burst of short prompts: Ray picks the first of equal queue lengths and its lengths lag the
    burst, so the router rotates the tied replicas (no cluster needed)"""
    import asyncio
    import types

    from cpufuse.serve.ray import PrefixRouter
    router = PrefixRouter.__new__(PrefixRouter)
    router._replica_queue_len_cache = {}
    router.initialize_state()
    reps = [types.SimpleNamespace(replica_id=f"r{i}") for i in (2, 0, 1)]

    def first():
        ranks = asyncio.run(router.choose_replicas(reps, None))
        assert sorted(x.replica_id for x in ranks[1]) == ["r0", "r1", "r2"]
        return ranks[0][0].replica_id
    assert [first() for _ in range(6)] == ["r0", "r1", "r2"] * 2
    router._replica_queue_len_cache = {"r0": 3}
    assert {first() for _ in range(4)} == {"r1", "r2"}
    long_prompt = types.SimpleNamespace(args=[types.SimpleNamespace(prompt="p" * 200)], kwargs={})
    router.on_request_routed(long_prompt, "r0", None)      # r0 holds the prefix, 3 queued: within 4 of 0
    ranks = asyncio.run(router.choose_replicas(reps, long_prompt))
    assert [x.replica_id for x in ranks[0]] == ["r0"]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    gguf = write_tiny_gguf(tmp_path_factory.mktemp("ray") / "tiny.gguf", tied=False, n_ctx_train=512,
                           chat_template=TEMPLATE)
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("not under make test-asan: the ASan preload would reach Ray's own processes")
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    try:
        ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
    except Exception as e:  # noqa: BLE001 -- no cluster can start on this machine
        pytest.skip(f"a local Ray cluster cannot start here: {type(e).__name__}: {e}")
    from ray import serve
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"model": gguf, "num_replicas": "2", "num_cpus": "1", "parallel": "2",
                             "n_ctx": "256", "chunk": "8"}), name="cpufuse", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _complete(url, body):
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.headers["x-cpufuse-replica"], r.json()["choices"][0]["text"], r.json()["usage"]


def test_two_replicas_answer_alike(url):
    body = {"prompt": "hi there", "max_tokens": 12, "temperature": 0.9, "seed": 7, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        out = list(ex.map(lambda _: _complete(url, body), range(24)))
    replicas = {r for r, _, _ in out}
    assert len(replicas) == 2, f"one replica took every request: {replicas}"
    assert len({(t, u["completion_tokens"]) for _, t, u in out}) == 1, "the replicas' tokens differ"
    # a shared prefix (three blocks) goes to the replica that took it first
    prefix = "You are a helpful assistant. " * 8
    seen = {_complete(url, {"prompt": prefix + f"question {i}", "max_tokens": 2})[0] for i in range(6)}
    assert len(seen) == 1, seen
    # the OpenAI routes through the proxy: models, a chat stream
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    assert client.models.list().data[0].id == "tiny"
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def _replica_actors():
    """{unique id (X-Cpufuse-Replica): Ray actor} of the Serve replicas"""
    return {a["name"].rsplit("#", 1)[1]: ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::")}


def _replica_actor(replica_id):
    """the Ray actor of the Serve replica whose unique id is `replica_id`"""
    actors = _replica_actors()
    assert replica_id in actors, f"no replica actor {replica_id}: {list(actors)}"
    return actors[replica_id]


def _wait_for_replicas(n, timeout=120):
    """until Serve has n replica actors again (it replaces a killed one)"""
    import time
    deadline = time.monotonic() + timeout
    while len(_replica_actors()) < n:
        assert time.monotonic() < deadline, f"Serve did not bring back {n} replicas in {timeout} s: {list(_replica_actors())}"
        time.sleep(0.5)


def _kill_mid_burst(url, n):
    """n requests at once; the replica of the first answer is killed; returns (the answers, the victim)"""
    first = concurrent.futures.Future()
    actors = _replica_actors()   # looked up before the burst, so the kill follows the first answer at once

    def one(i):
        body = {"prompt": "count", "max_tokens": 60 + 6 * i, "temperature": 0.8, "seed": 11, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        try:
            first.set_result(r.headers.get("x-cpufuse-replica"))
        except concurrent.futures.InvalidStateError:    # another answer came first
            pass
        return r
    with concurrent.futures.ThreadPoolExecutor(n) as ex:
        futs = [ex.submit(one, i) for i in range(n)]
        victim = first.result(timeout=120)
        ray.kill(actors[victim] if victim in actors else _replica_actor(victim), no_restart=True)
        return [f.result() for f in futs], victim


def test_a_replica_killed_mid_load_loses_no_request(url):
    """24 requests at once (2 running and the rest queued in each engine); when the first answer
    comes, its replica is killed. Ray's router retries what it had not handed to a replica yet; the
    ingress sends again what the dead replica had accepted (nothing of those replies had reached
    the client). Every request gets a whole answer, and the same tokens (same seed; each answer is
    a prefix of the longest). The router spreads a burst by queue lengths that lag it, so a replica
    may take only a few requests (4 of 24 seen): the lengths differ by 6 tokens, so the one the
    victim runs beside its first answer is usually still in flight when it is killed. Where the victim
    had nothing left (once in a CI run: its last request ended before the kill), the burst runs again
    on the two replicas Serve brings back, up to 3 times: every burst must lose nothing, and one must
    have sent a request again."""
    n = 24
    for attempt in range(3):
        if attempt:
            _wait_for_replicas(2)
        out, victim = _kill_mid_burst(url, n)
        assert [r.status_code for r in out] == [200] * n, [r.text for r in out if r.status_code != 200]
        assert [r.json()["usage"]["completion_tokens"] for r in out] == [60 + 6 * i for i in range(n)]
        texts = [r.json()["choices"][0]["text"] for r in out]
        assert all(texts[-1].startswith(t) for t in texts), "a retried request gave other tokens"
        retried = [r for r in out if r.headers.get("x-cpufuse-retries")]
        if retried:
            break
    assert retried, "in 3 bursts the killed replica never had a request in flight: nothing was retried"
    assert all(r.headers["x-cpufuse-replica"] != victim for r in retried)
    _wait_for_replicas(2)


def test_a_stream_whose_replica_dies_ends_with_the_reason(url):
    """a stream already under way cannot be sent again: it ends with an SSE error event naming the
    cause, then [DONE] (16 choices of 200 tokens keep it running while its replica is killed)"""
    import json
    body = {"prompt": "count", "max_tokens": 200, "n": 16, "temperature": 0.8, "seed": 5, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(x for x in lines if x.startswith("data: "))
        assert json.loads(first[6:])["choices"]
        ray.kill(_replica_actor(r.headers["x-cpufuse-replica"]), no_restart=True)
        data = [x[6:] for x in lines if x.startswith("data: ")]
    assert data[-1] == "[DONE]"
    err = json.loads(data[-2])["error"]
    assert err["code"] == "replica_died" and "died" in err["message"], err
