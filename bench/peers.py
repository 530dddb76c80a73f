"""Optional peers for the benchmark table: PyTorch (CPU), onnxruntime and ggml (via ctypes).

Details: bench/README.md, "bench.peers".
"""
import ctypes
import functools
import glob
import importlib.util
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
GGML_LOCAL = os.path.join(HERE, ".ggml")  # where peers_setup.py puts a ggml-only build


# ------------------------------------------------------------------------------------------------
# PyTorch

_torch = None


def _load_torch():
    global _torch
    if _torch is None:
        try:
            import torch
        except Exception as e:  # ImportError, or a broken install
            _torch = (None, f"torch not importable: {type(e).__name__}: {e}")
        else:
            torch.set_num_threads(1)
            try:
                torch.set_num_interop_threads(1)
            except RuntimeError:
                pass
            _torch = (torch, None)
    return _torch


def torch_build(case, inp):
    """torch.softmax(x*scale + mask, -1); F.rms_norm(x, (n,), w, eps); add: h = x + r, rms_norm(h).
    Written as users write them (each call allocates its result)."""
    torch, why = _load_torch()
    if torch is None:
        return None, why
    if case.op == "flash_attn":
        return torch_sdpa_build(torch, case, inp)
    if case.op not in ("softmax", "rms_norm", "add_rms_norm"):
        return None, f"no torch column for {case.op}"
    F = torch.nn.functional
    x = torch.from_numpy(inp["x"])
    n = inp["x"].shape[-1]
    if case.op == "softmax":
        m = torch.from_numpy(inp["mask"]) if inp["mask"] is not None else None
        s = case.scale
        if m is None:
            fn = (lambda: torch.softmax(x * s, -1)) if s != 1.0 else functools.partial(torch.softmax, x, -1)
        else:
            fn = lambda: torch.softmax(x * s + m, -1)  # noqa: E731  (f32 + f16 promotes to f32)
        return (fn, lambda: fn().numpy()), None
    w = torch.from_numpy(inp["w"])
    if case.op == "rms_norm":
        fn = functools.partial(F.rms_norm, x, (n,), w, case.eps)
        return (fn, lambda: fn().numpy()), None
    r = torch.from_numpy(inp["r"])

    def fn():
        h = x + r
        return h, F.rms_norm(h, (n,), w, case.eps)

    return (fn, lambda: tuple(t.numpy() for t in fn())), None


def torch_sdpa_build(torch, case, inp):
    """F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True) on
    (S, H, N|T, D) tensors, as a PyTorch user calls it. f16 K/V are upcast to f32 inside the timed
    call (CPU SDPA needs one dtype; a user holding an f16 cache writes k.float()). When enable_gqa
    is missing (torch < 2.5), K/V heads are repeated with repeat_interleave (also timed)."""
    F = torch.nn.functional
    q = torch.from_numpy(inp["q"])
    k, v = torch.from_numpy(inp["k"]), torch.from_numpy(inp["v"])
    up = inp["k"].dtype == np.float16
    causal, scale = bool(inp["causal"]), float(inp["scale"])
    if inp["mask"] is not None and not causal:
        return None, "the torch column handles causal or no mask only"
    rep = q.shape[1] // k.shape[1]
    try:
        F.scaled_dot_product_attention(q[:, :, :1], k[:, :, :1].float(), v[:, :, :1].float(), enable_gqa=True)
        gqa = True
    except TypeError:
        gqa = False

    def fn():
        kk = k.float() if up else k
        vv = v.float() if up else v
        if gqa:
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, scale=scale, enable_gqa=True)
        kk, vv = kk.repeat_interleave(rep, dim=1), vv.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, scale=scale)

    return (fn, lambda: fn().permute(0, 2, 1, 3).numpy()), None


def torch_version():
    torch, _ = _load_torch()
    return torch.__version__ if torch is not None else None


# ------------------------------------------------------------------------------------------------
# onnxruntime

_ort = None


def _load_ort():
    global _ort
    if _ort is None:
        try:
            import onnx
            import onnxruntime
        except Exception as e:
            _ort = (None, None, f"onnx/onnxruntime not importable: {type(e).__name__}: {e}")
        else:
            _ort = (onnx, onnxruntime, None)
    return _ort


def _ort_model(onnx, case, inp, use_rmsnorm_op):
    from onnx import TensorProto, helper, numpy_helper
    x = inp["x"]
    shape = list(x.shape)
    f32 = TensorProto.FLOAT
    nodes, inits = [], []
    ins = [helper.make_tensor_value_info("X", f32, shape)]
    if case.op == "softmax":
        opset = 13
        outs = [helper.make_tensor_value_info("Y", f32, shape)]
        z = "X"
        if case.scale != 1.0:
            inits.append(numpy_helper.from_array(np.array(case.scale, np.float32), "scale"))
            nodes.append(helper.make_node("Mul", ["X", "scale"], ["xs"]))
            z = "xs"
        m = inp["mask"]
        if m is not None:
            mt = TensorProto.FLOAT16 if m.dtype == np.float16 else f32
            ins.append(helper.make_tensor_value_info("M", mt, list(m.shape)))
            mm = "M"
            if m.dtype == np.float16:
                nodes.append(helper.make_node("Cast", ["M"], ["Mf"], to=f32))
                mm = "Mf"
            nodes.append(helper.make_node("Add", [z, mm], ["zm"]))
            z = "zm"
        nodes.append(helper.make_node("Softmax", [z], ["Y"], axis=-1))
    else:
        n = shape[-1]
        ins.append(helper.make_tensor_value_info("W", f32, [n]))
        h = "X"
        outs = []
        if case.op == "add_rms_norm":
            ins.append(helper.make_tensor_value_info("R", f32, shape))
            nodes.append(helper.make_node("Add", ["X", "R"], ["H"]))
            outs.append(helper.make_tensor_value_info("H", f32, shape))
            h = "H"
        outs.append(helper.make_tensor_value_info("Y", f32, shape))
        if use_rmsnorm_op:
            opset = 23
            nodes.append(helper.make_node("RMSNormalization", [h, "W"], ["Y"], axis=-1, epsilon=case.eps))
        else:
            opset = 18
            inits += [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
                      numpy_helper.from_array(np.array(case.eps, np.float32), "eps"),
                      numpy_helper.from_array(np.array([-1], np.int64), "axes")]
            nodes += [helper.make_node("Pow", [h, "two"], ["sq"]),
                      helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
                      helper.make_node("Add", ["ms", "eps"], ["mse"]),
                      helper.make_node("Sqrt", ["mse"], ["rms"]),
                      helper.make_node("Div", [h, "rms"], ["xn"]),
                      helper.make_node("Mul", ["xn", "W"], ["Y"])]
    graph = helper.make_graph(nodes, "cpufuse_bench", ins, outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = min(model.ir_version, 10)
    return model


def ort_build(case, inp):
    """Tiny in-memory ONNX graphs, one intra-op thread. Kernel rows bind preallocated numpy inputs
    and outputs (io_binding); the "alloc" latency row uses plain run(), which allocates outputs."""
    if case.op not in ("softmax", "rms_norm", "add_rms_norm"):
        return None, f"no onnxruntime column for {case.op} (ONNX Attention needs opset 23, and ORT's GQA op is a contrib op with its own KV-cache layout)"
    onnx, ort, why = _load_ort()
    if onnx is None:
        return None, why
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    sess, errors = None, []
    for use_op in ((True, False) if case.op != "softmax" else (False,)):
        try:
            model = _ort_model(onnx, case, inp, use_op)
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            break
        except Exception as e:
            errors.append(f"{'RMSNormalization' if use_op else 'graph'}: {type(e).__name__}: {e}")
    if sess is None:
        return None, "onnxruntime session failed: " + "; ".join(errors)
    feeds = {"X": inp["x"]}
    if case.op == "softmax" and inp["mask"] is not None:
        feeds["M"] = inp["mask"]
    if case.op != "softmax":
        feeds["W"] = inp["w"]
    if case.op == "add_rms_norm":
        feeds["R"] = inp["r"]
    out_names = [o.name for o in sess.get_outputs()]

    def unpack(res):
        return tuple(res) if len(res) == 2 else res[0]

    if case.mode == "alloc":
        fn = functools.partial(sess.run, None, feeds)
        return (fn, lambda: unpack(fn())), None
    io = sess.io_binding()
    for k, v in feeds.items():
        io.bind_cpu_input(k, v)
    outs = []
    for nm in out_names:
        o = np.empty_like(inp["x"])
        io.bind_output(nm, "cpu", 0, np.float32, list(o.shape), o.ctypes.data)
        outs.append(o)
    fn = functools.partial(sess.run_with_iobinding, io)

    def get():
        fn()
        return unpack([o.copy() for o in outs])

    fn._keep = (io, outs, sess)  # partial objects accept attributes; keeps buffers alive
    return (fn, get), None


def ort_version():
    onnx, ort, _ = _load_ort()
    return ort.__version__ if ort is not None else None


# ------------------------------------------------------------------------------------------------
# ggml (the reference implementation cpufuse mirrors), through ctypes on its shared libraries

GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _CPlan(ctypes.Structure):
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p), ("n_threads", ctypes.c_int),
                ("threadpool", ctypes.c_void_p), ("abort_callback", ctypes.c_void_p),
                ("abort_callback_data", ctypes.c_void_p), ("use_ref", ctypes.c_bool)]


class _TPParams(ctypes.Structure):
    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


def ggml_lib_dirs():
    """Candidate directories holding libggml-base.so and libggml-cpu.so, in order of preference."""
    dirs = []
    env = os.environ.get("CPUFUSE_GGML_LIB_DIR")
    if env:
        dirs.append(env)
    dirs.append(os.path.join(GGML_LOCAL, "lib"))
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except Exception:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            dirs.append(os.path.join(loc, "lib"))
    return dirs


_ggml = None


def _find_so(d, stem):
    hits = sorted(glob.glob(os.path.join(d, stem + ".so*")), key=len)
    return hits[0] if hits else None


def _load_ggml():
    """(namespace with base/cpu CDLLs and the thread pool, None) or (None, reason)."""
    global _ggml
    if _ggml is not None:
        return _ggml
    tried = []
    for d in ggml_lib_dirs():
        base_p, cpu_p = _find_so(d, "libggml-base"), _find_so(d, "libggml-cpu")
        if not (base_p and cpu_p):
            tried.append(d)
            continue
        try:
            base = ctypes.CDLL(base_p, mode=ctypes.RTLD_GLOBAL)
            cpu = ctypes.CDLL(cpu_p, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            _ggml = (None, f"ggml libraries in {d} failed to load: {e}")
            return _ggml
        P, V = ctypes.c_void_p, ctypes.c_void_p
        sig = {
            (base, "ggml_init"): (P, [_InitParams]),
            (base, "ggml_free"): (None, [P]),
            (base, "ggml_tensor_overhead"): (ctypes.c_size_t, []),
            (base, "ggml_graph_overhead"): (ctypes.c_size_t, []),
            (base, "ggml_new_tensor_1d"): (P, [P, ctypes.c_int, ctypes.c_int64]),
            (base, "ggml_new_tensor_2d"): (P, [P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
            (base, "ggml_get_data"): (V, [P]),
            (base, "ggml_nbytes"): (ctypes.c_size_t, [P]),
            (base, "ggml_soft_max_ext"): (P, [P, P, P, ctypes.c_float, ctypes.c_float]),
            (base, "ggml_rms_norm"): (P, [P, P, ctypes.c_float]),
            (base, "ggml_mul"): (P, [P, P, P]),
            (base, "ggml_add"): (P, [P, P, P]),
            (base, "ggml_new_graph"): (P, [P]),
            (base, "ggml_build_forward_expand"): (None, [P, P]),
            (base, "ggml_threadpool_params_init"): (None, [ctypes.POINTER(_TPParams), ctypes.c_int]),
            (cpu, "ggml_cpu_init"): (None, []),
            (cpu, "ggml_threadpool_new"): (P, [ctypes.POINTER(_TPParams)]),
            (cpu, "ggml_graph_plan"): (_CPlan, [P, ctypes.c_int, P]),
            (cpu, "ggml_graph_compute"): (ctypes.c_int, [P, ctypes.POINTER(_CPlan)]),
        }
        try:
            for (lib, name), (res, args) in sig.items():
                f = getattr(lib, name)
                f.restype, f.argtypes = res, args
        except AttributeError as e:
            _ggml = (None, f"ggml in {d} lacks a symbol this benchmark needs: {e}")
            return _ggml
        # attention (optional: an older ggml without them still gives the softmax/rms_norm columns)
        I64 = ctypes.c_int64
        fa_why = None
        try:
            base.ggml_new_tensor_4d.restype = P
            base.ggml_new_tensor_4d.argtypes = [P, ctypes.c_int, I64, I64, I64, I64]
            base.ggml_flash_attn_ext.restype = P
            base.ggml_flash_attn_ext.argtypes = [P, P, P, P, P, ctypes.c_float, ctypes.c_float, ctypes.c_float]
        except AttributeError as e:
            fa_why = f"ggml in {d} lacks {e}"
        cpu.ggml_cpu_init()
        tpp = _TPParams()
        base.ggml_threadpool_params_init(ctypes.byref(tpp), 1)
        pool = cpu.ggml_threadpool_new(ctypes.byref(tpp))

        class NS:
            pass
        ns = NS()
        ns.base, ns.cpu, ns.pool, ns.dir, ns.fa_why = base, cpu, pool, d, fa_why
        _ggml = (ns, None)
        return _ggml
    _ggml = (None, "ggml shared libraries not found (looked in: " + ", ".join(tried)
             + "); run `python -m bench.peers_setup`")
    return _ggml


class _GgmlGraph:
    """One ggml context holding the inputs, the graph and its work buffer; compute() runs it."""

    def __init__(self, g, mem_size):
        self.g = g
        self.ctx = g.base.ggml_init(_InitParams(mem_size, None, False))
        if not self.ctx:
            raise MemoryError("ggml_init failed")

    def tensor(self, arr):
        b = self.g.base
        typ = GGML_TYPE_F16 if arr.dtype == np.float16 else GGML_TYPE_F32
        if arr.ndim == 4:  # ggml's ne is numpy's shape reversed (ne0 = the contiguous axis)
            t = b.ggml_new_tensor_4d(self.ctx, typ, arr.shape[3], arr.shape[2], arr.shape[1], arr.shape[0])
        else:
            t = (b.ggml_new_tensor_1d(self.ctx, GGML_TYPE_F32, arr.shape[0]) if arr.ndim == 1 else
                 b.ggml_new_tensor_2d(self.ctx, typ, arr.shape[1], arr.shape[0]))
        self.view(t, arr.shape, arr.dtype)[...] = arr  # copy the data in once
        return t

    def view(self, t, shape, dtype=np.float32):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        assert n == self.g.base.ggml_nbytes(t)
        buf = (ctypes.c_char * n).from_address(self.g.base.ggml_get_data(t))
        return np.frombuffer(buf, dtype=dtype).reshape(shape)

    def finish(self, *outs):
        b, c = self.g.base, self.g.cpu
        self.gf = b.ggml_new_graph(self.ctx)
        for o in outs:
            b.ggml_build_forward_expand(self.gf, o)
        self.plan = c.ggml_graph_plan(self.gf, 1, self.g.pool)
        self.work = np.empty(max(1, self.plan.work_size), np.uint8)
        self.plan.work_data = self.work.ctypes.data
        self.plan.threadpool = self.g.pool
        self.compute = functools.partial(c.ggml_graph_compute, self.gf, ctypes.byref(self.plan))

    def __del__(self):
        try:
            self.g.base.ggml_free(self.ctx)
        except Exception:
            pass


def ggml_build(case, inp):
    """ggml_soft_max_ext(x, mask, scale, 0); ggml_mul(ggml_rms_norm(x, eps), w) (which ggml's CPU
    backend fuses into one RMS_NORM+MUL kernel); add: ggml_add then the same. Tensors are created
    and filled once; only ggml_graph_compute (1 thread, persistent thread pool) is timed."""
    g, why = _load_ggml()
    if g is None:
        return None, why
    if case.op == "flash_attn":
        return ggml_fa_build(g, case, inp)
    if case.op not in ("softmax", "rms_norm", "add_rms_norm"):
        return None, f"no ggml column for {case.op}"
    x = inp["x"]
    if x.ndim != 2:
        return None, "the ggml peer here handles 2-D x only"
    arrays = [x, x, x, x] + [a for a in (inp.get("mask"), inp.get("w"), inp.get("r")) if a is not None]
    mem = sum(a.nbytes for a in arrays) + 16 * g.base.ggml_tensor_overhead() + g.base.ggml_graph_overhead() + (1 << 20)
    gr = _GgmlGraph(g, mem)
    b = g.base
    tx = gr.tensor(x)
    if case.op == "softmax":
        tm = gr.tensor(inp["mask"]) if inp["mask"] is not None else None
        ty = b.ggml_soft_max_ext(gr.ctx, tx, tm, case.scale, 0.0)
        outs = (ty,)
    else:
        tw = gr.tensor(inp["w"])
        th = b.ggml_add(gr.ctx, tx, gr.tensor(inp["r"])) if case.op == "add_rms_norm" else tx
        ty = b.ggml_mul(gr.ctx, b.ggml_rms_norm(gr.ctx, th, case.eps), tw)
        outs = (th, ty) if case.op == "add_rms_norm" else (ty,)
    gr.finish(*outs)
    views = [gr.view(t, x.shape) for t in outs]
    fn = gr.compute

    def get():
        st = fn()
        if st != 0:
            raise RuntimeError(f"ggml_graph_compute returned status {st}")
        res = [v.copy() for v in views]
        return tuple(res) if len(res) == 2 else res[0]

    fn._keep = gr
    return (fn, get), None


def ggml_fa_build(g, case, inp):
    """ggml_flash_attn_ext(q, k, v, mask, scale, 0, 0): q f32 [D, N, Hq, S], k/v f16 or f32
    [D, T, Hkv, S] (v not transposed), mask f16 [T, N, 1, 1] (this ggml needs no GGML_KQ_MASK_PAD
    row padding: the mask must be f16, contiguous, with >= N rows); result [D, Hq, N, S], which is
    cpufuse's (S, N, Hq, D). Tensors are filled once; only ggml_graph_compute (1 thread) is timed.
    ggml rounds Q to f16 when K is f16 (its vec_dot type), so its error is that of f16 Q."""
    if g.fa_why:
        return None, g.fa_why
    q, k, v, m = inp["q"], inp["k"], inp["v"], inp["mask"]
    if m is not None and m.dtype != np.float16:
        return None, "ggml_flash_attn_ext takes an f16 mask only"
    S, Hq, N, D = q.shape
    out_bytes = S * N * Hq * v.shape[3] * 4
    arrays = [a for a in (q, k, v, m) if a is not None]
    mem = sum(a.nbytes for a in arrays) + out_bytes + 16 * g.base.ggml_tensor_overhead() + \
        g.base.ggml_graph_overhead() + (1 << 20)
    gr = _GgmlGraph(g, mem)
    tq, tk, tv = gr.tensor(q), gr.tensor(k), gr.tensor(v)
    tm = gr.tensor(np.ascontiguousarray(m)) if m is not None else None
    ty = g.base.ggml_flash_attn_ext(gr.ctx, tq, tk, tv, tm, float(inp["scale"]), 0.0, 0.0)
    gr.finish(ty)
    view = gr.view(ty, (S, N, Hq, v.shape[3]))
    fn = gr.compute

    def get():
        st = fn()
        if st != 0:
            raise RuntimeError(f"ggml_graph_compute returned status {st}")
        return view.copy()

    fn._keep = gr
    return (fn, get), None


# ------------------------------------------------------------------------------------------------
# ggml MUL_MAT on quantized weights, through the ggml-backend API (the quantized-matmul section,
# bench/quant.py). Weights live in a backend buffer: the CPU device's plain buffer type (vec_dot /
# llamafile sgemm) or its CPU_REPACK extra buffer type (the repacked gemv/gemm that llama.cpp runs by
# default for Q4_0 and Q4_K on AVX2), and the graph runs with ggml_backend_graph_compute on a CPU
# backend with n threads and a persistent thread pool, as llama.cpp drives it.

GGML_BACKEND_BUFFER_USAGE_WEIGHTS = 1
GGML_QTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10,
               "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30}
# llamafile_sgemm on x86 (ggml-cpu/llamafile/sgemm.cpp): these weight types x Q8_0 activations, n >= 2
_SGEMM_X86 = {"Q8_0", "Q4_0", "Q5_0", "IQ4_NL"}
# ggml_repack_get_optimal_repack_type on x86 (ggml-cpu/repack.cpp): layout name, ISA needed
_REPACK_X86 = {"Q4_0": ("q4_0_8x8", "avx2"), "Q4_K": ("q4_K_8x8", "avx2"), "IQ4_NL": ("iq4_nl_8x8", "avx2"),
               "Q2_K": ("q2_K_8x8", "avx512")}

_gb = None
_EXTRA_BUFTS_FN = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


def _load_ggml_backend():
    """(namespace with the backend API bound, None) or (None, reason). Binds the ggml-backend
    functions on the libraries _load_ggml found; the CPU device's extra buffer types come from
    ggml_backend_reg_get_proc_address(ggml_backend_cpu_reg(), "ggml_backend_dev_get_extra_bufts")."""
    global _gb
    if _gb is not None:
        return _gb
    g, why = _load_ggml()
    if g is None:
        _gb = (None, why)
        return _gb
    base, cpu = g.base, g.cpu
    P, I64, SZ = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t
    sig = {
        (base, "ggml_mul_mat"): (P, [P, P, P]),
        (base, "ggml_type_size"): (SZ, [ctypes.c_int]),
        (base, "ggml_row_size"): (SZ, [ctypes.c_int, I64]),
        (base, "ggml_backend_reg_dev_get"): (P, [P, SZ]),
        (base, "ggml_backend_reg_get_proc_address"): (P, [P, ctypes.c_char_p]),
        (base, "ggml_backend_dev_buffer_type"): (P, [P]),
        (base, "ggml_backend_dev_supports_op"): (ctypes.c_bool, [P, P]),
        (base, "ggml_backend_buft_name"): (ctypes.c_char_p, [P]),
        (base, "ggml_backend_alloc_ctx_tensors_from_buft"): (P, [P, P]),
        (base, "ggml_backend_buffer_set_usage"): (None, [P, ctypes.c_int]),
        (base, "ggml_backend_buffer_free"): (None, [P]),
        (base, "ggml_backend_tensor_set"): (None, [P, P, SZ, SZ]),
        (base, "ggml_backend_graph_compute"): (ctypes.c_int, [P, P]),
        (base, "ggml_backend_free"): (None, [P]),
        (cpu, "ggml_backend_cpu_reg"): (P, []),
        (cpu, "ggml_backend_cpu_init"): (P, []),
        (cpu, "ggml_backend_cpu_set_n_threads"): (None, [P, ctypes.c_int]),
        (cpu, "ggml_backend_cpu_set_threadpool"): (None, [P, P]),
        (cpu, "ggml_threadpool_free"): (None, [P]),
        (cpu, "ggml_cpu_has_avx2"): (ctypes.c_int, []),
        (cpu, "ggml_cpu_has_avx512"): (ctypes.c_int, []),
        (cpu, "ggml_cpu_has_llamafile"): (ctypes.c_int, []),
    }
    try:
        for (lib, name), (res, args) in sig.items():
            f = getattr(lib, name)
            f.restype, f.argtypes = res, args
    except AttributeError as e:
        _gb = (None, f"ggml in {g.dir} lacks a backend-API symbol the quantized matmul needs: {e}")
        return _gb
    reg = cpu.ggml_backend_cpu_reg()
    dev = base.ggml_backend_reg_dev_get(reg, 0)
    extra, why_extra = {}, None
    fp = base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not fp:
        why_extra = "the CPU backend exports no ggml_backend_dev_get_extra_bufts"
    else:
        arr = _EXTRA_BUFTS_FN(fp)(dev)  # NULL-terminated array of buffer types
        i = 0
        while arr and arr[i]:
            extra[base.ggml_backend_buft_name(arr[i]).decode()] = arr[i]
            i += 1
        if "CPU_REPACK" not in extra:
            why_extra = f"the CPU device has no CPU_REPACK buffer type (extra: {sorted(extra) or 'none'})"

    class NS:
        pass
    ns = NS()
    ns.g, ns.base, ns.cpu, ns.reg, ns.dev = g, base, cpu, reg, dev
    ns.plain_buft = base.ggml_backend_dev_buffer_type(dev)
    ns.extra_bufts = extra
    ns.repack_buft = extra.get("CPU_REPACK")
    ns.repack_why = why_extra
    ns.has_avx2, ns.has_avx512 = bool(cpu.ggml_cpu_has_avx2()), bool(cpu.ggml_cpu_has_avx512())
    ns.has_llamafile = bool(cpu.ggml_cpu_has_llamafile())
    _gb = (ns, None)
    return _gb


def ggml_repack_layout(qtype, n_out):
    """The repacked layout ggml picks for this weight on this (x86) CPU, or None: docs/quant-design.md,
    ggml_repack_get_optimal_repack_type. The peer itself asks ggml (ggml_backend_dev_supports_op);
    this is for labels and for deciding up front."""
    gb, _ = _load_ggml_backend()
    if gb is None or gb.repack_buft is None:
        return None
    lay = _REPACK_X86.get(qtype)
    if lay is None or n_out % 8:
        return None
    return lay[0] if (gb.has_avx512 if lay[1] == "avx512" else gb.has_avx2) else None


class _GgmlMulMat:
    """W (qtype, n_out x K) in a backend buffer, X f32 (rows x K), Y = ggml_mul_mat(W, X); a CPU
    backend with n_threads and its own thread pool. compute() is one ggml_backend_graph_compute."""

    def __init__(self, gb, raw, qtype, n_out, n_in, rows, n_threads, repack):
        self.gb, b, c = gb, gb.base, gb.cpu
        self.ctx_w = self.ctx_g = self.buf_w = self.buf_g = self.backend = self.pool = None
        tid = GGML_QTYPES[qtype]
        ov = b.ggml_tensor_overhead()
        self.ctx_w = b.ggml_init(_InitParams(4 * ov + 4096, None, True))       # no_alloc: data in backend buffers
        self.ctx_g = b.ggml_init(_InitParams(8 * ov + b.ggml_graph_overhead() + 4096, None, True))
        if not (self.ctx_w and self.ctx_g):
            raise MemoryError("ggml_init failed")
        self.w = b.ggml_new_tensor_2d(self.ctx_w, tid, n_in, n_out)
        nbytes = b.ggml_nbytes(self.w)
        raw = np.ascontiguousarray(raw)
        if raw.nbytes != nbytes:
            raise ValueError(f"ggml {qtype} ({n_out}, {n_in}) takes {nbytes} bytes, the weight has {raw.nbytes}")
        buft = gb.repack_buft if repack else gb.plain_buft
        self.buf_w = b.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx_w, buft)
        if not self.buf_w:
            raise MemoryError("ggml_backend_alloc_ctx_tensors_from_buft (weights) failed")
        b.ggml_backend_buffer_set_usage(self.buf_w, GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        self.x = b.ggml_new_tensor_2d(self.ctx_g, GGML_TYPE_F32, n_in, rows)
        self.y = b.ggml_mul_mat(self.ctx_g, self.w, self.x)
        # what llama.cpp's weight_buft_supported asks before placing a weight in an extra buffer type;
        # the repack buffer's set_tensor asserts a layout exists, so this must come first
        self.supported = bool(b.ggml_backend_dev_supports_op(gb.dev, self.y))
        if repack and not self.supported:
            return
        b.ggml_backend_tensor_set(self.w, raw.ctypes.data, 0, nbytes)          # repacks in CPU_REPACK
        self.buf_g = b.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx_g, gb.plain_buft)
        if not self.buf_g:
            raise MemoryError("ggml_backend_alloc_ctx_tensors_from_buft (activations) failed")
        self.gf = b.ggml_new_graph(self.ctx_g)
        b.ggml_build_forward_expand(self.gf, self.y)
        self.backend = c.ggml_backend_cpu_init()
        c.ggml_backend_cpu_set_n_threads(self.backend, int(n_threads))
        tpp = _TPParams()
        b.ggml_threadpool_params_init(ctypes.byref(tpp), int(n_threads))
        self.pool = c.ggml_threadpool_new(ctypes.byref(tpp))
        c.ggml_backend_cpu_set_threadpool(self.backend, self.pool)
        self.xv = self._view(self.x, (rows, n_in))
        self.yv = self._view(self.y, (rows, n_out))
        self.compute = functools.partial(b.ggml_backend_graph_compute, self.backend, self.gf)

    def _view(self, t, shape):
        b = self.gb.base
        n = int(np.prod(shape)) * 4
        assert n == b.ggml_nbytes(t)
        return np.frombuffer((ctypes.c_char * n).from_address(b.ggml_get_data(t)), np.float32).reshape(shape)

    def __del__(self):
        try:
            b, c = self.gb.base, self.gb.cpu
            if self.backend:
                b.ggml_backend_free(self.backend)
            if self.pool:
                c.ggml_threadpool_free(self.pool)
            for buf in (self.buf_g, self.buf_w):
                if buf:
                    b.ggml_backend_buffer_free(buf)
            for ctx in (self.ctx_g, self.ctx_w):
                if ctx:
                    b.ggml_free(ctx)
        except Exception:
            pass


def ggml_mul_mat_build(raw, qtype, n_out, n_in, x, n_threads=1, repack=False):
    """ggml_mul_mat(W, X) with W the GGUF bytes `raw` of a (n_out, n_in) `qtype` weight and X the f32
    activations x (rows, n_in): ((fn, get, info), None) or (None, reason). fn() = one
    ggml_backend_graph_compute (what is timed; x is copied in once at build); get() runs it and
    returns Y (rows, n_out). repack=True puts W in the CPU_REPACK extra buffer type (ggml repacks it
    in ggml_backend_tensor_set); (None, reason) when ggml has no repacked layout for it here.
    info: {"path": "repack" | "sgemm" | "vec_dot", "layout", "buffer_type"}."""
    gb, why = _load_ggml_backend()
    if gb is None:
        return None, why
    if qtype not in GGML_QTYPES:
        return None, f"no ggml type id for {qtype} here"
    if repack and gb.repack_buft is None:
        return None, gb.repack_why
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows = x.shape[0]
    mm = _GgmlMulMat(gb, raw, qtype, n_out, n_in, rows, n_threads, repack)
    if repack and not mm.supported:
        lay = _REPACK_X86.get(qtype)
        if lay is not None and n_out % 8:
            return None, (f"ggml repacks {qtype} only when n_out % 8 == 0 (n_out={n_out}); llama.cpp keeps this "
                          "weight in the plain buffer")
        return None, (f"ggml has no repacked layout for {qtype} on this CPU (ggml_repack_get_optimal_repack_type); "
                      "llama.cpp keeps it in the plain buffer")
    if not mm.supported:
        return None, f"ggml's CPU device does not support MUL_MAT {qtype} x F32"
    mm.xv[...] = x
    if repack:
        path, layout = "repack", ggml_repack_layout(qtype, n_out) or "?"
    elif gb.has_llamafile and rows >= 2 and qtype in _SGEMM_X86 and gb.has_avx2:
        path, layout = "sgemm", "tinyBLAS_Q0"
    else:
        path, layout = "vec_dot", None
    fn = mm.compute

    def get():
        st = fn()
        if st != 0:
            raise RuntimeError(f"ggml_backend_graph_compute returned status {st}")
        return mm.yv.copy()

    info = {"path": path, "layout": layout,
            "buffer_type": gb.base.ggml_backend_buft_name(gb.repack_buft if repack else gb.plain_buft).decode()}
    fn._keep = mm  # partial objects accept attributes; keeps the tensors, buffers and backend alive
    return (fn, get, info), None


def ggml_version():
    g, _ = _load_ggml()
    if g is None:
        return None
    so = _find_so(g.dir, "libggml-base")
    real = os.path.realpath(so)
    return {"lib_dir": g.dir, "libggml_base": os.path.basename(real)}


PEERS = {"torch": torch_build, "onnxruntime": ort_build, "ggml": ggml_build}
PEER_VERSIONS = {"torch": torch_version, "onnxruntime": ort_version, "ggml": ggml_version}


def availability():
    """{peer: None (usable) or reason} without building anything case-specific."""
    return {"torch": _load_torch()[1], "onnxruntime": _load_ort()[2], "ggml": _load_ggml()[1]}
