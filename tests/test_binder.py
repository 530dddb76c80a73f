"""The op binder (cpufuse/ops/binder.py): each op's declaration covers every argument, a call whose
operands do not bind on a cached signature (misaligned, strided, read-only, overlapping, wrong dtype or
shape, aliasing where it may not) runs the checks again and raises what the first call raises, and
overlap means sharing a byte: arrays that only touch bind."""
import inspect

import numpy as np
import pytest

import cpufuse
from cpufuse.ops import attention, binder, norms, rope, softmax
from cpufuse.quant import matmul as qm
from cpufuse.reference.quant import make_weight
from _util import AVAILABLE, AVAILABLE_NATIVE as NATIVE, assert_bit_identical, raised

RNG = np.random.default_rng(2828)
EPS = 1e-6


def f32(*shape):
    return RNG.standard_normal(shape, dtype=np.float32)


def misaligned(shape, dtype=np.float32):
    """a zeroed array of shape whose address is 1 byte off its item size"""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    a = np.zeros(n + 8, np.uint8)[1:1 + n].view(dtype).reshape(shape)
    assert not a.flags.aligned
    return a


def padded(a):
    """a copy of a with padded rows: same shape and dtype, not C-contiguous"""
    big = np.zeros(a.shape[:-1] + (a.shape[-1] + 4,), a.dtype)
    big[..., :a.shape[-1]] = a
    return big[..., :a.shape[-1]]


def readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


# ------------------------------------------------------------------------------------------------
# the declarations cover every argument of the public functions

# public argument -> the binder names it becomes, where a wrapper unpacks it
UNPACKED = {
    "add_rms_norm": {"out": {"h", "y", "out_type"}},
    "rope": {"cache": {"k_cache", "pos0", "cache_type"}},
    "matmul_multi": {"ws": {"w0", "w1", "w2"}, "out": {"out0", "out1", "out2", "out_type"}},
}
# arguments whose calls never take the cached binding (flash_attn's cache types, V head size and cold=True: a
# call that gives any of them runs the full checks every time)
UNBOUND = {"flash_attn": {"k_type", "v_type", "dv", "cold"}}
BINDERS = [(softmax.softmax, softmax._SM), (norms.rms_norm, norms._RN), (norms.add_rms_norm, norms._ADD),
           (attention.flash_attn, attention._FA), (rope.rope, rope._ROPE), (qm.matmul, qm._MM),
           (qm.matmul_multi, qm._MULTI), (qm.matmul_swiglu, qm._SWIGLU)]


@pytest.mark.parametrize("fn,b", BINDERS, ids=[b.name for _, b in BINDERS])
def test_declaration_covers_every_argument(fn, b):
    """an argument the declaration forgot would not be in the key: a call differing only there would
    reuse an entry made for another"""
    declared = {o.name for o in b.operands} | {p.name for p in b.params} | {"isa", "n_threads"}
    declared |= UNBOUND.get(b.name, set())
    args = set()
    for a in inspect.signature(fn).parameters:
        args |= UNPACKED.get(b.name, {}).get(a, {a})
    assert args == declared


def test_declaration_errors():
    with pytest.raises(ValueError, match="distinct"):
        binder.Binder("bad", (binder.In("x", np.float32), binder.Out("x", np.float32)))
    with pytest.raises(ValueError, match="distinct"):
        binder.Binder("bad", (binder.In("x", np.float32),), (binder.Param("isa"),))
    b = binder.Binder("ok", (binder.In("x", np.float32), binder.Out("y", np.float32)))
    with pytest.raises(ValueError, match="one new shape"):
        b.remember(None, lambda *a: None, False, new=((2,), (3,)))
    with pytest.raises(ValueError, match="start with _"):
        binder.Binder("bad", (binder.In("_p_x", np.float32),))
    assert "def fast(x, y, isa, n_threads)" in b.source


# ------------------------------------------------------------------------------------------------
# a cached signature with operands that do not bind: the checks again, the first call's error


def _overlapping(shape):
    """(a, b) of shape, b starting 4 floats into a"""
    n = int(np.prod(shape))
    buf = np.zeros(2 * n + 8, np.float32)
    return buf[:n].reshape(shape), buf[4:4 + n].reshape(shape)


def _bytes_at(n_bytes, *views):
    """views (offset, dtype, shape) of one zeroed, 64-byte aligned buffer"""
    raw = np.zeros(n_bytes + 64, np.uint8)
    raw = raw[(-raw.ctypes.data) % 64:][:n_bytes]
    return tuple(raw[o:o + int(np.prod(sh)) * np.dtype(dt).itemsize].view(dt).reshape(sh) for o, dt, sh in views)


def _cases():
    """name -> (call(operands), good operands, bad operands with the same signature): factories, so
    that each call gets its operands afresh"""
    x, w, q, xr = f32(2, 64), f32(64), f32(1, 1, 1, 64), f32(1, 1, 64)
    wq = make_weight("Q8_0", 64, 64, RNG)
    k16 = f32(1, 1, 4, 64).astype(np.float16)
    pos = np.array([2], np.int32)
    e = lambda: np.zeros((2, 64), np.float32)  # noqa: E731
    e2 = lambda: (e(), e())  # noqa: E731
    kc = lambda: np.zeros((4, 1, 64), np.float16)  # noqa: E731
    F16, F32_, I32 = np.float16, np.float32, np.int32
    return {
        "softmax misaligned out": (lambda o: cpufuse.softmax(x, out=o), e, lambda: misaligned((2, 64))),
        "softmax read-only out": (lambda o: cpufuse.softmax(x, out=o), e, lambda: readonly(x)),
        "softmax overlap": (lambda xo: cpufuse.softmax(*xo[:1], out=xo[1]), e2, lambda: _overlapping((2, 64))),
        "softmax wrong dtype": (lambda o: cpufuse.softmax(x, out=o), e, lambda: np.zeros((2, 64))),
        "softmax wrong shape": (lambda o: cpufuse.softmax(x, out=o), e, lambda: np.zeros((64, 2), np.float32)),
        "softmax f16 mask overlaps out": (
            lambda mo: cpufuse.softmax(x, mo[0], out=mo[1]),
            lambda: _bytes_at(1024, (0, F16, (2, 64)), (512, F32_, (2, 64))),
            lambda: _bytes_at(1024, (0, F16, (2, 64)), (252, F32_, (2, 64)))),
        "rms_norm misaligned out": (lambda o: cpufuse.rms_norm(x, w, eps=EPS, out=o), e,
                                    lambda: misaligned((2, 64))),
        "rms_norm out is x, with a weight": (lambda xo: cpufuse.rms_norm(xo[0], w, eps=EPS, out=xo[1]), e2,
                                             lambda: (lambda a: (a, a))(f32(2, 64))),
        "rms_norm out over the weight": (
            lambda wo: cpufuse.rms_norm(x, wo[0], eps=EPS, out=wo[1]),
            lambda: _bytes_at(1024, (0, F32_, (64,)), (256, F32_, (2, 64))),
            lambda: _bytes_at(1024, (0, F32_, (64,)), (252, F32_, (2, 64)))),
        "add_rms_norm h overlaps y": (lambda hy: cpufuse.add_rms_norm(x, x, w, eps=EPS, out=hy), e2,
                                      lambda: _overlapping((2, 64))),
        "add_rms_norm read-only h": (lambda h: cpufuse.add_rms_norm(x, x, w, eps=EPS, out=(h, e())), e,
                                     lambda: readonly(x)),
        "add_rms_norm out (None, None)": (lambda hy: cpufuse.add_rms_norm(x, x, w, eps=EPS, out=hy), lambda: None,
                                          lambda: (None, None)),
        "flash_attn misaligned out": (lambda o: cpufuse.flash_attn(q, k16, k16, scale=0.1, out=o),
                                      lambda: np.zeros((1, 1, 1, 64), np.float32),
                                      lambda: misaligned((1, 1, 1, 64))),
        "flash_attn out overlaps f16 k": (
            lambda ko: cpufuse.flash_attn(q, ko[0], ko[0], scale=0.1, out=ko[1]),
            lambda: _bytes_at(1024, (0, F16, (1, 1, 4, 64)), (512, F32_, (1, 1, 1, 64))),
            lambda: _bytes_at(1024, (0, F16, (1, 1, 4, 64)), (508, F32_, (1, 1, 1, 64)))),
        "rope out overlaps pos": (
            lambda po: cpufuse.rope(xr, po[0], n_dims=64, out=po[1]),
            lambda: _bytes_at(512, (0, I32, (1,)), (4, F32_, (1, 1, 64))),
            lambda: _bytes_at(512, (0, I32, (1,)), (0, F32_, (1, 1, 64)))),
        "rope cache read-only": (lambda c: cpufuse.rope(xr, pos, n_dims=64, cache=(c, 0)), kc,
                                 lambda: readonly(kc())),
        "rope cache misaligned": (lambda c: cpufuse.rope(xr, pos, n_dims=64, cache=(c, 0)), kc,
                                  lambda: misaligned((4, 1, 64), np.float16)),
        "rope cache pos0": (lambda p0: cpufuse.rope(xr, pos, n_dims=64, cache=(np.zeros((4, 1, 64), F16), p0)),
                            lambda: 3, lambda: 4),
        "rope cache pos0 bool": (lambda p0: cpufuse.rope(xr, pos, n_dims=64, cache=(np.zeros((4, 1, 64), F16), p0)),
                                 lambda: 1, lambda: True),
        "rope cache overlaps x": (
            lambda xk: cpufuse.rope(xk[0], pos, n_dims=64, cache=(xk[1], 0)),
            lambda: _bytes_at(1024, (0, F32_, (1, 1, 64)), (256, F16, (4, 1, 64))),
            lambda: _bytes_at(1024, (0, F32_, (1, 1, 64)), (252, F16, (4, 1, 64)))),
        "matmul read-only out": (lambda o: cpufuse.matmul(x, wq, out=o), e, lambda: readonly(x)),
        "matmul out over the weight": (lambda o: cpufuse.matmul(x[0], wq, out=o), lambda: np.zeros(64, F32_),
                                       lambda: np.frombuffer(wq.raw, np.uint8)[:256].view(np.float32)),
        "matmul residual overlaps x": (lambda xr_: cpufuse.matmul(xr_[0], wq, residual=xr_[1]), e2,
                                       lambda: _overlapping((2, 64))),
        "matmul out overlaps residual": (lambda ro: cpufuse.matmul(x, wq, residual=ro[0], out=ro[1]), e2,
                                         lambda: _overlapping((2, 64))),
        "matmul_multi outs overlap": (lambda oo: cpufuse.matmul_multi(x, (wq, wq), out=oo), e2,
                                      lambda: _overlapping((2, 64))),
        "matmul_swiglu misaligned out": (lambda o: cpufuse.matmul_swiglu(x, wq, wq, out=o), e,
                                         lambda: misaligned((2, 64))),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_cached_signature_rechecks(case):
    """the first call with the bad operands raises (through the checks); after good calls with the
    same signature made an entry, the bad call raises the same error"""
    call, good, bad = _cases()[case]
    binder.clear_plans()
    want = raised(lambda: call(bad()))
    assert want is not None, f"{case}: the first call did not raise"
    call(good())
    call(good())
    assert raised(lambda: call(bad())) == want


def _strided_pairs():
    """name -> (op on its operands, contiguous operands, the same operands strided or misaligned)"""
    x, w = f32(2, 64), f32(64)
    wq = make_weight("Q4_0", 64, 64, RNG)
    q, k = f32(1, 1, 1, 64), f32(1, 1, 3, 64).astype(np.float16)

    def mis(a):
        m = misaligned(a.shape, a.dtype)
        m[...] = a
        return m
    return {
        "softmax": (lambda a: cpufuse.softmax(a), (x,), (padded(x),)),
        "softmax misaligned x": (lambda a: cpufuse.softmax(a), (x,), (mis(x),)),
        "rms_norm": (lambda a, b: cpufuse.rms_norm(a, b, eps=EPS), (x, w), (padded(x), mis(w))),
        "add_rms_norm": (lambda a, b: cpufuse.add_rms_norm(a, b, w, eps=EPS), (x, x), (mis(x), padded(x))),
        "flash_attn": (lambda a, b: cpufuse.flash_attn(a, b, b, scale=0.1), (q, k), (mis(q), padded(k))),
        "rope": (lambda a: cpufuse.rope(a, np.arange(2, dtype=np.int32), n_dims=64), (x[:, None],),
                 (padded(x)[:, None],)),
        "matmul": (lambda a: cpufuse.matmul(a, wq), (x,), (padded(x),)),
        "matmul misaligned": (lambda a: cpufuse.matmul(a, wq), (x,), (mis(x),)),
    }


@pytest.mark.parametrize("case", list(_strided_pairs()))
def test_cached_signature_strided_operands(case):
    """strided or misaligned operands on a cached signature run the general way, bit for bit"""
    op, good, bad = _strided_pairs()[case]
    first = op(*good)
    op(*good)
    assert_bit_identical(op(*bad), first)


# ------------------------------------------------------------------------------------------------
# overlap: half-open byte ranges, strict; touching arrays bind, one shared byte does not

@pytest.mark.parametrize("isa", AVAILABLE)
def test_touching_operands_bind(isa):
    buf = np.zeros(4 * 64, np.float32)
    x, y = buf[:128].reshape(2, 64), buf[128:].reshape(2, 64)
    x[...] = f32(2, 64)
    want = cpufuse.softmax(x.copy(), isa=isa)
    assert cpufuse.softmax(x, out=y, isa=isa) is y  # (makes the entry)
    assert_bit_identical(y, want)
    y[...] = 0
    assert softmax._SM.fast(x, None, None, y, 1.0, 0.0, True, isa, None) is not None
    assert_bit_identical(y, want)
    # one shared float: the binder refuses, the checks raise
    z = buf[127:255].reshape(2, 64)
    assert softmax._SM.fast(x, None, None, z, 1.0, 0.0, True, isa, None) is None
    with pytest.raises(ValueError, match="overlap"):
        cpufuse.softmax(x, out=z, isa=isa)


@pytest.mark.skipif(not NATIVE, reason="no native ISA here")
def test_touching_in_bytes():
    """the byte comparisons (an f16 operand, int32 positions, a weight) draw the same line"""
    isa = NATIVE[0]
    raw = np.zeros(4096, np.uint8)
    # rope: int32 positions right before the output, then under its first float
    pos_out = raw[:4 + 256]
    pos, out = pos_out[:4].view(np.int32), pos_out[4:].view(np.float32).reshape(1, 1, 64)
    pos[0] = 3
    xr = f32(1, 1, 64)
    want = cpufuse.rope(xr, pos.copy(), n_dims=64, isa=isa)
    cpufuse.rope(xr, pos, n_dims=64, out=out, isa=isa)
    assert_bit_identical(out, want)
    args = (xr, pos, None, out, None, 64, "norm", 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0, 0, False, type(None), None, isa,
            None)
    assert rope._ROPE.fast(*args) is not None
    bad = raw[:256].view(np.float32).reshape(1, 1, 64)  # its first float is pos
    assert rope._ROPE.fast(*args[:3], bad, *args[4:]) is None
    # an f16 cache right after x, and one whose first row shares x's last 4 bytes
    b = raw[1024:1024 + 256 + 512]
    x2, kc = b[:256].view(np.float32).reshape(1, 1, 64), b[256:].view(np.float16).reshape(4, 1, 64)
    x2[...] = xr
    cpufuse.rope(x2, pos, n_dims=64, cache=(kc, 0), isa=isa)
    kargs = (x2, pos, None, None, kc, 64, "norm", 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0, 0, False, tuple, 0, isa, None)
    assert rope._ROPE.fast(*kargs) is not None
    kc_bad = raw[1024 + 252:1024 + 252 + 512].view(np.float16).reshape(4, 1, 64)
    assert rope._ROPE.fast(*kargs[:4], kc_bad, *kargs[5:]) is None
    with pytest.raises(ValueError, match="overlap"):
        cpufuse.rope(x2, pos, n_dims=64, cache=(kc_bad, 0), isa=isa)
    # a matmul output right after the weight's bytes
    wq = make_weight("Q8_0", 64, 64, RNG)
    wb = np.frombuffer(wq.raw, np.uint8)
    host = np.zeros(wb.size + 256 + 64, np.uint8)
    start = (-host.ctypes.data) % 64
    host = host[start:start + wb.size + 256]
    host[:wb.size] = wb
    from cpufuse.quant.types import QTensor
    w2 = QTensor(host[:wb.size], wq.qtype, wq.shape)
    xm = f32(64)
    after = host[wb.size:wb.size + 256].view(np.float32)
    cpufuse.matmul(xm, w2, out=after, isa=isa)
    assert_bit_identical(after, cpufuse.matmul(xm, wq, isa=isa))
    assert qm._MM.fast(xm, w2, None, None, after, None, None, isa, None) is not None
    last = host[wb.size - 4:wb.size + 252].view(np.float32)
    assert qm._MM.fast(xm, w2, None, None, last, None, None, isa, None) is None
    with pytest.raises(ValueError, match="overlap|share memory"):
        cpufuse.matmul(xm, w2, out=last, isa=isa)


def test_numba_entries_bind_by_the_same_rules():
    if "numba" not in AVAILABLE:
        pytest.skip("numba is not installed")
    x, w = f32(2, 64), f32(64)
    y = np.empty((2, 64), np.float32)
    cpufuse.rms_norm(x, w, eps=EPS, out=y, isa="numba")
    assert norms._RN.fast(x, w, None, y, EPS, True, "numba", None) is not None
    for bad in (misaligned((2, 64)), readonly(y), padded(y)):
        assert norms._RN.fast(x, w, None, bad, EPS, True, "numba", None) is None
    assert norms._RN.fast(x, w, None, x, EPS, True, "numba", None) is None  # aliasing x, with a weight


# ------------------------------------------------------------------------------------------------
# Numba is a registry entry that takes its C kernel's arguments

@pytest.mark.skipif("numba" not in AVAILABLE, reason="numba is not installed")
def test_numba_entries_take_the_c_arguments():
    import re
    from pathlib import Path
    from cpufuse import _registry
    cdef = (Path(__file__).resolve().parents[1] / "native" / "cdef.h").read_text()
    protos = {m.group(1): m.group(2) for m in re.finditer(r"\bCF_FN\((cf_\w+)\)\(([^)]*)\)", cdef)}
    checked = 0
    for op, (sym, nbk) in _registry.KERNELS.items():
        if sym is None or nbk is None:
            continue
        fn = _registry.kernel(op, "numba")
        assert fn.__module__ == "cpufuse.numba.entries", op
        assert len(inspect.signature(fn).parameters) == len(protos[sym].split(",")), op
        checked += 1
    assert checked >= 7
    assert _registry.convention("numba").arrays and not _registry.convention("scalar").arrays
