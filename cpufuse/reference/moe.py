"""float64 references of the routed matmul and the gating ops (cpufuse/graph/moe.py): what each
computes, without the kernels' order of operations."""
import math

import numpy as np

from .quant import ref_matmul_f32, ref_matmul_q8


def ref_matmul_id(x, w, ids, act="q8", up=None, glu="swiglu"):
    """float64 (n, k, n_out): y[r, j] = the act mode's product (ref_matmul_q8 or ref_matmul_f32) of
    row x[r] with expert ids[r, j] of the 3-D QTensor w; with up: glu(x . w_e^T) * (x . up_e^T)
    (silu g / (1 + exp(-g)), or the tanh-form gelu)."""
    x = np.asarray(x)
    ids = np.asarray(ids)
    mm = ref_matmul_q8 if act == "q8" else ref_matmul_f32
    out = np.empty(ids.shape + (w.n_out,), np.float64)
    for r in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[r, j])
            g = mm(x[r:r + 1], w.expert(e))[0]
            if up is not None:
                u = mm(x[r:r + 1], up.expert(e))[0]
                with np.errstate(over="ignore"):
                    if glu == "swiglu":
                        g = g / (1.0 + np.exp(-g))
                    else:
                        g = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))
                g = g * u
            out[r, j] = g
    return out


def ref_topk(x, k):
    """int64 (..., k): each row's indices sorted by (NaN last, value descending, index ascending),
    in float64 and plain Python sorting"""
    x = np.asarray(x, np.float64)
    rows = x.reshape(-1, x.shape[-1])
    out = [sorted(range(rows.shape[1]), key=lambda i, v=v: (math.isnan(v[i]), -v[i] if not math.isnan(v[i]) else 0.0,
                                                            i))[:k] for v in rows]
    return np.array(out, np.int64).reshape(x.shape[:-1] + (k,))


def ref_sigmoid(x):
    """float64 1 / (1 + exp(-x))"""
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def ref_wsum(y, w):
    """float64 sum over j of w[..., j] * y[..., j, :]"""
    return np.einsum("...j,...jm->...m", np.asarray(w, np.float64), np.asarray(y, np.float64))
