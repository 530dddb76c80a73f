"""Context beyond the cache in the server (issue 42 item 4): with context_shift (serve
--context-shift) a sequence that fills its slot shifts it as llama.cpp does and goes on, with the
tokens of the same sequence shifted alone by Model.generate(context_shift=True), beside other
sequences, streamed or not, chat and completions; without it a request fits the context and ends
with "length"; the reason is in the reply and in the request log; a prompt that fills the slot is
a 400 naming the lengths."""
import json

import numpy as np
import pytest

from _serving import collect as _collect, request_log
from _tiny_gguf import write_tiny_gguf

from cpufuse.llama import Model
from cpufuse.serve.batch import BatchEngine, SerialEngine
from cpufuse.serve.engine import EngineRequest, RequestError, SamplingParams, make_sampler

N_CTX, CHUNK, KEEP = 32, 8, 5
TEMPLATE = ("{% for message in messages %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(write_tiny_gguf(tmp_path_factory.mktemp("ctx") / "m.gguf", qtype="Q8_0", chat_template=TEMPLATE))


@pytest.fixture(scope="module")
def alone(path):
    """the library path: one sequence, prompt micro-batches of the engine's chunk"""
    m = Model.load(path, n_ctx=N_CTX, n_batch=CHUNK)

    def run(prompt, max_tokens, sp):
        return m.generate(list(prompt), max_tokens=max_tokens, sampler=make_sampler(sp), stop_at_eog=False,
                          reuse_cache=False, context_shift=True, n_keep=KEEP).tokens
    return run


def _requests():
    rng = np.random.default_rng(3)
    out = []
    for i, (L, n) in enumerate(((4, 70), (11, 45), (20, 9), (17, 40), (3, 100), (25, 30))):
        sp = SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=0.9, top_p=0.9, seed=7 + i)
        out.append(EngineRequest([int(t) for t in rng.integers(5, 250, L)], n, sp))
    return out


def _copy(r):
    return EngineRequest(list(r.prompt_ids), r.max_tokens, r.sampling)


@pytest.mark.parametrize("engine", ["batch", "serial"])
def test_shifted_sequences_equal_the_library_alone(path, alone, engine):
    reqs = _requests()
    if engine == "batch":
        eng = BatchEngine(Model.load(path, n_ctx=N_CTX, n_seq=3), chunk=CHUNK, context_shift=True, n_keep=KEEP)
    else:
        eng = SerialEngine(Model.load(path, n_ctx=N_CTX, n_batch=CHUNK), context_shift=True, n_keep=KEEP)
    eng.start()
    try:
        one = [_collect(eng.submit(_copy(r))) for r in reqs]          # one at a time
        hs = [eng.submit(_copy(r)) for r in reqs]                      # together (more than the slots)
        together = [_collect(h) for h in hs]
        shifts = eng.stats().context_shifts
    finally:
        eng.stop()
    for r, (t1, f1), (t2, f2) in zip(reqs, one, together):
        want = alone(r.prompt_ids, r.max_tokens, r.sampling)
        assert t1 == want and t2 == want, r.prompt_ids
        assert f1.finish_reason == f2.finish_reason == "length" and f1.completion_tokens == r.max_tokens
        n, past = 0, len(r.prompt_ids)  # the shifts: one each time a token to evaluate finds the slot full
        for _ in range(r.max_tokens - 1):
            if past == N_CTX:
                past, n = past - (N_CTX - KEEP) // 2, n + 1
            past += 1
        assert f1.detail == f2.detail == (f"{n} context shift{'s' if n > 1 else ''}" if n else None)
    assert shifts > 2 * len(reqs)


def test_a_shift_with_speculative_decoding_changes_no_token(path, alone):
    from cpufuse.llama import LlamaPromptLookupDecoding
    reqs = [EngineRequest([5, 6, 7, 8] * 3, 50, SamplingParams(temperature=0.0)),
            EngineRequest([9, 10, 11] * 4, 40, SamplingParams(temperature=0.9, seed=3))]
    eng = BatchEngine(Model.load(path, n_ctx=N_CTX, n_seq=2), chunk=CHUNK, context_shift=True, n_keep=KEEP,
                      draft=LlamaPromptLookupDecoding(num_pred_tokens=3))
    eng.start()
    try:
        got = [_collect(h) for h in [eng.submit(_copy(r)) for r in reqs]]
        st = eng.stats()
    finally:
        eng.stop()
    assert st.context_shifts >= 3 and st.draft_tokens > 0
    for r, (toks, fin) in zip(reqs, got):
        assert toks == alone(r.prompt_ids, r.max_tokens, r.sampling) and fin.detail.endswith("context shifts")


def test_a_shifted_slot_lends_only_its_first_n_keep_tokens(path, alone):
    eng = BatchEngine(Model.load(path, n_ctx=N_CTX, n_seq=1), chunk=4, context_shift=True, n_keep=8)
    eng.start()
    try:
        prompt = list(range(10, 30))
        toks, fin = _collect(eng.submit(EngineRequest(prompt, 20, SamplingParams(temperature=0.0))))
        assert fin.detail == "1 context shift" and eng.slots[0].exact == 8
        # the slot holds prompt[:8] + the rest after the shift: a request starting with all of the
        # slot's tokens reuses the first 8 only (the shifted cells are not what evaluation writes)
        h = eng.submit(EngineRequest(list(eng.slots[0].tokens) + [3], 4, SamplingParams(temperature=0.0)))
        _collect(h)
        assert h.cached_tokens == 8
    finally:
        eng.stop()


def test_without_the_flag_requests_fit_and_end_with_length(path):
    eng = BatchEngine(Model.load(path, n_ctx=N_CTX, n_seq=2), chunk=CHUNK)
    assert not eng.context_shift
    eng.start()
    try:
        with pytest.raises(RequestError, match=r"prompt \(10 tokens\) plus max_tokens \(23\) exceeds the context "
                                                r"\(32 tokens\)"):
            eng.submit(EngineRequest(list(range(10)), 23, SamplingParams(temperature=0.0)))
        toks, fin = _collect(eng.submit(EngineRequest(list(range(10)), 22, SamplingParams(temperature=0.0))))
        assert (len(toks), fin.finish_reason, fin.detail) == (22, "length", "context full: n_ctx 32")
        toks, fin = _collect(eng.submit(EngineRequest(list(range(10)), 5, SamplingParams(temperature=0.0))))
        assert (len(toks), fin.finish_reason, fin.detail) == (5, "length", None)
        assert eng.stats().context_shifts == 0
    finally:
        eng.stop()


def test_bad_context_arguments(path):
    m = Model.load(path, n_ctx=N_CTX)
    with pytest.raises(ValueError, match=r"n_keep must be an int in \[0, n_ctx - 2 = 30\].*got 31"):
        BatchEngine(m, context_shift=True, n_keep=31)
    with pytest.raises(ValueError, match="n_keep.*got -1"):
        BatchEngine(m, n_keep=-1)
    with pytest.raises(TypeError, match="context_shift must be a bool"):
        BatchEngine(m, context_shift="yes")
    eng = BatchEngine(m, context_shift=True)
    eng.start()
    try:
        with pytest.raises(RequestError, match=r"the prompt \(32 tokens\) does not fit the context \(32 tokens\)"):
            eng.submit(EngineRequest(list(range(32)), 1))
        toks, fin = _collect(eng.submit(EngineRequest(list(range(31)), 3, SamplingParams(temperature=0.0))))
        assert len(toks) == 3 and fin.detail == "1 context shift"
    finally:
        eng.stop()


def test_serve_checks_keep_before_loading(path, capsys):
    from cpufuse.serve import cli as serve_cli
    assert serve_cli.main([path, "-c", "32", "--context-shift", "--keep", "31"]) == 2
    assert "--keep must be in [0, -c - 2 = 30]" in capsys.readouterr().err
    assert serve_cli.main([path, "--keep", "-1"]) == 2
    assert "--keep must be" in capsys.readouterr().err
    a = serve_cli.build_parser().parse_args([path, "--context-shift", "--keep", "4"])
    assert (a.context_shift, a.keep) == (True, 4)


# ---------------------------------------------------------------------------------- HTTP
def _sse(resp):
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_http_chat_and_completions_shift_streamed_and_not(path):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient
    from cpufuse.llama.chat import chat_prompt
    from cpufuse.serve import create_app
    m = Model.load(path, n_ctx=N_CTX, n_batch=CHUNK)

    def ref(ids, n):
        return m.generate(ids, max_tokens=n, temperature=0, stop_at_eog=False, reuse_cache=False,
                          context_shift=True, n_keep=KEEP).text

    eng = BatchEngine(Model.load(path, n_ctx=N_CTX, n_seq=2), chunk=CHUNK, context_shift=True, n_keep=KEEP)
    with request_log() as lines, TestClient(create_app(eng)) as http:
        prompt = [11, 12, 13, 14, 15, 16]
        body = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        r = http.post("/v1/completions", json=body).json()
        want = ref(prompt, 60)
        assert r["choices"][0]["text"] == want and r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["completion_tokens"] == 60
        assert any("completion 60 tok, length (3 context shifts)" in s for s in lines), lines
        with http.stream("POST", "/v1/completions", json=dict(body, stream=True)) as s:
            ch = _sse(s)
        assert "".join(c["choices"][0]["text"] for c in ch) == want
        assert ch[-1]["choices"][0]["finish_reason"] == "length"

        msgs = [{"role": "user", "content": "hello world"}]
        ids = m.tokenize(chat_prompt(m.tokenizer, msgs), add_bos=False, special=True)
        want = ref(ids, 50)
        cb = {"messages": msgs, "max_tokens": 50, "temperature": 0, "ignore_eos": True}
        r = http.post("/v1/chat/completions", json=cb).json()
        assert r["choices"][0]["message"]["content"] == want and r["choices"][0]["finish_reason"] == "length"
        with http.stream("POST", "/v1/chat/completions", json=dict(cb, stream=True)) as s:
            ch = _sse(s)
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in ch if c["choices"]) == want
        assert [c["choices"][0]["finish_reason"] for c in ch if c["choices"]][-1] == "length"
        assert "cpufuse_context_shifts_total" in http.get("/metrics").text

        r = http.post("/v1/completions", json={"prompt": list(range(1, 40)), "max_tokens": 4})
        e = r.json()["error"]
        assert r.status_code == 400 and e["code"] == "context_length_exceeded" and e["param"] == "prompt"
        assert "maximum context length is 32 tokens" in e["message"] and "39 tokens" in e["message"]
        assert (e["n_prompt_tokens"], e["n_ctx"]) == (39, 32)


def test_http_without_the_flag_logs_a_full_context(path):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient
    from cpufuse.serve import create_app
    eng = BatchEngine(Model.load(path, n_ctx=N_CTX, n_seq=1), chunk=CHUNK)
    with request_log() as lines, TestClient(create_app(eng)) as http:
        r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 30, "ignore_eos": True})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "temperature": 0, "ignore_eos": True}).json()
        assert r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["total_tokens"] == N_CTX
        assert any("length (context full: n_ctx 32)" in s for s in lines), lines
