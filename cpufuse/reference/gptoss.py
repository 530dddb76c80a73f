"""The float64 reference forward of gpt-oss (llama.cpp's src/models/openai-moe-iswa.cpp), every
step in float64 from the dequantized tensors of the file: pre-norm attention with Q/K/V/O biases,
NEOX RoPE with YaRN (ggml rope_ext's ramp between the interpolated and extrapolated angles, cos/sin
times attn_factor * (1 + 0.1 ln(factor))), a sink logit per head in the softmax denominator,
sliding-window layers (il % 2 == 0), post_attention_norm before the routed FFN: router + bias,
top-k of the logits (ties: the lower expert), softmax over the k, per expert gate/up + biases,
swiglu_oai (min(g, 7), clamp(u, +-7), x sigmoid(1.702 x) (y + 1)), down + bias, the weighted sum."""
import math

import numpy as np

from .gguf_ref import RefFile as _File, rms as _rms

ALPHA, LIMIT = 1.702, 7.0


def swiglu_oai64(g, u):
    """swiglu_oai in float64"""
    x = np.minimum(g, LIMIT)
    y = np.clip(u, -LIMIT, LIMIT)
    return x / (1.0 + np.exp(-ALPHA * x)) * (y + 1.0)


def rope_yarn64(x, pos, n_rot, base, fs, ext, attn, nco, beta_fast=32.0, beta_slow=1.0):
    """NEOX rope_ext in float64 on x (n, heads, d): theta_e = p base^(-2i/n_rot), theta_i = fs theta_e,
    mixed by ramp(i) * ext (corr dims from beta_fast/beta_slow and nco), cos/sin times
    attn * (1 + 0.1 ln(1/fs)) when ext != 0"""
    half = n_rot // 2
    i = np.arange(half, dtype=np.float64)
    te = pos[:, None] * base ** (-2.0 * i / n_rot)
    th, m = fs * te, attn
    if ext:
        def corr(r):
            return n_rot * math.log(nco / (r * 2 * math.pi)) / (2 * math.log(base))
        lo, hi = max(0.0, math.floor(corr(beta_fast))), min(n_rot - 1.0, math.ceil(corr(beta_slow)))
        ramp = (1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)) * ext
        th = th * (1 - ramp) + te * ramp
        m = attn * (1 + 0.1 * math.log(1 / fs))
    c, s = (np.cos(th) * m)[:, None, :], (np.sin(th) * m)[:, None, :]
    y = x.copy()
    a, b = x[..., :half], x[..., half:n_rot]
    y[..., :half], y[..., half:n_rot] = a * c - b * s, a * s + b * c
    return y


def ref_experts(f, b, h):
    """the routed FFN of layer prefix b on the normed rows h (n, n_embd); returns (out, ids, margin):
    margin the gap between the k-th and (k+1)-th logits of each row (tests avoid near-ties)"""
    T = f.t
    k = f.a("expert_used_count")
    logits = h @ T[b + "ffn_gate_inp.weight"].T + T[b + "ffn_gate_inp.bias"]
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, ids, -1)
    w = np.exp(top - top.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    G, U, D = T[b + "ffn_gate_exps.weight"], T[b + "ffn_up_exps.weight"], T[b + "ffn_down_exps.weight"]
    bg, bu, bd = T[b + "ffn_gate_exps.bias"], T[b + "ffn_up_exps.bias"], T[b + "ffn_down_exps.bias"]
    out = np.zeros_like(h)
    for r in range(h.shape[0]):
        for j in range(k):
            e = ids[r, j]
            a = swiglu_oai64(G[e] @ h[r] + bg[e], U[e] @ h[r] + bu[e])
            out[r] += w[r, j] * (D[e] @ a + bd[e])
    s = np.sort(logits, -1)[:, ::-1]
    margin = s[:, k - 1] - s[:, k] if k < s.shape[1] else np.full(len(s), np.inf)
    return out, ids, margin


def ref_gptoss_logits(path, tokens, routes=None, hidden=False):
    """(len(tokens), n_vocab) float64 logits of every position; routes: a list that receives each
    layer's (ids, margin); path: a file path or a gguf_ref.RefFile; hidden: the rows after output_norm"""
    f = path if isinstance(path, _File) else _File(path)
    T = f.t
    E, L, H = f.a("embedding_length"), f.a("block_count"), f.a("attention.head_count")
    Hkv = f.a("attention.head_count_kv", H)
    D = f.a("attention.key_length", E // H)
    n_rot = f.a("rope.dimension_count", D)
    eps = f.a("attention.layer_norm_rms_epsilon")
    base = f.a("rope.freq_base", 10000.0)
    yarn = f.a("rope.scaling.type", "linear") == "yarn"
    factor = f.a("rope.scaling.factor", 0.0)
    fs = 1.0 / factor if factor else 1.0
    nco = f.a("rope.scaling.original_context_length", f.a("context_length"))
    window = f.a("attention.sliding_window", 0)
    tokens = np.asarray(tokens)
    n = len(tokens)
    pos = np.arange(n, dtype=np.float64)
    causal = pos[None, :] <= pos[:, None]
    x = T["token_embd.weight"][tokens]
    for il in range(L):
        b = f"blk.{il}."
        h = _rms(x, T[b + "attn_norm.weight"], eps)
        q = (h @ T[b + "attn_q.weight"].T + T.get(b + "attn_q.bias", 0.0)).reshape(n, H, D)
        k = (h @ T[b + "attn_k.weight"].T + T.get(b + "attn_k.bias", 0.0)).reshape(n, Hkv, D)
        v = (h @ T[b + "attn_v.weight"].T + T.get(b + "attn_v.bias", 0.0)).reshape(n, Hkv, D)
        q = rope_yarn64(q, pos, n_rot, base, fs, 1.0 if yarn else 0.0, 1.0, nco)
        k = rope_yarn64(k, pos, n_rot, base, fs, 1.0 if yarn else 0.0, 1.0, nco)
        vis = causal & ((pos[:, None] - pos[None, :] < window) if window and il % 2 == 0 else True)
        sinks = T[b + "attn_sinks.weight"]
        out = np.empty((n, H, D))
        g = H // Hkv
        for hh in range(H):
            s = np.where(vis, (q[:, hh] @ k[:, hh // g].T) / math.sqrt(n_rot), -np.inf)
            mx = np.maximum(s.max(axis=1, keepdims=True), sinks[hh])
            p = np.exp(s - mx)
            out[:, hh] = (p @ v[:, hh // g]) / (p.sum(axis=1, keepdims=True) + np.exp(sinks[hh] - mx))
        a = out.reshape(n, H * D) @ T[b + "attn_output.weight"].T + T.get(b + "attn_output.bias", 0.0)
        x = x + a
        y, ids, margin = ref_experts(f, b, _rms(x, T[b + "post_attention_norm.weight"], eps))
        if routes is not None:
            routes.append((ids, margin))
        x = x + y
    x = _rms(x, T["output_norm.weight"], eps)
    if hidden:
        return x
    return x @ T.get("output.weight", T["token_embd.weight"]).T
