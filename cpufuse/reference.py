"""float64 oracles (SPEC §1.3, §2.2), straight from the definitions, for tests and the benchmark's
correctness check. Inputs are the same f32/f16 arrays the kernels get; everything after the
ALiBi slope (which upstream computes in f32) is evaluated in float64."""
import numpy as np


def alibi_slopes(n_head, max_bias):
    """SPEC §1.2 in float32 (as upstream's powf): slope per head, or None when max_bias <= 0."""
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
    dimension (SPEC §2.3); with residual, x is first replaced by x + residual (added in f32, as
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
