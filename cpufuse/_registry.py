"""The kernel registry: (op, isa) -> the callable that runs the op on that ISA.

Every kernel that cpufuse calls is looked up here, Numba included. KERNELS names each op once:
its C entry point (the extension exports it once per compiled ISA, as <symbol>__<isa>, declared
in native/cdef.h) and its Numba entry (a function of a cpufuse.numba module, cpufuse/numba/entries.py
for the ops: it takes the C entry's arguments); either may be absent. tests/test_layouts.py checks
KERNELS against native/cdef.h.

An op calls its kernel one way on every ISA; convention(isa) says how that ISA's entries take the
arguments: a native entry a descriptor as a cffi int64 array and operands as pointers (NULL where
absent), a Numba entry the descriptor as a tuple and operands as the arrays (None where absent).

    fn = kernel("softmax", isa)                 # a cffi function (native ISA) ...
    fn = kernel("softmax", "numba", n_threads)  # ... or a Numba function, numba's threads set
    SM = table("softmax")                       # {isa: callable}: what hot paths keep

table(op) is the op's dict of the ISAs usable here: the native entries are resolved when cpufuse
is imported, the Numba entry on first use (kernel(op, "numba") imports its module, which compiles
or loads its cached machine code). Tests wrap the entries of these dicts to see which kernels run.
"""
import importlib
import threading

import numpy as np

from . import _backend, _dispatch

# op: (C symbol without its __<isa> suffix, or None; (cpufuse.numba module, function), or None)
KERNELS = {
    "softmax": ("cf_softmax_f32", ("entries", "softmax")),
    "softmax_unfused": ("cf_softmax_unfused_f32", ("entries", "softmax")),  # (Numba: no separate-pass chain)
    "rms_norm": ("cf_rms_norm_f32", ("entries", "rms_norm")),
    "rms_norm_unfused": ("cf_rms_norm_unfused_f32", ("entries", "rms_norm")),
    "rms_norm_rows": ("cf_rms_norm_rows_f32", ("entries", "rms_norm_rows")),  # contiguous rows, 1-D weight
    "flash_attn": ("cf_flash_attn_f32", ("entries", "flash_attn")),
    "flash_attn_unfused": ("cf_flash_attn_unfused_f32", ("entries", "flash_attn")),
    "qmatmul": ("cf_qmatmul_f32", ("entries", "qmatmul")),
    "quantize_act": ("cf_quantize_act", ("entries", "quantize_act")),
    "rope": ("cf_rope_f32", ("entries", "rope")),
    "plan_run": ("cf_plan_run", None),                           # the graph executor
    "add": ("cf_add_f32", None),                                 # elementwise (the plans' steps)
    "mul": ("cf_mul_f32", None),
    "swiglu": ("cf_swiglu_f32", None),
    "scale": ("cf_scale_f32", None),
    "silu": ("cf_silu_f32", None),
    "exp": ("cf_exp_f32", None),                                 # exp over an array (tests, benchmark)
    "exp_le0": ("cf_exp_le0_f32", None),
    "fma_peak": ("cf_fma_peak", None),                           # the benchmark's probes (probe.inc):
    "int8_peak": ("cf_int8_peak", None),                         # FMA and int8 dot peaks,
    "read_sum": ("cf_read_sum", None),                           # DRAM read bandwidth
    "build_info": ("cf_build_info", None),
    "qtype_info": ("cf_qtype_info", None),                       # quant.inc's type traits (tests/test_layouts.py)
    "dequant_rows": ("cf_dequant_rows_f32", None),               # GET_ROWS of quantized rows (Model.embed)
}

NATIVE = tuple(i for i in _dispatch.AVAILABLE if i != "numba") if _backend.lib is not None else ()
_TABLES = {op: {isa: _backend.native_fn(sym, isa) for isa in NATIVE} if sym else {}
           for op, (sym, _) in KERNELS.items()}
_lock = threading.Lock()


def table(op):
    """{isa: callable} for op: the dict itself (the same object for the life of the process)"""
    return _TABLES[op]


def _numba(op):
    nbk = KERNELS[op][1]
    if nbk is None or not _dispatch.HAVE_NUMBA:
        raise ValueError(f"kernel {op!r} has no Numba implementation")
    with _lock:
        fn = _TABLES[op].get("numba")
        if fn is None:
            fn = _TABLES[op]["numba"] = getattr(importlib.import_module(f"cpufuse.numba.{nbk[0]}"), nbk[1])
    return fn


_numba_tls = threading.local()
_numba_set = []


def _numba_threads(n_threads):
    """numba's thread count for this calling thread: n_threads (or the default), capped at numba's
    pool size; numba.set_num_threads (~1 us) is called only when it changes"""
    if not _numba_set:
        import numba
        _numba_set[:] = [numba.set_num_threads, numba.config.NUMBA_NUM_THREADS]
    n = min(_dispatch.threads(n_threads), _numba_set[1])
    if getattr(_numba_tls, "n", 0) != n:
        _numba_set[0](n)
        _numba_tls.n = n


def kernel(op, isa, n_threads=None):
    """The callable of op on isa (a resolved ISA name). For "numba", numba's thread count is set to
    n_threads (None: the default) for this thread first; native kernels take it as an argument."""
    fn = _TABLES[op].get(isa)
    if isa == "numba":
        if fn is None:
            fn = _numba(op)
        _numba_threads(n_threads)
    elif fn is None:
        raise ValueError(f"kernel {op!r} has no {isa} implementation here (native ISAs: {', '.join(NATIVE) or 'none'})")
    return fn


class Convention:
    """how an ISA's entries take their arguments (module doc): arrays (operands are the arrays
    themselves), null (an absent operand), desc(values) and doubles(values) (an int64 descriptor, a
    float64 parameter array), operand(a) (an array, None or a QTensor as the entry takes it) and
    at(buf, start, n, row_bytes) (rows start.. start + n of a C-contiguous operand buf)"""
    __slots__ = ("arrays", "null", "desc", "doubles", "operand", "at")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


def _pointer(a):
    """a cffi pointer to a's first element (any strides; the descriptor carries them), NULL for
    None, the bytes' pointer for a QTensor (cpufuse.quant.matmul._wptr made it)"""
    if a is None:
        return _ffi.NULL
    if type(a) is not np.ndarray:
        return a._c[0]
    if a.flags.c_contiguous:
        return _ffi.from_buffer(_PTR_TYPES.get(a.dtype, _T_CHAR), a)
    return _ffi.cast(_T_VOID, a.ctypes.data)


_ffi = _backend.ffi
if _ffi is not None:
    _PTR_TYPES = {np.dtype(np.float32): _ffi.typeof("float[]"), np.dtype(np.int32): _ffi.typeof("int32_t[]")}
    _T_CHAR, _T_VOID = _ffi.typeof("char[]"), _ffi.typeof("void *")
NATIVE_CONVENTION = Convention(
    arrays=False, null=_ffi.NULL if _ffi is not None else None, operand=_pointer,
    desc=lambda v: _ffi.new("int64_t[]", v), doubles=lambda v: _ffi.new("double[]", v),
    at=lambda buf, start, n, row: buf + start * row)
NUMBA_CONVENTION = Convention(arrays=True, null=None, operand=lambda a: a, desc=tuple, doubles=tuple,
                              at=lambda buf, start, n, row: buf[start:start + n])


def convention(isa):
    """how the entries of isa (a resolved ISA name) take their arguments"""
    return NUMBA_CONVENTION if isa == "numba" else NATIVE_CONVENTION
