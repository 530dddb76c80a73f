"""The graph builder: Graph (ggml-style nodes, shape and dtype checks at construction).
Graph.compile() runs the stages: fusion.fuse, records.lower, executor.Plan."""
import math
import os

import numpy as np

from .. import _dispatch

from .executor import compile_graph
from .ir import F16, F32, I32, GraphError, Node, as_int, _contig_strides, _is_contig, _softmax_mask_ok, _suffix_tiles, _view_root


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

    def gelu(self, a, name=None):
        """GELU, tanh form: a / (1 + exp(-a (C1 + C2 a^2))), C1 = 2 sqrt(2/pi), C2 = 0.044715 C1
        (= 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3))); docs/semantics.md §5)"""
        self._f32(a, "gelu", self._name("gelu", name))
        return self._add("gelu", [a], {}, a.shape, F32, name)

    def softcap(self, a, cap, name=None):
        """y = cap * tanh(a / cap) (the logit softcap of Gemma 2), cap a finite number > 0"""
        nm = self._name("softcap", name)
        self._f32(a, "softcap", nm)
        cap = float(cap)
        if not (math.isfinite(cap) and cap > 0):
            raise GraphError(f"softcap {nm!r}: cap must be finite and > 0, got {cap}")
        return self._add("softcap", [a], {"cap": cap}, a.shape, F32, name)

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
        shape = tuple(as_int(s) for s in shape)
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
        if w.n_expert:
            raise GraphError(f"qmatmul {nm!r}: w is a 3-D expert tensor {w.shape}; use w[e] or g.qmatmul_id")
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

    def _kv_cache(self, op, nm, cache, heads, head_dim, kv_type=None):
        """check a KV cache array: float16/float32 (n_cells, heads, head_dim), or with kv_type "q8_0" /
        "q4_0" uint8 blocks (n_cells, heads, head_dim / 32 * bytes per block)"""
        from ..ops import kvquant
        if kv_type is not None and kv_type not in kvquant.QUANT:
            raise GraphError(f"{op} {nm!r}: kv_type must be None (a float cache) or one of "
                             f"{', '.join(kvquant.QUANT)}, got {kv_type!r}")
        want = (np.dtype(np.uint8),) if kv_type else (F32, F16)
        if not isinstance(cache, np.ndarray) or cache.dtype not in want:
            raise GraphError(f"{op} {nm!r}: cache must be a " + (f"uint8 ({kv_type} blocks)" if kv_type else
                             "float16 or float32") + f" numpy array, got {getattr(cache, 'dtype', type(cache).__name__)}")
        if kv_type and head_dim % 32:
            raise GraphError(f"{op} {nm!r}: a {kv_type} cache needs a head_dim that is a multiple of 32, got {head_dim}")
        row = kvquant.row_bytes(kv_type, head_dim) if kv_type else head_dim
        if cache.ndim != 3 or cache.shape[1:] != (heads, row):
            raise GraphError(f"{op} {nm!r}: cache must be (n_cells, {heads}, {row}), got {cache.shape}")
        if not cache.flags.c_contiguous or not cache.flags.behaved:
            raise GraphError(f"{op} {nm!r}: cache must be C-contiguous, aligned and writeable, got "
                             f"c_contiguous={cache.flags.c_contiguous}, aligned={cache.flags.aligned}, "
                             f"writeable={cache.flags.writeable}")

    def _i32_input(self, op, nm, node, what, shape):
        if not isinstance(node, Node) or node.op != "input" or node.dtype != I32 or len(node.shape) != len(shape) \
                or any(a is not None and a != b for a, b in zip(shape, node.shape)):
            raise GraphError(f"{op} {nm!r}: {what} must be an int32 input node of shape {shape}, got {node!r}"
                             + (f" {node.dtype}" if isinstance(node, Node) else ""))

    def kv_write(self, src, cache, cells, kv_type=None, name=None):
        """Write row i of src (n_tokens, n_heads, head_dim) float32 into cell cells[i] of cache, a
        C-contiguous user-owned array (n_cells, n_heads, head_dim), float16 (rounded to nearest even)
        or float32; or with kv_type "q8_0" / "q4_0" a uint8 array (n_cells, n_heads, head_dim / 32 *
        34 or 18) of blocks (cpufuse.ops.kvquant.quantize; the node's shape is still (n_cells,
        n_heads, head_dim)); cells an int32 input node (n_tokens,) read at run time (a GraphError when a cell
        is outside the cache). The scatter form of cache_write, for batches that mix sequences
        (each with its own cells). The node's value is the whole cache; always executed."""
        nm = self._name("kv_write", name)
        self._f32(src, "kv_write", nm)
        if len(src.shape) != 3:
            raise GraphError(f"kv_write {nm!r}: src must be (n_tokens, n_heads, head_dim), got {src.shape}")
        self._kv_cache("kv_write", nm, cache, src.shape[1], src.shape[2], kv_type)
        self._i32_input("kv_write", nm, cells, "cells", (src.shape[0],))
        return self._add("kv_write", [src, cells], {"cache": cache, "kv_type": kv_type},
                         cache.shape[:2] + src.shape[2:], cache.dtype, name)

    def attn_seqs(self, q, k, v, seqs, scale, softcap=0.0, window=0, ring=0, sinks=None, name=None):
        """Attention of a batch that mixes sequences, each over exactly its own KV cells. q (n_tokens,
        n_heads, head_dim) float32; k, v: kv_write (or cache_write) nodes, i.e. KV caches (n_cells,
        n_kv_heads, head_dim) with n_heads a multiple of n_kv_heads (GQA); seqs an int32 input node
        (n_groups, 4), one row (cell0, row0, n_rows, pos0) per sequence in the batch: query rows
        row0 .. row0+n_rows-1 are its tokens at positions pos0.. (consecutive), its position p lives
        in cell cell0 + p, and token i attends positions 0 .. pos0+i (causal). Rows with n_rows = 0
        are unused. Each sequence is one flash_attn call with N = n_rows, T = pos0 + n_rows and the
        auto strategy of cpufuse.ops.choose_strategy: what it computes alone, whatever else is in
        the batch. window > 0: a sliding window, the token at position p attends positions
        p - window + 1 .. p only (T counts from the group's first visible position). ring > 0 (with a
        window): each sequence's cells are a ring of `ring` cells from cell0, position p in cell
        cell0 + p % ring (a sliding-window layer's cache of window + batch cells); a group whose
        visible keys wrap around is attended over a contiguous copy of them. sinks: a float32 node
        (n_heads,), each head's sink logit (gpt-oss: it adds exp(sink) to the softmax denominator).
        Output (n_tokens, n_heads, head_dim) float32 (rows of no group are left as they were)."""
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
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
            raise GraphError(f"attn_seqs {nm!r}: window must be an integer >= 0 (0: none), got {window!r}")
        if isinstance(ring, bool) or not isinstance(ring, (int, np.integer)) or ring < 0 or \
                (ring and not (window and window <= ring <= k.shape[0])):
            raise GraphError(f"attn_seqs {nm!r}: ring must be 0 or an integer in [window, n_cells] with a "
                             f"window > 0, got ring={ring!r}, window={window!r}, n_cells={k.shape[0]}")
        if sinks is not None:
            self._f32(sinks, "attn_seqs", nm)
            if sinks.shape != (q.shape[1],):
                raise GraphError(f"attn_seqs {nm!r}: sinks must be ({q.shape[1]},) (one per head), got {sinks.shape}")
        return self._add("attn_seqs", [q, k, v, seqs] + ([sinks] if sinks is not None else []),
                         {"scale": float(scale), "softcap": float(softcap),
                                                        "window": int(window), "ring": int(ring)},
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

    # -- weights as data: routed matmul and gating (graph/moe.py, native/kernels/qmoe.inc) ----------
    def qmatmul_id(self, x, w, ids, act=None, up=None, glu="swiglu", bias=None, up_bias=None, name=None):
        """The routed matmul (ggml's mul_mat_id): x (n, n_in) float32, w a 3-D cpufuse.QTensor
        (n_expert, n_out, n_in), ids an int32 node (n, k) of expert ids read at run time (an input, or
        g.topk's output): y[r, j] = x[r] . dequant(w[ids[r, j]])^T, output (n, k, n_out). Each row is
        computed exactly as cpufuse.matmul computes it alone (act "q8" (default) or "f32"); each
        expert's weights are read once per run over the rows routed to it. up: a second 3-D tensor of
        w's shape: y = glu(x . w_e^T) * (x . up_e^T), glu "swiglu" or "geglu" (matmul_swiglu /
        matmul_geglu), or "swiglu_oai" (g.swiglu_oai's op on the two products). bias, up_bias: float32
        nodes (n_expert, n_out), expert e's row added to its product (w's, up's) before the glu, one f32
        add each (g.add_id's): gpt-oss's expert biases (with up=, glu "swiglu_oai" only). An id
        outside [0, n_expert) is a GraphError at run time."""
        from ..quant.types import QTensor
        nm = self._name("qmatmul_id", name)
        if not isinstance(x, Node):
            raise GraphError(f"qmatmul_id {nm!r}: x must be a node of this graph, got {type(x).__name__}")
        self._f32(x, "qmatmul_id", nm)
        for what, t in (("w", w), ("up", up)):
            if t is None and what == "up":
                continue
            if not isinstance(t, QTensor) or not t.n_expert:
                raise GraphError(f"qmatmul_id {nm!r}: {what} must be a 3-D cpufuse.QTensor (n_expert, n_out, n_in), "
                                 f"got {getattr(t, 'shape', type(t).__name__)}")
        if up is not None and up.shape != w.shape:
            raise GraphError(f"qmatmul_id {nm!r}: up {up.shape} must have w's shape {w.shape}")
        if up is not None and glu not in ("swiglu", "geglu", "swiglu_oai"):
            raise GraphError(f"qmatmul_id {nm!r}: glu must be 'swiglu', 'geglu' or 'swiglu_oai', got {glu!r}")
        if up is None and up_bias is not None:
            raise GraphError(f"qmatmul_id {nm!r}: up_bias needs up")
        if up is not None and (bias is not None or up_bias is not None) and glu != "swiglu_oai":
            raise GraphError(f"qmatmul_id {nm!r}: biases with up= need glu='swiglu_oai', got {glu!r}")
        for what, b in (("bias", bias), ("up_bias", up_bias)):
            if b is None:
                continue
            if not isinstance(b, Node) or b.dtype != F32 or b.shape != (w.n_expert, w.n_out):
                raise GraphError(f"qmatmul_id {nm!r}: {what} must be a float32 node ({w.n_expert}, {w.n_out}), got "
                                 f"{getattr(b, 'shape', type(b).__name__)}" + (f" {b.dtype}" if isinstance(b, Node) else ""))
        if act not in (None, "q8", "f32"):
            raise GraphError(f"qmatmul_id {nm!r}: act must be 'q8', 'f32' or None, got {act!r}")
        if len(x.shape) != 2 or x.shape[1] != w.n_in:
            raise GraphError(f"qmatmul_id {nm!r}: x {x.name!r} must be (n, {w.n_in}) (w is {w.shape}), got {x.shape}")
        if not isinstance(ids, Node) or ids.dtype != I32 or len(ids.shape) != 2 or ids.shape[0] != x.shape[0] \
                or ids.shape[1] < 1:
            raise GraphError(f"qmatmul_id {nm!r}: ids must be an int32 node of shape ({x.shape[0]}, k >= 1), got "
                             f"{ids!r}" + (f" {ids.dtype}" if isinstance(ids, Node) else ""))
        self._unit_rows(x, "qmatmul_id", nm)
        biases = [b for b in (bias, up_bias) if b is not None]
        return self._add("qmatmul_id", [x, ids] + biases, {"w": w, "up": up, "glu": glu, "act": act or "q8",
                                                           "bias": bias is not None, "up_bias": up_bias is not None},
                         (x.shape[0], ids.shape[1], w.n_out), F32, name)

    def topk(self, x, k, name=None):
        """The indices (an int32 node (..., k)) of the k largest values of each row of x (..., c) float32,
        largest first; exact ties go to the lower index; NaN ranks below every number (-inf included),
        NaNs among themselves by index. Their values: g.take(x, ids)."""
        nm = self._name("topk", name)
        self._f32(x, "topk", nm)
        if len(x.shape) < 1 or isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= x.shape[-1]:
            raise GraphError(f"topk {nm!r}: k must be an int in [1, {x.shape[-1] if x.shape else 0}] (x is "
                             f"{x.shape}), got {k!r}")
        return self._add("topk", [x], {}, x.shape[:-1] + (int(k),), I32, name)

    def take(self, x, idx, name=None):
        """y[..., j] = x[..., idx[..., j]]: x (..., c) float32, idx an int32 node (..., k) with x's leading
        shape (e.g. g.topk's output: the top-k values, or the unbiased probabilities at the selected ids).
        An index outside [0, c) is a GraphError at run time."""
        nm = self._name("take", name)
        self._f32(x, "take", nm)
        if not isinstance(idx, Node) or idx.dtype != I32 or idx.shape[:-1] != x.shape[:-1] or len(idx.shape) < 1:
            raise GraphError(f"take {nm!r}: idx must be an int32 node of shape {x.shape[:-1]} + (k,), got {idx!r}"
                             + (f" {idx.dtype}" if isinstance(idx, Node) else ""))
        return self._add("take", [x, idx], {}, idx.shape, F32, name)

    def sigmoid(self, a, name=None):
        """1 / (1 + exp(-a)), elementwise in float32"""
        self._f32(a, "sigmoid", self._name("sigmoid", name))
        return self._add("sigmoid", [a], {}, a.shape, F32, name)

    def wsum(self, y, w, name=None):
        """The weighted sum over k (the MoE combine): y (..., k, m), w (..., k) float32 -> (..., m),
        out = sum over j of f32(w[..., j] * y[..., j, :]), added in slot order j = 0..k-1."""
        nm = self._name("wsum", name)
        self._f32(y, "wsum", nm)
        self._f32(w, "wsum", nm)
        if len(y.shape) < 2 or tuple(w.shape) != tuple(y.shape[:-1]):
            raise GraphError(f"wsum {nm!r}: w must have y's shape without its last axis, got y {y.shape}, w {w.shape}")
        return self._add("wsum", [y, w], {}, y.shape[:-2] + (y.shape[-1],), F32, name)

    def normw(self, x, floor=0.0, scale=0.0, name=None):
        """The MoE weights' renormalisation and scale over the last axis of x (..., k) float32:
        y = x / max(sum_j x[..., j], floor) when floor > 0 (the sum in double, rounded to f32, as
        ggml's sum_rows), then y * scale when scale is not 0 (llama.cpp's norm_w floor is
        6.103515625e-5)."""
        nm = self._name("normw", name)
        self._f32(x, "normw", nm)
        floor, scale = float(floor), float(scale)
        if not (math.isfinite(floor) and floor >= 0 and math.isfinite(scale)) or len(x.shape) < 1:
            raise GraphError(f"normw {nm!r}: floor must be finite and >= 0 and scale finite, got floor={floor}, "
                             f"scale={scale} (x {x.shape})")
        return self._add("normw", [x], {"floor": floor, "scale": scale}, x.shape, F32, name)

    def swiglu_oai(self, g, u, name=None):
        """gpt-oss's GLU: x = min(g, 7), y = clamp(u, -7, 7), x * sigmoid(1.702 x) * (y + 1), elementwise
        in float32 (g and u of one shape; graph/oai.py)"""
        nm = self._name("swiglu_oai", name)
        self._f32(g, "swiglu_oai", nm)
        self._f32(u, "swiglu_oai", nm)
        if g.shape != u.shape:
            raise GraphError(f"swiglu_oai {nm!r}: g {g.shape} and u {u.shape} must have one shape")
        return self._add("swiglu_oai", [g, u], {}, g.shape, F32, name)

    def add_id(self, a, b, ids, name=None):
        """y[r, j, :] = a[r, j, :] + b[ids[r, j], :] (ggml's add_id: the per-expert bias after a routed
        matmul): a (n, k, m) float32, b (n_b, m) float32, ids an int32 node (n, k); an id outside
        [0, n_b) is a GraphError at run time"""
        nm = self._name("add_id", name)
        self._f32(a, "add_id", nm)
        self._f32(b, "add_id", nm)
        if len(a.shape) != 3 or len(b.shape) != 2 or b.shape[1] != a.shape[2]:
            raise GraphError(f"add_id {nm!r}: a must be (n, k, m) and b (n_b, m), got {a.shape} and {b.shape}")
        if not isinstance(ids, Node) or ids.dtype != I32 or ids.shape != a.shape[:2]:
            raise GraphError(f"add_id {nm!r}: ids must be an int32 node of shape {a.shape[:2]}, got {ids!r}")
        return self._add("add_id", [a, b, ids], {}, a.shape, F32, name)

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
        return compile_graph(self, bool(fusion), _dispatch.resolve(isa))
