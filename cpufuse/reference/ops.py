"""float64 oracles (docs/semantics.md §2, §3), straight from the definitions, for tests and the benchmark's
correctness check. Inputs are the same f32/f16 arrays the kernels get; everything after the
ALiBi slope (which upstream computes in f32) is evaluated in float64."""
import numpy as np


def alibi_slopes(n_head, max_bias):
    """docs/semantics.md §2 in float32 (as upstream's powf): slope per head, or None when max_bias <= 0."""
    if max_bias <= 0.0:
        return None
    n_head_log2 = 1 << int(np.floor(np.log2(n_head))) if n_head > 0 else 1
    f = np.float32
    m0 = np.power(f(2.0), f(-max_bias) / f(n_head_log2))
    m1 = np.power(f(2.0), f(-max_bias / 2.0) / f(n_head_log2))
    h = np.arange(n_head)
    out = np.where(h < n_head_log2,
                   np.power(m0, (h + 1).astype(f)),
                   np.power(m1, (2 * (h - n_head_log2) + 1).astype(f)))
    return out.astype(np.float32)


def _as4(a):
    return a.reshape((1,) * (4 - a.ndim) + a.shape)


def tile_mask(mask, S, H, R):
    """The mask rows each (s, h, r) row of x reads: heads and sequences by modulo, rows direct."""
    m = _as4(np.asarray(mask))
    mS, mH = m.shape[0], m.shape[1]
    return m[np.arange(S) % mS][:, np.arange(H) % mH][:, :, :R]


def softmax(x, mask=None, scale=1.0, max_bias=0.0, sinks=None):
    x4 = _as4(np.asarray(x)).astype(np.float64)
    S, H, R, C = x4.shape
    z = x4 * scale
    if mask is not None:
        slopes = alibi_slopes(H, max_bias)
        slope = np.ones(H) if slopes is None else slopes.astype(np.float64)
        z = z + slope[None, :, None, None] * tile_mask(mask, S, H, R).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        M = z.max(axis=-1, keepdims=True) if C else np.full(z.shape[:-1] + (1,), -np.inf)
        if sinks is not None:
            sk = np.asarray(sinks, np.float64)[None, :, None, None]
            M = np.maximum(M, sk)
        e = np.exp(z - M)
        den = e.sum(axis=-1, keepdims=True)
        if sinks is not None:
            den = den + np.exp(sk - M)
        y = e / den
    return y.reshape(np.shape(x))


def rms_norm(x, eps, weight=None, bias=None, residual=None):
    """y = x * (1/sqrt(mean(x^2) + eps)) * weight + bias, weight/bias tiled by modulo in every
    dimension (docs/semantics.md §3); with residual, x is first replaced by x + residual (added in f32, as
    the kernels store h in f32) and (h, y) is returned."""
    x = np.asarray(x)
    h = None
    if residual is not None:
        h = (x + tile_to(residual, x.shape)).astype(np.float32)
        x = h
    x64 = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        ms = (x64 * x64).mean(axis=-1, keepdims=True)
        y = x64 / np.sqrt(ms + eps)
        if weight is not None:
            y = y * tile_to(weight, x.shape).astype(np.float64)
        if bias is not None:
            y = y + tile_to(bias, x.shape).astype(np.float64)
    return (h, y) if residual is not None else y


def tile_to(a, shape):
    """ggml binary-op tiling (ggml_can_repeat): index every dim of `a` by modulo."""
    a = np.asarray(a)
    a = a.reshape((1,) * (len(shape) - a.ndim) + a.shape)
    idx = np.ix_(*[np.arange(n) % m for n, m in zip(shape, a.shape)])
    return a[idx]


def nmse(ref, out):
    ref = np.asarray(ref, np.float64)
    out = np.asarray(out, np.float64)
    den = float(np.sum(ref * ref))
    num = float(np.sum((ref - out) ** 2))
    return num / den if den else num


def flash_attn(q, k, v, mask=None, scale=1.0, max_bias=0.0, softcap=0.0, sinks=None):
    """docs/semantics.md §4 in float64 from the stored values (f16 K/V widened exactly). Output is ggml's
    permuted layout (S, N, Hq, DV). Excluded positions (slope*mask == -inf) are dropped before the
    dot products, so NaN/inf stored there never reaches the result; an empty row is zeros."""
    q4, k4, v4 = (_as4(np.asarray(a)) for a in (q, k, v))
    S, Hq, N, DK = q4.shape
    Hk, T, Hv, DV = k4.shape[1], k4.shape[2], v4.shape[1], v4.shape[3]
    slopes = alibi_slopes(Hq, max_bias)
    out = np.zeros((S, N, Hq, DV))
    for s in range(S):
        for h in range(Hq):
            qh = q4[s, h].astype(np.float64)
            kh = k4[s, h // (Hq // Hk)].astype(np.float64)
            vh = v4[s, h // (Hq // Hv)].astype(np.float64)
            if mask is not None:
                m4 = _as4(np.asarray(mask))
                a = m4[s % m4.shape[0], h % m4.shape[1], :N, :T].astype(np.float32)
                if slopes is not None:
                    a = (slopes[h] * a).astype(np.float32)  # upstream forms slope*mask in f32
                a = a.astype(np.float64)
            else:
                a = np.zeros((N, T))
            inc = a != -np.inf
            for n in range(N):
                idx = np.nonzero(inc[n])[0]
                with np.errstate(invalid="ignore", over="ignore"):
                    dots = kh[idx] @ qh[n]
                    z = dots * scale if softcap == 0.0 else softcap * np.tanh(dots * scale / softcap)
                    z = z + a[n, idx]
                    M = z.max() if idx.size else -np.inf
                    if sinks is not None:
                        M = max(M, float(sinks[h]))
                    if M == -np.inf:
                        continue
                    e = np.exp(z - M)
                    den = e.sum() + (np.exp(float(sinks[h]) - M) if sinks is not None else 0.0)
                    out[s, n, h] = (e @ vh[idx]) / den if den else 0.0
    return out


def rope(x, pos, n_dims, base=10000.0):
    """ggml rope_ext in normal (LLaMA) mode, freq_scale 1, no YaRN, float64: the pairs (2i, 2i+1) of
    the first n_dims of x (T, H, D) rotated by pos[t] * base^(-2i/n_dims)."""
    x64 = np.asarray(x, np.float64)
    out = x64.copy()
    theta = np.asarray(pos, np.float64)[:, None] * base ** (-2.0 * np.arange(n_dims // 2) / n_dims)[None, :]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = x64[..., 0:n_dims:2], x64[..., 1:n_dims:2]
    out[..., 0:n_dims:2] = x0 * c - x1 * s
    out[..., 1:n_dims:2] = x0 * s + x1 * c
    return out
