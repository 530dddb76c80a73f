"""Op graphs in the spirit of ggml's: build nodes, mark outputs, compile to a plan, run it often.

    g = cpufuse.Graph()
    x = g.input("x", (n_tok, 576))
    h = g.mul(g.rms_norm(x, eps=1e-5), g.constant(w_norm))      # fused to one RMS_NORM+MUL kernel
    g.output(h)
    plan = g.compile()            # fusion=False, or CPUFUSE_DISABLE_FUSION=1, keeps every node
    print(plan.describe())        # what was fused into what, and why other candidates were not
    (y,) = plan.run(x=arr)

Fusion legality follows SPEC §4.1/§4.4 (ggml_can_fuse): the chain's nodes are consecutive in
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
import ctypes
import glob
import math
import os
import threading

import numpy as np

from .. import _backend, _dispatch, _registry
from ..ops import attention as _ops

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
I32 = np.dtype(np.int32)

OP_ADD, OP_MUL, OP_SCALE, OP_SILU, OP_SWIGLU, OP_RMS, OP_SOFTMAX, OP_FA, OP_COPY, OP_GEMM, OP_QMM, OP_ROPE, \
    OP_CACHE_WRITE, OP_KV_WRITE, OP_ATTN_SEQS, OP_GATHER_ROWS = range(1, 17)
_DESC_OPS = (OP_RMS, OP_SOFTMAX, OP_FA, OP_COPY, OP_QMM, OP_ROPE)  # records whose args[0] is a descriptor
_RP_LEN, _RPF_LEN = 12, 6  # native/kernels/rope.h

# Step kinds forced to run as Python steps even where the C executor could run them (tests and
# benchmarks compare the two; e.g. {"qmatmul", "qmatmul_swiglu", "rope", "rope_cache", "cache_write"}).
PY_STEPS = set()


class GraphError(ValueError):
    """A graph that cannot be built or compiled: the message names the node."""


class Node:
    __slots__ = ("id", "op", "srcs", "params", "shape", "dtype", "name", "view_of", "view_strides",
                 "view_offset", "value")

    def __init__(self, nid, op, srcs, params, shape, dtype, name):
        self.id, self.op, self.srcs, self.params = nid, op, list(srcs), dict(params)
        self.shape, self.dtype, self.name = tuple(int(s) for s in shape), np.dtype(dtype), name
        self.view_of = None      # the node whose buffer this view reads
        self.view_strides = None  # element strides into that buffer
        self.view_offset = 0
        self.value = None        # constants

    @property
    def is_view(self):
        return self.view_of is not None

    def __repr__(self):
        return f"<{self.op} {self.name!r} {self.shape}>"


def _suffix_tiles(small, big):
    """ggml-style tiling restricted to a trailing suffix: small's shape (left-padded with 1s) must
    equal big's trailing dims where it is not 1... here: small == big[-len(small):] after dropping
    leading 1s of small. Then small, contiguous, repeats over big's leading dims by modulo of its
    length. Returns True when that holds."""
    s = list(small)
    while s and s[0] == 1 and len(s) > 1:
        s.pop(0)
    return len(s) <= len(big) and tuple(s) == tuple(big[len(big) - len(s):])


class Graph:
    def __init__(self):
        self.nodes = []
        self.outputs = []

    # -- construction --------------------------------------------------------------------------
    def _add(self, op, srcs, params, shape, dtype=F32, name=None):
        for s in srcs:
            if s is not None and (not isinstance(s, Node) or s not in self._ids()):
                raise GraphError(f"{op}: source {s!r} is not a node of this graph")
        n = Node(len(self.nodes), op, srcs, params, shape, dtype, name or f"{op}{len(self.nodes)}")
        self.nodes.append(n)
        return n

    def _ids(self):
        return self.nodes

    def input(self, name, shape, dtype=np.float32):
        """A named run-time input: float32 or float16 data, or int32 (token positions for g.rope,
        the cache offset for g.cache_write)."""
        dt = np.dtype(dtype)
        if dt not in (F32, F16, I32):
            raise GraphError(f"input {name!r}: dtype must be float32, float16 or int32, got {dt}")
        return self._add("input", [], {}, shape, dt, name)

    def constant(self, value, name=None):
        a = np.asarray(value)
        if a.dtype not in (F32, F16):
            raise GraphError(f"constant {name!r}: dtype must be float32 or float16, got {a.dtype}")
        n = self._add("const", [], {}, a.shape, a.dtype, name)
        n.value = np.require(a, requirements=("C", "A"))   # contiguous and aligned (a copy if needed)
        return n

    def _name(self, op, name):
        return name or f"{op}{len(self.nodes)}"

    def _unit_rows(self, node, op, name):
        """row ops read rows in place: the last axis of a view must be unit-stride"""
        st = _view_root(node)[1]
        if node.shape and node.shape[-1] > 1 and st[-1] != 1:
            raise GraphError(f"{op} {name!r}: input {node.name!r} must have a unit-stride last axis, got a view "
                             f"with element strides {tuple(st)}; add g.contiguous() first")

    def _f32(self, node, op, name):
        if node.dtype != F32:
            raise GraphError(f"{op} {name!r}: input {node.name!r} must be float32, got {node.dtype}")

    def _binary(self, op, a, b, name):
        nm = name or f"{op}{len(self.nodes)}"
        self._f32(a, op, nm)
        self._f32(b, op, nm)
        b_tiles_a, a_tiles_b = _suffix_tiles(b.shape, a.shape), _suffix_tiles(a.shape, b.shape)
        if a.shape == b.shape or (b_tiles_a and not (a_tiles_b and len(b.shape) > len(a.shape))):
            shape = a.shape
        elif a_tiles_b:
            shape = b.shape
        else:
            raise GraphError(f"{op} {nm!r}: shapes {a.shape} and {b.shape} do not tile (one must "
                             f"equal the other's trailing dims)")
        return self._add(op, [a, b], {}, shape, F32, name)

    def add(self, a, b, name=None):
        return self._binary("add", a, b, name)

    def mul(self, a, b, name=None):
        return self._binary("mul", a, b, name)

    def scale(self, a, s, name=None):
        self._f32(a, "scale", self._name("scale", name))
        return self._add("scale", [a], {"s": float(s)}, a.shape, F32, name)

    def silu(self, a, name=None):
        self._f32(a, "silu", self._name("silu", name))
        return self._add("silu", [a], {}, a.shape, F32, name)

    def rms_norm(self, a, eps, name=None):
        nm = self._name("rms_norm", name)
        self._f32(a, "rms_norm", nm)
        self._unit_rows(a, "rms_norm", nm)
        if not float(eps) >= 0.0:
            raise GraphError(f"rms_norm {nm!r}: eps must be >= 0, got {eps}")
        return self._add("rms_norm", [a], {"eps": float(eps)}, a.shape, F32, name)

    def softmax(self, a, mask=None, scale=1.0, max_bias=0.0, sinks=None, name=None):
        nm = name or f"softmax{len(self.nodes)}"
        self._f32(a, "softmax", nm)
        self._unit_rows(a, "softmax", nm)
        if a.shape and len(a.shape) > 4:
            raise GraphError(f"softmax {nm!r}: at most 4 dims, got {a.shape}")
        if mask is not None:
            _softmax_mask_ok(mask.shape, a.shape, nm)
        elif max_bias > 0:
            raise GraphError(f"softmax {nm!r}: max_bias > 0 (ALiBi) requires a mask, got max_bias={max_bias} "
                             f"and mask=None")
        srcs = [a, mask, sinks]
        return self._add("softmax", srcs, {"scale": float(scale), "max_bias": float(max_bias)}, a.shape, F32, name)

    def flash_attn(self, q, k, v, mask=None, scale=1.0, max_bias=0.0, softcap=0.0, sinks=None, name=None):
        nm = name or f"flash_attn{len(self.nodes)}"
        if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
            raise GraphError(f"flash_attn {nm!r}: q, k, v must be 4-D, got {q.shape}, {k.shape}, {v.shape}")
        for t in (q, k, v):
            self._unit_rows(t, "flash_attn", nm)
        S, Hq, N, DK = q.shape
        if k.shape[3] != DK or k.shape[2] != v.shape[2] or Hq % k.shape[1] or Hq % v.shape[1]:
            raise GraphError(f"flash_attn {nm!r}: k must be (S, Hk, T, DK={DK}) and v (S, Hv, T, DV) with the same "
                             f"T and q heads {Hq} a multiple of Hk and Hv, got q {q.shape}, k {k.shape}, v {v.shape}")
        return self._add("flash_attn", [q, k, v, mask, sinks],
                         {"scale": float(scale), "max_bias": float(max_bias), "softcap": float(softcap)},
                         (S, N, Hq, v.shape[3]), F32, name)

    def matmul(self, a, b, name=None):
        nm = name or f"matmul{len(self.nodes)}"
        self._f32(a, "matmul", nm)
        self._f32(b, "matmul", nm)
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[0]:
            raise GraphError(f"matmul {nm!r}: needs (M, K) @ (K, N), got {a.shape} @ {b.shape}")
        return self._add("matmul", [a, b], {}, (a.shape[0], b.shape[1]), F32, name)

    def reshape(self, a, shape, name=None):
        shape = tuple(int(s) for s in shape)
        nm = self._name("reshape", name)
        if math.prod(shape) != math.prod(a.shape):
            raise GraphError(f"reshape {nm!r}: shape must hold the {math.prod(a.shape)} elements of {a.name!r} "
                             f"{a.shape}, got {shape} ({math.prod(shape)} elements)")
        base, st, off = _view_root(a)
        if not _is_contig(a.shape, st):
            raise GraphError(f"reshape {nm!r}: input {a.name!r} is a non-contiguous view; "
                             f"add g.contiguous() first")
        n = self._add("reshape", [a], {}, shape, a.dtype, name)
        n.view_of, n.view_strides, n.view_offset = base, _contig_strides(shape), off
        return n

    def permute(self, a, axes, name=None):
        axes = tuple(axes)
        if sorted(axes) != list(range(len(a.shape))):
            raise GraphError(f"permute {self._name('permute', name)!r}: axes {axes} do not permute "
                             f"{len(a.shape)} dims")
        n = self._add("permute", [a], {}, tuple(a.shape[i] for i in axes), a.dtype, name)
        base, st, off = _view_root(a)
        n.view_of, n.view_strides, n.view_offset = base, [st[i] for i in axes], off
        return n

    def contiguous(self, a, name=None):
        return self._add("copy", [a], {}, a.shape, a.dtype, name)

    def concat(self, a, b, axis, name=None):
        nm = name or f"concat{len(self.nodes)}"
        if len(a.shape) != len(b.shape) or a.dtype != b.dtype or any(
                x != y for i, (x, y) in enumerate(zip(a.shape, b.shape)) if i != axis % len(a.shape)):
            raise GraphError(f"concat {nm!r}: shapes {a.shape} and {b.shape} differ off axis {axis}")
        ax = axis % len(a.shape)
        shape = list(a.shape)
        shape[ax] += b.shape[ax]
        return self._add("concat", [a, b], {"axis": ax}, shape, a.dtype, name)

    # -- quantized matmul, rope, KV-cache writes -------------------------------------------------
    def qmatmul(self, x, w, act=None, name=None):
        """y = x . dequant(w)^T (cpufuse.matmul): x a float32 node (..., n_in), w a cpufuse.QTensor
        of shape (n_out, n_in) held as a parameter (not a node); act "q8" (default) or "f32".
        Output (..., n_out). Fusions: see the module docstring (QKV, SwiGLU, RMS_NORM prologue)."""
        from ..quant.types import QTensor
        nm = self._name("qmatmul", name)
        if not isinstance(x, Node):
            raise GraphError(f"qmatmul {nm!r}: x must be a node of this graph, got {type(x).__name__}")
        self._f32(x, "qmatmul", nm)
        if not isinstance(w, QTensor):
            raise GraphError(f"qmatmul {nm!r}: w must be a cpufuse.QTensor, got {type(w).__name__}")
        if act not in (None, "q8", "f32"):
            raise GraphError(f"qmatmul {nm!r}: act must be 'q8', 'f32' or None, got {act!r}")
        if len(x.shape) < 1 or x.shape[-1] != w.shape[1]:
            raise GraphError(f"qmatmul {nm!r}: x {x.name!r} {x.shape} must end in the weight's "
                             f"n_in={w.shape[1]} (w is {tuple(w.shape)})")
        self._unit_rows(x, "qmatmul", nm)
        return self._add("qmatmul", [x], {"w": w, "act": act or "q8"}, x.shape[:-1] + (w.shape[0],), F32, name)

    def rope(self, x, pos, n_dims, mode="norm", name=None, **rope_kwargs):
        """ggml rope_ext (cpufuse.rope) on x (n_tokens, n_heads, head_dim) float32 with pos an int32
        input node (n_tokens,); rope_kwargs (freq_base=..., ...) go to cpufuse.rope unchanged.
        Output: same shape as x."""
        nm = self._name("rope", name)
        self._f32(x, "rope", nm)
        self._unit_rows(x, "rope", nm)
        if len(x.shape) != 3:
            raise GraphError(f"rope {nm!r}: x must be (n_tokens, n_heads, head_dim), got {x.shape}")
        if not isinstance(pos, Node) or pos.op != "input" or pos.dtype != I32 or pos.shape != (x.shape[0],):
            raise GraphError(f"rope {nm!r}: pos must be an int32 input node of shape ({x.shape[0]},), got "
                             f"{pos!r}" + (f" {pos.dtype}" if isinstance(pos, Node) else ""))
        n_dims = int(n_dims)
        if n_dims <= 0 or n_dims % 2 or n_dims > x.shape[2]:
            raise GraphError(f"rope {nm!r}: n_dims must be even and in [2, head_dim={x.shape[2]}], got {n_dims}")
        for k in ("out", "cache", "isa", "n_threads"):
            if k in rope_kwargs:
                raise GraphError(f"rope {nm!r}: {k}= is set by the plan, not by the graph")
        return self._add("rope", [x, pos], {"n_dims": n_dims, "mode": mode, "kw": dict(rope_kwargs)},
                         x.shape, F32, name)

    def cache_write(self, src, cache, pos0, name=None):
        """Write src (n_tokens, n_heads, head_dim) float32 into rows cache[pos0 : pos0 + n_tokens] of
        cache, a C-contiguous user-owned numpy array (n_ctx, n_heads, head_dim), float16 (converted,
        round to nearest even) or float32, written in place at every run; pos0 an int32 input node of
        shape (1,) read at run time (a GraphError if the rows do not fit). The node's value is the
        whole cache (the user's array, not a copy): it may be read downstream (e.g. as flash_attn's
        K or V after a reshape/permute) or marked as an output. A cache write is a side effect and
        is ALWAYS executed by plan.run, even when neither it nor anything reading it is an output."""
        nm = self._name("cache_write", name)
        self._f32(src, "cache_write", nm)
        if len(src.shape) != 3:
            raise GraphError(f"cache_write {nm!r}: src must be (n_tokens, n_heads, head_dim), got {src.shape}")
        if not isinstance(cache, np.ndarray) or cache.dtype not in (F32, F16):
            raise GraphError(f"cache_write {nm!r}: cache must be a float16 or float32 numpy array, got "
                             f"{getattr(cache, 'dtype', type(cache).__name__)}")
        if cache.ndim != 3 or cache.shape[1:] != src.shape[1:] or cache.shape[0] < src.shape[0]:
            raise GraphError(f"cache_write {nm!r}: cache {cache.shape} does not hold rows of src {src.shape} "
                             f"(needs (n_ctx >= {src.shape[0]}, {src.shape[1]}, {src.shape[2]}))")
        if not cache.flags.c_contiguous or not cache.flags.behaved:
            raise GraphError(f"cache_write {nm!r}: cache must be C-contiguous, aligned and writeable, got "
                             f"c_contiguous={cache.flags.c_contiguous}, aligned={cache.flags.aligned}, "
                             f"writeable={cache.flags.writeable}")
        if not isinstance(pos0, Node) or pos0.op != "input" or pos0.dtype != I32 or pos0.shape != (1,):
            raise GraphError(f"cache_write {nm!r}: pos0 must be an int32 input node of shape (1,), got {pos0!r}"
                             + (f" {pos0.dtype}" if isinstance(pos0, Node) else ""))
        n = self._add("cache_write", [src, pos0], {"cache": cache}, cache.shape, cache.dtype, name)
        return n

    def _kv_cache(self, op, nm, cache, heads, head_dim):
        if not isinstance(cache, np.ndarray) or cache.dtype not in (F32, F16):
            raise GraphError(f"{op} {nm!r}: cache must be a float16 or float32 numpy array, got "
                             f"{getattr(cache, 'dtype', type(cache).__name__)}")
        if cache.ndim != 3 or cache.shape[1:] != (heads, head_dim):
            raise GraphError(f"{op} {nm!r}: cache must be (n_cells, {heads}, {head_dim}), got {cache.shape}")
        if not cache.flags.c_contiguous or not cache.flags.behaved:
            raise GraphError(f"{op} {nm!r}: cache must be C-contiguous, aligned and writeable, got "
                             f"c_contiguous={cache.flags.c_contiguous}, aligned={cache.flags.aligned}, "
                             f"writeable={cache.flags.writeable}")

    def _i32_input(self, op, nm, node, what, shape):
        if not isinstance(node, Node) or node.op != "input" or node.dtype != I32 or len(node.shape) != len(shape) \
                or any(a is not None and a != b for a, b in zip(shape, node.shape)):
            raise GraphError(f"{op} {nm!r}: {what} must be an int32 input node of shape {shape}, got {node!r}"
                             + (f" {node.dtype}" if isinstance(node, Node) else ""))

    def kv_write(self, src, cache, cells, name=None):
        """Write row i of src (n_tokens, n_heads, head_dim) float32 into cell cells[i] of cache, a
        C-contiguous user-owned array (n_cells, n_heads, head_dim), float16 (rounded to nearest even)
        or float32; cells an int32 input node (n_tokens,) read at run time (a GraphError when a cell
        is outside the cache). The scatter form of cache_write, for batches that mix sequences
        (each with its own cells). The node's value is the whole cache; always executed."""
        nm = self._name("kv_write", name)
        self._f32(src, "kv_write", nm)
        if len(src.shape) != 3:
            raise GraphError(f"kv_write {nm!r}: src must be (n_tokens, n_heads, head_dim), got {src.shape}")
        self._kv_cache("kv_write", nm, cache, src.shape[1], src.shape[2])
        self._i32_input("kv_write", nm, cells, "cells", (src.shape[0],))
        return self._add("kv_write", [src, cells], {"cache": cache}, cache.shape, cache.dtype, name)

    def attn_seqs(self, q, k, v, seqs, scale, softcap=0.0, name=None):
        """Attention of a batch that mixes sequences, each over exactly its own KV cells. q (n_tokens,
        n_heads, head_dim) float32; k, v: kv_write (or cache_write) nodes, i.e. KV caches (n_cells,
        n_kv_heads, head_dim) with n_heads a multiple of n_kv_heads (GQA); seqs an int32 input node
        (n_groups, 4), one row (cell0, row0, n_rows, pos0) per sequence in the batch: query rows
        row0 .. row0+n_rows-1 are its tokens at positions pos0.. (consecutive), its position p lives
        in cell cell0 + p, and token i attends positions 0 .. pos0+i (causal). Rows with n_rows = 0
        are unused. Each sequence is one flash_attn call with N = n_rows, T = pos0 + n_rows and the
        auto strategy of cpufuse.ops.choose_strategy: what it computes alone, whatever else is in
        the batch. Output (n_tokens, n_heads, head_dim) float32 (rows of no group are left as they were)."""
        nm = self._name("attn_seqs", name)
        self._f32(q, "attn_seqs", nm)
        if len(q.shape) != 3:
            raise GraphError(f"attn_seqs {nm!r}: q must be (n_tokens, n_heads, head_dim), got {q.shape}")
        for what, c in (("k", k), ("v", v)):
            if not isinstance(c, Node) or c.op not in ("kv_write", "cache_write"):
                raise GraphError(f"attn_seqs {nm!r}: {what} must be a kv_write or cache_write node, got {c!r}")
            if len(c.shape) != 3 or c.shape[2] != q.shape[2] or q.shape[1] % c.shape[1]:
                raise GraphError(f"attn_seqs {nm!r}: {what} cache {c.shape} does not fit q {q.shape} "
                                 "(head_dim must match, n_heads a multiple of its heads)")
        if k.shape != v.shape:
            raise GraphError(f"attn_seqs {nm!r}: k {k.shape} and v {v.shape} caches differ")
        self._i32_input("attn_seqs", nm, seqs, "seqs", (None, 4))
        return self._add("attn_seqs", [q, k, v, seqs], {"scale": float(scale), "softcap": float(softcap)},
                         q.shape, F32, name)

    def gather_rows(self, x, idx, name=None):
        """Rows idx[j] of x (n, width) float32, idx an int32 input node (m,): (m, width) (e.g. the
        last token of each sequence before the output head). A GraphError at run time on an index
        outside [0, n)."""
        nm = self._name("gather_rows", name)
        self._f32(x, "gather_rows", nm)
        if len(x.shape) != 2:
            raise GraphError(f"gather_rows {nm!r}: x must be 2-D (n, width), got {x.shape}")
        self._i32_input("gather_rows", nm, idx, "idx", (None,))
        return self._add("gather_rows", [x, idx], {}, (idx.shape[0], x.shape[1]), F32, name)

    def output(self, *nodes):
        for n in nodes:
            if not isinstance(n, Node) or not any(n is m for m in self.nodes):
                raise GraphError(f"output: {n!r} is not a node of this graph")
            if n not in self.outputs:
                self.outputs.append(n)
        return nodes[0] if len(nodes) == 1 else nodes

    def compile(self, fusion=None, isa=None):
        if fusion is None:
            fusion = os.environ.get("CPUFUSE_DISABLE_FUSION", "0") in ("", "0")
        return Plan(self, bool(fusion), _dispatch.resolve(isa))


def _softmax_mask_ok(mshape, xshape, nm):
    m = (1,) * (4 - len(mshape)) + tuple(mshape)
    x = (1,) * (4 - len(xshape)) + tuple(xshape)
    if m[3] != x[3] or m[2] < x[2] or x[1] % m[1] or x[0] % m[0]:
        raise GraphError(f"softmax {nm!r}: mask must fit x {tuple(xshape)} (soft_max_ext: same columns, at least "
                         f"as many rows, heads/sequences dividing x's), got mask {tuple(mshape)}")


def _contig_strides(shape):
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return st[::-1]


def _is_contig(shape, strides):
    return all(st == c for st, c, n in zip(strides, _contig_strides(shape), shape) if n != 1)


def _view_root(a):
    """(buffer-owning node, element strides, element offset) for a node or a view of one"""
    if a.view_of is not None:
        return a.view_of, list(a.view_strides), a.view_offset
    return a, _contig_strides(a.shape), 0


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


class Step:
    """One kernel call of a plan: kind, the graph nodes it covers, what it reads and writes."""
    __slots__ = ("kind", "nodes", "ins", "outs", "params", "note")

    def __init__(self, kind, nodes, ins, outs, params=None, note=""):
        self.kind, self.nodes, self.ins, self.outs = kind, nodes, ins, outs
        self.params, self.note = params or {}, note


class Plan:
    def __init__(self, graph, fusion, isa):
        if not graph.outputs and not any(n.op in ("cache_write", "kv_write") for n in graph.nodes):
            raise GraphError("the graph has no outputs: mark them with g.output(node)")
        self.graph, self.fusion, self.isa = graph, fusion, isa
        self.native = isa != "numba" and _backend.lib is not None
        self.rejected = []
        # a plan owns its intermediate and output buffers and its input-pointer table: runs of one
        # plan from several threads take turns (the soak test found them clobbering each other)
        self._lock = threading.Lock()
        nodes = graph.nodes
        self._uses = [0] * len(nodes)
        self._consumers = [[] for _ in nodes]
        for n in nodes:
            for s in n.srcs:
                if s is not None:
                    self._uses[s.id] += 1
                    self._consumers[s.id].append(n)
        self._outset = {n.id for n in graph.outputs}
        # buffers that outputs live in (an output may be a view of a computed node)
        self._out_roots = {_view_root(n)[0].id for n in graph.outputs}
        self.steps = self._lower()
        self._allocate()
        self._build_program()

    # -- fusion ----------------------------------------------------------------------------------
    def _compute_order(self):
        return [n for n in self.graph.nodes if n.op not in ("input", "const", "reshape", "permute")]

    def _fusible_intermediate(self, node, nxt, order_pos, why_prefix):
        """SPEC 4.1 checks for `node` feeding `nxt`; returns None or the reason it fails."""
        if self._uses[node.id] != 1:
            return f"{why_prefix}: {node.name!r} has {self._uses[node.id]} consumers"
        if node.id in self._outset:
            return f"{why_prefix}: {node.name!r} is a graph output"
        if node.is_view:
            return f"{why_prefix}: {node.name!r} is a view"
        if order_pos[nxt.id] != order_pos[node.id] + 1:
            return f"{why_prefix}: {nxt.name!r} does not directly follow {node.name!r}"
        if nxt.shape != node.shape:
            return f"{why_prefix}: shape {nxt.shape} != {node.shape}"
        return None

    def _lower(self):
        order = self._compute_order()
        pos = {n.id: i for i, n in enumerate(order)}
        done = set()
        steps = []
        for n in order:
            if n.id in done:
                continue
            st = self._try_fuse(n, order, pos) if self.fusion else None
            if st is None:
                st = self._single(n)
            for m in st.nodes:
                done.add(m.id)
            steps.append(st)
        return steps

    def _other(self, binop, node):
        a, b = binop.srcs
        if a is node and b is node:
            return None
        return b if a is node else a

    def _try_fuse(self, n, order, pos):
        if n.op == "add" and not n.is_view:
            # ADD -> RMS_NORM (-> MUL (-> ADD)): the residual pattern, h kept (two outputs)
            norms = [c for c in self._consumers[n.id] if c.op == "rms_norm" and pos.get(c.id) == pos[n.id] + 1]
            if norms and self._qgroup_after_norm(norms[0], pos, order, quiet=True) is not None:
                self.rejected.append(f"ADD -> RMS_NORM: {norms[0].name!r} is folded into the QMATMUL "
                                     f"prologue instead")
                norms = []
            if norms:
                r = norms[0]
                x, res = n.srcs
                if x.shape != n.shape:
                    x, res = res, x
                w, b, tail = self._norm_tail(r, order, pos)
                if w is n or b is n:
                    self.rejected.append(f"ADD -> RMS_NORM: {n.name!r} is also the weight or bias of "
                                         f"its own norm")
                    return None
                return Step("add_rms_norm", [n, r] + tail, [x, res, w, b], [n, tail[-1] if tail else r],
                            {"eps": r.params["eps"]},
                            note="ADD -> RMS_NORM" + "".join(" -> " + t.op.upper() for t in tail))
        if n.op == "rms_norm":
            st = self._qgroup_after_norm(n, pos, order)
            if st is not None:
                return st
            w, b, tail = self._norm_tail(n, order, pos)
            if tail:
                return Step("rms_norm", [n] + tail, [n.srcs[0], None, w, b], [None, tail[-1]],
                            {"eps": n.params["eps"]}, note="RMS_NORM" + "".join(" -> " + t.op.upper() for t in tail))
            return None
        if n.op in ("scale", "add"):
            return self._softmax_chain(n, pos)
        if n.op == "qmatmul":
            grp = self._qgroup(n, order, pos)
            if grp is not None:
                return self._qstep(grp, None)
            return None
        if n.op == "rope":
            return self._rope_cache(n, pos)
        if n.op == "silu":
            cons = self._consumers[n.id]
            if cons and cons[0].op == "mul":
                m = cons[0]
                u, why = self._mul_operand(n, m, pos, "SILU -> MUL")
                if why is None:
                    return Step("swiglu", [n, m], [n.srcs[0], u], [m], note="SILU -> MUL")
                self.rejected.append(why)
        return None

    # -- quantized matmul groups -----------------------------------------------------------------
    def _intermediate(self, node, label):
        """single consumer, not an output, not a view: None or the reason it fails"""
        if self._uses[node.id] != 1:
            return f"{label}: {node.name!r} has {self._uses[node.id]} consumers"
        if node.id in self._outset:
            return f"{label}: {node.name!r} is a graph output"
        if node.is_view:
            return f"{label}: {node.name!r} is a view"
        return None

    def _swiglu_group(self, n, order, pos, record=True):
        """n a QMATMUL: (gate, up, silu, mul) when n is the gate or up product of the SwiGLU pattern
        QMATMUL(x,Wg) -> SILU -> MUL(silu, QMATMUL(x,Wu)), else None (reason recorded if any)."""
        cons = self._consumers[n.id]
        if len(cons) != 1:
            return None
        c = cons[0]
        if c.op == "silu":
            s = c
            sc = self._consumers[s.id]
            if len(sc) != 1 or sc[0].op != "mul":
                return None
            m = sc[0]
            g, u = n, self._other(m, s)
        elif c.op == "mul":
            m = c
            s = self._other(m, n)
            if s is None or s.op != "silu" or s.srcs[0].op != "qmatmul":
                return None
            g, u = s.srcs[0], n
        else:
            return None
        if u is None or u.op != "qmatmul" or g is u:
            return None
        label = "QMATMUL x2 -> SILU -> MUL"
        why = None
        for node in (g, u, s):
            why = why or self._intermediate(node, label)
        if why is None and g.srcs[0] is not u.srcs[0]:
            why = f"{label}: {g.name!r} and {u.name!r} read different inputs"
        if why is None and g.params["act"] != u.params["act"]:
            why = f"{label}: {g.name!r} and {u.name!r} use different act modes"
        if why is None and tuple(g.params["w"].shape) != tuple(u.params["w"].shape):
            why = f"{label}: weights {tuple(g.params['w'].shape)} and {tuple(u.params['w'].shape)} differ in shape"
        if why is None and m.shape != s.shape:
            why = f"{label}: MUL {m.name!r} {m.shape} broadcasts"
        if why is None:
            ps = sorted(pos[k.id] for k in (g, u, s, m))
            if ps != list(range(ps[0], ps[0] + 4)):
                why = f"{label}: {g.name!r}, {u.name!r}, {s.name!r}, {m.name!r} are not consecutive"
        if why:
            if record:
                self.rejected.append(why)
            return None
        return [g, u, s, m]

    def _qgroup(self, n, order, pos, record=True):
        """the fused QMATMUL group starting at n (the first in execution order): ("swiglu", nodes)
        or ("multi", [2..3 qmatmuls]) or None."""
        sw = self._swiglu_group(n, order, pos, record)
        if sw is not None:
            if pos[sw[0].id] == pos[n.id] or pos[sw[1].id] == pos[n.id]:
                return ("swiglu", sw)
            return None
        grp = [n]
        i = pos[n.id] + 1
        while len(grp) < 3 and i < len(order):
            c = order[i]
            if c.op != "qmatmul" or c.srcs[0] is not n.srcs[0] or c.params["act"] != n.params["act"]:
                break
            grp.append(c)
            i += 1
        return ("multi", grp) if len(grp) > 1 else None

    def _qgroup_after_norm(self, r, pos, order, quiet=False):
        """RMS_NORM r -> MUL(w) -> a QMATMUL group reading exactly the MUL: the fused step, or None"""
        cons = self._consumers[r.id]
        if len(cons) != 1 or cons[0].op != "mul":
            return None
        m = cons[0]
        mc = self._consumers[m.id]
        if not mc or not all(c.op == "qmatmul" for c in mc):
            return None
        label = "RMS_NORM -> MUL -> QMATMUL"
        why = self._intermediate(r, label)
        w = self._other(m, r)
        if why is None and (w is None or pos.get(m.id) != pos[r.id] + 1):
            why = f"{label}: {m.name!r} does not directly follow {r.name!r}" if w is not None else \
                f"{label}: MUL(n, n) uses {r.name!r} twice"
        n_in = r.shape[-1] if r.shape else 0
        if why is None:
            ws = list(w.shape)
            while len(ws) > 1 and ws[0] == 1:
                ws.pop(0)
            if w.op not in ("const", "input") or w.is_view or w.dtype != F32 or tuple(ws) != (n_in,):
                why = (f"{label}: the norm weight {w.name!r} must be a float32 const or input node of shape "
                       f"({n_in},), got {w.op} {w.dtype} {w.shape}")
        if why is None and m.id in self._outset:
            why = f"{label}: {m.name!r} is a graph output"
        if why is None and m.shape != r.shape:
            why = f"{label}: MUL {m.name!r} {m.shape} broadcasts"
        first = min(mc, key=lambda c: pos[c.id])
        grp = None
        if why is None and pos[first.id] != pos[m.id] + 1:
            why = f"{label}: {first.name!r} does not directly follow {m.name!r}"
        if why is None:
            grp = self._qgroup(first, order, pos, record=not quiet) or ("multi", [first])
            qs = grp[1][:2] if grp[0] == "swiglu" else grp[1]
            if {c.id for c in mc} != {q.id for q in qs} or self._uses[m.id] != len(qs):
                why = (f"{label}: the consumers of {m.name!r} ({', '.join(c.name for c in mc)}) are not "
                       f"exactly one fused QMATMUL group ({', '.join(q.name for q in qs)})")
        if why:
            if not quiet:
                self.rejected.append(why)
            return None
        return self._qstep(grp, (r, m, w))

    def _qstep(self, grp, norm):
        kind, nodes = grp
        r = m = w = None
        if norm is not None:
            r, m, w = norm
        pre = [r, m] if norm is not None else []
        x = r.srcs[0] if norm is not None else nodes[0].srcs[0]
        eps = r.params["eps"] if norm is not None else None
        head = "RMS_NORM -> MUL -> " if norm is not None else ""
        act = nodes[0].params["act"]
        if kind == "swiglu":
            g, u, s, mm = nodes
            return Step("qmatmul_swiglu", pre + nodes, [x, w], [mm],
                        {"ws": (g.params["w"], u.params["w"]), "act": act, "eps": eps},
                        note=head + "QMATMUL x2 -> SILU -> MUL (matmul_swiglu)")
        k = len(nodes)
        note = head + ("QMATMUL" if k == 1 else f"QMATMUL x{k} (shared activation)")
        return Step("qmatmul", pre + nodes, [x, w], list(nodes),
                    {"ws": tuple(q.params["w"] for q in nodes), "act": act, "eps": eps}, note=note)

    def _rope_cache(self, n, pos):
        cons = self._consumers[n.id]
        if len(cons) != 1 or cons[0].op != "cache_write":
            return None
        cw = cons[0]
        why = self._intermediate(n, "ROPE -> CACHE_WRITE")
        if why is None and pos[cw.id] != pos[n.id] + 1:
            why = f"ROPE -> CACHE_WRITE: {cw.name!r} does not directly follow {n.name!r}"
        if why:
            self.rejected.append(why)
            return None
        return Step("rope_cache", [n, cw], [n.srcs[0], n.srcs[1], cw.srcs[1]], [cw],
                    {"n_dims": n.params["n_dims"], "mode": n.params["mode"], "kw": n.params["kw"],
                     "cache": cw.params["cache"]}, note="ROPE -> CACHE_WRITE")

    def _mul_operand(self, n, m, pos, label):
        """MUL m consuming n: (its other operand, None) if n may fuse into it, else (_, reason)"""
        why = self._fusible_intermediate(n, m, pos, label)
        other = self._other(m, n)
        if why is None and other is None:
            why = f"{label}: MUL(n, n) uses {n.name!r} twice"
        if why is None and not (other.shape == n.shape or _suffix_tiles(other.shape, n.shape)):
            why = f"{label}: {other.name!r} {other.shape} does not tile {n.shape}"
        return other, why

    def _norm_tail(self, r, order, pos):
        """RMS_NORM's MUL (and ADD) if they can join the rms_norm kernel: (weight, bias, nodes)."""
        cons = self._consumers[r.id]
        muls = [c for c in cons if c.op == "mul"]
        if not muls:
            for c in cons:
                if c.is_view and any(cc.op == "mul" for cc in self._consumers[c.id]):
                    self.rejected.append(f"RMS_NORM -> MUL: {r.name!r} reaches the MUL through the view "
                                         f"{c.name!r}")
            return None, None, []
        m = muls[0]
        w, why = self._mul_operand(r, m, pos, "RMS_NORM -> MUL")
        if why:
            self.rejected.append(why)
            return None, None, []
        mc = self._consumers[m.id]
        if mc and mc[0].op == "add":
            a = mc[0]
            why = self._fusible_intermediate(m, a, pos, "MUL -> ADD")
            b = self._other(a, m)
            if why is None and (b is None or not (b.shape == m.shape or _suffix_tiles(b.shape, m.shape))):
                why = f"MUL -> ADD: bias does not tile {m.shape}"
            if why is None:
                return w, b, [m, a]
            self.rejected.append(why)
        return w, None, [m]

    def _softmax_chain(self, n, pos):
        """[SCALE ->] [ADD(mask) ->] SOFT_MAX starting at n, as one soft_max_ext call"""
        chain, scale, mask = [n], 1.0, None
        if n.op == "scale":
            scale, src = n.params["s"], n.srcs[0]
            cons = self._consumers[n.id]
            if cons and cons[0].op == "add" and self._fusible_intermediate(n, cons[0], pos, "") is None:
                mask = self._other(cons[0], n)
                if mask is not None:
                    chain.append(cons[0])
        else:
            src, mask = n.srcs
            if src.shape != n.shape:
                src, mask = mask, src
        last = chain[-1]
        cons = self._consumers[last.id]
        if not cons or cons[0].op != "softmax" or cons[0].srcs[0] is not last:
            return None
        sm = cons[0]
        label = " -> ".join(c.op.upper() for c in chain) + " -> SOFT_MAX"
        why = self._fusible_intermediate(last, sm, pos, label)
        if why is None and (sm.srcs[1] is not None or sm.params["max_bias"] != 0.0):
            why = f"{label}: the softmax already has a mask or ALiBi"
        if why is None and mask is not None and sm.params["scale"] != 1.0:
            why = f"{label}: the softmax's own scale would multiply the mask too"
        if why is None and mask is not None:
            if mask.dtype != F32:
                why = f"{label}: mask {mask.name!r} must be float32"
            else:
                try:
                    _softmax_mask_ok(mask.shape, last.shape, sm.name)
                except GraphError:
                    why = f"{label}: {mask.name!r} {mask.shape} is not a soft_max_ext mask for {last.shape}"
        if why:
            self.rejected.append(why)
            return None
        return Step("softmax", chain + [sm], [src, mask, sm.srcs[2]], [sm],
                    {"scale": scale * sm.params["scale"], "max_bias": 0.0}, note=label)

    def _single(self, n):
        kind = {"add": "add", "mul": "mul", "scale": "scale", "silu": "silu", "rms_norm": "rms_norm",
                "softmax": "softmax", "flash_attn": "flash_attn", "matmul": "matmul", "copy": "copy",
                "concat": "concat", "qmatmul": "qmatmul", "rope": "rope", "cache_write": "cache_write",
                "kv_write": "kv_write", "attn_seqs": "attn_seqs", "gather_rows": "gather_rows"}[n.op]
        if kind == "qmatmul":
            return Step(kind, [n], [n.srcs[0], None], [n], {"ws": (n.params["w"],), "act": n.params["act"], "eps": None})
        if kind == "rms_norm":
            return Step(kind, [n], [n.srcs[0], None, None, None], [None, n], {"eps": n.params["eps"]})
        if kind == "softmax":
            return Step(kind, [n], [n.srcs[0], n.srcs[1], n.srcs[2]], [n], dict(n.params))
        return Step(kind, [n], [s for s in n.srcs], [n], dict(n.params))

    # -- buffers ---------------------------------------------------------------------------------
    def _allocate(self):
        """One float32 arena buffer per computed node that owns storage; intermediates whose
        lifetimes do not overlap share memory (greedy first fit); outputs get their own."""
        last_use = {}
        for i, st in enumerate(self.steps):
            for a in st.ins:
                if a is not None:
                    last_use[_view_root(a)[0].id] = i
        self.buffers = {}  # node id -> ndarray (flat, owning)
        for n in self.graph.nodes:
            if n.op in ("cache_write", "kv_write"):  # the user's cache array is the node's buffer
                self.buffers[n.id] = n.params["cache"].reshape(-1)
        free = []  # (size, array)
        for i, st in enumerate(self.steps):
            for o in st.outs:
                if o is None or o.id in self.buffers:
                    continue
                size = math.prod(o.shape)
                arr = None
                if o.id not in self._out_roots:
                    for j, (sz, a) in enumerate(free):
                        if sz >= size:
                            arr = a
                            free.pop(j)
                            break
                if arr is None:
                    arr = np.empty(max(size, 1), o.dtype)
                self.buffers[o.id] = arr
            for a in st.ins + st.outs:
                if a is None:
                    continue
                root = _view_root(a)[0]
                if last_use.get(root.id, -1) == i and root.id in self.buffers and root.id not in self._out_roots \
                        and root.op not in ("input", "const", "cache_write", "kv_write"):
                    free.append((self.buffers[root.id].size, self.buffers[root.id]))
                    del last_use[root.id]
            free.sort(key=lambda t: t[0])
        for n in self.graph.nodes:
            if n.op == "const":
                self.buffers[n.id] = n.value.reshape(-1)

    def _array(self, node, inputs=None):
        """ndarray view of a node's data (inputs from the run's arguments)"""
        root, st, off = _view_root(node)
        base = inputs[root.name] if root.op == "input" else self.buffers[root.id]
        flat = base.reshape(-1)
        it = flat.itemsize
        return np.lib.stride_tricks.as_strided(flat[off:], shape=node.shape, strides=[s * it for s in st])

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
        x, nw = st.ins
        ws = p["ws"]
        epi = 1 if st.kind == "qmatmul_swiglu" else 0
        geo = self._rows(x)
        if geo is None or not all(self._contig(o) for o in st.outs):
            return None
        rows, xs = geo
        K = ws[0].shape[1]
        if rows == 0 or any(math.prod(o.shape) == 0 for o in st.outs):
            return None
        if nw is not None and not self._contig(nw):
            return None
        do_norm = 1 if p["eps"] is not None else 0
        d = [rows, K, xs if rows > 1 else K, 1 if p["act"] == "q8" else 0, len(ws), epi, do_norm]
        for i in range(3):
            if i < len(ws):
                n = ws[0].shape[0] if epi else ws[i].shape[0]
                d += [ws[i].type_id, ws[i].shape[0], ws[i].row_bytes, n, 1 if ws[i].layout == "p16" else 0]
            else:
                d += [0, 0, 0, 0, 0]
        wsl = [self._wslot(w) for w in ws] + [-1] * (3 - len(ws))
        ysl = [self._slot(o) for o in st.outs] + [-1] * (3 - len(st.outs))
        eps = self._fparam(p["eps"] if do_norm else 0.0)
        return [OP_QMM, 10, 0, self._slot(x), self._slot(nw) if do_norm else -1, eps] + wsl + ysl, d

    def _rope_record(self, st):
        """OP_ROPE for a rope or rope_cache step: descriptor RP_* then the RPF_* doubles' bits"""
        try:  # the module (the package's `rope` attribute is the function)
            import importlib
            _rp = importlib.import_module("cpufuse.ops.rope")
        except ImportError:  # pragma: no cover - a build without cpufuse.rope
            return None
        p = st.params
        x, pos = st.ins[0], st.ins[1]
        kw = dict(p["kw"])
        try:
            import inspect
            dflt = {k: v.default for k, v in inspect.signature(_rp.rope).parameters.items()
                    if v.kind == v.KEYWORD_ONLY}
            known = ("freq_base", "freq_scale", "ext_factor", "attn_factor", "beta_fast", "beta_slow",
                     "n_ctx_orig", "freq_factors", "ggml_compat")
            if set(kw) - set(known) or not set(known) <= set(dflt):
                return None  # the Python step raises the precise error (or runs a newer rope)
            v = {k: kw.get(k, dflt[k]) for k in known}
            m = _rp._mode(p["mode"])
            fps = [_rp._real(v["freq_base"], "freq_base", positive=True),
                   _rp._real(v["freq_scale"], "freq_scale", positive=True),
                   _rp._real(v["ext_factor"], "ext_factor"), _rp._real(v["attn_factor"], "attn_factor"),
                   _rp._real(v["beta_fast"], "beta_fast"), _rp._real(v["beta_slow"], "beta_slow")]
            nco = _rp._int(v["n_ctx_orig"], "n_ctx_orig")
        except (TypeError, ValueError, AttributeError):
            return None
        compat, ff = v["ggml_compat"], v["freq_factors"]
        nd = p["n_dims"]
        if nco < 0 or not isinstance(compat, (bool, np.bool_)):
            return None
        if ff is not None and (not isinstance(ff, np.ndarray) or ff.dtype != F32 or ff.shape != (nd // 2,)):
            return None
        T, H, D = x.shape
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
        d = [T, H, D, nd, m, int(bool(compat)), int(f16), xst[0], xst[1], H * D, D, nco]
        assert len(d) == _RP_LEN and len(fps) == _RPF_LEN
        d += np.array(fps, np.float64).view(np.int64).tolist()
        return [OP_ROPE, 8, 0, self._slot(x), self._slot(pos), ffs, y, p0, n_ctx, row_b], d

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
        if k in ("add", "mul", "swiglu"):
            out = outs[0]
            a, b = ins
            if k != "swiglu" and a.shape != out.shape:
                a, b = b, a
            if a.shape != out.shape or not (self._contig(a) and self._contig(b) and self._contig(out)):
                return None
            op = {"add": OP_ADD, "mul": OP_MUL, "swiglu": OP_SWIGLU}[k]
            return [op, 5, math.prod(out.shape), S(a), S(b), math.prod(b.shape), S(out)], None
        if k in ("scale", "silu"):
            a, out = ins[0], outs[0]
            if not (self._contig(a) and self._contig(out)):
                return None
            if k == "scale":
                return [OP_SCALE, 4, math.prod(out.shape), S(a), self._fparam(st.params["s"]), S(out)], None
            return [OP_SILU, 3, math.prod(out.shape), S(a), S(out)], None
        if k in ("rms_norm", "add_rms_norm"):
            x, r, w, b = ins
            h, y = outs
            g = lambda n: G(n) if n is not None else None  # noqa: E731
            desc = _ops.rms_desc(G(x), G(y), g(h), g(r), g(w), g(b))
            return [OP_RMS, 9, 0, S(x), S(r), S(w), S(b), self._fparam(st.params["eps"]), S(h), S(y), 1], desc
        if k == "softmax":
            x, m, sk = ins
            y = outs[0]
            slopes = None
            if st.params["max_bias"] > 0:
                slopes = self._keep_array(_ops._slopes(G(x)[0][1], st.params["max_bias"]))
            mkind = 0 if m is None else (2 if m.dtype == F16 else 1)
            desc = _ops.softmax_desc(G(x), G(y), G(m) if m is not None else None, mkind)
            return [OP_SOFTMAX, 8, 0, S(x), S(m), slopes if slopes is not None else -1, S(sk),
                    self._fparam(st.params["scale"]), S(y), 1], desc
        if k == "flash_attn":
            q, kk, v, m, sk = ins
            out = outs[0]
            p = st.params
            slopes = None
            if p["max_bias"] > 0 and m is not None:
                slopes = self._keep_array(_ops._slopes(q.shape[1], p["max_bias"]))
            mkind = 0 if m is None else (2 if m.dtype == F16 else 1)
            N, T = q.shape[2], kk.shape[2]
            desc = _ops.fa_desc(G(q), G(kk), G(v), G(out), G(m) if m is not None else None, mkind,
                                kk.dtype == F16, v.dtype == F16, _ops.choose_strategy(N, T),
                                _ops.DEFAULT_SPLIT_CHUNK, 64)
            return [OP_FA, 11, 0, S(q), S(kk), S(v), S(m), slopes if slopes is not None else -1, S(sk),
                    self._fparam(p["scale"]), self._fparam(p["softcap"]), S(out), 1], desc
        if k == "matmul":
            a, b = ins
            c = outs[0]
            if not self.sgemm or not (self._contig(a) and self._contig(b) and self._contig(c)):
                return None
            M, K = a.shape
            N = b.shape[1]
            return [OP_GEMM, 9, M, N, K, S(a), K, S(b), N, S(c), N], None
        if k == "copy":
            a, out = ins[0], outs[0]
            ga, go = G(a), G(out)
            return [OP_COPY, 4, 0, S(a), S(out), a.dtype.itemsize], list(ga[0]) + ga[1] + go[1]
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
                recs.append(([OP_COPY, 4, 0, S(src), S(key_node), out.dtype.itemsize],
                             list(gs[0]) + gs[1] + [0] * pad + list(ost)))
            return recs
        if k in ("qmatmul", "qmatmul_swiglu"):
            return self._qmm_record(st)
        if k in ("rope", "rope_cache"):
            return self._rope_record(st)
        if k == "cache_write":
            src, p0 = ins
            cw = outs[0]
            if not self._contig(src):
                return None
            return [OP_CACHE_WRITE, 7, math.prod(src.shape), S(src), S(cw), S(p0), cw.shape[0], src.shape[0],
                    int(cw.dtype == F16)], None
        if k == "kv_write":
            src, cells = ins
            kv = outs[0]
            if not self._contig(src):
                return None
            return [OP_KV_WRITE, 7, src.shape[0], S(src), S(kv), S(cells), kv.shape[0], kv.shape[1] * kv.shape[2],
                    int(kv.dtype == F16)], None
        if k == "attn_seqs":
            q, kc, vc, seqs = ins
            out = outs[0]
            if not (self._contig(q) and self._contig(out)):
                return None
            n, H, D = q.shape
            return [OP_ATTN_SEQS, 18, S(q), S(kc), S(vc), S(seqs), seqs.shape[0], S(out), n, H, kc.shape[1], D,
                    kc.shape[0], int(kc.dtype == F16), int(vc.dtype == F16), _ops.SPLIT_MIN_T, _ops.TILED_MIN_N,
                    _ops.DEFAULT_SPLIT_CHUNK, self._fparam(st.params["scale"]), self._fparam(st.params["softcap"])], None
        if k == "gather_rows":
            x, idx = ins
            out = outs[0]
            if not (self._contig(x) and self._contig(out)):
                return None
            return [OP_GATHER_ROWS, 6, out.shape[0], S(x), S(idx), S(out), x.shape[1], x.shape[0]], None
        return None

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
        lines = [f"plan: {len(self.steps)} kernel calls for {len(self._compute_order())} compute nodes, "
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
        for n in self._inputs:
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
            inp = [(slot, cast("void *", arrays[name].ctypes.data + boff)) for slot, name, boff in self._input_slots]
        outs = tuple(self._array(n, arrays) for n in self.graph.outputs)
        ptrs, segments = getattr(self, "_ptrs", None), self.segments

        def bound(copy=False, n_threads=None):
            nth = _dispatch.threads(n_threads)
            with self._lock:
                for slot, p in inp:  # (re)point the plan at these inputs: another bind may have run since
                    ptrs[slot] = p
                for kind, seg in segments:
                    if kind == "c":
                        fn, prog, nrec, steps = seg
                        rc = fn(prog, nrec, ptrs, self._fpc, self._blas, self.ilp64, nth)
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
        elif k == "swiglu":
            g, u = A(st.ins[0]), A(st.ins[1])
            with np.errstate(over="ignore"):
                np.multiply(g / (1.0 + np.exp(-g)), u, out=A(st.outs[0]))
        elif k == "rms_norm":
            x, _, w, b = (A(a) for a in st.ins)
            _ops.rms_norm(x, w, eps=st.params["eps"], bias=b, out=A(st.outs[1]), isa=isa, n_threads=nth)
        elif k == "add_rms_norm":
            x, r, w, b = (A(a) for a in st.ins)
            _ops.add_rms_norm(x, r, w, eps=st.params["eps"], bias=b, out=(A(st.outs[0]), A(st.outs[1])), isa=isa, n_threads=nth)
        elif k == "softmax":
            x, m, sk = (A(a) for a in st.ins)
            _ops.softmax(x, m, scale=st.params["scale"], max_bias=st.params["max_bias"], sinks=sk,
                         out=A(st.outs[0]), isa=isa, n_threads=nth)
        elif k == "flash_attn":
            q, kk, v, m, sk = (A(a) for a in st.ins)
            p = st.params
            _ops.flash_attn(q, kk, v, m, scale=p["scale"], max_bias=p["max_bias"], softcap=p["softcap"],
                            sinks=sk, out=A(st.outs[0]), isa=isa, n_threads=nth)
        elif k == "matmul":
            np.matmul(A(st.ins[0]), A(st.ins[1]), out=A(st.outs[0]))
        elif k == "copy":
            np.copyto(A(st.outs[0]), A(st.ins[0]))
        elif k == "concat":
            np.concatenate([A(st.ins[0]), A(st.ins[1])], axis=st.params["axis"], out=A(st.outs[0]))
        elif k in ("qmatmul", "qmatmul_swiglu"):
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
            elif len(p["ws"]) == 1:
                _qm.matmul(x, p["ws"][0], out=A(st.outs[0]), **kw)
            else:
                _qm.matmul_multi(x, p["ws"], out=tuple(A(o) for o in st.outs), **kw)
        elif k == "rope":
            p = st.params
            _rope_fn(st.nodes[0].name)(A(st.ins[0]), A(st.ins[1]), n_dims=p["n_dims"], mode=p["mode"],
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
            r = _rope_fn(st.nodes[0].name)(A(st.ins[0]), A(st.ins[1]), n_dims=p["n_dims"], mode=p["mode"],
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
            if nr < 0 or r0 < 0 or r0 + nr > n or pos0 < 0 or cell0 < 0 or cell0 + pos0 + nr > kc.shape[0]:
                raise GraphError(f"run: attn_seqs {st.outs[0].name!r}: group {g} (cell0, row0, n_rows, pos0) = "
                                 f"{(cell0, r0, nr, pos0)} does not fit {n} query rows and {kc.shape[0]} cache cells")
            T = pos0 + nr
            mask = None
            if nr > 1:
                mask = np.zeros((1, 1, nr, T), F16)
                mask[0, 0][np.arange(T)[None, :] > pos0 + np.arange(nr)[:, None]] = -np.inf
            K = kc[cell0:cell0 + T].transpose(1, 0, 2)[None]
            V = vc[cell0:cell0 + T].transpose(1, 0, 2)[None]
            Q = q[r0:r0 + nr].transpose(1, 0, 2)[None]
            o = _ops.flash_attn(Q, K, V, mask, scale=st.params["scale"], softcap=st.params["softcap"],
                                isa=self.isa, n_threads=nth)
            out[r0:r0 + nr] = o[0]

    def _pos0(self, node, n_tokens, cw, arrays):
        p0 = int(self._array(node, arrays)[0])
        n_ctx = cw.shape[0]
        if p0 < 0 or p0 + n_tokens > n_ctx:
            raise GraphError(f"run: cache_write {cw.name!r}: rows [{p0}, {p0 + n_tokens}) of input "
                             f"{node.name!r} do not fit the cache's n_ctx={n_ctx}")
        return p0


def _rope_fn(name):
    """cpufuse.rope, imported when a plan first runs a rope step (it lives in another module)."""
    import cpufuse
    fn = getattr(cpufuse, "rope", None)
    if fn is None:
        raise GraphError(f"run: rope {name!r}: cpufuse.rope is not available in this build")
    return fn


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
        self._in_shape = {n.name: (np.array(n.shape), {}) for n in self.plan._inputs}
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
            if self.plan._fp != p1._fp or self.plan._fp != p2._fp:
                raise GraphError(f"DynamicPlan: float parameters change with {d!r}")
            self._slopes[d] = s1
            for n1 in p1._inputs:
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
        for slot, name, boff in plan._input_slots:
            a = inputs.get(name)
            want = self._shape(*self._in_shape[name], sz)
            node = next(n for n in plan._inputs if n.name == name)
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
        with plan._lock:
            for slot, p in ptr_args:
                plan._ptrs[slot] = p
            pc = _backend.ffi.from_buffer("int64_t[]", prog)
            rc = self._fn(pc, self._nrec, plan._ptrs, plan._fpc, plan._blas, plan.ilp64, nth)
            if rc:
                bad = self._steps[rc - 1]
                raise GraphError(f"run: kernel call failed at {bad.kind} [{', '.join(n.name for n in bad.nodes)}] "
                                 "(an index input out of range: kv_write cells, attn_seqs groups or gather_rows idx)")
            return tuple(o.copy() for o in outs) if copy else tuple(outs)
