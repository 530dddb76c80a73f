"""A llama-style decoder block as a cpufuse graph, with its numpy and float64 twins.

Used by the tests (fused plan == unfused plan, both vs float64) and the benchmark's graph section
(SmolLM2-135M and Llama-7B-like sizes). Pre-norm block with a KV cache of n_past positions (float32 here: the
graph has no f32->f16 cache write):
  h = rms_norm(x) * w_attn;  q, k, v = h Wq, h Wk, h Wv;  K = [K_cache; k], V = [V_cache; v]
  a = flash_attn(q, K, V, causal mask, scale = 1/sqrt(head_dim));  x2 = x + a Wo
  h2 = rms_norm(x2) * w_ffn;  out = x2 + (silu(h2 Wg) * (h2 Wu)) Wd
"""
import numpy as np

from cpufuse.graph import Graph

SMOLLM2_135M = dict(d=576, n_head=9, n_kv=3, head_dim=64, ffn=1536, eps=1e-5)
LLAMA_7B = dict(d=4096, n_head=32, n_kv=32, head_dim=128, ffn=11008, eps=1e-6)


def make_weights(cfg, rng):
    d, H, Hk, hd, f = cfg["d"], cfg["n_head"], cfg["n_kv"], cfg["head_dim"], cfg["ffn"]

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[0])).astype(np.float32)
    return {
        "w_attn": (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32),
        "w_ffn": (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32),
        "wq": w(d, H * hd), "wk": w(d, Hk * hd), "wv": w(d, Hk * hd), "wo": w(H * hd, d),
        "wg": w(d, f), "wu": w(d, f), "wd": w(f, d),
    }


def make_inputs(cfg, n_tok, n_past, rng):
    Hk, hd = cfg["n_kv"], cfg["head_dim"]
    T = n_past + n_tok
    mask = np.zeros((1, 1, n_tok, T), np.float16)
    for i in range(n_tok):
        mask[0, 0, i, n_past + i + 1:] = -np.inf  # causal: token i sees the cache and tokens <= i
    return {
        "x": rng.standard_normal((n_tok, cfg["d"]), dtype=np.float32),
        "k_cache": rng.standard_normal((1, Hk, n_past, hd), dtype=np.float32),
        "v_cache": rng.standard_normal((1, Hk, n_past, hd), dtype=np.float32),
        "mask": mask,
    }


def build_graph(cfg, weights, n_tok, n_past):
    d, H, Hk, hd, f, eps = (cfg[k] for k in ("d", "n_head", "n_kv", "head_dim", "ffn", "eps"))
    g = Graph()
    x = g.input("x", (n_tok, d))
    kc = g.input("k_cache", (1, Hk, n_past, hd))
    vc = g.input("v_cache", (1, Hk, n_past, hd))
    mask = g.input("mask", (1, 1, n_tok, n_past + n_tok), np.float16)
    W = {k: g.constant(v, k) for k, v in weights.items()}
    h = g.mul(g.rms_norm(x, eps, name="attn_norm"), W["w_attn"], name="attn_norm_w")
    q = g.permute(g.reshape(g.matmul(h, W["wq"], name="q"), (1, n_tok, H, hd)), (0, 2, 1, 3), name="q4")
    k = g.permute(g.reshape(g.matmul(h, W["wk"], name="k"), (1, n_tok, Hk, hd)), (0, 2, 1, 3), name="k4")
    v = g.permute(g.reshape(g.matmul(h, W["wv"], name="v"), (1, n_tok, Hk, hd)), (0, 2, 1, 3), name="v4")
    K = g.concat(kc, k, axis=2, name="K")
    V = g.concat(vc, v, axis=2, name="V")
    a = g.flash_attn(q, K, V, mask, scale=1.0 / np.sqrt(hd), name="attn")
    o = g.matmul(g.reshape(a, (n_tok, H * hd)), W["wo"], name="attn_out")
    x2 = g.add(x, o, name="resid1")
    h2 = g.mul(g.rms_norm(x2, eps, name="ffn_norm"), W["w_ffn"], name="ffn_norm_w")
    gate = g.matmul(h2, W["wg"], name="gate")
    up = g.matmul(h2, W["wu"], name="up")
    act = g.mul(g.silu(gate, name="silu"), up, name="swiglu")
    out = g.add(x2, g.matmul(act, W["wd"], name="down"), name="resid2")
    g.output(out)
    return g


def numpy_block(cfg, W, x, k_cache, v_cache, mask, dtype=np.float32):
    """The block as a numpy user writes it (dtype float32), or the float64 oracle (dtype float64)."""
    H, Hk, hd, eps = cfg["n_head"], cfg["n_kv"], cfg["head_dim"], cfg["eps"]
    c = lambda a: np.asarray(a, dtype)  # noqa: E731
    x = c(x)
    n_tok = x.shape[0]

    def rms(a, w):
        return a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + dtype(eps)) * c(w)
    h = rms(x, W["w_attn"])
    q = (h @ c(W["wq"])).reshape(n_tok, H, hd).transpose(1, 0, 2)
    k = np.concatenate([c(k_cache)[0], (h @ c(W["wk"])).reshape(n_tok, Hk, hd).transpose(1, 0, 2)], axis=1)
    v = np.concatenate([c(v_cache)[0], (h @ c(W["wv"])).reshape(n_tok, Hk, hd).transpose(1, 0, 2)], axis=1)
    rep = H // Hk
    k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
    s = q @ k.transpose(0, 2, 1) * dtype(1.0 / np.sqrt(hd)) + c(mask[0])
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    a = (p @ v).transpose(1, 0, 2).reshape(n_tok, H * hd)
    x2 = x + a @ c(W["wo"])
    h2 = rms(x2, W["w_ffn"])
    gt = h2 @ c(W["wg"])
    act = gt / (1 + np.exp(-gt)) * (h2 @ c(W["wu"]))
    return x2 + act @ c(W["wd"])
