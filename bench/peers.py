"""Optional peers for the kernel tables: PyTorch (CPU) and ggml (its CPU backend, through ctypes).
A build returns ((fn, get), None) or (None, why). Details: bench/README.md, "bench.peers".
"""
import ctypes
import functools
import glob
import importlib.util
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
GGML_LOCAL = os.path.join(HERE, ".ggml")  # where `llama_bench_build.sh --ggml bench/.ggml` puts ggml


@functools.lru_cache(maxsize=None)
def _load_torch():
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install
        return None, f"torch not importable: {type(e).__name__}: {e}"
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    return torch, None


def torch_build(case, inp):
    """what a PyTorch user writes (each call allocates): softmax(x*scale + mask), F.rms_norm (after
    h = x + r for add_rms_norm), F.scaled_dot_product_attention"""
    torch, why = _load_torch()
    if torch is None:
        return None, why
    F = torch.nn.functional
    if case.op == "flash_attn":
        return _torch_sdpa(torch, inp)
    x = torch.from_numpy(inp["x"])
    if case.op == "softmax":
        m = torch.from_numpy(inp["mask"]) if inp["mask"] is not None else None
        s = case.scale
        fn = (functools.partial(torch.softmax, x, -1) if m is None and s == 1.0 else
              lambda: torch.softmax(x * s if m is None else x * s + m, -1))   # f32 + f16 -> f32
        return (fn, lambda: fn().numpy()), None
    n, w = inp["x"].shape[-1], torch.from_numpy(inp["w"])
    if case.op == "rms_norm":
        fn = functools.partial(F.rms_norm, x, (n,), w, case.eps)
        return (fn, lambda: fn().numpy()), None
    r = torch.from_numpy(inp["r"])

    def fn():
        h = x + r
        return h, F.rms_norm(h, (n,), w, case.eps)
    return (fn, lambda: tuple(t.numpy() for t in fn())), None


def _torch_sdpa(torch, inp):
    """SDPA on (S, H, N|T, D) with enable_gqa (torch >= 2.5); f16 K/V upcast inside the timed call, as a
    user holding an f16 cache writes k.float()"""
    q, k, v = (torch.from_numpy(inp[n]) for n in "qkv")
    up, causal, scale = inp["k"].dtype == np.float16, bool(inp["causal"]), float(inp["scale"])
    if inp["mask"] is not None and not causal:
        return None, "the torch column handles causal or no mask only"
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, is_causal=causal, scale=scale,
                             enable_gqa=True)
    fn = (lambda: sdpa(q, k.float(), v.float())) if up else functools.partial(sdpa, q, k, v)
    return (fn, lambda: fn().permute(0, 2, 1, 3).numpy()), None


# ------------------------------------------------------------------------------------------------
# ggml through its backend API, as llama.cpp drives it: tensors in a CPU backend buffer (weights in
# the plain buffer type, vec_dot / llamafile sgemm, or in CPU_REPACK, the repacked gemv/gemm that
# llama.cpp runs by default), ggml_backend_graph_compute on n threads with a persistent thread pool.

GGML_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10,
              "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30}
_SGEMM_X86 = {"Q8_0", "Q4_0", "Q5_0", "IQ4_NL"}   # llamafile_sgemm on x86 (x Q8_0 activations, n >= 2)
# ggml_repack_get_optimal_repack_type on x86: layout, ISA needed
_REPACK_X86 = {"Q4_0": ("q4_0_8x8", "avx2"), "Q4_K": ("q4_K_8x8", "avx2"), "IQ4_NL": ("iq4_nl_8x8", "avx2"),
               "Q2_K": ("q2_K_8x8", "avx512")}
_EXTRA_BUFTS_FN = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _TPParams(ctypes.Structure):
    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


def ggml_lib_dirs():
    """directories that may hold libggml-base.so and libggml-cpu.so, in order of preference"""
    dirs = [os.environ.get("CPUFUSE_GGML_LIB_DIR"), os.path.join(GGML_LOCAL, "lib")]
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except Exception:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        dirs += [os.path.join(loc, "lib") for loc in spec.submodule_search_locations]
    return [d for d in dirs if d]


def _find_so(d, stem):
    hits = sorted(glob.glob(os.path.join(d, stem + ".so*")), key=len)
    return hits[0] if hits else None


def _signatures(P=ctypes.c_void_p, I=ctypes.c_int, I64=ctypes.c_int64, SZ=ctypes.c_size_t):
    """{(library, name): (restype, argtypes)}: library 0 = libggml-base, 1 = libggml-cpu"""
    return {
        (0, "ggml_init"): (P, [_InitParams]), (0, "ggml_free"): (None, [P]),
        (0, "ggml_tensor_overhead"): (SZ, []), (0, "ggml_graph_overhead"): (SZ, []),
        (0, "ggml_new_tensor_4d"): (P, [P, I, I64, I64, I64, I64]), (0, "ggml_get_data"): (P, [P]),
        (0, "ggml_nbytes"): (SZ, [P]), (0, "ggml_soft_max_ext"): (P, [P, P, P, ctypes.c_float, ctypes.c_float]),
        (0, "ggml_rms_norm"): (P, [P, P, ctypes.c_float]), (0, "ggml_mul"): (P, [P, P, P]),
        (0, "ggml_add"): (P, [P, P, P]), (0, "ggml_mul_mat"): (P, [P, P, P]),
        (0, "ggml_flash_attn_ext"): (P, [P, P, P, P, P, ctypes.c_float, ctypes.c_float, ctypes.c_float]),
        (0, "ggml_new_graph"): (P, [P]), (0, "ggml_build_forward_expand"): (None, [P, P]),
        (0, "ggml_threadpool_params_init"): (None, [ctypes.POINTER(_TPParams), I]),
        (0, "ggml_backend_reg_dev_get"): (P, [P, SZ]),
        (0, "ggml_backend_reg_get_proc_address"): (P, [P, ctypes.c_char_p]),
        (0, "ggml_backend_dev_buffer_type"): (P, [P]), (0, "ggml_backend_dev_supports_op"): (ctypes.c_bool, [P, P]),
        (0, "ggml_backend_buft_name"): (ctypes.c_char_p, [P]),
        (0, "ggml_backend_alloc_ctx_tensors_from_buft"): (P, [P, P]),
        (0, "ggml_backend_buffer_set_usage"): (None, [P, I]), (0, "ggml_backend_buffer_free"): (None, [P]),
        (0, "ggml_backend_tensor_set"): (None, [P, P, SZ, SZ]), (0, "ggml_backend_graph_compute"): (I, [P, P]),
        (0, "ggml_backend_free"): (None, [P]), (1, "ggml_cpu_init"): (None, []),
        (1, "ggml_threadpool_new"): (P, [ctypes.POINTER(_TPParams)]), (1, "ggml_threadpool_free"): (None, [P]),
        (1, "ggml_backend_cpu_reg"): (P, []), (1, "ggml_backend_cpu_init"): (P, []),
        (1, "ggml_backend_cpu_set_n_threads"): (None, [P, I]), (1, "ggml_backend_cpu_set_threadpool"): (None, [P, P]),
        (1, "ggml_cpu_has_avx2"): (I, []), (1, "ggml_cpu_has_avx512"): (I, []), (1, "ggml_cpu_has_llamafile"): (I, []),
    }


class _NS:
    pass


@functools.lru_cache(maxsize=None)
def _load_ggml():
    """(namespace: base and cpu CDLLs, the CPU device, its buffer types, its ISA flags, None) or
    (None, reason)"""
    dirs = ggml_lib_dirs()
    d = next((d for d in dirs if _find_so(d, "libggml-base") and _find_so(d, "libggml-cpu")), None)
    if d is None:
        return None, (f"ggml shared libraries not found (looked in: {', '.join(dirs)}); "
                      "run `bash bench/llama_bench_build.sh --ggml bench/.ggml`")
    try:
        libs = [ctypes.CDLL(_find_so(d, s), mode=ctypes.RTLD_GLOBAL) for s in ("libggml-base", "libggml-cpu")]
    except OSError as e:
        return None, f"ggml libraries in {d} failed to load: {e}"
    try:
        for (lib, name), (res, args) in _signatures().items():
            f = getattr(libs[lib], name)
            f.restype, f.argtypes = res, args
    except AttributeError as e:
        return None, f"ggml in {d} lacks a symbol this benchmark needs: {e}"
    g, (b, c) = _NS(), libs
    g.base, g.cpu, g.dir = b, c, d
    c.ggml_cpu_init()
    g.reg = c.ggml_backend_cpu_reg()
    g.dev = b.ggml_backend_reg_dev_get(g.reg, 0)
    g.plain_buft, extra = b.ggml_backend_dev_buffer_type(g.dev), {}
    fp = b.ggml_backend_reg_get_proc_address(g.reg, b"ggml_backend_dev_get_extra_bufts")
    arr = _EXTRA_BUFTS_FN(fp)(g.dev) if fp else None   # a NULL-terminated array of buffer types
    while arr and arr[len(extra)]:
        extra[b.ggml_backend_buft_name(arr[len(extra)]).decode()] = arr[len(extra)]
    g.repack_buft = extra.get("CPU_REPACK")
    g.repack_why = None if g.repack_buft else f"the CPU device has no CPU_REPACK buffer type (extra: {sorted(extra)})"
    g.has_avx2, g.has_avx512 = bool(c.ggml_cpu_has_avx2()), bool(c.ggml_cpu_has_avx512())
    g.has_llamafile = bool(c.ggml_cpu_has_llamafile())
    return g, None


class _Graph:
    """ggml contexts without data (0: weights, 1: the rest); alloc() puts a context's tensors in a
    backend buffer and copies their arrays in; run() plans the graph on a CPU backend of n threads
    and sets compute() = one ggml_backend_graph_compute (what is timed)"""

    def __init__(self, g):
        self.g, b = g, g.base
        self.backend = self.pool = None
        self.bufs, self.data = [], ([], [])
        size = 16 * b.ggml_tensor_overhead() + b.ggml_graph_overhead() + 4096
        self.ctx = [b.ggml_init(_InitParams(size, None, True)) for _ in range(2)]
        if not all(self.ctx):
            raise MemoryError("ggml_init failed")

    def tensor(self, arr, shape=None, typ=None, ctx=1):
        """a tensor for the numpy array arr (ggml's ne = the shape reversed), to be copied in by alloc()"""
        shape = shape or arr.shape
        typ = typ if typ is not None else GGML_TYPES["F16" if arr.dtype == np.float16 else "F32"]
        t = self.g.base.ggml_new_tensor_4d(self.ctx[ctx], typ, *(list(shape[::-1]) + [1, 1, 1])[:4])
        self.data[ctx].append((t, np.ascontiguousarray(arr)))
        return t

    def alloc(self, ctx=1, buft=None, usage=0, fill=True):
        b = self.g.base
        buf = b.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx[ctx], buft or self.g.plain_buft)
        if not buf:
            raise MemoryError("ggml_backend_alloc_ctx_tensors_from_buft failed")
        self.bufs.append(buf)
        b.ggml_backend_buffer_set_usage(buf, usage)   # 1: weights
        if fill:
            self.fill(ctx)

    def fill(self, ctx):
        b = self.g.base
        for t, arr in self.data[ctx]:
            if arr.nbytes != b.ggml_nbytes(t):
                raise ValueError(f"the ggml tensor takes {b.ggml_nbytes(t)} bytes, the array has {arr.nbytes}")
            b.ggml_backend_tensor_set(t, arr.ctypes.data, 0, arr.nbytes)   # CPU_REPACK repacks here

    def run(self, outs, n_threads=1):
        b, c = self.g.base, self.g.cpu
        self.gf = b.ggml_new_graph(self.ctx[1])
        for o in outs:
            b.ggml_build_forward_expand(self.gf, o)
        self.backend = c.ggml_backend_cpu_init()
        c.ggml_backend_cpu_set_n_threads(self.backend, int(n_threads))
        tpp = _TPParams()
        b.ggml_threadpool_params_init(ctypes.byref(tpp), int(n_threads))
        self.pool = c.ggml_threadpool_new(ctypes.byref(tpp))
        c.ggml_backend_cpu_set_threadpool(self.backend, self.pool)
        self.compute = functools.partial(b.ggml_backend_graph_compute, self.backend, self.gf)
        return self.compute

    def view(self, t, shape):
        n = int(np.prod(shape)) * 4
        assert n == self.g.base.ggml_nbytes(t)
        return np.frombuffer((ctypes.c_char * n).from_address(self.g.base.ggml_get_data(t)), np.float32).reshape(shape)

    def getter(self, outs, shapes):
        """get(): compute, then copies of the outputs (a tuple when there are two)"""
        views = [self.view(t, s) for t, s in zip(outs, shapes)]

        def get():
            st = self.compute()
            if st != 0:
                raise RuntimeError(f"ggml_backend_graph_compute returned status {st}")
            res = [v.copy() for v in views]
            return tuple(res) if len(res) > 1 else res[0]
        self.compute._keep = self   # partial objects take attributes: keeps the buffers alive
        return get

    def __del__(self):
        try:
            b = self.g.base
            if self.backend:
                b.ggml_backend_free(self.backend)
            if self.pool:
                self.g.cpu.ggml_threadpool_free(self.pool)
            for buf in self.bufs:
                b.ggml_backend_buffer_free(buf)
            for ctx in self.ctx:
                b.ggml_free(ctx)
        except Exception:
            pass


def ggml_build(case, inp):
    """ggml_soft_max_ext(x, mask, scale, 0); ggml_mul(ggml_rms_norm(x, eps), w) (fused by ggml's CPU
    backend), after ggml_add for add_rms_norm; ggml_flash_attn_ext(q, k, v, mask, scale): q f32, k/v
    f16 or f32 (ggml rounds Q to f16 when K is f16), an f16 mask, result (S, N, Hq, D). 1 thread."""
    g, why = _load_ggml()
    if g is None:
        return None, why
    gr, b = _Graph(g), g.base
    if case.op == "flash_attn":
        q, k, v, m = (inp[n] for n in ("q", "k", "v", "mask"))
        if m is not None and m.dtype != np.float16:
            return None, "ggml_flash_attn_ext takes an f16 mask only"
        tm = gr.tensor(m) if m is not None else None
        ty = b.ggml_flash_attn_ext(gr.ctx[1], gr.tensor(q), gr.tensor(k), gr.tensor(v), tm, float(inp["scale"]),
                                   0.0, 0.0)
        outs, shapes = (ty,), [(q.shape[0], q.shape[2], q.shape[1], v.shape[3])]
    else:
        x = inp["x"]
        tx = gr.tensor(x)
        if case.op == "softmax":
            tm = gr.tensor(inp["mask"]) if inp["mask"] is not None else None
            outs = (b.ggml_soft_max_ext(gr.ctx[1], tx, tm, case.scale, 0.0),)
        else:
            th = b.ggml_add(gr.ctx[1], tx, gr.tensor(inp["r"])) if case.op == "add_rms_norm" else tx
            ty = b.ggml_mul(gr.ctx[1], b.ggml_rms_norm(gr.ctx[1], th, case.eps), gr.tensor(inp["w"]))
            outs = (th, ty) if case.op == "add_rms_norm" else (ty,)
        shapes = [x.shape] * len(outs)
    gr.alloc()
    fn = gr.run(outs)
    return (fn, gr.getter(outs, shapes)), None


def ggml_repack_layout(qtype, n_out):
    """the repacked layout ggml picks for this weight on this x86 CPU, or None (for labels)"""
    g, _ = _load_ggml()
    lay = _REPACK_X86.get(qtype)
    if g is None or g.repack_buft is None or lay is None or n_out % 8:
        return None
    return lay[0] if (g.has_avx512 if lay[1] == "avx512" else g.has_avx2) else None


def ggml_mul_mat_build(raw, qtype, n_out, n_in, x, n_threads=1, repack=False):
    """Y = ggml_mul_mat(W, X): W the GGUF bytes `raw` of a (n_out, n_in) `qtype` weight (in CPU_REPACK
    when repack), X = x f32 (rows, n_in), copied in once: ((fn, get, info), None) or (None, reason);
    info: {"path": "repack" | "sgemm" | "vec_dot", "layout", "buffer_type"}"""
    g, why = _load_ggml()
    if g is None:
        return None, why
    if qtype not in GGML_TYPES:
        return None, f"no ggml type id for {qtype} here"
    if repack and g.repack_buft is None:
        return None, g.repack_why
    x = np.ascontiguousarray(x, dtype=np.float32)
    gr, b = _Graph(g), g.base
    w = gr.tensor(raw, (n_out, n_in), GGML_TYPES[qtype], ctx=0)
    buft = g.repack_buft if repack else g.plain_buft
    gr.alloc(0, buft, usage=1, fill=False)
    y = b.ggml_mul_mat(gr.ctx[1], w, gr.tensor(x))
    # what llama.cpp asks before placing a weight in an extra buffer type (whose set_tensor asserts)
    if not b.ggml_backend_dev_supports_op(g.dev, y):
        if not repack:
            return None, f"ggml's CPU device does not support MUL_MAT {qtype} x F32"
        if qtype in _REPACK_X86 and n_out % 8:
            return None, f"ggml repacks {qtype} only when n_out % 8 == 0 (n_out={n_out}); llama.cpp keeps it plain"
        return None, f"ggml has no repacked layout for {qtype} on this CPU; llama.cpp keeps it in the plain buffer"
    gr.fill(0)
    gr.alloc(1)
    fn = gr.run((y,), n_threads)
    if repack:
        path, layout = "repack", ggml_repack_layout(qtype, n_out) or "?"
    elif g.has_llamafile and x.shape[0] >= 2 and qtype in _SGEMM_X86 and g.has_avx2:
        path, layout = "sgemm", "tinyBLAS_Q0"
    else:
        path, layout = "vec_dot", None
    info = {"path": path, "layout": layout, "buffer_type": b.ggml_backend_buft_name(buft).decode()}
    return (fn, gr.getter((y,), [(x.shape[0], n_out)]), info), None


def ggml_version():
    g, _ = _load_ggml()
    if g is None:
        return None
    return {"lib_dir": g.dir, "libggml_base": os.path.basename(os.path.realpath(_find_so(g.dir, "libggml-base")))}


PEERS = {"torch": torch_build, "ggml": ggml_build}
PEER_VERSIONS = {"torch": lambda: getattr(_load_torch()[0], "__version__", None), "ggml": ggml_version}


def availability():
    """{peer: None (usable) or reason}"""
    return {"torch": _load_torch()[1], "ggml": _load_ggml()[1]}
