"""Mixtures of experts (qwen3moe, qwen2moe, olmoe, granitemoe) on tiny synthetic GGUFs written from
their architecture modules, against the float64 reference forward (cpufuse/reference/archs.py with
reference/moe_ffn.py): every gating variant, routing that changes between tokens, bit-identity
across thread counts and batch compositions, and memory (mapped or per-expert repacked weights).
tests/test_archs.py also runs each MoE architecture through its generic prompt/incremental tests."""
import numpy as np
import pytest

pytest.importorskip("gguf")

from cpufuse.graph import Graph  # noqa: E402
from cpufuse.graph.moe import normw  # noqa: E402
from cpufuse.llama import Model  # noqa: E402
from cpufuse.llama.decoder import Batch  # noqa: E402
from cpufuse.llama.tiny import write_tiny_gguf  # noqa: E402
from cpufuse.reference import moe_ffn as _ref_moe  # noqa: E402
from cpufuse.reference.archs import ref_logits  # noqa: E402

TOKENS = [5, 17, 280, 42, 99, 7, 256, 3, 128, 64, 11, 200, 90, 31]
MOE_ARCHS = ("qwen3moe", "qwen2moe", "olmoe", "granitemoe")

# (arch, arch_keys, options): every gating variant llama.cpp's build_moe_ffn has for these files
VARIANTS = [
    ("qwen3moe", None, None),                                            # softmax, norm_w
    ("qwen3moe", {"expert_gating_func": 2}, None),                       # sigmoid, norm_w
    ("qwen3moe", {"expert_gating_func": 2, "expert_weights_norm": False}, None),   # sigmoid, raw weights
    ("qwen3moe", {"expert_gating_func": 3}, None),                       # softmax over the top-k logits
    ("qwen3moe", {"expert_weights_scale": 2.5}, None),                   # norm_w then scale
    ("qwen3moe", {"expert_weights_norm": False, "expert_weights_scale": 0.75}, None),   # scale only
    ("qwen3moe", None, {"moe_bias": True}),                              # router bias + selection bias
    ("qwen3moe", {"expert_gating_func": 2}, {"moe_bias": True}),         # DeepSeek-V3-like selection
    ("qwen2moe", None, None),                                            # shared expert x sigmoid gate
    ("olmoe", None, None),                                               # full-width Q/K norms, no norm_w
    ("granitemoe", None, None),                                          # norm_w, ungated shared expert
    ("granitemoe", None, {"shexp": False}),                              # no shared expert
]


def _tiny(tmp_path, arch, arch_keys=None, options=None, qtype="F32", **kw):
    tag = f"{arch}-{sorted((arch_keys or {}).items())}-{sorted((options or {}).items())}-{qtype}"
    name = "".join(c if c.isalnum() else "_" for c in tag)
    return write_tiny_gguf(tmp_path / f"{name}.gguf", qtype=qtype, arch=arch, embd_qtype="F32" if qtype == "F32"
                           else "F16", arch_keys=arch_keys, options=options, **kw)


def _close(got, ref, tol):
    got = np.asarray(got, np.float64)
    err = np.max(np.abs(got - ref)) / max(1.0, np.max(np.abs(ref)))
    assert err < tol, f"max error {err:.3g} (relative to the largest logit) >= {tol}"


def _routes(monkeypatch, path, tokens=TOKENS):
    """the reference's logits and, per layer, its expert ids (n, k) and the margin between the k-th
    and (k+1)-th selection scores of each row (the tests need routing without near-ties)"""
    seen = []
    real = _ref_moe.routing

    def spy(f, b, h):
        ids, w, sel = real(f, b, h)
        s = np.sort(sel, axis=-1)[:, ::-1]
        k = ids.shape[1]
        seen.append((ids, s[:, k - 1] - s[:, k] if k < s.shape[1] else np.full(len(s), np.inf)))
        return ids, w, sel
    monkeypatch.setattr(_ref_moe, "routing", spy)
    ref = ref_logits(path, tokens, n_ctx=64)
    monkeypatch.setattr(_ref_moe, "routing", real)
    return ref, seen


@pytest.mark.parametrize("arch,keys,options", VARIANTS)
def test_moe_gating_variants_match_reference(tmp_path, monkeypatch, arch, keys, options):
    """exact f32 mode: a prompt batch and then decode steps, against the float64 forward; the routing
    differs between tokens and has no near-ties"""
    p = _tiny(tmp_path, arch, keys, options)
    ref, seen = _routes(monkeypatch, p)
    for ids, margin in seen:
        assert len({tuple(sorted(r)) for r in ids.tolist()}) >= 3, "routing should change between tokens"
        assert margin.min() > 1e-5, f"a near-tie in the top-k ({margin.min():.3g}): pick another seed"
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32", n_batch=6, n_threads=2)
    assert m.hparams.n_expert and m.hparams.arch == arch
    _close(m.logits(TOKENS), ref, 2e-5)
    m.reset()
    got = [m.eval(TOKENS[:6])] + [m.eval([t]) for t in TOKENS[6:]]
    _close(np.stack(got), ref[5:], 2e-5)


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_moe_quantized_experts_match_reference(tmp_path, monkeypatch, arch, qtype):
    """quantized 3-D experts (repacked per expert into P16 panels) in the exact f32 activation mode,
    against the float64 forward of the dequantized file (q8 activations move the router's scores by
    more than these tiny models' top-k margins, so that mode is checked by the bit-identity test and
    tests/test_graph_moe.py's routed-matmul references)"""
    p = _tiny(tmp_path, arch, qtype=qtype)
    ref, seen = _routes(monkeypatch, p)
    assert min(mg.min() for _, mg in seen) > 1e-5
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32", n_threads=2)
    _close(m.logits(TOKENS), ref, 2e-5)


@pytest.mark.parametrize("arch,qtype", [(a, "Q4_0") for a in MOE_ARCHS] + [("qwen3moe", "Q4_K")])
def test_moe_bit_identical_threads_and_batches(tmp_path, arch, qtype):
    """the same bits for 1, 2 and 3 threads, with and without repacking, and for a sequence alone
    or beside others in one multi-slot Batch (its rows grouped with theirs by expert)"""
    kq = {"n_embd": 256, "n_ff": 256, "n_head": 8, "n_ff_exp": 256, "n_expert": 8, "n_expert_used": 3}
    p = _tiny(tmp_path, arch, qtype=qtype, dims=kq if qtype == "Q4_K" else None)
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


@pytest.mark.parametrize("isa", [None, "numba"])
def test_normw_op_matches_its_definition(isa):
    rng = np.random.default_rng(3)
    x = rng.random((7, 5)).astype(np.float32)
    x[2] = 1e-6   # the floor applies
    x[4, 1] = np.nan
    want = normw(x, 6.103515625e-5, 2.5)
    for floor, scale in ((6.103515625e-5, 2.5), (0.0, 0.5), (1e-3, 0.0)):
        g = Graph()
        a = g.input("a", x.shape)
        g.output(g.normw(a, floor, scale, name="y"))
        (got,) = g.compile(isa=isa).run(copy=True, a=x)
        assert np.array_equal(np.asarray(got), normw(x, floor, scale), equal_nan=True)
    assert np.isnan(want[4]).all() and np.isfinite(np.delete(want, 4, 0)).all()
    x = np.delete(x, 4, 0)
    want = normw(x, 6.103515625e-5, 2.5)
    s = x.astype(np.float64).sum(1, keepdims=True)
    np.testing.assert_allclose(want, x / np.maximum(s, 6.103515625e-5) * 2.5, rtol=1e-6)
    with pytest.raises(Exception, match="floor"):
        Graph().normw(Graph().input("a", (2, 3)), -1.0)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_moe_numba_isa_matches_reference(tmp_path, monkeypatch, arch):
    """the Python/Numba steps of every MoE op (no C kernels) against the float64 forward"""
    p = _tiny(tmp_path, arch, {"expert_weights_scale": 1.5} if arch == "qwen3moe" else None)
    ref, _ = _routes(monkeypatch, p, TOKENS[:6])
    m = Model.load(p, n_ctx=64, act="f32", kv_dtype="f32", isa="numba", n_threads=2)
    _close(m.logits(TOKENS[:6]), ref, 2e-5)


def test_moe_weights_stay_mapped_or_repack_per_expert(tmp_path):
    p = _tiny(tmp_path, "qwen3moe", qtype="Q4_0")
    m = Model.load(p, n_ctx=64, repack=False)
    L = m.layers[0]
    assert L.wg_exps.shape == (4, 32, 64) and L.wd_exps.shape == (4, 64, 32)
    assert not m.repacked and L.wg_exps.layout == "gguf"
    for t in (L.wg_exps, L.wu_exps, L.wd_exps, L.router):
        assert _mapped(t.raw), "expert weights stay in the memory-mapped file"
    r = Model.load(p, n_ctx=64, repack=True)
    wg = r.layers[0].wg_exps
    if wg.layout == "p16":
        for e in range(wg.n_expert):
            assert np.array_equal(wg[e].gguf_bytes(), L.wg_exps[e].raw)


def _mapped(a):
    import mmap
    while isinstance(a, np.ndarray):
        a = a.base
    return isinstance(a, memoryview) and isinstance(a.obj, mmap.mmap)


def test_moe_bad_keys_are_refused(tmp_path):
    p = _tiny(tmp_path, "qwen3moe", {"expert_used_count": 9})
    with pytest.raises(ValueError, match="expert_used_count"):
        Model.load(p, n_ctx=64)
    p = _tiny(tmp_path, "qwen3moe", {"expert_gating_func": 7})
    with pytest.raises(ValueError, match="expert_gating_func"):
        Model.load(p, n_ctx=64)


def test_moe_experts_stay_mapped_when_memory_is_short(tmp_path, monkeypatch):
    """repack=True on a machine whose available memory cannot hold the repacked model: the stacked
    experts stay mapped from the file (the rest is repacked), with the same logits bit for bit"""
    import cpufuse.llama.loader as loader
    p = _tiny(tmp_path, "olmoe", qtype="Q4_0")
    full = Model.load(p, n_ctx=64, n_threads=2)
    assert not full.experts_mapped
    monkeypatch.setattr(loader, "mem_available", lambda: loader.MEM_MARGIN + 1000)
    m = Model.load(p, n_ctx=64, n_threads=2)
    L = m.layers[0]
    assert m.experts_mapped and _mapped(L.wg_exps.raw) and _mapped(L.wd_exps.raw)
    if full.layers[0].wq.layout == "p16":
        assert L.wq.layout == "p16" and full.layers[0].wg_exps.layout == "p16"
    assert np.array_equal(m.logits(TOKENS), full.logits(TOKENS))


def test_moe_key_defaults_as_llama_cpp(tmp_path):
    """an absent expert_feed_forward_length is n_ff / expert_used_count (olmoe: n_ff); qwen2moe's
    absent shared length is n_ff; granitemoe's 0 means no shared expert"""
    d = {"n_ff": 64, "n_ff_exp": 32}   # 64 / k=2
    p = _tiny(tmp_path, "qwen3moe", {"expert_feed_forward_length": None}, dims=d)
    assert Model.load(p, n_ctx=32).hparams.n_ff_exp == 32
    p = _tiny(tmp_path, "olmoe", {"expert_feed_forward_length": None}, dims={"n_ff": 32, "n_ff_exp": 32})
    assert Model.load(p, n_ctx=32).hparams.n_ff_exp == 32
    p = _tiny(tmp_path, "qwen2moe", {"expert_shared_feed_forward_length": None}, dims={"n_ff": 64, "n_ff_shexp": 64})
    assert Model.load(p, n_ctx=32).hparams.n_ff_shexp == 64
    p = _tiny(tmp_path, "granitemoe", {"expert_shared_feed_forward_length": 0}, options={"shexp": False})
    m = Model.load(p, n_ctx=32)
    assert m.hparams.n_ff_shexp == 0 and m.layers[0].wg_shexp is None
