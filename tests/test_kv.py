"""cpufuse.llama.kv: the KV cells' layout (slots, sliding-window rings), the batch inputs, prefix
copies and reuse, a slot's cells as bytes, and bad arguments; on KVCache alone and on tiny models."""
import numpy as np
import pytest

from cpufuse.llama import kv as _kv
from cpufuse.llama.kv import KVCache

TOKENS = [5, 17, 280, 42, 99, 7, 256, 3, 128, 64, 11, 200, 90, 31]


def _cache(**kw):
    """3 layers of 2 x 4, the first two sliding-window ones (window 4); n_batch 3 -> rings of 7"""
    a = dict(n_layer=3, n_head_kv=2, head_dim=4, n_ctx=16, n_seq=3, type_k="f32", swa_window=4,
             swa_layers=(True, True, False), n_batch=3)
    a.update(kw)
    return KVCache(**a)


def _fill(kv, seed=0):
    rng = np.random.default_rng(seed)
    for li in range(kv.n_layer):
        for a in kv.layer(li):
            a[...] = rng.standard_normal(a.shape)


# ------------------------------------------------------------------------------------ layout
def test_full_layout_and_batch_inputs():
    kv = _cache(swa_window=0, swa_layers=None, type_k="f16")
    assert kv.ring_cells == 0 and kv.ring_layers == (False,) * 3
    assert kv.k.shape == kv.v.shape == (3, 48, 2, 4) and kv.k.dtype == np.float16
    assert (kv.type_k, kv.type_v) == ("f16", "f16")
    assert kv.nbytes == 2 * 3 * 48 * 8 * 2 and kv.slot_cells(2) == 16
    assert np.shares_memory(kv.layer(1)[0], kv.k[1]) and np.shares_memory(kv.layer(1)[1], kv.v[1])
    # slot 2: 3 tokens at positions 5..7; slot 0: one token at 9; 4 groups of capacity
    inp = kv.batch_inputs([(2, 0, 3, 5), (0, 3, 1, 9)], n=4, n_groups=4)
    assert set(inp) == {"cells", "seqs"}
    assert inp["cells"].tolist() == [37, 38, 39, 9] and inp["cells"].dtype == np.int32
    assert inp["seqs"].tolist() == [[32, 0, 3, 5], [0, 3, 1, 9], [0, 0, 0, 0], [0, 0, 0, 0]]


def test_ring_layout_and_batch_inputs():
    kv = _cache()
    assert kv.ring_cells == 7 and kv.ring_layers == (True, True, False)
    assert [a.shape[0] for a in kv.k] == [21, 21, 48] and kv.slot_cells(0) == 7 and kv.slot_cells(2) == 16
    assert kv.nbytes == 2 * (21 + 21 + 48) * 8 * 4
    inp = kv.batch_inputs([(1, 0, 4, 5)], n=4, n_groups=2)
    assert inp["cells"].tolist() == [21, 22, 23, 24]
    assert inp["cells_swa"].tolist() == [7 + 5, 7 + 6, 7 + 0, 7 + 1]      # position p in cell s*7 + p % 7
    assert inp["seqs_swa"].tolist() == [[7, 0, 4, 5], [0, 0, 0, 0]]
    assert inp["seqs"].tolist() == [[16, 0, 4, 5], [0, 0, 0, 0]]


@pytest.mark.parametrize("kw", [{}, {"swa_window": 0, "swa_layers": None}])
def test_step_inputs_equal_batch_inputs(kw):
    kv = _cache(**kw)
    for slot in (0, 2):
        inp, set_pos = kv.step_inputs(slot)
        for pos in (0, 6, 7, 15):
            set_pos(pos)
            ref = kv.batch_inputs([(slot, 0, 1, pos)], n=1, n_groups=1)
            assert inp.keys() == ref.keys()
            for k in ref:
                assert np.array_equal(inp[k], ref[k]), (slot, pos, k)


def test_rings_only_where_they_save_cells(monkeypatch):
    assert _cache(n_batch=12).ring_cells == 0                 # window + n_batch >= n_ctx: full caches
    assert _cache(swa_layers=(False,) * 3).ring_cells == 0     # no sliding-window layer
    assert _cache(rings=False).ring_cells == 0
    monkeypatch.setattr(_kv, "SWA_RINGS", False)
    assert _cache().ring_cells == 0 and isinstance(_cache().k, np.ndarray)
    assert _cache(rings=True).ring_cells == 7


def test_check_group():
    kv = _cache()
    kv.check_group(2, 4, 12)                                   # n_batch + 1 tokens at the end of n_ctx
    for slot, n, pos0 in ((3, 1, 0), (-1, 1, 0), (0, 0, 0), (0, 1, -1), (0, 2, 15)):
        with pytest.raises(ValueError, match="does not fit 3 slots of n_ctx = 16"):
            kv.check_group(slot, n, pos0)
    with pytest.raises(ValueError, match="ring of 7 cells"):
        kv.check_group(0, 5, 0)
    _cache(rings=False).check_group(0, 16, 0)


# ---------------------------------------------------------------------------- reuse and copies
def test_reuse_rules():
    kv = _cache()              # window 4, rings of 7
    assert kv.reusable(0, 10) == 0 and kv.reusable(5, 5) == 5
    # keep 8 needs positions 5..7; after n_cached positions the ring holds n_cached - 7 ..
    assert kv.reusable(8, 12) == 8 and kv.reusable(8, 13) == 0
    assert kv.reusable(2, 7) == 2 and kv.reusable(2, 8) == 0
    assert _cache(rings=False).reusable(8, 16) == 8


@pytest.mark.parametrize("rings", [True, False])
def test_copy_prefix(rings):
    kv = _cache(rings=rings)
    _fill(kv)
    k0 = [a.copy() for a in kv.k]
    kv.copy_prefix(2, 0, 9, n_cached=11)
    for li in range(3):
        C = kv.slot_cells(li)
        for p in range(9):
            if kv.ring_layers[li] and p < 9 - 4 + 1:
                continue       # a ring holds (and a continuation reads) the window before position 9
            assert np.array_equal(kv.k[li][0 * C + p % C], k0[li][2 * C + p % C]), (li, p)
            assert np.array_equal(kv.v[li][p % C], kv.v[li][2 * C + p % C])
        assert np.array_equal(kv.k[li][C:], k0[li][C:])                  # slots 1 and 2 untouched
    if rings:
        with pytest.raises(ValueError, match="no longer hold the window before position 9"):
            kv.copy_prefix(2, 0, 9, n_cached=14)
    else:
        kv.copy_prefix(2, 0, 9, n_cached=16)
    kv.copy_prefix(1, 1, 9)      # onto itself: nothing to do


@pytest.mark.parametrize("rings", [True, False])
def test_read_write_slot(rings):
    kv, other = _cache(rings=rings), _cache(rings=rings)
    _fill(kv, 1)
    _fill(other, 2)
    for n in (0, 3, 7, 11, 16):
        b = kv.read_slot(1, n)
        assert isinstance(b, bytes) and len(b) == kv.slot_nbytes(n)
        other.write_slot(2, n, b)
        assert other.read_slot(2, n) == b
        if n and rings:
            assert len(b) == (2 * min(n, 7) + n) * 2 * 8 * 4
    # the cells written are exactly those of positions [0, n) (rings: the last 7)
    n = 11
    other.write_slot(0, n, kv.read_slot(1, n))
    for li in range(3):
        C = kv.slot_cells(li)
        ps = range(max(0, n - C), n) if kv.ring_layers[li] else range(n)
        for p in ps:
            assert np.array_equal(other.k[li][p % C], kv.k[li][C + p % C])
    f16 = _cache(rings=rings, type_k="f16")
    with pytest.raises(ValueError, match="data must hold"):
        f16.write_slot(0, n, kv.read_slot(1, n))


# ---------------------------------------------------------------------------------- arguments
def test_bad_arguments():
    with pytest.raises(ValueError, match="type_k must be one of 'f16', 'f32', got 'q8_0'"):
        _cache(type_k="q8_0")
    with pytest.raises(ValueError, match="type_v must be one of"):
        _cache(type_v="bf16")
    with pytest.raises(TypeError, match="n_ctx must be an integer, got float"):
        _cache(n_ctx=16.0)
    with pytest.raises(ValueError, match="n_seq must be in"):
        _cache(n_seq=0)
    with pytest.raises(ValueError, match="one flag per layer"):
        _cache(swa_layers=(True,))
    with pytest.raises(ValueError, match=r"n_batch must be in \[1, 16\], got 17"):
        _cache(n_batch=17)
    kv = _cache()
    with pytest.raises(ValueError, match=r"src must be in \[0, 2\], got 3"):
        kv.copy_prefix(3, 0, 1)
    with pytest.raises(TypeError, match="dst must be an integer"):
        kv.copy_prefix(0, None, 1)
    with pytest.raises(ValueError, match=r"n must be in \[0, 16\], got 17"):
        kv.copy_prefix(0, 1, 17)
    with pytest.raises(ValueError, match=r"n_cached must be in \[5, 16\], got 4"):
        kv.copy_prefix(0, 1, 5, n_cached=4)
    with pytest.raises(ValueError, match="slot must be in"):
        kv.read_slot(-1, 2)
    with pytest.raises(ValueError, match="slot must be in"):
        kv.step_inputs(3)
    with pytest.raises(TypeError, match="data must be bytes-like, got str"):
        kv.write_slot(0, 2, "abc")
    with pytest.raises(ValueError, match="data must hold"):
        kv.write_slot(0, 2, b"\0" * 3)
    with pytest.raises(ValueError, match="2 sequences do not fit 1 groups"):
        kv.batch_inputs([(0, 0, 1, 0), (1, 1, 1, 0)], 2, 1)


# ------------------------------------------------------------------------------- on a model
def _model(tmp_path, arch, **kw):
    pytest.importorskip("gguf")
    from cpufuse.llama import Model
    from cpufuse.llama.tiny import write_tiny_gguf
    p = write_tiny_gguf(tmp_path / f"{arch}.gguf", qtype="Q8_0", arch=arch)
    return Model.load(p, n_ctx=32, n_batch=4, n_seq=3, **kw)


def _run(m, groups):
    """one Batch of (slot, tokens, pos0) groups: the logits of each group's last token (a copy)"""
    from cpufuse.llama.decoder import Batch
    b = Batch(m)
    for slot, toks, p0 in groups:
        b.add(slot, toks, p0)
    return np.array(b.run(m.decoder, (16, 3, 3)), copy=True)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_model_slots_copies_and_bytes(tmp_path, arch):
    """a slot's cells are where the layout says (a sequence in slot 2 writes what it writes in slot
    0); a prefix copied from a slot that went on (by less than its ring allows), or written back
    from bytes, continues bit for bit as if that slot had evaluated it"""
    m = _model(tmp_path, arch)
    kv = m.kv
    assert (kv.ring_cells == 8) == (arch == "gemma3") and m.kv_bytes == kv.nbytes
    chunks = [(0, 5), (5, 9)]                       # the same chunk boundaries everywhere
    for a, b in chunks:
        _run(m, [(0, TOKENS[a:b], a), (2, TOKENS[a:b], a)])
    assert kv.read_slot(0, 9) == kv.read_slot(2, 9)
    _run(m, [(0, TOKENS[9:10], 9)])                 # slot 0 goes on to 10 positions
    ref = _run(m, [(2, TOKENS[9:14], 9)])
    kv.copy_prefix(0, 1, 9, n_cached=10)
    assert np.array_equal(_run(m, [(1, TOKENS[9:14], 9)]), ref)
    saved = kv.read_slot(2, 14)
    ref = _run(m, [(2, [TOKENS[0]], 14)])
    _run(m, [(2, TOKENS[:4], 0)])                   # slot 2 overwritten, then restored
    kv.write_slot(2, 14, saved)
    assert np.array_equal(_run(m, [(2, [TOKENS[0]], 14)]), ref)
    kv.write_slot(0, 14, saved)                     # or moved to another slot
    assert np.array_equal(_run(m, [(0, [TOKENS[0]], 14)]), ref)
    if kv.ring_cells:
        with pytest.raises(ValueError, match="no longer hold"):
            kv.copy_prefix(2, 1, 4, n_cached=14)
