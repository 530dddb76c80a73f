"""The model's forward pass one public cpufuse op at a time, driven from Python (the forward
cpufuse/llama/model.py ran before the decoder graph): the reference the decoder graph must match
bit for bit (tests/test_llama_model.py). It reads the model's weights, hyperparameters, `_embed`
and `_rope_kw`, and writes only the arrays it is given.
"""
import numpy as np

from cpufuse import flash_attn, matmul, matmul_multi, matmul_swiglu, rms_norm, rope


def buffers(m, n):
    """work arrays for micro-batches of up to n tokens (reused across calls of `forward`)"""
    hp = m.hparams
    E, H, Hkv, D = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim
    shapes = dict(x=E, q=H * D, k=Hkv * D, v=Hkv * D, attn=H * D, o=E, g=hp.n_ff, logits=m.n_logits)
    return {k: np.empty((n, w), np.float32) for k, w in shapes.items()}


def forward(m, tokens, pos0, kc_all, vc_all, all_logits=False, bufs=None):
    """tokens at positions pos0.. of one sequence whose KV cells are rows 0.. of kc_all[l]/vc_all[l]
    ((n_ctx, Hkv, D) per layer, written here); returns the last token's logits (1, V) or all (n, V).
    bufs: buffers(m, >= n) to work in (the logits returned are then a view of it)."""
    hp = m.hparams
    n, T = len(tokens), pos0 + len(tokens)
    H, Hkv, D = hp.n_head, hp.n_head_kv, hp.head_dim
    eps, act, isa, nt = hp.eps, m.act, m.isa, m.n_threads
    b = {k: a[:n] for k, a in (bufs or buffers(m, n)).items()}
    x, q, k, v, o, g = b["x"], b["q"], b["k"], b["v"], b["o"], b["g"]
    m.embed(tokens, x)
    q3, k3, v3 = q.reshape(n, H, D), k.reshape(n, Hkv, D), v.reshape(n, Hkv, D)
    attn = b["attn"].reshape(1, n, H, D)
    pos = np.arange(pos0, T, dtype=np.int32)
    mask = None
    if n > 1:
        mask = np.zeros((n, T), np.float16)
        mask[:, pos0:T] = np.triu(np.full((n, n), -np.inf, np.float16), 1)
        mask = mask[None, None]
    rope_kw = m.rope_kw
    for li, L in enumerate(m.layers):
        matmul_multi(x, (L.wq, L.wk, L.wv), out=(q, k, v), norm_weight=L.attn_norm, eps=eps, act=act,
                     isa=isa, n_threads=nt)
        for a, bias in ((q, L.bq), (k, L.bk), (v, L.bv)):
            if bias is not None:
                a += bias
        if L.q_norm is not None:
            q.reshape(-1, D)[...] = rms_norm(q.reshape(-1, D), L.q_norm, eps=eps, isa=isa, n_threads=nt)
            k.reshape(-1, D)[...] = rms_norm(k.reshape(-1, D), L.k_norm, eps=eps, isa=isa, n_threads=nt)
        kc, vc = kc_all[li], vc_all[li]
        rope(q3, pos, out=q3, **rope_kw)
        rope(k3, pos, cache=(kc, pos0), **rope_kw)
        vc[pos0:T] = v3
        flash_attn(q3.transpose(1, 0, 2)[None], kc[:T].transpose(1, 0, 2)[None],
                   vc[:T].transpose(1, 0, 2)[None], mask, scale=hp.kq_scale, out=attn, isa=isa, n_threads=nt)
        matmul(attn.reshape(n, H * D), L.wo, out=o, act=act, isa=isa, n_threads=nt)
        if L.bo is not None:
            o += L.bo
        x += o
        matmul_swiglu(x, L.wg, L.wu, out=g, norm_weight=L.ffn_norm, eps=eps, act=act, isa=isa, n_threads=nt)
        matmul(g, L.wd, out=o, act=act, isa=isa, n_threads=nt)
        if L.bd is not None:
            o += L.bd
        x += o
    rows = x if all_logits else x[n - 1:n]
    out = b["logits"][:len(rows)]
    matmul(rows, m.output, out=out, norm_weight=m.output_norm, eps=eps, act=act, isa=isa, n_threads=nt)
    if m.output_bias is not None:
        out += m.output_bias
    return out
