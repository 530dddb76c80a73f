"""The architecture registry (cpufuse/llama/arch/): the one declaration the loader, the decoder, the
tiny-model writer, the command line and the docs' list read; every architecture's tiny file
carries the tensors and keys it declares and loads."""
import os
import re

import numpy as np
import pytest

pytest.importorskip("gguf")

from cpufuse.llama import Model  # noqa: E402
from cpufuse.llama.arch import REGISTRY, SUPPORTED  # noqa: E402
from cpufuse.llama.arch.spec import Dims  # noqa: E402
from cpufuse.llama.tiny import ARCHS, tensor_plan, model_dims, write_tiny_gguf  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _docs_table():
    text = open(os.path.join(ROOT, "docs", "architectures.md"), encoding="utf-8").read()
    return re.findall(r"^\| `([a-z0-9_-]+)` \|", text, re.M)


def test_docs_list_is_the_registry():
    assert _docs_table() == list(SUPPORTED)


def _lists(text):
    """every run of three or more registered names separated by commas or "and" in text"""
    name = "`?(?:" + "|".join(map(re.escape, sorted(SUPPORTED, key=len, reverse=True))) + r")\b`?"
    run = re.compile(rf"\b{name}(?:(?:,\s+(?:and\s+)?|\s+and\s+){name}){{2,}}")
    return [re.findall(r"[a-z0-9_-]+", m.group(0).replace("and", " ")) for m in run.finditer(text)]


@pytest.mark.parametrize("doc", ["README.md", "docs/kernels.md"])
def test_other_docs_list_all_or_none(doc):
    """a list of architectures elsewhere in the docs names every registered one, in order"""
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    for names in _lists(text):
        assert names == list(SUPPORTED), f"{doc} lists {names}, the registry has {list(SUPPORTED)}"


def test_lists_are_generated_from_the_registry():
    from cpufuse.llama.cli import build_parser
    from cpufuse.llama.hparams import SUPPORTED_ARCHS
    from cpufuse.llama.decoder import ARCHS as DECODERS
    assert SUPPORTED_ARCHS == SUPPORTED == ARCHS == tuple(DECODERS)
    assert ", ".join(SUPPORTED) in build_parser().description
    assert all(REGISTRY[a].name == a and REGISTRY[a].rope in ("norm", "neox") for a in SUPPORTED)
    assert [REGISTRY[a].rank for a in SUPPORTED] == sorted(REGISTRY[a].rank for a in SUPPORTED)


def test_unknown_architecture_is_refused_naming_the_supported(tmp_path):
    p = write_tiny_gguf(tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(ValueError, match=r"'mamba' is not supported by cpufuse.llama \(supported: "
                       + re.escape(", ".join(SUPPORTED))):
        Model.load(p, n_ctx=32)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_stacked_weights_any_rank(tmp_path, qtype):
    """a declared shape is a tuple of any rank (experts first): the tiny writer writes it stacked,
    expert e the contiguous rows e*n_out.. of one tensor"""
    import gguf
    from cpufuse.llama import tiny
    from cpufuse.llama.arch.spec import T
    t = T("blk.0.ffn_gate_exps.weight", (4, 96, 64), "wg_exps")
    assert t.fields == ("wg_exps",)
    w = gguf.GGUFWriter(str(tmp_path / "e.gguf"), "llama")
    tiny._add_weight(w, np.random.default_rng(0), t.name, 4 * 96, 64, qtype, 0.1, lead=t.shape[:-2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (r,) = gguf.GGUFReader(str(tmp_path / "e.gguf")).tensors
    assert tuple(int(x) for x in r.shape) == (64, 96, 4)     # ne: n_in, rows, experts


@pytest.mark.parametrize("arch", SUPPORTED)
def test_tiny_file_has_the_declared_tensors(tmp_path, arch):
    """the tiny file's tensors are the declared ones (tiny.py writes from the declaration), and the
    loader fills every field the written tensors declare"""
    p = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch, qtype="Q8_0")
    import gguf
    names = {t.name for t in gguf.GGUFReader(p).tensors}
    d = model_dims(arch)
    plan = tensor_plan(arch, d, 300)
    assert {n for n, *_ in plan} == names
    m = Model.load(p, n_ctx=32)
    model, layer = REGISTRY[arch].tensors(Dims.of(m.hparams))
    for t in layer:
        if "blk.0." + t.name in names:
            for f in t.fields:
                v = getattr(m.layers[0], f)
                assert v is not None, (arch, t.name, f)
                rows = dict(t.split).get(f, t.shape[0])
                assert (v.shape[0] if hasattr(v, "shape") else len(v)) == rows
    out = m.logits([5, 17, 280])
    assert out.shape == (3, m.n_vocab) and np.all(np.isfinite(out))


def test_missing_and_refused_tensors_are_named(tmp_path):
    from cpufuse.llama.gguf_file import GGUFFile
    from cpufuse.llama.hparams import read_hparams
    from cpufuse.llama.loader import load_weights
    gf = GGUFFile(write_tiny_gguf(tmp_path / "b.gguf"))
    hp = read_hparams(gf)
    t = gf.tensors.pop("blk.1.ffn_down.weight")
    with pytest.raises(ValueError, match=r"GGUF is missing the tensor blk\.1\.ffn_down\.weight"):
        load_weights(gf, hp, 32)
    gf.tensors["blk.1.ffn_down.weight"] = t
    gf.tensors["blk.0.ffn_gate.bias"] = gf.tensors["output_norm.weight"]
    with pytest.raises(ValueError, match=r"tensor blk\.0\.ffn_gate\.bias: FFN gate/up biases are not supported"):
        load_weights(gf, hp, 32)
