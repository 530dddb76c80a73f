"""Structured output and tools through the live server (`python -m cpufuse serve`, BatchEngine) with the
official openai client: response_format (json_object, json_schema, parse() with a pydantic model),
llama.cpp's grammar / json_schema fields, regex, tools with every tool_choice streamed and not, a
multi-turn tool conversation, logit_bias, n > 1, /tokenize and /detokenize, and batch invariance with
constraints. The tiny model emits noise: the constraint is what makes every reply valid."""
import concurrent.futures
import json
import os
import sys
from typing import List, Literal

import pytest

sys.path.insert(0, os.path.dirname(__file__))
pytest.importorskip("starlette", reason="the serve extra (pip install cpufuse[serve]) is not installed")
pytest.importorskip("llguidance", reason="structured output needs llguidance")
openai = pytest.importorskip("openai", reason="the openai client (test extra) is not installed")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

from _tiny_gguf import write_tiny_gguf  # noqa: E402
from test_serve import serve_process  # noqa: E402
from test_structured import TOOLS, PARAMS, schemas  # noqa: E402

N_CTX = 2048
# a Hermes-style template: tools in a system block, assistant tool_calls as <tool_call> blocks
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }}: "
    "{{ t.function.parameters | tojson }}\n{% endfor %}Call a tool with <tool_call>{...}</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MSGS = [{"role": "user", "content": "hi"}]
NO_PAR = dict(parallel_tool_calls=False)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    gguf = write_tiny_gguf(tmp_path_factory.mktemp("serve_structured") / "tiny.gguf", tied=False,
                           n_ctx_train=N_CTX, chat_template=TEMPLATE)
    # OpenAI's defaults for the fields a request leaves out (the CLI's are llama.cpp's), as
    # create_app() without `sampling` has them
    yield from serve_process([gguf, "--n-ctx", str(N_CTX), "--threads", "1", "--parallel", "8", "--chunk", "8",
                              "--temp", "1.0", "--top-k", "0", "--top-p", "1.0", "--min-p", "0.0",
                              "--log-level", "warning"])


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="sk-none", max_retries=0, timeout=120)


def _rf(schema, name="s"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# ------------------------------------------------------------------ response_format

class Colour(pydantic.BaseModel):
    name: Literal["red", "green", "blue"]
    rgb: List[pydantic.conint(ge=0, le=255)] = pydantic.Field(max_length=3)
    label: pydantic.constr(max_length=4)
    bright: bool


def test_parse_with_a_pydantic_model(client):
    for seed in range(3):
        r = client.chat.completions.parse(model="x", messages=MSGS, response_format=Colour, seed=seed,
                                          max_tokens=400)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(msg.parsed, Colour), msg.content
        assert Colour.model_validate_json(msg.content) == msg.parsed


def test_json_schema_over_generated_schemas(client):
    scs = schemas(50, seed=11)

    def one(i):
        r = client.chat.completions.create(model="x", messages=MSGS, response_format=_rf(scs[i]), seed=i,
                                           max_tokens=1000)
        return r.choices[0]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(one, range(len(scs))))
    for sc, ch in zip(scs, outs):
        assert ch.finish_reason == "stop", ch.message.content
        jsonschema.validate(json.loads(ch.message.content), sc)


def test_json_object_and_streaming(client):
    r = client.chat.completions.create(model="x", messages=MSGS, response_format={"type": "json_object"},
                                       temperature=0.7, seed=1, max_tokens=600)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    sc = schemas(1, seed=5)[0]
    parts, reasons = [], []
    for ch in client.chat.completions.create(model="x", messages=MSGS, response_format=_rf(sc), seed=2,
                                             max_tokens=1000, stream=True):
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
            reasons.append(ch.choices[0].finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads("".join(parts)), sc)


def test_completions_response_format_grammar_json_schema_regex(client):
    # no additional properties: a noise model under the server's default sampling would otherwise add
    # keys and strings of any length, and max_tokens could cut the JSON
    sc = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["n"],
          "additionalProperties": False}
    r = client.completions.create(model="x", prompt="hello", max_tokens=300, seed=0, extra_body={"response_format": _rf(sc)})
    jsonschema.validate(json.loads(r.choices[0].text), sc)
    r = client.completions.create(model="x", prompt="hello", max_tokens=300, seed=0, extra_body={"json_schema": sc})
    jsonschema.validate(json.loads(r.choices[0].text), sc)
    r = client.completions.create(model="x", prompt="hello", max_tokens=20, extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="x", prompt="hello", max_tokens=20, stream=True, extra_body={"regex": "[0-9]{4}"}) if c.choices)
    assert len(text) == 4 and text.isdigit()
    r = client.chat.completions.create(model="x", messages=MSGS, max_tokens=20,
                                       extra_body={"lark": 'start: "ok" | "fine"'})
    assert r.choices[0].message.content in ("ok", "fine")


@pytest.mark.parametrize("body, param, text", [
    ({"response_format": _rf({"type": "string", "format": "bogus"})}, "response_format", "Unknown format"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"grammar": "root ::= (", "json_schema": {"type": "object"}}, None, "only one constraint"),
    ({"grammar": "root ::= nothing"}, "grammar", "nothing"),
    ({"regex": "[a-"}, "regex", "regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "zz"}}}, "tool_choice", "zz"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "name"),
    ({"tool_choice": "auto"}, "tool_choice", "tools"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools", "combined"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"1": 500}}, "logit_bias", "[-100, 100]"),
])
def test_rejected_constraints_are_400(url, body, param, text):
    r = httpx.post(url + "/v1/chat/completions", json=dict({"messages": MSGS, "max_tokens": 4}, **body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert text in err["message"]
    if param:
        assert err["param"] == param


# ------------------------------------------------------------------ tools

def _stream_tools(client, **kw):
    """(content, {index: (id, name, arguments)}, finish_reason) from a streamed reply"""
    content, calls, reason = [], {}, None
    for ch in client.chat.completions.create(model="x", messages=MSGS, stream=True, **kw):
        if not ch.choices:
            continue
        c = ch.choices[0]
        d = c.delta
        if d.content:
            content.append(d.content)
        for tc in d.tool_calls or []:
            i = tc.index
            cid, name, args = calls.get(i, (None, None, ""))
            calls[i] = (tc.id or cid, (tc.function.name if tc.function and tc.function.name else name),
                        args + (tc.function.arguments or "" if tc.function else ""))
        reason = c.finish_reason or reason
    return "".join(content), calls, reason


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_forced_tool_choice(client, choice):
    r = client.chat.completions.create(model="x", messages=MSGS, tools=TOOLS, tool_choice=choice, seed=3,
                                       max_tokens=600, **NO_PAR)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(choice, dict):
        assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    content, calls, reason = _stream_tools(client, tools=TOOLS, tool_choice=choice, seed=4, max_tokens=600, **NO_PAR)
    assert reason == "tool_calls" and content == "" and list(calls) == [0]
    cid, name, args = calls[0]
    assert cid.startswith("call_")
    jsonschema.validate(json.loads(args), PARAMS[name])
    # the client's stream helper assembles the same calls from the deltas
    with client.chat.completions.stream(model="x", messages=MSGS, tools=TOOLS, tool_choice=choice, seed=4,
                                        max_tokens=600, **NO_PAR) as st:
        final = st.get_final_completion()
    (fc,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert (fc.function.name, fc.function.arguments) == (name, args)


def test_parallel_tool_calls_are_each_valid(client):
    r = client.chat.completions.create(model="x", messages=MSGS, tools=TOOLS, tool_choice="required", seed=5,
                                       temperature=1.0, max_tokens=1500)
    ch = r.choices[0]
    if ch.finish_reason == "length":          # a random model may keep calling: nothing parsed then
        assert ch.message.tool_calls is None
        return
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) >= 1
    assert len({c.id for c in ch.message.tool_calls}) == len(ch.message.tool_calls)
    for c in ch.message.tool_calls:
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_none_and_auto(client, choice):
    """none: text, never parsed; auto: the noise rarely opens a call, and what comes is text or a valid call"""
    for stream in (False, True):
        if stream:
            content, calls, reason = _stream_tools(client, tools=TOOLS, tool_choice=choice, seed=6, max_tokens=40)
        else:
            r = client.chat.completions.create(model="x", messages=MSGS, tools=TOOLS, tool_choice=choice, seed=6,
                                               max_tokens=40)
            content, calls, reason = r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason
        if choice == "none" or not calls:
            assert not calls and reason in ("stop", "length") and isinstance(content, str)
        else:
            assert reason == "tool_calls"


def test_multi_turn_tool_conversation(client, url):
    msgs = [{"role": "user", "content": "what is 2 + 3?"}]
    r = client.chat.completions.create(model="x", messages=msgs, tools=TOOLS, tool_choice={"type": "function",
                                       "function": {"name": "add"}}, seed=7, max_tokens=600, **NO_PAR)
    call = r.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    msgs.append(r.choices[0].message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    r2 = client.chat.completions.create(model="x", messages=msgs, tools=TOOLS, seed=7, max_tokens=8,
                                        tool_choice="none")
    assert r2.choices[0].message.tool_calls is None
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    # the history went through the template: the tool call and its result are in the prompt
    body = dict(model="x", messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=1, logprobs=False)
    assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 200
    # a second call with the result in the history: forced again, still valid
    r3 = client.chat.completions.create(model="x", messages=msgs, tools=TOOLS, tool_choice="required", seed=8,
                                        max_tokens=600, **NO_PAR)
    c3 = r3.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(c3.function.arguments), PARAMS[c3.function.name])


# ------------------------------------------------------------------ logit_bias, n, tokenize

def test_logit_bias_and_n(client, url):
    tok = httpx.post(url + "/tokenize", json={"content": "Q"}).json()["tokens"]
    (q,) = tok
    r = client.completions.create(model="x", prompt="hello", max_tokens=5, temperature=0,
                                  logit_bias={str(q): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == "QQQQQ"
    r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0,
                                                   "ignore_eos": True, "logit_bias": [[q, 100]]})
    assert r.json()["choices"][0]["text"] == "QQQ"                  # llama.cpp's [[id, bias]] form
    r = client.completions.create(model="x", prompt="hello", max_tokens=6, temperature=1.0, seed=3, n=3,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == len(
        httpx.post(url + "/tokenize", json={"content": "hello"}).json()["tokens"])
    # choice i is the request with seed + i alone
    for i in range(3):
        one = client.completions.create(model="x", prompt="hello", max_tokens=6, temperature=1.0, seed=3 + i,
                                        extra_body={"ignore_eos": True})
        assert one.choices[0].text == r.choices[i].text
    texts = {}
    for ch in client.chat.completions.create(model="x", messages=MSGS, max_tokens=300, n=2, seed=1, stream=True,
                                             response_format={"type": "json_object"}):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert sorted(texts) == [0, 1]
    for t in texts.values():
        assert isinstance(json.loads(t), dict)


def test_tokenize_and_detokenize(url):
    r = httpx.post(url + "/tokenize", json={"content": "hello world<|im_end|>"}).json()
    ids = r["tokens"]
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).json() == {"content": "hello world<|im_end|>"}
    plain = httpx.post(url + "/tokenize", json={"content": "<|im_end|>", "parse_special": False}).json()["tokens"]
    assert len(plain) > 1
    pieces = httpx.post(url + "/tokenize", json={"content": "hi é", "with_pieces": True}).json()["tokens"]
    assert any(isinstance(p["piece"], list) for p in pieces)        # é is two byte tokens: bytes, not text
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                    for p in pieces) == "hi é".encode()
    assert all(set(p) == {"id", "piece"} for p in pieces)
    assert httpx.post(url + "/detokenize", json={"tokens": [99999]}).status_code == 400
    assert httpx.post(url + "/tokenize", json={"content": 5}).status_code == 400


# ------------------------------------------------------------------ batch invariance

def test_constrained_requests_are_batch_invariant(client):
    scs = schemas(8, seed=23)

    def one(i):
        kw = dict(temperature=0) if i % 2 else dict(temperature=1.0, seed=100 + i)
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": f"item {i}"}],
                                           response_format=_rf(scs[i]), max_tokens=1000, **kw)
        return r.choices[0].message.content
    alone = [one(i) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        together = list(ex.map(one, range(8)))
    assert alone == together
    for sc, t in zip(scs, alone):
        jsonschema.validate(json.loads(t), sc)


def test_generic_tool_format_in_process(tmp_path):
    """a model without a chat template (ChatML, the generic format: the reply is JSON), the app run
    in-process under Starlette's TestClient with the openai client on it"""
    from starlette.testclient import TestClient

    from cpufuse.llama import Model
    from cpufuse.serve import create_app
    from cpufuse.serve.batch import BatchEngine
    gguf = write_tiny_gguf(tmp_path / "plain.gguf", tied=False, n_ctx_train=2048)
    eng = BatchEngine(Model.load(gguf, n_ctx=2048, n_seq=2, n_threads=1), chunk=8)
    with TestClient(create_app(eng)) as http:
        c = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        r = c.chat.completions.create(model="x", messages=MSGS, tools=TOOLS, tool_choice="required", seed=1,
                                      max_tokens=800, parallel_tool_calls=False)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch.message.content
        (call,) = ch.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        # auto: a JSON reply, either {"response": ...} (content) or a call
        for seed in range(3):
            r = c.chat.completions.create(model="x", messages=MSGS, tools=TOOLS, seed=seed, max_tokens=800,
                                          parallel_tool_calls=False)
            m = r.choices[0].message
            if r.choices[0].finish_reason == "tool_calls":
                jsonschema.validate(json.loads(m.tool_calls[0].function.arguments),
                                    PARAMS[m.tool_calls[0].function.name])
            else:
                assert r.choices[0].finish_reason in ("stop", "length") and m.tool_calls is None
                if r.choices[0].finish_reason == "stop":
                    assert not m.content.lstrip().startswith("{"), m.content     # the response, unwrapped
