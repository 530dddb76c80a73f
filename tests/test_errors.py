"""Bad inputs raise TypeError / ValueError whose message names the offending argument (docs/semantics.md §1),
on every available path, including planned calls; never a crash."""
import re

import numpy as np
import pytest

import cpufuse
from _util import AVAILABLE

F32 = np.float32
_rng = np.random.default_rng(11)
X = _rng.standard_normal((2, 3, 4, 16)).astype(F32)
X2 = _rng.standard_normal((6, 16)).astype(F32)  # 2-D contiguous: a planned rms_norm call
W = _rng.standard_normal(16).astype(F32)
M = np.zeros((1, 3, 4, 16), F32)


def _ro(a):
    a = a.copy()
    a.setflags(write=False)
    return a


def _buf_overlap():
    buf = np.zeros(6 * 16 + 8, F32)
    x = buf[:96].reshape(6, 16)
    out = buf[8:104].reshape(6, 16)  # shifted by 8 elements: partial overlap
    x[...] = X2
    return x, out


_bx, _bout = _buf_overlap()

# (id, exception type, argument name that the message must contain, callable(isa))
SOFTMAX_BAD = [
    ("x-f64", TypeError, "x", lambda i: cpufuse.softmax(X.astype(np.float64), isa=i)),
    ("x-int", TypeError, "x", lambda i: cpufuse.softmax(X.astype(np.int32), isa=i)),
    ("x-f16", TypeError, "x", lambda i: cpufuse.softmax(X.astype(np.float16), isa=i)),
    ("x-list", TypeError, "x", lambda i: cpufuse.softmax(X2.tolist(), isa=i)),
    ("x-0d", ValueError, "x", lambda i: cpufuse.softmax(np.array(1.0, F32), isa=i)),
    ("x-5d", ValueError, "x", lambda i: cpufuse.softmax(X[None], isa=i)),
    ("x-strided-last", ValueError, "x", lambda i: cpufuse.softmax(X2[:, ::2], isa=i)),
    ("x-fortran", ValueError, "x", lambda i: cpufuse.softmax(np.asfortranarray(X2), isa=i)),
    ("x-bool", TypeError, "x", lambda i: cpufuse.softmax(X2 > 0, isa=i)),
    ("mask-f64", TypeError, "mask", lambda i: cpufuse.softmax(X, M.astype(np.float64), isa=i)),
    ("mask-int", TypeError, "mask", lambda i: cpufuse.softmax(X, M.astype(np.int16), isa=i)),
    ("mask-list", TypeError, "mask", lambda i: cpufuse.softmax(X2, X2.tolist(), isa=i)),
    ("mask-columns", ValueError, "mask", lambda i: cpufuse.softmax(X, np.zeros((1, 3, 4, 15), F32), isa=i)),
    ("mask-columns-more", ValueError, "mask", lambda i: cpufuse.softmax(X, np.zeros((1, 3, 4, 17), F32), isa=i)),
    ("mask-rows", ValueError, "mask", lambda i: cpufuse.softmax(X, np.zeros((1, 3, 3, 16), F32), isa=i)),
    ("mask-heads", ValueError, "mask", lambda i: cpufuse.softmax(X, np.zeros((1, 2, 4, 16), F32), isa=i)),
    ("mask-seqs", ValueError, "mask", lambda i: cpufuse.softmax(X, np.zeros((3, 1, 4, 16), F32), isa=i)),
    ("mask-5d", ValueError, "mask", lambda i: cpufuse.softmax(X, M[None], isa=i)),
    ("mask-strided-last", ValueError, "mask", lambda i: cpufuse.softmax(X2, np.zeros((6, 32), F32)[:, ::2], isa=i)),
    ("alibi-no-mask", ValueError, "max_bias", lambda i: cpufuse.softmax(X, max_bias=8.0, isa=i)),
    ("max_bias-inf", ValueError, "max_bias", lambda i: cpufuse.softmax(X, M, max_bias=np.inf, isa=i)),
    ("scale-str", TypeError, "scale", lambda i: cpufuse.softmax(X, scale="a", isa=i)),
    ("scale-numeric-str", TypeError, "scale", lambda i: cpufuse.softmax(X, scale="2", isa=i)),
    ("sinks-shape", ValueError, "sinks", lambda i: cpufuse.softmax(X, sinks=np.zeros(4, F32), isa=i)),
    ("sinks-2d", ValueError, "sinks", lambda i: cpufuse.softmax(X, sinks=np.zeros((1, 3), F32), isa=i)),
    ("sinks-dtype", TypeError, "sinks", lambda i: cpufuse.softmax(X, sinks=np.zeros(3), isa=i)),
    ("sinks-list", TypeError, "sinks", lambda i: cpufuse.softmax(X, sinks=[0.0, 0.0, 0.0], isa=i)),
    ("out-shape", ValueError, "out", lambda i: cpufuse.softmax(X, out=np.empty((2, 3, 4, 15), F32), isa=i)),
    ("out-shape-flat", ValueError, "out", lambda i: cpufuse.softmax(X, out=np.empty(X.size, F32), isa=i)),
    ("out-dtype", TypeError, "out", lambda i: cpufuse.softmax(X, out=np.empty(X.shape), isa=i)),
    ("out-list", TypeError, "out", lambda i: cpufuse.softmax(X2, out=X2.tolist(), isa=i)),
    ("out-readonly", ValueError, "out", lambda i: cpufuse.softmax(X, out=_ro(X), isa=i)),
    ("out-strided-last", ValueError, "out", lambda i: cpufuse.softmax(X2, out=np.empty((6, 32), F32)[:, ::2], isa=i)),
    ("out-overlaps-x", ValueError, "out", lambda i: cpufuse.softmax(_bx, out=_bout, isa=i)),
    ("out-overlaps-mask", ValueError, "out", lambda i: cpufuse.softmax(X2, _bx, out=_bout, isa=i)),
    ("out-x-reversed", ValueError, "out", lambda i: (lambda x: cpufuse.softmax(x, out=x[::-1], isa=i))(X2.copy())),
    ("isa-unknown", ValueError, "isa", lambda i: cpufuse.softmax(X, isa="foo")),
    ("isa-none-str", ValueError, "isa", lambda i: cpufuse.softmax(X, isa="")),
]

RMS_BAD = [
    ("x-f64", TypeError, "x", lambda i: cpufuse.rms_norm(X2.astype(np.float64), W, eps=1e-6, isa=i)),
    ("x-f64-plain", TypeError, "x", lambda i: cpufuse.rms_norm(X.astype(np.float64), eps=1e-6, isa=i)),
    ("x-int", TypeError, "x", lambda i: cpufuse.rms_norm(X2.astype(np.int64), W, eps=1e-6, isa=i)),
    ("x-f16", TypeError, "x", lambda i: cpufuse.rms_norm(X2.astype(np.float16), W, eps=1e-6, isa=i)),
    ("x-list", TypeError, "x", lambda i: cpufuse.rms_norm(X2.tolist(), W, eps=1e-6, isa=i)),
    ("x-0d", ValueError, "x", lambda i: cpufuse.rms_norm(np.array(1.0, F32), eps=1e-6, isa=i)),
    ("x-5d", ValueError, "x", lambda i: cpufuse.rms_norm(X[None], eps=1e-6, isa=i)),
    ("x-strided-last", ValueError, "x", lambda i: cpufuse.rms_norm(X2[:, ::2], W[:8], eps=1e-6, isa=i)),
    ("eps-negative", ValueError, "eps", lambda i: cpufuse.rms_norm(X2, W, eps=-1e-6, isa=i)),
    ("eps-negative-plain", ValueError, "eps", lambda i: cpufuse.rms_norm(X, eps=-1.0, isa=i)),
    ("eps-nan", ValueError, "eps", lambda i: cpufuse.rms_norm(X2, W, eps=float("nan"), isa=i)),
    ("eps-neg-inf", ValueError, "eps", lambda i: cpufuse.rms_norm(X2, W, eps=-np.inf, isa=i)),
    ("eps-missing", TypeError, "eps", lambda i: cpufuse.rms_norm(X2, W, isa=i)),
    ("eps-str", TypeError, "eps", lambda i: cpufuse.rms_norm(X2, W, eps="abc", isa=i)),
    ("eps-numeric-str", TypeError, "eps", lambda i: cpufuse.rms_norm(X2, W, eps="1e-6", isa=i)),
    ("eps-none", TypeError, "eps", lambda i: cpufuse.rms_norm(X2, W, eps=None, isa=i)),
    ("bias-without-weight", ValueError, "bias", lambda i: cpufuse.rms_norm(X2, eps=1e-6, bias=W, isa=i)),
    ("weight-no-tile", ValueError, "weight", lambda i: cpufuse.rms_norm(X2, W[:15], eps=1e-6, isa=i)),
    ("weight-no-tile-rows", ValueError, "weight", lambda i: cpufuse.rms_norm(X2, np.ones((4, 16), F32), eps=1e-6, isa=i)),
    ("weight-longer", ValueError, "weight", lambda i: cpufuse.rms_norm(X2, np.ones(32, F32), eps=1e-6, isa=i)),
    ("weight-too-many-dims", ValueError, "weight", lambda i: cpufuse.rms_norm(X2, np.ones((1, 1, 16), F32), eps=1e-6, isa=i)),
    ("weight-f64", TypeError, "weight", lambda i: cpufuse.rms_norm(X2, W.astype(np.float64), eps=1e-6, isa=i)),
    ("weight-list", TypeError, "weight", lambda i: cpufuse.rms_norm(X2, W.tolist(), eps=1e-6, isa=i)),
    ("weight-strided-last", ValueError, "weight", lambda i: cpufuse.rms_norm(X2, np.ones(32, F32)[::2], eps=1e-6, isa=i)),
    ("bias-no-tile", ValueError, "bias", lambda i: cpufuse.rms_norm(X2, W, eps=1e-6, bias=np.ones(5, F32), isa=i)),
    ("bias-f16", TypeError, "bias", lambda i: cpufuse.rms_norm(X2, W, eps=1e-6, bias=W.astype(np.float16), isa=i)),
    ("out-shape", ValueError, "out", lambda i: cpufuse.rms_norm(X2, W, eps=1e-6, out=np.empty((6, 15), F32), isa=i)),
    ("out-shape-plain", ValueError, "out", lambda i: cpufuse.rms_norm(X, eps=1e-6, out=np.empty((24, 16), F32), isa=i)),
    ("out-dtype", TypeError, "out", lambda i: cpufuse.rms_norm(X2, W, eps=1e-6, out=np.empty((6, 16)), isa=i)),
    ("out-dtype-plain", TypeError, "out", lambda i: cpufuse.rms_norm(X, eps=1e-6, out=np.empty(X.shape, np.float16), isa=i)),
    ("out-readonly-planned", ValueError, "out", lambda i: cpufuse.rms_norm(X2, W, eps=1e-6, out=_ro(X2), isa=i)),
    ("out-readonly-plain", ValueError, "out", lambda i: cpufuse.rms_norm(X, eps=1e-6, out=_ro(X), isa=i)),
    ("out-readonly-bias", ValueError, "out", lambda i: cpufuse.rms_norm(X2, W, eps=1e-6, bias=W, out=_ro(X2), isa=i)),
    ("out-overlaps-x", ValueError, "out", lambda i: cpufuse.rms_norm(_bx, W, eps=1e-6, out=_bout, isa=i)),
    ("out-overlaps-x-plain", ValueError, "out", lambda i: cpufuse.rms_norm(_bx, eps=1e-6, out=_bout, isa=i)),
    ("out-is-x-with-weight", ValueError, "out", lambda i: (lambda x: cpufuse.rms_norm(x, W, eps=1e-6, out=x, isa=i))(X2.copy())),
    ("out-is-x-with-weight-4d", ValueError, "out", lambda i: (lambda x: cpufuse.rms_norm(x, W, eps=1e-6, out=x, isa=i))(X.copy())),
    ("out-is-x-with-bias", ValueError, "out", lambda i: (lambda x: cpufuse.rms_norm(x, W, eps=1e-6, bias=W, out=x, isa=i))(X2.copy())),
    ("out-is-weight", ValueError, "out", lambda i: (lambda w: cpufuse.rms_norm(X2[:1], w, eps=1e-6, out=w, isa=i))(W.copy()[None])),
    ("isa-unknown", ValueError, "isa", lambda i: cpufuse.rms_norm(X2, W, eps=1e-6, isa="foo")),
    ("isa-unknown-plain", ValueError, "isa", lambda i: cpufuse.rms_norm(X, eps=1e-6, isa="foo")),
]

ADD_BAD = [
    ("residual-f64", TypeError, "residual", lambda i: cpufuse.add_rms_norm(X2, X2.astype(np.float64), eps=1e-6, isa=i)),
    ("residual-list", TypeError, "residual", lambda i: cpufuse.add_rms_norm(X2, X2.tolist(), eps=1e-6, isa=i)),
    ("residual-no-tile", ValueError, "residual", lambda i: cpufuse.add_rms_norm(X2, np.ones((4, 16), F32), eps=1e-6, isa=i)),
    ("residual-none", TypeError, "residual", lambda i: cpufuse.add_rms_norm(X2, None, eps=1e-6, isa=i)),
    ("x-f64", TypeError, "x", lambda i: cpufuse.add_rms_norm(X2.astype(np.float64), X2, eps=1e-6, isa=i)),
    ("eps-negative", ValueError, "eps", lambda i: cpufuse.add_rms_norm(X2, X2, eps=-1.0, isa=i)),
    ("bias-without-weight", ValueError, "bias", lambda i: cpufuse.add_rms_norm(X2, X2, eps=1e-6, bias=W, isa=i)),
    ("out-not-tuple", TypeError, "out", lambda i: cpufuse.add_rms_norm(X2, X2, eps=1e-6, out=np.empty_like(X2), isa=i)),
    ("out-tuple-len", TypeError, "out", lambda i: cpufuse.add_rms_norm(X2, X2, eps=1e-6, out=(np.empty_like(X2),), isa=i)),
    ("out-h-shape", ValueError, "out", lambda i: cpufuse.add_rms_norm(X2, X2, eps=1e-6, out=(np.empty((6, 8), F32), np.empty_like(X2)), isa=i)),
    ("out-y-dtype", TypeError, "out", lambda i: cpufuse.add_rms_norm(X2, X2, eps=1e-6, out=(np.empty_like(X2), np.empty((6, 16))), isa=i)),
    ("out-y-readonly", ValueError, "out", lambda i: cpufuse.add_rms_norm(X2, X2, eps=1e-6, out=(np.empty_like(X2), _ro(X2)), isa=i)),
    ("out-y-is-x", ValueError, "out", lambda i: (lambda x: cpufuse.add_rms_norm(x, X2, eps=1e-6, out=(np.empty_like(x), x), isa=i))(X2.copy())),
    ("out-y-is-h", ValueError, "out", lambda i: (lambda h: cpufuse.add_rms_norm(X2, X2, eps=1e-6, out=(h, h), isa=i))(np.empty_like(X2))),
    ("out-h-overlaps-x", ValueError, "out", lambda i: cpufuse.add_rms_norm(_bx, X2, eps=1e-6, out=(_bout, np.empty_like(X2)), isa=i)),
    ("out-h-is-weight", ValueError, "out", lambda i: (lambda w: cpufuse.add_rms_norm(X2[:1], X2[:1], w, eps=1e-6, out=(w, np.empty((1, 16), F32)), isa=i))(W.copy()[None])),
    ("isa-unknown", ValueError, "isa", lambda i: cpufuse.add_rms_norm(X2, X2, eps=1e-6, isa="foo")),
]


def _names_arg(msg, name):
    return re.search(r"(?<![A-Za-z_])" + re.escape(name) + r"(?![A-Za-z_])", msg) is not None


def _run_bad(exc, name, fn):
    for isa in AVAILABLE:
        with pytest.raises(exc) as ei:
            fn(isa)
        assert type(ei.value) is exc or isinstance(ei.value, exc)
        msg = str(ei.value)
        assert _names_arg(msg, name), f"[{isa}] {type(ei.value).__name__} message does not name {name!r}: {msg!r}"


@pytest.mark.parametrize("exc,name,fn", [pytest.param(e, n, f, id=i) for i, e, n, f in SOFTMAX_BAD])
def test_softmax_bad(exc, name, fn):
    _run_bad(exc, name, fn)


@pytest.mark.parametrize("exc,name,fn", [pytest.param(e, n, f, id=i) for i, e, n, f in RMS_BAD])
def test_rms_norm_bad(exc, name, fn):
    _run_bad(exc, name, fn)


@pytest.mark.parametrize("exc,name,fn", [pytest.param(e, n, f, id=i) for i, e, n, f in ADD_BAD])
def test_add_rms_norm_bad(exc, name, fn):
    _run_bad(exc, name, fn)


def test_failed_call_leaves_out_untouched():
    out = np.full(X2.shape, 3.0, F32)
    with pytest.raises(ValueError):
        cpufuse.rms_norm(X2, W[:15], eps=1e-6, out=out)
    with pytest.raises(ValueError):
        cpufuse.softmax(X2, np.zeros((5, 16), F32), out=out)
    assert np.all(out == 3.0)


# ------------------------------------------------------------------------------------------------
# what is allowed

def test_out_is_x_allowed_softmax_and_plain_rms_norm():
    for isa in AVAILABLE:
        x = X.copy()
        assert cpufuse.softmax(x, out=x, isa=isa) is x
        x = X.copy()
        assert cpufuse.softmax(x, M, out=x, isa=isa) is x
        x = X.copy()
        assert cpufuse.rms_norm(x, eps=1e-6, out=x, isa=isa) is x
        x = X2.copy()
        assert cpufuse.rms_norm(x, eps=1e-6, out=x, isa=isa) is x


def test_accepted_scalars():
    """eps / scale / max_bias accept python ints and numpy scalars"""
    ref = cpufuse.rms_norm(X2, W, eps=1.0)
    for eps in (1, np.float32(1.0), np.float64(1.0), np.int64(1)):
        assert np.array_equal(cpufuse.rms_norm(X2, W, eps=eps), ref)
    ref = cpufuse.softmax(X, M, scale=2.0, max_bias=8.0)
    for s in (2, np.float32(2.0), np.int32(2)):
        assert np.array_equal(cpufuse.softmax(X, M, scale=s, max_bias=np.float32(8)), ref)


# ------------------------------------------------------------------------------------------------
# ISA names

def test_unknown_isa_message_lists_isas():
    for fn in (lambda: cpufuse.softmax(X, isa="foo"), lambda: cpufuse.rms_norm(X2, W, eps=1e-6, isa="foo")):
        with pytest.raises(ValueError) as ei:
            fn()
        msg = str(ei.value)
        assert "foo" in msg
        for name in cpufuse.available_isas():
            assert name in msg


@pytest.mark.parametrize("name", [i for i in cpufuse.ALL_ISAS if i not in cpufuse.available_isas()] or ["<none>"])
def test_unavailable_isa(name):
    if name == "<none>":
        pytest.skip("every ISA is available on this machine")
    calls = [lambda: cpufuse.softmax(X, isa=name), lambda: cpufuse.rms_norm(X2, W, eps=1e-6, isa=name),
             lambda: cpufuse.rms_norm(X, eps=1e-6, isa=name), lambda: cpufuse.add_rms_norm(X2, X2, eps=1e-6, isa=name)]
    for fn in calls:
        with pytest.raises(ValueError) as ei:
            fn()
        msg = str(ei.value)
        assert name in msg and "isa" in msg
        assert "available" in msg
        for ok in cpufuse.available_isas():
            assert ok in msg, f"{ok!r} missing from {msg!r}"
    with pytest.raises(ValueError) as ei:
        with cpufuse.use_isa(name):
            pass
    assert all(ok in str(ei.value) for ok in cpufuse.available_isas())


def test_use_isa_unknown():
    with pytest.raises(ValueError) as ei:
        with cpufuse.use_isa("foo"):
            pass
    assert "foo" in str(ei.value)


# ------------------------------------------------------------------------------------------------
# one test per message family: the exception type, and a message naming the argument, what was
# expected and what was received (docs/semantics.md §1)

Q = _rng.standard_normal((1, 4, 3, 16)).astype(F32)
K16 = _rng.standard_normal((1, 2, 5, 16)).astype(np.float16)
XR = _rng.standard_normal((3, 2, 8)).astype(F32)  # rope x (n_tokens, n_heads, head_dim)
POS = np.arange(3, dtype=np.int32)


def _qt(qtype="Q4_0", n_out=8, n_in=64):
    from cpufuse.reference import quant as qref
    return qref.make_weight(qtype, n_out, n_in, np.random.default_rng(5))


def _graph_x(shape=(4, 16)):
    g = cpufuse.Graph()
    return g, g.input("x", shape)


def _graph_bind(**inputs):
    g, x = _graph_x()
    g.output(g.rms_norm(x, 1e-6))
    return g.compile().bind(**inputs)


def _graph_permuted_softmax():
    g, x = _graph_x()
    return g.softmax(g.permute(x, (1, 0)))


def _readonly(shape, dtype=F32):
    a = np.zeros(shape, dtype)
    a.setflags(write=False)
    return a


# (family, exception, argument name, expected (substring), received (substring), call)
FAMILIES = [
    ("dtype", TypeError, "x", "float32", "float64", lambda: cpufuse.softmax(X.astype(np.float64))),
    ("dtype-kv", TypeError, "k", "float16 or float32", "int8",
     lambda: cpufuse.flash_attn(Q, K16.astype(np.int8), K16, scale=1.0)),
    ("dtype-mask", TypeError, "mask", "float16 or float32", "float64", lambda: cpufuse.softmax(X, M.astype(np.float64))),
    ("dtype-rope-pos", TypeError, "pos", "int32", "int64", lambda: cpufuse.rope(XR, POS.astype(np.int64), n_dims=8)),
    ("dtype-matmul-x", TypeError, "x", "float32", "float16", lambda: cpufuse.matmul(X2.astype(np.float16)[:, :16], _qt(n_in=32))),
    ("ndim", ValueError, "x", "at most 4 dimensions", "5", lambda: cpufuse.softmax(X[None])),
    ("ndim-q", ValueError, "q", "4-D", "(4, 3, 16)", lambda: cpufuse.flash_attn(Q[0], K16, K16, scale=1.0)),
    ("ndim-rope", ValueError, "x", "3 dims", "(6, 16)", lambda: cpufuse.rope(X2, POS, n_dims=8)),
    ("shape-kv", ValueError, "k", "DK=16", "8", lambda: cpufuse.flash_attn(Q, K16[..., :8], K16, scale=1.0)),
    ("shape-pos", ValueError, "pos", "(3,)", "(2,)", lambda: cpufuse.rope(XR, POS[:2], n_dims=8)),
    ("shape-matmul-x", ValueError, "x", "n_in=64", "(6, 16)", lambda: cpufuse.matmul(X2, _qt())),
    ("unit-stride", ValueError, "x", "unit-stride", "stride 8", lambda: cpufuse.softmax(X2[:, ::2])),
    ("unit-stride-q", ValueError, "q", "unit-stride", "stride 8", lambda: cpufuse.flash_attn(
        np.repeat(Q, 2, axis=3)[..., ::2], K16, K16, scale=1.0)),
    ("unit-stride-rope", ValueError, "x", "unit-stride", "stride 8", lambda: cpufuse.rope(
        np.repeat(XR, 2, axis=2)[..., ::2], POS, n_dims=8)),
    ("item-size-strides", ValueError, "x", "multiples of its item size 4", "strides",
     lambda: cpufuse.softmax(np.lib.stride_tricks.as_strided(np.zeros(64, F32), (3, 16), (6, 4)))),
    ("tiling", ValueError, "weight", "multiple of weight's (5)", "16", lambda: cpufuse.rms_norm(X2, np.ones(5, F32), eps=1e-6)),
    ("tiling-dims", ValueError, "residual", "at most 2 dims", "got 3",
     lambda: cpufuse.add_rms_norm(X2, X2[None], eps=1e-6)),
    ("mask-columns", ValueError, "mask", "16 columns", "15", lambda: cpufuse.softmax(X, np.zeros((4, 15), F32))),
    ("mask-rows", ValueError, "mask", "at least 4 rows", "3", lambda: cpufuse.softmax(X, np.zeros((3, 16), F32))),
    ("mask-heads", ValueError, "mask", "divide", "(2, 1)", lambda: cpufuse.softmax(X, np.zeros((1, 2, 4, 16), F32))),
    ("mask-kv", ValueError, "mask", "at least 5 columns", "4",
     lambda: cpufuse.flash_attn(Q, K16, K16, np.zeros((3, 4), np.float16), scale=1.0)),
    ("alibi", ValueError, "max_bias", "requires a mask", "max_bias=8.0", lambda: cpufuse.softmax(X, max_bias=8.0)),
    ("sinks-shape", ValueError, "sinks", "(3,)", "(4,)", lambda: cpufuse.softmax(X, sinks=np.zeros(4, F32))),
    ("sinks-dtype", TypeError, "sinks", "float32", "float64", lambda: cpufuse.softmax(X, sinks=np.zeros(3))),
    ("out-shape", ValueError, "out", "(2, 3, 4, 16)", "(2, 3, 4, 15)",
     lambda: cpufuse.softmax(X, out=np.empty((2, 3, 4, 15), F32))),
    ("out-dtype", TypeError, "out", "float32", "float64", lambda: cpufuse.rms_norm(X2, W, eps=1e-6, out=np.empty((6, 16)))),
    ("out-readonly", ValueError, "out", "writeable", "read-only", lambda: cpufuse.softmax(X, out=_readonly(X.shape))),
    ("out-readonly-rope", ValueError, "out", "writeable", "read-only",
     lambda: cpufuse.rope(XR, POS, n_dims=8, out=_readonly(XR.shape))),
    ("out-overlap", ValueError, "out", "must not overlap", "sharing memory", lambda: cpufuse.softmax(_bx, out=_bout)),
    ("out-overlap-matmul", ValueError, "out", "must not share memory", "overlaps the input 'x'",
     lambda: (lambda b: cpufuse.matmul(b, _qt(), out=b[:, :8]))(np.zeros((2, 64), F32))),
    ("out-overlap-h", ValueError, "out[0] (h)", "in place", "partially overlapping",
     lambda: cpufuse.add_rms_norm(_bx, X2, eps=1e-6, out=(_bout, np.empty_like(X2)))),
    ("out-tuple", TypeError, "out", "tuple (h_out, y_out)", "ndarray",
     lambda: cpufuse.add_rms_norm(X2, X2, eps=1e-6, out=np.empty_like(X2))),
    ("eps", ValueError, "eps", ">= 0", "-1.0", lambda: cpufuse.rms_norm(X, eps=-1.0)),
    ("eps-type", TypeError, "eps", "real number", "str", lambda: cpufuse.rms_norm(X2, W, eps="1e-6")),
    ("eps-norm-weight", ValueError, "eps", "must be given with norm_weight", "eps=None",
     lambda: cpufuse.matmul(X2[:, :16].repeat(4, axis=1), _qt(), norm_weight=np.ones(64, F32))),
    ("scale-type", TypeError, "scale", "real number", "str", lambda: cpufuse.softmax(X, scale="a")),
    ("scale-finite", ValueError, "scale", "finite", "inf", lambda: cpufuse.flash_attn(Q, K16, K16, scale=np.inf)),
    ("softcap-finite", ValueError, "softcap", "finite", "nan",
     lambda: cpufuse.flash_attn(Q, K16, K16, scale=1.0, softcap=float("nan"))),
    ("max_bias-finite", ValueError, "max_bias", "finite", "inf", lambda: cpufuse.softmax(X, M, max_bias=np.inf)),
    ("chunk", ValueError, "chunk", ">= 1", "0", lambda: cpufuse.flash_attn(Q, K16, K16, scale=1.0, chunk=0)),
    ("q_tile", ValueError, "q_tile", ">= 1", "-2", lambda: cpufuse.flash_attn(Q, K16, K16, scale=1.0, q_tile=-2)),
    ("strategy", ValueError, "strategy", "rows, tiled, split", "'fast'",
     lambda: cpufuse.flash_attn(Q, K16, K16, scale=1.0, strategy="fast")),
    ("act", ValueError, "act", "('q8', 'f32')", "'int4'", lambda: cpufuse.matmul(X2[:, :16].repeat(4, axis=1), _qt(), act="int4")),
    ("n_threads", ValueError, "n_threads", "integer >= 1", "0", lambda: cpufuse.softmax(X, n_threads=0)),
    ("n_threads-type", ValueError, "n_threads", "integer >= 1", "1.5", lambda: cpufuse.rms_norm(X2, W, eps=1e-6, n_threads=1.5)),
    ("set_num_threads", ValueError, "n_threads", "integer >= 1", "-1", lambda: cpufuse.set_num_threads(-1)),
    ("isa", ValueError, "isa", "available here", "'sse9'", lambda: cpufuse.flash_attn(Q, K16, K16, scale=1.0, isa="sse9")),
    ("isa-rope", ValueError, "isa", "available here", "'sse9'", lambda: cpufuse.rope(XR, POS, n_dims=8, isa="sse9")),
    ("qtensor-type", TypeError, "w", "cpufuse.QTensor", "ndarray", lambda: cpufuse.matmul(X2, X2)),
    ("qtype-name", ValueError, "qtype", "supported: F32", "'Q9_9'",
     lambda: cpufuse.QTensor(np.zeros(18, np.uint8), "Q9_9", (1, 32))),
    ("qtype-kind", TypeError, "qtype", "type name (str)", "float", lambda: cpufuse.QTensor(np.zeros(18, np.uint8), 2.5, (1, 32))),
    ("qtensor-bytes", ValueError, "raw", "needs 36 bytes", "got 35 bytes",
     lambda: cpufuse.QTensor(np.zeros(35, np.uint8), "Q4_0", (2, 32))),
    ("qtensor-blocks", ValueError, "n_in", "block size 256", "n_in=300",
     lambda: cpufuse.QTensor(np.zeros(144, np.uint8), "Q4_K", (1, 300))),
    ("qtensor-raw-dtype", TypeError, "raw", "uint8", "float64", lambda: cpufuse.QTensor(np.zeros(9), "Q4_0", (1, 32))),
    ("qtensor-shape", ValueError, "shape", "(n_out, n_in)", "4 values", lambda: cpufuse.QTensor(np.zeros(18, np.uint8), "Q4_0", (1, 1, 32, 1))),
    ("matmul-weights-n_in", ValueError, "ws[1]", "share the activation", "n_in=96",
     lambda: cpufuse.matmul_multi(X2[:, :16].repeat(4, axis=1), (_qt(), _qt(n_in=96)))),
    ("swiglu-shape", ValueError, "w_up", "same shape", "(9, 64)",
     lambda: cpufuse.matmul_swiglu(X2[:, :16].repeat(4, axis=1), _qt(), _qt(n_out=9))),
    ("rope-n_dims", ValueError, "n_dims", "even, > 0 and <= head_dim = 8", "got 7", lambda: cpufuse.rope(XR, POS, n_dims=7)),
    ("rope-mode", ValueError, "mode", "'norm' (0) or 'neox' (2)", "8", lambda: cpufuse.rope(XR, POS, n_dims=8, mode=8)),
    ("rope-freq_base", ValueError, "freq_base", "> 0", "-1.0", lambda: cpufuse.rope(XR, POS, n_dims=8, freq_base=-1.0)),
    ("rope-ext_factor", ValueError, "ext_factor", "finite", "nan",
     lambda: cpufuse.rope(XR, POS, n_dims=8, ext_factor=float("nan"))),
    ("rope-freq_factors", ValueError, "freq_factors", "(4,)", "(3,)",
     lambda: cpufuse.rope(XR, POS, n_dims=8, freq_factors=np.ones(3, F32))),
    ("rope-cache-shape", ValueError, "k_cache", "(n_ctx, 2, 8)", "(9, 2, 4)",
     lambda: cpufuse.rope(XR, POS, n_dims=8, cache=(np.zeros((9, 2, 4), np.float16), 0))),
    ("rope-cache-fit", ValueError, "pos0", "n_ctx = 4", "2 + 3 = 5",
     lambda: cpufuse.rope(XR, POS, n_dims=8, cache=(np.zeros((4, 2, 8), np.float16), 2))),
    ("rope-cache-readonly", ValueError, "k_cache", "writeable", "read-only",
     lambda: cpufuse.rope(XR, POS, n_dims=8, cache=(_readonly((4, 2, 8), np.float16), 0))),
    ("rope-out-and-cache", ValueError, "cache", "exclusive", "got both",
     lambda: cpufuse.rope(XR, POS, n_dims=8, out=np.empty_like(XR), cache=(np.zeros((4, 2, 8), np.float16), 0))),
    ("graph-input-dtype", ValueError, "input 'x'", "float32, float16 or int32", "float64",
     lambda: cpufuse.Graph().input("x", (2, 3), np.float64)),
    ("graph-binary", ValueError, "add", "trailing dims", "(4, 16) and (3,)",
     lambda: (lambda g, x: g.add(x, g.input("b", (3,))))(*_graph_x())),
    ("graph-unit-rows", ValueError, "softmax", "unit-stride last axis", "strides (1, 16)", _graph_permuted_softmax),
    ("graph-rms-eps", ValueError, "eps", ">= 0", "-1", lambda: (lambda g, x: g.rms_norm(x, -1.0))(*_graph_x())),
    ("graph-alibi", ValueError, "max_bias", "requires a mask", "max_bias=8.0",
     lambda: (lambda g, x: g.softmax(x, max_bias=8.0))(*_graph_x())),
    ("graph-reshape", ValueError, "reshape", "64 elements", "(5, 16)", lambda: (lambda g, x: g.reshape(x, (5, 16)))(*_graph_x())),
    ("graph-mask", ValueError, "mask", "fit x (4, 16)", "(4, 15)",
     lambda: (lambda g, x: g.softmax(x, g.input("m", (4, 15))))(*_graph_x())),
    ("graph-qmatmul", ValueError, "qmatmul", "n_in=64", "(4, 16)", lambda: (lambda g, x: g.qmatmul(x, _qt()))(*_graph_x())),
    ("graph-rope-pos", ValueError, "pos", "int32 input node of shape (4,)", "float32",
     lambda: (lambda g, x: g.rope(g.reshape(x, (4, 2, 8)), g.input("p", (4,)), 8))(*_graph_x())),
    ("graph-bind-shape", ValueError, "input 'x'", "shape (4, 16)", "(4, 15)", lambda: _graph_bind(x=np.zeros((4, 15), F32))),
    ("graph-bind-dtype", ValueError, "input 'x'", "float32", "float64", lambda: _graph_bind(x=np.zeros((4, 16)))),
    ("graph-bind-missing", ValueError, "missing input 'x'", "shape (4, 16)", "got inputs []", lambda: _graph_bind()),
    ("graph-bind-unknown", ValueError, "unknown inputs ['y']", "graph's inputs are ['x']", "'y'",
     lambda: _graph_bind(x=np.zeros((4, 16), F32), y=np.zeros(3, F32))),
]


@pytest.mark.parametrize("exc,name,expected,received,fn", [pytest.param(*f[1:], id=f[0]) for f in FAMILIES])
def test_message_family(exc, name, expected, received, fn):
    with pytest.raises(exc) as ei:
        fn()
    msg = str(ei.value)
    assert type(ei.value) is exc or isinstance(ei.value, exc), type(ei.value)
    for what, s in (("argument", name), ("expected", expected), ("received", received)):
        assert s in msg, f"the message does not give the {what} ({s!r}): {msg!r}"
