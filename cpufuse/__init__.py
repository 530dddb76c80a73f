"""cpufuse: fused LLM kernels for llama.cpp-style CPU inference, on numpy arrays.

    import cpufuse
    y = cpufuse.softmax(scores, mask, scale=0.125)           # ggml soft_max_ext
    w = cpufuse.QTensor(raw_gguf_bytes, "Q4_K", (n_out, n_in)) # GGUF weight, stays quantized
    y = cpufuse.matmul(x, w)                                  # fused dequantize x matmul
    y = cpufuse.rms_norm(x, weight, eps=1e-6)                 # RMS_NORM+MUL, one pass
    h, y = cpufuse.add_rms_norm(x, residual, weight, eps=1e-6)
    q = cpufuse.rope(q, pos, n_dims=128)                     # ggml rope_ext (f64 angles)
    cpufuse.rope(k, pos, n_dims=128, cache=(k_cache, pos0))  # rope + f16 KV-cache write
    with cpufuse.use_isa("scalar"): ...                       # or isa="avx2", or CPUFUSE_ISA=numba
    print(cpufuse.info())
"""
from . import _backend, _dispatch, _pages
from ._dispatch import AVAILABLE as _AVAILABLE
from ._dispatch import get_num_threads, set_num_threads, use_isa
from ._isa import ALL_ISAS
from .graph import Graph, GraphError
from .ops.attention import flash_attn
from .ops.norms import add_rms_norm, rms_norm
from .ops.rope import rope
from .ops.softmax import softmax
from .quant.matmul import matmul, matmul_multi, matmul_swiglu
from .quant.types import QTensor

__version__ = "0.1.0"
__all__ = ["set_num_threads", "get_num_threads", "softmax", "rms_norm", "add_rms_norm", "flash_attn", "QTensor", "matmul", "matmul_multi", "matmul_swiglu", "rope", "Graph", "GraphError", "use_isa", "available_isas", "info", "ALL_ISAS"]

OPS = ("softmax", "rms_norm", "add_rms_norm", "flash_attn", "matmul", "rope")


def available_isas():
    """ISA names usable here, best first (a subset of ALL_ISAS)."""
    return _AVAILABLE


def info():
    """What was compiled, what the CPU has, the override in force, and the ISA a call without isa=
    runs now ("isa": every op, since each op has a kernel for every available ISA and none falls
    back to another; tests/test_dispatch.py checks both)."""
    cur = _dispatch.current()
    return {
        "version": __version__,
        "machine": _backend.MACHINE,
        "native_extension": _backend.lib is not None,
        "native_load_error": _backend.LOAD_ERROR,
        "compiled_isas": list(_backend.COMPILED),
        "cpu_features": list(_backend.cpu_features()),
        "cpu_isas": list(_backend.cpu_isas()),
        "available_isas": list(_AVAILABLE),
        "auto_isa": _AVAILABLE[0],
        "override": {"source": _dispatch.override(), "isa": cur if _dispatch.override() else None},
        "isa": cur,
        "num_threads": _dispatch.get_num_threads(),
        "cores": {"affinity": _dispatch._affinity_cores(), "cgroup_cpu_quota": _dispatch.CPU_LIMIT,
                  "usable": _dispatch.CORES},
        "build_flags": {isa: _backend.build_info(isa) for isa in _backend.COMPILED},
        "huge_pages": _pages.thp(),
    }
