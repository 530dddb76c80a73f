"""The architectures beyond llama/qwen2/qwen3 (gemma3, gemma2, phi3, smollm3, granite and every one
added to the registry since) on tiny synthetic GGUFs, against the float64 reference forward of
cpufuse/reference/archs.py (written from llama.cpp's graphs, reading the file with gguf-py); and
the graph ops they added (gelu, GEGLU, softcap, the sliding window of attn_seqs)."""
import math

import numpy as np
import pytest

pytest.importorskip("gguf")

import cpufuse  # noqa: E402
from cpufuse.graph import Graph  # noqa: E402
from cpufuse.graph import records as _records  # noqa: E402
from cpufuse.llama import Model  # noqa: E402
from cpufuse.llama.arch import SUPPORTED  # noqa: E402
from cpufuse.llama.tiny import write_tiny_gguf  # noqa: E402
from cpufuse.reference.archs import ref_logits  # noqa: E402

NEW_ARCHS = tuple(a for a in SUPPORTED if a not in ("llama", "qwen2", "qwen3"))   # every later one
TOKENS = [5, 17, 280, 42, 99, 7, 256, 3, 128, 64, 11, 200, 90, 31]   # 14 > the window of 4


def _tiny(tmp_path, arch, **kw):
    return write_tiny_gguf(tmp_path / f"{arch}.gguf", qtype=kw.pop("qtype", "F32"), arch=arch,
                           embd_qtype=kw.pop("embd_qtype", "F32"), **kw)


def _close(got, ref, tol):
    got = np.asarray(got, np.float64)
    err = np.max(np.abs(got - ref)) / max(1.0, np.max(np.abs(ref)))
    assert err < tol, f"max error {err:.3g} (relative to the largest logit) >= {tol}"


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_arch_logits_match_float64_reference(tmp_path, arch):
    """every position's logits from an empty cache (one prompt batch), exact f32 mode"""
    p = _tiny(tmp_path, arch)
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32", n_threads=2)
    assert m.hparams.arch == arch
    _close(m.logits(TOKENS), ref_logits(p, TOKENS, n_ctx=64), 2e-5)


@pytest.mark.parametrize("arch", NEW_ARCHS)
@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_arch_incremental_matches_reference(tmp_path, arch, kv):
    """a micro-batch, then micro-batches of 3, then single-token decode steps: the KV cells
    across calls; for gemma the sliding window (4) and its rings of window + n_batch = 7 cells per
    sequence, which wrap around several times over the 14 positions"""
    p = _tiny(tmp_path, arch, dims={"n_layer": 3} if arch == "gemma3" else None,
              arch_keys={"attention.sliding_window_pattern": 3} if arch == "gemma3" else None)
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype=kv, n_batch=3, n_threads=2)
    if arch.startswith("gemma"):
        assert m.kv.ring_cells == 7
        assert m.hparams.swa_layers == ((True, True, False) if arch == "gemma3" else (True, False))
    ref = ref_logits(p, TOKENS, n_ctx=64)
    got = [m.eval(TOKENS[:3])]
    for s in range(3, 9, 3):
        got.append(m.eval(TOKENS[s:s + 3]))
    for t in TOKENS[9:]:
        got.append(m.eval([t]))
    rows = [2, 5, 8] + list(range(9, len(TOKENS)))
    _close(np.stack(got), ref[rows], 2e-5 if kv == "f32" else 3e-3)


def test_gemma_ring_cache_memory_and_limits(tmp_path):
    p = _tiny(tmp_path, "gemma3")
    full = Model.load(p, n_ctx=64, n_batch=64)      # window + n_batch >= n_ctx: one full cache
    ring = Model.load(p, n_ctx=64, n_batch=4)       # 5 SWA layers of 8 cells, 1 global of 64
    assert full.kv.ring_cells == 0 and ring.kv.ring_cells == 8
    assert ring.kv_bytes * 64 == full.kv_bytes * (5 * 8 + 64) // 6
    from cpufuse.llama.decoder import Batch
    b = Batch(ring)
    with pytest.raises(ValueError, match="ring of 8 cells"):
        b.add(0, list(range(6)), 0)
    # the rings change where K and V live, not a bit of the results
    import cpufuse.llama.kv as _kv
    long = TOKENS + TOKENS[:6]
    lr = ring.logits(long)
    _kv.SWA_RINGS = False
    try:
        noring = Model.load(p, n_ctx=64, n_batch=4)
    finally:
        _kv.SWA_RINGS = True
    assert noring.kv.ring_cells == 0
    np.testing.assert_array_equal(noring.logits(long), lr)
    # a reused prefix whose window cells were overwritten is evaluated again: same tokens
    long = TOKENS + TOKENS[:6]
    a = ring.generate(long, max_tokens=3, temperature=0).tokens
    assert ring.kv.reusable(12, len(long) + 2) == 0 and ring.kv.reusable(12, 14) == 12
    r1 = ring.generate(TOKENS[:12] + [9, 9], max_tokens=4, temperature=0).tokens
    assert ring.generate(long, max_tokens=3, temperature=0, reuse_cache=False).tokens == a
    r2 = ring.generate(TOKENS[:12] + [9, 9], max_tokens=4, temperature=0, reuse_cache=False).tokens
    assert r1 == r2
    # a reusable prefix (the ring still holds its window) is reused
    ring.generate(TOKENS[:12], max_tokens=1, temperature=0)
    r3 = ring.generate(TOKENS[:12] + [9, 9], max_tokens=4, temperature=0)
    assert r3.prompt_eval_tokens == 2 and r3.tokens == r1


def test_gemma3_pattern_and_keys(tmp_path):
    p = _tiny(tmp_path, "gemma3")
    m = Model.load(p, n_ctx=64)
    hp = m.hparams
    assert hp.swa_layers == (True,) * 5 + (False,)
    assert hp.swa_window == 4 and hp.freq_base_swa == 10000.0 and hp.freq_scale_swa == 1.0
    assert hp.kq_scale == 1.0 / math.sqrt(hp.head_dim)
    assert hp.emb_scale == float(np.float32(math.sqrt(64)))
    assert hp.final_softcap == 0.0 and hp.rope_mode == "neox"
    L = m.layers[0]
    assert L.q_norm.shape == (hp.head_dim,) and L.post_attn_norm is not None and L.post_ffn_norm is not None
    d = m.plan(4).plan.describe()
    assert "l0.gelu" in d and "l0.silu" not in d
    assert m.tied and m.output is not None


@pytest.mark.parametrize("key, value, msg", [
    ("attention.sliding_window_pattern", [True, False], "one bool per layer"),
    ("final_logit_softcapping", -3.0, "final_logit_softcapping = -3.0: must be finite and > 0"),
    ("final_logit_softcapping", float("nan"), "final_logit_softcapping = nan: must be finite"),
    ("rope.freq_base_swa", 0.0, "rope.freq_base_swa = 0.0: must be finite and > 0"),
    ("attention.sliding_window", "wide", "sliding_window = 'wide': expected an integer"),
])
def test_gemma3_bad_keys_are_refused(tmp_path, key, value, msg):
    def extra(w):
        k = "gemma3." + key
        if isinstance(value, str):
            w.add_string(k, value)
        elif isinstance(value, list):
            w.add_array(k, value)
        else:
            w.add_float32(k, value)
    keys = {key: None} if key == "attention.sliding_window" else None
    p = write_tiny_gguf(tmp_path / "bad.gguf", arch="gemma3", extra=extra, arch_keys=keys)
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        Model.load(p, n_ctx=64)


def test_gemma3_head_dim_and_rope_scaling(tmp_path):
    """key_length != n_embd / n_head; global layers on freq_base with the linear factor, SWA
    layers on base 10000 and scale 1; an explicit final softcap"""
    p = _tiny(tmp_path, "gemma3", freq_base=1e6, dims={"head_dim": 24},
              arch_keys={"rope.scaling.type": None, "rope.scaling.factor": 8.0, "final_logit_softcapping": 3.0})
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32")
    assert m.hparams.head_dim == 24 and m.hparams.freq_scale == 0.125 and m.hparams.final_softcap == 3.0
    ref = ref_logits(p, TOKENS, n_ctx=64)
    assert np.max(np.abs(ref)) <= 3.0
    _close(m.logits(TOKENS), ref, 2e-5)


def test_gemma3_fused_plan(tmp_path):
    """GEGLU runs in the gate/up matmul's epilogue, each post-norm with its residual add in one
    rms_norm kernel, the whole decoder is one C call"""
    p = _tiny(tmp_path, "gemma3", qtype="Q8_0")
    m = Model.load(p, n_ctx=64)
    d = m.plan(4).plan.describe()
    assert d.count("QMATMUL x2 -> GELU -> MUL (matmul_geglu)") == 6
    assert d.count("RMS_NORM -> MUL -> ADD") == 12
    assert "ONE C call" in d
    # fused and unfused agree (q8 activations; different kernels round differently)
    m2 = Model.load(p, n_ctx=64, fusion=False)
    a, b = m.logits(TOKENS), m2.logits(TOKENS)
    _close(a, b.astype(np.float64), 1e-3)


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_gemma_q8_close_to_reference(tmp_path, arch):
    """the default mode (q8 activations, f16 KV) on Q8_0 weights: the reference's top-1 almost
    everywhere, logits within the q8 error"""
    p = _tiny(tmp_path, arch, qtype="Q8_0", embd_qtype="Q8_0")
    m = Model.load(p, n_ctx=64)
    got, ref = m.logits(TOKENS), ref_logits(p, TOKENS)
    _close(got, ref, 3e-2)
    assert np.mean(np.argmax(got, 1) == np.argmax(ref, 1)) >= 0.85


def test_phi3_long_and_short_factors(tmp_path):
    p = _tiny(tmp_path, "phi3")
    ms = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32")     # n_ctx <= original 64: short
    ml = Model.load(p, n_ctx=128, act="f32", kv_dtype="f32")    # > 64: long
    assert not np.array_equal(ms.rope_freqs, ml.rope_freqs)
    assert ms.hparams.n_rot == ms.hparams.head_dim // 2 and ms.hparams.attn_factor == pytest.approx(1.19)
    _close(ml.logits(TOKENS), ref_logits(p, TOKENS, n_ctx=128), 2e-5)


def test_smollm3_nope_layers(tmp_path):
    p = _tiny(tmp_path, "smollm3", dims={"n_layer": 4})
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32")
    assert m.hparams.nope_layers == (False, False, False, True)
    d = m.plan(4).plan.describe()
    assert [f"l{i}.rope_q" in d for i in range(4)] == [True, True, True, False]
    _close(m.logits(TOKENS), ref_logits(p, TOKENS), 2e-5)


def test_granite_scales(tmp_path):
    p = _tiny(tmp_path, "granite")
    hp = Model.load(p, n_ctx=64).hparams
    assert (hp.emb_scale, hp.residual_scale, hp.kq_scale, hp.logit_scale) == (12.0, pytest.approx(0.22),
                                                                             0.0078125, 8.0)


def test_gemma_tokens_eog_template(tmp_path):
    """EOG = {eos, <end_of_turn>}; no template in the file + <start_of_turn> in the vocabulary:
    the Gemma turn format, BOS rendered once (chat prompts are tokenized without add_bos)"""
    from cpufuse.llama.chat import chat_prompt
    p = _tiny(tmp_path, "gemma3")
    m = Model.load(p, n_ctx=64)
    tok = m.tokenizer
    eot = tok.tokenize("<end_of_turn>", special=True)
    assert len(eot) == 1 and eot[0] in m.eog_ids and tok.eos_id in m.eog_ids
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hi "},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    text = chat_prompt(tok, msgs)
    assert text == (tok.bos_text + "<start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n"
                    "<start_of_turn>model\nhello<end_of_turn>\n<start_of_turn>user\nbye<end_of_turn>\n"
                    "<start_of_turn>model\n")
    ids = m.prompt_ids(msgs)
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id
    with pytest.raises(Exception, match="alternate"):
        chat_prompt(tok, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    r = m.generate(msgs, max_tokens=4, temperature=0)
    assert r.prompt_tokens == len(ids)


def test_gemma3_generate_on_numba(tmp_path):
    """the Numba ISA runs the same graph (GEGLU epilogue 3, the window in Python's attn_seqs)"""
    p = _tiny(tmp_path, "gemma3")
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32", isa="numba", n_batch=3)
    assert m.kv.ring_cells == 7     # the rings, read by the Python attn_seqs
    _close(m.logits(TOKENS), ref_logits(p, TOKENS), 2e-5)


# ------------------------------------------------------------------------------- graph ops
def _gelu64(x):
    x = x.astype(np.float64)   # 0.5 x (1 + tanh(y)) = x / (1 + exp(-2y)): no cancellation for x << 0
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-2.0 * math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("py", [False, True])
def test_graph_gelu_geglu_softcap(py, monkeypatch):
    if py:
        monkeypatch.setattr(_records, "PY_STEPS", {"gelu", "geglu", "softcap"})
    rng = np.random.default_rng(1)
    n = 1000 + 7
    a = (rng.standard_normal(n) * 4).astype(np.float32)
    a[:6] = [0.0, -0.0, 30.0, -30.0, 1e30, -1e30]
    u = rng.standard_normal(n).astype(np.float32)
    g = Graph()
    xa, xu = g.input("a", (n,)), g.input("u", (n,))
    y1 = g.gelu(xa)
    g.output(y1, g.mul(g.gelu(xa), xu), g.softcap(xa, 7.5))
    plan = g.compile()
    if not py:
        assert "GELU -> MUL" in plan.describe()
    o1, o2, o3 = plan.run(a=a, u=u)
    ref = _gelu64(a)
    np.testing.assert_allclose(o1, ref, rtol=2e-6, atol=1e-9)   # f32 z: ~z*eps relative in the far tail
    np.testing.assert_allclose(o2, ref * u, rtol=3e-6, atol=1e-9)
    np.testing.assert_allclose(o3, 7.5 * np.tanh(a.astype(np.float64) / 7.5), rtol=1e-6, atol=7.5 * 2e-7)   # flash_attn's tanh: ~1e-7 absolute
    assert o1[4] == 1e30 and o1[5] == 0.0 and np.signbit(o1[5])
    bad = np.array([np.nan, np.inf, -np.inf], np.float32)
    g = Graph()
    xb = g.input("b", (3,))
    g.output(g.gelu(xb), g.softcap(xb, 2.0))
    r1, r2 = g.compile().run(b=bad)
    assert np.isnan(r1[0]) and r1[1] == np.inf and np.isnan(r1[2])   # -inf / inf, as silu(-inf)
    assert np.isnan(r2[0]) and r2[1] == 2.0 and r2[2] == -2.0


def test_graph_softcap_and_window_args():
    g = Graph()
    x = g.input("x", (4,))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="cap must be finite and > 0"):
            g.softcap(x, bad)


def test_matmul_geglu_against_reference():
    rng = np.random.default_rng(2)
    wg = rng.standard_normal((40, 64)).astype(np.float32)
    wu = rng.standard_normal((40, 64)).astype(np.float32)
    qg, qu = (cpufuse.QTensor(w.view(np.uint8), "F32", w.shape) for w in (wg, wu))
    x = rng.standard_normal((5, 64)).astype(np.float32)
    from cpufuse.quant.matmul import matmul_geglu
    y = matmul_geglu(x, qg, qu, act="f32")
    ref = _gelu64(x.astype(np.float64) @ wg.T.astype(np.float64)) * (x.astype(np.float64) @ wu.T.astype(np.float64))
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


def test_gemma3_batch_engine_tokens_do_not_depend_on_the_batch(tmp_path):
    """the server's continuous batching on gemma3 (SWA layers, window 4): a request's tokens are
    the same alone and beside others, and the library's"""
    from cpufuse.serve.batch import BatchEngine
    from cpufuse.serve.engine import EngineRequest, SamplingParams, TokenEvent, make_sampler
    p = _tiny(tmp_path, "gemma3", qtype="Q8_0")
    rng = np.random.default_rng(3)
    reqs = [EngineRequest([int(t) for t in rng.integers(5, 280, int(rng.integers(3, 20)))], 8,
                          SamplingParams(temperature=0.0)) for _ in range(6)]

    def collect(h):
        return [ev.token for ev in h if isinstance(ev, TokenEvent)]

    eng = BatchEngine(Model.load(p, n_ctx=64, n_seq=3, n_batch=5), chunk=5)
    assert eng.model.kv.ring_cells == 9        # the sliding-window layers' rings
    with pytest.raises(ValueError, match="chunk must be <= the model's n_batch"):
        BatchEngine(eng.model, chunk=6)
    eng.start()
    try:
        alone = [collect(eng.submit(EngineRequest(list(r.prompt_ids), r.max_tokens, r.sampling))) for r in reqs]
        hs = [eng.submit(EngineRequest(list(r.prompt_ids), r.max_tokens, r.sampling)) for r in reqs]
        together = [collect(h) for h in hs]
    finally:
        eng.stop()
    assert alone == together
    m = Model.load(p, n_ctx=64, n_batch=5)
    for r, toks in zip(reqs, alone):
        ref = m.generate(list(r.prompt_ids), max_tokens=r.max_tokens, sampler=make_sampler(r.sampling),
                         stop_at_eog=False, reuse_cache=False).tokens
        assert toks == ref


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "phi3"])
def test_arch_results_do_not_depend_on_threads(tmp_path, arch):
    p = _tiny(tmp_path, arch, qtype="Q8_0")
    outs = [Model.load(p, n_ctx=64, n_batch=4, n_threads=t).logits(TOKENS) for t in (1, 2, 3)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_python_steps_match_the_c_plan(tmp_path, arch, monkeypatch):
    """the Python steps of the new kinds (matmul_geglu, attn_seqs with window and ring, softcap)
    give what the C plan gives"""
    p = _tiny(tmp_path, arch, qtype="Q8_0")
    c = Model.load(p, n_ctx=64, n_batch=3).logits(TOKENS)
    monkeypatch.setattr(_records, "PY_STEPS", {"qmatmul_geglu", "attn_seqs", "softcap", "geglu"})
    m = Model.load(p, n_ctx=64, n_batch=3)
    assert m.kv.ring_cells == 7
    py = m.logits(TOKENS)
    np.testing.assert_allclose(py, c, rtol=0, atol=1e-5 * np.max(np.abs(c)))


@pytest.mark.parametrize("arch,dims", [
    ("gemma3", {"n_embd": 64, "n_head": 4, "n_head_kv": 1, "head_dim": 32}),   # Gemma-3-1B: 4 / 1 heads, H*D != n_embd
    ("phi3", {"n_embd": 96, "n_head": 6, "n_head_kv": 2, "n_rot": 12})])      # Phi-4-mini: 3:1 GQA, rotary 0.75
def test_real_head_layouts_match_reference(tmp_path, arch, dims):
    """the head layouts of the bench's synthetic Gemma-3-1B and Phi-4-mini shapes (written with
    tiny.py's tensor_plan and add_model_keys at the real dims) at tiny dims, against the reference"""
    p = _tiny(tmp_path, arch, dims=dims)
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32", n_threads=2)
    hp = m.hparams
    assert (hp.n_head, hp.n_head_kv, hp.head_dim) == (dims["n_head"], dims["n_head_kv"],
                                                      dims.get("head_dim", dims["n_embd"] // dims["n_head"]))
    assert hp.n_rot == dims.get("n_rot", hp.head_dim)
    _close(m.logits(TOKENS), ref_logits(p, TOKENS, n_ctx=64), 2e-5)
