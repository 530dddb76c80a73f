"""No request field is silently ignored: an unknown field is a 400 naming it on every route (raw HTTP
and the openai client's extra_body), an OpenAI field cpufuse cannot honour is a 400 unless null,
and the fields it accepts with a documented meaning (user, metadata, store: false, ...) answer
200. What the openai client and LangChain's ChatOpenAI send by default is accepted, and a reply
the openai client parsed goes back into the next request's messages."""
import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
pytest.importorskip("starlette", reason="the serve extra (pip install cpufuse[serve]) is not installed")
openai = pytest.importorskip("openai", reason="the openai client (test extra) is not installed")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from _serving import live  # noqa: E402
from _tiny_gguf import write_tiny_gguf  # noqa: E402
from cpufuse.llama import Model  # noqa: E402
from cpufuse.serve import create_app  # noqa: E402
from cpufuse.serve.batch import BatchEngine  # noqa: E402

MSGS = [{"role": "user", "content": "hi"}]
# each route and a body it answers 200 (slots: a file name in the save directory)
ROUTES = [("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2}),
          ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
          ("/v1/embeddings", {"input": "hi"}),
          ("/embeddings", {"input": "hi"}),
          ("/tokenize", {"content": "hi"}),
          ("/detokenize", {"tokens": [1, 2]}),
          ("/slots/0?action=save", {"filename": "s.bin"}),
          ("/slots/0?action=restore", {"filename": "s.bin"}),
          ("/slots/0?action=erase", {})]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    d = tmp_path_factory.mktemp("fields")
    gguf = write_tiny_gguf(d / "tiny.gguf", tied=False, n_ctx_train=1024)
    eng = BatchEngine(Model.load(gguf, n_ctx=1024, n_seq=2, n_threads=1), chunk=8)
    with live(create_app(eng, embeddings="mean", slot_save_path=str(d))) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def _err400(r, param):
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["type"] == "invalid_request_error" and e["param"] == param, e
    return e["message"]


@pytest.mark.parametrize("path, body", ROUTES, ids=[p for p, _ in ROUTES])
def test_every_route_refuses_an_unknown_field(url, path, body):
    assert httpx.post(url + path, json=body, timeout=60).status_code == 200   # the body alone is fine
    msg = _err400(httpx.post(url + path, json=dict(body, frobnicate=1), timeout=60), "frobnicate")
    assert msg == "Unrecognized request argument supplied: frobnicate"
    msg = _err400(httpx.post(url + path, json=dict(body, zz=1, aa=None), timeout=60), "zz")
    assert msg == "Unrecognized request arguments supplied: zz, aa"


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi", "mood": "sunny"}]}, "messages.0.mood"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "bold": True}]}]},
     "messages.0.content.0.bold"),
    ({"messages": MSGS, "stream": True, "stream_options": {"include_usage": True, "every": 2}},
     "stream_options.every"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "x": 1,
                                                         "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.tool_calls.0.x"),
    # llama-server's sampling fields cpufuse does not have are unknown too
    ({"messages": MSGS, "mirostat": 2}, "mirostat"),
    ({"messages": MSGS, "typical_p": 0.5}, "typical_p"),
])
def test_nested_and_llama_server_unknown_fields(url, body, param):
    msg = _err400(httpx.post(url + "/v1/chat/completions", json=body), param)
    assert msg == f"Unrecognized request argument supplied: {param}"


@pytest.mark.parametrize("field, value", [
    ("audio", {"voice": "alloy", "format": "wav"}), ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "low"), ("verbosity", "low"), ("web_search_options", {}),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("moderation", {}),
    ("prompt_cache_options", {"mode": "explicit"}), ("store", True), ("service_tier", "flex"),
    ("prompt_cache_retention", "24h"), ("modalities", ["text", "audio"]),
])
def test_openai_fields_cpufuse_cannot_honour_are_400(url, client, field, value):
    body = {"messages": MSGS, "max_tokens": 2}
    msg = _err400(httpx.post(url + "/v1/chat/completions", json=dict(body, **{field: value})), field)
    assert field in msg
    if field not in ("store", "service_tier", "prompt_cache_retention", "modalities"):
        assert "not supported" in msg
        assert httpx.post(url + "/v1/chat/completions", json=dict(body, **{field: None})).status_code == 200
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, extra_body={field: value})
    assert e.value.status_code == 400 and e.value.param == field


def test_refused_message_fields_and_obfuscation(url):
    for extra in ({"audio": {"id": "a"}}, {"function_call": {"name": "f", "arguments": "{}"}},
                  {"refusal": "no"}, {"annotations": [{"type": "url_citation"}]}):
        msgs = [{"role": "assistant", "content": "x", **extra}, {"role": "user", "content": "hi"}]
        msg = _err400(httpx.post(url + "/v1/chat/completions", json={"messages": msgs}), "messages")
        assert next(iter(extra)) in msg and "not supported" in msg
        msgs[0] = {"role": "assistant", "content": "x", **{k: None for k in extra}}   # null: accepted
        assert httpx.post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}).status_code == 200
    part = {"type": "text", "text": "hi", "prompt_cache_breakpoint": {"mode": "explicit"}}
    _err400(httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]}),
            "messages")
    for kind, payload in (("image_url", {"url": "http://x/a.png"}), ("input_audio", {"data": "", "format": "wav"})):
        msg = _err400(httpx.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": kind, kind: payload}]}]}), "messages")
        assert f"type {kind!r} are not supported" in msg
    body = {"messages": MSGS, "max_tokens": 2, "stream": True}
    _err400(httpx.post(url + "/v1/chat/completions",
                       json=dict(body, stream_options={"include_obfuscation": True})), "stream_options.include_obfuscation")
    assert httpx.post(url + "/v1/chat/completions",
                      json=dict(body, stream_options={"include_obfuscation": False})).status_code == 200


def test_accepted_fields_answer_and_user_is_logged(url, client, caplog):
    caplog.set_level(logging.INFO, logger="cpufuse.serve")
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=2, user="alice", metadata={"team": "a"}, store=False,
        service_tier="auto", prompt_cache_key="k1", safety_identifier="hash-1", modalities=["text"],
        extra_body={"prompt_cache_retention": "in_memory"})
    assert r.choices[0].finish_reason in ("stop", "length")
    client.completions.create(model="tiny", prompt="hi", max_tokens=2, user="bob")
    client.embeddings.create(model="tiny", input="hi", user="carol")
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "cpufuse.serve"]
    for who in ("'alice / hash-1'", "'bob'", "'carol'"):
        assert any(f"| user {who} |" in line for line in lines), (who, lines)
    _err400(httpx.post(url + "/v1/chat/completions", json={"messages": MSGS, "metadata": {"k": 1}}), "metadata.k")
    _err400(httpx.post(url + "/v1/embeddings", json={"input": "hi", "user": 3}), "user")


@pytest.mark.parametrize("route", ["chat", "completions", "embeddings"])
def test_openai_client_extra_body_unknown_field(client, route):
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, extra_body={"top_a": 0.1})
        elif route == "completions":
            client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"top_a": 0.1})
        else:
            client.embeddings.create(model="tiny", input="hi", extra_body={"top_a": 0.1})
    assert e.value.status_code == 400 and e.value.param == "top_a" and e.value.code == "unknown_parameter"
    assert "Unrecognized request argument supplied: top_a" in e.value.message


def test_what_clients_send_by_default_is_accepted(url, client):
    # LangChain's ChatOpenAI: model, stream, n, temperature (its _default_params), then with
    # streaming stream_options.include_usage; bind_tools adds tools, tool_choice, parallel_tool_calls
    tool = {"type": "function", "function": {"name": "f", "description": "d",
                                             "parameters": {"type": "object", "properties": {}}}}
    base = {"model": "gpt-4o-mini", "messages": MSGS, "n": 1, "temperature": 0.7, "max_tokens": 2}
    for extra in ({"stream": False}, {"stream": True, "stream_options": {"include_usage": True}},
                  {"stream": False, "tools": [tool], "tool_choice": "auto", "parallel_tool_calls": False},
                  {"stream": False, "logprobs": True, "top_logprobs": 2, "seed": 1, "stop": ["x"],
                   "presence_penalty": 0, "frequency_penalty": 0, "top_p": 1, "logit_bias": {}}):
        r = httpx.post(url + "/v1/chat/completions", json=dict(base, **extra), timeout=60)
        assert r.status_code == 200, (extra, r.text)
    # a reply parsed by the openai client goes back as history (its message object, as is)
    first = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3)
    again = client.chat.completions.create(
        model="tiny", max_tokens=2, messages=MSGS + [first.choices[0].message, {"role": "user", "content": "more"}])
    assert again.choices[0].message.role == "assistant"
    first = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3)
    hist = MSGS + [first.choices[0].message.model_dump(), {"role": "user", "content": "more"}]   # every key, nulls too
    assert client.chat.completions.create(model="tiny", max_tokens=2, messages=hist).choices
