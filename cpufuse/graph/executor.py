"""Op graphs in the spirit of ggml's: build nodes, mark outputs, compile to a plan, run it often.

    g = cpufuse.Graph()
    x = g.input("x", (n_tok, 576))
    h = g.mul(g.rms_norm(x, eps=1e-5), g.constant(w_norm))      # fused to one RMS_NORM+MUL kernel
    g.output(h)
    plan = g.compile()            # fusion=False, or CPUFUSE_DISABLE_FUSION=1, keeps every node
    print(plan.describe())        # what was fused into what, and why other candidates were not
    (y,) = plan.run(x=arr)

Fusion legality follows docs/semantics.md §5 (ggml_can_fuse): the chain's nodes are consecutive in
execution order, every intermediate has exactly one consumer (counted per source slot), is not a
graph output and is not a view, and the shapes match. The rules:
  RMS_NORM -> MUL [-> ADD]        one rms_norm kernel with weight [and bias]
  ADD -> RMS_NORM -> MUL [-> ADD] the residual pattern: a two-output kernel writes h and y
                                  (h may have other consumers: it is the next residual)
  [SCALE ->] [ADD(mask) ->] SOFT_MAX   one soft_max_ext kernel
  SILU -> MUL                     one SwiGLU kernel
Quantized weights (g.qmatmul: a QTensor held as a parameter; these steps run inside the C plan
executor like the others, one cf_qmatmul / cf_rope call each, so a whole decoder layer (or model)
can be one C call; a step the executor cannot take, e.g. a non-contiguous operand, runs from Python):
  QMATMUL x2..3 on one input      one matmul_multi call, one shared activation quantization (QKV)
  QMATMUL(x,Wg) -> SILU -> MUL(., QMATMUL(x,Wu))   one matmul_swiglu call, products never stored
  RMS_NORM -> MUL(w) -> (one of the two above, or one QMATMUL)   the norm folded into the matmul's
                                  prologue (the MUL's consumers must be exactly that group's matmuls)
  ROPE -> CACHE_WRITE             one rope call writing the rotated rows into the KV cache
  QMATMUL [-> SCALE] -> ADD(r)    r + (s *) product in the matmul's epilogue, each op rounded as its kernel
  WSUM [-> SCALE] -> ADD(r)       the same in the weighted sum over k (in the down tasks at decode)
  QMATMUL -> SCALE                s * product in the epilogue (granite's logit scale after the head)
CACHE_WRITE (g.cache_write) has a side effect on a user-owned array: it is always executed, whether
or not it is marked as an output (every node of a graph runs; plans do no dead-node elimination).
A compiled plan owns its buffers (allocated once; intermediates share memory when their lifetimes
do not overlap) and runs the kernel sequence in one C call per segment (matmul included, through
numpy's own BLAS when its cblas_sgemm can be found, otherwise matmul runs through numpy between
C segments; quantized matmuls, RoPE and cache writes included, the cache row offset read from the
pos0 input and checked by the executor at run time), so a whole decoder stack with its KV-cache
writes is one C call; describe() ends with the segment split. graph.PY_STEPS forces step kinds
back to Python steps (to compare the two). Outputs are the plan's buffers: they are overwritten by the next run (copy=True to
get fresh arrays).
"""
import threading

import numpy as np

from .. import _backend, _dispatch
from .fusion import fuse
from .ir import Dim, GraphError, _view_root, at, compute_nodes
from .kinds import KIND
from .records import lower


def compile_graph(graph, fusion, isa):
    """Graph.compile's stages: fuse -> lower -> the executor."""
    if not graph.outputs and not any(n.op in ("cache_write", "kv_write") for n in graph.nodes):
        raise GraphError("the graph has no outputs: mark them with g.output(node)")
    steps, rejected = fuse(graph, fusion)
    return Plan(lower(graph, steps, isa), rejected, fusion)


class Plan:
    """The executor stage: runs a Program (records.lower) on named inputs (run, bind) and says what it
    holds (describe). rejected: the fusion candidates fuse() rejected; fusion: whether it fused."""

    def __init__(self, program, rejected=(), fusion=True):
        self.program, self.rejected, self.fusion = program, list(rejected), fusion
        p = program
        self.graph, self.steps, self.isa, self.native = p.graph, p.steps, p.isa, p.native
        self.buffers, self.segments, self.sgemm, self.sgemm_why = p.buffers, p.segments, p.sgemm, p.sgemm_why
        # a plan owns its intermediate and output buffers and its input-pointer table: runs of one
        # plan from several threads take turns (the soak test found them clobbering each other)
        self._lock = threading.Lock()

    def _array(self, node, inputs=None):
        """ndarray view of a node's data (inputs from the run's arguments)"""
        root, st, off = _view_root(node)
        base = inputs[root.name] if root.op == "input" else self.buffers[root.id]
        flat = base.reshape(-1)
        it = flat.itemsize
        return np.lib.stride_tricks.as_strided(flat[off:], shape=node.shape, strides=[s * it for s in st])

    def _segment_summary(self):
        """one line: how the steps split into C calls and Python steps"""
        if not self.native:
            return f"segments: {len(self.steps)} Python steps (isa {self.isa} has no C plan executor)"
        parts = []
        for kind, seg in self.segments:
            if kind == "c":
                n = len({id(s) for s in seg[3]})
                parts.append(f"C x{n}")
            else:
                parts.append(f"py {seg.kind}")
        nc = sum(1 for k, _ in self.segments if k == "c")
        head = ("segments: the whole plan is ONE C call" if [k for k, _ in self.segments] == ["c"]
                else f"segments: {nc} C call(s), {len(self.segments) - nc} Python step(s)")
        return head + " [" + ", ".join(parts) + "]"

    def describe(self):
        """Human-readable plan: every kernel call, the nodes it covers, and rejected fusions."""
        lines = [f"plan: {len(self.steps)} kernel calls for {len(compute_nodes(self.graph))} compute nodes, "
                 f"fusion {'on' if self.fusion else 'off'}, isa {self.isa}, matmul via "
                 + ("numpy BLAS from C" if self.sgemm else "numpy (Python)" + (f" ({self.sgemm_why})" if self.sgemm_why else ""))]
        for i, st in enumerate(self.steps):
            names = ", ".join(n.name for n in st.nodes)
            lines.append(f"  {i:3d} {st.kind:<12} [{names}]" + (f"  fused: {st.note}" if len(st.nodes) > 1 else ""))
        lines.append(self._segment_summary())
        if self.rejected:
            lines.append("rejected fusion candidates:")
            lines += [f"  - {r}" for r in dict.fromkeys(self.rejected)]
        return "\n".join(lines)

    __str__ = describe

    def run(self, copy=False, n_threads=None, out=None, **inputs):
        """Run the plan on named input arrays; returns the outputs in g.output() order (out: the
        bound callable's)."""
        return self.bind(**inputs)(copy=copy, n_threads=n_threads, out=out)

    def bind(self, **inputs):
        """Check the named input arrays once and return a callable `f(copy=False, n_threads=None,
        out=None)` that runs the plan on exactly these arrays (their contents may change between
        calls, not the arrays): the repeated-call form of run(), without its per-call checks.
        The outputs are the plan's own buffers, overwritten by its next run (copy=True returns
        copies), or with out (a tuple of one array or None per output, each of the output's dtype
        and shape) the out arrays, written straight by the kernels where the plan is one C call
        (_Out); runs of one plan from several threads are serialized by a lock."""
        arrays = {}
        for n in self.program.inputs:
            if n.name not in inputs:
                raise GraphError(f"run: missing input {n.name!r} (a {n.dtype} array of shape {n.shape}); "
                                 f"got inputs {sorted(inputs)}")
            a = inputs[n.name]
            if not isinstance(a, np.ndarray) or a.dtype != n.dtype or a.shape != n.shape:
                raise GraphError(f"run: input {n.name!r} must be a {n.dtype} array of shape {n.shape}, "
                                 f"got {getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
            f = a.flags   # a copy where the kernels could not read it in place (strided, or misaligned)
            arrays[n.name] = a if f.c_contiguous and f.aligned else np.require(a, requirements=("C", "A"))
        if len(inputs) != len(arrays):
            raise GraphError(f"run: unknown inputs {sorted(set(inputs) - set(arrays))}; the graph's inputs are "
                             f"{sorted(arrays)}")
        inp = []
        if self.native:
            from_buffer = _backend.ffi.from_buffer
            inp = [(slot, from_buffer(arrays[name]) + boff) for slot, name, boff in self.program.input_slots]
        outs = tuple(self._array(n, arrays) for n in self.graph.outputs)
        p = self.program
        ptrs, segments, fpc, blas, ilp64 = p.ptrs, p.segments, p.fpc, p.blas, p.ilp64
        one_call = self.native and all(k == "c" for k, _ in segments)
        ob = []   # the _Out, made at the first call with out (a run without out pays nothing for it)

        def bound(copy=False, n_threads=None, out=None):
            nth = _dispatch.threads(n_threads)
            idx = ()
            if out is not None:
                if not ob:
                    ob.append(_Out(self.program, outs, one_call, arrays.values()))
                out, idx = ob[0].prepare(out)
            with self._lock:
                for slot, p in inp:  # (re)point the plan at these inputs: another bind may have run since
                    ptrs[slot] = p
                _Out.point(ptrs, idx)
                try:
                    self._segments(segments, ptrs, fpc, blas, ilp64, nth, arrays)
                finally:
                    _Out.restore(ptrs, idx)
                if out is not None:
                    return _Out.result(out, outs, idx, copy)
                return tuple(o.copy() for o in outs) if copy else outs
        return bound

    def _segments(self, segments, ptrs, fpc, blas, ilp64, nth, arrays):
        """run the plan's segments (under the lock, its pointers set)"""
        for kind, seg in segments:
            if kind == "c":
                fn, prog, nrec, steps = seg
                rc = fn(prog, nrec, ptrs, fpc, blas, ilp64, nth)
                if rc:
                    bad = steps[rc - 1]
                    if KIND[bad.kind].explains:   # a run-time index out of range: say which
                        KIND[bad.kind].run(bad, _Run(self, arrays, nth))
                    raise GraphError(f"run: kernel call failed at {bad.kind} "
                                     f"[{', '.join(n.name for n in bad.nodes)}]")
            else:
                KIND[seg.kind].run(seg, _Run(self, arrays, nth))


class _Out:
    """A bound run's `out`: arrays that its outputs are written into, one per output (None: the plan's own
    buffer). Where the plan is one C call and an output fills its whole buffer, the C call writes straight
    into the caller's array: the pointer slots into that buffer (Program.output_slots) point at the array
    for the run and back to the buffer after it. Otherwise, or where the array overlaps an input or another
    out array, the output is copied into it after the run. Either way the array holds the same bytes."""
    __slots__ = ("slots", "direct", "spans", "want")

    def __init__(self, program, outs, one_call, inputs):
        self.slots = program.output_slots if one_call and program.output_slots else [[] for _ in outs]
        self.direct = [bool(sl) and o.flags.c_contiguous and o.size == size
                       for sl, o, size in zip(self.slots, outs, _buffer_sizes(program))]
        self.spans = [_span(a) for a in inputs]   # the inputs' bytes (C-contiguous: bind made them so)
        self.want = [(o.dtype, o.shape) for o in outs]

    def prepare(self, out):
        """check out (TypeError / ValueError naming out[i]); returns it as a list and, per output the C call
        writes into its out array, (slots, the array's pointer)"""
        want = self.want
        if not isinstance(out, (tuple, list)) or len(out) != len(want):
            got = f"a {type(out).__name__}" + (f" of {len(out)}" if isinstance(out, (tuple, list)) else "")
            raise TypeError(f"out must be a tuple of {len(want)} arrays (or None), one per output, got {got}")
        spans, base, ffi = {}, {}, _backend.ffi
        for i, a in enumerate(out):
            if a is None:
                continue
            dt, shape = want[i]
            if not isinstance(a, np.ndarray) or a.dtype != dt or a.shape != shape:
                raise ValueError(f"out[{i}] must be a {dt} array of shape {shape}, got "
                                 f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
            f = a.flags
            if not (f.c_contiguous and f.aligned and f.writeable):
                raise ValueError(f"out[{i}] must be a C-contiguous, aligned, writeable array")
            if self.direct[i]:   # the pointer the slots get, and its address
                base[i] = ffi.from_buffer(a)
                lo = int(ffi.cast("uintptr_t", base[i]))
                spans[i] = (lo, lo + a.nbytes)
            else:
                spans[i] = _span(a)
        # an out array over an input (the kernels would write what they still read) or over another out array:
        # copied in after the run instead
        pts = []
        for i, p in base.items():
            lo, hi = spans[i]
            if not any(lo < h and l < hi for l, h in self.spans) and \
                    not any(j != i and lo < h and l < hi for j, (l, h) in spans.items()):
                pts.append((i, self.slots[i], p))
        return list(out), pts

    @staticmethod
    def point(ptrs, pts):
        for _, slots, base in pts:
            for sl, boff, _ in slots:
                ptrs[sl] = base + boff

    @staticmethod
    def restore(ptrs, pts):
        for _, slots, _ in pts:
            for sl, _, p in slots:
                ptrs[sl] = p

    @staticmethod
    def result(out, outs, pts, copy):
        """what the run returns: the out arrays (filled: pointed at, or copied into), the plan's buffers elsewhere"""
        done = {i for i, _, _ in pts}
        res = []
        for i, o in enumerate(outs):
            a = out[i]
            if a is None:
                res.append(o.copy() if copy else o)
            else:
                if i not in done:
                    np.copyto(a, o)
                res.append(a)
        return tuple(res)


def _span(a):
    """a C-contiguous array's byte range"""
    lo = a.__array_interface__["data"][0]
    return lo, lo + a.nbytes


def _buffer_sizes(program):
    """per graph output: its buffer's elements where the output starts at the buffer's first one, else -1"""
    sizes = []
    for node in program.graph.outputs:
        root, _, off = _view_root(node)
        buf = program.buffers.get(root.id) if root.op != "input" else None
        sizes.append(buf.size if buf is not None and off == 0 else -1)
    return sizes


class _Run:
    """What a step's Python execution (kinds.py, run) sees: X.a(node) a node's array (the run's
    inputs or the plan's buffers), X.isa, X.nth, X.pos0(...)"""
    __slots__ = ("plan", "arrays", "isa", "nth")

    def __init__(self, plan, arrays, nth):
        self.plan, self.arrays, self.isa, self.nth = plan, arrays, plan.isa, nth

    def a(self, node):
        return None if node is None else self.plan._array(node, self.arrays)

    def pos0(self, node, n_tokens, cw):
        """the cache row offset read from input `node` for n_tokens rows of cache_write node cw"""
        p0 = int(self.a(node)[0])
        n_ctx = cw.shape[0]
        if p0 < 0 or p0 + n_tokens > n_ctx:
            raise GraphError(f"run: cache_write {cw.name!r}: rows [{p0}, {p0 + n_tokens}) of input "
                             f"{node.name!r} do not fit the cache's n_ctx={n_ctx}")
        return p0


class DynamicPlan:
    """A plan compiled once and run at any size up to its capacity in its dynamic dimensions.

        dp = DynamicPlan(build, {"n": 512})      # build(n=...) -> Graph, e.g. n tokens
        (y,) = dp.run({"n": 37}, x=x37, ...)     # exactly 37 rows computed: no padding

    The graph is built once with each dimension an ir.Dim (its capacity, which knows its slope):
    every shape, stride and record field computed from it is affine in the sizes, and the lowering
    records each size-dependent field of the program with its slope (Program.affine). A run
    patches a copy of the program, field = value - slope * (capacity - size), and runs it on the
    capacity plan's buffers. A kernel choice that depends on the size (a flash_attn strategy over
    the rows) is refused with a GraphError (ir.same_over_sizes); attn_seqs chooses its strategy per
    sequence at run time. The results are those of a plan compiled for the exact size
    (tests/test_graph_dynamic.py). A plan that is not one C call (Python steps: no extension, numba,
    a step C cannot run) runs one plan per size instead, compiled lazily."""

    def __init__(self, build, dims, fusion=None, isa=None):
        if not dims or any(int(c) < 1 for c in dims.values()):
            raise GraphError(f"DynamicPlan: dims must map names to capacities >= 1, got {dims!r}")
        self.build, self.dims = build, {k: int(v) for k, v in dims.items()}
        self.fusion, self.isa = fusion, isa
        self._per_size = {}
        self._cache = {}   # sizes -> _at_sizes(sizes)
        self.plan = build(**{d: Dim.var(d, c) for d, c in self.dims.items()}).compile(fusion, isa)
        p = self.plan.program
        self.native = p.native and [k for k, _ in p.segments] == ["c"]
        self.fixed = [] if self.native else list(self.dims)   # Python steps: one plan per size
        if not self.native:
            return
        self._fn, prog, self._nrec, self._steps = p.segments[0][1]
        self._base = np.frombuffer(_backend.ffi.buffer(prog), np.int64).copy()
        self._affine = [(d, ix, sl) for d, (ix, sl) in p.affine[0].items()]
        self._prog = prog
        self._in = {n.name: (n.dtype, n.shape, tuple(int(v) for v in n.shape)) for n in p.inputs}
        self._outs = []
        for node in self.plan.graph.outputs:
            root, st, off = _view_root(node)
            if isinstance(off, Dim):
                raise GraphError(f"DynamicPlan: output {node.name!r} starts at an offset that depends on the sizes")
            self._outs.append((self.plan.buffers[root.id].reshape(-1)[off:], node.shape, st))
        self._full = tuple(self._outputs(self.dims))   # the outputs at the capacities

    def _outputs(self, sz):
        """the outputs at sizes sz: views of the plan's buffers"""
        dims, outs = self.dims, []
        for flat, shape, st in self._outs:
            it = flat.itemsize
            outs.append(np.lib.stride_tricks.as_strided(flat, shape=tuple(at(v, sz, dims) for v in shape),
                                                        strides=[at(x, sz, dims) * it for x in st]))
        return outs

    def _sizes(self, sizes):
        out = {}
        for d, cap in self.dims.items():
            v = sizes.get(d)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= int(v) <= cap:
                raise GraphError(f"run: size {d!r} must be an int in [1, {cap}], got {v!r}")
            out[d] = int(v)
        if set(sizes) - set(self.dims):
            raise GraphError(f"run: unknown sizes {sorted(set(sizes) - set(self.dims))}; dims are {sorted(self.dims)}")
        return out

    def _at_sizes(self, sz):
        """(input checks, program, outputs) at sizes sz: per pointer slot (slot, name, byte offset,
        dtype, shape), the program patched to these sizes, the output views"""
        dims, pp = self.dims, self.plan.program
        if sz == dims:   # at the capacities: the program as it is
            prog, outs = self._prog, self._full
        else:
            patched = self._base.copy()
            for d, ix, sl in self._affine:
                patched[ix] -= sl * (dims[d] - sz[d])
            prog, outs = _backend.ffi.new("int64_t[]", patched.tolist()), tuple(self._outputs(sz))
        slots = [(slot, name, boff, self._in[name][0], tuple(at(v, sz, dims) for v in self._in[name][1]))
                 for slot, name, boff in pp.input_slots]
        return slots, prog, outs

    def run(self, sizes, copy=False, n_threads=None, out=None, **inputs):
        """Run at `sizes` (one int per dynamic dimension, 1..capacity) on named inputs of the shapes
        the graph has at those sizes; returns the outputs (views of the plan's buffers, or copies, or
        the out arrays: Plan.bind)."""
        return self.bind(sizes, **inputs)(copy=copy, n_threads=n_threads, out=out)

    def bind(self, sizes, **inputs):
        """run()'s checks once: a callable `f(copy=False, n_threads=None, out=None)` that runs the
        plan at `sizes` on exactly these arrays (their contents may change between calls, not the
        arrays; a strided or misaligned one is read through a copy made here, as Plan.bind does).
        out as in Plan.bind: written straight by the kernels at the capacities, copied into below."""
        key = tuple(sizes.get(d) for d in self.dims) if type(sizes) is dict and len(sizes) == len(self.dims) else ()
        entry = self._cache.get(key) if all(type(v) is int for v in key) else None   # sizes seen (and checked) before
        if entry is None:
            sz = self._sizes(sizes)
            key = tuple(sz[d] for d in self.dims)
            if self.fixed:   # one exact plan per size
                p = self._per_size.get(key)
                if p is None:
                    p = self._per_size[key] = self.build(**sz).compile(self.fusion, self.isa)
                return p.bind(**inputs)
            if len(self._cache) >= 256:
                self._cache.clear()
            entry = self._cache[key] = self._at_sizes(sz)
        slots, prog, outs = entry
        plan = self.plan
        pp = plan.program
        if not inputs.keys() <= self._in.keys():
            raise GraphError(f"run: unknown inputs {sorted(set(inputs) - set(self._in))}")
        from_buffer = _backend.ffi.from_buffer
        ptr_args = []
        for slot, name, boff, dtype, want in slots:
            a = inputs.get(name)
            if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != want:
                raise GraphError(f"run: input {name!r} must be a {dtype} array of shape {want} at sizes "
                                 f"{dict(zip(self.dims, key))}, got {getattr(a, 'dtype', type(a).__name__)} "
                                 f"{getattr(a, 'shape', '')}")
            if not (a.flags.c_contiguous and a.flags.aligned):
                a = inputs[name] = np.require(a, requirements=("C", "A"))
            ptr_args.append((slot, from_buffer(a) + boff))
        fn, nrec, ptrs, fpc, blas, ilp64, lock = self._fn, self._nrec, pp.ptrs, pp.fpc, pp.blas, pp.ilp64, plan._lock
        ob = []   # the _Out, made at the first call with out

        def bound(copy=False, n_threads=None, out=None):
            nth = _dispatch.threads(n_threads)
            idx = ()
            if out is not None:
                if not ob:
                    ob.append(_Out(pp, outs, True, inputs.values()))
                out, idx = ob[0].prepare(out)
            with lock:
                for slot, p in ptr_args:
                    ptrs[slot] = p
                _Out.point(ptrs, idx)
                try:
                    rc = fn(prog, nrec, ptrs, fpc, blas, ilp64, nth)
                finally:
                    _Out.restore(ptrs, idx)
                if rc:
                    bad = self._steps[rc - 1]
                    if prog is self._prog and KIND[bad.kind].explains:   # the precise error (the nodes' shapes are these sizes')
                        KIND[bad.kind].run(bad, _Run(plan, inputs, nth))
                    raise GraphError(f"run: kernel call failed at {bad.kind} [{', '.join(n.name for n in bad.nodes)}] "
                                     "(an index input out of range: kv_write cells, attn_seqs groups or gather_rows idx)")
                if out is not None:
                    return _Out.result(out, outs, idx, copy)
                return tuple(o.copy() for o in outs) if copy else outs
        return bound
