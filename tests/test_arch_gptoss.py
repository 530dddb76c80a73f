"""gpt-oss: its graph ops (swiglu_oai, add_id, attention sinks) against float64, and tiny synthetic
gpt-oss files written from its architecture module (biases, sinks, sliding-window layers, YaRN,
softmax over the top-k logits, per-expert biases, MXFP4 experts) against the float64 reference
forward (cpufuse/reference/gptoss.py), bit-identical across thread counts and batch compositions."""
import numpy as np
import pytest

pytest.importorskip("gguf")

from cpufuse import Graph, GraphError  # noqa: E402
from cpufuse.graph.oai import swiglu_oai  # noqa: E402
from cpufuse.llama import Model  # noqa: E402
from cpufuse.llama.decoder import Batch  # noqa: E402
from cpufuse.llama.tiny import write_tiny_gguf  # noqa: E402
from cpufuse.reference.gptoss import ref_gptoss_logits, swiglu_oai64  # noqa: E402

TOKENS = [5, 17, 280, 42, 99, 7, 256, 3, 128, 64, 11, 200, 90, 31]


def test_swiglu_oai_op(isa, rng):
    G = (rng.standard_normal((5, 37)) * 6).astype(np.float32)
    U = (rng.standard_normal((5, 37)) * 6).astype(np.float32)
    G[0, :6] = [np.nan, np.inf, -np.inf, 7.0, 7.5, -100.0]
    U[0, 6:12] = [np.nan, np.inf, -np.inf, -7.0, -7.5, 100.0]
    U[0, 1] = U[0, 3] = U[0, 4] = 0.5
    g = Graph()
    gi, ui = g.input("g", G.shape), g.input("u", U.shape)
    g.output(g.swiglu_oai(gi, ui))
    (y,) = g.compile(isa=isa).run(copy=True, g=G, u=U)
    with np.errstate(invalid="ignore"):   # -inf / inf: NaN, as in C and ggml
        ref = swiglu_oai64(G.astype(np.float64), U.astype(np.float64))
    assert np.array_equal(np.isnan(y), np.isnan(ref)) and np.isnan(y[0, 0]) and np.isnan(y[0, 6])
    ok = ~np.isnan(ref)
    assert np.allclose(y[ok], ref[ok], rtol=1e-6, atol=1e-6)
    assert y[0, 1] == y[0, 3] and y[0, 4] == y[0, 3]                  # min(g, 7)
    assert np.array_equal(swiglu_oai(G, U)[ok], y[ok]) or isa != "numba"   # the Python step is the numba path
    with pytest.raises(GraphError, match="one shape"):
        g.swiglu_oai(gi, g.input("u2", (5, 36)))


def test_add_id_op(isa, rng):
    n, k, m, nb = 4, 3, 19, 5
    A = rng.standard_normal((n, k, m)).astype(np.float32)
    B = rng.standard_normal((nb, m)).astype(np.float32)
    ids = rng.integers(0, nb, (n, k)).astype(np.int32)
    g = Graph()
    a, i = g.input("a", A.shape), g.input("ids", ids.shape, np.int32)
    g.output(g.add_id(a, g.constant(B, "b"), i))
    plan = g.compile(isa=isa)
    (y,) = plan.run(copy=True, a=A, ids=ids)
    assert np.array_equal(y, A + B[ids])
    with pytest.raises(GraphError, match="must be in|out of range"):
        plan.run(copy=True, a=A, ids=np.full((n, k), nb, np.int32))


def test_oai_ops_in_chunks_over_threads(isa, rng):
    """a prompt's swiglu_oai and add_id run in chunks over the team: the same bits at 1, 2 and 3 threads"""
    n, k, m, nb = 7, 4, 1203, 6                      # 33,684 elements: more than one chunk, odd sizes
    G = (rng.standard_normal((n, k, m)) * 6).astype(np.float32)
    U = (rng.standard_normal((n, k, m)) * 6).astype(np.float32)
    B = rng.standard_normal((nb, m)).astype(np.float32)
    ids = rng.integers(0, nb, (n, k)).astype(np.int32)
    g = Graph()
    gi, ui, ii = g.input("g", G.shape), g.input("u", U.shape), g.input("ids", ids.shape, np.int32)
    g.output(g.swiglu_oai(g.add_id(gi, g.constant(B, "b"), ii), ui))
    plan = g.compile(isa=isa)
    ys = [plan.run(copy=True, n_threads=t, g=G, u=U, ids=ids)[0] for t in (1, 2, 3)]
    assert all(np.array_equal(y, ys[0]) for y in ys[1:])
    ref = swiglu_oai64(G.astype(np.float64) + B[ids].astype(np.float64), U.astype(np.float64))
    assert np.allclose(ys[0], ref, rtol=1e-5, atol=1e-5)


def test_attn_seqs_sinks(isa, rng):
    """attn_seqs with a sink logit per head: each sequence gets flash_attn with those sinks alone (bit
    for bit) and the float64 attention with exp(sink) in the denominator; sinks of -inf change nothing"""
    from cpufuse import flash_attn
    from cpufuse.reference.ops import flash_attn as fa64
    H, HKV, D, NC, n = 4, 2, 16, 64, 7
    kc, vc = np.zeros((NC, HKV, D), np.float32), np.zeros((NC, HKV, D), np.float32)
    sk = np.array([0.5, -1.0, 3.0, -np.inf], np.float32)
    g = Graph()
    q, k, v = g.input("q", (n, H, D)), g.input("k", (n, HKV, D)), g.input("v", (n, HKV, D))
    cells, seqs = g.input("cells", (n,), np.int32), g.input("seqs", (2, 4), np.int32)
    kw, vw = g.kv_write(k, kc, cells), g.kv_write(v, vc, cells)
    g.output(g.attn_seqs(q, kw, vw, seqs, scale=0.25, sinks=g.constant(sk, "sinks")),
             g.attn_seqs(q, kw, vw, seqs, scale=0.25, sinks=g.constant(np.full(H, -np.inf, np.float32), "none")),
             g.attn_seqs(q, kw, vw, seqs, scale=0.25))
    Q, K, V = (rng.standard_normal((n, h, D)).astype(np.float32) for h in (H, HKV, HKV))
    S = np.array([[0, 0, 4, 0], [32, 4, 3, 0]], np.int32)       # two sequences prefilling 4 and 3 tokens
    a, none, plain = g.compile(isa=isa).run(copy=True, q=Q, k=K, v=V, cells=np.array([0, 1, 2, 3, 32, 33, 34], np.int32),
                                            seqs=S)
    assert np.array_equal(none, plain)
    for cell0, r0, nr, pos0 in S:
        m = np.zeros((1, 1, nr, nr), np.float16)
        m[0, 0][np.triu(np.ones((nr, nr), bool), 1)] = -np.inf
        args = (Q[r0:r0 + nr].transpose(1, 0, 2)[None], kc[cell0:cell0 + nr].transpose(1, 0, 2)[None],
                vc[cell0:cell0 + nr].transpose(1, 0, 2)[None], m)
        alone = flash_attn(*args, scale=0.25, sinks=sk, isa=isa)[0]
        assert np.array_equal(a[r0:r0 + nr], alone)
        ref = fa64(*(x.astype(np.float64) for x in args), scale=0.25, sinks=sk.astype(np.float64))[0]
        assert np.allclose(a[r0:r0 + nr], ref, atol=1e-5)
    assert not np.allclose(a, plain)
    with pytest.raises(GraphError, match="sinks"):
        g.attn_seqs(q, kw, vw, seqs, scale=0.25, sinks=g.constant(sk[:3], "bad"))


def _tiny(tmp_path, qtype="F32", seed=0):
    return write_tiny_gguf(tmp_path / f"gptoss-{qtype}-{seed}.gguf", qtype=qtype, arch="gpt-oss", seed=seed,
                           embd_qtype="F32" if qtype == "F32" else "F16")


def _close(got, ref, tol):
    got = np.asarray(got, np.float64)
    err = np.max(np.abs(got - ref)) / max(1.0, np.max(np.abs(ref)))
    assert err < tol, f"max error {err:.3g} (relative to the largest logit) >= {tol}"


def _ref(path):
    routes = []
    ref = ref_gptoss_logits(path, TOKENS, routes)
    for ids, margin in routes:
        assert len({tuple(sorted(r)) for r in ids.tolist()}) >= 3, "routing should change between tokens"
        assert margin.min() > 1e-5, f"a near-tie in the top-k ({margin.min():.3g}): pick another seed"
    return ref


@pytest.mark.parametrize("qtype", ["F32", "MXFP4", "Q8_0"])
def test_gptoss_matches_reference(tmp_path, qtype):
    """exact f32 activations: a prompt, then a batch and single-token decode steps past the sliding
    window (3 in the tiny file), against the float64 forward of the dequantized file"""
    p = _tiny(tmp_path, qtype)
    ref = _ref(p)
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32", n_batch=6, n_threads=2)
    h = m.hparams
    assert h.arch == "gpt-oss" and h.swa_window == 3 and h.swa_layers == (True, False, True, False)
    assert h.ext_factor == 1.0 and h.freq_scale == 0.25 and h.expert_gating == "softmax_weight"
    assert not h.expert_weights_norm
    _close(m.logits(TOKENS), ref, 2e-5)
    m.reset()
    got = [m.eval(TOKENS[:6])] + [m.eval([t]) for t in TOKENS[6:]]
    _close(np.stack(got), ref[5:], 2e-5)


def test_gptoss_sinks_matter(tmp_path):
    """the sinks change the logits (a file without their effect would not match the reference)"""
    p = _tiny(tmp_path)
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32", n_threads=1)
    a = np.array(m.logits(TOKENS[:5]), copy=True)
    for L in m.layers:
        L.attn_sinks = np.full_like(L.attn_sinks, -1e30)
    m.decoder.__init__(m)
    b = np.array(m.logits(TOKENS[:5]), copy=True)
    assert np.max(np.abs(a - b)) > 1e-3


def test_gptoss_bit_identical_threads_and_batches(tmp_path):
    """MXFP4 experts, q8 activations: the same bits for 1, 2 and 3 threads, repacked or not, and for
    a sequence alone or beside others in one multi-slot Batch"""
    p = _tiny(tmp_path, "MXFP4")
    runs = []
    for nt in (1, 2, 3):
        m = Model.load(p, n_ctx=64, n_batch=8, n_threads=nt)
        runs.append(np.array(m.logits(TOKENS[:8]), copy=True))
    m = Model.load(p, n_ctx=64, n_batch=8, n_threads=2, repack=False)
    runs.append(np.array(m.logits(TOKENS[:8]), copy=True))
    for r in runs[1:]:
        assert np.array_equal(r, runs[0])
    m = Model.load(p, n_ctx=64, n_batch=8, n_seq=3, n_threads=3)
    alone = []
    for toks, slot in ((TOKENS[:5], 0), (TOKENS[3:9], 2)):
        b = Batch(m)
        b.add(slot, toks, 0)
        alone.append(np.array(b.run(m.decoder, (24, 4, 3)), copy=True))
    b = Batch(m)
    b.add(1, TOKENS[7:14], 0)
    b.add(0, TOKENS[:5], 0)
    b.add(2, TOKENS[3:9], 0)
    both = np.array(b.run(m.decoder, (24, 4, 3)), copy=True)
    assert np.array_equal(both[1], alone[0][0]) and np.array_equal(both[2], alone[1][0])
    assert np.array_equal(alone[0][0], runs[0][4])


def test_gptoss_numba_matches_reference(tmp_path):
    pytest.importorskip("numba")
    p = _tiny(tmp_path)
    ref = _ref(p)
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32", n_threads=2, isa="numba")
    _close(m.logits(TOKENS), ref, 2e-5)


def test_harmony_template_renders_and_tokenizes(tmp_path):
    """the harmony chat format as a gpt-oss file's Jinja renders it (tests/_chat_templates.py's
    GPT_OSS: system header, tools as a TypeScript namespace, a tool call on the commentary channel
    ending in <|call|>, the tool's result, final answers, the generation prompt), and the rendered
    prompt's markers tokenized as single special tokens by a tiny gpt-oss file's tokenizer"""
    from _chat_templates import GPT_OSS
    from cpufuse.llama.chat import chat_prompt, render_chat
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "name": "get_weather", "content": "18 C, sunny"},
            {"role": "assistant", "content": "It is 18 C and sunny."},
            {"role": "user", "content": "Thanks!"}]
    out = render_chat(GPT_OSS, msgs, tools=tools)
    want = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: "
            "2024-06\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included "
            "for every message.\nCalls to these tools must go to the commentary channel: 'functions'.<|end|>"
            "<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n// Weather of a city\n"
            'type get_weather = (_: {"type": "object", "properties": {"city": {"type": "string"}}}) => any;\n\n'
            "} // namespace functions<|end|>"
            "<|start|>user<|message|>Weather in Paris?<|end|>"
            '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
            "<|call|>"
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 C, sunny"<|end|>'
            "<|start|>assistant<|channel|>final<|message|>It is 18 C and sunny.<|end|>"
            "<|start|>user<|message|>Thanks!<|end|>"
            "<|start|>assistant")
    assert out == want
    p = write_tiny_gguf(tmp_path / "gptoss-chat.gguf", qtype="F32", arch="gpt-oss", chat_template=GPT_OSS)
    m = Model.load(p, n_ctx=64)
    tok = m.tokenizer
    assert chat_prompt(tok, msgs, tools=tools) == want
    ids = tok.tokenize(want, add_bos=False, special=True)
    specials = {t: tok.tokenize(t, add_bos=False, special=True) for t in
                ("<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|call|>", "<|constrain|>")}
    assert all(len(v) == 1 for v in specials.values())
    assert ids.count(specials["<|start|>"][0]) == 8 and ids.count(specials["<|call|>"][0]) == 1
    assert tok.detokenize(ids, special=True) == want
