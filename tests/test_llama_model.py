"""cpufuse.llama.Model on tiny GGUF models written by tests/_tiny_gguf.py (no downloads).

The reference is an independent float64 numpy forward pass of the same dequantized weights
(gguf.quants.dequantize), written here from docs/semantics.md §10: RMSNorm, Q/K/V (+bias), RoPE NORM or
NEOX with exact angles, causal GQA softmax attention, SwiGLU FFN, tied or separate head.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from _tiny_gguf import kquant_dims, write_tiny_gguf  # noqa: E402

from cpufuse.llama.model import Model  # noqa: E402
from cpufuse.llama.sampling import Sampler, apply_penalties, min_p, top_k, top_p  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [257, 271, 111, 283, 44, 262, 256, 258, 121, 32, 109, 111, 100, 101, 108, 33, 50, 60, 70, 80]


# ------------------------------------------------------------------------------------------------
# float64 reference

def _field(r, k, default=None):
    f = r.fields.get(k)
    return default if f is None else f.contents()


def ref_logits(path, tokens, kv_round=None):
    """kv_round: None, or callable(q, k, v) -> (q, k, v) applied per layer after RoPE (a quantized
    cache: K and V as stored, Q as the int8 scores see it)"""
    r = gguf.GGUFReader(path)
    arch = _field(r, "general.architecture")
    W = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float64).reshape(
        [int(s) for s in reversed(t.shape)] if len(t.shape) > 1 else -1) for t in r.tensors}
    E = int(_field(r, f"{arch}.embedding_length"))
    L = int(_field(r, f"{arch}.block_count"))
    H = int(_field(r, f"{arch}.attention.head_count"))
    Hkv = int(_field(r, f"{arch}.attention.head_count_kv"))
    eps = float(_field(r, f"{arch}.attention.layer_norm_rms_epsilon"))
    base = float(_field(r, f"{arch}.rope.freq_base"))
    D = E // H
    neox = arch in ("qwen2", "qwen3")
    T = len(tokens)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    def rope(x):  # (T, h, D)
        pos = np.arange(T, dtype=np.float64)[:, None]
        k = np.arange(D // 2, dtype=np.float64)[None, :]
        th = pos * base ** (-2.0 * k / D)
        c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
        y = x.copy()
        if neox:
            a, b = x[..., :D // 2], x[..., D // 2:]
            y[..., :D // 2] = a * c - b * s
            y[..., D // 2:] = a * s + b * c
        else:
            a, b = x[..., 0::2], x[..., 1::2]
            y[..., 0::2] = a * c - b * s
            y[..., 1::2] = a * s + b * c
        return y

    x = W["token_embd.weight"][np.asarray(tokens)]
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(L):
        b = f"blk.{i}."
        h = norm(x, W[b + "attn_norm.weight"])
        if b + "attn_qkv.weight" in W:
            W[b + "attn_q.weight"], W[b + "attn_k.weight"], W[b + "attn_v.weight"] = np.split(
                W[b + "attn_qkv.weight"], [H * D, (H + Hkv) * D])
        q = h @ W[b + "attn_q.weight"].T + W.get(b + "attn_q.bias", 0.0)
        k = h @ W[b + "attn_k.weight"].T + W.get(b + "attn_k.bias", 0.0)
        v = h @ W[b + "attn_v.weight"].T + W.get(b + "attn_v.bias", 0.0)
        q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
        if arch == "qwen3":
            q = norm(q, W[b + "attn_q_norm.weight"])
            k = norm(k, W[b + "attn_k_norm.weight"])
        q, k = rope(q), rope(k)
        if kv_round is not None:
            q, k, v = kv_round(q, k, v)
        o = np.empty((T, H, D))
        for hh in range(H):
            kv = hh // (H // Hkv)
            s = q[:, hh] @ k[:, kv].T / np.sqrt(D) + causal
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            o[:, hh] = p @ v[:, kv]
        x = x + o.reshape(T, H * D) @ W[b + "attn_output.weight"].T
        h = norm(x, W[b + "ffn_norm.weight"])
        g = h @ W[b + "ffn_gate.weight"].T
        u = h @ W[b + "ffn_up.weight"].T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ W[b + "ffn_down.weight"].T
    head = W.get("output.weight", W["token_embd.weight"])
    return norm(x, W["output_norm.weight"]) @ head.T


def nmse(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.sum((a - ref) ** 2) / np.sum(ref ** 2))


# ------------------------------------------------------------------------------------------------
# fixtures

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_gguf")


_CACHE = {}


def tiny(tiny_dir, qtype="F16", **kw):
    key = (qtype,) + tuple(sorted((k, repr(v)) for k, v in kw.items()))
    if key not in _CACHE:
        name = "tiny_" + "_".join(str(x) for x in key).replace("/", "").replace(" ", "")[:80] + ".gguf"
        if qtype in ("Q4_K", "Q6_K"):
            kw.setdefault("dims", kquant_dims())
        _CACHE[key] = write_tiny_gguf(os.path.join(tiny_dir, name), qtype=qtype, **kw)
    return _CACHE[key]


# ------------------------------------------------------------------------------------------------
# logits against the float64 reference

@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_logits_match_float64_reference(tiny_dir, qtype):
    p = tiny(tiny_dir, qtype, tied=(qtype != "Q8_0"))
    ref = ref_logits(p, PROMPT)
    # exact mode: f32 activations, f32 KV cache -> only f32 rounding
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32")
    got = m.logits(PROMPT)
    assert got.shape == (len(PROMPT), m.n_vocab) and got.dtype == np.float32
    assert nmse(got, ref) < 1e-10, nmse(got, ref)   # measured ~3e-14
    # llama.cpp mode: q8 activations, f16 KV cache
    m = Model.load(p, n_ctx=64)
    got = m.logits(PROMPT)
    e = nmse(got, ref)
    assert e < (3e-3 if qtype in ("Q4_K", "Q6_K") else 1e-3), e
    assert np.mean(got.argmax(1) == ref.argmax(1)) >= 0.75   # the untied Q8_0 head has small logits (near ties)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_archs_match_reference(tiny_dir, arch):
    p = tiny(tiny_dir, "F16", arch=arch)
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32")
    assert m.hparams.rope_mode == "neox"
    e = nmse(m.logits(PROMPT), ref_logits(p, PROMPT))
    assert e < 1e-10, e


def test_fused_qkv_tensor(tiny_dir):
    p = tiny(tiny_dir, "Q8_0", fused_qkv=True)
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32")
    e = nmse(m.logits(PROMPT), ref_logits(p, PROMPT))
    assert e < 1e-10, e


def test_untied_head_and_hparams(tiny_dir):
    p = tiny(tiny_dir, "Q8_0", tied=False)
    m = Model.load(p, n_ctx=100)
    hp = m.hparams
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff) == \
        ("llama", 2, 64, 4, 2, 16, 96)
    assert not m.tied and m.output.qtype == "Q8_0"
    assert m.n_ctx == 100 and m.k_cache.shape == (2, 100, 2, 16) and m.k_cache.dtype == np.float16
    assert Model.load(tiny(tiny_dir, "F16"), n_ctx=32).tied


# ------------------------------------------------------------------------------------------------
# KV cache consistency

@pytest.mark.parametrize("act,kv", [("f32", "f32"), (None, "f16")])
def test_decode_matches_prefill(tiny_dir, act, kv):
    p = tiny(tiny_dir, "Q4_0")
    m = Model.load(p, n_ctx=64, act=act, kv_dtype=kv)
    full = m.logits(PROMPT)
    m.reset()
    steps = np.stack([m.eval([t]).copy() for t in PROMPT])
    tol = 1e-10 if act == "f32" else 1e-6
    assert nmse(steps, full) < tol, nmse(steps, full)
    assert (steps.argmax(1) == full.argmax(1)).all()


def test_cache_across_calls_equals_recompute(tiny_dir):
    p = tiny(tiny_dir, "Q8_0")
    m = Model.load(p, n_ctx=64, n_batch=8)          # also exercises micro-batch splitting
    full = m.logits(PROMPT)
    m.reset()
    a = m.eval(PROMPT[:7], logits_all=True)
    b = m.eval(PROMPT[7:13], logits_all=True)
    c = m.eval(PROMPT[13:], logits_all=True)
    assert m.n_past == len(PROMPT)
    pieces = np.concatenate([a, b, c])
    assert nmse(pieces, full) < 1e-6
    assert (pieces.argmax(1) == full.argmax(1)).all()
    m.reset()
    last = m.eval(PROMPT)
    assert nmse(last, full[-1]) < 1e-6


def test_f32_kv_and_threads(tiny_dir):
    p = tiny(tiny_dir, "Q4_0")
    a = Model.load(p, n_ctx=64, n_threads=1).logits(PROMPT)
    b = Model.load(p, n_ctx=64, n_threads=2).logits(PROMPT)
    np.testing.assert_array_equal(a, b)        # the kernels do not depend on the thread count


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_decode_steps_do_not_depend_on_threads(tiny_dir, qtype):
    # one-token steps run the decode path: several threads prefetch hinted weights and take their
    # first chunks by thread id (native/src/pool.c); 3 and 5 threads oversubscribe a small VM
    p = tiny(tiny_dir, qtype)
    runs = []
    for nt in (1, 2, 3, 5):
        m = Model.load(p, n_ctx=64, n_threads=nt)
        m.eval(PROMPT[:4])
        runs.append(np.stack([m.eval([t]) for t in PROMPT[4:14]]))
    for r in runs[1:]:
        np.testing.assert_array_equal(runs[0], r)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_decode_step_equals_a_batch_of_one(tmp_path, arch):
    # eval of one token runs decoder.Step (the decode plan with its inputs bound once); a Batch of
    # that token on the same plan gives the same logits bit for bit (gemma3: the sliding-window rings)
    from cpufuse.llama.decoder import Batch
    from cpufuse.llama.tiny import write_tiny_gguf
    p = write_tiny_gguf(tmp_path / f"{arch}.gguf", qtype="Q4_0", arch=arch)
    a, b = (Model.load(p, n_ctx=64, n_batch=4, n_threads=2) for _ in range(2))
    assert arch == "llama" or a.kv.ring_cells > 0
    a.eval(PROMPT[:4])
    b.eval(PROMPT[:4])
    for i, t in enumerate(PROMPT[4:16]):
        got = a.eval([t])
        bt = Batch(b)
        bt.add(0, [t], 4 + i)
        want = bt.run(b.decoder, (1, 1, 1), n_threads=2)[0]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), i
    assert a.n_past == 16 and a._cached == PROMPT[:16]


@pytest.mark.parametrize("arch", ["llama", "granitemoe"])
def test_decode_eval_returns_new_arrays(tmp_path, arch):
    # Model.eval of one token returns a new array with the bits of the decode plan's buffer (model._eval,
    # and a Batch of one on the same plan), at 1-4 threads; each array stays as returned after later steps
    from cpufuse.llama.decoder import Batch
    from cpufuse.llama.tiny import write_tiny_gguf
    p = write_tiny_gguf(tmp_path / f"{arch}.gguf", qtype="Q8_0", arch=arch)
    runs = []
    for nt in (1, 2, 3, 4):
        a, b = (Model.load(p, n_ctx=64, n_batch=4, n_threads=nt) for _ in range(2))
        a.eval(PROMPT[:4])
        b.eval(PROMPT[:4])
        got, kept = [], []
        for i, t in enumerate(PROMPT[4:12]):
            g = a.eval([t])
            assert g.shape == (a.n_logits,) and g.dtype == np.float32 and g.flags.c_contiguous
            want = np.array(b._eval([t]), copy=True)
            assert np.array_equal(g.view(np.uint32), want.view(np.uint32)), (nt, i)
            bt = Batch(a)     # the same plan, its own output buffer: a row of the position just written
            bt.add(0, [t], 4 + i)
            again = bt.run(a.decoder, (1, 1, 1), n_threads=nt)[0]
            assert np.array_equal(again.view(np.uint32), want.view(np.uint32)) and not np.shares_memory(again, g)
            got.append(g)
            kept.append(g.copy())
        assert all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(got, kept))
        runs.append(np.stack(got))
    for r in runs[1:]:
        assert np.array_equal(runs[0].view(np.uint32), r.view(np.uint32))


def test_decode_eval_short_path(tmp_path):
    # eval([int]) after the first decode step takes a short path: the same logits and bookkeeping as the
    # general one (an id array, a bool), the same errors (an id out of range, the context full)
    from cpufuse.llama.tiny import write_tiny_gguf
    p = write_tiny_gguf(tmp_path / "l.gguf", qtype="Q8_0", arch="llama")
    a, b = (Model.load(p, n_ctx=12, n_threads=2) for _ in range(2))
    for m in (a, b):
        m.eval(PROMPT[:4])
        m.eval([PROMPT[4]])
    for t in PROMPT[5:11]:
        x, y = a.eval([t]), b.eval(np.array([t]))
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32)) and x.base is None
    assert a.n_past == b.n_past == 11 and a._cached == b._cached == PROMPT[:11]
    assert np.array_equal(a.eval([True]), b.eval(np.array([1])))
    for m in (a, b):
        with pytest.raises(ValueError, match="context overflow"):
            m.eval([5])
    with pytest.raises(ValueError, match="out of range"):
        a.eval([10 ** 6])
    assert a.n_past == 12 and len(a._cached) == 12


def test_profile_counters_of_the_calling_thread(tmp_path):
    # cf_pool_profile_ext (bench/e2e/profile.py's serial table): per record kind its time outside the
    # regions (at most its wall), its regions (adding up to all of them) and the caller's wait in them
    # (adding up to the whole wait); the regions' parts on the caller add up to their wall; nothing
    # counted once profiling is off
    from cpufuse import _backend
    from cpufuse.graph.kinds import RECORDS
    from cpufuse.llama.tiny import write_tiny_gguf
    ffi, lib = _backend.ffi, _backend.lib
    if lib is None:
        pytest.skip("no native extension")
    p = write_tiny_gguf(tmp_path / "g.gguf", qtype="Q8_0", arch="granitemoe")
    m = Model.load(p, n_ctx=64, n_threads=2)
    m.eval(PROMPT[:4])
    out, ext = ffi.new("uint64_t[67]"), ffi.new("uint64_t[197]")
    lib.cf_pool_profile(1, ffi.NULL)
    for t in PROMPT[4:8]:
        m.eval([t])
    lib.cf_pool_profile_ext(ext)
    lib.cf_pool_profile(0, out)
    ops = [r.op for r in RECORDS if r.op < 64]
    assert sum(ext[64 + op] for op in ops) == out[2] > 0 and ext[132] == 4
    for op in ops:
        assert ext[op] <= out[3 + op]
    assert ext[128] + ext[129] + ext[130] <= out[1] <= ext[131]
    assert sum(out[3 + op] for op in ops) <= ext[131]
    assert sum(ext[133 + op] for op in ops) == ext[130] > 0
    lib.cf_pool_profile_ext(ext)
    assert not any(ext[i] for i in range(197))


# ------------------------------------------------------------------------------------------------
# generation

def test_greedy_generation_is_deterministic_and_argmax(tiny_dir):
    p = tiny(tiny_dir, "Q4_0")
    m = Model.load(p, n_ctx=64)
    r1 = m.generate(PROMPT[:6], max_tokens=12, temperature=0)
    r2 = m.generate(PROMPT[:6], max_tokens=12, temperature=0)
    assert r1.tokens == r2.tokens and r1.text == r2.text
    assert len(r1.tokens) == 12 or r1.stop_reason == "eog"
    assert r2.prompt_eval_tokens == 1       # the second call reused the cached prompt prefix
    # each generated token is the argmax of a fresh recompute of its prefix
    seq = PROMPT[:6] + r1.tokens
    lg = m.logits(seq[:-1])
    assert list(lg[5:].argmax(1)) == r1.tokens
    assert r1.prompt_tps > 0 and r1.decode_tps > 0 and r1.decode_tokens == len(r1.tokens) - 1


def test_seeded_sampling_is_reproducible(tiny_dir):
    p = tiny(tiny_dir, "Q4_0")
    m = Model.load(p, n_ctx=64)
    kw = dict(max_tokens=10, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, stop_at_eog=False)
    a = m.generate("hello world", seed=1, **kw).tokens
    b = m.generate("hello world", seed=1, **kw).tokens
    assert a == b and len(a) == 10


def test_stream_yields_text(tiny_dir):
    p = tiny(tiny_dir, "F16")
    m = Model.load(p, n_ctx=64)
    it = m.generate("hello", max_tokens=8, temperature=0, stream=True, stop_at_eog=False)
    pieces = list(it)
    assert "".join(pieces) == it.result.text
    assert it.result.text == m.generate("hello", max_tokens=8, temperature=0, stop_at_eog=False).text


def test_chat_messages_prompt(tiny_dir):
    p = tiny(tiny_dir, "F16")
    m = Model.load(p, n_ctx=64)
    r = m.generate([{"role": "user", "content": "hello"}], max_tokens=4, temperature=0)
    ids = r.prompt_ids
    im_start = m.tokenizer.token_to_id["<|im_start|>"]
    assert ids[0] == im_start and ids.count(im_start) == 2   # ChatML, special tokens parsed


def test_stops_at_eog(tiny_dir):
    p = tiny(tiny_dir, "F16")
    m = Model.load(p, n_ctx=64)
    first = int(m.logits(PROMPT[:5])[-1].argmax())
    m2 = Model.load(p, n_ctx=64)
    m2._tokenizer.eog_ids = frozenset({first})     # make the greedy first token an EOG
    r = m2.generate(PROMPT[:5], max_tokens=10, temperature=0)
    assert r.tokens == [] and r.stop_reason == "eog" and r.stop_token == first


# ------------------------------------------------------------------------------------------------
# errors

def test_exceeding_n_ctx_raises(tiny_dir):
    p = tiny(tiny_dir, "Q4_0")
    m = Model.load(p, n_ctx=8)
    with pytest.raises(ValueError, match="n_ctx"):
        m.logits(PROMPT[:9])
    m.reset()
    m.eval(PROMPT[:6])
    with pytest.raises(ValueError, match="context overflow"):
        m.eval(PROMPT[:3])
    assert m.n_past == 6                         # the failed call left the cache untouched
    r = m.generate(PROMPT[:4], max_tokens=20, temperature=0, stop_at_eog=False)
    assert r.stop_reason == "context" and len(r.tokens) == 8 - 4 + 1
    with pytest.raises(ValueError, match="n_ctx"):
        m.generate(PROMPT[:9], max_tokens=2)


def test_unknown_architecture_refused(tiny_dir):
    p = os.path.join(tiny_dir, "mamba.gguf")
    write_tiny_gguf(p, arch="mamba")
    with pytest.raises(ValueError, match="mamba"):
        Model.load(p)


BLOCK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


def test_dequant_rows_kernel_is_the_reference_bit_for_bit():
    """cf_dequant_rows_f32 (Model.embed's GET_ROWS) on random bytes of every block type (inf and NaN
    scales included), on every native ISA: the rows cpufuse.quant.types.dequantize gives, bit for
    bit (a NaN where it has a NaN); an id outside the table is refused, nothing read"""
    from cpufuse import _backend, _registry
    from cpufuse.quant.types import dequantize, resolve_qtype
    table = _registry.table("dequant_rows")
    if not table:
        pytest.skip("no native extension")
    ffi, rng = _backend.ffi, np.random.default_rng(5)
    for isa, fn in table.items():
        for name in BLOCK_TYPES:
            t = resolve_qtype(name)
            K = 512
            rb = K // t.block_size * t.type_size
            raw = rng.integers(0, 256, (40, rb), dtype=np.uint8)
            ids = np.array([3, 0, 39, 17, 3], np.int64)
            out = np.full((len(ids), K), -7.0, np.float32)

            def call(ids):
                return fn(t.type_id, K, ffi.from_buffer("uint8_t[]", raw), len(raw), rb,
                          ffi.from_buffer("int64_t[]", ids), len(ids), ffi.from_buffer("float[]", out))
            assert call(ids) == 0
            with np.errstate(all="ignore"):
                ref = dequantize(raw[ids], name, K)
            nan = np.isnan(ref)
            assert np.isfinite(ref).sum() > K, (isa, name)      # mostly real numbers
            assert np.array_equal(np.isnan(out), nan), (isa, name)
            assert np.array_equal(out.view(np.uint32)[~nan], ref.view(np.uint32)[~nan]), (isa, name)
            out[:] = -7.0
            assert call(np.array([1, 40], np.int64)) == -2 and call(np.array([-1], np.int64)) == -2
            assert (out == -7.0).all()
        assert fn(1, 64, ffi.NULL, 1, 128, ffi.NULL, 0, ffi.NULL) == -1   # F16: the numpy path's


@pytest.mark.parametrize("embd", ["Q8_0", "Q4_K", "F16"])
def test_embed_is_the_dequantized_rows(tmp_path, embd):
    """Model.embed: the token_embd rows, dequantized (C for block types, numpy for float ones), into
    out= or a new array; an id outside the table raises IndexError"""
    from cpufuse.quant.types import dequantize
    kw = {"dims": kquant_dims()} if embd == "Q4_K" else {}
    m = Model.load(write_tiny_gguf(tmp_path / "e.gguf", qtype="Q8_0", embd_qtype=embd, **kw), n_ctx=32)
    te = m.tok_embd
    ids = [5, 0, m.n_vocab - 1, 5, 200]
    ref = dequantize(te.raw[ids], te.qtype, te.n_in)
    got = m.embed(ids)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    out = np.empty((len(ids), te.n_in), np.float32)
    assert m.embed(np.array(ids), out) is out and np.array_equal(out, ref)
    strided = np.empty((len(ids), 2 * te.n_in), np.float32)[:, ::2]     # out= that is not contiguous
    assert m.embed(ids, strided) is strided and np.array_equal(strided, ref)
    assert m.embed([]).shape == (0, te.n_in)
    if embd != "F16":
        for bad in ([m.n_vocab], [-1]):
            with pytest.raises(IndexError):
                m.embed(bad)


def test_bad_tokens_and_args(tiny_dir):
    p = tiny(tiny_dir, "F16")
    with pytest.raises(ValueError, match="kv_dtype"):
        Model.load(p, kv_dtype="q8")
    m = Model.load(p, n_ctx=16)
    with pytest.raises(ValueError, match="out of range"):
        m.eval([10 ** 6])
    with pytest.raises(TypeError):
        m.generate(3.5)


# ------------------------------------------------------------------------------------------------
# sampling

def test_sampler_stages():
    lg = np.array([1.0, 3.0, 2.0, 3.0, -1.0, 0.5], np.float32)
    v, i = top_k(lg, 3)
    assert list(i) == [1, 3, 2] and list(v) == [3.0, 3.0, 2.0]
    v, i = top_k(lg, 0)
    assert list(i) == [1, 3, 2, 0, 5, 4]
    pv, pi = top_p(v, i, 0.5)                        # p(3)+p(3) = 0.63 >= 0.5 -> two kept
    assert list(pi) == [1, 3]
    mv, mi = min_p(v, i, 0.3)                        # keep l >= 3 + ln 0.3 = 1.80
    assert list(mi) == [1, 3, 2]
    pen = apply_penalties(lg, [1, 4, 4], repeat=2.0)
    assert pen[1] == 1.5 and pen[4] == -2.0 and pen[0] == 1.0
    assert Sampler(temperature=0).sample(lg) == 1    # first maximum
    s = Sampler(temperature=0, repeat_penalty=2.0)
    s.accept_prompt([1])
    assert s.sample(lg) == 3
    # distribution check: top_k=2, temperature 1 -> tokens 1 and 3 equally likely, nothing else
    s = Sampler(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=0)
    draws = [s.sample(lg) for _ in range(400)]
    assert set(draws) == {1, 3} and 120 < draws.count(1) < 280


# ------------------------------------------------------------------------------------------------
# CLI

def test_cli_generate_on_tiny_model(tiny_dir):
    p = tiny(tiny_dir, "Q4_0")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "cpufuse", "generate", "-m", p, "-p", "hello world", "-n", "6",
                        "--temp", "0", "-t", "1", "--ctx", "64"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "prompt" in r.stderr and "tokens/s" in r.stderr
    rc = subprocess.run([sys.executable, "-m", "cpufuse", "generate", "-m", p, "--chat", "-p", "hi", "-n", "3",
                         "--seed", "3"], capture_output=True, text=True, env=env, timeout=120)
    assert rc.returncode == 0, rc.stderr


def test_cli_with_an_unknown_model(capsys):
    from cpufuse.llama import cli
    assert cli.main(["no-such-model", "-p", "hi"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "smollm2-135m" in err
    assert cli.main(["-m", "missing/file.gguf", "-p", "hi"]) == 1
    assert "model file not found: missing/file.gguf" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# the decoder graph (cpufuse.llama.decoder) against the op-by-op forward it replaced

VARIANTS = [dict(qtype="Q4_0"), dict(qtype="Q8_0", tied=False, fused_qkv=True), dict(qtype="Q4_K"),
            dict(qtype="F16", arch="qwen2"), dict(qtype="F16", arch="qwen3")]


def _opbyop_run(m, chunks, steps, all_logits=False):
    """the reference: prompt chunks, then one-token steps, through cpufuse/reference/opbyop.py"""
    from cpufuse.reference.opbyop import forward
    kc, vc = np.zeros_like(m.k_cache), np.zeros_like(m.v_cache)
    pos, out = 0, []
    for c in chunks:
        out.append(forward(m, c, pos, kc, vc, all_logits=all_logits))
        pos += len(c)
    out += [forward(m, [t], pos + i, kc, vc) for i, t in enumerate(steps)]
    return out, kc, vc


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("act,kv,repack", [(None, "f16", True), (None, "f16", False), ("f32", "f32", True)])
def test_decoder_equals_opbyop(tiny_dir, variant, act, kv, repack):
    """prompt micro-batches (logits_all and last-token) and decode steps: logits and KV cache bit
    for bit equal to the op-by-op forward; every micro-batch and step is one C call"""
    p = tiny(tiny_dir, **variant)
    m = Model.load(p, n_ctx=64, act=act, kv_dtype=kv, n_batch=7, repack=repack)
    lg = m.logits(PROMPT[:13])                        # micro-batches of 7 and 6, every row
    steps = [m.eval([t]).copy() for t in PROMPT[13:]]
    ref, kc, vc = _opbyop_run(m, [PROMPT[:7], PROMPT[7:13]], PROMPT[13:], all_logits=True)
    assert np.array_equal(lg, np.concatenate(ref[:2]))
    assert all(np.array_equal(a, b[0]) for a, b in zip(steps, ref[2:]))
    assert np.array_equal(m.k_cache, kc) and np.array_equal(m.v_cache, vc)
    m.reset()
    last = m.eval(PROMPT[:10])                        # last token only: a gather of one row
    ref2, _, _ = _opbyop_run(m, [PROMPT[:7], PROMPT[7:10]], [])
    assert np.array_equal(last, ref2[1][0])
    for n in (1, 7):
        d = m.plan(n).plan.describe()
        assert "the whole plan is ONE C call" in d, d


def test_decoder_fusions(tiny_dir):
    m = Model.load(tiny(tiny_dir, "Q4_0"), n_ctx=64)
    notes = [st.note for st in m.plan(1).plan.steps if len(st.nodes) > 1]
    per_layer = ["RMS_NORM -> MUL -> QMATMUL x3 (shared activation)",
                 "QMATMUL -> ADD (the residual in the epilogue)",
                 "RMS_NORM -> MUL -> QMATMUL x2 -> SILU -> MUL (matmul_swiglu)",
                 "QMATMUL -> ADD (the residual in the epilogue)"]
    assert notes == per_layer * m.hparams.n_layer + ["RMS_NORM -> MUL -> QMATMUL"]


@pytest.mark.parametrize("how", ["arg", "env"])
def test_fusion_off_reaches_prompts(tiny_dir, how, monkeypatch):
    """fusion=False (or CPUFUSE_DISABLE_FUSION=1) plans keep every op apart, prompts included, and
    give the fused plans' numbers"""
    p = tiny(tiny_dir, "Q4_K")
    ref = Model.load(p, n_ctx=64).logits(PROMPT)
    if how == "env":
        monkeypatch.setenv("CPUFUSE_DISABLE_FUSION", "1")
        m = Model.load(p, n_ctx=64)
    else:
        m = Model.load(p, n_ctx=64, fusion=False)
    got = m.logits(PROMPT)
    for n in (1, len(PROMPT)):
        assert all(len(st.nodes) == 1 for st in m.plan(n, all_logits=True).plan.steps)
    assert np.array_equal(got, ref)


def test_decoder_long_context(tiny_dir):
    """decode past 600 cells (split-KV, as every decode step from 128 cells) after a prompt of 600: bit for bit"""
    p = tiny(tiny_dir, "Q4_0")
    toks = np.random.default_rng(0).integers(0, 280, 700).tolist()
    m = Model.load(p, n_ctx=701, n_batch=600)
    m.eval(toks[:600])
    lg = [m.eval([t]).copy() for t in toks[600:640]]
    ref, kc, vc = _opbyop_run(m, [toks[:600]], toks[600:640])
    assert all(np.array_equal(a, b[0]) for a, b in zip(lg, ref[1:]))
    assert np.array_equal(m.k_cache, kc) and np.array_equal(m.v_cache, vc)


def test_generation_cache_reuse_and_numba(tiny_dir):
    """greedy generation with prefix reuse equals generation from scratch; the numba ISA (no C
    executor: the plans run Python steps) generates the same tokens as the op-by-op reference"""
    p = tiny(tiny_dir, "Q4_0")
    m = Model.load(p, n_ctx=64)
    r1 = m.generate(PROMPT[:6], max_tokens=12, temperature=0, stop_at_eog=False)
    r2 = m.generate(PROMPT[:3] + [40, 41], max_tokens=10, temperature=0, stop_at_eog=False)
    assert r2.prompt_eval_tokens == 2
    m2 = Model.load(p, n_ctx=64)
    assert m2.generate(PROMPT[:3] + [40, 41], max_tokens=10, temperature=0, stop_at_eog=False,
                       reuse_cache=False).tokens == r2.tokens
    mn = Model.load(p, n_ctx=64, isa="numba")
    lg = mn.logits(PROMPT[:9])
    ref, _, _ = _opbyop_run(mn, [PROMPT[:9]], [], all_logits=True)
    assert np.array_equal(lg, ref[0])
    assert mn.generate(PROMPT[:6], max_tokens=5, temperature=0, stop_at_eog=False).tokens == \
        Model.load(p, n_ctx=64, isa="numba", repack=False).generate(PROMPT[:6], max_tokens=5, temperature=0,
                                                                     stop_at_eog=False).tokens


def test_kv_slots(tiny_dir):
    """n_seq slots: the cache holds n_seq * n_ctx cells; slot 0 serves generate()"""
    m = Model.load(tiny(tiny_dir, "Q4_0"), n_ctx=32, n_seq=3)
    assert m.k_cache.shape[1] == 96 and m.n_seq == 3
    a = m.logits(PROMPT[:5])
    assert np.array_equal(a, Model.load(tiny(tiny_dir, "Q4_0"), n_ctx=32).logits(PROMPT[:5]))
    with pytest.raises(ValueError, match="n_seq"):
        Model.load(tiny(tiny_dir, "Q4_0"), n_ctx=32, n_seq=0)
