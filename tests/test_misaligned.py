"""Misaligned buffers (views of byte buffers at odd addresses) on every op, ISA and weight type.

The kernels read elements through typed pointers, undefined behaviour on a misaligned address
(UBSan reports it under `make test-asan`). The Python layer copies a misaligned input to an
aligned one (the result is then bit-identical to the aligned call) and refuses a misaligned
output (it is written in place, so it cannot be copied); weight bytes are read with memcpy-style
loads, so a QTensor may sit at any address. Run under `make test-asan`, this file is the check
that no misaligned read reaches a kernel through a typed pointer."""
import numpy as np
import pytest

import cpufuse
from cpufuse import QTensor
from cpufuse.reference import quant as qref
from cpufuse._dispatch import AVAILABLE

ISAS = list(AVAILABLE)
rng = np.random.default_rng(7)

def mis(a, off):
    """a copy of `a` whose data starts `off` bytes past a 64-byte boundary"""
    buf = np.zeros(a.nbytes + 128, np.uint8)
    s = (-buf.ctypes.data) % 64 + off
    v = buf[s:s + a.nbytes].view(a.dtype).reshape(a.shape)
    v[...] = a
    assert v.flags.aligned == (off % a.itemsize == 0)
    return v


def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def same(a, b):
    if isinstance(a, tuple):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    else:
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------------------------
# inputs: copied, so the result equals the aligned call's

X = f32(5, 37)
MASK16 = np.where(rng.random((5, 37)) < 0.2, -np.inf, 0).astype(np.float16)
W37, B37 = f32(37), f32(37)
Q, K, V = f32(1, 4, 3, 24), f32(1, 2, 33, 24).astype(np.float16), f32(1, 2, 33, 24)
AMASK = np.zeros((1, 1, 3, 33), np.float16)
XR, POS, FF = f32(3, 2, 20), np.array([0, 5, 9], np.int32), (1 + rng.random(10)).astype(np.float32)

OPS = {
    "softmax": (lambda x, m, s, isa: cpufuse.softmax(x, m, sinks=s, scale=0.5, isa=isa), (X, MASK16, f32(1))),
    "softmax-planned": (lambda x, isa: cpufuse.softmax(x, isa=isa), (X,)),
    "rms_norm": (lambda x, w, b, isa: cpufuse.rms_norm(x, w, bias=b, eps=1e-5, isa=isa), (X, W37, B37)),
    "rms_norm-planned": (lambda x, w, isa: cpufuse.rms_norm(x, w, eps=1e-5, isa=isa), (X, W37)),
    "add_rms_norm": (lambda x, r, w, isa: cpufuse.add_rms_norm(x, r, w, eps=1e-5, isa=isa), (X, X[::-1].copy(), W37)),
    "flash_attn": (lambda q, k, v, m, isa: cpufuse.flash_attn(q, k, v, m, scale=0.2, isa=isa), (Q, K, V, AMASK)),
    "flash_attn-planned": (lambda q, k, v, isa: cpufuse.flash_attn(q, k, v, scale=0.2, isa=isa), (Q, K, V)),
    "rope": (lambda x, p, f, isa: cpufuse.rope(x, p, n_dims=20, freq_factors=f, isa=isa), (XR, POS, FF)),
    "rope-planned": (lambda x, p, isa: cpufuse.rope(x, p, n_dims=20, mode="neox", isa=isa), (XR, POS)),
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("off", [1, 2, 3])
def test_misaligned_inputs(isa, op, off):
    fn, args = OPS[op]
    want = fn(*args, isa)
    for i in range(len(args)):      # each operand misaligned in turn, then all at once
        a = list(args)
        a[i] = mis(a[i], off)
        same(fn(*a, isa), want)
    same(fn(*[mis(a, off) for a in args], isa), want)


@pytest.mark.parametrize("isa", ISAS)
def test_misaligned_rope_into_cache_and_graph_inputs(isa):
    kc = np.zeros((16, 2, 20), np.float16)
    cpufuse.rope(XR, POS, n_dims=20, cache=(kc, 4), isa=isa)
    kc2 = np.zeros_like(kc)
    cpufuse.rope(mis(XR, 2), mis(POS, 1), n_dims=20, cache=(kc2, 4), isa=isa)
    same(kc2, kc)
    g = cpufuse.Graph()
    x = g.input("x", (5, 37))
    g.output(g.mul(g.rms_norm(x, 1e-5), g.constant(mis(W37, 1))))
    plan = g.compile(isa=isa)
    want = cpufuse.rms_norm(X, W37, eps=1e-5, isa=isa)
    same(plan.run(x=mis(X, 3))[0], want)
    same(plan.bind(x=mis(X, 2))()[0], want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("off", [1, 2])
def test_misaligned_matmul_x(isa, off):
    w = qref.quantize_weight(f32(16, 64), "Q8_0")
    x = f32(3, 64)
    want = cpufuse.matmul(x, w, isa=isa)
    same(cpufuse.matmul(mis(x, off)[:, None, :], w, isa=isa)[:, 0], want)   # 3-D: through _check_x
    same(cpufuse.matmul(mis(x, off), w, isa=isa), want)                     # 2-D: the plan does not bind a misaligned x


# ------------------------------------------------------------------------------------------------
# outputs: refused

@pytest.mark.parametrize("isa", ISAS)
def test_misaligned_outputs_refused(isa):
    o = mis(np.zeros((5, 37), np.float32), 2)
    for call in (lambda: cpufuse.softmax(X, out=o, isa=isa), lambda: cpufuse.rms_norm(X, W37, eps=1e-5, out=o, isa=isa),
                 lambda: cpufuse.rms_norm(X, W37, bias=B37, eps=1e-5, out=o, isa=isa),
                 lambda: cpufuse.add_rms_norm(X, X, W37, eps=1e-5, out=(o, np.empty_like(X)), isa=isa)):
        with pytest.raises(ValueError, match="aligned"):
            call()
    with pytest.raises(ValueError, match="out must be aligned"):
        cpufuse.softmax(o, out=o, isa=isa)                 # in place on a misaligned x: refused too
    with pytest.raises(ValueError, match="out must be aligned"):
        cpufuse.flash_attn(Q, K, V, scale=0.2, out=mis(np.zeros((1, 3, 4, 24), np.float32), 1), isa=isa)
    with pytest.raises(ValueError, match="out must be aligned"):
        cpufuse.rope(XR, POS, n_dims=20, out=mis(np.zeros_like(XR), 2), isa=isa)
    with pytest.raises(ValueError, match="k_cache must be aligned"):
        cpufuse.rope(XR, POS, n_dims=20, cache=(mis(np.zeros((8, 2, 20), np.float16), 1), 0), isa=isa)
    g = cpufuse.Graph()
    with pytest.raises(ValueError, match="aligned"):
        g.cache_write(g.input("k", (1, 2, 20)), mis(np.zeros((8, 2, 20), np.float16), 1), g.input("p", (1,), np.int32))


# ------------------------------------------------------------------------------------------------
# weights: a QTensor over an offset view of a uint8 buffer, every type

QTYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("off", [1, 2, 3])
def test_misaligned_weight_bytes(isa, qtype, off):
    n_in = 256 if qtype.endswith("_K") else 72 if qtype in ("F32", "F16", "BF16") else 96   # float rows get tails
    ref = qref.quantize_weight(f32(9, n_in), qtype)
    raw = ref.raw.reshape(-1)
    buf = np.zeros(raw.size + 128, np.uint8)
    s = (-buf.ctypes.data) % 64 + off
    buf[s:s + raw.size] = raw
    w = QTensor(buf[s:s + raw.size], qtype, ref.shape)
    x = f32(3, n_in)
    for act in ("q8", "f32"):
        same(cpufuse.matmul(x, w, act=act, isa=isa), cpufuse.matmul(x, ref, act=act, isa=isa))
    same(w.dequantize(), ref.dequantize())
