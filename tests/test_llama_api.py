"""cpufuse.llama.Llama (llama-cpp-python's API) and Model.generate(stop=) on tiny models: return
shapes, agreement with Model.generate and with a float64 reference of the repeat penalty, stop
strings, logprobs, refused options, and a script written for llama-cpp-python with only its import
changed."""
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _tiny_gguf import write_tiny_gguf  # noqa: E402

from cpufuse.llama import Llama, Model  # noqa: E402
from cpufuse.llama.sampling import Sampler  # noqa: E402

TEMPLATE = ("{% for message in messages %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("api") / "tiny.gguf", tied=False, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def llm(path):
    return Llama(model_path=path, n_ctx=256, n_threads=1, verbose=False)


@pytest.fixture(scope="module")
def model(path):
    return Model.load(path, n_ctx=256, n_threads=1)


def test_completion_shape_and_agreement(llm, model):
    out = llm("hello world", max_tokens=12, temperature=0)
    assert set(out) == {"id", "object", "created", "model", "choices", "usage"}
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-") and isinstance(out["created"], int)
    assert out["model"] == llm.model_path
    (c,) = out["choices"]
    assert set(c) == {"text", "index", "logprobs", "finish_reason"} and c["index"] == 0 and c["logprobs"] is None
    ref = model.generate("hello world", max_tokens=12, sampler=Sampler(temperature=0, penalty_last_n=64))
    assert c["text"] == ref.text
    assert c["finish_reason"] == ("length" if ref.stop_reason == "length" else "stop")
    u = out["usage"]
    assert u == {"prompt_tokens": len(ref.prompt_ids), "completion_tokens": len(ref.tokens),
                 "total_tokens": len(ref.prompt_ids) + len(ref.tokens)}
    # the stream: chunks of the same text, the finish reason on the last one
    chunks = list(llm.create_completion("hello world", max_tokens=12, temperature=0, stream=True))
    assert all(ch["object"] == "text_completion" and ch["id"] == chunks[0]["id"] for ch in chunks)
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == c["text"]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == c["finish_reason"]
    # echo and token-id prompts
    e = llm("hello world", max_tokens=12, temperature=0, echo=True)["choices"][0]["text"]
    assert e == "hello world" + c["text"]
    ids = llm.tokenize(b"hello world")
    assert llm(ids, max_tokens=12, temperature=0)["choices"][0]["text"] == c["text"]


def test_chat_shape_stream_and_agreement(llm, model):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    out = llm.create_chat_completion(messages=msgs, max_tokens=10, temperature=0)
    assert set(out) == {"id", "object", "created", "model", "choices", "usage"}
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    (c,) = out["choices"]
    assert set(c) == {"index", "message", "logprobs", "finish_reason"}
    assert c["message"]["role"] == "assistant"
    ref = model.generate(msgs, max_tokens=10, sampler=Sampler(temperature=0, penalty_last_n=64))
    assert c["message"]["content"] == ref.text
    assert out["usage"]["completion_tokens"] == len(ref.tokens)
    chunks = list(llm.create_chat_completion(messages=msgs, max_tokens=10, temperature=0, stream=True))
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == c["finish_reason"]
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == c["message"]["content"]
    # content given as text parts
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    a = llm.create_chat_completion(messages=parts, max_tokens=6, temperature=0)["choices"][0]["message"]["content"]
    b = llm.create_chat_completion(messages=[{"role": "user", "content": "hi there"}], max_tokens=6,
                                   temperature=0)["choices"][0]["message"]["content"]
    assert a == b


def test_seeds(path):
    a = Llama(path, n_ctx=128, seed=7, verbose=False)
    b = Llama(path, n_ctx=128, seed=7, verbose=False)
    kw = dict(max_tokens=10, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    ta = [a("the", **kw)["choices"][0]["text"] for _ in range(2)]
    tb = [b("the", **kw)["choices"][0]["text"] for _ in range(2)]
    assert ta == tb                                   # a seeded Llama: the same sequence of calls
    assert a("the", seed=3, **kw) ["choices"][0]["text"] == b("the", seed=3, **kw)["choices"][0]["text"]


def test_tokenize_detokenize(llm, model):
    ids = llm.tokenize(b"hello world")
    assert ids == model.tokenize(b"hello world")
    assert llm.detokenize(ids) == b"hello world"
    assert llm.tokenize("<|im_start|>".encode(), special=True) == [model.tokenizer.tokens.index("<|im_start|>")] \
        if hasattr(model.tokenizer, "tokens") else True
    with pytest.raises(TypeError, match="bytes"):
        llm.tokenize("hello")
    assert llm.n_ctx() == 256 and llm.n_vocab() == model.n_vocab


def test_stop_strings(model, llm):
    full = model.generate("hello world", max_tokens=24, temperature=0)
    assert len(full.text) > 6, full.text
    stop = full.text[3:6]                              # a string that appears: cut before it
    r = model.generate("hello world", max_tokens=24, temperature=0, stop=[stop, "\x00never"])
    k = full.text.find(stop)
    assert r.text == full.text[:k] and r.stop_reason == "stop"
    it = model.generate("hello world", max_tokens=24, temperature=0, stop=stop, stream=True)
    pieces = list(it)
    assert "".join(pieces) == r.text and it.result.stop_reason == "stop"
    out = llm("hello world", max_tokens=24, temperature=0, stop=[stop])
    assert out["choices"][0]["text"] == r.text and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == len(r.tokens)
    # a stop string that never comes changes nothing
    r2 = model.generate("hello world", max_tokens=24, temperature=0, stop="\x01\x02")
    assert r2.text == full.text and r2.stop_reason == full.stop_reason
    for bad, err in ((3, TypeError), ([""], ValueError), (["a", 1], TypeError)):
        with pytest.raises(err, match="stop"):
            model.generate("hi", max_tokens=2, stop=bad)


def test_repeat_penalty_against_a_float64_reference(llm, model):
    """greedy decoding with llama.cpp's repeat penalty over the last 64 tokens (prompt included),
    recomputed from the model's logits in float64: a logit > 0 divided, <= 0 multiplied"""
    prompt = "hello hello hello world"
    n, rp = 10, 1.7
    ids = model.tokenize(prompt, special=True)
    seq = list(ids)
    for _ in range(n):
        lg = model.logits(seq)[-1].astype(np.float64)
        for t in set(seq[-64:]):
            lg[t] = lg[t] / rp if lg[t] > 0 else lg[t] * rp
        t = int(np.argmax(lg))
        if t in model.eog_ids:
            break
        seq.append(t)
    ref = seq[len(ids):]
    r = model.generate(prompt, max_tokens=n, temperature=0, repeat_penalty=rp)
    assert r.tokens == ref
    out = llm(prompt, max_tokens=n, temperature=0, repeat_penalty=rp)
    assert out["choices"][0]["text"] == model.detokenize(ref)
    plain = model.generate(prompt, max_tokens=n, temperature=0, repeat_penalty=1.0)
    assert plain.tokens != ref                        # the penalty changed something on this prompt


def test_logprobs(llm, model):
    out = llm("hello world", max_tokens=5, temperature=0, logprobs=3)
    lp = out["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "text_offset", "token_logprobs", "top_logprobs"}
    r = model.generate("hello world", max_tokens=5, temperature=0)
    seq = list(r.prompt_ids)
    for i, t in enumerate(r.tokens):
        x = model.logits(seq)[-1].astype(np.float64)
        ls = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        assert lp["token_logprobs"][i] == pytest.approx(ls[t], abs=1e-4)
        # a dict keyed by the token's text (llama-cpp-python's shape): byte tokens that decode to the
        # same replacement character share one key
        assert 1 <= len(lp["top_logprobs"][i]) <= 3 and max(lp["top_logprobs"][i].values()) == pytest.approx(ls.max(), abs=1e-4)
        seq.append(t)
    assert lp["text_offset"][0] == len("hello world")
    ch = llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
                                    logprobs=True, top_logprobs=2)
    c = ch["choices"][0]["logprobs"]["content"]
    assert len(c) == ch["usage"]["completion_tokens"] or ch["choices"][0]["finish_reason"] == "stop"
    assert all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 2 for e in c)
    # streamed: each chunk carries its tokens' logprobs; together they are the whole reply's
    chunks = list(llm("hello world", max_tokens=5, temperature=0, logprobs=3, stream=True))
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert sum((p["token_logprobs"] for p in parts), []) == lp["token_logprobs"]
    assert sum((p["text_offset"] for p in parts), []) == lp["text_offset"]
    chunks = list(llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                             temperature=0, logprobs=True, top_logprobs=2, stream=True))
    streamed = sum((c["choices"][0]["logprobs"]["content"] for c in chunks if c["choices"][0]["logprobs"]), [])
    assert [e["logprob"] for e in streamed][:len(c)] == [e["logprob"] for e in c]


def test_refused_and_unknown_options(path, llm):
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        Llama(path, bogus=1, verbose=False)
    with pytest.raises(NotImplementedError, match="lora_path"):
        Llama(path, lora_path="x.gguf", verbose=False)
    Llama(path, n_ctx=64, n_gpu_layers=-1, use_mmap=True, flash_attn=True, logits_all=True, verbose=False)
    # what LangChain's LlamaCpp passes: legacy options, and RoPE values equal to the model's
    Llama(path, n_ctx=64, n_parts=-1, f16_kv=True, rope_freq_base=10000.0, rope_freq_scale=1.0, lora_path=None,
          lora_base=None, vocab_only=False, use_mlock=False, last_n_tokens_size=64, verbose=False)
    with pytest.raises(NotImplementedError, match="rope_freq_base"):
        Llama(path, n_ctx=64, rope_freq_base=500000.0, verbose=False)
    for kw in (dict(kv_overrides={"llama.context_length": 8}), dict(last_n_tokens_size=16)):   # would change results
        with pytest.raises(NotImplementedError, match=next(iter(kw))):
            Llama(path, n_ctx=64, verbose=False, **kw)
    for kw, name in ((dict(mirostat_mode=2), "mirostat_mode"), (dict(typical_p=0.5), "typical_p"),
                     (dict(suffix="x"), "suffix")):
        with pytest.raises(NotImplementedError, match=name):
            llm("hi", max_tokens=2, **kw)
    with pytest.raises(TypeError):
        llm("hi", max_tokens=2, not_an_option=1)
    with pytest.raises(ValueError, match="temperature"):
        llm("hi", max_tokens=2, temperature=-1)


# a script as llama-cpp-python's README writes it; only the import line differs
SCRIPT = '''
from llama_cpp import Llama
import sys

llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, n_batch=64, seed=1337, verbose=False)
output = llm("Q: Name the planets in the solar system? A: ", max_tokens=32, stop=["Q:", "\\n"], echo=True)
print(output["choices"][0]["text"])
assert output["usage"]["prompt_tokens"] > 0
out = llm.create_chat_completion(
    messages=[{"role": "system", "content": "You are an assistant who perfectly describes images."},
              {"role": "user", "content": "Describe this image in detail please."}],
    max_tokens=16, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repeat_penalty=1.1,
    presence_penalty=0.1, frequency_penalty=0.1, seed=5)
print(out["choices"][0]["message"]["content"], out["choices"][0]["finish_reason"], out["usage"]["total_tokens"])
for chunk in llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True):
    delta = chunk["choices"][0]["delta"]
    if "content" in delta:
        print(delta["content"], end="", flush=True)
print()
tokens = llm.tokenize(b"Hello, world!")
print(llm.detokenize(tokens).decode("utf-8"))
print("ok", llm.n_ctx())
'''


def test_a_llama_cpp_python_script_runs_with_only_the_import_changed(path, tmp_path):
    src = SCRIPT.replace("from llama_cpp import Llama", "from cpufuse.llama import Llama")
    assert src.count("\n") == SCRIPT.count("\n") and src != SCRIPT
    f = tmp_path / "script.py"
    f.write_text(src)
    r = subprocess.run([sys.executable, str(f), path], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("Q: Name the planets in the solar system? A: ")
    assert "Hello, world!" in lines and lines[-1] == "ok 512"


def test_chat_tools_and_response_format(path):
    """tools and response_format reach Model.generate through create_chat_completion; a call comes
    back in OpenAI's shape (content None, tool_calls with a JSON arguments string, finish_reason
    "tool_calls"), as llama-cpp-python returns it"""
    import json
    llm = Llama(model_path=path, n_ctx=2048, n_threads=1, verbose=False)   # the tools' JSON is in the prompt
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x"], "additionalProperties": False}}}]
    out = llm.create_chat_completion(messages=[{"role": "user", "content": "add"}], tools=tools,
                                     tool_choice="required", parallel_tool_calls=False, max_tokens=800,
                                     temperature=0)
    ch = out["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None, ch
    (call,) = ch["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "add"
    assert 0 <= json.loads(call["function"]["arguments"])["x"] <= 9
    schema = {"type": "object", "properties": {"b": {"enum": ["x", "y"]}}, "required": ["b"],
              "additionalProperties": False}
    out = llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=200, temperature=0,
                                     response_format={"type": "json_object", "schema": schema})
    assert json.loads(out["choices"][0]["message"]["content"])["b"] in ("x", "y")
    chunks = list(llm.create_chat_completion(messages=[{"role": "user", "content": "add"}], tools=tools,
                                             tool_choice="required", max_tokens=800, temperature=0, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") for d in deltas)                     # the call's text is not content
    head, args = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert head["id"] == head["id"] and head["function"] == {"name": "add", "arguments": ""}
    assert args["function"]["arguments"] == call["function"]["arguments"]          # greedy: the same call


def test_grammar_logit_bias_and_response_format(path, llm):
    """grammar (GBNF text, cpufuse's LlamaGrammar, an object like llama-cpp-python's), logit_bias
    and response_format json_schema on both completion calls, as llama-cpp-python takes them"""
    import json
    from types import SimpleNamespace
    from cpufuse.llama import LlamaGrammar
    msgs = [{"role": "user", "content": "yes or no?"}]
    gbnf = 'root ::= "yes" | "no"'
    for g in (gbnf, LlamaGrammar.from_string(gbnf), SimpleNamespace(_grammar=gbnf)):
        out = llm.create_chat_completion(messages=msgs, grammar=g, max_tokens=20, temperature=0.9, seed=1)
        assert out["choices"][0]["message"]["content"] in ("yes", "no")
        assert llm("Q:", grammar=g, max_tokens=20, seed=2)["choices"][0]["text"] in ("yes", "no")
    g = LlamaGrammar.from_json_schema(json.dumps({"type": "object", "properties": {"k": {"enum": [1, 2]}},
                                                  "required": ["k"]}))
    assert json.loads(llm("Q:", grammar=g, max_tokens=60, temperature=0)["choices"][0]["text"])["k"] in (1, 2)
    schema = {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}
    out = llm.create_chat_completion(messages=msgs, max_tokens=60, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert set(json.loads(out["choices"][0]["message"]["content"])) == {"b"}     # closed: no other key
    # logit_bias: +100 makes a token win every greedy step; -100 keeps the greedy one out
    plain = llm("Q:", max_tokens=6, temperature=0)
    first = llm.tokenize(plain["choices"][0]["text"].encode(), add_bos=False)[0]
    t = 7 if first != 7 else 8
    biased = llm("Q:", max_tokens=6, temperature=0, logit_bias={t: 100.0})
    assert llm.tokenize(biased["choices"][0]["text"].encode(), add_bos=False)[:1] == [t]
    banned = llm.create_chat_completion(messages=msgs, max_tokens=6, temperature=0, logit_bias={str(first): -100})
    assert banned["choices"][0]["message"]["content"] is not None
    streamed = "".join(c["choices"][0]["text"] for c in llm("Q:", max_tokens=6, temperature=0, stream=True,
                                                            logit_bias={t: 100.0}))
    assert streamed == biased["choices"][0]["text"]


def test_bad_guide_arguments_are_clear_errors(path, llm):
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    cases = [
        (dict(logit_bias={10 ** 9: 1.0}), ValueError, "logit_bias: token id"),
        (dict(logit_bias={1: 500}), ValueError, r"\[-100, 100\]"),
        (dict(logit_bias="x"), TypeError, "logit_bias must be"),
        (dict(grammar=3), ValueError, "grammar must be a GBNF string or a LlamaGrammar"),
        (dict(grammar="root ::= ("), ValueError, "grammar"),
        (dict(response_format="json"), TypeError, "response_format must be"),
        (dict(response_format={"type": "xml"}), ValueError, "response_format.type"),
        (dict(tools="f"), TypeError, "tools must be a list"),
        (dict(tools=[]), ValueError, "tools must be a non-empty"),
        (dict(tool_choice="auto"), ValueError, "tool_choice needs tools"),
        (dict(parallel_tool_calls=True), ValueError, "parallel_tool_calls needs tools"),
        (dict(tools=tools, parallel_tool_calls=1), TypeError, "parallel_tool_calls must be a bool"),
        (dict(tools=tools, tool_choice={"type": "function", "function": {"name": "g"}}), ValueError, "not in tools"),
        (dict(tools=tools, tool_choice="always"), ValueError, "tool_choice must be"),
        (dict(tools=tools, tool_choice="required", response_format={"type": "json_object"}), ValueError,
         "cannot be combined"),
        (dict(tools=tools, functions=[{"name": "f"}]), ValueError, "not both"),
        (dict(function_call="sometimes", functions=[{"name": "f"}]), ValueError, "function_call must be"),
        (dict(grammar='root ::= "a"', response_format={"type": "json_object"}), ValueError, "only one constraint"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            llm.create_chat_completion(messages=msgs, max_tokens=2, **kw)
    with pytest.raises(ValueError, match="logit_bias"):
        llm("hi", max_tokens=2, logit_bias={-1: 1.0})
    # the legacy functions / function_call form is tools / tool_choice
    big = Llama(model_path=path, n_ctx=2048, n_threads=1, verbose=False)     # the tools' JSON is in the prompt
    out = big.create_chat_completion(messages=msgs, max_tokens=400, temperature=0, functions=[
        {"name": "f", "parameters": {"type": "object", "properties": {"v": {"enum": [1]}}, "required": ["v"]}}],
        function_call={"name": "f"})
    assert out["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"v": 1}'}


def test_logits_processor_and_stopping_criteria(llm):
    """llama-cpp-python's hooks: a processor that forbids the greedy token changes the first token;
    a criterion that fires after 3 generated tokens stops there with finish_reason "stop";
    both get the ids so far (prompt included) as an int32 array and the float32 row"""
    plain = llm("Q:", max_tokens=8, temperature=0, logprobs=0)["choices"][0]["logprobs"]["tokens"]
    seen = []

    def ban(ids, scores):                      # the greedy first token is forbidden
        if not seen:
            scores[int(np.argmax(scores))] = -np.inf
        seen.append((ids.dtype, scores.dtype, len(ids)))
        return scores
    out = llm("Q:", max_tokens=8, temperature=0, logits_processor=[ban], logprobs=0)
    assert out["choices"][0]["logprobs"]["tokens"][0] != plain[0]
    n0 = seen[0][2]
    assert seen[0][:2] == (np.intc, np.float32) and [s[2] for s in seen] == list(range(n0, n0 + len(seen)))
    out = llm("Q:", max_tokens=8, temperature=0, stopping_criteria=lambda ids, logits: len(ids) >= n0 + 3)
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 3
    msgs = [{"role": "user", "content": "hi"}]
    seen.clear()
    chat = llm.create_chat_completion(messages=msgs, max_tokens=4, temperature=0, logits_processor=ban)
    assert chat["choices"][0]["finish_reason"] in ("stop", "length")
    with pytest.raises(TypeError, match="logits_processor must be a callable"):
        llm("Q:", max_tokens=2, logits_processor=[3])
    with pytest.raises(NotImplementedError, match="stopping_criteria together with grammar"):
        llm("Q:", max_tokens=2, grammar='root ::= "a"', stopping_criteria=lambda i, s: False)
