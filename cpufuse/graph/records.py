"""The lowering stage, lower(graph, steps, isa) -> Program: the buffers (allocate), and the steps as
records of the C plan executor (cf_plan_run, native/kernels/graph.inc) with their pointer table,
float parameters and descriptors, one program per C segment; the steps C cannot run stay Python
steps between them."""
import ctypes
import glob
import math
import os

import numpy as np

from .. import _backend, _registry
from .._layouts import R, RECORDS, RPF
from ..ops import attention as _attn, checks as _checks, norms as _norms, rope as _rope, softmax as _softmax
from .ir import F16, F32, Node, _is_contig, _view_root

# the records' opcodes and argument names are declared in cpufuse/_layouts.py (R.<NAME>.pack)
_DESC_FIELD = {r.op: r.index["desc"] for r in RECORDS if "desc" in r.index}  # opcode -> its desc field

# Step kinds forced to run as Python steps even where the C executor could run them (tests and
# benchmarks compare the two; e.g. {"qmatmul", "qmatmul_swiglu", "rope", "rope_cache", "cache_write"}).
PY_STEPS = set()



# ------------------------------------------------------------------------------------------------
def _find_cblas_sgemm():
    """numpy's bundled OpenBLAS: ((sgemm, sgemv) addresses, ilp64), or (None, reason)."""
    try:
        libdir = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
        cands = glob.glob(os.path.join(libdir, "libscipy_openblas*.so*")) + glob.glob(
            os.path.join(libdir, "libopenblas*.so*"))
        for path in cands:
            lib = ctypes.CDLL(path)
            for pre, suf, ilp64 in (("scipy_", "64_", 1), ("", "64_", 1), ("scipy_", "", 0), ("", "", 0)):
                mm = getattr(lib, f"{pre}cblas_sgemm{suf}", None)
                mv = getattr(lib, f"{pre}cblas_sgemv{suf}", None)
                if mm is not None and mv is not None:
                    addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
                    return (addr(mm), addr(mv)), ilp64
        return None, "numpy's bundled OpenBLAS was not found"
    except OSError as e:
        return None, str(e)


_SGEMM = None


def _sgemm():
    global _SGEMM
    if _SGEMM is None:
        _SGEMM = _find_cblas_sgemm() if os.environ.get("CPUFUSE_GRAPH_BLAS", "1") != "0" else (None, "disabled")
    return _SGEMM



class Program:
    """What lower() returns and the executor runs: plain data, set once.

    graph, steps, isa; native: whether the C plan executor runs here; buffers: node id -> the flat
    array a computed node (or constant, or KV cache) lives in; inputs: the input nodes; segments:
    ("c", (fn, prog, nrec, steps)) runs of records executed by one cf_plan_run call (prog the int64
    program, nrec its records' length, steps the step of each record) or ("py", step); ptrs, fp,
    fpc, blas, ilp64: cf_plan_run's pointer table, float parameters (a list, and the C array), BLAS
    pointers; input_slots: (pointer slot, input name, byte offset) filled at bind; keep: the
    objects the program points into; sgemm, sgemm_why: numpy's cblas_sgemm, or why not."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def lower(graph, steps, isa):
    """The lowering stage: the steps as a Program (buffers allocated, records packed)."""
    native = isa != "numba" and _backend.lib is not None
    buffers = allocate(graph, steps)
    inputs = [n for n in graph.nodes if n.op == "input"]
    prog = Program(graph=graph, steps=steps, isa=isa, native=native, buffers=buffers, inputs=inputs,
                   segments=[("py", st) for st in steps], ptrs=None, fp=[], fpc=None, blas=None, ilp64=0,
                   input_slots=[], keep=[], sgemm=None, sgemm_why=None)
    if not native:
        return prog
    addr, ilp = _sgemm()
    if addr:
        prog.sgemm, prog.ilp64 = addr, ilp
    else:
        prog.sgemm_why = ilp
    L = _Lowerer(buffers, prog.sgemm)
    raw = []     # ("py", step) or ("c", [(step, record, descriptor or None), ...])
    for st in steps:
        rec = _record(st, L) if st.kind not in PY_STEPS else None
        if rec is None:
            raw.append(("py", st))
            continue
        if not raw or raw[-1][0] != "c":
            raw.append(("c", []))
        raw[-1][1].extend((st, body, desc) for body, desc in (rec if isinstance(rec, list) else [rec]))
    ffi = _backend.ffi
    prog.ptrs = ffi.new("void *[]", max(1, len(L.slot_addr)))
    for k, a in enumerate(L.slot_addr):
        if a is not None:
            prog.ptrs[k] = ffi.cast("void *", a)
    prog.fp, prog.input_slots, prog.keep = L.fp, L.input_slots, L.keep
    prog.fpc = ffi.new("float[]", L.fp or [0.0])
    prog.blas = ffi.new("void *[2]", [ffi.cast("void *", a) for a in prog.sgemm]) if prog.sgemm else ffi.NULL
    fn = _registry.kernel("plan_run", isa)
    prog.segments = [(kind, seg) if kind == "py" else ("c", (fn, ffi.new("int64_t[]", _assemble(seg)),
                                                    sum(len(body) for _, body, _ in seg), [st for st, _, _ in seg]))
                     for kind, seg in raw]
    return prog


def _assemble(seg):
    """one segment's program: its records, then their descriptors (a record's desc field is the
    offset of its descriptor in the program)"""
    flat = []
    pos = sum(len(body) for _, body, _ in seg)
    for _, body, desc in seg:
        if desc is not None:
            body = list(body)
            body[2 + _DESC_FIELD[body[0]]] = pos
            pos += len(desc)
        flat += body
    for _, _, desc in seg:
        if desc is not None:
            flat += desc
    return flat


def allocate(graph, steps):
    """One arena buffer per computed node that owns storage (node id -> flat ndarray);
    intermediates whose lifetimes do not overlap share memory (greedy first fit); outputs get
    their own; constants and KV caches are their own arrays."""
    out_roots = {_view_root(n)[0].id for n in graph.outputs}   # an output may be a view of a computed node
    last_use = {}
    for i, st in enumerate(steps):
        for a in st.ins:
            if a is not None:
                last_use[_view_root(a)[0].id] = i
    buffers = {}
    for n in graph.nodes:
        if n.op in ("cache_write", "kv_write"):  # the user's cache array is the node's buffer
            buffers[n.id] = n.params["cache"].reshape(-1)
    free = []  # (size, array)
    for i, st in enumerate(steps):
        for o in st.outs:
            if o is None or o.id in buffers:
                continue
            size = math.prod(o.shape)
            arr = None
            if o.id not in out_roots:
                for j, (sz, a) in enumerate(free):
                    if sz >= size:
                        arr = a
                        free.pop(j)
                        break
            if arr is None:
                arr = np.empty(max(size, 1), o.dtype)
            buffers[o.id] = arr
        for a in st.ins + st.outs:
            if a is None:
                continue
            root = _view_root(a)[0]
            if last_use.get(root.id, -1) == i and root.id in buffers and root.id not in out_roots \
                    and root.op not in ("input", "const", "cache_write", "kv_write"):
                free.append((buffers[root.id].size, buffers[root.id]))
                del last_use[root.id]
        free.sort(key=lambda t: t[0])
    for n in graph.nodes:
        if n.op == "const":
            buffers[n.id] = n.value.reshape(-1)
    return buffers


class _Lowerer:
    """The pointer table and float parameters of a program being lowered: the records' slot,
    fparam, keep_array and wslot allocate their entries."""

    def __init__(self, buffers, sgemm):
        self.buffers, self.sgemm = buffers, sgemm
        self.slots, self.slot_addr, self.input_slots, self.keep, self.fp = {}, [], [], [], []

    def slot(self, node):
        """pointer-table index for a node's first element (-1 for None)"""
        if node is None:
            return -1
        root, st, off = _view_root(node)
        key = (root.id, off)
        if key not in self.slots:
            self.slots[key] = len(self.slot_addr)
            if root.op == "input":
                self.slot_addr.append(None)
                self.input_slots.append((len(self.slot_addr) - 1, root.name, off * root.dtype.itemsize))
            else:
                buf = self.buffers[root.id]
                self.slot_addr.append(buf.ctypes.data + off * buf.itemsize)
        return self.slots[key]

    def fparam(self, v):
        self.fp.append(float(v))
        return len(self.fp) - 1

    def keep_array(self, a):
        """a constant array the program points at (ALiBi slopes): kept alive by the plan"""
        a = np.ascontiguousarray(a, dtype=np.float32)
        self.keep.append(a)
        self.slots[("keep", len(self.keep))] = len(self.slot_addr)
        self.slot_addr.append(a.ctypes.data)
        return len(self.slot_addr) - 1

    def wslot(self, w):
        """pointer-table index for a QTensor's GGUF bytes (the tensor is kept alive by the plan)"""
        from ..quant.matmul import _wptr
        key = ("w", id(w))
        if key not in self.slots:
            self.keep.append(w)
            self.slots[key] = len(self.slot_addr)
            self.slot_addr.append(_wptr(w)[1])
        return self.slots[key]


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


def _qmm_record(st, L):
    """OP_QMM for a qmatmul / qmatmul_swiglu step (its descriptor as quant.inc's QM_* / QW_*)"""
    p = st.params
    x, nw = st.ins[:2]
    res = st.ins[2] if len(st.ins) > 2 else None   # QMATMUL -> ADD: the residual added in the epilogue
    ws = p["ws"]
    epi = {"qmatmul_swiglu": 1, "qmatmul_geglu": 3}.get(st.kind, 2 if res is not None else 0)
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
                0 if res is None else (rgeo[1] if rows > 1 else ws[0].shape[0]))
    wsl = [L.wslot(w) for w in ws] + [-1] * (3 - len(ws))
    ysl = [L.slot(o) for o in st.outs] + [-1] * (3 - len(st.outs))
    eps = L.fparam(p["eps"] if do_norm else 0.0)
    return R.QMM.pack(desc=0, x=L.slot(x), nw=L.slot(nw) if do_norm else -1, f_eps=eps,
                      w0=wsl[0], w1=wsl[1], w2=wsl[2], y0=ysl[0], y1=ysl[1], y2=ysl[2],
                      res=L.slot(res) if res is not None else -1), d


def _rope_record(st, L):
    """OP_ROPE for a rope or rope_cache step: descriptor RP_* then the RPF_* doubles' bits"""
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
    return R.ROPE.pack(desc=0, x=L.slot(x), pos=L.slot(pos), ff=ffs, y=y, pos0=p0, n_ctx=n_ctx,
                       row_bytes=row_b), d


def _geom(node):
    _, st, _ = _view_root(node)
    pad = 4 - len(node.shape)
    return (1,) * pad + node.shape, [0] * pad + list(st)


def _contig(node):
    return _is_contig(node.shape, _view_root(node)[1])


def _record(st, L):
    """([op, nargs, args...], descriptor or None) for a step the C executor can run, else None"""
    k, S, G = st.kind, L.slot, _geom
    ins, outs = st.ins, st.outs
    if k in ("add", "mul", "swiglu", "geglu"):
        out = outs[0]
        a, b = ins
        if k not in ("swiglu", "geglu") and a.shape != out.shape:
            a, b = b, a
        if a.shape != out.shape or not (_contig(a) and _contig(b) and _contig(out)):
            return None
        if k in ("swiglu", "geglu"):
            rec = R.SWIGLU if k == "swiglu" else R.GEGLU
            return rec.pack(n=math.prod(out.shape), g=S(a), u=S(b), nb=math.prod(b.shape), y=S(out)), None
        rec = R.ADD if k == "add" else R.MUL
        return rec.pack(n=math.prod(out.shape), a=S(a), b=S(b), nb=math.prod(b.shape), y=S(out)), None
    if k in ("scale", "silu", "gelu", "softcap"):
        a, out = ins[0], outs[0]
        if not (_contig(a) and _contig(out)):
            return None
        if k == "gelu":
            return R.GELU.pack(n=math.prod(out.shape), a=S(a), y=S(out)), None
        if k == "softcap":
            c = st.params["cap"]
            return R.SOFTCAP.pack(n=math.prod(out.shape), a=S(a), f_inv=L.fparam(np.float32(1.0) / np.float32(c)),
                                  f_c=L.fparam(c), y=S(out)), None
        if k == "scale":
            return R.SCALE.pack(n=math.prod(out.shape), a=S(a), f_s=L.fparam(st.params["s"]), y=S(out)), None
        return R.SILU.pack(n=math.prod(out.shape), a=S(a), y=S(out)), None
    if k in ("rms_norm", "add_rms_norm"):
        x, r, w, b = ins
        h, y = outs
        g = lambda n: G(n) if n is not None else None  # noqa: E731
        desc = _norms.rms_desc(G(x), G(y), g(h), g(r), g(w), g(b))
        return R.RMS_NORM.pack(desc=0, x=S(x), r=S(r), w=S(w), b=S(b), f_eps=L.fparam(st.params["eps"]),
                               h=S(h), y=S(y), fused=1), desc
    if k == "softmax":
        x, m, sk = ins
        y = outs[0]
        slopes = None
        if st.params["max_bias"] > 0:
            slopes = L.keep_array(_checks._slopes(G(x)[0][1], st.params["max_bias"]))
        mkind = 0 if m is None else (2 if m.dtype == F16 else 1)
        desc = _softmax.softmax_desc(G(x), G(y), G(m) if m is not None else None, mkind)
        return R.SOFTMAX.pack(desc=0, x=S(x), mask=S(m), slopes=slopes if slopes is not None else -1, sinks=S(sk),
                              f_scale=L.fparam(st.params["scale"]), y=S(y), fused=1), desc
    if k == "flash_attn":
        q, kk, v, m, sk = ins
        out = outs[0]
        p = st.params
        slopes = None
        if p["max_bias"] > 0 and m is not None:
            slopes = L.keep_array(_checks._slopes(q.shape[1], p["max_bias"]))
        mkind = 0 if m is None else (2 if m.dtype == F16 else 1)
        N, T = q.shape[2], kk.shape[2]
        desc = _attn.fa_desc(G(q), G(kk), G(v), G(out), G(m) if m is not None else None, mkind,
                            kk.dtype == F16, v.dtype == F16, _attn.choose_strategy(N, T),
                            _attn.DEFAULT_SPLIT_CHUNK, 64)
        return R.FLASH_ATTN.pack(desc=0, q=S(q), k=S(kk), v=S(v), mask=S(m),
                                 slopes=slopes if slopes is not None else -1, sinks=S(sk),
                                 f_scale=L.fparam(p["scale"]), f_softcap=L.fparam(p["softcap"]),
                                 out=S(out), fused=1), desc
    if k == "matmul":
        a, b = ins
        c = outs[0]
        if not L.sgemm or not (_contig(a) and _contig(b) and _contig(c)):
            return None
        M, K = a.shape
        N = b.shape[1]
        return R.GEMM.pack(m=M, n=N, k=K, a=S(a), lda=K, b=S(b), ldb=N, c=S(c), ldc=N), None
    if k == "copy":
        a, out = ins[0], outs[0]
        ga, go = G(a), G(out)
        return R.COPY.pack(desc=0, src=S(a), dst=S(out), esize=a.dtype.itemsize), list(ga[0]) + ga[1] + go[1]
    if k == "concat":
        a, b = ins
        out = outs[0]
        ax = st.params["axis"]
        root, ost, off = _view_root(out)
        pad = 4 - len(out.shape)
        recs = []
        for src, start in ((a, 0), (b, a.shape[ax])):
            gs = G(src)
            key_node = Node(-1, "part", [], {}, src.shape, out.dtype, f"{out.name}.part")
            key_node.view_of, key_node.view_strides = root, ost
            key_node.view_offset = off + start * ost[ax]
            recs.append((R.COPY.pack(desc=0, src=S(src), dst=S(key_node), esize=out.dtype.itemsize),
                         list(gs[0]) + gs[1] + [0] * pad + list(ost)))
        return recs
    if k in ("qmatmul", "qmatmul_swiglu", "qmatmul_geglu"):
        return _qmm_record(st, L)
    if k in ("rope", "rope_cache"):
        return _rope_record(st, L)
    if k == "cache_write":
        src, p0 = ins
        cw = outs[0]
        if not _contig(src):
            return None
        return R.CACHE_WRITE.pack(n=math.prod(src.shape), src=S(src), cache=S(cw), pos0=S(p0), n_ctx=cw.shape[0],
                                  t=src.shape[0], f16=cw.dtype == F16), None
    if k == "kv_write":
        src, cells = ins
        kv = outs[0]
        if not _contig(src):
            return None
        return R.KV_WRITE.pack(n=src.shape[0], src=S(src), cache=S(kv), cells=S(cells), n_cells=kv.shape[0],
                               row=kv.shape[1] * kv.shape[2], f16=kv.dtype == F16), None
    if k == "attn_seqs":
        q, kc, vc, seqs = ins
        out = outs[0]
        if not (_contig(q) and _contig(out)):
            return None
        n, H, D = q.shape
        return R.ATTN_SEQS.pack(q=S(q), k=S(kc), v=S(vc), seqs=S(seqs), ngroups=seqs.shape[0], out=S(out), n=n, h=H,
                                hkv=kc.shape[1], d=D, n_cells=kc.shape[0], kf16=kc.dtype == F16,
                                vf16=vc.dtype == F16, split_min_t=_attn.SPLIT_MIN_T,
                                tiled_min_n=_attn.TILED_MIN_N, chunk=_attn.DEFAULT_SPLIT_CHUNK,
                                f_scale=L.fparam(st.params["scale"]),
                                f_softcap=L.fparam(st.params["softcap"]), swa=st.params["window"], ring=st.params["ring"]), None
    if k == "gather_rows":
        x, idx = ins
        out = outs[0]
        if not (_contig(x) and _contig(out)):
            return None
        return R.GATHER_ROWS.pack(m=out.shape[0], src=S(x), idx=S(idx), dst=S(out), row=x.shape[1],
                                  n_src=x.shape[0]), None
    return None
