"""Embeddings (cpufuse.llama.embedding): the hidden states after output_norm against the float64
reference forward on every architecture, each pooling, llama.cpp's normalizations, the file's
pooling_type, and Llama's embed / create_embedding shapes and errors."""
import numpy as np
import pytest

pytest.importorskip("gguf")

from cpufuse.llama import Llama, Model  # noqa: E402
from cpufuse.llama.decoder import ARCHS  # noqa: E402
from cpufuse.llama.embedding import embed_ids, normalize  # noqa: E402
from cpufuse.llama.tiny import write_tiny_gguf  # noqa: E402
from cpufuse.reference.archs import ref_logits  # noqa: E402

IDS = [5, 17, 280, 42, 99, 7, 256, 3, 128, 64, 11, 200, 90, 31]


def _rel(got, ref):
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / max(1.0, np.max(np.abs(ref))))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_hidden_states_match_float64_reference(tmp_path, arch):
    p = write_tiny_gguf(tmp_path / f"{arch}.gguf", qtype="F32", embd_qtype="F32", arch=arch)
    ref = ref_logits(p, IDS, n_ctx=64, hidden=True)
    # n_batch 5: three micro-batches (and gemma's rings of window + 5 cells)
    m = Model.load(p, n_ctx=64, n_batch=5, act="f32", kv_dtype="f32", n_threads=1)
    assert _rel(embed_ids(m, IDS, "none"), ref) < 2e-5
    assert _rel(embed_ids(m, IDS, "mean"), ref.mean(0)) < 2e-5
    assert _rel(embed_ids(m, IDS, "cls"), ref[0]) < 2e-5
    assert _rel(embed_ids(m, IDS, "last"), ref[-1]) < 2e-5
    v = embed_ids(m, IDS, "mean", norm=2)
    assert v.dtype == np.float32 and abs(np.linalg.norm(v.astype(np.float64)) - 1.0) < 1e-6
    assert m.n_past == len(IDS)
    # the default mode (q8 activations, f16 cache) on a quantized file: cosine >= 0.999
    q = write_tiny_gguf(tmp_path / f"{arch}-q8.gguf", qtype="Q8_0", arch=arch)
    ref = ref_logits(q, IDS, n_ctx=64, hidden=True).mean(0)
    got = embed_ids(Model.load(q, n_ctx=64, n_threads=1), IDS, "mean").astype(np.float64)
    assert got @ ref / np.linalg.norm(got) / np.linalg.norm(ref) >= 0.999


def test_independent_of_cache_state_and_threads(tmp_path):
    p = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q8_0")
    m = Model.load(p, n_ctx=64, n_threads=1)
    a = embed_ids(m, IDS, "none")
    m.generate(IDS[:4], max_tokens=5, temperature=0)
    m2 = Model.load(p, n_ctx=64, n_threads=2, n_batch=3)
    assert np.array_equal(embed_ids(m, IDS, "none"), a) and np.array_equal(embed_ids(m2, IDS, "none"), a)
    # the last position's hidden state gives the model's logits for it
    lg = m.logits(IDS)[-1]
    assert np.array_equal(embed_ids(m, IDS, "last"), a[-1]) and lg.shape == (m.n_vocab,)


def test_normalize_as_llama_cpp():
    v = np.array([[3.0, -4.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
    assert np.allclose(normalize(v, 2), [[0.6, -0.8, 0.0], [0, 0, 0]])
    assert np.allclose(normalize(v, 1), [[3 / 7, -4 / 7, 0.0], [0, 0, 0]])
    assert np.allclose(normalize(v, 0), [[3 * 32760 / 4, -32760, 0.0], [0, 0, 0]])
    assert np.allclose(normalize(v, 3), v / np.cbrt(27 + 64))
    assert normalize(v, -1) is v
    for bad in (-2, 1.5, True, "l2"):
        with pytest.raises(ValueError, match="normalize must be"):
            normalize(v, bad)


def test_pooling_from_the_file_and_errors(tmp_path):
    p = write_tiny_gguf(tmp_path / "last.gguf", qtype="Q8_0", extra=lambda w: w.add_uint32("llama.pooling_type", 3))
    m = Model.load(p, n_ctx=64, n_threads=1)
    assert m.hparams.pooling_type == 3
    assert np.array_equal(embed_ids(m, IDS), embed_ids(m, IDS, "none")[-1])
    bad = write_tiny_gguf(tmp_path / "bad.gguf", extra=lambda w: w.add_uint32("llama.pooling_type", 9))
    with pytest.raises(ValueError, match="pooling_type = 9"):
        Model.load(bad, n_ctx=64)
    with pytest.raises(ValueError, match="pooling must be one of"):
        embed_ids(m, IDS, "max")
    with pytest.raises(NotImplementedError, match="classification head"):
        embed_ids(m, IDS, "rank")
    with pytest.raises(ValueError, match="no tokens"):
        embed_ids(m, [], "mean")
    with pytest.raises(ValueError, match="out of range"):
        embed_ids(m, [10 ** 6], "mean")
    with pytest.raises(ValueError, match="context overflow"):
        embed_ids(m, [1] * 65, "mean")


def test_llama_embed_and_create_embedding(tmp_path):
    p = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q8_0")
    llm = Llama(p, n_ctx=64, n_batch=8, embedding=True, pooling_type=1, verbose=False)
    assert llm.pooling_type() == 1
    ids = llm.tokenize(b"hello world")
    want = embed_ids(llm.model, ids, "mean").tolist()
    assert llm.embed("hello world") == want
    got = llm.embed(["hello world", "the cat"], normalize=True)
    assert len(got) == 2 and got[0] == normalize(np.array(want, np.float32), 2).tolist()
    r = llm.create_embedding("hello world")
    assert r["object"] == "list" and r["data"] == [{"object": "embedding", "embedding": want, "index": 0}]
    assert r["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids)} and r["model"] == p
    assert [d["index"] for d in llm.create_embedding(["a", "b", "c"])["data"]] == [0, 1, 2]
    long = "hello world " * 20                      # more than n_batch = 8 tokens
    assert llm.embed(long) == embed_ids(llm.model, llm.tokenize(long.encode())[:8], "mean").tolist()
    with pytest.raises(ValueError, match="exceed batch size of 8"):
        llm.embed(long, truncate=False)
    with pytest.raises(TypeError, match="input must be a str"):
        llm.embed(5)
    with pytest.raises(TypeError, match="input must be a str"):
        llm.embed([])
    tok = Llama(p, n_ctx=64, embedding=True, verbose=False)       # no pooling_type in the file: none
    per_token = tok.embed("hello world")
    assert tok.pooling_type() == 0 and len(per_token) == len(ids) and len(per_token[0]) == 64
    with pytest.raises(RuntimeError, match="embedding=True"):
        Llama(p, n_ctx=64, verbose=False).embed("x")
    with pytest.raises(ValueError, match="pooling must be one of"):
        Llama(p, n_ctx=64, embedding=True, pooling_type=7, verbose=False)
