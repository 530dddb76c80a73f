"""The graph's data, shared by every stage (builder, fusion, lowering, executor): Node, Step,
GraphError, Dim (a size-dependent integer), the dtypes and the view helpers. Imports nothing from
the other graph modules."""
import itertools

import numpy as np

from .._layouts import _field as as_int   # an int: a Dim stays one, a bool or numpy integer becomes a plain int

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
I32 = np.dtype(np.int32)


class GraphError(ValueError):
    """A graph that cannot be built or compiled: the message names the node."""


class Dim(int):
    """An integer that depends on dynamic sizes, affinely: the int is its value at the capacities,
    coef[d] its change per unit of dimension d, span[d] = capacity_d - 1. At sizes s it is
    int(self) - sum(coef[d] * (capacity_d - s_d)) (at(self, sizes)). DynamicPlan builds its graph
    with Dim sizes; shapes, strides and record fields computed from them by +, -, * and // by
    constants stay Dims, so every size-dependent field of a program is known with its slope
    (records.lower: Program.affine). Decisions (comparisons, branches) see the value at the
    capacities: a lowering whose choice depends on the size checks it (same_over_sizes). A product
    of two Dims, or a Dim in a float, is not affine: GraphError."""

    def __new__(cls, value, coef, span):
        coef = {d: c for d, c in coef.items() if c}
        if not coef:
            return int(value)
        self = super().__new__(cls, value)
        self.coef, self.span = coef, {d: span[d] for d in coef}
        return self

    @classmethod
    def var(cls, name, cap):
        """the dimension itself, at capacity cap (its sizes are 1..cap)"""
        return cls(cap, {name: 1}, {name: cap - 1})

    def _lin(self, other, sign):
        if isinstance(other, Dim):
            coef = dict(self.coef)
            for d, c in other.coef.items():
                coef[d] = coef.get(d, 0) + sign * c
            return Dim(int(self) + sign * int(other), coef, {**self.span, **other.span})
        if isinstance(other, (int, np.integer)):
            return Dim(int(self) + sign * int(other), self.coef, self.span)
        raise GraphError(f"a size that depends on {sorted(self.coef)} used with {type(other).__name__}")

    def __add__(self, other):
        return self._lin(other, 1)

    __radd__ = __add__

    def __sub__(self, other):
        return self._lin(other, -1)

    def __rsub__(self, other):
        return -self._lin(other, -1)

    def __neg__(self):
        return Dim(-int(self), {d: -c for d, c in self.coef.items()}, self.span)

    def __mul__(self, other):
        if isinstance(other, Dim) or not isinstance(other, (int, np.integer)):
            raise GraphError(f"a size that depends on {sorted(self.coef)} times {type(other).__name__}: not affine")
        k = int(other)
        return Dim(int(self) * k, {d: c * k for d, c in self.coef.items()}, self.span)

    __rmul__ = __mul__

    def __floordiv__(self, other):
        if isinstance(other, (int, np.integer)) and not isinstance(other, Dim) and other > 0 \
                and all(c % other == 0 for c in self.coef.values()):
            return Dim(int(self) // int(other), {d: c // int(other) for d, c in self.coef.items()}, self.span)
        raise GraphError(f"a size that depends on {sorted(self.coef)} divided by {other!r}: not affine")

    def __truediv__(self, *other):
        raise GraphError(f"a size that depends on {sorted(self.coef)} in a float: not affine")

    __rtruediv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __float__ = __truediv__

    def __repr__(self):
        return int.__repr__(self)

    __str__ = __repr__

    def __reduce__(self):
        return (Dim, (int(self), self.coef, self.span))


def at(v, sizes, caps):
    """the value of v (an int or a Dim) at sizes (dim -> size) of the capacities caps"""
    if not isinstance(v, Dim):
        return v
    return int(v) - sum(c * (caps[d] - sizes[d]) for d, c in v.coef.items())


def same_over_sizes(fn, *args):
    """fn(*args), checked to be the same at every corner of the sizes the Dim args span (fn is
    monotone in each dimension for the callers: a strategy threshold), else GraphError"""
    dims = {}
    for a in args:
        if isinstance(a, Dim):
            dims.update(a.span)
    want = fn(*(int(a) for a in args))
    for corner in itertools.product(*[(0, sp) for sp in dims.values()]):
        down = dict(zip(dims, corner))
        got = fn(*(int(a) - sum(c * down[d] for d, c in a.coef.items()) if isinstance(a, Dim) else a for a in args))
        if got != want:
            raise GraphError(f"not affine in {sorted(dims)}: {getattr(fn, '__name__', 'a choice')} is {want!r} at the "
                             f"capacity and {got!r} at a smaller size; compile per size instead")
    return want


class Node:
    __slots__ = ("id", "op", "srcs", "params", "shape", "dtype", "name", "view_of", "view_strides",
                 "view_offset", "value")

    def __init__(self, nid, op, srcs, params, shape, dtype, name):
        self.id, self.op, self.srcs, self.params = nid, op, list(srcs), dict(params)
        self.shape, self.dtype, self.name = tuple(as_int(s) for s in shape), np.dtype(dtype), name
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
