"""cpufuse.llama.Model on tiny GGUF models whose 2-D weights are Q2_K, Q3_K, IQ4_NL or IQ4_XS (the
types of issue 29) or MXFP4 (gpt-oss's experts' type, here on a dense model): logits against the float64 reference forward of tests/test_llama_model.py, and
the decoder plan equal to the op-by-op forward bit for bit, repacked or not."""
import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from _tiny_gguf import kquant_dims, write_tiny_gguf  # noqa: E402
from test_llama_model import PROMPT, _opbyop_run, ref_logits  # noqa: E402

from cpufuse.llama.gguf_file import GGUFFile  # noqa: E402
from cpufuse.llama.model import Model  # noqa: E402
from cpufuse.reference import nmse  # noqa: E402

TYPES = ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4")
_PATHS = {}


def _tiny(tmp_path_factory, qtype):
    if qtype not in _PATHS:
        d = tmp_path_factory.mktemp("tiny_newtypes")
        kw = {} if qtype in ("IQ4_NL", "MXFP4") else {"dims": kquant_dims()}
        _PATHS[qtype] = write_tiny_gguf(str(d / f"tiny_{qtype}.gguf"), qtype=qtype, **kw)
    return _PATHS[qtype]


@pytest.mark.parametrize("qtype", TYPES)
def test_logits_match_float64_reference(tmp_path_factory, qtype):
    p = _tiny(tmp_path_factory, qtype)
    types = [t.type_name for t in GGUFFile(p).tensors.values()]
    assert types.count(qtype) >= 7, types              # every 2-D weight but the embedding
    ref = ref_logits(p, PROMPT)
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32")
    got = m.logits(PROMPT)
    assert nmse(got, ref) < 1e-10, nmse(got, ref)
    m = Model.load(p, n_ctx=64)                      # q8 activations, f16 KV cache
    got = m.logits(PROMPT)
    e = nmse(got, ref)
    assert e < 3e-3, e
    assert np.mean(got.argmax(1) == ref.argmax(1)) >= 0.75


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("repack", [True, False])
def test_decoder_equals_opbyop(tmp_path_factory, qtype, repack):
    p = _tiny(tmp_path_factory, qtype)
    m = Model.load(p, n_ctx=64, kv_dtype="f16", n_batch=7, repack=repack)
    lg = m.logits(PROMPT[:13])
    steps = [m.eval([t]).copy() for t in PROMPT[13:]]
    ref, kc, vc = _opbyop_run(m, [PROMPT[:7], PROMPT[7:13]], PROMPT[13:], all_logits=True)
    assert np.array_equal(lg, np.concatenate(ref[:2]))
    assert all(np.array_equal(a, b[0]) for a, b in zip(steps, ref[2:]))
    assert np.array_equal(m.k_cache, kc) and np.array_equal(m.v_cache, vc)
