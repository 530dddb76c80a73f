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
from .ir import Dim, GraphError, _view_root
from .kinds import KIND, RECORDS

_BY_OP = {r.op: r for r in RECORDS}

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
    pointers; input_slots: (pointer slot, input name, byte offset) filled at bind; output_slots: per
    graph output, the (pointer slot, byte offset, its pointer) triples into its buffer (run's `out`); keep: the
    objects the program points into; sgemm, sgemm_why: numpy's cblas_sgemm, or why not;
    affine: per segment, {dim: (indices, slopes)} of its program's fields that depend on the
    dynamic sizes (a graph built with ir.Dim sizes; the program holds their values at the
    capacities, and a field is value - slope * (capacity - size)), or None for a Python step."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def lower(graph, steps, isa):
    """The lowering stage: the steps as a Program (buffers allocated, records packed)."""
    native = isa != "numba" and _backend.lib is not None
    buffers = allocate(graph, steps)
    inputs = [n for n in graph.nodes if n.op == "input"]
    prog = Program(graph=graph, steps=steps, isa=isa, native=native, buffers=buffers, inputs=inputs,
                   segments=[("py", st) for st in steps], ptrs=None, fp=[], fpc=None, blas=None, ilp64=0,
                   input_slots=[], output_slots=[], keep=[], sgemm=None, sgemm_why=None,
                   affine=[None] * len(steps))
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
        rec = KIND[st.kind].lower(st, L) if st.kind not in PY_STEPS else None
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
    # per graph output: the pointer slots into its buffer, (slot, byte offset in it, the slot's own pointer);
    # run(out=...) points them at the caller's arrays for one run, then back to the pointer kept here
    prog.output_slots = []
    for node in graph.outputs:
        root = _view_root(node)[0]
        prog.output_slots.append([(s, key[1] * root.dtype.itemsize, prog.ptrs[s]) for key, s in L.slots.items()
                                  if type(key[0]) is int and key[0] == root.id])
    prog.fpc = ffi.new("float[]", L.fp or [0.0])
    prog.blas = ffi.new("void *[2]", [ffi.cast("void *", a) for a in prog.sgemm]) if prog.sgemm else ffi.NULL
    fn = _registry.kernel("plan_run", isa)
    prog.segments, prog.affine = [], []
    for kind, seg in raw:
        if kind == "py":
            prog.segments.append((kind, seg))
            prog.affine.append(None)
            continue
        flat = _assemble(seg)
        prog.segments.append(("c", (fn, ffi.new("int64_t[]", [int(v) for v in flat]),
                                    sum(len(body) for _, body, _ in seg), [st for st, _, _ in seg])))
        prog.affine.append(_slopes(flat))
    return prog


def _slopes(flat):
    """{dim: (indices, slopes)} of a program's size-dependent fields (the Dims among its values)"""
    out = {}
    for i, v in enumerate(flat):
        if isinstance(v, Dim):
            for d, c in v.coef.items():
                out.setdefault(d, ([], []))
                out[d][0].append(i)
                out[d][1].append(c)
    return {d: (np.array(ix, np.intp), np.array(sl, np.int64)) for d, (ix, sl) in out.items()}


def _assemble(seg):
    """one segment's program: its records, then their descriptors (a record's desc field is the
    offset of its descriptor in the program)"""
    flat = []
    pos = sum(len(body) for _, body, _ in seg)
    for _, body, desc in seg:
        if desc is not None:
            body = list(body)
            body[2 + _BY_OP[body[0]].index["desc"]] = pos
            pos += len(desc)
        flat += body
    for _, _, desc in seg:
        if desc is not None:
            flat += desc
    return flat


AFTER_KINDS = ("rms_norm", "rope", "kv_write")
AFTER_MAX = 8      # native/kernels/graph.inc QM_AFTER_MAX
AFTER_ROWS = 3     # the most rows of a QMM whose task region runs the records after it (plan_after_of)


def _after_windows(steps):
    """step i -> the last step of the window it lies in (i where none): a decode-sized qmatmul (at most
    AFTER_ROWS rows) and the rms_norm, rope and kv_write steps right after it (at most AFTER_MAX), which
    the C executor may run in the matmul's task region, concurrently (graph.inc plan_after_of). A buffer
    freed inside a window is reused only after it, so no step of the window writes over what another
    one (or the matmul) still reads; plan_after_of checks the spans and runs them one by one otherwise."""
    end = list(range(len(steps)))
    for i, st in enumerate(steps):
        lead = st.outs[0].shape[:-1] if st.kind == "qmatmul" and st.outs and st.outs[0] is not None else None
        if lead is None or not all(isinstance(d, int) for d in lead) or math.prod(lead) > AFTER_ROWS:
            continue
        j = i
        while j + 1 < len(steps) and j - i < AFTER_MAX and steps[j + 1].kind in AFTER_KINDS:
            j += 1
        for k in range(i, j + 1):
            end[k] = j
    return end


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
    hold = _after_windows(steps)
    free, held = [], []  # (size, array); held: freed inside a window, free at its end
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
                (held if hold[i] > i else free).append((buffers[root.id].size, buffers[root.id]))
                del last_use[root.id]
        if held and hold[i] == i:
            free += held
            held = []
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
        if isinstance(off, Dim):   # a pointer is not patched per size
            raise GraphError(f"{node.name!r}: a view whose offset depends on the sizes {sorted(off.coef)}")
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

    def wslots(self, w):
        """the first of n_expert consecutive pointer-table entries, expert e's weight (w.expert(e), a
        2-D view over its slab) at first + e: a record's array of weight pointers"""
        from ..quant.matmul import _wptr
        key = ("warr", id(w))
        if key not in self.slots:
            self.keep.append(w)
            self.slots[key] = len(self.slot_addr)
            for e in range(w.n_expert):
                self.slot_addr.append(_wptr(w.expert(e))[1])
        return self.slots[key]
