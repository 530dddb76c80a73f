"""Weights as data that can be indexed: the lowering and the Python step of the routed matmul
(qmatmul_id, ggml's mul_mat_id), top-k, take, sigmoid and the weighted sum over k. Their rows
(QMM_ID, TOPK, TAKE, SIGMOID, WSUM) are declared in kinds.py, their C in native/kernels/qmoe.inc.

Semantics (docs/semantics.md, "Routed matmul and gating"):
  qmatmul_id  y[r, j] = x[r] . W[ids[r, j]]^T, each row computed as cpufuse.matmul computes it
              alone (same act mode, same bits); with up=, glu(x . G^T) * (x . U^T) as matmul_swiglu
              / matmul_geglu, or swiglu_oai(x . G^T + bg[e], x . U^T + bu[e]) (oai.py's op, each
              bias one f32 add: add_id's); bias= alone: x . W^T + b[e]. An id outside [0, n_expert)
              is a GraphError at run time.
  topk        the indices (int32) of the k largest values of each row, largest first; exact ties
              go to the lower index; NaN ranks below every number (-inf too), NaNs by index.
  take        y[r, j] = x[r, idx[r, j]] (the values of a top-k, or other probabilities at its ids).
  sigmoid     1 / (1 + exp(-x)) in f32.
  wsum        out[r] = sum_j f32(w[r, j] * y[r, j, :]), accumulated in slot order j = 0..k-1 (fused
              with a following [SCALE ->] ADD: res[r] + f32(s * that)).
  normw       y[r] = x[r] / max(f32(sum_j x[r, j] in double), floor), then * scale (ggml's sum_rows,
              clamp, div, scale of build_moe_ffn's norm_w and expert_weights_scale).
"""
import math

import numpy as np

from . import oai as _oai
from .ir import GraphError, _is_contig, _view_root


def _contig(node):
    return _is_contig(node.shape, _view_root(node)[1])


def _glu_epi(glu, paired):
    return 0 if not paired else {"swiglu": 1, "geglu": 3, "swiglu_oai": 4}[glu]


def _biases(st):
    """the bias node of w's product and of up's (None where the step has none)"""
    rest = list(st.ins[2:])
    return tuple(rest.pop(0) if st.params.get(f) else None for f in ("bias", "up_bias"))


def lower_qmm_id(st, L, row):
    x, ids = st.ins[:2]
    out = st.outs[0]
    p = st.params
    ws = (p["w"],) + ((p["up"],) if p["up"] is not None else ())
    bs = _biases(st)
    if not all(_contig(a) for a in (x, ids, out) + tuple(b for b in bs if b is not None)):
        return None
    n, k = ids.shape
    K, N = ws[0].n_in, ws[0].n_out
    from ..quant.matmul import qm_desc
    d = qm_desc(n * k, K, K, p["act"] == "q8", _glu_epi(p["glu"], len(ws) > 1), 0, [w.expert(0) for w in ws],
                [N] * len(ws))
    return row.pack(desc=0, x=L.slot(x), ids=L.slot(ids), w0=L.wslots(ws[0]),
                    w1=L.wslots(ws[1]) if len(ws) > 1 else -1, n_exp=ws[0].n_expert, n=n, k=k,
                    y=L.slot(out), b0=L.slot(bs[0]) if bs[0] is not None else -1,
                    b1=L.slot(bs[1]) if bs[1] is not None else -1), d


def check_ids(ids, n_exp, st):
    if ids.size and (ids.min() < 0 or ids.max() >= n_exp):
        bad = ids[(ids < 0) | (ids >= n_exp)]
        raise GraphError(f"run: {st.kind} {st.outs[0].name!r}: ids of {st.ins[1].name!r} must be in "
                         f"[0, {n_exp}), got {bad[:5].tolist()}")


def run_qmm_id(st, X):
    """one matmul per expert over its rows, in (r, j) order (the numba path; the error of a failed C step)"""
    from ..quant import matmul as _qm
    p = st.params
    x, ids, out = X.a(st.ins[0]), X.a(st.ins[1]), X.a(st.outs[0])
    b, bu = (None if n is None else X.a(n) for n in _biases(st))
    w, up = p["w"], p["up"]
    check_ids(ids, w.n_expert, st)
    for e in np.unique(ids):
        rr, jj = np.nonzero(ids == e)
        xe = np.ascontiguousarray(x[rr])
        kw = {"act": p["act"], "isa": X.isa, "n_threads": X.nth}
        e = int(e)
        if up is None or p["glu"] == "swiglu_oai":   # (the builder allows biases only here)
            y = _qm.matmul(xe, w.expert(e), **kw)
            y = y if b is None else y + b[e]
            if up is not None:
                u = _qm.matmul(xe, up.expert(e), **kw)
                y = _oai.swiglu_oai(y, u if bu is None else u + bu[e])
        else:
            fn = _qm.matmul_swiglu if p["glu"] == "swiglu" else _qm.matmul_geglu
            y = fn(xe, w.expert(e), up.expert(e), **kw)
        out[rr, jj] = y


def _rows_of(node):
    return math.prod(node.shape[:-1]), node.shape[-1]


def lower_topk(st, L, row):
    x, out = st.ins[0], st.outs[0]
    if not (_contig(x) and _contig(out)):
        return None
    n, c = _rows_of(x)
    return row.pack(n=n, c=c, k=out.shape[-1], x=L.slot(x), idx=L.slot(out)), None


def topk_order(x, k):
    """the top-k indices of each row of x (any float dtype), by the rule above"""
    x = np.asarray(x)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    idx = np.broadcast_to(np.arange(x2.shape[1]), x2.shape)
    nan = np.isnan(x2)
    with np.errstate(invalid="ignore"):
        neg = np.where(nan, 0, -x2.astype(np.float64))
    order = np.lexsort((idx, neg, nan), axis=-1)[:, :k]   # NaN last, then descending, then index
    return order.astype(np.int32).reshape(lead + (k,))


def run_topk(st, X):
    np.copyto(X.a(st.outs[0]), topk_order(X.a(st.ins[0]), st.outs[0].shape[-1]))


def lower_take(st, L, row):
    x, idx = st.ins
    out = st.outs[0]
    if not (_contig(x) and _contig(idx) and _contig(out)):
        return None
    n, c = _rows_of(x)
    return row.pack(n=n, c=c, k=idx.shape[-1], x=L.slot(x), idx=L.slot(idx), y=L.slot(out)), None


def run_take(st, X):
    x, idx = X.a(st.ins[0]), X.a(st.ins[1])
    c = x.shape[-1]
    if idx.size and (idx.min() < 0 or idx.max() >= c):
        raise GraphError(f"run: take {st.outs[0].name!r}: indices of {st.ins[1].name!r} must be in [0, {c}), got "
                         f"{idx[(idx < 0) | (idx >= c)][:5].tolist()}")
    np.copyto(X.a(st.outs[0]), np.take_along_axis(x, idx.astype(np.intp), axis=-1))


def lower_sigmoid(st, L, row):
    a, out = st.ins[0], st.outs[0]
    if not (_contig(a) and _contig(out)):
        return None
    return row.pack(n=math.prod(out.shape), a=L.slot(a), y=L.slot(out)), None


def run_sigmoid(st, X):
    a = X.a(st.ins[0])
    with np.errstate(over="ignore"):   # exp(-a) = inf for very negative a: 0, as in C
        np.divide(np.float32(1.0), np.float32(1.0) + np.exp(-a), out=X.a(st.outs[0]))


def lower_wsum(st, L, row):
    """wsum, and WSUM [-> SCALE] -> ADD (ins [y, w, res], params["post_scale"]: the SCALE's s or None)"""
    y, w = st.ins[:2]
    res = st.ins[2] if len(st.ins) > 2 else None
    out = st.outs[0]
    if not (_contig(y) and _contig(w) and _contig(out) and (res is None or _contig(res))):
        return None
    s = st.params.get("post_scale")
    return row.pack(n=math.prod(w.shape[:-1]), k=w.shape[-1], m=y.shape[-1], y=L.slot(y), w=L.slot(w),
                    out=L.slot(out), res=-1 if res is None else L.slot(res), sc=0 if s is None else 1,
                    f_s=L.fparam(0.0 if s is None else s)), None


def run_wsum(st, X):
    y, w, out = X.a(st.ins[0]), X.a(st.ins[1]), X.a(st.outs[0])
    acc = y[..., 0, :] * w[..., 0:1]
    for j in range(1, w.shape[-1]):
        acc = acc + y[..., j, :] * w[..., j:j + 1]
    if st.params.get("post_scale") is not None:
        acc = acc * np.float32(st.params["post_scale"])
    if len(st.ins) > 2:
        acc = X.a(st.ins[2]) + acc
    np.copyto(out, acc)


def lower_normw(st, L, row):
    x, out = st.ins[0], st.outs[0]
    if not (_contig(x) and _contig(out)):
        return None
    n, k = _rows_of(x)
    p = st.params
    return row.pack(n=n, k=k, f_floor=L.fparam(p["floor"]), f_scale=L.fparam(p["scale"]), x=L.slot(x),
                    y=L.slot(out)), None


def normw(x, floor, scale):
    """normw's float32 result (the numba step and the tests' exact model of the C kernel)"""
    x = np.asarray(x, np.float32)
    y = x
    if floor:
        s = x.astype(np.float64).sum(axis=-1, keepdims=True).astype(np.float32)  # ggml_vec_sum_f32: double
        y = x / np.where(s < np.float32(floor), np.float32(floor), s)
    if scale:
        y = y * np.float32(scale)
    return y.astype(np.float32)


def run_normw(st, X):
    np.copyto(X.a(st.outs[0]), normw(X.a(st.ins[0]), st.params["floor"], st.params["scale"]))
