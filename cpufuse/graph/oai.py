"""gpt-oss's graph ops: the lowering and the Python step of SWIGLU_OAI and ADD_ID (rows in
kinds.py, C in native/kernels/oai.inc).

Semantics (docs/semantics.md, "gpt-oss ops"):
  swiglu_oai  x = min(g, 7) and y = clamp(u, -7, 7) (a NaN stays NaN: ggml's std::min/std::clamp),
              out = f32(x / f32(1 + exp(-f32(1.702 x)))) * f32(y + 1), each step rounded to f32
              (ggml's swiglu_oai with alpha 1.702 and limit 7, gpt-oss's experts).
  add_id      y[r, j, :] = a[r, j, :] + b[ids[r, j], :] (ggml's add_id: a per-expert bias after a
              routed matmul); an id outside [0, rows of b) is a GraphError at run time.
"""
import math

import numpy as np

from .ir import GraphError, _is_contig, _view_root

ALPHA, LIMIT = 1.702, 7.0


def _contig(node):
    return _is_contig(node.shape, _view_root(node)[1])


def swiglu_oai(g, u):
    """the op in numpy float32, step by step (the Python step and the tests' bit reference)"""
    g, u = np.asarray(g, np.float32), np.asarray(u, np.float32)
    lim = np.float32(LIMIT)
    x = np.where(g > lim, lim, g)                      # NaN: g (a comparison with NaN is false)
    y = np.where(u < -lim, -lim, np.where(u > lim, lim, u))
    with np.errstate(over="ignore", invalid="ignore"):   # exp overflow; -inf / inf = NaN as in C
        s = x / (np.float32(1.0) + np.exp(-(np.float32(ALPHA) * x)))
    return (s * (y + np.float32(1.0))).astype(np.float32)


def lower_swiglu_oai(st, L, row):
    g, u = st.ins
    out = st.outs[0]
    if not (_contig(g) and _contig(u) and _contig(out)):
        return None
    return row.pack(n=math.prod(out.shape), g=L.slot(g), u=L.slot(u), y=L.slot(out)), None


def run_swiglu_oai(st, X):
    np.copyto(X.a(st.outs[0]), swiglu_oai(X.a(st.ins[0]), X.a(st.ins[1])))


def lower_add_id(st, L, row):
    a, b, ids = st.ins
    out = st.outs[0]
    if not (_contig(a) and _contig(b) and _contig(ids) and _contig(out)):
        return None
    return row.pack(n=ids.shape[0], k=ids.shape[1], m=a.shape[-1], a=L.slot(a), b=L.slot(b), ids=L.slot(ids),
                    n_b=b.shape[0], y=L.slot(out)), None


def run_add_id(st, X):
    a, b, ids = X.a(st.ins[0]), X.a(st.ins[1]), X.a(st.ins[2]).astype(np.intp)   # (as moe.run_take reads ids)
    if ids.size and (ids.min() < 0 or ids.max() >= b.shape[0]):
        raise GraphError(f"run: add_id {st.outs[0].name!r}: ids of {st.ins[2].name!r} must be in [0, {b.shape[0]}), "
                         f"got {ids[(ids < 0) | (ids >= b.shape[0])][:5].tolist()}")
    np.add(a, b[ids], out=X.a(st.outs[0]))
