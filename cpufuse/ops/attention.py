"""flash_attn (ggml flash_attn_ext): the declaration of its operands (binder.py), the checks, which make its
entries, the strategy and the call."""
import math
import os

import numpy as np

from .. import _dispatch, _registry
from .._layouts import FA, FA_STRATEGY
from . import kvquant
from .binder import Binder, In, Out, Param
from .checks import (
    F16, F32, _aligned, _check_f32, _check_last_axis, _check_mask_sinks, _check_no_overlap, _check_out, _geom4,
    _kernel, _ndarray, _real, _slopes, _thr)


def fa_desc(qg, kg, vg, og, mg, mkind, kf16, vf16, strategy, chunk, q_tile, cold=False):
    (S, Hq, N, DK), qs = qg
    (_, Hk, T, _), ks = kg
    (_, Hv, _, DV), vs = vg
    os_ = og[1]
    (MS, MH, _, _), (MS0, MS1, MS2, _) = mg if mg else ((1, 1, 0, 0), (0, 0, 0, 0))
    return FA.pack(S=S, HQ=Hq, N=N, DK=DK, HK=Hk, HV=Hv, T=T, DV=DV, QS0=qs[0], QS1=qs[1], QS2=qs[2],
                   KS0=ks[0], KS1=ks[1], KS2=ks[2], VS0=vs[0], VS1=vs[1], VS2=vs[2], KF16=kf16, VF16=vf16,
                   MS=MS, MH=MH, MS0=MS0, MS1=MS1, MS2=MS2, MKIND=mkind if mg else 0,
                   OS0=os_[0], OS1=os_[1], OS2=os_[2], STRATEGY=STRATEGIES[strategy], CHUNK=chunk or 0, QTILE=q_tile,
                   COLD=int(cold))



# ------------------------------------------------------------------------------------------------
# flash attention

STRATEGIES = {k.lower(): v for k, v in FA_STRATEGY.values.items()}   # {"rows": 1, "tiled": 2, "split": 3}
DEFAULT_SPLIT_CHUNK = None  # KV columns per split-KV chunk; None: auto_split_chunk(T), taken by the kernel


def auto_split_chunk(T):
    """The split-KV chunk the kernels take for T cells when none is given (C fa_auto_chunk): 64 up to 1024
    cells, 128 up to 2048, then 256. A function of T alone, so results never depend on the thread count or
    the batch; small chunks give a team tasks at short contexts, large ones keep the merge cheap at depth
    (docs/kv.md, "Split-KV from 128 cells")."""
    return 64 if T <= 1024 else 128 if T <= 2048 else 256



def _cgeom(shape):
    """(shape, element strides) of a C-contiguous 4-D array"""
    S, H, R, C = shape
    return shape, [H * R * C, R * C, C, 1]


def _plan(isa, fused, qs, ks, vs, kf16, vf16, strategy, chunk, q_tile, n_threads):
    """the entry of a checked call with C-contiguous q, k, v, no mask, sinks or ALiBi"""
    conv = _registry.convention(isa)
    fn = _kernel("flash_attn" if fused else "flash_attn_unfused", isa, n_threads)
    S, Hq, N, DK = qs
    DV = vs[3]
    oshape = (S, N, Hq, DV)
    dp = conv.desc(fa_desc(_cgeom(qs), _cgeom(ks), _cgeom(vs), (oshape, [N * Hq * DV, Hq * DV, DV, 1]), None, 0,
                           kf16, vf16, strategy, chunk, q_tile))
    null = conv.null

    def launch(q, k, v, mask, sinks, o, scale, softcap, nt):
        if fn(dp, q, k, v, mask, null, sinks, scale, softcap, o, nt or _thr[0]):
            raise MemoryError("flash_attn: could not allocate scratch memory")
    return launch, conv.arrays, (oshape,)


def _check_kv(a, name):
    if not isinstance(a, _ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of float16 or float32, got {type(a).__name__}")
    if a.dtype != F32 and a.dtype != F16:
        raise TypeError(f"{name} must be float16 or float32, got {a.dtype}")
    if a.ndim != 4:
        raise ValueError(f"{name} must be 4-D (S, H, T, D), got shape {a.shape}")
    _check_last_axis(a, name)


SPLIT_MIN_T = 128  # one query over at least this many KV positions: split-KV
TILED_MIN_N = 8    # at least this many query rows: tiled blocks (also read by the plans' attn_seqs in C)


def _split_knob(env):
    """CPUFUSE_FA_SPLIT="MIN_T,CHUNK" (read once, at import; for timing experiments): split-KV from MIN_T
    cells in chunks of CHUNK, in place of SPLIT_MIN_T and DEFAULT_SPLIT_CHUNK. Results then differ from the
    defaults' (the chunks are merged in another order), the same for every thread count."""
    try:
        t, c = (int(x) for x in env.split(","))
    except ValueError:
        t = c = 0
    if not (t >= 2 and c >= 1):
        raise ValueError(f"CPUFUSE_FA_SPLIT must be 'MIN_T,CHUNK', two integers >= 2 and >= 1, got {env!r}")
    return t, c


if os.environ.get("CPUFUSE_FA_SPLIT", "").strip():
    SPLIT_MIN_T, DEFAULT_SPLIT_CHUNK = _split_knob(os.environ["CPUFUSE_FA_SPLIT"].strip())


def choose_strategy(N, T):
    """Auto strategy (docs/semantics.md §4): split-KV for one query over a long KV, tiled GEMM blocks when
    there are enough query rows to share a K/V block, per-row online softmax otherwise."""
    if N == 1 and T >= SPLIT_MIN_T:
        return "split"
    if N >= TILED_MIN_N:
        return "tiled"
    return "rows"


_FA = Binder("flash_attn", (In("q", F32), In("k", F32, F16), In("v", F32, F16), In("mask", F32, F16, optional=True),
                            In("sinks", F32, optional=True), Out("out", F32)),
             (Param("scale", passed=True), Param("softcap", passed=True), Param("max_bias"), Param("strategy"),
              Param("chunk"), Param("q_tile"), Param("fused"), Param("ggml_compat")))
_fast = _FA.fast


def _check_qkv(a, name, kv_type, D):
    """a quantized K or V: uint8 (S, H, T, D / 32 * bytes per block), rows unit-stride"""
    if not isinstance(a, _ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of uint8 blocks ({name[0]}_type={kv_type!r}), "
                        f"got {type(a).__name__}")
    if a.dtype != np.uint8:
        raise TypeError(f"{name} must be uint8 blocks for {name[0]}_type={kv_type!r}, got {a.dtype}")
    if a.ndim != 4:
        raise ValueError(f"{name} must be 4-D (S, H, T, blocks), got shape {a.shape}")
    if D % 32 or a.shape[3] != kvquant.row_bytes(kv_type, D):
        raise ValueError(f"{name} rows must hold {D} values as {kv_type} ({name[0]}_type): a head size that is a "
                         f"multiple of 32 and {kvquant.row_bytes(kv_type, D) if D % 32 == 0 else '-'} bytes a row, "
                         f"got head size {D} and {a.shape[3]} bytes")
    _check_last_axis(a, name)


def flash_attn(q, k, v, mask=None, *, scale, max_bias=0.0, softcap=0.0, sinks=None, out=None,
               isa=None, strategy=None, chunk=DEFAULT_SPLIT_CHUNK, q_tile=64, fused=True,
               ggml_compat=False, n_threads=None, k_type=None, v_type=None, dv=None, cold=False):
    """ggml flash_attn_ext (docs/semantics.md §4): softmax(q·kᵀ·scale [softcap] + slope·mask)·v per query row.

    q: float32 (S, Hq, N, DK); k: float16/float32 (S, Hk, T, DK); v: float16/float32 (S, Hv, T, DV);
    Hq % Hk == Hq % Hv == 0 (GQA: head h reads K head h // (Hq/Hk)). mask: float16 (or float32,
    used as given) (mS, mH, mN, Tm) with mN >= N, Tm >= T, heads/sequences tiled by modulo; a -inf
    entry excludes that KV position (its K/V are never read). sinks: float32 (Hq,). Returns float32
    (S, N, Hq, DV), ggml's permuted layout. Strided q/k/v with unit-stride rows are read in place.
    strategy: None (auto), "rows", "tiled" or "split"; chunk: the split-KV chunk (None: auto_split_chunk(T);
    either way independent of the threads).
    fused=False runs the unfused chain (score matrix, softmax, matmul). ggml_compat=True rounds Q
    to f16 when K is f16, as upstream's reference path does.
    k_type / v_type "q8_0" or "q4_0": k (S, Hk, T, DK / 32 * 34 or 18) / v (S, Hv, T, DV / 32 * ...) are uint8
    blocks (cpufuse.ops.kvquant.quantize), DK and DV multiples of 32 (dv= gives DV; default DK). Scores
    are int8 dot products of Q quantized to Q8_0 with the K codes, V rows are dequantized exactly
    (docs/semantics.md §4). "f16"/"f32" (or None) mean the float arrays as above.
    cold=True says K and V come from DRAM, as a decoder step's cache does once the weights have streamed past it:
    the kernel then prefetches them at any size (by default only past 4 MiB). Timing only: no result depends on it.
    """
    kt = None if k_type is None else kvquant.check_kv_type(k_type, "k_type")
    vt = None if v_type is None else kvquant.check_kv_type(v_type, "v_type")
    kq, vq = kt in kvquant.QUANT, vt in kvquant.QUANT
    if k_type is None and v_type is None and dv is None and cold is False:   # the cached binding keys on none of these
        r = _fast(q, k, v, mask, sinks, out, scale, softcap, max_bias, strategy, chunk, q_tile, fused, ggml_compat,
                  isa, n_threads)
        if r is not None:
            return r[0]
    if cold is not False and cold is not True:
        raise TypeError(f"cold must be a bool, got {type(cold).__name__}")
    isa_arg, scale_arg, softcap_arg, strategy_arg, chunk_arg, q_tile_arg = isa, scale, softcap, strategy, chunk, q_tile
    plain = type(scale) is float and type(softcap) is float  # a plan passes them to the kernel as given
    isa = _dispatch.resolve(isa)
    _check_f32(q, "q")
    if q.ndim != 4:
        raise ValueError(f"q must be 4-D (S, Hq, N, DK), got shape {q.shape}")
    S, Hq, N, DK = q.shape
    if dv is not None and (isinstance(dv, bool) or not isinstance(dv, int) or dv < 1):
        raise ValueError(f"dv must be a positive int (V's head size, for a quantized v), got {dv!r}")
    DVq = DK if dv is None else dv
    for a, nm, t, quant, D in ((k, "k", kt, kq, DK), (v, "v", vt, vq, DVq)):
        if quant:
            _check_qkv(a, nm, t, D)
        else:
            _check_kv(a, nm)
            if t is not None and a.dtype != (F16 if t == "f16" else F32):
                raise TypeError(f"{nm} must be {'float16' if t == 'f16' else 'float32'} for {nm}_type={t!r}, got {a.dtype}")
    if kq or vq:
        if not fused:
            raise ValueError("fused=False (the unfused chain) takes float K/V only, got "
                             f"k_type={k_type!r}, v_type={v_type!r}")
        if ggml_compat:
            raise ValueError("ggml_compat=True takes float K/V only (it rounds Q to f16 for an f16 K)")
    Sk, Hk, T, DKk = k.shape
    Sv, Hv, Tv, DV = v.shape
    DKk = DK if kq else DKk
    DV = DVq if vq else DV
    if Sk != S or Sv != S:
        raise ValueError(f"k and v must have q's sequence count S={S}, got k {Sk}, v {Sv}")
    if DKk != DK:
        raise ValueError(f"k must have q's head size DK={DK} in its last dim, got {DKk} (k shape {k.shape})")
    if Tv != T:
        raise ValueError(f"v must have k's KV length T={T}, got {Tv}")
    if Hk == 0 or Hq % Hk or Hv == 0 or Hq % Hv:
        raise ValueError(f"q heads must be a multiple of k heads and v heads (GQA), got q {Hq}, k {Hk}, v {Hv}")
    scale, max_bias, softcap = _real(scale, "scale"), _real(max_bias, "max_bias"), _real(softcap, "softcap")
    for nm, val in (("scale", scale), ("max_bias", max_bias), ("softcap", softcap)):
        if not math.isfinite(val):
            raise ValueError(f"{nm} must be finite, got {val}")
    m4, mkind, sinks = _check_mask_sinks(mask, max_bias, sinks, S, Hq, N, T, False, "q")
    if strategy is None or strategy == "auto":
        strategy = choose_strategy(N, T)
    elif strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of auto, {', '.join(STRATEGIES)}; got {strategy!r}")
    chunk, q_tile = None if chunk is None else int(chunk), int(q_tile)
    for nm, val in (("chunk", chunk), ("q_tile", q_tile)):
        if val is not None and val < 1:
            raise ValueError(f"{nm} must be >= 1{' or None' if nm == 'chunk' else ''}, got {val}")
    oshape = (S, N, Hq, DV)
    n_th = _dispatch.threads(n_threads)
    if out is not None:
        _check_out(out, oshape)
        _check_no_overlap(out, (("q", q), ("k", k), ("v", v), ("mask", mask), ("sinks", sinks)))
    kcode = kvquant.CODE[kt] if kq else int(k.dtype == F16)
    vcode = kvquant.CODE[vt] if vq else int(v.dtype == F16)
    if plain and not cold and not (kq or vq) and mask is None and sinks is None and max_bias == 0.0 and not ggml_compat and \
            S * Hq * N * T * DK * DV:
        made = _plan(isa, fused, q.shape, k.shape, v.shape, k.dtype == F16, v.dtype == F16, strategy, chunk, q_tile,
                     n_threads)
        r = _FA.plan(made, q, k, v, mask, sinks, out, scale_arg, softcap_arg, max_bias, strategy_arg, chunk_arg,
                     q_tile_arg, fused, ggml_compat, isa_arg, n_threads)
        if r is not None:
            return r[0]
    if out is None:
        out = np.empty(oshape, F32)
    if out.size == 0:
        return out
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    if m4 is not None and not m4.flags.aligned:
        m4 = _aligned(m4)
    if ggml_compat and k.dtype == F16:
        q = q.astype(F16).astype(F32)
    slopes = _slopes(Hq, max_bias) if (mask is not None and max_bias > 0.0) else None

    # the descriptor depends only on geometry and options: decode calls repeat it, so it is kept
    conv = _registry.convention(isa)
    P = conv.operand
    dkey = (conv.arrays, q.shape, q.strides, k.shape, k.strides, kcode, v.shape, v.strides, vcode, DV,
            out.strides, None if m4 is None else (m4.shape, m4.strides, mkind), strategy, chunk, q_tile, cold)
    kg, vg = _geom4(k), _geom4(v)
    if vq:   # the descriptor's DV is the values a row holds, not its bytes
        vg = ((vg[0][0], vg[0][1], vg[0][2], DV), vg[1])
    dp = _FA.descriptor(dkey, lambda: conv.desc(fa_desc(
        _geom4(q), kg, vg, _geom4(out), _geom4(m4) if m4 is not None else None, mkind, kcode, vcode,
        strategy, chunk, q_tile, cold)))
    if _kernel("flash_attn" if fused else "flash_attn_unfused", isa, n_threads)(
            dp, P(q), P(k), P(v), P(m4), P(slopes), P(sinks), scale, softcap, P(out), n_th):
        raise MemoryError("flash_attn: could not allocate scratch memory")
    return out
