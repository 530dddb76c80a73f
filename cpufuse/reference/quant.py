"""References for the quantized matmul (docs/quant-design.md): activation quantizers, weight
makers for tests, and float64 matmul references. Plain numpy, vectorized over blocks; this file
is the executable spec of the C and Numba kernels.

    quantize_act(x, vtype) / decode_act(blocks, vtype, K)   ggml block_q8_0 / q8_1 / q8_K bytes
    ref_matmul_f32(x, qt)   float64 x @ dequantize(W).T
    ref_matmul_q8(x, qt)    float64 of the integer block arithmetic on quantized activations
    quantize_weight(w, qtype), make_weight(...), random_blocks(...)   QTensors for tests

`gguf` is needed only by quantize_weight/make_weight for the legacy and float types.
"""
import numpy as np

from ..quant.types import ACT_QTYPES, KVALUES_IQ4NL, QTensor, resolve_qtype, unpack_blocks

__all__ = ["ACT_TYPES", "quantize_act", "decode_act", "ref_matmul_f32", "ref_matmul_q8",
           "quantize_weight", "make_weight", "random_blocks"]

# vec_dot activation types: (elements per block, bytes per block)
ACT_TYPES = {t.name: (t.block_size, t.type_size) for t in ACT_QTYPES.values()}   # (elements, bytes) per block

_f32 = np.float32


def _act_type(vtype):
    if not isinstance(vtype, str):
        raise TypeError(f"vtype must be one of {', '.join(ACT_TYPES)}, got {type(vtype).__name__}")
    v = vtype.strip().upper()
    if v not in ACT_TYPES:
        raise ValueError(f"vtype must be one of {', '.join(ACT_TYPES)}, got {vtype!r}")
    return v


def _rows_f32(x, name="x"):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of float32, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    if x.ndim not in (1, 2):
        raise ValueError(f"{name} must be 1-D (K,) or 2-D (rows, K), got shape {x.shape}")
    return x.reshape(-1, x.shape[-1])


# ------------------------------------------------------------------------------------------------
# activation quantization (docs/quant-design.md "Activation quantization")

def _q8_0_codes(xb):
    """xb float32 (..., 32) -> (codes int8, unrounded d float32): the AVX2 rule, id = 127/amax, RNE"""
    amax = np.max(np.abs(xb), axis=-1)
    d = amax / _f32(127)
    with np.errstate(divide="ignore"):
        iden = np.where(amax != 0, _f32(127) / amax, _f32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * iden[..., None]), -127, 127).astype(np.int8)
    return q, d


def quantize_act(x, vtype):
    """Quantize activation rows to ggml blocks: uint8 (rows, K/B*block_bytes) for 2-D x, (bytes,)
    for 1-D x. x: float32 (rows, K) with finite values, K a multiple of 32 (Q8_0/Q8_1) or 256 (Q8_K).
    Arithmetic is float32 throughout; rounding is to nearest even."""
    v = _act_type(vtype)
    x2 = _rows_f32(x)
    B, nbytes = ACT_TYPES[v]
    rows, K = x2.shape
    if K % B:
        raise ValueError(f"x: K={K} is not a multiple of the {v} block size {B}")
    nb = K // B
    xb = x2.reshape(rows, nb, B)
    out = np.zeros((rows, nb, nbytes), np.uint8)
    if v in ("Q8_0", "Q8_1"):
        q, d = _q8_0_codes(xb)
        out[..., 0:2] = d.astype("<f2").view(np.uint8).reshape(rows, nb, 2)
        out[..., -32:] = q.view(np.uint8)
        if v == "Q8_1":
            s = d * q.sum(axis=-1, dtype=np.int32).astype(np.float32)       # f32(d * f32(sum q))
            out[..., 2:4] = s.astype("<f2").view(np.uint8).reshape(rows, nb, 2)
    else:
        imax = np.argmax(np.abs(xb), axis=-1)                               # first on ties
        mx = np.take_along_axis(xb, imax[..., None], axis=-1)[..., 0]
        nz = mx != 0
        with np.errstate(divide="ignore"):
            iscale = np.where(nz, _f32(-127) / mx, _f32(0)).astype(np.float32)
            d = np.where(nz, _f32(1) / iscale, _f32(0)).astype(np.float32)
        q = np.minimum(np.rint(xb * iscale[..., None]), _f32(127)).astype(np.int8)   # 0 where max == 0
        bsums = q.reshape(rows, nb, 16, 16).sum(axis=-1, dtype=np.int16)
        out[..., 0:4] = d.astype("<f4").view(np.uint8).reshape(rows, nb, 4)
        out[..., 4:260] = q.view(np.uint8)
        out[..., 260:292] = bsums.astype("<i2").view(np.uint8).reshape(rows, nb, 32)
    out = out.reshape(rows, nb * nbytes)
    return out if x.ndim == 2 else out[0]


def decode_act(blocks, vtype, K):
    """Split quantized activation blocks into (codes int8 (rows, K), d float32 (rows, K/B),
    s float32 (rows, K/32) for Q8_1 else None, bsums int16 (rows, K/256, 16) for Q8_K else None).
    blocks: uint8 (rows, K/B*block_bytes) or 1-D, as quantize_act returns; the arrays are copies."""
    v = _act_type(vtype)
    B, nbytes = ACT_TYPES[v]
    K = int(K)
    if K <= 0 or K % B:
        raise ValueError(f"K: {K} is not a positive multiple of the {v} block size {B}")
    if not isinstance(blocks, np.ndarray) or blocks.dtype != np.uint8:
        raise TypeError(f"blocks must be a uint8 numpy.ndarray, got "
                        f"{getattr(blocks, 'dtype', type(blocks).__name__)}")
    nb = K // B
    if blocks.size % (nb * nbytes):
        raise ValueError(f"blocks: {blocks.size} bytes is not a whole number of rows of {nb} {v} blocks "
                         f"({nb * nbytes} bytes each)")
    b = np.ascontiguousarray(blocks).reshape(-1, nb, nbytes)
    rows = b.shape[0]
    s = bsums = None
    if v == "Q8_K":
        d = b[..., 0:4].copy().view("<f4").astype(np.float32)[..., 0]
        codes = b[..., 4:260].copy().view(np.int8)
        bsums = b[..., 260:292].copy().view("<i2").astype(np.int16)
    else:
        d = b[..., 0:2].copy().view("<f2").astype(np.float32)[..., 0]
        if v == "Q8_1":
            s = b[..., 2:4].copy().view("<f2").astype(np.float32)[..., 0]
        codes = b[..., -32:].copy().view(np.int8)
    return codes.reshape(rows, K), d, s, bsums


# ------------------------------------------------------------------------------------------------
# float64 matmul references

def ref_matmul_f32(x, qt):
    """float64 x @ dequantize(W).T: x float (rows, K) or (K,), qt a QTensor -> float64 (rows, n_out)
    or (n_out,)."""
    if not isinstance(qt, QTensor):
        raise TypeError(f"qt must be a QTensor, got {type(qt).__name__}")
    x = np.asarray(x)
    if x.ndim not in (1, 2) or x.shape[-1] != qt.n_in:
        raise ValueError(f"x: expected shape (rows, {qt.n_in}) or ({qt.n_in},), got {x.shape}")
    return x.astype(np.float64) @ qt.dequantize().astype(np.float64).T


def _chunks(n_out, per_col):
    """output-column chunks keeping the float64 intermediates around 32 MB"""
    step = max(1, int(4_000_000 // max(per_col, 1)))
    return [slice(o, min(o + step, n_out)) for o in range(0, n_out, step)]


def ref_matmul_q8(x, qt):
    """float64 of the q8-mode block arithmetic (docs/semantics.md §9), x float32 (rows, K) or (K,):
    quantize x per qt.vec_dot_type with quantize_act, then per block and output
      Q4_0/Q5_0/Q8_0: d_w*d_a*I (I = sum of signed weight codes times activation codes)
      Q4_1/Q5_1:      d_w*d_a*I (unsigned codes) + m_w*s_a (the stored Q8_1 s)
      Q4_K/Q5_K:      d_a*(d_w*sum_j sc_j*I_j - dmin_w*sum_j m_j*(bsums[2j]+bsums[2j+1]))
      Q6_K, Q3_K:     d_a*d_w*sum_j sc_j*I_j (signed codes, 16-element sub-blocks)
      Q2_K:           d_a*(d_w*sum_j sc_j*I_j - dmin_w*sum_j m_j*bsums[j]) (16-element sub-blocks)
      IQ4_NL, MXFP4:  d_w*d_a*I (I over the table values of the codes; MXFP4 d_w = 2^(e-128))
      IQ4_XS:         d_a*d_w*sum_j sc_j*I_j (table values, 8 sub-blocks, sc_j in -32..31)
    summed over blocks. F32/F16/BF16 weights: ref_matmul_f32. Returns float64 (rows, n_out), or
    (n_out,) for 1-D x."""
    if not isinstance(qt, QTensor):
        raise TypeError(f"qt must be a QTensor, got {type(qt).__name__}")
    x2 = _rows_f32(x)
    if x2.shape[1] != qt.n_in:
        raise ValueError(f"x: expected shape (rows, {qt.n_in}) or ({qt.n_in},), got {x.shape}")
    if qt.vec_dot_type is None:
        return ref_matmul_f32(x, qt)
    y = _ref_q8_rows(x2, qt)
    return y if x.ndim == 2 else y[0]


def ref_matmul_residual(x, qt, residual, act="q8"):
    """float64 of cpufuse.matmul(x, qt, residual=residual, act=act): residual + the act mode's
    product (ref_matmul_q8 or ref_matmul_f32), residual of the output's shape."""
    y = ref_matmul_q8(x, qt) if act == "q8" else ref_matmul_f32(x, qt)
    residual = np.asarray(residual)
    if residual.shape != y.shape:
        raise ValueError(f"residual: expected shape {y.shape} (the output's), got {residual.shape}")
    return residual.astype(np.float64) + y


def _ref_q8_rows(x2, qt):
    v = qt.vec_dot_type
    K, rows, n = qt.n_in, x2.shape[0], qt.qtype
    codes, d_a, s_a, bsums = decode_act(quantize_act(x2, v), v, K)
    w = unpack_blocks(qt.raw, n, K)                  # leading axes (n_out, nb)
    nb = K // qt.block_size
    y = np.empty((rows, qt.n_out))
    if qt.block_size == 256:
        sub = 16 if n in ("Q6_K", "Q2_K", "Q3_K") else 8   # sub-blocks per super-block
        L = 256 // sub
        A = codes.reshape(rows, nb * sub, L).transpose(1, 0, 2).astype(np.float64)   # (nb*sub, rows, L)
        da = d_a.astype(np.float64).T[:, :, None]                                     # (nb, rows, 1)
        mins = n in ("Q4_K", "Q5_K", "Q2_K")
        if mins:
            bp = bsums.astype(np.float64)
            if sub == 8:
                bp = bp[..., 0::2] + bp[..., 1::2]
            bp = bp.transpose(1, 0, 2)                                                  # (nb, rows, sub)
        for c in _chunks(qt.n_out, nb * sub * rows):
            Wq = w["q"][c].reshape(-1, nb * sub, L).transpose(1, 2, 0).astype(np.float64)  # (nb*sub, L, o)
            I = np.matmul(A, Wq).reshape(nb, sub, rows, -1)
            sc = w["sc"][c].astype(np.float64).transpose(1, 2, 0)[:, :, None, :]        # (nb, sub, 1, o)
            S = (I * sc).sum(axis=1)                                                    # (nb, rows, o)
            dw = w["d"][c].astype(np.float64).T[:, None, :]                             # (nb, 1, o)
            if not mins:
                y[:, c] = (da * dw * S).sum(axis=0)
            else:
                M = np.matmul(bp, w["m"][c].astype(np.float64).transpose(1, 2, 0))     # (nb, rows, o)
                dmin = w["dmin"][c].astype(np.float64).T[:, None, :]
                y[:, c] = (da * dw * S - da * dmin * M).sum(axis=0)
        return y
    A = codes.reshape(rows, nb, 32).transpose(1, 0, 2).astype(np.float64)             # (nb, rows, 32)
    da = d_a.astype(np.float64).T[:, :, None]
    for c in _chunks(qt.n_out, nb * rows):
        Wq = w["q"][c].astype(np.float64).transpose(1, 2, 0)                            # (nb, 32, o)
        dw = w["d"][c].astype(np.float64).T[:, None, :]
        y[:, c] = (da * dw * np.matmul(A, Wq)).sum(axis=0)
        if n in ("Q4_1", "Q5_1"):
            y[:, c] += s_a.astype(np.float64) @ w["m"][c].astype(np.float64).T
    return y


# ------------------------------------------------------------------------------------------------
# weight quantizers for tests

def _h(a):
    """-> float32 -> float16 (RNE) -> float32"""
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def _fit_scale_min(x, nmax, rmin, rdelta, nstep):
    """Per row of x (N, n): (scale >= 0, min >= 0) with x ~ scale*L - min, L in 0..nmax, chosen by
    a grid of inverse scales and a weighted least-squares refit (in the spirit of ggml's qkx2)."""
    x = x.astype(np.float64)
    w = np.sqrt(np.mean(x * x, axis=1, keepdims=True)) + np.abs(x)
    lo = np.minimum(x.min(axis=1), 0.0)[:, None]
    span = x.max(axis=1)[:, None] - lo
    ok = span > 0
    span = np.where(ok, span, 1.0)
    best_s, best_m = span / nmax, lo.copy()
    L = np.clip(np.rint((x - lo) * nmax / span), 0, nmax)
    best_e = np.sum(w * (best_s * L + best_m - x) ** 2, axis=1, keepdims=True)
    sw, sx = w.sum(1, keepdims=True), (w * x).sum(1, keepdims=True)
    for t in range(nstep + 1):
        L = np.clip(np.rint((rmin + rdelta * t + nmax) / span * (x - lo)), 0, nmax)
        sl, sll, slx = (w * L).sum(1, keepdims=True), (w * L * L).sum(1, keepdims=True), (w * L * x).sum(1, keepdims=True)
        det = sw * sll - sl * sl
        good = det > 0
        det = np.where(good, det, 1.0)
        s = (sw * slx - sl * sx) / det
        m = (sll * sx - sl * slx) / det
        pos = m > 0                                   # x ~ s*L + m with m <= 0 only
        s = np.where(pos, slx / np.where(sll > 0, sll, 1.0), s)
        m = np.where(pos, 0.0, m)
        e = np.sum(w * (s * L + m - x) ** 2, axis=1, keepdims=True)
        take = good & (e < best_e)
        best_s, best_m, best_e = np.where(take, s, best_s), np.where(take, m, best_m), np.where(take, e, best_e)
    best_s = np.where(ok, np.maximum(best_s, 0.0), 0.0)
    return best_s[:, 0], np.where(ok, -best_m, 0.0)[:, 0]


def _pack_scale_min_k4(sc, m):
    """sc, m uint8 (N, 8) in 0..63 -> (N, 12) bytes (docs/semantics.md §8)"""
    b = np.empty(sc.shape[:-1] + (12,), np.uint8)
    b[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    b[..., 4:8] = m[..., 0:4] | ((m[..., 4:8] >> 4) << 6)
    b[..., 8:12] = (sc[..., 4:8] & 15) | ((m[..., 4:8] & 15) << 4)
    return b


def _quantize_q45_k(x, five):
    """x float32 (N, 256) -> Q4_K or Q5_K blocks (N, 144 / 176)"""
    N = x.shape[0]
    nmax = 31 if five else 15
    xs = x.reshape(N * 8, 32)
    scale, mn = _fit_scale_min(xs, nmax, -0.5 if five else -1.0, 0.1, 15 if five else 20)
    scale, mn = scale.reshape(N, 8), mn.reshape(N, 8)
    codes = []
    for v in (scale, mn):                              # 6-bit codes against a per-block f16 scale
        vmax = v.max(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            c = np.where(vmax > 0, np.rint(v * (63.0 / vmax)), 0)
        codes.append((np.clip(c, 0, 63).astype(np.uint8), _h(vmax[:, 0] / 63.0)))
    (ls, d), (lm, dmin) = codes
    ds = (d[:, None] * ls).astype(np.float64)[..., None]          # effective sub-block scale
    dm = (dmin[:, None] * lm).astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(ds > 0, np.rint((x.reshape(N, 8, 32) + dm) / ds), 0)
    q = np.clip(q, 0, nmax).astype(np.uint8)                        # (N, 8, 32)
    low = q & 15
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(N, 128)
    parts = [d.astype("<f2").view(np.uint8).reshape(N, 2), dmin.astype("<f2").view(np.uint8).reshape(N, 2),
             _pack_scale_min_k4(ls, lm)]
    if five:   # bit s of qh[l] = 5th bit of sub-block s, element l
        hb = (q >> 4).astype(np.uint8)
        parts.append(np.bitwise_or.reduce(hb << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _quantize_q6_k(x):
    """x float32 (N, 256) -> Q6_K blocks (N, 210)"""
    N = x.shape[0]
    xs = x.reshape(N * 16, 16).astype(np.float64)
    w = xs * xs
    mx = np.take_along_axis(xs, np.argmax(np.abs(xs), axis=1)[:, None], axis=1)
    nz = mx != 0
    mxs = np.where(nz, mx, 1.0)
    best_s, best_score = np.zeros((N * 16, 1)), np.full((N * 16, 1), -1.0)
    for t in [0] + [t for t in range(-9, 10) if t]:
        L = np.clip(np.rint(-(32 + 0.1 * t) / mxs * xs), -32, 31)
        slx, sll = (w * xs * L).sum(1, keepdims=True), (w * L * L).sum(1, keepdims=True)
        safe = np.where(sll > 0, sll, 1.0)
        score = np.where(sll > 0, slx * slx / safe, 0.0)
        take = nz & (score > best_score)
        best_s, best_score = np.where(take, slx / safe, best_s), np.where(take, score, best_score)
    scale = best_s.reshape(N, 16)
    ms = np.take_along_axis(scale, np.argmax(np.abs(scale), axis=1)[:, None], axis=1)[:, 0]
    live = np.abs(ms) >= 1e-15
    iscale = np.where(live, -128.0 / np.where(live, ms, 1.0), 0.0)
    d = np.where(live, _h(1.0 / np.where(live, iscale, 1.0)), 0).astype(np.float32)
    sc = np.clip(np.rint(iscale[:, None] * scale), -128, 127).astype(np.int8)
    ds = (d[:, None] * sc).astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(ds != 0, np.rint(x.reshape(N, 16, 16) / ds), 0)
    qu = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(N, 2, 4, 32)    # [half, group, l]
    low, high = qu & 15, qu >> 4
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(N, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(N, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.astype("<f2").view(np.uint8).reshape(N, 2)], axis=1)


def _pick_max(x):
    """per row of x (N, L): the element of largest |x| (first on ties), float32"""
    return np.take_along_axis(x, np.argmax(np.abs(x), axis=-1)[:, None], axis=-1)[:, 0]


def _f16(v):
    return np.asarray(v, np.float32).astype(np.float16).astype(np.float32)


def _nearest_kv(v):
    """index of the nearest KVALUES_IQ4NL entry to every element of v (float32)"""
    kv = KVALUES_IQ4NL.astype(np.float32)
    return np.argmin(np.abs(v[..., None] - kv), axis=-1).astype(np.uint8)


def _quantize_iq4_nl(x):
    """x float32 (N, 32) -> IQ4_NL blocks (N, 18): d = f16(max / -127), nearest table value"""
    N = len(x)
    d = _f16(_pick_max(x) / np.float32(-127.0))
    with np.errstate(divide="ignore"):
        idd = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = _nearest_kv(x * idd[:, None])
    return np.concatenate([_f16_bytes(d), q[:, :16] | (q[:, 16:] << np.uint8(4))], axis=1).reshape(N, 18)


def _quantize_iq4_xs(x):
    """x float32 (N, 256) -> IQ4_XS blocks (N, 136): per 32 elements a signed scale max/-127,
    the 6-bit scales ls-32 = round(s/d) with d = f16(s_max/-32), nearest table values"""
    N = len(x)
    xs = x.reshape(N * 8, 32)
    s = (_pick_max(xs) / np.float32(-127.0)).reshape(N, 8).astype(np.float32)
    d = _f16(_pick_max(s) / np.float32(-32.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(d[:, None] != 0, np.rint(s / d[:, None]), 0)
    ls = (np.clip(ls, -32, 31) + 32).astype(np.uint8)                                # (N, 8)
    dl = (d[:, None] * (ls.astype(np.float32) - np.float32(32.0))).astype(np.float32)
    with np.errstate(divide="ignore"):
        idl = np.where(dl != 0, np.float32(1.0) / dl, np.float32(0.0)).astype(np.float32)
    q = _nearest_kv(x.reshape(N, 8, 32) * idl[..., None])                              # (N, 8, 32)
    sh = np.zeros(N, np.uint16)
    for j in range(8):
        sh |= ((ls[:, j] >> 4).astype(np.uint16) & np.uint16(3)) << np.uint16(2 * j)
    sl = (ls[:, 0::2] & np.uint8(15)) | ((ls[:, 1::2] & np.uint8(15)) << np.uint8(4))
    qs = (q[..., :16] | (q[..., 16:] << np.uint8(4))).reshape(N, 128)
    return np.concatenate([_f16_bytes(d), sh.astype("<u2").view(np.uint8).reshape(N, 2), sl, qs], axis=1)


def _pack_2bit_qs(u):
    """codes (N, 256) in 0..3 -> the 64 bytes of Q2_K/Q3_K: element 128h + 32g + l at bits 2g of
    byte 32h + l"""
    u = u.reshape(len(u), 2, 4, 32)
    return (u[:, :, 0] | (u[:, :, 1] << 2) | (u[:, :, 2] << 4) | (u[:, :, 3] << 6)).astype(np.uint8).reshape(len(u), 64)


def _quantize_q2_k(x):
    """x float32 (N, 256) -> Q2_K blocks (N, 84): per 16 elements scale (max-min)/3 and min
    -min(x, 0), both as 4-bit multiples of d = f16(max scale/15), dmin = f16(max min/15)"""
    N = len(x)
    xs = x.reshape(N, 16, 16)
    mn = np.minimum(xs.min(axis=-1), 0).astype(np.float32)
    sc = ((xs.max(axis=-1) - mn) / np.float32(3.0)).astype(np.float32)
    d = _f16(sc.max(axis=-1) / np.float32(15.0))
    dmin = _f16((-mn).max(axis=-1) / np.float32(15.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        lsc = np.where(d[:, None] != 0, np.rint(sc / d[:, None]), 0)
        lm = np.where(dmin[:, None] != 0, np.rint(-mn / dmin[:, None]), 0)
    lsc = np.clip(lsc, 0, 15).astype(np.uint8)
    lm = np.clip(lm, 0, 15).astype(np.uint8)
    dl = (d[:, None] * lsc.astype(np.float32)).astype(np.float32)
    ml = (dmin[:, None] * lm.astype(np.float32)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(dl[..., None] != 0, np.rint((xs + ml[..., None]) / dl[..., None]), 0)
    q = np.clip(q, 0, 3).astype(np.uint8).reshape(N, 256)
    return np.concatenate([lsc | (lm << np.uint8(4)), _pack_2bit_qs(q), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def _quantize_q3_k(x):
    """x float32 (N, 256) -> Q3_K blocks (N, 110): per 16 elements a signed scale max/-4, the
    6-bit scales sc-32 = round(s/d) with d = f16(s_max/-32), codes round(x/(d*sc)) in -4..3"""
    N = len(x)
    xs = x.reshape(N * 16, 16)
    s = (_pick_max(xs) / np.float32(-4.0)).reshape(N, 16).astype(np.float32)
    d = _f16(_pick_max(s) / np.float32(-32.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(d[:, None] != 0, np.rint(s / d[:, None]), 0)
    ls = np.clip(ls, -32, 31).astype(np.int16)                                          # sc - 32
    dl = (d[:, None] * ls.astype(np.float32)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(dl[..., None] != 0, np.rint(x.reshape(N, 16, 16) / dl[..., None]), 0)
    u = (np.clip(q, -4, 3) + 4).astype(np.uint8).reshape(N, 256)                       # q + 4
    hb = (u >> 2).reshape(N, 8, 32)                                                     # element 32b + l
    hmask = np.zeros((N, 32), np.uint8)
    for b in range(8):
        hmask |= hb[:, b] << np.uint8(b)
    v = (ls + 32).astype(np.uint8)                                                      # 0..63
    sc = np.zeros((N, 12), np.uint8)
    sc[:, 0:8] = (v[:, 0:8] & np.uint8(15)) | ((v[:, 8:16] & np.uint8(15)) << np.uint8(4))
    for k in range(4):
        sc[:, 8:12] |= ((v[:, 4 * k:4 * k + 4] >> np.uint8(4)) & np.uint8(3)) << np.uint8(2 * k)
    return np.concatenate([hmask, _pack_2bit_qs(u & np.uint8(3)), sc, _f16_bytes(d)], axis=1)


_OWN_QUANTIZERS = {"Q2_K": (256, _quantize_q2_k), "Q3_K": (256, _quantize_q3_k),
                   "IQ4_NL": (32, _quantize_iq4_nl), "IQ4_XS": (256, _quantize_iq4_xs)}


def quantize_weight(w, qtype):
    """Quantize float weights w (n_out, n_in) to a new QTensor. Float and legacy types use
    gguf.quants.quantize (ggml's reference quantizers); Q4_K/Q5_K/Q6_K, Q2_K/Q3_K and
    IQ4_NL/IQ4_XS use this module's own numpy quantizers (valid and accurate, not byte-identical to llama-quantize)."""
    t = resolve_qtype(qtype)
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D (n_out, n_in), got shape {w.shape}")
    n_out, n_in = w.shape
    if n_in % t.block_size:
        raise ValueError(f"w: n_in={n_in} is not a multiple of the {t.name} block size {t.block_size}")
    if t.name in _OWN_QUANTIZERS:
        B, fn = _OWN_QUANTIZERS[t.name]
        raw = fn(w.reshape(-1, B))
    elif t.name in ("Q4_K", "Q5_K", "Q6_K"):
        xb = w.reshape(-1, 256)
        raw = _quantize_q6_k(xb) if t.name == "Q6_K" else _quantize_q45_k(xb, t.name == "Q5_K")
    else:
        import gguf
        raw = gguf.quants.quantize(np.ascontiguousarray(w), gguf.GGMLQuantizationType(t.type_id))
    return QTensor(np.array(raw, copy=True, order="C"), t, (n_out, n_in))


def make_weight(qtype, n_out, n_in, rng, kind="normal"):
    """A QTensor of random weights (kind: "normal" N(0,1), "uniform" U[-1,1), "t3" Student-t with
    3 d.o.f., "zeros") quantized by quantize_weight."""
    if kind == "normal":
        w = rng.standard_normal((n_out, n_in))
    elif kind == "uniform":
        w = rng.uniform(-1, 1, (n_out, n_in))
    elif kind == "t3":
        w = rng.standard_t(3, (n_out, n_in))
    elif kind == "zeros":
        w = np.zeros((n_out, n_in))
    else:
        raise ValueError(f"kind must be 'normal', 'uniform', 't3' or 'zeros', got {kind!r}")
    return quantize_weight(w.astype(np.float32), qtype)


def _f16_bytes(v):
    return np.asarray(v, np.float32).astype("<f2").view(np.uint8).reshape(np.shape(v) + (2,))


def random_blocks(qtype, n_out, n_in, rng, d_range=(1e-3, 1e-2)):
    """A QTensor of random valid bytes: uniform random codes and scale bytes, f16 scales
    d = ±d_range (dmin in d_range, Q4_1/Q5_1 m in ±[0, 0.1]). Edge cases when there are
    enough blocks: flat block 0 holds extreme codes (Q4_K/Q5_K: sc = m = 63 and q = 15 / 31;
    Q6_K: scales -128/127 with q = -32/31; legacy: the largest codes, Q8_0 ±127), flat block 1
    has d = 0 (and dmin = m = 0). Q8_0 codes stay in [-127, 127] as ggml's quantizer produces.
    Float types: N(0, 1) values."""
    t = resolve_qtype(qtype)
    n_out, n_in = int(n_out), int(n_in)
    if n_in % t.block_size:
        raise ValueError(f"n_in={n_in} is not a multiple of the {t.name} block size {t.block_size}")
    if t.block_size == 1:
        return quantize_weight(rng.standard_normal((n_out, n_in)).astype(np.float32), t)
    nbk = n_out * n_in // t.block_size
    b = rng.integers(0, 256, (nbk, t.type_size), dtype=np.uint8)
    d = rng.uniform(*d_range, nbk) * rng.choice([-1.0, 1.0], nbk)
    dmin = rng.uniform(*d_range, nbk)
    if nbk > 1:
        d[1] = dmin[1] = 0.0
    n = t.name
    if n == "Q2_K":
        b[:, 80:82], b[:, 82:84] = _f16_bytes(d), _f16_bytes(dmin)
        b[0, 0:80] = 0xFF                                                 # sc = m = 15, q = 3
    elif n == "Q3_K":
        b[:, 108:110] = _f16_bytes(d)
        b[0, 0:32] = 0x00                                                 # q = -4 (no high bit)
        b[0, 32:96] = 0x00
        b[0, 96:108] = np.array([0] * 8 + [0x55] * 4, np.uint8)           # sc: -32 (0..7) / -16 (8..15)
        if nbk > 2:
            b[2, 0:96] = 0xFF                                             # q = 3
            b[2, 96:108] = 0xFF                                           # sc = 31
    elif n in ("IQ4_NL", "IQ4_XS"):
        b[:, 0:2] = _f16_bytes(d)
        if n == "IQ4_NL":
            b[0, 2:18] = np.tile(np.array([0x0F, 0xF0], np.uint8), 8)    # -127 and 113
        else:
            b[0, 2:8] = 0x00                                              # all scales -32
            b[0, 8:] = np.tile(np.array([0x0F, 0xF0], np.uint8), 64)
    elif n == "MXFP4":   # E8M0 scales 2^(e-128) about d_range; block 0: codes 12 / -12; block 1: e = 0
        b[:, 0] = np.clip(np.round(np.log2(np.maximum(np.abs(d), 1e-30)) + 127), 1, 254).astype(np.uint8)
        b[0, 1:17] = np.tile(np.array([0x77, 0xFF], np.uint8), 8)
        if nbk > 1:
            b[1, 0] = 0
    elif n == "Q6_K":
        b[:, 208:210] = _f16_bytes(d)
        b[0, 0:192] = np.tile(np.array([0xFF, 0x00], np.uint8), 96)      # q = 31 / -32 alternating
        b[0, 192:208] = np.tile(np.array([0x80, 0x7F], np.uint8), 8)     # scales -128 / 127
    elif n in ("Q4_K", "Q5_K"):
        b[:, 0:2], b[:, 2:4] = _f16_bytes(d), _f16_bytes(dmin)
        b[0, 4:16] = 0xFF                                                 # sc = m = 63
        b[0, 16:] = 0xFF                                                  # q = 15 (31 with qh)
    else:
        b[:, 0:2] = _f16_bytes(d)
        if n in ("Q4_1", "Q5_1"):
            m = rng.uniform(-0.1, 0.1, nbk)
            if nbk > 1:
                m[1] = 0.0
            b[:, 2:4] = _f16_bytes(m)
        if n == "Q8_0":
            q = rng.integers(-127, 128, (nbk, 32), dtype=np.int8)
            q[0] = np.tile(np.array([127, -127], np.int8), 16)
            b[:, 2:34] = q.view(np.uint8)
        else:
            b[0, 2 if n in ("Q4_0", "Q5_0") else 4:] = 0xFF               # largest codes (and qh)
    return QTensor(b.reshape(n_out, -1), t, (n_out, n_in))
