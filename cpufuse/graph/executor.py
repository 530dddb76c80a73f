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
import math
import threading

import numpy as np

from .. import _backend, _dispatch
from ..ops import attention as _attn, norms as _norms, rope as _rope, softmax as _softmax
from .ir import F16, GraphError, _view_root, compute_nodes
from .fusion import fuse
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

    def run(self, copy=False, n_threads=None, **inputs):
        """Run the plan on named input arrays; returns the outputs in g.output() order."""
        return self.bind(**inputs)(copy=copy, n_threads=n_threads)

    def bind(self, **inputs):
        """Check the named input arrays once and return a callable `f(copy=False, n_threads=None)`
        that runs the plan on exactly these arrays (their contents may change between calls,
        not the arrays): the repeated-call form of run(), without its per-call checks.
        The outputs are the plan's own buffers, overwritten by its next run (copy=True returns
        copies); runs of one plan from several threads are serialized by a lock."""
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
            cast = _backend.ffi.cast
            inp = [(slot, cast("void *", arrays[name].ctypes.data + boff)) for slot, name, boff in self.program.input_slots]
        outs = tuple(self._array(n, arrays) for n in self.graph.outputs)
        p = self.program
        ptrs, segments, fpc, blas, ilp64 = p.ptrs, p.segments, p.fpc, p.blas, p.ilp64

        def bound(copy=False, n_threads=None):
            nth = _dispatch.threads(n_threads)
            with self._lock:
                for slot, p in inp:  # (re)point the plan at these inputs: another bind may have run since
                    ptrs[slot] = p
                for kind, seg in segments:
                    if kind == "c":
                        fn, prog, nrec, steps = seg
                        rc = fn(prog, nrec, ptrs, fpc, blas, ilp64, nth)
                        if rc:
                            bad = steps[rc - 1]
                            if bad.kind in ("cache_write", "rope_cache"):  # the rows do not fit: say so
                                self._pos0(bad.ins[1 if bad.kind == "cache_write" else 2], bad.ins[0].shape[0],
                                           bad.outs[0], arrays)
                            if bad.kind in ("kv_write", "attn_seqs", "gather_rows"):
                                self._exec(bad, arrays, nth)  # raises the precise error
                            raise GraphError(f"run: kernel call failed at {bad.kind} "
                                             f"[{', '.join(n.name for n in bad.nodes)}]")
                    else:
                        self._exec(seg, arrays, nth)
                return tuple(o.copy() for o in outs) if copy else outs
        return bound

    def _exec(self, st, arrays, nth=None):
        A = lambda n: None if n is None else self._array(n, arrays)  # noqa: E731
        isa, k = self.isa, st.kind
        if k in ("add", "mul"):
            a, b = st.ins
            out = A(st.outs[0])
            big, small = (a, b) if a.shape == out.shape else (b, a)
            x, w = A(big), A(small)
            np.add(x, w, out=out) if k == "add" else np.multiply(x, w, out=out)
        elif k == "scale":
            np.multiply(A(st.ins[0]), np.float32(st.params["s"]), out=A(st.outs[0]))
        elif k == "silu":
            x = A(st.ins[0])
            with np.errstate(over="ignore"):  # exp(-x) = inf for very negative x: silu -> -0, as in C
                np.divide(x, 1.0 + np.exp(-x), out=A(st.outs[0]))
        elif k in ("gelu", "geglu"):
            g = A(st.ins[0])
            with np.errstate(over="ignore", invalid="ignore"):   # graph.inc's gelu_v, op by op in f32 (-inf: NaN)
                z = g * (np.float32(0.07135481627159025) * (g * g) + np.float32(1.5957691216057308))
                y = g / (np.float32(1.0) + np.exp(-z))
            if k == "geglu":
                y = y * A(st.ins[1])
            np.copyto(A(st.outs[0]), y)
        elif k == "softcap":
            c = np.float32(st.params["cap"])
            np.multiply(np.tanh(A(st.ins[0]) * (np.float32(1.0) / c)), c, out=A(st.outs[0]))
        elif k == "swiglu":
            g, u = A(st.ins[0]), A(st.ins[1])
            with np.errstate(over="ignore"):
                np.multiply(g / (1.0 + np.exp(-g)), u, out=A(st.outs[0]))
        elif k == "rms_norm":
            x, _, w, b = (A(a) for a in st.ins)
            _norms.rms_norm(x, w, eps=st.params["eps"], bias=b, out=A(st.outs[1]), isa=isa, n_threads=nth)
        elif k == "add_rms_norm":
            x, r, w, b = (A(a) for a in st.ins)
            _norms.add_rms_norm(x, r, w, eps=st.params["eps"], bias=b, out=(A(st.outs[0]), A(st.outs[1])), isa=isa, n_threads=nth)
        elif k == "softmax":
            x, m, sk = (A(a) for a in st.ins)
            _softmax.softmax(x, m, scale=st.params["scale"], max_bias=st.params["max_bias"], sinks=sk,
                         out=A(st.outs[0]), isa=isa, n_threads=nth)
        elif k == "flash_attn":
            q, kk, v, m, sk = (A(a) for a in st.ins)
            p = st.params
            _attn.flash_attn(q, kk, v, m, scale=p["scale"], max_bias=p["max_bias"], softcap=p["softcap"],
                            sinks=sk, out=A(st.outs[0]), isa=isa, n_threads=nth)
        elif k == "matmul":
            np.matmul(A(st.ins[0]), A(st.ins[1]), out=A(st.outs[0]))
        elif k == "copy":
            np.copyto(A(st.outs[0]), A(st.ins[0]))
        elif k == "concat":
            np.concatenate([A(st.ins[0]), A(st.ins[1])], axis=st.params["axis"], out=A(st.outs[0]))
        elif k in ("qmatmul", "qmatmul_swiglu", "qmatmul_geglu"):
            from ..quant import matmul as _qm
            p = st.params
            x = A(st.ins[0])
            kw = {"act": p["act"], "isa": isa, "n_threads": nth}
            if p["eps"] is not None:
                kw["eps"] = p["eps"]
                if st.ins[1] is not None:
                    kw["norm_weight"] = np.ascontiguousarray(A(st.ins[1])).reshape(-1)
            if k == "qmatmul_swiglu":
                _qm.matmul_swiglu(x, p["ws"][0], p["ws"][1], out=A(st.outs[0]), **kw)
            elif k == "qmatmul_geglu":
                _qm.matmul_geglu(x, p["ws"][0], p["ws"][1], out=A(st.outs[0]), **kw)
            elif len(p["ws"]) == 1:
                res = A(st.ins[2]) if len(st.ins) > 2 else None   # QMATMUL -> ADD: the residual epilogue
                _qm.matmul(x, p["ws"][0], out=A(st.outs[0]), residual=res, **kw)
            else:
                _qm.matmul_multi(x, p["ws"], out=tuple(A(o) for o in st.outs), **kw)
        elif k == "rope":
            p = st.params
            _rope.rope(A(st.ins[0]), A(st.ins[1]), n_dims=p["n_dims"], mode=p["mode"],
                       out=A(st.outs[0]), isa=isa, n_threads=nth, **p["kw"])
        elif k == "cache_write":
            src, cw = st.ins[0], st.outs[0]
            p0 = self._pos0(st.ins[1], src.shape[0], cw, arrays)
            cache = cw.params["cache"]
            cache[p0:p0 + src.shape[0]] = A(src)  # f32 -> f16 rounds to nearest even
        elif k == "rope_cache":
            p = st.params
            cw = st.outs[0]
            p0 = self._pos0(st.ins[2], st.ins[0].shape[0], cw, arrays)
            r = _rope.rope(A(st.ins[0]), A(st.ins[1]), n_dims=p["n_dims"], mode=p["mode"],
                           cache=(p["cache"], p0), isa=isa, n_threads=nth, **p["kw"])
        elif k == "kv_write":
            src, cells = A(st.ins[0]), A(st.ins[1])
            kv = st.outs[0]
            cache = kv.params["cache"]
            if cells.size and (cells.min() < 0 or cells.max() >= cache.shape[0]):
                raise GraphError(f"run: kv_write {kv.name!r}: cells of input {st.ins[1].name!r} must be in "
                                 f"[0, {cache.shape[0]}), got {cells[(cells < 0) | (cells >= cache.shape[0])][:5].tolist()}")
            cache[cells] = src   # f32 -> f16 rounds to nearest even
        elif k == "attn_seqs":
            self._attn_seqs_py(st, A, nth)
        elif k == "gather_rows":
            x, idx = A(st.ins[0]), A(st.ins[1])
            if idx.size and (idx.min() < 0 or idx.max() >= x.shape[0]):
                raise GraphError(f"run: gather_rows {st.outs[0].name!r}: indices of input {st.ins[1].name!r} must be "
                                 f"in [0, {x.shape[0]}), got {idx[(idx < 0) | (idx >= x.shape[0])][:5].tolist()}")
            np.take(x, idx, axis=0, out=A(st.outs[0]))
        else:  # pragma: no cover
            raise GraphError(f"unknown step {k}")

    def _attn_seqs_py(self, st, A, nth):
        """attn_seqs from Python (the numba path; and the error of a failed C step)"""
        q, seqs, out = A(st.ins[0]), A(st.ins[3]), A(st.outs[0])
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
                                isa=self.isa, n_threads=nth)
            out[r0:r0 + nr] = o[0]

    def _pos0(self, node, n_tokens, cw, arrays):
        p0 = int(self._array(node, arrays)[0])
        n_ctx = cw.shape[0]
        if p0 < 0 or p0 + n_tokens > n_ctx:
            raise GraphError(f"run: cache_write {cw.name!r}: rows [{p0}, {p0 + n_tokens}) of input "
                             f"{node.name!r} do not fit the cache's n_ctx={n_ctx}")
        return p0


class DynamicPlan:
    """A plan compiled once and run at any size up to its capacity in its dynamic dimensions.

        dp = DynamicPlan(build, {"n": 512})      # build(n=...) -> Graph, e.g. n tokens
        (y,) = dp.run({"n": 37}, x=x37, ...)     # exactly 37 rows computed: no padding

    The plan is compiled for the capacities. Every field of its C program that depends on a
    dimension (row counts, element counts, a view's leading stride) is affine in it; the program is
    built again at capacity-1 and capacity-2 of each dimension, and the fields that change, with
    their change per unit, are patched into a copy of the program at each run. A graph whose program
    is not affine in a dimension (its fusions or kernel choices change with the size, e.g. a
    flash_attn whose strategy depends on the rows) is refused with a GraphError; attn_seqs chooses
    its strategy per sequence at run time and is affine. The buffers are the capacity plan's, so the
    results are those of a plan compiled for the exact size (tests/test_graph_dynamic.py).
    Capacities below 3 cannot be checked: such a dimension runs one plan per size (compiled lazily)."""

    def __init__(self, build, dims, fusion=None, isa=None):
        if not dims or any(int(c) < 1 for c in dims.values()):
            raise GraphError(f"DynamicPlan: dims must map names to capacities >= 1, got {dims!r}")
        self.build, self.dims = build, {k: int(v) for k, v in dims.items()}
        self.fusion, self.isa = fusion, isa
        self._lock = threading.Lock()
        self._per_size = {}
        self.plan = build(**self.dims).compile(fusion, isa)
        self.fixed = [d for d, c in self.dims.items() if c < 3]
        self.native = self.plan.native and [k for k, _ in self.plan.segments] == ["c"]
        if not self.native:   # Python steps: one plan per size
            self.fixed = list(self.dims)
            return
        fn, prog, nrec, steps = self.plan.segments[0][1]
        self._fn, self._nrec, self._steps = fn, nrec, steps
        ffi = _backend.ffi
        self._base = np.frombuffer(ffi.buffer(prog), np.int64).copy()
        self._slopes = {}
        self._in_shape = {n.name: (np.array(n.shape), {}) for n in self.plan.program.inputs}
        self._out_shape = [(np.array(n.shape), {}) for n in self.plan.graph.outputs]
        for d, cap in self.dims.items():
            if d in self.fixed:
                continue
            p1 = build(**{**self.dims, d: cap - 1}).compile(fusion, isa)
            p2 = build(**{**self.dims, d: cap - 2}).compile(fusion, isa)
            a1, a2 = (self._prog_of(p, d) for p in (p1, p2))
            s1, s2 = self._base - a1, a1 - a2
            if not np.array_equal(s1, s2):
                bad = np.flatnonzero(s1 != s2)[:5].tolist()
                raise GraphError(f"DynamicPlan: the program is not affine in {d!r} (fields {bad} change "
                                 f"non-linearly with it): compile per size instead")
            if self.plan.program.fp != p1.program.fp or self.plan.program.fp != p2.program.fp:
                raise GraphError(f"DynamicPlan: float parameters change with {d!r}")
            self._slopes[d] = s1
            for n1 in p1.program.inputs:
                base, sl = self._in_shape[n1.name]
                sl[d] = base - np.array(n1.shape)
            for (base, sl), o1 in zip(self._out_shape, p1.graph.outputs):
                sl[d] = base - np.array(o1.shape)
        self._patched = np.flatnonzero(sum((s != 0).astype(np.int64) for s in self._slopes.values())
                                       if self._slopes else np.zeros(0, np.int64))

    def _prog_of(self, p, d):
        if not p.native or [k for k, _ in p.segments] != ["c"]:
            raise GraphError(f"DynamicPlan: the plan at a smaller {d!r} is not one C call")
        prog, nrec = p.segments[0][1][1], p.segments[0][1][2]
        a = np.frombuffer(_backend.ffi.buffer(prog), np.int64).copy()
        if a.size != self._base.size or nrec != self._nrec:
            raise GraphError(f"DynamicPlan: the program's structure changes with {d!r} (fusions or steps differ)")
        return a

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

    def _shape(self, base, sl, sizes):
        sh = base.copy()
        for d, s in sl.items():
            sh = sh - s * (self.dims[d] - sizes[d])
        return tuple(int(v) for v in sh)

    def run(self, sizes, copy=False, n_threads=None, **inputs):
        """Run at `sizes` (one int per dynamic dimension, 1..capacity) on named inputs of the shapes
        the graph has at those sizes; returns the outputs (views of the plan's buffers, or copies)."""
        sz = self._sizes(sizes)
        if self.fixed:   # one exact plan per size of the unchecked dimensions
            key = tuple(sz[d] for d in self.dims)
            p = self._per_size.get(key)
            if p is None:
                p = self._per_size[key] = self.build(**sz).compile(self.fusion, self.isa)
            return p.run(copy=copy, n_threads=n_threads, **inputs)
        plan = self.plan
        cast = _backend.ffi.cast
        ptr_args = []
        for slot, name, boff in plan.program.input_slots:
            a = inputs.get(name)
            want = self._shape(*self._in_shape[name], sz)
            node = next(n for n in plan.program.inputs if n.name == name)
            if not isinstance(a, np.ndarray) or a.dtype != node.dtype or a.shape != want:
                raise GraphError(f"run: input {name!r} must be a {node.dtype} array of shape {want} at sizes "
                                 f"{sz}, got {getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
            if not (a.flags.c_contiguous and a.flags.aligned):
                a = inputs[name] = np.require(a, requirements=("C", "A"))
            ptr_args.append((slot, cast("void *", a.ctypes.data + boff)))
        if set(inputs) - set(self._in_shape):
            raise GraphError(f"run: unknown inputs {sorted(set(inputs) - set(self._in_shape))}")
        prog = self._base.copy()
        if self._patched.size:
            delta = np.zeros_like(prog)
            for d, s in self._slopes.items():
                delta += s * (self.dims[d] - sz[d])
            prog[self._patched] -= delta[self._patched]
        nth = _dispatch.threads(n_threads)
        outs = []
        for (base, sl), node in zip(self._out_shape, plan.graph.outputs):
            shape = self._shape(base, sl, sz)
            root, st, off = _view_root(node)
            flat = plan.buffers[root.id].reshape(-1)
            outs.append(np.lib.stride_tricks.as_strided(flat[off:], shape=shape, strides=[x * flat.itemsize for x in st]))
        pp = plan.program
        with plan._lock:
            for slot, p in ptr_args:
                pp.ptrs[slot] = p
            pc = _backend.ffi.from_buffer("int64_t[]", prog)
            rc = self._fn(pc, self._nrec, pp.ptrs, pp.fpc, pp.blas, pp.ilp64, nth)
            if rc:
                bad = self._steps[rc - 1]
                raise GraphError(f"run: kernel call failed at {bad.kind} [{', '.join(n.name for n in bad.nodes)}] "
                                 "(an index input out of range: kv_write cells, attn_seqs groups or gather_rows idx)")
            return tuple(o.copy() for o in outs) if copy else tuple(outs)
