"""The model's quantized KV cache (issue 42 item 1): Model.load(type_k=, type_v=) with q8_0 / q4_0 cells
written by the graph's kv_write and read by attn_seqs. Logits against the float64 forward of
test_llama_model that stores K and V quantized (and Q as its Q8_0 values when K is); bit-identical
over thread counts and batch compositions; the Numba path; kv_bytes; state and context shift; bad
type names."""
import numpy as np
import pytest

import cpufuse

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from test_llama_model import PROMPT, nmse, ref_logits  # noqa: E402

from cpufuse.llama.decoder import Batch  # noqa: E402
from cpufuse.llama.model import Model  # noqa: E402
from cpufuse.llama.tiny import write_tiny_gguf  # noqa: E402
from cpufuse.ops import kvquant  # noqa: E402

DIMS = dict(n_embd=128, n_layer=2, n_head=4, n_head_kv=2, n_ff=96)   # head_dim 32: one block per head
PAIRS = [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f16", "q4_0")]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(write_tiny_gguf(tmp_path_factory.mktemp("kvt") / "m.gguf", qtype="F16", dims=DIMS))


def _rounder(tk, tv):
    def rnd(x, t):
        return kvquant.dequantize(kvquant.quantize(x.astype(np.float32), t), t, x.shape[-1]).astype(np.float64)

    def f(q, k, v):
        if tk in kvquant.QUANT:
            k, q = rnd(k, tk), rnd(q, "q8_0")
        if tv in kvquant.QUANT:
            v = rnd(v, tv)
        return q, k, v
    return f


@pytest.fixture(scope="module")
def path64(tmp_path_factory):   # head_dim 64: two blocks per head, GQA 2
    return str(write_tiny_gguf(tmp_path_factory.mktemp("kvt") / "m64.gguf", qtype="F16", arch="qwen2",
                               dims=dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=96)))


@pytest.mark.parametrize("tk,tv", PAIRS)
@pytest.mark.parametrize("which", ["path", "path64"])
def test_quantized_cache_logits_match_reference(request, which, tk, tv):
    path = request.getfixturevalue(which)
    m = Model.load(path, n_ctx=64, act="f32", type_k=tk, type_v=tv, n_threads=2)
    got = m.logits(PROMPT)
    want = ref_logits(path, PROMPT, kv_round=_rounder(tk, tv))
    plain = ref_logits(path, PROMPT)
    e, e0 = nmse(got, want), nmse(got, plain)
    assert e < 1e-6, (e, e0)            # the same rounding of the stored K/V: f32 error only
    if tk == "q4_0":
        assert e0 > 10 * e              # ... and the quantization is really there


@pytest.mark.filterwarnings("ignore:cpufuse. n_threads")
@pytest.mark.parametrize("tk,tv", PAIRS[:2])
def test_threads_and_batch_composition_bit_identical(path, tk, tv):
    runs = []
    for nt in (1, 2, 3):
        m = Model.load(path, n_ctx=32, n_seq=2, n_batch=8, type_k=tk, type_v=tv, n_threads=nt)
        a = m.eval(PROMPT[:6]).copy()
        runs.append(np.concatenate([a[None]] + [m.eval([t])[None].copy() for t in PROMPT[6:12]]))
    for r in runs[1:]:
        assert np.array_equal(runs[0].view(np.uint32), r.view(np.uint32))
    # the same sequence in slot 1 of a Batch beside another sequence in slot 0
    m = Model.load(path, n_ctx=32, n_seq=2, n_batch=8, type_k=tk, type_v=tv, n_threads=2)
    b = Batch(m)
    b.add(0, PROMPT[10:15], 0)
    b.add(1, PROMPT[:6], 0)
    rows = [b.run(m.decoder, (16, 2, 2), n_threads=2)[1].copy()]
    for i, t in enumerate(PROMPT[6:12]):
        b = Batch(m)
        b.add(0, [PROMPT[i]], 5 + i)
        b.add(1, [t], 6 + i)
        rows.append(b.run(m.decoder, (16, 2, 2), n_threads=2)[1].copy())
    assert np.array_equal(runs[0].view(np.uint32), np.stack(rows).view(np.uint32))


def test_numba_path_matches_reference(path):
    m = Model.load(path, n_ctx=64, act="f32", type_k="q8_0", type_v="q4_0", isa="numba", n_threads=1)
    got = m.logits(PROMPT)
    assert nmse(got, ref_logits(path, PROMPT, kv_round=_rounder("q8_0", "q4_0"))) < 1e-6


def test_kv_bytes_and_types(path):
    f16 = Model.load(path, n_ctx=64).kv_bytes
    assert Model.load(path, n_ctx=64, kv_dtype="q8_0").kv_bytes / f16 == 34 / 64
    assert Model.load(path, n_ctx=64, type_k="q4_0", type_v="q4_0").kv_bytes / f16 == 18 / 64
    m = Model.load(path, n_ctx=64, kv_dtype="f32", type_k="q8_0")
    assert (m.kv.type_k, m.kv.type_v) == ("q8_0", "f32")
    for kw, name in (({"type_k": "q5_0"}, "type_k"), ({"type_v": "Q8"}, "type_v"), ({"kv_dtype": "x"}, "kv_dtype")):
        with pytest.raises(ValueError, match=name):
            Model.load(path, n_ctx=8, **kw)
    odd = write_tiny_gguf(str(path) + ".odd.gguf", qtype="F16")   # head_dim 16
    with pytest.raises(ValueError, match="type_k.*multiple of 32"):
        Model.load(odd, n_ctx=8, type_k="q8_0")


def test_state_prefix_and_shift(path, tmp_path):
    m = Model.load(path, n_ctx=32, n_seq=2, type_k="q4_0", type_v="q8_0", n_threads=1)
    m.eval(PROMPT[:10])
    want = m.eval([PROMPT[10]]).copy()
    data = m.kv.read_slot(0, 11)
    assert len(data) == m.kv.slot_nbytes(11)
    m.kv.write_slot(1, 11, data)
    assert m.kv.read_slot(1, 11) == data
    m2 = Model.load(path, n_ctx=32, type_k="q4_0", type_v="q8_0", n_threads=1)
    m.save_kv(tmp_path / "s.kv")
    m2.load_kv(tmp_path / "s.kv")
    assert np.array_equal(m2.eval([PROMPT[11]]), m.eval([PROMPT[11]]))
    assert want.shape == (m.n_vocab,)
    # context shift of a quantized K: dequantized, re-rotated, quantized again
    n = m.shift_context(n_keep=2)
    assert n == 5 and m.n_past == 7
    out = m.eval([PROMPT[12]])
    assert np.all(np.isfinite(out))


@pytest.fixture(scope="module")
def path_g8(tmp_path_factory):   # 8 query heads on one KV head: a decode group of 8 rows (the GEMM path, slices)
    return str(write_tiny_gguf(tmp_path_factory.mktemp("kvt") / "g8.gguf", qtype="F16", n_ctx_train=1024,
                               dims=dict(n_embd=256, n_layer=2, n_head=8, n_head_kv=1, n_ff=96)))


@pytest.fixture(scope="module")
def path_swa(tmp_path_factory):   # gemma3: sliding-window layers whose cells are a ring of 4 a sequence (wrapping)
    return str(write_tiny_gguf(tmp_path_factory.mktemp("kvt") / "swa.gguf", qtype="F16", arch="gemma3",
                               n_ctx_train=1024, dims=dict(n_embd=128, n_head=4, n_head_kv=2)))


@pytest.mark.filterwarnings("ignore:cpufuse. n_threads")
@pytest.mark.parametrize("which", ["path", "path_g8", "path_swa"])
@pytest.mark.parametrize("tk", ["f16", "q8_0"])
@pytest.mark.parametrize("isa", [None, "avx2"])
def test_decode_batch_in_one_region_changes_no_bit(request, which, tk, isa):
    """from two threads a batch's one-token sequences run their attention in one parallel region
    (fa_batch_run): the rows sequences, beside them past two threads the split ones (from 128 cells),
    the slices of a large team's groups and the wrapped ranges of sliding-window rings. Each row's
    bits are its sequence's alone at one thread"""
    if isa and isa not in cpufuse.available_isas():
        pytest.skip(f"{isa}: this CPU or build lacks it")
    path = request.getfixturevalue(which)
    lens = (3, 68, 544, 136)    # cached tokens a sequence; 544 decodes by split-KV chunks; 68 divides 68, 544, 136:
    # their steps wrap a ring of 4 + 64 cells (path_swa)
    toks = [int(t) for t in np.random.default_rng(3).integers(10, 200, size=600)]
    cap = (64, 4, 4)

    def load(nt):
        m = Model.load(path, n_ctx=560, n_seq=4, n_batch=64, type_k=tk, type_v=tk, n_threads=nt, isa=isa)
        for slot, n in enumerate(lens):
            for i in range(0, n, 64):
                b = Batch(m)
                b.add(slot, toks[i:min(n, i + 64)], i)
                b.run(m.decoder, cap, n_threads=nt)
        return m

    got = {}
    for nt in (1, 2, 3, 5, 16):
        m = load(nt)
        steps = []
        for j in range(3):
            b = Batch(m)
            for slot, n in enumerate(lens):
                b.add(slot, [toks[n + j + slot]], n + j)
            steps.append(b.run(m.decoder, cap, n_threads=nt).copy())
        got[nt] = np.stack(steps)
    for nt in (2, 3, 5, 16):
        assert np.array_equal(got[1].view(np.uint32), got[nt].view(np.uint32)), nt
    m = load(1)     # each sequence alone
    for slot, n in enumerate(lens):
        for j in range(3):
            b = Batch(m)
            b.add(slot, [toks[n + j + slot]], n + j)
            assert np.array_equal(b.run(m.decoder, cap, n_threads=1)[0].view(np.uint32), got[1][j, slot].view(np.uint32))
