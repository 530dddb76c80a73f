"""Structured output and tool calls (cpufuse.llama.constrain, cpufuse.llama.tools): the matcher and
the guided sampler, Model.generate's constraint arguments, every tool format's grammar and parser,
batch invariance with constraints in BatchEngine. A tiny random model emits noise, so the
constraint is all that makes its output valid. The live server's side is tests/test_serve_structured.py."""
import json
import random

import numpy as np
import pytest

pytest.importorskip("llguidance", reason="structured output needs llguidance (pip install cpufuse[llama])")
jsonschema = pytest.importorskip("jsonschema")

from _tiny_gguf import write_tiny_gguf  # noqa: E402

from cpufuse.llama import Model  # noqa: E402
from cpufuse.llama.constrain import Constraint, GuidedSampler, grammar_from_options, parse_logit_bias  # noqa: E402
from cpufuse.llama.sampling import Sampler  # noqa: E402
from cpufuse.llama.tools import ToolSpec, ToolStream, detect_format  # noqa: E402


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("structured") / "tiny.gguf", tied=False, n_ctx_train=1024)


@pytest.fixture(scope="module")
def model(gguf):
    return Model.load(gguf, n_ctx=1024, n_threads=1)


@pytest.fixture(scope="module")
def tok(model):
    return model.tokenizer


def _schema(rng: random.Random, depth=0) -> dict:
    """a random JSON schema whose every value is bounded (a random model ends it in few tokens)"""
    kinds = ["integer", "enum", "string", "boolean", "number", "const", "null"]
    if depth < 2:
        kinds += ["object", "array", "object"]
    k = rng.choice(kinds)
    if k == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if k == "number":
        return {"type": "number", "minimum": 0, "maximum": 8, "multipleOf": 0.5}
    if k == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True, "a b"], rng.randint(1, 4))}
    if k == "string":
        return {"type": "string", "maxLength": rng.randint(0, 5)}
    if k == "boolean":
        return {"type": "boolean"}
    if k == "const":
        return {"const": rng.choice(["x", 3, False])}
    if k == "null":
        return {"type": "null"}
    if k == "array":
        return {"type": "array", "items": _schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    props = {f"k{i}": _schema(rng, depth + 1) for i in range(rng.randint(1, 3))}
    req = [p for p in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": req, "additionalProperties": False}


def schemas(n, seed=0):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        s = _schema(rng)
        if s.get("type") == "object":
            out.append(s)
    return out


def _noise_run(tok, c, seed, n=300, temp=1.0):
    """a GuidedSampler over random logits: (text, stop reason)"""
    rng = np.random.default_rng(seed)
    g = GuidedSampler(Sampler(temperature=temp, top_k=0, top_p=1.0, min_p=0.0, seed=seed), c)
    out = []
    for _ in range(n):
        t = g.sample(rng.standard_normal(tok.n_vocab).astype(np.float32) * 4)
        if t in tok.eog_ids:
            return tok.detokenize(out, special=True), "stop"
        out.append(t)
        if g.done:
            return tok.detokenize(out, special=True), "stop"
    return tok.detokenize(out, special=True), "length"


# ------------------------------------------------------------------ the matcher

def test_llg_tokenizer_is_built_once_per_model(tok):
    from cpufuse.llama.constrain import llg_tokenizer
    a = llg_tokenizer(tok)
    assert llg_tokenizer(tok) is a
    assert a.vocab_size == tok.n_vocab
    assert sorted(a.eos_tokens) == sorted(tok.eog_ids)


@pytest.mark.parametrize("opts, param, text", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "no-such-format"}}}), "response_format", "Unknown format"),
    (dict(response_format={"type": "json_schema"}), "response_format", "json_schema"),
    (dict(response_format={"type": "xml"}), "response_format", "'xml'"),
    (dict(grammar='root ::= ("a"'), "grammar", "GBNF"),
    (dict(grammar='root ::= missing'), "grammar", "missing"),
    (dict(regex="[a-"), "regex", "regex"),
    (dict(lark="start: nothing_here"), "lark", "nothing_here"),
    (dict(grammar='root ::= "a"', json_schema={"type": "object"}), None, "only one constraint"),
    (dict(json_schema=[1, 2]), "json_schema", "JSON schema"),
])
def test_rejected_grammars_raise_valueerror_with_the_message(tok, opts, param, text):
    with pytest.raises(ValueError) as e:
        Constraint.from_options(tok, **opts)
    assert text in str(e.value)
    if param:
        assert str(e.value).startswith(param)


def test_grammars_are_compiled_once_and_matchers_are_independent_copies(tok, monkeypatch):
    import cpufuse.llama.constrain as C
    monkeypatch.setattr(C, "_COMPILED_MAX", 2)
    a = Constraint.from_options(tok, regex="[ab]{3}")
    b = Constraint.from_options(tok, regex="[ab]{3}")
    assert a._start is b._start                          # the second request reuses the compiled grammar
    m1, m2 = a.matcher(), b.matcher()
    t = tok.tokenize("a", add_bos=False)[0]
    assert m1.consume_token(t) and m1.consume_token(t) and not m1.is_accepting()
    assert m2.validate_tokens([t, t, t]) == 3 and a.matcher().validate_tokens([t, t, t]) == 3
    with pytest.raises(ValueError):
        Constraint.from_options(tok, regex="[a-")
    assert "[a-" not in str(list(tok._llg_compiled))      # a rejected grammar is not kept
    Constraint.from_options(tok, regex="x")
    Constraint.from_options(tok, regex="y")
    assert len(tok._llg_compiled) == 2 and Constraint.from_options(tok, regex="[ab]{3}")._start is not a._start


def test_text_and_no_options_mean_no_constraint(tok):
    assert grammar_from_options() is None
    assert Constraint.from_options(tok, response_format={"type": "text"}) is None


@pytest.mark.parametrize("schema", schemas(50, seed=1), ids=lambda s: str(len(json.dumps(s))))
def test_generated_schemas_give_valid_json_from_noise(tok, schema):
    c = Constraint.from_options(tok, response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": schema, "strict": True}})
    text, why = _noise_run(tok, c, seed=len(json.dumps(schema)), n=2000)
    assert why == "stop", text
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("opts, check", [
    (dict(response_format={"type": "json_object"}), lambda s: isinstance(json.loads(s), dict)),
    (dict(grammar='root ::= "yes" | "no"'), lambda s: s in ("yes", "no")),
    (dict(grammar='root ::= [0-9]{2} "-" [a-c]+\n'), lambda s: s[:2].isdigit() and s[2] == "-"
     and set(s[3:]) <= set("abc")),
    (dict(regex=r"[0-9]{3}"), lambda s: len(s) == 3 and s.isdigit()),
    (dict(lark='start: "a" B\nB: /[xy]{2}/'), lambda s: s in ("axx", "axy", "ayx", "ayy")),
    (dict(json_schema={"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}),
     lambda s: all(v in (1, 2) for v in json.loads(s))),
])
def test_each_constraint_kind_holds_on_noise(tok, opts, check):
    c = Constraint.from_options(tok, **opts)
    for seed in range(4):
        text, why = _noise_run(tok, c, seed, n=3000)
        assert why == "stop" and check(text), text


def test_mask_leaves_one_token_through_every_filter(tok):
    """one allowed token: top_k > 1, top_p, min_p, min_keep > 1 and temperature keep it alone"""
    c = Constraint.from_options(tok, grammar='root ::= "q"')
    q = tok.tokenize("q", add_bos=False)[0]
    for seed in range(20):
        g = GuidedSampler(Sampler(temperature=1.5, top_k=40, top_p=0.5, min_p=0.2, min_keep=5, seed=seed,
                                  presence_penalty=1.0, frequency_penalty=1.0), c)
        logits = np.random.default_rng(seed).standard_normal(tok.n_vocab).astype(np.float32)
        logits[q] = -50.0                       # the least likely token, and still the only one
        assert g.sample(logits) == q
        assert g.done


def test_eos_only_where_the_grammar_accepts(tok):
    c = Constraint.from_options(tok, regex=r"ab?")
    g = GuidedSampler(Sampler(temperature=0), c)
    eog = sorted(tok.eog_ids)
    x = np.zeros(tok.n_vocab, np.float32)
    x[eog] = 100.0                             # EOS is the argmax: not allowed before "a"
    assert g.sample(x) == tok.tokenize("a", add_bos=False)[0]
    assert g.sample(x) in tok.eog_ids           # after "a" the grammar accepts: EOS wins


def test_mask_row_is_the_bitmask(tok):
    """compute_mask's additive row: 0 exactly at the bits llguidance sets, -inf elsewhere"""
    c = Constraint.from_options(tok, response_format={"type": "json_object"})
    g = GuidedSampler(Sampler(temperature=0.5, seed=0), c)
    rng = np.random.default_rng(0)
    for _ in range(6):
        g.compute_mask()
        bits = np.unpackbits(g._words.view(np.uint8), count=tok.n_vocab, bitorder="little").astype(bool)
        assert 0 < bits.sum() < tok.n_vocab
        assert np.array_equal(g._mask, np.where(bits, np.float32(0), np.float32(-np.inf)))
        assert (g._mask.view(np.uint32)[bits] == 0).all()          # +0.0, not -0.0
        g.sample(rng.standard_normal(tok.n_vocab).astype(np.float32))


@pytest.mark.parametrize("opts", [dict(response_format={"type": "json_object"}), dict(regex=r"ab?"),
                                  dict(regex=r"[0-9]{3}"), dict(json_schema=schemas(3, seed=5)[2])])
@pytest.mark.parametrize("kw", [dict(), dict(repeat_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)])
def test_greedy_masks_only_when_the_top_token_is_refused(tok, opts, kw, monkeypatch):
    """greedy under a grammar: the same tokens as with the mask filled before every token (the
    full-mask path), the mask filled only where the unconstrained top token is not allowed; with a
    logit bias and penalties too"""
    c = Constraint.from_options(tok, **opts)
    filled = []
    orig = GuidedSampler.compute_mask

    def spy(self):
        filled.append(self)
        return orig(self)
    monkeypatch.setattr(GuidedSampler, "compute_mask", spy)
    bias = (np.arange(40, 60, dtype=np.int64), np.full(20, 2.0, np.float32))
    for seed in range(3):
        fast, ref, ahead = (GuidedSampler(Sampler(temperature=0, penalty_scope="generated", **kw), c, bias)
                            for _ in range(3))
        assert fast.mask_ahead                          # the first token: ask for the mask ahead
        rng = np.random.default_rng(seed)
        n = hits = 0
        for i in range(80):
            x = rng.standard_normal(tok.n_vocab).astype(np.float32) * 4
            ref.compute_mask()                          # the mask before every token
            if ahead.mask_ahead:                        # the mask before the tokens it asks for
                ahead.compute_mask()
            allowed = np.flatnonzero(ref._mask == 0)
            if i % 2:                                   # every other top token is allowed
                x[rng.choice(allowed)] = 100.0
            before = len(filled)
            t = fast.sample(x)
            hits += len(filled) == before
            assert len(filled) == before or not i % 2, i    # an allowed top token: no mask
            assert fast.mask_ahead == (len(filled) > before), i   # ahead after a refusal
            assert ref.sample(x) == t and ahead.sample(x) == t
            n += 1
            if t in tok.eog_ids or fast.done:
                break
        assert ref.done == fast.done == ahead.done
        assert 0 < hits < n or n < 2, (n, hits)


def test_other_samplers_get_their_own_rows(tok):
    """a sampler that is not a cpufuse Sampler always gets the full mask and a fresh row (it may keep it)"""
    class Keep:
        def __init__(self):
            self.rows = []

        def sample(self, x):
            self.rows.append(x)
            return int(np.argmax(x))
    c = Constraint.from_options(tok, regex="[ab]{3}")
    k = Keep()
    g = GuidedSampler(k, c)
    assert g.mask_ahead
    rng = np.random.default_rng(0)
    toks = [g.sample(rng.standard_normal(tok.n_vocab).astype(np.float32)) for _ in range(3)]
    assert set(tok.detokenize(toks)) <= set("ab") and g.done
    assert len({id(r) for r in k.rows}) == 3 and all(np.isinf(r).sum() > tok.n_vocab // 2 for r in k.rows)


def test_logit_bias(tok):
    ids, vals = parse_logit_bias({"65": 100, "66": -100.0}, tok.n_vocab)
    assert ids.tolist() == [65, 66] and vals.tolist() == [100.0, -100.0]
    g = GuidedSampler(Sampler(temperature=0), None, (ids, vals))
    x = np.zeros(tok.n_vocab, np.float32)
    x[66] = 50.0
    assert g.sample(x) == 65
    assert parse_logit_bias([[3, 1.5]], tok.n_vocab)[0].tolist() == [3]
    assert parse_logit_bias([[3.0, 1.5]], tok.n_vocab)[0].tolist() == [3]      # as pydantic hands a list form over
    assert parse_logit_bias({}, tok.n_vocab) == ()
    for bad, msg in [({"x": 1}, "token ids"), ([[1.5, 1]], "token ids"), ({"99999": 1}, "outside"), ({"1": 101}, "[-100, 100]"),
                     ({"1": "a"}, "[-100, 100]"), (5, "object")]:
        with pytest.raises(ValueError, match="logit_bias") as e:
            parse_logit_bias(bad, tok.n_vocab)
        assert msg in str(e.value)


# ------------------------------------------------------------------ Model.generate

def test_model_generate_takes_the_constraints(model):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    r = model.generate("hi", max_tokens=200, temperature=0,
                       response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    jsonschema.validate(json.loads(r.text), schema)
    assert r.stop_reason == "eog"
    s = model.generate("hi", max_tokens=20, temperature=0.8, seed=3, grammar='root ::= "yes" | "no"', stream=True)
    assert "".join(s) in ("yes", "no")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x"], "additionalProperties": False}}}]
    r = model.generate([{"role": "user", "content": "add"}], max_tokens=800, temperature=0, tools=tools,
                       tool_choice="required", parallel_tool_calls=False)
    assert r.tool_calls, (r.stop_reason, len(r.tokens), model.tokenizer.detokenize(r.tokens, special=True))
    (call,) = r.tool_calls
    assert call["function"]["name"] == "add" and 0 <= json.loads(call["function"]["arguments"])["x"] <= 9
    with pytest.raises(ValueError, match="tool_choice"):
        model.generate("hi", max_tokens=2, tool_choice="auto")
    with pytest.raises(ValueError, match="grammar"):
        model.generate("hi", max_tokens=2, grammar="root ::= (")


# ------------------------------------------------------------------ tool formats

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def test_format_detection():
    assert detect_format("{{ '<tool_call>' }}") == "hermes"
    assert detect_format("[TOOL_CALLS]") == "mistral"
    assert detect_format("<|python_tag|>") == "llama3"
    assert detect_format("<|start_of_role|><|tool_call|>") == "granite"
    assert detect_format("<|tool_call|>{{ x }}<|/tool_call|>") == "phi4"
    assert detect_format("<|start|>assistant<|channel|>final") == "gpt-oss"
    assert detect_format(None) == detect_format("{{ messages }}") == "generic"


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "granite", "phi4", "gpt-oss", "generic"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("parallel", [False, True])
def test_forced_tool_calls_parse_and_validate(tok, fmt, choice, parallel):
    spec = ToolSpec(TOOLS, choice, parallel, tokenizer=tok, fmt=fmt)
    c = spec.constraint()
    for seed in range(3):
        text, why = _noise_run(tok, c, seed, n=3000)
        assert why == "stop", text
        content, calls = spec.parse(text)
        assert calls, text
        assert content is None
        if not parallel:
            assert len(calls) == 1
        for call in calls:
            name = call["function"]["name"]
            assert call["id"].startswith("call_") and call["type"] == "function"
            if isinstance(choice, dict):
                assert name == "add"
            jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[name])


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "granite", "phi4"])
def test_auto_is_free_text_until_the_opening_then_constrained(tok, fmt):
    spec = ToolSpec(TOOLS, "auto", False, tokenizer=tok, fmt=fmt)
    c = spec.constraint()
    opening = {"hermes": "<tool_call>", "llama3": '{"name": "', "mistral": "[TOOL_CALLS]", "granite": "<|tool_call|>",
               "phi4": "<|tool_call|>"}[fmt]
    g = GuidedSampler(Sampler(temperature=0), c)
    forced = tok.tokenize("Sure. " + opening, add_bos=False)
    rng = np.random.default_rng(0)
    for t in forced:                           # free text, then the opening: allowed
        x = rng.standard_normal(tok.n_vocab).astype(np.float32)
        x[t] = 1000.0
        assert g.sample(x) == t
    out = list(forced)
    for _ in range(3000):                      # from here on the grammar writes a valid call
        t = g.sample(rng.standard_normal(tok.n_vocab).astype(np.float32) * 4)
        if t in tok.eog_ids or g.done:
            if t not in tok.eog_ids:
                out.append(t)
            break
        out.append(t)
    content, calls = spec.parse(tok.detokenize(out, special=True))
    assert content == "Sure." and len(calls) == 1
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), PARAMS[calls[0]["function"]["name"]])
    # plain text is a plain answer
    assert spec.parse("no call here") == ("no call here", None)


def test_generic_auto_response_and_parse_errors(tok):
    spec = ToolSpec(TOOLS, "auto", True, tokenizer=tok, fmt="generic")
    assert spec.parse('{"response": "hello"}') == ("hello", None)
    content, calls = spec.parse('{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert spec.parse('{"tool_calls": [{"name": "nope", "arguments": {}}]}')[1] is None     # unknown tool
    assert spec.parse('{"tool_call": {"name": "add", "argu')[1] is None                     # cut short


def test_tool_spec_rejects_bad_tools():
    for tools, msg in [([], "non-empty"), ([{"type": "function"}], "name"),
                       ([{"type": "retrieval"}], "tools[0]"), (TOOLS + TOOLS[:1], "twice"),
                       ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "parameters")]:
        with pytest.raises(ValueError, match="tools") as e:
            ToolSpec(tools)
        assert msg in str(e.value)
    with pytest.raises(ValueError, match="not in tools"):
        ToolSpec(TOOLS, {"type": "function", "function": {"name": "zzz"}})
    with pytest.raises(ValueError, match="tool_choice"):
        ToolSpec(TOOLS, "sometimes")


def test_tool_stream_holds_back_a_possible_opening(tok):
    spec = ToolSpec(TOOLS, "auto", False, tokenizer=tok, fmt="hermes")
    st = ToolStream(spec)
    assert st.push("Hello <tool") == "Hello "          # "<tool" could open a call: held
    assert st.push("box> there ") == "<toolbox> there "
    assert st.push("<tool_call>\n{\"name\": \"add\", ") == ""
    assert st.push("\"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>") == ""
    content, calls = st.finish()
    assert content is None and calls[0]["function"]["name"] == "add"
    st = ToolStream(spec)
    assert st.push("plain <tool_c") == "plain "
    assert st.finish() == ("<tool_c", None)
    st = ToolStream(ToolSpec(TOOLS, "auto", tokenizer=tok, fmt="generic"))      # generic: all at the end
    assert st.push('{"response": "hel') == "" and st.push('lo"}') == ""
    assert st.finish() == ("hello", None)


def test_history_with_tool_calls_for_a_template_without_them(tok):
    spec = ToolSpec(TOOLS, "auto", template=None, tokenizer=tok)
    msgs, extra = spec.messages([
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}])
    assert extra == {}
    assert msgs[0]["role"] == "system" and "add" in msgs[0]["content"]           # the tools described
    assert json.loads(msgs[2]["content"]) == {"tool_call": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    assert msgs[3] == {"role": "tool", "tool_call_id": "call_1", "content": "3"}
    tpl = "{% for m in messages %}{{ m.tool_calls }}{% endfor %}{{ tools }}<tool_call>"
    spec = ToolSpec(TOOLS, "auto", template=tpl, tokenizer=tok)
    msgs, extra = spec.messages([{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}])
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}          # parsed for the template


# ------------------------------------------------------------------ engines

def test_batch_engine_constrained_tokens_do_not_depend_on_the_batch(gguf):
    """8 constrained requests (greedy and seeded) alone, then all at once: the same tokens, the
    same as Model.generate with the same guided sampler, and each valid"""
    from cpufuse.serve.batch import BatchEngine
    from cpufuse.serve.engine import EngineRequest, FinishEvent, SamplingParams, make_sampler
    m = Model.load(gguf, n_ctx=256, n_seq=4, n_threads=1)
    tok = m.tokenizer
    scs = schemas(8, seed=7)
    reqs = []
    for i, sc in enumerate(scs):
        c = Constraint.from_options(tok, json_schema=sc)
        sp = SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=1.0, seed=i)
        prompt = tok.tokenize(f"request {i}: " + "x" * (3 * i), add_bos=False)
        reqs.append(EngineRequest(prompt, 120, sp, stop_ids=tok.eog_ids, constraint=c))

    def copy(r):
        return EngineRequest(list(r.prompt_ids), r.max_tokens, r.sampling, stop_ids=r.stop_ids,
                             constraint=r.constraint)

    from test_serve_batch import _collect as collect
    eng = BatchEngine(m, chunk=8)
    eng.start()
    try:
        alone = [collect(eng.submit(copy(r))) for r in reqs]
        hs = [eng.submit(copy(r)) for r in reqs]
        together = [collect(h) for h in hs]
    finally:
        eng.stop()
    eng = BatchEngine(m, chunk=8, mask_thread=False)     # masks filled serially: the same tokens
    eng.start()
    try:
        hs = [eng.submit(copy(r)) for r in reqs]
        serial = [collect(h) for h in hs]
    finally:
        eng.stop()
    assert [t for t, _ in serial] == [t for t, _ in together]
    ref_m = Model.load(gguf, n_ctx=256, n_batch=8, n_threads=1)
    for i, r in enumerate(reqs):
        assert alone[i][0] == together[i][0], i
        assert alone[i][1].finish_reason == "stop", (i, alone[i][1])
        jsonschema.validate(json.loads(tok.detokenize(alone[i][0])), scs[i])
        ref = ref_m.generate(list(r.prompt_ids), max_tokens=r.max_tokens, reuse_cache=False,
                             sampler=make_sampler(r.sampling, r.constraint))
        assert ref.tokens == alone[i][0], i
    assert isinstance(alone[0][1], FinishEvent)


def test_serial_engine_constraint_and_bias(gguf):
    from cpufuse.serve.batch import SerialEngine
    from cpufuse.serve.engine import EngineRequest, SamplingParams, TokenEvent
    m = Model.load(gguf, n_ctx=256, n_threads=1)
    tok = m.tokenizer
    eng = SerialEngine(m)
    eng.start()
    try:
        c = Constraint.from_options(tok, regex="[ab]{4}")
        h = eng.submit(EngineRequest(tok.tokenize("hi", add_bos=False), 50, SamplingParams(temperature=0),
                                     stop_ids=tok.eog_ids, constraint=c))
        evs = list(h)
        toks = [e.token for e in evs if isinstance(e, TokenEvent)]
        assert len(tok.detokenize(toks)) == 4 and set(tok.detokenize(toks)) <= set("ab")
        assert evs[-1].finish_reason == "stop"
        b = tok.tokenize("b", add_bos=False)[0]
        h = eng.submit(EngineRequest(tok.tokenize("hi", add_bos=False), 6, SamplingParams(
            temperature=0, logit_bias=((b, 100.0),)), stop_ids=tok.eog_ids))
        assert [e.token for e in h if isinstance(e, TokenEvent)] == [b] * 6
    finally:
        eng.stop()


def test_batch_engine_fills_masks_in_its_worker_thread(gguf, monkeypatch):
    """every mask of a sampled (temperature > 0) constrained sequence is filled by the mask worker
    during the decoder step, never late in sample(); greedy sequences need none there"""
    import threading

    from cpufuse.serve.batch import BatchEngine
    from cpufuse.serve.engine import EngineRequest, SamplingParams
    where = []
    orig = GuidedSampler.compute_mask

    def spy(self):
        where.append(threading.current_thread().name)
        return orig(self)
    monkeypatch.setattr(GuidedSampler, "compute_mask", spy)
    m = Model.load(gguf, n_ctx=128, n_seq=2, n_threads=1)
    tok = m.tokenizer
    eng = BatchEngine(m, chunk=8)
    eng.start()
    try:
        c = Constraint.from_options(tok, regex="[a-z]{6}")
        hs = [eng.submit(EngineRequest(tok.tokenize(p, add_bos=False), 20, SamplingParams(temperature=0.7, seed=i),
                                       stop_ids=tok.eog_ids, constraint=c)) for i, p in enumerate(("one", "two two"))]
        outs = [list(h) for h in hs]
        n_sampled = len(where)
        h = eng.submit(EngineRequest(tok.tokenize("three", add_bos=False), 20, SamplingParams(temperature=0),
                                     stop_ids=tok.eog_ids, constraint=c))
        greedy = list(h)
    finally:
        eng.stop()
    n_tok = 0
    for o in outs:
        assert o[-1].finish_reason == "stop"
        text = tok.detokenize([e.token for e in o[:-1]])
        assert len(text) == 6 and text.isalpha(), text
        n_tok += len(o) - 1
    assert n_sampled == n_tok and all(w.startswith("cpufuse-masks") for w in where[:n_sampled]), where
    text = tok.detokenize([e.token for e in greedy[:-1]])
    assert len(text) == 6 and text.isalpha() and greedy[-1].finish_reason == "stop", text
    # greedy: the first mask ahead in the worker, then only where the top token was refused
    assert 1 <= len(where) - n_sampled <= len(greedy) - 1 and where[n_sampled].startswith("cpufuse-masks"), where


def test_without_llguidance_only_constraints_need_it(tok, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "llguidance", None)        # import llguidance -> ImportError
    assert grammar_from_options(response_format={"type": "text"}) is None
    assert parse_logit_bias({"1": 2}, tok.n_vocab)[0].tolist() == [1]
    with pytest.raises(ImportError, match="pip install"):
        Constraint.from_options(tok, response_format={"type": "json_object"})
