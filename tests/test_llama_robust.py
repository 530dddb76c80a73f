"""cpufuse.llama under bad files and misuse: hyperparameters and tensor shapes checked at load
(mutations of a tiny model, rewritten by hand with tests/_gguf_bytes.py), one Model from several
threads, paused and abandoned streams, prompt and chat-template limits, argument ranges, the CLI.
Every bad case raises the documented exception, naming the key or argument, within a second."""
import gc
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from _gguf_bytes import (ARRAY, FLOAT32, INT32, STRING, UINT32, UINT64, KV, Layout, T, del_kv, from_file,  # noqa: E402
                         gguf_bytes, set_kv)
from _tiny_gguf import write_tiny_gguf  # noqa: E402

import cpufuse  # noqa: E402
from cpufuse.llama.chat import TemplateLimitError, render_chat  # noqa: E402
from cpufuse.llama.model import Model  # noqa: E402
from cpufuse.llama.sampling import Sampler  # noqa: E402
from cpufuse.llama.tokenizer import Tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVIL_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def tdir(tmp_path_factory):
    return tmp_path_factory.mktemp("robust")


@pytest.fixture(scope="module")
def tiny(tdir):
    return write_tiny_gguf(tdir / "tiny.gguf", qtype="Q4_0")


@pytest.fixture(scope="module")
def model(tiny):
    return Model.load(tiny, n_ctx=64)


def mutated(src, dst, kv_set=(), kv_del=(), tensors=None, layout=None, alignment_key=None):
    """src rewritten with keys set ((key, type, value) triples) or deleted, tensors edited by
    `tensors(list) -> list`; the file's path"""
    kv, ts, align = from_file(src)
    for k, t, v in kv_set:
        kv = set_kv(kv, k, t, v)
    for k in kv_del:
        kv = del_kv(kv, k)
    if tensors is not None:
        ts = tensors(ts)
    if alignment_key is not None:
        kv = set_kv(kv, "general.alignment", UINT32, alignment_key)
    dst.write_bytes(gguf_bytes(kv, ts, layout or Layout(alignment=align)))
    return str(dst)


def refused(path, *frags, exc=ValueError, **kw):
    t = time.perf_counter()
    with pytest.raises(exc) as ei:
        Model.load(path, **kw)
    assert time.perf_counter() - t < 1.0
    msg = str(ei.value)
    for f in frags:
        assert f in msg, (f, msg)
    return msg


# ------------------------------------------------------------------------------------------------
# hyperparameters

P = "llama."
HP_CASES = [
    (P + "attention.head_count", UINT32, 0, ["attention.head_count = 0", "[1,"]),
    (P + "attention.head_count", INT32, -1, ["attention.head_count = -1"]),
    (P + "attention.head_count", FLOAT32, 4.0, ["attention.head_count", "expected an integer", "float32"]),
    (P + "attention.head_count", ARRAY, (UINT32, [4, 2]), ["per-layer values [2, 4]"]),
    (P + "attention.head_count", ARRAY, (UINT32, [4, 4, 4]), ["one value per layer", "block_count = 2", "3 values"]),
    (P + "attention.head_count_kv", UINT32, 3, ["head_count_kv = 3", "must divide", "head_count = 4"]),
    (P + "attention.head_count_kv", UINT32, 8, ["head_count_kv = 8", "must divide"]),
    (P + "embedding_length", UINT32, 66, ["embedding_length = 66", "multiple of attention.head_count = 4"]),
    (P + "embedding_length", UINT32, 0, ["embedding_length = 0"]),
    (P + "attention.value_length", UINT32, 8, ["value_length = 8", "key length 16"]),
    (P + "rope.dimension_count", UINT32, 15, ["rope.dimension_count = 15", "even"]),
    (P + "rope.dimension_count", UINT32, 32, ["rope.dimension_count = 32", "<= the head dim 16"]),
    (P + "rope.dimension_count", UINT32, 8, ["rope.dimension_count = 8", "equal the head dim 16"]),
    (P + "rope.dimension_count", UINT32, 0, ["rope.dimension_count = 0", "[2,"]),
    (P + "attention.layer_norm_rms_epsilon", FLOAT32, float("inf"), ["epsilon = inf", "finite and > 0"]),
    (P + "attention.layer_norm_rms_epsilon", FLOAT32, float("nan"), ["epsilon = nan", "finite"]),
    (P + "attention.layer_norm_rms_epsilon", FLOAT32, 0.0, ["epsilon = 0.0", "> 0"]),
    (P + "attention.layer_norm_rms_epsilon", FLOAT32, -1e-5, ["epsilon = -1e-05", "> 0"]),
    (P + "attention.layer_norm_rms_epsilon", FLOAT32, 2.0, ["epsilon = 2.0", "<= 1.0"]),
    (P + "attention.layer_norm_rms_epsilon", STRING, "1e-5", ["epsilon = '1e-5'", "expected a number", "string"]),
    (P + "rope.freq_base", FLOAT32, 0.0, ["rope.freq_base = 0.0", "> 0"]),
    (P + "rope.freq_base", FLOAT32, float("inf"), ["rope.freq_base = inf", "finite"]),
    (P + "rope.scaling.factor", FLOAT32, -2.0, ["rope.scaling.factor = -2.0", "finite and > 0"]),
    (P + "rope.scaling.factor", FLOAT32, float("nan"), ["rope.scaling.factor = nan"]),
    (P + "rope.scaling.attn_factor", FLOAT32, 0.0, ["rope.scaling.attn_factor = 0.0", "> 0"]),
    (P + "rope.scaling.type", STRING, "ntk", ["rope.scaling.type = 'ntk'", "none, linear, yarn"]),
    (P + "rope.scaling.original_context_length", UINT32, 0, ["original_context_length = 0"]),
    (P + "context_length", UINT32, 0, ["context_length = 0", "[1, 16777216]"]),
    (P + "context_length", UINT64, 2 ** 40, [f"context_length = {2 ** 40}", "16777216"]),
    (P + "block_count", UINT32, 0, ["block_count = 0"]),
    (P + "block_count", UINT32, 5000, ["block_count = 5000", "4096"]),
    (P + "block_count", UINT32, 3, ["missing the tensor blk.2."]),
    ("general.architecture", UINT32, 7, ["general.architecture = 7", "expected a string", "uint32"]),
    ("general.architecture", STRING, "mamba", ["'mamba'", "not supported"]),
    ("tokenizer.ggml.bos_token_id", INT32, -1, ["tokenizer.ggml.bos_token_id = -1", "[0, n_vocab) = [0, 290)"]),
    ("tokenizer.ggml.eos_token_id", UINT32, 290, ["tokenizer.ggml.eos_token_id = 290", "[0, 290)"]),
    ("tokenizer.ggml.padding_token_id", STRING, "x", ["padding_token_id = 'x'", "integer", "string"]),
    ("tokenizer.ggml.tokens", ARRAY, (INT32, list(range(290))), ["tokenizer.ggml.tokens", "array of strings",
                                                                  "array[int32]"]),
    ("tokenizer.ggml.token_type", ARRAY, (INT32, [1] * 100), ["token_type", "100 entries", "(290)"]),
]


@pytest.mark.parametrize("key,t,v,frags", HP_CASES, ids=[f"{c[0].split('.', 1)[1]}={c[2]!r}"[:60] for c in HP_CASES])
def test_bad_hyperparameters_refused(tiny, tdir, key, t, v, frags):
    p = mutated(tiny, tdir / "hp.gguf", kv_set=[(key, t, v)])
    refused(p, *frags)


def test_missing_keys(tiny, tdir):
    refused(mutated(tiny, tdir / "m1.gguf", kv_del=["general.architecture"]), "general.architecture")
    refused(mutated(tiny, tdir / "m2.gguf", kv_del=[P + "attention.layer_norm_rms_epsilon"]),
            "missing the required key llama.attention.layer_norm_rms_epsilon")
    refused(mutated(tiny, tdir / "m3.gguf", kv_del=[P + "embedding_length"]), "llama.embedding_length")


def test_vocab_against_token_embd(tiny, tdir):
    kv, _, _ = from_file(tiny)
    toks = next(e.value[1] for e in kv if e.key == "tokenizer.ggml.tokens")
    types = next(e.value[1] for e in kv if e.key == "tokenizer.ggml.token_type")
    p = mutated(tiny, tdir / "v.gguf", kv_set=[("tokenizer.ggml.tokens", ARRAY, (STRING, list(toks) + ["extra"])),
                                              ("tokenizer.ggml.token_type", ARRAY, (INT32, list(types) + [1]))])
    refused(p, "token_embd.weight", "ne = [64, 290]", "expected [64, 291]")


def _replace(name, new):
    def f(ts):
        return [new if t.name == name else t for t in ts]
    return f


def test_tensor_shapes_and_types(tiny, tdir):
    q4 = np.random.default_rng(0).integers(0, 256, (32, 2 * 18), np.uint8).tobytes()
    refused(mutated(tiny, tdir / "t1.gguf", tensors=_replace("blk.0.attn_q.weight", T("blk.0.attn_q.weight", (64, 32), 2, q4))),
            "blk.0.attn_q.weight", "ne = [64, 32]", "expected [64, 64]")
    refused(mutated(tiny, tdir / "t2.gguf", tensors=_replace("output_norm.weight", T("output_norm.weight", (63,), 0, bytes(252)))),
            "output_norm.weight", "ne = [63]", "expected [64]")
    refused(mutated(tiny, tdir / "t3.gguf", tensors=lambda ts: [t for t in ts if t.name != "blk.1.ffn_down.weight"]),
            "missing the tensor blk.1.ffn_down.weight")
    # a weight of a type the reader sizes but cpufuse does not compute: NotImplementedError naming it
    refused(mutated(tiny, tdir / "t4.gguf", tensors=_replace("blk.0.attn_q.weight", T("blk.0.attn_q.weight", (64, 64), 26, bytes(64 * 64 * 4)))),
            "blk.0.attn_q.weight", "I32", exc=NotImplementedError)
    # the same type on a tensor the model does not use: loads
    m = Model.load(mutated(tiny, tdir / "t5.gguf", tensors=lambda ts: ts + [T("unused.q2k", (256, 2), 10, bytes(168))]),
                   n_ctx=16)
    assert m.hparams.n_layer == 2


def test_misaligned_tensors_load_and_match(tiny, tdir, model):
    """general.alignment = 1: tensors at odd addresses; the float ones are copied aligned, the
    logits equal the aligned file's bit for bit"""
    from cpufuse.llama.gguf_file import GGUFFile
    p = mutated(tiny, tdir / "a1.gguf", layout=Layout(alignment=1), alignment_key=1)
    f = GGUFFile(p)
    assert f.tensors["token_embd.weight"].file_offset % 2 and sum(t.file_offset % 4 != 0 for t in f.tensors.values()) > 5
    m = Model.load(p, n_ctx=64)
    for w in [m.tok_embd] + [L.wq for L in m.layers]:      # F16 and Q4_0 weights: at even addresses
        assert w.raw.ctypes.data % 2 == 0, w
    ids = model.tokenize("hello world")
    np.testing.assert_array_equal(m.logits(ids), model.logits(ids))


def test_bad_load_arguments(tiny):
    for kw, frag, exc in [(dict(n_ctx=-1), "n_ctx", ValueError), (dict(n_ctx=2 ** 30), "n_ctx", ValueError),
                          (dict(n_ctx="64"), "n_ctx", TypeError), (dict(n_threads=0), "n_threads", ValueError),
                          (dict(n_threads=5000), "n_threads", ValueError), (dict(n_batch=0), "n_batch", ValueError),
                          (dict(isa="sse9"), "isa", ValueError), (dict(kv_dtype="q8"), "kv_dtype", ValueError)]:
        refused(tiny, frag, exc=exc, **kw)


def test_tokenizer_special_ids_checked():
    meta = {"model": "gpt2", "pre": "gpt-2", "tokens": ["a", "b", "ab"], "merges": ["a b"]}
    with pytest.raises(ValueError, match=r"bos_token_id = -1: .*\[0, 3\)"):
        Tokenizer(dict(meta, bos_token_id=-1))
    with pytest.raises(ValueError, match="eos_token_id = 3"):
        Tokenizer(dict(meta, eos_token_id=3))
    with pytest.raises(ValueError, match="tokens must be an array of strings"):
        Tokenizer(dict(meta, tokens=["a", 5, "ab"]))
    assert Tokenizer(dict(meta, bos_token_id=2)).bos_id == 2


# ------------------------------------------------------------------------------------------------
# one Model, several threads; streams

KW = dict(max_tokens=12, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, stop_at_eog=False)
PROMPTS = ("hello world", "The other one is here")      # different first tokens: no shared prefix


def _expected(m):
    return [m.generate(p, seed=i, **KW).tokens for i, p in enumerate(PROMPTS)]


def test_two_threads_on_one_model_serialize(tiny):
    m = Model.load(tiny, n_ctx=64)
    want = _expected(m)
    assert want[0] != want[1]
    got, errors = [[], []], []

    def worker(i):
        try:
            for _ in range(6):
                got[i].append(m.generate(PROMPTS[i], seed=i, **KW).tokens)
                got[i].append(m.eval(m.tokenize(PROMPTS[i])).argmax())   # eval/logits take turns too
        except Exception as e:   # pragma: no cover - reported below
            errors.append(e)
    ths = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    [t.start() for t in ths]
    [t.join(60) for t in ths]
    assert not errors, errors
    for i in range(2):
        assert got[i][0::2] == [want[i]] * 6              # never someone else's cache
        m.reset()
        assert got[i][1::2] == [m.eval(m.tokenize(PROMPTS[i])).argmax()] * 6


def test_stream_interrupted_by_another_call(tiny):
    m = Model.load(tiny, n_ctx=64)
    want = _expected(m)
    for other in (lambda: m.generate(PROMPTS[1], seed=1, **KW), lambda: m.eval([5, 6]), m.reset,
                  lambda: m.logits([7])):
        s = m.generate(PROMPTS[0], seed=0, stream=True, **KW)
        next(s)
        other()
        t = time.perf_counter()
        with pytest.raises(RuntimeError, match="this stream was interrupted by another generate"):
            for _ in s:
                pass
        assert time.perf_counter() - t < 1.0
        assert m.generate(PROMPTS[0], seed=0, **KW).tokens == want[0]    # the model is still usable
    s = m.generate(PROMPTS[0], seed=0, stream=True, **KW)                   # uninterrupted: the same tokens
    assert "".join(s) == s.result.text and s.result.tokens == want[0]


def test_abandoned_and_closed_streams_leave_the_model_usable(tiny):
    m = Model.load(tiny, n_ctx=64)
    want = _expected(m)
    s = m.generate(PROMPTS[0], seed=0, stream=True, **KW)
    next(s)
    s.close()
    assert m.generate(PROMPTS[1], seed=1, **KW).tokens == want[1]
    s = m.generate(PROMPTS[0], seed=0, stream=True, **KW)
    next(s)
    del s
    gc.collect()
    kept = m.generate(PROMPTS[0], seed=0, stream=True, **KW)   # a paused stream kept alive, never closed
    next(kept)
    done = []
    th = threading.Thread(target=lambda: done.append(m.generate(PROMPTS[1], seed=1, **KW).tokens))
    th.start()
    th.join(30)
    assert done == [want[1]]                                  # no lock is held across a yield
    with pytest.raises(RuntimeError, match="interrupted"):
        list(kept)


def test_streams_from_two_threads_never_mix(tiny):
    """each stream either finishes with its own tokens or raises the interruption error"""
    m = Model.load(tiny, n_ctx=64)
    want = _expected(m)
    res = {}

    def worker(i):
        outcomes = []
        for _ in range(5):
            s = m.generate(PROMPTS[i], seed=i, stream=True, **KW)
            try:
                for _ in s:
                    time.sleep(0.0005)
                outcomes.append(s.result.tokens)
            except RuntimeError as e:
                assert "interrupted" in str(e)
                outcomes.append("interrupted")
        res[i] = outcomes
    ths = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    [t.start() for t in ths]
    [t.join(60) for t in ths]
    for i in range(2):
        assert len(res[i]) == 5
        assert all(o == "interrupted" or o == want[i] for o in res[i]), res[i]


# ------------------------------------------------------------------------------------------------
# limits

def test_huge_prompt_text_refused_before_tokenizing(model, monkeypatch):
    huge = "ab" * 150_000_000                     # aborted the process inside the Rust tokenizer before
    calls = []
    monkeypatch.setattr(model.tokenizer, "tokenize", lambda *a, **k: calls.append(a) or [])
    with pytest.raises(ValueError, match="too long for the context"):
        model.tokenize(huge)
    assert calls == []                            # refused by its length, never handed to the tokenizer
    del huge
    monkeypatch.undo()
    n = model.max_text_len
    assert n == model.n_ctx * model.tokenizer.max_piece_bytes
    assert len(model.tokenize("a" * n)) <= n       # at the bound: tokenized
    with pytest.raises(ValueError, match=f"{n + 1} characters > n_ctx 64"):
        model.generate("a" * (n + 1), max_tokens=1)
    with pytest.raises(ValueError, match="bytes"):
        model.tokenize(b"a" * (n + 1))
    with pytest.raises(TypeError, match="str or bytes"):
        model.tokenize(5)


def test_chat_template_limits(tiny, tdir):
    t = time.perf_counter()
    with pytest.raises(TemplateLimitError, match="time limit of 1.0 s"):
        render_chat(EVIL_TEMPLATE, [])
    assert time.perf_counter() - t < 2.0
    with pytest.raises(TemplateLimitError, match="max_chars"):
        render_chat("{{ 'x' * 100000000 }}", [])
    with pytest.raises(TemplateLimitError, match="max_chars"):
        render_chat("{% for i in range(2000) %}{{ messages[0]['content'] }}{% endfor %}",
                    [{"role": "user", "content": "y" * 10000}], max_chars=1_000_000)
    with pytest.raises(TemplateLimitError, match="width"):
        render_chat("{{ 'x'|center(1000000000) }}", [])
    with pytest.raises(TemplateLimitError, match="recursion"):
        render_chat("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", [])
    # the model renders its file's template with the limit, and its prompt bound as the size limit
    evil = write_tiny_gguf(tdir / "evil.gguf", qtype="Q4_0", chat_template=EVIL_TEMPLATE)
    m = Model.load(evil, n_ctx=64)
    t = time.perf_counter()
    with pytest.raises(TemplateLimitError):
        m.generate([{"role": "user", "content": "hi"}], max_tokens=2)
    assert time.perf_counter() - t < 2.0
    m2 = Model.load(tiny, n_ctx=64)
    with pytest.raises(TemplateLimitError, match=f"limit of {m2.max_text_len}"):
        m2.generate([{"role": "user", "content": "z" * (m2.max_text_len + 10)}], max_tokens=2)


def test_limited_sandbox_renders_like_jinja2():
    """the limits change nothing for a real template: loop vars, namespace, macros, filters"""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    tpl = ("{%- set ns = namespace(n=0) -%}{%- macro r(m) -%}[{{ m.role|upper }}]{%- endmacro -%}"
           "{%- for m in messages if m.role != 'x' -%}{%- set ns.n = ns.n + 1 -%}{{ r(m) }}{{ loop.index }}/"
           "{{ loop.length }}{{ m.content|trim|replace('a', 'b') }}{% if loop.last %}!{% endif %}"
           "{%- else -%}none{%- endfor -%}{{ ns.n }}{{ messages|map(attribute='role')|join(',') }}"
           "{{ (messages|selectattr('role', 'equalto', 'user')|list|length) * 2 }}{{ '%05d'|format(7) }}"
           "{{ {'k': [1, 2]}|tojson }}{{ range(3)|sum }}{{ 2 ** 10 }}{{ 'ab' * 3 }}")
    msgs = [{"role": "system", "content": " sys a "}, {"role": "user", "content": "hi"},
            {"role": "x", "content": "skip"}, {"role": "assistant", "content": "banana"}]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = __import__("json").dumps
    assert render_chat(tpl, msgs) == env.from_string(tpl).render(messages=msgs, add_generation_prompt=True,
                                                                 bos_token="", eos_token="")
    assert render_chat(tpl, []).startswith("none0")


# ------------------------------------------------------------------------------------------------
# argument ranges

@pytest.mark.parametrize("kw,frag", [(dict(max_tokens=-1), "max_tokens"), (dict(top_p=0.0), "top_p"),
                                     (dict(top_p=1.5), "top_p"), (dict(top_p=float("nan")), "top_p"),
                                     (dict(temperature=-0.1), "temperature"),
                                     (dict(temperature=float("inf")), "temperature"), (dict(top_k=-1), "top_k"),
                                     (dict(min_p=-0.1), "min_p"), (dict(min_p=1.01), "min_p"),
                                     (dict(repeat_penalty=0.0), "repeat_penalty"),
                                     (dict(repeat_penalty=-1.0), "repeat_penalty")])
def test_bad_generation_arguments(model, kw, frag):
    for stream in (False, True):          # refused at the call, before a stream is returned
        with pytest.raises(ValueError, match=frag):
            model.generate("hello", stream=stream, **kw)
    if frag != "max_tokens":
        with pytest.raises(ValueError, match=frag):
            Sampler(**kw)


def test_zero_max_tokens_and_thread_bounds(model):
    r = model.generate("hello", max_tokens=0)
    assert r.tokens == [] and r.decode_tokens == 0 and r.prompt_eval_tokens > 0
    for bad in (0, 1025, 2 ** 40, 1.5, True):
        with pytest.raises(ValueError, match="n_threads"):
            cpufuse.set_num_threads(bad)
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="n_threads"):
        cpufuse.rms_norm(x, np.ones(8, np.float32), eps=1e-5, n_threads=2 ** 40)
    with pytest.raises(ValueError, match="n_threads"):
        cpufuse.softmax(x, n_threads=5000)
    assert cpufuse.get_num_threads() >= 1


def test_cli_values(tiny):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "cpufuse", "generate", "-m", tiny, "-p", "hello", "--ctx", "64",
                               *args], capture_output=True, text=True, env=env, timeout=120)
    r = cli("-n", "0")
    assert r.returncode == 0 and "nan" not in r.stderr.lower() and "decode: 0 tokens" in r.stderr, r.stderr
    # bad flags are usage errors (2) naming the flag, checked before the model loads; -t at the load (1)
    for args, frag, rc in ((("-n", "-1"), "-n must be >= 0", 2), (("--top-p", "2"), "--top-p", 2),
                           (("--temp", "-1"), "--temp", 2), (("-t", "5000"), "n_threads", 1)):
        r = cli(*args)
        assert r.returncode == rc and frag in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_fifo_model_path_refused(tdir):
    fifo = tdir / "model.fifo"
    os.mkfifo(fifo)
    t = time.perf_counter()
    with pytest.raises(ValueError, match="FIFO"):
        Model.load(fifo)
    assert time.perf_counter() - t < 1.0
