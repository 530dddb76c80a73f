"""One binder for the op calls: each public op declares its operands once, and the binder derives the
cache key, the per-call checks and the cached (kernel, descriptor), as numpy caches a ufunc's inner
loop by the operands' dtypes.

    _SM = Binder("softmax",
                 operands=(In("x", F32), In("mask", F32, F16, optional=True), In("sinks", F32, optional=True),
                           Out("out", F32, alias=("x",))),
                 params=(Param("scale", key=False, passed=True), Param("max_bias"), Param("fused")))

An operand has a dtype (F32 binds as float*, I32 as int32_t*, anything else as char*), a role and
whether it may be None:
  In     read only;
  InOut  read, and written when an output aliases it: it must not share a byte with another input;
  Out    written: new (allocated, of the entry's shape) when the caller passes None, else aligned,
         writeable and sharing no byte with any input or earlier output, except that it may be one of
         its `alias` inputs exactly (the same array object: in place);
  Weight a QTensor (cpufuse.quant): its geometry joins the key, its bytes are an input.
A parameter joins the key by type and value (key=True) or by type alone (key=False: only for a
value that no check looks at), and is handed to the kernel when passed=True. isa and n_threads
close every key; n_threads is always handed to the kernel.

The key is what the checks look at apart from the operands' addresses and memory layout: each
operand's shape and dtype (or None), whether each output is each of its alias inputs, each
parameter, the ISA in force and n_threads. The op's checks run on the first call with a key; they
raise the precise error, or make an entry, (launch, arrays, new shapes), where launch closes over
the kernel and its descriptor, and hand it to `plan`, which keeps it under the key and binds the
call. Later calls with the key only bind:

  every operand C-contiguous (cffi's from_buffer refuses anything else) and aligned, every given
  output writeable, and no two operands overlapping where the declaration forbids it.

Overlap is decided once, here: operands are half-open byte ranges [a, a + na), and two share memory
iff -nb < b - a < na (strict: arrays that only touch do not overlap). An operand that does not bind
makes the call return None, and the op then runs its checks, which run the call strided, copy, or
raise the error the first call would have raised. An entry therefore never skips a check.

launch(operands..., passed params..., n_threads) gets the operands as the ISA's registry entries take
them (_registry.convention: cffi pointers for a native entry, the arrays themselves for a Numba one,
arrays=True); it returns a false value when the kernel ran, a true one to send the call through the
checks (rope's pos0 outside the cache, say).

The binder writes each op's key, fast and bind functions as Python source once (`Binder.source`),
from the declaration, so that a call pays no loop over declarations: fast(operands..., params...,
isa, n_threads) is the key, the lookup and the binding in one frame, and returns the outputs as a
tuple, or None. The general path (strided operands, masks...) keeps its descriptors by geometry in
the same cache (`descriptor`).
"""
import linecache

import numpy as np

from .. import _backend, _dispatch

F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)
ffi = _backend.ffi
if ffi is None:  # no native extension: the Numba entries still bind through cffi's own pointers
    try:
        import cffi
        ffi = cffi.FFI()
    except ImportError:  # nothing binds: every call runs its checks
        ffi = None

ENTRIES_MAX = 256  # entries kept per op; an op's cache is cleared when full
_CACHES = []


def clear_plans():
    """forget every op's entries: an entry holds the kernel the registry gave when it was made, so
    code that swaps registry entries (tests do) clears them"""
    for d in _CACHES:
        d.clear()


class Operand:
    __slots__ = ("name", "dtypes", "role", "alias", "optional")

    def __init__(self, name, dtypes, role, alias=(), optional=False):
        self.name, self.dtypes, self.role, self.alias, self.optional = name, tuple(dtypes), role, tuple(alias), optional

    @property
    def kind(self):
        """how the operand binds: 'f' float*, 'i' int32_t*, 'c' char* (unit: 4, 4, 1 bytes)"""
        if self.role == "weight" or self.dtypes == (F32,):
            return "f"
        return "i" if self.dtypes == (I32,) else "c"


def In(name, *dtypes, optional=False):
    return Operand(name, dtypes, "in", optional=optional)


def InOut(name, *dtypes, optional=False):
    return Operand(name, dtypes, "inout", optional=optional)


def Out(name, *dtypes, alias=()):
    return Operand(name, dtypes, "out", alias=alias, optional=True)


def Weight(name, optional=False):
    return Operand(name, (), "weight", optional=optional)


class Param:
    __slots__ = ("name", "key", "passed")

    def __init__(self, name, key=True, passed=False):
        self.name, self.key, self.passed = name, key, passed


_CTYPES = {"f": "float[]", "i": "int32_t[]", "c": "char[]"}
_UNIT = {"f": 4, "i": 4, "c": 1}


class Binder:
    """an op's declaration, its cache of entries and the functions written from it (module doc)"""

    def __init__(self, name, operands, params=()):
        self.name, self.operands, self.params = name, tuple(operands), tuple(params)
        names = [o.name for o in self.operands] + [p.name for p in self.params]
        if len(set(names)) != len(names) or {"isa", "n_threads"} & set(names) or any(n[0] == "_" for n in names):
            raise ValueError(f"{name}: operand and parameter names must be distinct, not isa or n_threads and "
                             f"not start with _ (the written code's own names), got {names}")
        self.outs = tuple(o for o in self.operands if o.role == "out")
        self.cache = {}
        _CACHES.append(self.cache)
        self.source = self._source()
        filename = f"<cpufuse binder {name}>"
        linecache.cache[filename] = (len(self.source), None, self.source.splitlines(True), filename)
        ns = {"_get": self.cache.get, "_fb": ffi.from_buffer if ffi is not None else None,
              "_cast": ffi.cast if ffi is not None else None, "_NULL": ffi.NULL if ffi is not None else None,
              "_FP": ffi.typeof("float *") if ffi is not None else None,
              "_CP": ffi.typeof("char *") if ffi is not None else None,
              "_ctx_get": _dispatch._ctx.get, "_dispatch": _dispatch, "_empty": np.empty}
        for i, o in enumerate(self.operands):
            ns[f"_T{i}"] = ffi.typeof(_CTYPES[o.kind]) if ffi is not None else None
            ns[f"_D{i}"] = o.dtypes[0] if o.dtypes else None
        exec(compile(self.source, filename, "exec"), ns)
        self.key, self.fast, self.bind = ns["key"], ns["fast"], ns["bind"]

    def remember(self, key, launch, arrays, new=None):
        """store and return the entry (launch, arrays, new shape of each output or None) of key;
        key None (no hashable signature) stores nothing"""
        entry = (launch, arrays) + tuple(new if new is not None else (None,) * len(self.outs))
        if len(entry) != 2 + len(self.outs):
            raise ValueError(f"{self.name}: one new shape (or None) per output, got {new}")
        if key is not None:
            if len(self.cache) >= ENTRIES_MAX:
                self.cache.clear()
            self.cache[key] = entry
        return entry

    def descriptor(self, dkey, make):
        """a descriptor of the op's general path by its geometry dkey, made by make() on first use and
        kept in the op's one cache (under ("desc", dkey): no call key is a str first)"""
        k = ("desc", dkey)
        d = self.cache.get(k)
        if d is None:
            d = make()
            if len(self.cache) >= ENTRIES_MAX:
                self.cache.clear()
            self.cache[k] = d
        return d

    def plan(self, made, *args):
        """the op's checks passed for the call args (fast's arguments, as the caller gave them) and
        made (launch, arrays, new shapes), or None where the op has no plan for such calls: remember
        it under the call's key and bind args to it (the outputs, or None where they do not bind)"""
        if made is None:
            return None
        return self.bind(self.remember(self.key(*args), *made), *args)

    # -- the source written from the declaration ---------------------------------------------------
    def _source(self):
        ops, args = self.operands, ", ".join([o.name for o in self.operands] + [p.name for p in self.params]
                                             + ["isa", "n_threads"])
        key = []
        for o in ops:
            n = o.name
            part = (f"{n}._c[3]" if o.role == "weight"
                    else f"{n}.shape, {n}.dtype{''.join(f', {n} is {a}' for a in o.alias)}")
            key.append(f"None if {n} is None else ({part})" if o.optional else part)
        for p in self.params:
            key.append(f"type({p.name})")
            if p.key:
                key.append(p.name)
        key += ["isa or _ctx_get() or _dispatch.DEFAULT", "type(n_threads)", "n_threads"]
        key = "(" + ", ".join(key) + ")"
        body = self._bind_body()
        return (f"def key({args}):\n    try:\n        return {key}\n"
                f"    except (AttributeError, TypeError):\n        return None\n\n\n"
                f"def fast({args}):\n    try:\n        _e = _get({key})\n"
                f"    except (AttributeError, TypeError):\n        return None\n"
                f"    if _e is None:\n        return None\n"
                f"{body}\n\n"
                f"def bind(_e, {args}):\n{body}")

    def _bind_body(self):
        ops = self.operands
        ins = [o for o in ops if o.role != "out"]
        L = ["    try:"]
        w = L.append
        for o in ins:  # 1. the inputs' pointers
            i, n = ops.index(o), o.name
            ind = "        "
            if o.optional:
                w(f"{ind}if {n} is None:\n{ind}    _p_{n} = _NULL\n{ind}else:")
                ind += "    "
            if o.role == "weight":
                w(f"{ind}_w_{n} = {n}._c\n{ind}_p_{n} = _w_{n}[0]")
            else:
                w(f"{ind}if not {n}.flags.aligned:\n{ind}    return None\n{ind}_p_{n} = _fb(_T{i}, {n})")
        for o in ins:  # 2. an input that may be written shares no byte with another input
            if o.role == "inout":
                self._emit_tests(w, o, [self._overlap(o, a) for a in ins if a is not o])
        for o in self.outs:  # 3. the outputs: new, or given (writeable, sharing no byte where forbidden)
            i, j, n = ops.index(o), self.outs.index(o), o.name
            w(f"        if {n} is None:\n            _s = _e[{2 + j}]\n            if _s is None:\n"
              f"                _p_{n} = _NULL\n            else:\n"
              f"                {n} = _empty(_s, _D{i})\n                _p_{n} = _fb(_T{i}, {n})\n"
              f"        else:\n            if not {n}.flags.behaved:\n                return None\n"
              f"            _p_{n} = _fb(_T{i}, {n})")
            before = ins + list(self.outs[:j])
            # o's char pointer is taken once if a pair that is always tested compares bytes
            shared = o.kind != "c" and any(self._in_bytes(o, a) and not a.optional for a in before)
            if before:
                w(f"            _o_{n} = _p_{n} + 0\n            _n_{n} = len(_p_{n})")
                if shared:
                    w(f"            _c_{n} = _cast(_CP, _p_{n})\n            _b_{n} = {_UNIT[o.kind]} * _n_{n}")
                self._emit_tests(w, o, [self._overlap(o, a, shared) for a in before], "            ")
        w("    except (ValueError, TypeError, BufferError):\n        return None  # not C-contiguous, read-only, "
          "or pointers cffi cannot compare")
        passed = [p.name for p in self.params if p.passed] + ["n_threads"]
        arrays = ", ".join([o.name for o in ops] + passed)
        ptrs = ", ".join([f"_p_{o.name}" for o in ops] + passed)
        outs = "".join(f"{o.name}, " for o in self.outs)
        w(f"    if (_e[0]({arrays}) if _e[1] else _e[0]({ptrs})):\n        return None\n    return ({outs})\n")
        return "\n".join(L)

    @staticmethod
    def _emit_tests(w, o, tests, ind="        "):
        for t in tests:
            w(f"{ind}if {t}:\n{ind}    return None")

    @staticmethod
    def _in_bytes(o, a):
        return o.kind == "c" or a.kind == "c"

    @staticmethod
    def _overlap(o, a, shared=False):
        """the test that output (or inout) o shares a byte with operand a, on pointers (module doc)"""
        n, m = o.name, a.name
        is_out = o.role == "out"
        lo = f"_o_{n}" if is_out else f"(_p_{n} + 0)"
        ln = f"_n_{n}" if is_out else f"len(_p_{n})"
        if a.role == "weight":
            pa, la, ka = f"_w_{m}[4]", f"_w_{m}[5]", "f"
        else:
            pa, la, ka = f"_p_{m}", f"len(_p_{m})", a.kind
        ko = o.kind
        if ko != "c" and ka != "c":  # both 4-byte units: compare as floats
            if ko != "f":
                lo = f"_cast(_FP, _p_{n})"
            if ka != "f":
                pa = f"_cast(_FP, {pa})"
            test = f"-{ln} < {lo} - {pa} < {la}"
        else:  # in bytes
            if ko != "c":  # (an output's char pointer and byte length are taken once: c_, b_)
                lo, ln = (f"_c_{n}", f"_b_{n}") if shared else (f"_cast(_CP, _p_{n})", f"({_UNIT[ko]} * {ln})")
            if ka != "c":
                pa, la = f"_cast(_CP, {pa})", f"{_UNIT[ka]} * {la}"
            test = f"-{ln} < {lo} - {pa} < {la}"
        guards = [f"{n} is not None"] if (o.optional and not is_out) else []
        guards += [f"{m} is not None"] if (a.optional or a.role == "out") else []
        guards += [f"{n} is not {m}"] if m in o.alias else []
        return " and ".join(guards + [test])
