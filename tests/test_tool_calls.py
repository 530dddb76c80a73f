"""Tool calls as models write them (cpufuse.llama.toolcalls, cpufuse.llama.tools): every known chat
template (tests/_chat_templates.py) is rendered with tools and a tool-call history, and fixed model
outputs in each format's forms are parsed, whole and streamed piece by piece. No model runs here
except the tiny one behind Llama at the end."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _chat_templates import TEMPLATES  # noqa: E402

from cpufuse.llama.chat import render_chat  # noqa: E402
from cpufuse.llama.toolcalls import detect_format, parse_calls  # noqa: E402
from cpufuse.llama.tools import ToolSpec, ToolStream, close_schema  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
PARIS = ("get_weather", {"city": "Paris"})
SUM = ("add", {"a": 1, "b": 2})

# fixed replies per format: (text, content expected, calls expected)
REPLIES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [PARIS]),
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         "Let me check.", [PARIS]),
        # what Qwen2.5-Coder writes under "auto": a fenced JSON block
        ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', None, [PARIS]),
        ('Sure:\n```json\n{\n  "name": "add",\n  "arguments": {"a": 1, "b": 2}\n}\n```\nDone.', "Sure:\nDone.", [SUM]),
        ('```xml\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n```', None, [SUM]),
        ('<function_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</function_call>', None, [SUM]),
        ('<tool>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool>', None, [SUM]),
        ('<tools>{"name": "add", "arguments": {"a": 1, "b": 2}}</tools>', None, [SUM]),
        ('<response>{"name": "add", "arguments": {"a": 1, "b": 2}}</response>', None, [SUM]),
        ('<json>{"name": "add", "arguments": {"a": 1, "b": 2}}</json>', None, [SUM]),
        ('<xml>{"name": "add", "arguments": {"a": 1, "b": 2}}</xml>', None, [SUM]),
        ('<JSON>{"name": "add", "arguments": {"a": 1, "b": 2}}</JSON>', None, [SUM]),
        ('<function=add>{"a": 1, "b": 2}</function>', None, [SUM]),
        ('<function name="add">{"a": 1, "b": 2}</function>', None, [SUM]),
        ('{"name": "add", "arguments": {"a": 1, "b": 2}}', None, [SUM]),                 # bare, the whole reply
        ('{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}', None, [SUM]),       # arguments as a string
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
         '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [SUM, PARIS]),
        # the second call cut off by max_tokens: the first is kept
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
         '{"name": "get_weather", "argu', None, [SUM]),
        ('The answer is 3. {"a": 1} is a JSON object.', 'The answer is 3. {"a": 1} is a JSON object.', None),
        ('A file: {"name": "x.txt", "size": 3}', 'A file: {"name": "x.txt", "size": 3}', None),     # no arguments
        # Qwen2.5-Coder-1.5B-Instruct Q4_K_M through the server (auto, default sampling, seed 4: 3 of 8
        # replies): the call in doubled braces, as its template's `{"name": <function-name>, ...}`
        ('{{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}', None,
         [("get_weather", {"city": "Paris", "unit": "celsius"})]),
        ('{{"name": "get_weather", "arguments": {"city": "Cairo", "unit": "celsius"}}}}', None,   # seed 101
         [("get_weather", {"city": "Cairo", "unit": "celsius"})]),
        ('<tool_call>\n{{"name": "get_weather", "arguments": {"city": "Paris"}}}\n</tool_call>', None, [PARIS]),
        ('Ok {{"name": "get_weather", "arguments": {"city": "Paris"}} and', "Ok {and", [PARIS]),   # not doubled
        ('{{"name": "add", "arguments": {"a": 1, "b": 2}}}\n{{"name": "get_weather", "arguments": {"city": "Pa',
         None, [SUM]),
    ],
    "llama3": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
        ('{"type": "function", "name": "add", "parameters": {"a": 1, "b": 2}}', None, [SUM]),
        ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [SUM]),
        ('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "Paris"}}',
         None, [SUM, PARIS]),
        ('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weath', None, [SUM]),
        ("It is sunny.", "It is sunny.", None),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}]', None, [PARIS]),
        ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": '
         '{"city": "Paris"}}]', None, [SUM, PARIS]),
        ('[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', None, [SUM]),                          # Mistral Small 3.2
        ('[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
         None, [SUM, PARIS]),
        ("Hello!", "Hello!", None),
    ],
    "granite": [
        ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [PARIS]),
        ('<|tool_call|>[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": '
         '{"city": "Paris"}}]', None, [SUM, PARIS]),
        ("Hi there.", "Hi there.", None),
    ],
    "phi4": [
        ('<|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}<|/tool_call|>', None, [PARIS]),
        ('<|tool_call|>[{"name": "add", "arguments": {"a": 1, "b": 2}}]<|/tool_call|><|tool_call|>{"name": '
         '"get_weather", "arguments": {"city": "Paris"}}<|/tool_call|>', None, [SUM, PARIS]),
        ("Plain.", "Plain.", None),
    ],
    "gpt-oss": [
        ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
         'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>', None, [PARIS]),
        ('<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 3.<|return|>',
         "It is 3.", None),
    ],
    "generic": [
        ('{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}', None, [PARIS]),
        ('{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": '
         '{"city": "Paris"}}]}', None, [SUM, PARIS]),
        ('{"response": "Hello"}', "Hello", None),
    ],
}


def _calls(calls):
    return None if calls is None else [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("fmt", sorted(REPLIES))
def test_fixed_replies_parse(fmt):
    for text, content, calls in REPLIES[fmt]:
        spec = ToolSpec(TOOLS, "auto", parallel_tool_calls=True, fmt=fmt)
        got_content, got = spec.parse(text)
        assert (got_content, _calls(got)) == (content, calls), text
        for c in got or ():
            assert c["id"].startswith("call_") and c["type"] == "function"
        # parallel_tool_calls false (the default): the first call only
        one = ToolSpec(TOOLS, "auto", fmt=fmt).parse(text)[1]
        assert _calls(one) == (None if calls is None else calls[:1])


@pytest.mark.parametrize("fmt", sorted(set(REPLIES) - {"generic", "gpt-oss"}))
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_replies_send_content_and_hold_calls(fmt, step):
    """pieces of `step` characters: the content sent while streaming plus the rest at the end is the
    content, and no call text is ever sent"""
    for text, content, calls in REPLIES[fmt]:
        spec = ToolSpec(TOOLS, "auto", parallel_tool_calls=True, fmt=fmt)
        st = ToolStream(spec)
        sent = "".join(st.push(text[i:i + step]) for i in range(0, len(text), step))
        rest, got = st.finish()
        assert _calls(got) == calls, text
        if calls is None:
            assert sent + (rest or "") == text
        else:
            assert '"name"' not in sent and "[ARGS]" not in sent
            whole = (sent.strip() + ("\n\n" if sent.strip() and rest else "") + (rest or "")).strip() or None
            if content is None:
                assert whole is None, (sent, rest)
            else:
                assert sent.strip() and content.startswith(sent.strip())


def test_forced_choices_and_parallel_defaults():
    text = REPLIES["hermes"][16][0]                                        # two calls
    assert ToolSpec(TOOLS, fmt="hermes", tool_choice="auto").parallel is False    # llama-server's default
    assert len(ToolSpec(TOOLS, fmt="hermes", tool_choice="required").parse(text)[1]) == 1
    assert len(ToolSpec(TOOLS, fmt="hermes", tool_choice="required", parallel_tool_calls=True).parse(text)[1]) == 2
    named = ToolSpec(TOOLS, fmt="hermes", tool_choice={"type": "function", "function": {"name": "add"}},
                     parallel_tool_calls=True)
    assert named.parallel is False and _calls(named.parse(text)[1]) == [SUM]
    weather = {"type": "function", "function": {"name": "get_weather"}}
    assert ToolSpec(TOOLS, fmt="hermes", tool_choice=weather).parse(text)[1] is None
    assert ToolSpec(TOOLS, fmt="hermes", tool_choice="none").parse(text) == (text, None)
    unknown = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    assert ToolSpec(TOOLS, fmt="hermes").parse(unknown) == (unknown, None)
    with pytest.raises(TypeError, match="parallel_tool_calls"):
        ToolSpec(TOOLS, parallel_tool_calls="yes")


def test_tool_parameters_are_closed_as_llama_cpp_closes_them():
    s = {"type": "object", "properties": {"a": {"type": "object", "properties": {"x": {}}},
                                          "b": {"type": "array", "items": {"properties": {"y": {}}}},
                                          "c": {"type": "object"}},
         "$defs": {"d": {"properties": {"z": {}}, "additionalProperties": True}},
         "anyOf": [{"properties": {"w": {}}}]}
    c = close_schema(s)
    assert c["additionalProperties"] is False
    assert c["properties"]["a"]["additionalProperties"] is False
    assert c["properties"]["b"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in c["properties"]["c"]                 # no properties listed: any object
    assert c["$defs"]["d"]["additionalProperties"] is True                   # said so: kept
    assert c["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in s                                   # the argument is not changed
    assert ToolSpec([WEATHER]).tools[0]["function"]["parameters"]["additionalProperties"] is False


def test_closed_parameters_hold_in_the_grammar():
    llg = pytest.importorskip("llguidance")
    from _tiny_gguf import write_tiny_gguf  # noqa: F401 -- a tokenizer with every byte
    import tempfile
    from cpufuse.llama import Model
    with tempfile.TemporaryDirectory() as d:
        tok = Model.load(write_tiny_gguf(os.path.join(d, "t.gguf"), tied=False), n_ctx=64, n_threads=1).tokenizer
    spec = ToolSpec([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, tokenizer=tok, fmt="hermes")
    m = spec.constraint().matcher()
    ok = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P", "extra": 1}}\n</tool_call>'
    assert m.validate_tokens(tok.tokenize(ok, add_bos=False)) == len(tok.tokenize(ok, add_bos=False))
    m = spec.constraint().matcher()
    ids = tok.tokenize(bad, add_bos=False)
    assert m.validate_tokens(ids) < len(ids)
    del llg



@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    pytest.importorskip("llguidance")
    from _tiny_gguf import write_tiny_gguf  # a tokenizer with every byte
    from cpufuse.llama import Model
    p = write_tiny_gguf(tmp_path_factory.mktemp("tok") / "t.gguf", tied=False)
    return Model.load(p, n_ctx=64, n_threads=1).tokenizer


def _takes(constraint, tok, text):
    """whether the grammar takes the whole text and may end there"""
    m = constraint.matcher()
    ids = tok.tokenize(text, add_bos=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


PARIS_TOKYO = ('{"name": "get_weather", "arguments": {"city": "Paris"}}',
               '{"name": "get_weather", "arguments": {"city": "Tokyo"}}')
# hermes under "auto": the JSON forms the lazy grammar triggers on (beside <tool_call>), valid calls
JSON_CALLS = [
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',                        # bare
    '\n{"name": "add", "arguments": {"a": 1, "b": 2}}',
    '{{"name": "get_weather", "arguments": {"city": "Paris"}}}',                      # doubled braces
    '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',         # fenced
    'Sure:\n```json\n{\n  "name": "add",\n  "arguments": {"a": 1, "b": 2}\n}\n```',
    '```\n{{"name": "add", "arguments": {"a": 1, "b": 2}}}\n```',
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
]
# once triggered, the arguments are enforced: an array for a string, an invented key, a string for
# an integer, a missing required key, a stray brace, text after the call
JSON_BAD = [
    '{"name": "get_weather", "arguments": {"city": ["Paris", "Tokyo"]}}',
    '{{"name": "get_weather", "arguments": {"city": ["Paris", "Tokyo"]}}}',
    '```json\n{"name": "get_weather", "arguments": {"city": "Paris", "country": "FR"}}\n```',
    'Sure:\n```json\n{"name": "add", "arguments": {"a": 1, "b": "2"}}\n```',
    '{"name": "add", "arguments": {"a": 1}}',
    '{{"name": "get_weather", "arguments": {"city": "Cairo"}}}}',
    '{"name": "get_weather", "arguments": {"city": "Paris"}} Done.',
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
]
# not a call's opening (or not a listed function, or not at the start for the bare form): free text
JSON_FREE = ["Hello world", 'A file: {"name": "x.txt", "size": 3}', '{"name": "rm", "arguments": {"x": [1]}}',
             '```json\n{"name": "x.txt"}\n```',
             '{"arguments": {"city": ["a"]}, "name": "get_weather"}', "```python\nprint(1)\n```"]


def test_auto_grammar_triggers_on_the_json_forms_qwen_writes(tiny_tok):
    for parallel in (False, True):
        spec = ToolSpec(TOOLS, "auto", parallel_tool_calls=parallel, tokenizer=tiny_tok, fmt="hermes")
        c = spec.constraint()
        for text in JSON_CALLS:
            assert _takes(c, tiny_tok, text), (parallel, text)
            assert len(spec.parse(text)[1]) == 1, text
        for text in JSON_BAD:
            assert not _takes(c, tiny_tok, text), (parallel, text)
        for text in JSON_FREE:
            assert _takes(c, tiny_tok, text), (parallel, text)
            assert spec.parse(text)[1] is None, text
        # a bare object after text is read as a call but not constrained (only the start triggers)
        late = 'Here: {"name": "get_weather", "arguments": {"city": ["a"]}}'
        assert _takes(c, tiny_tok, late) and _calls(spec.parse(late)[1]) == [("get_weather", {"city": ["a"]})]
        # parallel_tool_calls: a second call in the same form only when allowed
        for two in ("\n".join(PARIS_TOKYO), "\n".join(f"```json\n{t}\n```" for t in PARIS_TOKYO)):
            assert _takes(c, tiny_tok, two) is parallel, (parallel, two)
            if parallel:
                assert _calls(spec.parse(two)[1]) == [PARIS, ("get_weather", {"city": "Tokyo"})]
    # the other formats keep their own openings: a bare object is free text for phi4
    phi4 = ToolSpec(TOOLS, "auto", tokenizer=tiny_tok, fmt="phi4").constraint()
    assert _takes(phi4, tiny_tok, JSON_BAD[0])

HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "abcdefghi", "name": "get_weather", "content": "sunny"},
    {"role": "user", "content": "And add 1 and 2."},
]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_real_templates_render_tools_and_history(name):
    tpl, fmt = TEMPLATES[name]
    assert detect_format(tpl) == fmt
    spec = ToolSpec(TOOLS, "auto", template=tpl)
    assert spec.format == fmt
    msgs = HISTORY if name != "gemma3" else HISTORY[:1]          # Gemma's template allows no tool turns
    m, extra = spec.messages(msgs)
    out = render_chat(tpl, m, add_generation_prompt=True, bos_token="<s>", eos_token="</s>", **extra)
    assert "get_weather" in out and "add" in out                 # the tools reach the prompt
    if name != "gemma3":
        assert "sunny" in out and "Paris" in out                 # the history's call and result
    # the format's own call text, as the model would write it, parses back
    call = spec.call_text("add", {"a": 1, "b": 2})
    assert _calls(spec.parse(call)[1]) == [SUM]


def test_parse_calls_rejects_an_unknown_format():
    with pytest.raises(ValueError, match="tool format"):
        parse_calls("nope", "")


# ------------------------------------------------------------------ through Llama, a fixed reply

@pytest.fixture(scope="module")
def qwen_llm(tmp_path_factory):
    pytest.importorskip("llguidance")
    from _tiny_gguf import write_tiny_gguf
    from cpufuse.llama import Llama
    p = write_tiny_gguf(tmp_path_factory.mktemp("qwen") / "tiny.gguf", tied=False, n_ctx_train=4096,
                        chat_template=TEMPLATES["qwen2.5"][0])
    return Llama(model_path=p, n_ctx=4096, n_threads=1, verbose=False)


def _forcing(llm, text):
    """a logits processor that makes the model write `text`, then end"""
    import numpy as np
    ids = llm.model.tokenize(text, add_bos=False, special=True)
    eos = llm.token_eos()
    step = [0]

    def force(_, scores):
        k = step[0]
        step[0] += 1
        want = ids[k] if k < len(ids) else eos
        assert np.isfinite(scores[want]), f"the grammar refused token {k} of the fixed reply"
        scores[:] = -np.inf
        scores[want] = 0.0
        return scores
    return force


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reply", [REPLIES["hermes"][2], REPLIES["hermes"][1], REPLIES["hermes"][14]],
                         ids=["fenced", "tool_call", "bare"])
def test_llama_reads_the_call_a_qwen_model_writes(qwen_llm, reply, stream):
    """Qwen2.5's template, tool_choice auto: the fixed reply goes through the lazy grammar, the
    parser and (streamed) the content hold-back, and comes out in OpenAI's shape"""
    text, content, calls = reply
    kw = dict(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, temperature=0,
              max_tokens=200, logits_processor=_forcing(qwen_llm, text))
    if not stream:
        out = qwen_llm.create_chat_completion(**kw)
        ch = out["choices"][0]
        assert ch["finish_reason"] == "tool_calls"
        assert ch["message"]["content"] == content and _calls(ch["message"]["tool_calls"]) == calls
        return
    chunks = list(qwen_llm.create_chat_completion(stream=True, **kw))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    sent = "".join(d.get("content") or "" for d in deltas)
    assert sent.strip() == (content or "")
    heads = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    args = [d["tool_calls"][0]["function"]["arguments"] for d in deltas
            if "tool_calls" in d and "id" not in d["tool_calls"][0]]
    assert [(h["function"]["name"], json.loads(a)) for h, a in zip(heads, args)] == calls
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
