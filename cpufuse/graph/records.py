"""Lowering of steps to the C plan executor's records (cf_plan_run, native/kernels/graph.inc): the
pointer table, float parameters, descriptors, and the program of each C segment."""
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
_DESC_OPS = frozenset(r.op for r in RECORDS if r.has_desc)  # records whose args[0] is a descriptor

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
    """Plan's program half: _build_program() turns self.steps into segments (C records or
    Python steps)."""

    # -- program ---------------------------------------------------------------------------------
    def _build_program(self):
        """Segments: runs of steps executed by one cf_plan_run call, or single numpy steps."""
        self.sgemm, self.ilp64, self.sgemm_why = None, 0, None
        self._inputs = [n for n in self.graph.nodes if n.op == "input"]
        self.segments = []
        if not self.native:
            self.segments = [("py", st) for st in self.steps]
            return
        addr, ilp = _sgemm()
        if addr:
            self.sgemm, self.ilp64 = addr, ilp
        else:
            self.sgemm_why = ilp
        ffi = _backend.ffi
        self._slots, self._slot_addr, self._input_slots, self._keep = {}, [], [], []
        self._fp = []
        cur = None
        for st in self.steps:
            rec = self._record(st) if st.kind not in PY_STEPS else None
            if rec is None:
                self.segments.append(("py", st))
                cur = None
                continue
            if cur is None:
                cur = {"recs": [], "descs": [], "steps": []}
                self.segments.append(("c", cur))
            for body, desc in (rec if isinstance(rec, list) else [rec]):
                if desc is not None:
                    body[2] = -1 - len(cur["descs"])  # patched below: offset of this descriptor
                    cur["descs"].append(desc)
                cur["recs"].append(body)
                cur["steps"].append(st)
        self._ptrs = ffi.new("void *[]", max(1, len(self._slot_addr)))
        for k, a in enumerate(self._slot_addr):
            if a is not None:
                self._ptrs[k] = ffi.cast("void *", a)
        self._fpc = ffi.new("float[]", self._fp or [0.0])
        fn = _registry.kernel("plan_run", self.isa)
        segs = []
        for kind, seg in self.segments:
            if kind == "py":
                segs.append((kind, seg))
                continue
            flat = []
            for body in seg["recs"]:
                flat += body
            nrec = len(flat)
            offs, pos = [], nrec
            for dsc in seg["descs"]:
                offs.append(pos)
                pos += len(dsc)
            k = 0
            for body in seg["recs"]:
                if body[2] < 0 and body[0] in _DESC_OPS:
                    flat[k + 2] = offs[-1 - body[2]]
                k += len(body)
            for dsc in seg["descs"]:
                flat += dsc
            prog = ffi.new("int64_t[]", flat)
            segs.append(("c", (fn, prog, nrec, seg["steps"])))
        self.segments = segs
        self._blas = ffi.new("void *[2]", [ffi.cast("void *", a) for a in self.sgemm]) if self.sgemm else ffi.NULL

    def _slot(self, node):
        """pointer-table index for a node's first element (-1 for None)"""
        if node is None:
            return -1
        root, st, off = _view_root(node)
        key = (root.id, off)
        if key not in self._slots:
            self._slots[key] = len(self._slot_addr)
            if root.op == "input":
                self._slot_addr.append(None)
                self._input_slots.append((len(self._slot_addr) - 1, root.name, off * root.dtype.itemsize))
            else:
                buf = self.buffers[root.id]
                self._slot_addr.append(buf.ctypes.data + off * buf.itemsize)
        return self._slots[key]

    def _fparam(self, v):
        self._fp.append(float(v))
        return len(self._fp) - 1

    def _keep_array(self, a):
        """a constant array the program points at (ALiBi slopes): kept alive by the plan"""
        a = np.ascontiguousarray(a, dtype=np.float32)
        self._keep.append(a)
        self._slots[("keep", len(self._keep))] = len(self._slot_addr)
        self._slot_addr.append(a.ctypes.data)
        return len(self._slot_addr) - 1

    def _wslot(self, w):
        """pointer-table index for a QTensor's GGUF bytes (the tensor is kept alive by the plan)"""
        from ..quant.matmul import _wptr
        key = ("w", id(w))
        if key not in self._slots:
            self._keep.append(w)
            self._slots[key] = len(self._slot_addr)
            self._slot_addr.append(_wptr(w)[1])
        return self._slots[key]

    @staticmethod
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

    def _qmm_record(self, st):
        """OP_QMM for a qmatmul / qmatmul_swiglu step (its descriptor as quant.inc's QM_* / QW_*)"""
        p = st.params
        x, nw = st.ins[:2]
        res = st.ins[2] if len(st.ins) > 2 else None   # QMATMUL -> ADD: the residual added in the epilogue
        ws = p["ws"]
        epi = {"qmatmul_swiglu": 1, "qmatmul_geglu": 3}.get(st.kind, 2 if res is not None else 0)
        geo = self._rows(x)
        if geo is None or not all(self._contig(o) for o in st.outs):
            return None
        rows, xs = geo
        rgeo = self._rows(res) if res is not None else (rows, 0)
        if rgeo is None or rgeo[0] != rows:
            return None
        K = ws[0].shape[1]
        if rows == 0 or any(math.prod(o.shape) == 0 for o in st.outs):
            return None
        if nw is not None and not self._contig(nw):
            return None
        from ..quant.matmul import qm_desc
        do_norm = 1 if p["eps"] is not None else 0
        d = qm_desc(rows, K, xs if rows > 1 else K, p["act"] == "q8", epi, do_norm, ws,
                    [ws[0].shape[0] if epi else w.shape[0] for w in ws],
                    0 if res is None else (rgeo[1] if rows > 1 else ws[0].shape[0]))
        wsl = [self._wslot(w) for w in ws] + [-1] * (3 - len(ws))
        ysl = [self._slot(o) for o in st.outs] + [-1] * (3 - len(st.outs))
        eps = self._fparam(p["eps"] if do_norm else 0.0)
        return R.QMM.pack(desc=0, x=self._slot(x), nw=self._slot(nw) if do_norm else -1, f_eps=eps,
                          w0=wsl[0], w1=wsl[1], w2=wsl[2], y0=ysl[0], y1=ysl[1], y2=ysl[2],
                          res=self._slot(res) if res is not None else -1), d

    def _rope_record(self, st):
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
        ffs = self._keep_array(ff) if ff is not None else -1
        if st.kind == "rope_cache":
            cw = st.outs[0]
            cache = p["cache"]
            f16 = cache.dtype == F16
            y, p0, n_ctx, row_b = self._slot(cw), self._slot(st.ins[2]), cache.shape[0], H * D * cache.itemsize
        else:
            out = st.outs[0]
            if not self._contig(out):
                return None
            f16, y, p0, n_ctx, row_b = False, self._slot(out), -1, 0, 0
        d = _rope.rp_desc(T, H, D, nd, m, compat, f16, xst[0], xst[1], H * D, D, nco)
        assert len(fps) == RPF.LEN
        d += np.array(fps, np.float64).view(np.int64).tolist()
        return R.ROPE.pack(desc=0, x=self._slot(x), pos=self._slot(pos), ff=ffs, y=y, pos0=p0, n_ctx=n_ctx,
                           row_bytes=row_b), d

    @staticmethod
    def _geom(node):
        _, st, _ = _view_root(node)
        pad = 4 - len(node.shape)
        return (1,) * pad + node.shape, [0] * pad + list(st)

    @staticmethod
    def _contig(node):
        return _is_contig(node.shape, _view_root(node)[1])

    def _record(self, st):
        """([op, nargs, args...], descriptor or None) for a step the C executor can run, else None"""
        k, S, G = st.kind, self._slot, self._geom
        ins, outs = st.ins, st.outs
        if k in ("add", "mul", "swiglu", "geglu"):
            out = outs[0]
            a, b = ins
            if k not in ("swiglu", "geglu") and a.shape != out.shape:
                a, b = b, a
            if a.shape != out.shape or not (self._contig(a) and self._contig(b) and self._contig(out)):
                return None
            if k in ("swiglu", "geglu"):
                rec = R.SWIGLU if k == "swiglu" else R.GEGLU
                return rec.pack(n=math.prod(out.shape), g=S(a), u=S(b), nb=math.prod(b.shape), y=S(out)), None
            rec = R.ADD if k == "add" else R.MUL
            return rec.pack(n=math.prod(out.shape), a=S(a), b=S(b), nb=math.prod(b.shape), y=S(out)), None
        if k in ("scale", "silu", "gelu", "softcap"):
            a, out = ins[0], outs[0]
            if not (self._contig(a) and self._contig(out)):
                return None
            if k == "gelu":
                return R.GELU.pack(n=math.prod(out.shape), a=S(a), y=S(out)), None
            if k == "softcap":
                c = st.params["cap"]
                return R.SOFTCAP.pack(n=math.prod(out.shape), a=S(a), f_inv=self._fparam(np.float32(1.0) / np.float32(c)),
                                      f_c=self._fparam(c), y=S(out)), None
            if k == "scale":
                return R.SCALE.pack(n=math.prod(out.shape), a=S(a), f_s=self._fparam(st.params["s"]), y=S(out)), None
            return R.SILU.pack(n=math.prod(out.shape), a=S(a), y=S(out)), None
        if k in ("rms_norm", "add_rms_norm"):
            x, r, w, b = ins
            h, y = outs
            g = lambda n: G(n) if n is not None else None  # noqa: E731
            desc = _norms.rms_desc(G(x), G(y), g(h), g(r), g(w), g(b))
            return R.RMS_NORM.pack(desc=0, x=S(x), r=S(r), w=S(w), b=S(b), f_eps=self._fparam(st.params["eps"]),
                                   h=S(h), y=S(y), fused=1), desc
        if k == "softmax":
            x, m, sk = ins
            y = outs[0]
            slopes = None
            if st.params["max_bias"] > 0:
                slopes = self._keep_array(_checks._slopes(G(x)[0][1], st.params["max_bias"]))
            mkind = 0 if m is None else (2 if m.dtype == F16 else 1)
            desc = _softmax.softmax_desc(G(x), G(y), G(m) if m is not None else None, mkind)
            return R.SOFTMAX.pack(desc=0, x=S(x), mask=S(m), slopes=slopes if slopes is not None else -1, sinks=S(sk),
                                  f_scale=self._fparam(st.params["scale"]), y=S(y), fused=1), desc
        if k == "flash_attn":
            q, kk, v, m, sk = ins
            out = outs[0]
            p = st.params
            slopes = None
            if p["max_bias"] > 0 and m is not None:
                slopes = self._keep_array(_checks._slopes(q.shape[1], p["max_bias"]))
            mkind = 0 if m is None else (2 if m.dtype == F16 else 1)
            N, T = q.shape[2], kk.shape[2]
            desc = _attn.fa_desc(G(q), G(kk), G(v), G(out), G(m) if m is not None else None, mkind,
                                kk.dtype == F16, v.dtype == F16, _attn.choose_strategy(N, T),
                                _attn.DEFAULT_SPLIT_CHUNK, 64)
            return R.FLASH_ATTN.pack(desc=0, q=S(q), k=S(kk), v=S(v), mask=S(m),
                                     slopes=slopes if slopes is not None else -1, sinks=S(sk),
                                     f_scale=self._fparam(p["scale"]), f_softcap=self._fparam(p["softcap"]),
                                     out=S(out), fused=1), desc
        if k == "matmul":
            a, b = ins
            c = outs[0]
            if not self.sgemm or not (self._contig(a) and self._contig(b) and self._contig(c)):
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
            return self._qmm_record(st)
        if k in ("rope", "rope_cache"):
            return self._rope_record(st)
        if k == "cache_write":
            src, p0 = ins
            cw = outs[0]
            if not self._contig(src):
                return None
            return R.CACHE_WRITE.pack(n=math.prod(src.shape), src=S(src), cache=S(cw), pos0=S(p0), n_ctx=cw.shape[0],
                                      t=src.shape[0], f16=cw.dtype == F16), None
        if k == "kv_write":
            src, cells = ins
            kv = outs[0]
            if not self._contig(src):
                return None
            return R.KV_WRITE.pack(n=src.shape[0], src=S(src), cache=S(kv), cells=S(cells), n_cells=kv.shape[0],
                                   row=kv.shape[1] * kv.shape[2], f16=kv.dtype == F16), None
        if k == "attn_seqs":
            q, kc, vc, seqs = ins
            out = outs[0]
            if not (self._contig(q) and self._contig(out)):
                return None
            n, H, D = q.shape
            return R.ATTN_SEQS.pack(q=S(q), k=S(kc), v=S(vc), seqs=S(seqs), ngroups=seqs.shape[0], out=S(out), n=n, h=H,
                                    hkv=kc.shape[1], d=D, n_cells=kc.shape[0], kf16=kc.dtype == F16,
                                    vf16=vc.dtype == F16, split_min_t=_attn.SPLIT_MIN_T,
                                    tiled_min_n=_attn.TILED_MIN_N, chunk=_attn.DEFAULT_SPLIT_CHUNK,
                                    f_scale=self._fparam(st.params["scale"]),
                                    f_softcap=self._fparam(st.params["softcap"]), swa=st.params["window"], ring=st.params["ring"]), None
        if k == "gather_rows":
            x, idx = ins
            out = outs[0]
            if not (self._contig(x) and self._contig(out)):
                return None
            return R.GATHER_ROWS.pack(m=out.shape[0], src=S(x), idx=S(idx), dst=S(out), row=x.shape[1],
                                      n_src=x.shape[0]), None
        return None
