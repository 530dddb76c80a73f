"""olmo2 (cpufuse/llama/arch/olmo2.py) on tiny synthetic GGUFs against the float64 reference
forward (cpufuse/reference/archs.py): no pre-norms, Q/K RMSNorm over the full projection before
NEOX RoPE, post-norms on both branches. tests/test_archs.py runs the shared checks (one prompt
batch, micro-batches then decode steps, f16 KV) on it too."""
import numpy as np
import pytest

pytest.importorskip("gguf")

from cpufuse.llama import Model  # noqa: E402
from cpufuse.llama.decoder import Batch  # noqa: E402
from cpufuse.llama.tiny import write_tiny_gguf  # noqa: E402
from cpufuse.reference.archs import ref_logits  # noqa: E402

TOKENS = [5, 17, 280, 42, 99, 7, 256, 3, 128, 64, 11, 200, 90, 31]


def _tiny(tmp_path, name="olmo2", **kw):
    return write_tiny_gguf(tmp_path / f"{name}.gguf", arch="olmo2", qtype=kw.pop("qtype", "F32"),
                           embd_qtype=kw.pop("embd_qtype", "F32"), **kw)


def _err(got, ref):
    return np.max(np.abs(np.asarray(got, np.float64) - ref)) / max(1.0, np.max(np.abs(ref)))


def test_olmo2_tensors_and_graph(tmp_path):
    p = _tiny(tmp_path, qtype="Q8_0")
    m = Model.load(p, n_ctx=64)
    hp, L = m.hparams, m.layers[0]
    assert hp.rope_mode == "neox" and hp.n_rot == hp.head_dim
    assert L.attn_norm is None and L.ffn_norm is None          # no pre-norms
    assert L.q_norm.shape == (hp.n_head * hp.head_dim,) and L.k_norm.shape == (hp.n_head_kv * hp.head_dim,)
    d = m.plan(4).plan.describe()
    assert "attn_norm" not in d and "ffn_norm" not in d
    assert d.count("RMS_NORM -> MUL -> ADD") == 2 * hp.n_layer   # each post-norm with its residual add
    assert "ONE C call" in d


@pytest.mark.parametrize("dims", [None, {"n_embd": 64, "n_head": 4, "n_head_kv": 1, "head_dim": 24}])
def test_olmo2_matches_reference(tmp_path, dims):
    """exact mode, every position; also a head layout with H*D != n_embd and 4:1 GQA (the K norm
    over n_head_kv * head_dim values)"""
    p = _tiny(tmp_path, dims=dims)
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32", n_threads=2)
    assert _err(m.logits(TOKENS), ref_logits(p, TOKENS, n_ctx=64)) < 2e-5


def test_olmo2_q8_close_to_reference(tmp_path):
    p = _tiny(tmp_path, qtype="Q8_0", embd_qtype="Q8_0")
    got, ref = Model.load(p, n_ctx=64).logits(TOKENS), ref_logits(p, TOKENS)
    assert _err(got, ref) < 3e-2
    assert np.mean(np.argmax(got, 1) == np.argmax(ref, 1)) >= 0.85


def test_olmo2_threads_and_batch_composition(tmp_path):
    """bit-identical at 1 and 3 threads; a sequence's logits are the same alone and beside another"""
    p = _tiny(tmp_path, qtype="Q4_0")
    outs = [Model.load(p, n_ctx=64, n_batch=4, n_threads=t).logits(TOKENS) for t in (1, 3)]
    np.testing.assert_array_equal(outs[0], outs[1])
    m = Model.load(p, n_ctx=64, n_batch=8, n_seq=2)
    b = Batch(m)
    b.add(0, TOKENS[:6], 0)
    alone = np.array(b.run(m.decoder, (16, 2, 2)), copy=True)
    b = Batch(m)
    b.add(1, TOKENS[6:11], 0)
    b.add(0, TOKENS[:6], 0)
    both = b.run(m.decoder, (16, 2, 2))
    np.testing.assert_array_equal(both[1], alone[0])


def test_olmo2_sliding_window_is_refused(tmp_path):
    p = _tiny(tmp_path, arch_keys={"attention.sliding_window": 8})
    with pytest.raises(ValueError, match=r"olmo2\.attention\.sliding_window = 8: OLMo 3's sliding-window"):
        Model.load(p, n_ctx=64)
    p = _tiny(tmp_path, "zero", arch_keys={"attention.sliding_window": 0})
    assert Model.load(p, n_ctx=64).hparams.swa_window == 0
