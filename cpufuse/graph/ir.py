"""The graph's data, shared by every stage (builder, fusion, lowering, executor): Node, Step,
GraphError, the dtypes and the view helpers. Imports nothing from the other graph modules."""
import numpy as np

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
I32 = np.dtype(np.int32)


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


class Step:
    """One kernel call of a plan (what fusion hands to lowering): its kind (a row of kinds.py), the
    graph nodes it covers, what it reads and writes, its parameters and, when fused, a note."""
    __slots__ = ("kind", "nodes", "ins", "outs", "params", "note")

    def __init__(self, kind, nodes, ins, outs, params=None, note=""):
        self.kind, self.nodes, self.ins, self.outs = kind, nodes, ins, outs
        self.params, self.note = params or {}, note


def compute_nodes(graph):
    """the nodes that compute (every node but inputs, constants and views), in execution order"""
    return [n for n in graph.nodes if n.op not in ("input", "const", "reshape", "permute")]


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
