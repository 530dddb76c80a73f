"""The step kinds of a plan, one row each: the C record (its name OP_<NAME>, its fields, what it
does), the step kinds it runs, how a step lowers to it, and the step's Python execution. The C
side of a row is the function plan_<name> in native/kernels/graph.inc, which reads the record
only through the field names R_<NAME>_<FIELD> generated from the row into layouts.h (with the
opcodes and the executor's dispatch, CF_PLAN_OPS), so the fields may be declared in any order.

    lower(st, L) -> (record, descriptor or None), a list of them, or None (C cannot run this step:
                    it stays a Python step). L is records._Lowerer: L.slot(node) the pointer-table
                    index of a node's data, L.fparam(v) a float parameter's index, L.keep_array(a),
                    L.wslot(qtensor). The record is row.pack(field=value, ...), every field by name;
                    a "desc" field is given 0 and set to its descriptor's offset by lower().
    run(st, X)     the step from Python (no C extension, isa="numba", graph.PY_STEPS, or a step
                    C cannot run). X.a(node) is a node's array, X.isa, X.nth, X.pos0(...).
    explains       the step checks run-time indices (cache rows, cells, groups): when its record
                    fails in C, the executor runs the Python step, which raises the precise error.

Field kinds, by name: a pointer-table index (x, y, ...; -1 = NULL), "desc" an offset into the
program of a descriptor, "f_*" an index into the float parameters, anything else an integer.
Adding a step kind: docs/architecture.md ("Adding a graph step").
"""
import math

import numpy as np

from .._layouts import CP, RPF, Record
from ..ops import attention as _attn, checks as _checks, kvquant, norms as _norms, rope as _rope
from ..ops import softmax as _softmax
from .ir import F16, GraphError, Node, _is_contig, _view_root, same_over_sizes
from . import moe as _moe, oai as _oai

ROWS = []   # in opcode order


class Kind(Record):
    """One row: the record (Record: name, op, fields, doc, pack) and its steps' lowering and run."""

    def __init__(self, name, fields, doc, steps, lower, run, explains=False):
        super().__init__(name, len(ROWS) + 1, fields, doc)
        self.steps, self.lower, self.run, self.explains = tuple(steps), lower, run, explains
        ROWS.append(self)


# -- geometry helpers of the lowerings ------------------------------------------------------------
def _geom(node):
    """(4-D shape, 4 element strides), left-padded"""
    _, st, _ = _view_root(node)
    pad = 4 - len(node.shape)
    return (1,) * pad + node.shape, [0] * pad + list(st)


def _contig(node):
    return _is_contig(node.shape, _view_root(node)[1])


def _rows(node):
    """(rows, row stride in elements) when a node's leading axes merge into one row axis over
    unit-stride rows (what cf_qmatmul reads), else None"""
    shape, st = node.shape, _view_root(node)[1]
    if shape and shape[-1] > 1 and st[-1] != 1:
        return None
    lead = [(n, s) for n, s in zip(shape[:-1], st[:-1]) if n != 1]
    rows = math.prod(n for n, _ in lead) if lead else 1
    for (n0, s0), (n1, s1) in zip(lead, lead[1:]):
        if s0 != s1 * n1:
            return None
    return rows, (lead[-1][1] if lead else shape[-1])


def _mask_kind(m):
    return 0 if m is None else (2 if m.dtype == F16 else 1)


# -- elementwise ----------------------------------------------------------------------------------
def _lower_binary(st, L):
    """ADD, MUL, SWIGLU, GEGLU: y = f(a, b), b tiled by modulo of its length"""
    out = st.outs[0]
    a, b = st.ins
    if st.kind in ("add", "mul") and a.shape != out.shape:
        a, b = b, a
    if a.shape != out.shape or not (_contig(a) and _contig(b) and _contig(out)):
        return None
    if st.kind in ("swiglu", "geglu"):
        return KIND[st.kind].pack(n=math.prod(out.shape), g=L.slot(a), u=L.slot(b), nb=math.prod(b.shape),
                                  y=L.slot(out)), None
    return KIND[st.kind].pack(n=math.prod(out.shape), a=L.slot(a), b=L.slot(b), nb=math.prod(b.shape),
                              y=L.slot(out)), None


def _run_binary(st, X):
    a, b = st.ins
    out = X.a(st.outs[0])
    big, small = (a, b) if a.shape == out.shape else (b, a)
    (np.add if st.kind == "add" else np.multiply)(X.a(big), X.a(small), out=out)


def _run_swiglu(st, X):
    g, u = X.a(st.ins[0]), X.a(st.ins[1])
    with np.errstate(over="ignore"):   # exp(-g) = inf for very negative g: silu -> -0, as in C
        np.multiply(g / (1.0 + np.exp(-g)), u, out=X.a(st.outs[0]))


def _run_gelu(st, X):
    """gelu and geglu: graph.inc's gelu_v, op by op in f32 (-inf: NaN)"""
    g = X.a(st.ins[0])
    with np.errstate(over="ignore", invalid="ignore"):
        z = g * (np.float32(0.07135481627159025) * (g * g) + np.float32(1.5957691216057308))
        y = g / (np.float32(1.0) + np.exp(-z))
    if st.kind == "geglu":
        y = y * X.a(st.ins[1])
    np.copyto(X.a(st.outs[0]), y)


def _unary(st, L, **fields):
    """SCALE, SILU, GELU, SOFTCAP: y = f(a) over contiguous data"""
    a, out = st.ins[0], st.outs[0]
    if not (_contig(a) and _contig(out)):
        return None
    return KIND[st.kind].pack(n=math.prod(out.shape), a=L.slot(a), y=L.slot(out), **fields), None


def _run_scale(st, X):
    np.multiply(X.a(st.ins[0]), np.float32(st.params["s"]), out=X.a(st.outs[0]))


def _run_silu(st, X):
    x = X.a(st.ins[0])
    with np.errstate(over="ignore"):  # exp(-x) = inf for very negative x: silu -> -0, as in C
        np.divide(x, 1.0 + np.exp(-x), out=X.a(st.outs[0]))


def _lower_softcap(st, L):
    c = st.params["cap"]
    return _unary(st, L, f_inv=L.fparam(np.float32(1.0) / np.float32(c)), f_c=L.fparam(c))


def _run_softcap(st, X):
    c = np.float32(st.params["cap"])
    np.multiply(np.tanh(X.a(st.ins[0]) * (np.float32(1.0) / c)), c, out=X.a(st.outs[0]))


# -- norms, softmax, attention --------------------------------------------------------------------
def _lower_rms_norm(st, L):
    x, r, w, b = st.ins
    h, y = st.outs
    g = lambda n: _geom(n) if n is not None else None  # noqa: E731
    desc = _norms.rms_desc(_geom(x), _geom(y), g(h), g(r), g(w), g(b))
    return RMS_NORM.pack(desc=0, x=L.slot(x), r=L.slot(r), w=L.slot(w), b=L.slot(b), f_eps=L.fparam(st.params["eps"]),
                         h=L.slot(h), y=L.slot(y), fused=1), desc


def _run_rms_norm(st, X):
    x, r, w, b = (X.a(a) for a in st.ins)
    if st.kind == "rms_norm":
        _norms.rms_norm(x, w, eps=st.params["eps"], bias=b, out=X.a(st.outs[1]), isa=X.isa, n_threads=X.nth)
    else:
        _norms.add_rms_norm(x, r, w, eps=st.params["eps"], bias=b, out=(X.a(st.outs[0]), X.a(st.outs[1])),
                            isa=X.isa, n_threads=X.nth)


def _lower_softmax(st, L):
    x, m, sk = st.ins
    y = st.outs[0]
    slopes = -1
    if st.params["max_bias"] > 0:
        slopes = L.keep_array(_checks._slopes(_geom(x)[0][1], st.params["max_bias"]))
    desc = _softmax.softmax_desc(_geom(x), _geom(y), _geom(m) if m is not None else None, _mask_kind(m))
    return SOFTMAX.pack(desc=0, x=L.slot(x), mask=L.slot(m), slopes=slopes, sinks=L.slot(sk),
                        f_scale=L.fparam(st.params["scale"]), y=L.slot(y), fused=1), desc


def _run_softmax(st, X):
    x, m, sk = (X.a(a) for a in st.ins)
    _softmax.softmax(x, m, scale=st.params["scale"], max_bias=st.params["max_bias"], sinks=sk,
                     out=X.a(st.outs[0]), isa=X.isa, n_threads=X.nth)


def _lower_flash_attn(st, L):
    q, kk, v, m, sk = st.ins
    out = st.outs[0]
    p = st.params
    slopes = -1
    if p["max_bias"] > 0 and m is not None:
        slopes = L.keep_array(_checks._slopes(q.shape[1], p["max_bias"]))
    N, T = q.shape[2], kk.shape[2]
    desc = _attn.fa_desc(_geom(q), _geom(kk), _geom(v), _geom(out), _geom(m) if m is not None else None,
                         _mask_kind(m), kk.dtype == F16, v.dtype == F16, same_over_sizes(_attn.choose_strategy, N, T),
                         _attn.DEFAULT_SPLIT_CHUNK, 64)
    return FLASH_ATTN.pack(desc=0, q=L.slot(q), k=L.slot(kk), v=L.slot(v), mask=L.slot(m), slopes=slopes,
                           sinks=L.slot(sk), f_scale=L.fparam(p["scale"]), f_softcap=L.fparam(p["softcap"]),
                           out=L.slot(out), fused=1), desc


def _run_flash_attn(st, X):
    q, kk, v, m, sk = (X.a(a) for a in st.ins)
    p = st.params
    _attn.flash_attn(q, kk, v, m, scale=p["scale"], max_bias=p["max_bias"], softcap=p["softcap"],
                     sinks=sk, out=X.a(st.outs[0]), isa=X.isa, n_threads=X.nth)


# -- copies and matmuls ---------------------------------------------------------------------------
def _copy_desc(src, dst_strides):
    shape, sst = _geom(src)
    return CP.pack(N0=shape[0], N1=shape[1], N2=shape[2], N3=shape[3], S0=sst[0], S1=sst[1], S2=sst[2], S3=sst[3],
                   D0=dst_strides[0], D1=dst_strides[1], D2=dst_strides[2], D3=dst_strides[3])


def _lower_copy(st, L):
    """copy: one strided copy; concat: one per part, into its place in the output"""
    out = st.outs[0]
    if st.kind == "copy":
        a = st.ins[0]
        return COPY.pack(desc=0, src=L.slot(a), dst=L.slot(out), esize=a.dtype.itemsize), \
            _copy_desc(a, _geom(out)[1])
    ax = st.params["axis"]
    root, ost, off = _view_root(out)
    dst = [0] * (4 - len(out.shape)) + list(ost)
    recs = []
    for src, start in ((st.ins[0], 0), (st.ins[1], st.ins[0].shape[ax])):
        part = Node(-1, "part", [], {}, src.shape, out.dtype, f"{out.name}.part")
        part.view_of, part.view_strides, part.view_offset = root, ost, off + start * ost[ax]
        recs.append((COPY.pack(desc=0, src=L.slot(src), dst=L.slot(part), esize=out.dtype.itemsize),
                     _copy_desc(src, dst)))
    return recs


def _run_copy(st, X):
    if st.kind == "copy":
        np.copyto(X.a(st.outs[0]), X.a(st.ins[0]))
    else:
        np.concatenate([X.a(st.ins[0]), X.a(st.ins[1])], axis=st.params["axis"], out=X.a(st.outs[0]))


def _lower_gemm(st, L):
    a, b = st.ins
    c = st.outs[0]
    if not L.sgemm or not (_contig(a) and _contig(b) and _contig(c)):
        return None
    M, K = a.shape
    N = b.shape[1]
    return GEMM.pack(m=M, n=N, k=K, a=L.slot(a), lda=K, b=L.slot(b), ldb=N, c=L.slot(c), ldc=N), None


def _run_gemm(st, X):
    np.matmul(X.a(st.ins[0]), X.a(st.ins[1]), out=X.a(st.outs[0]))


def _lower_qmm(st, L):
    """qmatmul (1..3 weights; a residual epilogue), qmatmul_swiglu, qmatmul_geglu: the descriptor
    is quant.inc's QM_* / QW_*"""
    p = st.params
    x, nw = st.ins[:2]
    res = st.ins[2] if len(st.ins) > 2 else None   # QMATMUL -> ADD: the residual added in the epilogue
    ws = p["ws"]
    s = p.get("post_scale")    # QMATMUL -> SCALE [-> ADD]: the product scaled (QM_EPI 6; with the add, 5)
    if st.kind != "qmatmul":
        epi = 1 if st.kind == "qmatmul_swiglu" else 3
    else:
        epi = (0 if s is None else 6) if res is None else (2 if s is None else 5)
    geo = _rows(x)
    if geo is None or not all(_contig(o) for o in st.outs):
        return None
    rows, xs = geo
    rgeo = _rows(res) if res is not None else (rows, 0)
    if rgeo is None or rgeo[0] != rows:
        return None
    K = ws[0].shape[1]
    if rows == 0 or any(math.prod(o.shape) == 0 for o in st.outs):
        return None
    if nw is not None and not _contig(nw):
        return None
    from ..quant.matmul import qm_desc
    do_norm = 1 if p["eps"] is not None else 0
    d = qm_desc(rows, K, xs if rows > 1 else K, p["act"] == "q8", epi, do_norm, ws,
                [ws[0].shape[0] if epi else w.shape[0] for w in ws],
                0 if res is None else (rgeo[1] if rows > 1 else ws[0].shape[0]), s)
    wsl = [L.wslot(w) for w in ws] + [-1] * (3 - len(ws))
    ysl = [L.slot(o) for o in st.outs] + [-1] * (3 - len(st.outs))
    eps = L.fparam(p["eps"] if do_norm else 0.0)
    return QMM.pack(desc=0, x=L.slot(x), nw=L.slot(nw) if do_norm else -1, f_eps=eps,
                    w0=wsl[0], w1=wsl[1], w2=wsl[2], y0=ysl[0], y1=ysl[1], y2=ysl[2],
                    res=L.slot(res) if res is not None else -1), d


def _run_qmm(st, X):
    from ..quant import matmul as _qm
    p = st.params
    x = X.a(st.ins[0])
    kw = {"act": p["act"], "isa": X.isa, "n_threads": X.nth}
    if p["eps"] is not None:
        kw["eps"] = p["eps"]
        if st.ins[1] is not None:
            kw["norm_weight"] = np.ascontiguousarray(X.a(st.ins[1])).reshape(-1)
    if st.kind == "qmatmul_swiglu":
        _qm.matmul_swiglu(x, p["ws"][0], p["ws"][1], out=X.a(st.outs[0]), **kw)
    elif st.kind == "qmatmul_geglu":
        _qm.matmul_geglu(x, p["ws"][0], p["ws"][1], out=X.a(st.outs[0]), **kw)
    elif len(p["ws"]) == 1 and p.get("post_scale") is not None:   # QMATMUL -> SCALE [-> ADD]: [res +] f32(s * y)
        y = _qm.matmul(x, p["ws"][0], **kw)
        if len(st.ins) > 2:
            np.multiply(y, np.float32(p["post_scale"]), out=y)
            np.add(X.a(st.ins[2]), y, out=X.a(st.outs[0]))
        else:
            np.multiply(y, np.float32(p["post_scale"]), out=X.a(st.outs[0]))
    elif len(p["ws"]) == 1:
        res = X.a(st.ins[2]) if len(st.ins) > 2 else None   # QMATMUL -> ADD: the residual epilogue
        _qm.matmul(x, p["ws"][0], out=X.a(st.outs[0]), residual=res, **kw)
    else:
        _qm.matmul_multi(x, p["ws"], out=tuple(X.a(o) for o in st.outs), **kw)


# -- rope and the KV cache ------------------------------------------------------------------------
def _lower_rope(st, L):
    """rope, rope_cache (ROPE -> CACHE_WRITE): descriptor RP_* then the RPF_* doubles' bits"""
    p = st.params
    x, pos = st.ins[0], st.ins[1]
    T, H, D = x.shape
    try:  # the Python step raises the precise error (or runs a rope with parameters this record lacks)
        nd, m, fps, nco, compat, ff = _rope.rope_params(p["n_dims"], D, p["mode"], **p["kw"])
    except (TypeError, ValueError):
        return None
    xst = _view_root(x)[1]
    if D > 1 and xst[2] != 1:
        return None
    ffs = L.keep_array(ff) if ff is not None else -1
    if st.kind == "rope_cache":
        cw = st.outs[0]
        cache = p["cache"]
        f16 = cache.dtype == F16
        y, p0, n_ctx, row_b = L.slot(cw), L.slot(st.ins[2]), cache.shape[0], H * D * cache.itemsize
    else:
        out = st.outs[0]
        if not _contig(out):
            return None
        f16, y, p0, n_ctx, row_b = False, L.slot(out), -1, 0, 0
    d = _rope.rp_desc(T, H, D, nd, m, compat, f16, xst[0], xst[1], H * D, D, nco)
    assert len(fps) == RPF.LEN
    d += np.array(fps, np.float64).view(np.int64).tolist()
    return ROPE.pack(desc=0, x=L.slot(x), pos=L.slot(pos), ff=ffs, y=y, pos0=p0, n_ctx=n_ctx, row_bytes=row_b), d


def _run_rope(st, X):
    p = st.params
    if st.kind == "rope":
        _rope.rope(X.a(st.ins[0]), X.a(st.ins[1]), n_dims=p["n_dims"], mode=p["mode"],
                   out=X.a(st.outs[0]), isa=X.isa, n_threads=X.nth, **p["kw"])
        return
    p0 = X.pos0(st.ins[2], st.ins[0].shape[0], st.outs[0])
    _rope.rope(X.a(st.ins[0]), X.a(st.ins[1]), n_dims=p["n_dims"], mode=p["mode"],
               cache=(p["cache"], p0), isa=X.isa, n_threads=X.nth, **p["kw"])


def _lower_cache_write(st, L):
    src, p0 = st.ins
    cw = st.outs[0]
    if not _contig(src):
        return None
    return CACHE_WRITE.pack(n=math.prod(src.shape), src=L.slot(src), cache=L.slot(cw), pos0=L.slot(p0),
                            n_ctx=cw.shape[0], t=src.shape[0], f16=cw.dtype == F16), None


def _run_cache_write(st, X):
    src, cw = st.ins[0], st.outs[0]
    p0 = X.pos0(st.ins[1], src.shape[0], cw)
    cw.params["cache"][p0:p0 + src.shape[0]] = X.a(src)  # f32 -> f16 rounds to nearest even


def _kv_code(kv):
    """a kv_write node's cell type as flash_attn's FA_KF16 code (0 f32, 1 f16, 2 q8_0, 3 q4_0)"""
    t = kv.params.get("kv_type")
    return kvquant.CODE[t] if t else int(kv.dtype == F16)


def _lower_kv_write(st, L):
    src, cells = st.ins
    kv = st.outs[0]
    if not _contig(src):
        return None
    return KV_WRITE.pack(n=src.shape[0], src=L.slot(src), cache=L.slot(kv), cells=L.slot(cells), n_cells=kv.shape[0],
                         row=kv.shape[1] * kv.shape[2], f16=_kv_code(kv)), None


def _run_kv_write(st, X):
    src, cells = X.a(st.ins[0]), X.a(st.ins[1])
    kv = st.outs[0]
    cache = kv.params["cache"]
    if cells.size and (cells.min() < 0 or cells.max() >= cache.shape[0]):
        raise GraphError(f"run: kv_write {kv.name!r}: cells of input {st.ins[1].name!r} must be in "
                         f"[0, {cache.shape[0]}), got {cells[(cells < 0) | (cells >= cache.shape[0])][:5].tolist()}")
    t = kv.params.get("kv_type")
    cache[cells] = kvquant.quantize(src, t) if t else src   # f32 -> f16 rounds to nearest even


def _lower_attn_seqs(st, L):
    q, kc, vc, seqs = st.ins[:4]
    out = st.outs[0]
    if not (_contig(q) and _contig(out)):
        return None
    n, H, D = q.shape
    return ATTN_SEQS.pack(q=L.slot(q), k=L.slot(kc), v=L.slot(vc), seqs=L.slot(seqs), ngroups=seqs.shape[0],
                          out=L.slot(out), n=n, h=H, hkv=kc.shape[1], d=D, n_cells=kc.shape[0], kf16=_kv_code(kc),
                          vf16=_kv_code(vc), split_min_t=_attn.SPLIT_MIN_T, tiled_min_n=_attn.TILED_MIN_N,
                          chunk=_attn.DEFAULT_SPLIT_CHUNK or 0, f_scale=L.fparam(st.params["scale"]),
                          f_softcap=L.fparam(st.params["softcap"]), swa=st.params["window"],
                          ring=st.params["ring"], sinks=L.slot(st.ins[4] if len(st.ins) > 4 else None)), None


def _run_attn_seqs(st, X):
    """one flash_attn call per sequence (the numba path; and the error of a failed C step)"""
    q, seqs, out = X.a(st.ins[0]), X.a(st.ins[3]), X.a(st.outs[0])
    kc, vc = st.ins[1].params["cache"], st.ins[2].params["cache"]
    n = q.shape[0]
    for g, (cell0, r0, nr, pos0) in enumerate(seqs.tolist()):
        if nr == 0:
            continue
        win, ring = st.params["window"], st.params["ring"]
        k0 = max(0, pos0 - win + 1) if win > 0 else 0   # graph.inc plan_attn_seqs: the first visible key
        T = pos0 + nr - k0
        if nr < 0 or r0 < 0 or r0 + nr > n or pos0 < 0 or cell0 < 0 or (
                cell0 + ring > kc.shape[0] or T > ring if ring else cell0 + pos0 + nr > kc.shape[0]):
            raise GraphError(f"run: attn_seqs {st.outs[0].name!r}: group {g} (cell0, row0, n_rows, pos0) = "
                             f"{(cell0, r0, nr, pos0)} does not fit {n} query rows and {kc.shape[0]} cache cells"
                             + (f" (a ring of {ring} cells per sequence, window {win})" if ring else ""))
        mask = None
        if nr > 1:
            mask = np.zeros((1, 1, nr, T), F16)
            pk, pq = k0 + np.arange(T)[None, :], pos0 + np.arange(nr)[:, None]
            bad = (pk > pq) | ((pq - pk >= win) if win > 0 else False)
            mask[0, 0][bad] = -np.inf
        rows = cell0 + (np.arange(k0, k0 + T) % ring if ring else np.arange(k0, k0 + T))
        K = kc[rows].transpose(1, 0, 2)[None]
        V = vc[rows].transpose(1, 0, 2)[None]
        Q = q[r0:r0 + nr].transpose(1, 0, 2)[None]
        o = _attn.flash_attn(Q, K, V, mask, scale=st.params["scale"], softcap=st.params["softcap"],
                             sinks=X.a(st.ins[4]) if len(st.ins) > 4 else None, isa=X.isa, n_threads=X.nth,
                             k_type=st.ins[1].params.get("kv_type"), v_type=st.ins[2].params.get("kv_type"),
                             dv=q.shape[2])
        out[r0:r0 + nr] = o[0]


def _lower_gather_rows(st, L):
    x, idx = st.ins
    out = st.outs[0]
    if not (_contig(x) and _contig(out)):
        return None
    return GATHER_ROWS.pack(m=out.shape[0], src=L.slot(x), idx=L.slot(idx), dst=L.slot(out), row=x.shape[1],
                            n_src=x.shape[0]), None


def _run_gather_rows(st, X):
    x, idx = X.a(st.ins[0]), X.a(st.ins[1])
    if idx.size and (idx.min() < 0 or idx.max() >= x.shape[0]):
        raise GraphError(f"run: gather_rows {st.outs[0].name!r}: indices of input {st.ins[1].name!r} must be "
                         f"in [0, {x.shape[0]}), got {idx[(idx < 0) | (idx >= x.shape[0])][:5].tolist()}")
    np.take(x, idx, axis=0, out=X.a(st.outs[0]))


# -- the table: the row order is the opcode order -------------------------------------------------
ADD = Kind("ADD", "n a b nb y", "y = a + b, b tiled by modulo of its length nb", ("add",), _lower_binary, _run_binary)
MUL = Kind("MUL", "n a b nb y", "y = a * b, b tiled", ("mul",), _lower_binary, _run_binary)
SCALE = Kind("SCALE", "n a f_s y", "y = a * s", ("scale",),
             lambda st, L: _unary(st, L, f_s=L.fparam(st.params["s"])), _run_scale)
SILU = Kind("SILU", "n a y", "y = silu(a)", ("silu",), _unary, _run_silu)
SWIGLU = Kind("SWIGLU", "n g u nb y", "y = silu(g) * u", ("swiglu",), _lower_binary, _run_swiglu)
RMS_NORM = Kind("RMS_NORM", "desc x r w b f_eps h y fused", "cf_rms_norm_f32 (RN_*)", ("rms_norm", "add_rms_norm"),
                _lower_rms_norm, _run_rms_norm)
SOFTMAX = Kind("SOFTMAX", "desc x mask slopes sinks f_scale y fused", "cf_softmax_f32 (SM_*)", ("softmax",),
               _lower_softmax, _run_softmax)
FLASH_ATTN = Kind("FLASH_ATTN", "desc q k v mask slopes sinks f_scale f_softcap out fused", "cf_flash_attn_f32 (FA_*)",
                  ("flash_attn",), _lower_flash_attn, _run_flash_attn)
COPY = Kind("COPY", "desc src dst esize", "strided 4-D copy (CP_*)", ("copy", "concat"), _lower_copy, _run_copy)
GEMM = Kind("GEMM", "m n k a lda b ldb c ldc", "C = A.B row-major through numpy's cblas_sgemm (sgemv when M == 1)",
            ("matmul",), _lower_gemm, _run_gemm)
QMM = Kind("QMM", "desc x nw f_eps w0 w1 w2 y0 y1 y2 res", "cf_qmatmul_f32 (QM_*); weights are pointer-table "
           "entries; res: the residual of QM_EPI 2 and 5 (-1: none)", ("qmatmul", "qmatmul_swiglu", "qmatmul_geglu"),
           _lower_qmm, _run_qmm)
ROPE = Kind("ROPE", "desc x pos ff y pos0 n_ctx row_bytes",
            "cf_rope_f32: desc = RP_LEN ints then RPF_LEN doubles (their bits); pos0 >= 0: rows go to "
            "y + p0 * row_bytes, p0 = *(int32 *)ptrs[pos0] checked against n_ctx", ("rope", "rope_cache"),
            _lower_rope, _run_rope, explains=True)
CACHE_WRITE = Kind("CACHE_WRITE", "n src cache pos0 n_ctx t f16", "t rows (n elements) of f32 src into cache rows p0..",
                   ("cache_write",), _lower_cache_write, _run_cache_write, explains=True)
KV_WRITE = Kind("KV_WRITE", "n src cache cells n_cells row f16",
                "row i of src into cache cell cells[i] (distinct, < n_cells); f16: the cells' type code "
                "(0 f32, 1 f16, 2 q8_0, 3 q4_0 blocks)", ("kv_write",),
                _lower_kv_write, _run_kv_write, explains=True)
ATTN_SEQS = Kind("ATTN_SEQS", "q k v seqs ngroups out n h hkv d n_cells kf16 vf16 split_min_t tiled_min_n chunk "
                 "f_scale f_softcap swa ring sinks", "attention of each sequence over its own KV cells (kf16, vf16: the "
                 "cells' type codes, as KV_WRITE's f16; swa > 0: a sliding "
                 "window of swa positions; ring > 0: a sequence's cells are a ring of that many)", ("attn_seqs",),
                 _lower_attn_seqs, _run_attn_seqs, explains=True)
GATHER_ROWS = Kind("GATHER_ROWS", "m src idx dst row n_src", "dst[j] = src[idx[j]]", ("gather_rows",),
                   _lower_gather_rows, _run_gather_rows, explains=True)
GELU = Kind("GELU", "n a y", "y = gelu(a), the tanh form", ("gelu",), _unary, _run_gelu)
GEGLU = Kind("GEGLU", "n g u nb y", "y = gelu(g) * u", ("geglu",), _lower_binary, _run_gelu)
SOFTCAP = Kind("SOFTCAP", "n a f_inv f_c y", "y = c * tanh(a * inv), inv = 1/c", ("softcap",),
               _lower_softcap, _run_softcap)
# weights as data that can be indexed (moe.py; native/kernels/qmoe.inc)
QMM_ID = Kind("QMM_ID", "desc x ids w0 w1 n_exp n k y b0 b1",
              "y[r, j] = x[r] . W[ids[r, j]]^T: desc a QM_* template (every expert's geometry), w0/w1 the "
              "first of n_exp pointer-table entries (expert e's weight at ptrs[w0 + e]; w1: up, EPI 1/3/4, or -1); "
              "b0/b1: (n_exp, N) f32 bias rows added to w0's/w1's products before the epilogue (-1: none)",
              ("qmatmul_id",), lambda st, L: _moe.lower_qmm_id(st, L, QMM_ID), _moe.run_qmm_id, explains=True)
TOPK = Kind("TOPK", "n c k x idx", "idx[r] = the k largest of x[r]'s c values, largest first (ties: lower index; "
            "NaN last)", ("topk",), lambda st, L: _moe.lower_topk(st, L, TOPK), _moe.run_topk)
TAKE = Kind("TAKE", "n c k x idx y", "y[r, j] = x[r, idx[r, j]] (idx in [0, c))", ("take",),
            lambda st, L: _moe.lower_take(st, L, TAKE), _moe.run_take, explains=True)
SIGMOID = Kind("SIGMOID", "n a y", "y = 1 / (1 + exp(-a))", ("sigmoid",),
               lambda st, L: _moe.lower_sigmoid(st, L, SIGMOID), _moe.run_sigmoid)
WSUM = Kind("WSUM", "n k m y w out res sc f_s", "out[r] = sum over j in order of w[r, j] * y[r, j, :]; then * s "
            "where sc is 1 (WSUM -> SCALE) and res[r] + it where res is a slot (-> ADD: the residual; -1: none)", ("wsum",),
            lambda st, L: _moe.lower_wsum(st, L, WSUM), _moe.run_wsum)
NORMW = Kind("NORMW", "n k f_floor f_scale x y", "y[r] = x[r] / max(sum of x[r]'s k values (in double, rounded to "
             "f32), floor) (floor 0: no division), then * scale (0: none): the MoE weights' norm_w and scale",
             ("normw",), lambda st, L: _moe.lower_normw(st, L, NORMW), _moe.run_normw)

# gpt-oss (oai.py; native/kernels/oai.inc)
SWIGLU_OAI = Kind("SWIGLU_OAI", "n g u y", "y = x * sigmoid(1.702 x) * (clamp(u, -7, 7) + 1), x = min(g, 7)",
                  ("swiglu_oai",), lambda st, L: _oai.lower_swiglu_oai(st, L, SWIGLU_OAI), _oai.run_swiglu_oai)
ADD_ID = Kind("ADD_ID", "n k m a b ids n_b y", "y[r, j] = a[r, j] + b[ids[r, j]] (ids in [0, n_b))", ("add_id",),
              lambda st, L: _oai.lower_add_id(st, L, ADD_ID), _oai.run_add_id, explains=True)

RECORDS = tuple(ROWS)
KIND = {s: row for row in ROWS for s in row.steps}   # step kind -> its row
